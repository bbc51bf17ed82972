"""Figure of the core issue: MeanField on digits, MLP 64-100-10, 100 epochs.

Prints test accuracy, NLL, ECE (15 bins) and Brier per seed and their medians.

    python benchmarks/digits_meanfield.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pyro_bnn as pb


def run(seed: int, epochs: int, init_scale: float, lr: float, batch_size: int, num_samples: int):
    torch.manual_seed(seed)
    split = pb.datasets.digits()
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
    model = pb.BNN(net, likelihood="categorical", prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.MeanField(model, init_scale=init_scale)
    t0 = time.perf_counter()
    pb.fit(model, guide, split.train, epochs=epochs, batch_size=batch_size, lr=lr, progress=False, seed=seed)
    seconds = time.perf_counter() - t0
    scores = pb.evaluate(model, guide, *split.test, num_samples=num_samples)
    return {**scores, "train_seconds": seconds}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--init-scale", type=float, default=1e-3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-samples", type=int, default=64)
    args = ap.parse_args(argv)
    rows = []
    for seed in args.seeds:
        r = run(seed, args.epochs, args.init_scale, args.lr, args.batch_size, args.num_samples)
        rows.append(r)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()), flush=True)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.4f}" for k in rows[0]))


if __name__ == "__main__":
    main()
