"""Cost of one invariance-learning hyperparameter step (LILA) vs a plain KFAC fit; memory vs N.

1. Time: median wall time of one evidence step on η (KFAC refit with S copies + batched
   trace/likelihood backprop, :func:`pyro_bnn.invariance.evidence_step`) against a plain
   KFAC fit of the non-invariant model over the same data (the Laplace guide's
   ``fit_curvature``), in the same process.  The ratio is compared with S.
2. Memory: peak RSS of one evidence step for growing N, in a fresh subprocess each, with
   minibatches (bounded: should stay flat) and with one whole-data batch (grows with N).

    python benchmarks/bench_invariance.py --quick
    python benchmarks/bench_invariance.py --samples 8 16 31 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.invariance import AffineAugmentation, evidence_step


def _model(samples, hidden, d_in=64):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    aug = None if samples == 0 else AffineAugmentation(num_samples=samples, init_extent=0.3)
    return pb.BNN(net, "categorical", augmentation=aug)


def _data(n, d_in=64):
    d = pb.datasets.digits(test_fraction=0.2)
    reps = -(-n // len(d.x_train))
    return d.x_train.repeat(reps, 1)[:n, :d_in], d.y_train.repeat(reps)[:n]


def _batches(x, y, bs):
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]


def time_step(samples, n, hidden, batch_size, repeats):
    """Median seconds of one η evidence step and of a plain KFAC fit."""
    x, y = _data(n)
    inv, plain = _model(samples, hidden), _model(0, hidden)
    values = inv.initial_values()
    log_delta = torch.zeros(2)
    opt = torch.optim.Adam([inv.augmentation.eta], lr=0.01)
    guide = pb.guides.Laplace(plain, structure="kron", curvature_batch_size=batch_size)
    t_hyper, t_plain = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        guide.fit_curvature((x, y))
        t_plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        evidence_step(inv, values, _batches(x, y, batch_size), log_delta, eta_optimizer=opt, seed=r)
        t_hyper.append(time.perf_counter() - t0)
    return statistics.median(t_hyper), statistics.median(t_plain)


def _peak_child(n, samples, hidden, batch_size):
    """Run in a subprocess: peak RSS (MB) added by one evidence step on N examples."""
    x, y = _data(n)
    inv = _model(samples, hidden)
    opt = torch.optim.Adam([inv.augmentation.eta], lr=0.01)
    # warm-up on a few examples so lazy initialisation is not counted
    evidence_step(inv, inv.initial_values(), _batches(x[:32], y[:32], 32), torch.zeros(2),
                  eta_optimizer=opt)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    evidence_step(inv, inv.initial_values(), _batches(x, y, batch_size), torch.zeros(2),
                  eta_optimizer=opt)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"n": n, "base_mb": base, "peak_mb": peak, "added_mb": peak - base}))


def peak_memory(n, samples, hidden, batch_size):
    out = subprocess.run([sys.executable, __file__, "--child", str(n), str(samples), str(hidden),
                          str(batch_size)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, nargs="+", default=[8, 16, 31])
    p.add_argument("--n", type=int, default=1348)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-n", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    p.add_argument("--memory-samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        _peak_child(*args.child)
        return
    if args.quick:
        args.samples, args.n, args.hidden, args.repeats = [4], 300, 32, 1
        args.memory_n = [200, 400]
    print(f"one η evidence step vs a plain KFAC fit: N={args.n}, MLP 64-{args.hidden}-10, "
          f"batch {args.batch_size}, median of {args.repeats}")
    print(f"{'S':>4} {'hyper step s':>13} {'plain KFAC s':>13} {'ratio':>7} {'ratio/S':>8}")
    for s in [] if args.memory_only else args.samples:
        th, tp = time_step(s, args.n, args.hidden, args.batch_size, args.repeats)
        print(f"{s:>4} {th:13.3f} {tp:13.3f} {th / tp:7.1f} {th / tp / s:8.2f}", flush=True)
    s = args.memory_samples
    print(f"\npeak RSS added by one evidence step (S={s}), minibatches of {args.batch_size} "
          f"vs one whole-data batch")
    print(f"{'N':>6} {'minibatch MB':>13} {'whole-data MB':>14}")
    for n in args.memory_n:
        mb = peak_memory(n, s, args.hidden, args.batch_size)
        full = peak_memory(n, s, args.hidden, n)
        print(f"{n:>6} {mb['added_mb']:13.1f} {full['added_mb']:14.1f}", flush=True)


if __name__ == "__main__":
    main()
