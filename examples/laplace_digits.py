"""Laplace on digits: MAP by SVI, KFAC curvature, prior precision by the evidence or a
validation grid search, GLM predictive.

    .venv/bin/python examples/laplace_digits.py                          # last layer, δ by evidence
    .venv/bin/python examples/laplace_digits.py --tune gridsearch        # δ by validation NLL
    .venv/bin/python examples/laplace_digits.py --subset all --prior-structure layerwise
    .venv/bin/python examples/laplace_digits.py --subset all --marglik   # online (Immer 2021)

The defaults are the best-practice configuration (``pb.compare``'s ``"laplace"``): last-layer
KFAC, δ by the evidence, the Monte-Carlo GLM predictive (the guide's default; the probit
approximation and sampled weights are printed beside it); the MAP is trained with a cosine
schedule (300 epochs at lr 1e-2 reach a flat training loss on digits, ``docs/results/laplace.md``).
For ``--tune gridsearch`` a validation split is taken from the training digits and the
MAP is trained on the rest.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pyro_bnn as pb


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--structure", choices=["kron", "diag", "full"], default="kron")
    p.add_argument("--subset", choices=["all", "last_layer"], default="last_layer",
                   help="Laplace over the last layer (default) or all layers (the rest a point estimate)")
    p.add_argument("--prior-structure", choices=["scalar", "layerwise", "sitewise"], default="scalar")
    p.add_argument("--tune", choices=["marglik", "gridsearch"], default="marglik",
                   help="post-hoc δ: evidence maximisation or validation grid search")
    p.add_argument("--marglik", action="store_true", help="learn δ online during training (then no post-hoc step)")
    p.add_argument("--hidden", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    data = pb.datasets.digits()
    x_tr, y_tr = data.train
    val = None
    if args.tune == "gridsearch":          # validation digits taken from the training set
        perm = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(args.seed))
        val = (x_tr[perm[:200]], y_tr[perm[:200]])
        x_tr, y_tr = x_tr[perm[200:]], y_tr[perm[200:]]
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model = pb.BNN(net, "categorical")
    guide = pb.guides.Laplace(model, structure=args.structure, subset=args.subset,
                              prior_structure=args.prior_structure,
                              kron_bias="separate" if args.prior_structure == "sitewise" else "joint")
    marglik = pb.MarglikOptions(every=5, burnin=10, steps=100, lr=0.1) if args.marglik else None
    result = pb.fit(model, guide, (x_tr, y_tr), epochs=args.epochs, lr=args.lr, lr_schedule="cosine",
                    seed=args.seed, marglik=marglik, progress=False)
    loss = result.history["loss"]
    print(f"MAP phase: {result.seconds:.1f}s; training loss at 75/90/100 % of the epochs: "
          f"{loss[int(0.75 * len(loss)) - 1]:.1f} / {loss[int(0.9 * len(loss)) - 1]:.1f} / {loss[-1]:.1f}")
    if not args.marglik:
        if args.tune == "marglik":
            value = guide.optimize_prior_precision(steps=300)
            print(f"δ by the evidence: {guide.prior_precision.tolist()} (log evidence {value:.1f})")
        else:
            value = guide.optimize_prior_precision(method="gridsearch", val=val, link_approx="probit")
            print(f"δ by validation grid search: {guide.prior_precision.tolist()} (validation NLL {value:.4f})")

    with torch.no_grad():
        map_probs = torch.softmax(model.run_with(guide.median(), data.x_test), -1)[None]
    rows = {"MAP": pb.metrics.classification_metrics(map_probs, data.y_test, num_bins=15),
            "GLM, MC (64)": pb.evaluate(model, guide, data.x_test, data.y_test, predictive="glm", num_samples=64),
            "GLM (probit)": pb.evaluate(model, guide, data.x_test, data.y_test, predictive="glm_probit"),
            "weights (64)": pb.evaluate(model, guide, data.x_test, data.y_test, predictive="sample",
                                        num_samples=64)}
    for name, m in rows.items():
        print(f"{name:<16} acc {m['accuracy']:.4f}  nll {m['nll']:.4f}  ece {m['ece']:.4f}")


if __name__ == "__main__":
    main()
