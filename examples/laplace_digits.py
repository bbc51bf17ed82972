"""Laplace on digits: MAP by SVI, KFAC curvature, evidence-optimised prior, GLM predictive.

    .venv/bin/python examples/laplace_digits.py --epochs 60            # post-hoc δ
    .venv/bin/python examples/laplace_digits.py --epochs 60 --marglik  # online (Immer 2021)
    .venv/bin/python examples/laplace_digits.py --subset last_layer    # last-layer Laplace
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.meanfield import _run_with_values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--structure", choices=["kron", "diag", "full"], default="kron")
    p.add_argument("--hidden", type=int, default=100)
    p.add_argument("--marglik", action="store_true", help="learn δ online during training")
    p.add_argument("--subset", choices=["all", "last_layer"], default="all",
                   help="Laplace over all layers or the last one only (the rest a point estimate)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    data = pb.datasets.digits()
    net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model = pb.BNN(net, "categorical")
    guide = pb.guides.Laplace(model, structure=args.structure, subset=args.subset)
    marglik = dict(every=1, burnin=10, steps=100, lr=0.1) if args.marglik else None
    result = pb.fit(model, guide, data.train, epochs=args.epochs, lr=1e-3, seed=args.seed,
                    marglik=marglik)
    print(f"MAP phase done in {result.seconds:.1f}s; log evidence at δ={float(guide.prior_precision):.3g}: "
          f"{float(guide.log_evidence()):.1f}")
    if not args.marglik:
        ev = guide.optimize_prior_precision()
        print(f"evidence-optimised δ = {float(guide.prior_precision):.3g}, log evidence {ev:.1f}")

    with torch.no_grad():
        map_probs = torch.softmax(_run_with_values(model, guide.median(), data.x_test), -1)[None]
    rows = {"MAP": pb.metrics.classification_metrics(map_probs, data.y_test, 15),
            "GLM (probit)": pb.evaluate(model, guide, data.x_test, data.y_test, method="glm"),
            "MC weights (64)": pb.evaluate(model, guide, data.x_test, data.y_test, num_samples=64)}
    for name, m in rows.items():
        print(f"{name:<16} acc {m['accuracy']:.4f}  nll {m['nll']:.4f}  ece {m['ece']:.4f}")


if __name__ == "__main__":
    main()
