"""Wall time of ``pb.compare`` with one process against ``workers=N``, side by side.

Every registered guide on the digits data (1,348 / 449 8×8 images, MLP 64-100-10, the main
job's network), ``--epochs`` each, ``--loo-samples`` DataTree draws, one torch thread per
process (``--threads``).  Each repeat runs the comparison once in one process and once with
``--workers`` processes, in alternating order (so drift in the machine's speed falls on both);
every pair is checked to give the same table (every column but the timings, exactly) before its
times count.  Printed: each run's wall seconds, the medians, their ratio (one process ÷ workers),
and per guide the median training seconds both ways (how much a fit slows beside another).

    python benchmarks/bench_compare_workers.py --epochs 40 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import pandas as pd
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides import registered_guides

TIMING = ["train_seconds", "predict_seconds"]


def _model():
    return pb.BNN(nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)), "categorical")


def _run(split, workers: int, args) -> tuple[float, pd.DataFrame]:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the convergence diagnosis of short fits
        table = pb.compare(_model, list(registered_guides()), split, epochs=args.epochs,
                           loo_samples=args.loo_samples, num_samples=args.num_samples,
                           progress=False, workers=workers)
    return time.perf_counter() - t0, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--loo-samples", type=int, default=30)
    p.add_argument("--num-samples", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    split = pb.datasets.digits()
    walls: dict[int, list[float]] = {1: [], args.workers: []}
    train: dict[int, list[pd.Series]] = {1: [], args.workers: []}
    for r in range(args.repeats):
        order = (1, args.workers) if r % 2 == 0 else (args.workers, 1)
        tables = {}
        for w in order:
            wall, tables[w] = _run(split, w, args)
            walls[w].append(wall)
            train[w].append(tables[w]["train_seconds"])
            print(json.dumps({"repeat": r, "workers": w, "wall_s": round(wall, 2)}), flush=True)
        pd.testing.assert_frame_equal(tables[1].drop(columns=TIMING),
                                      tables[args.workers].drop(columns=TIMING), check_exact=True)
    one, many = statistics.median(walls[1]), statistics.median(walls[args.workers])
    print(f"median wall: one process {one:.1f} s, workers={args.workers} {many:.1f} s, "
          f"ratio {one / many:.2f} (tables identical in all {args.repeats} pairs)")
    med1 = pd.concat(train[1], axis=1).median(axis=1)
    medw = pd.concat(train[args.workers], axis=1).median(axis=1)
    print("median training seconds per guide (one process / workers, ratio):")
    for name in med1.index:
        print(f"  {name}: {med1[name]:.1f} / {medw[name]:.1f} ({medw[name] / med1[name]:.2f})")


if __name__ == "__main__":
    main()
