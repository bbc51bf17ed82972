"""Figure of the core issue: MeanField on digits, MLP 64-100-10, trained to convergence.

Prints the training ELBO at the end (mean of the last 10 % of epochs), ``pb.fit``'s
convergence diagnosis, and test accuracy, NLL, ECE (15 bins) and Brier per seed, and their
medians.  Defaults: N(0, 1) prior, MeanField's own ``init_scale`` and ``default_lr``
(``--init-scale`` / ``--lr`` override), cosine learning-rate decay, 300 epochs.

    python benchmarks/digits_meanfield.py --seeds 0 1 2
    python benchmarks/digits_meanfield.py --seeds 0 --epochs 600      # twice as long: same ELBO?
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
from torch import nn

import pyro_bnn as pb


def run(seed: int, epochs: int, init_scale: float | None, lr: float | None, lr_schedule: str,
        batch_size: int, num_samples: int) -> dict:
    torch.manual_seed(seed)
    split = pb.datasets.digits()
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
    model = pb.BNN(net, likelihood="categorical", prior=pb.priors.IIDNormal(1.0))
    options = {} if init_scale is None else {"init_scale": init_scale}
    guide = pb.guides.MeanField(model, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)   # reported in the row instead
        fit = pb.fit(model, guide, split.train, epochs=epochs, batch_size=batch_size, lr=lr,
                     lr_schedule=lr_schedule, progress=False, seed=seed)
    elbo = fit.history["elbo"]
    window = max(len(elbo) // 10, 1)
    scores = pb.evaluate(model, guide, *split.test, num_samples=num_samples)
    return {"elbo_end": sum(elbo[-window:]) / window, "converged": float(fit.convergence.converged),
            **scores, "train_seconds": fit.seconds}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--init-scale", type=float, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for seed in args.seeds:
        r = run(seed, args.epochs, args.init_scale, args.lr, args.lr_schedule, args.batch_size, args.num_samples)
        rows.append(r)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()), flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.4f}" for k in rows[0]))


if __name__ == "__main__":
    main()
