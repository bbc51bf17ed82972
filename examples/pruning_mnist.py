"""Prune a mean-field BNN on MNIST by signal-to-noise and by zero-probability (Blundell §5.1).

MNIST 5k/5k split (first 5,000 test digits train, next 5,000 test), 784-400-400-10 ReLU MLP,
MeanField guide, N(0, 1) prior.  Prints and plots test accuracy vs fraction of weights
removed for each score, plus the σ statistics that explain the zero-probability rule.

    .venv/bin/python examples/pruning_mnist.py --epochs 100 --out docs/results/figures
    .venv/bin/python examples/pruning_mnist.py --quick          # 1k/1k, 5 epochs, smoke run
    .venv/bin/python examples/pruning_mnist.py --dataset digits --hidden 100 --epochs 300 --lr 1e-2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import pyro
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn import pruning
from pyro_bnn.uncertainty_plots import plot_pruning_curves


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--dataset", choices=["mnist", "digits"], default="mnist",
                   help="digits: sklearn's 8×8 digits (1,348/449), a fast CPU stand-in")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--hidden", type=int, default=400)
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-test", type=int, default=5000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--init-scale", type=float, default=1e-2)
    p.add_argument("--num-samples", type=int, default=16, help="predictive draws per fraction")
    p.add_argument("--fractions", default="0,0.5,0.75,0.9,0.95,0.98")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1k/1k digits, 5 epochs")
    p.add_argument("--out", default="docs/results/figures")
    p.add_argument("--save-state", default=None, help="save model/guide state here")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.num_train, args.num_test = 5, 1000, 1000
    if args.threads:
        torch.set_num_threads(args.threads)
    fractions = [float(f) for f in args.fractions.split(",")]

    if args.dataset == "digits":
        data = pb.datasets.digits()
        args.num_train, args.num_test = len(data.x_train), len(data.x_test)
    else:
        data = pb.datasets.mnist_split(args.data_dir, args.num_train, args.num_test)
    d_in = data.x_train.shape[1]
    pyro.set_rng_seed(args.seed)
    net = nn.Sequential(nn.Linear(d_in, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                        nn.ReLU(), nn.Linear(args.hidden, 10))
    model = pb.BNN(net, "categorical")
    guide = pb.guides.MeanField(model, init_scale=args.init_scale)
    t0 = time.perf_counter()
    fit = pb.fit(model, guide, data.train, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                 seed=args.seed, progress=False)
    train_s = time.perf_counter() - t0
    if args.save_state:
        torch.save({"model": model.state_dict(), "guide": guide.state_dict()}, args.save_state)

    # σ statistics behind the zero-probability rule
    scales = torch.cat([guide.loc_and_scale(s)[1].detach().reshape(-1) for s in model.site_names])
    snr = torch.cat([v.reshape(-1) for v in pruning.scores(guide, "snr", model).values()])
    zp = torch.cat([v.reshape(-1) for v in pruning.scores(guide, "zero_prob", model).values()])
    stats = {
        "sigma_quantiles_1_50_99": [float(q) for q in torch.quantile(scales[:1_000_000],
                                                                      torch.tensor([0.01, 0.5, 0.99]))],
        "fraction_sigma_above_0.5": float((scales > 0.5).double().mean()),
        "log_sigma_range": float(scales.log().max() - scales.log().min()),
        "spearman_snr_vs_zero_prob": rank_correlation(snr, zp),
    }

    curves, t1 = {}, time.perf_counter()
    for kind in ("snr", "zero_prob", "magnitude"):
        curves[kind] = pruning.pruning_curve(model, guide, data.x_test, data.y_test, fractions, kind=kind,
                                             num_samples=args.num_samples, seed=args.seed)
        curves[kind + " (mean net)"] = pruning.pruning_curve(model, guide, data.x_test, data.y_test,
                                                             fractions, kind=kind, predictive="mean")
    eval_s = time.perf_counter() - t1
    summary = {"args": vars(args), "train_seconds": train_s, "eval_seconds": eval_s,
               "final_loss": fit.final_loss, "sigma_stats": stats, "curves": curves}
    print(json.dumps({k: v for k, v in summary.items() if k != "curves"}, indent=1))
    print(f"{'score':24s} " + " ".join(f"{100 * f:6.1f}%" for f in fractions))
    for label, c in curves.items():
        print(f"{label:24s} " + " ".join(f"{100 * a:6.2f} " for a in c["accuracy"]))
    os.makedirs(args.out, exist_ok=True)
    tag = ("quick" if args.quick else f"e{args.epochs}") + ("_digits" if args.dataset == "digits" else "")
    with open(os.path.join(args.out, f"pruning_mnist_{tag}.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    plot_pruning_curves({k: curves[k] for k in ("snr", "zero_prob", "magnitude")},
                        path=os.path.join(args.out, f"pruning_mnist_{tag}.png"),
                        title=f"MeanField {args.dataset} ({args.num_train} train), {args.epochs} epochs: pruning",
                        baseline=curves["snr"]["accuracy"][0])
    if not math.isfinite(fit.final_loss):
        raise SystemExit("training diverged")


if __name__ == "__main__":
    main()
