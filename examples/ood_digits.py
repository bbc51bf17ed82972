"""OOD detection on digits (BHN paper's offline experiment): train on classes 0–4, treat 5–9 as OOD.

For each guide: AUROC/AUPR of max-probability, entropy, mutual information, variation ratio
and std scores; also uniform-noise and 90°-rotated inputs as OOD sets.  The MAP network
(AutoDelta) is the max-probability baseline.

    .venv/bin/python examples/ood_digits.py --epochs 100 --out docs/results/figures
    .venv/bin/python examples/ood_digits.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pyro
import torch
from pyro.infer.autoguide import AutoDelta
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides import init_to_network, registered_guides
from pyro_bnn.uncertainty_plots import plot_ood_scores


def make_guide(name, model):
    if name == "MAP":
        return AutoDelta(model, init_loc_fn=init_to_network(model))
    return registered_guides()[name](model)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guides", default="MAP,meanfield,hypernet,laplace,symmetrized")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--hidden", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="5 epochs, 16 samples")
    p.add_argument("--out", default="docs/results/figures")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.num_samples = 5, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    d = pb.datasets.digits()
    tr, te_in, te_out = d.y_train < 5, d.y_test < 5, d.y_test >= 5
    x_in, x_out = d.x_test[te_in], d.x_test[te_out]
    ood_sets = {"digits 5-9": x_out,
                "uniform noise": torch.rand(len(x_in), 64, generator=torch.Generator().manual_seed(0)),
                "rotated 90": pb.corruption.rotate(x_in, 90)}
    results, table = {}, {}
    for name in args.guides.split(","):
        if name != "MAP" and name not in registered_guides():
            print(f"skip {name}: not registered")
            continue
        pyro.set_rng_seed(args.seed)
        net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 5))
        model = pb.BNN(net, "categorical", weight_norm=(name == "hypernet"))
        guide = make_guide(name, model)
        t0 = time.perf_counter()
        pb.fit(model, guide, (d.x_train[tr], d.y_train[tr]), epochs=args.epochs, batch_size=64,
               lr=args.lr, seed=args.seed, progress=False)
        secs = time.perf_counter() - t0
        # Laplace: the linearised (GLM) predictive, its recommended one
        kw = {"method": "glm"} if name == "laplace" else {}
        acc = pb.evaluate(model, guide, x_in, d.y_test[te_in], num_samples=args.num_samples, **kw)["accuracy"]
        table[name] = {"accuracy_0_4": acc, "train_seconds": secs}
        for ood_name, xo in ood_sets.items():
            res = pb.ood.evaluate(model, guide, x_in, xo, num_samples=args.num_samples, seed=args.seed, **kw)
            table[name][ood_name] = {s: {k: round(v, 4) for k, v in r.items()} for s, r in res.items()}
            if ood_name == "digits 5-9":
                results[name] = res
        line = " ".join(f"{s}={table[name]['digits 5-9'][s]['auroc']:.3f}" for s in pb.ood.SCORES)
        print(f"{name:12s} acc(0-4)={acc:.3f} train {secs:.0f}s  AUROC(5-9): {line}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = "quick" if args.quick else f"e{args.epochs}"
    with open(os.path.join(args.out, f"ood_digits_{tag}.json"), "w") as fh:
        json.dump({"args": vars(args), "results": table}, fh, indent=1)
    plot_ood_scores(results, path=os.path.join(args.out, f"ood_digits_{tag}.png"),
                    title="Digits: train 0–4, OOD 5–9 (AUROC)")
    if "MAP" in table:
        base = table["MAP"]["digits 5-9"]["max_prob"]["auroc"]
        for name in table:
            if name != "MAP":
                mi = table[name]["digits 5-9"]["mutual_information"]["auroc"]
                print(f"{name}: MI AUROC {mi:.3f} vs MAP max-prob AUROC {base:.3f} -> "
                      f"{'higher' if mi > base else 'NOT higher'}")


if __name__ == "__main__":
    main()
