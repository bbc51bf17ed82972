"""Why ``pb.fit`` flushes denormal floats on the CPU: one Adam step of a 784-400 layer whose
weights sit in the denormal range (weights of always-blank MNIST pixels that only the prior
pulls on decay there in long fits), against the same step with normal-range weights, with and
without ``pyro_bnn.training.devices.flush_denormals``.  Interleaved repeats in one process, medians.

    python benchmarks/bench_denormal.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyro_bnn.training.devices import flush_denormals


def step_seconds(scale: float, flush: bool, steps: int) -> float:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(400, 784) * scale)
    x = torch.rand(128, 784)
    opt = torch.optim.Adam([w], lr=1e-3)
    t = time.perf_counter()
    with flush_denormals() if flush else _null():
        for _ in range(steps):
            loss = (x @ w.t()).square().mean() * 1e-30 + 0.5 * w.square().sum()   # prior pull only
            opt.zero_grad()
            loss.backward()
            opt.step()
    return (time.perf_counter() - t) / steps


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = {"normal weights (1e-2)": (1e-2, False), "denormal weights (1e-40)": (1e-40, False),
             "denormal weights, flushed": (1e-40, True)}
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, (scale, flush) in cases.items():
            times[name].append(step_seconds(scale, flush, args.steps))
    base = statistics.median(times["normal weights (1e-2)"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:28s} {1e3 * m:8.2f} ms/step   ratio {m / base:5.2f}")


if __name__ == "__main__":
    main()
