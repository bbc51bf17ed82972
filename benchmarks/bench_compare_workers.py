"""Wall time of ``pb.compare`` with one process against ``workers=N``, side by side.

Every registered guide on the digits data (1,348 / 449 8×8 images, MLP 64-100-10, the main
job's network), ``--epochs`` each, ``--loo-samples`` DataTree draws, one torch thread per
process (``--threads``).  Each repeat runs the comparison once in one process and once with
``--workers`` processes, in alternating order (so drift in the machine's speed falls on both);
every pair is checked to give the same table (every column but the timings, exactly) before its
times count.  Printed: each run's wall seconds, the medians, their ratio (one process ÷ workers),
and per guide the median training seconds both ways (how much a fit slows beside another).
``--bars`` times ``--workers`` processes with their progress bars (drawn on stderr) against the
same without bars instead: what the bars cost.

    python benchmarks/bench_compare_workers.py --epochs 40 --repeats 3
    python benchmarks/bench_compare_workers.py --epochs 40 --repeats 3 --bars 2>/dev/null
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


def _run(split, workers: int, bars: bool, args) -> tuple[float, pd.DataFrame]:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the convergence diagnosis of short fits
        table = pb.compare(_model, list(registered_guides()), split, epochs=args.epochs,
                           loo_samples=args.loo_samples, num_samples=args.num_samples,
                           progress=bars, workers=workers)
    return time.perf_counter() - t0, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--loo-samples", type=int, default=30)
    p.add_argument("--num-samples", type=int, default=100)
    p.add_argument("--bars", action="store_true",
                   help="time --workers with progress bars against --workers without them")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    split = pb.datasets.digits()
    n = args.workers
    # (label, workers, bars): the baseline first
    runs = ([(f"workers={n} without bars", n, False), (f"workers={n} with bars", n, True)] if args.bars
            else [("one process", 1, False), (f"workers={n}", n, False)])
    walls: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    train: dict[str, list[pd.Series]] = {label: [] for label, _, _ in runs}
    for r in range(args.repeats):
        tables = {}
        for label, workers, bars in (runs if r % 2 == 0 else runs[::-1]):
            wall, tables[label] = _run(split, workers, bars, args)
            walls[label].append(wall)
            train[label].append(tables[label]["train_seconds"])
            print(json.dumps({"repeat": r, "run": label, "wall_s": round(wall, 2)}), flush=True)
        first, second = (tables[label].drop(columns=TIMING) for label, _, _ in runs)
        pd.testing.assert_frame_equal(first, second, check_exact=True)
    (base, _, _), (other, _, _) = runs
    m0, m1 = statistics.median(walls[base]), statistics.median(walls[other])
    print(f"median wall: {base} {m0:.1f} s, {other} {m1:.1f} s, "
          f"ratio {m0 / m1:.2f} (tables identical in all {args.repeats} pairs)")
    med0 = pd.concat(train[base], axis=1).median(axis=1)
    med1 = pd.concat(train[other], axis=1).median(axis=1)
    print(f"median training seconds per guide ({base} / {other}, ratio):")
    for name in med0.index:
        print(f"  {name}: {med0[name]:.1f} / {med1[name]:.1f} ({med1[name] / med0[name]:.2f})")


if __name__ == "__main__":
    main()
