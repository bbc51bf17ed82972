"""A Hypernet training step phase by phase, library against its plain-PyTorch reference (issue 27).

The Fashion-MNIST MLP of ``benchmarks/bench_fmnist_speed.py`` (784-200-200-10, weight norm,
``Hypernet`` with 0 or 8 IAF blocks), one minibatch of 128 random images with the full-data
scaling (N = 60,000).  The reference (``benchmarks/bench_reference.py``: the same algorithm as one
plain PyTorch function) and the library's objective (``guide.make_objective(1)`` in the module-local
parameter mode that ``pb.fit`` uses, with the library's optimiser) are stepped alternately in one
process; each phase is timed apart:

* ``forward``: the loss (sampling, log q, the network, the prior);
* ``backward``: ``zero_grad`` + ``loss.backward()``;
* ``adam``: the optimiser step (fused Adam for both).

Medians over ``--steps`` steps after ``--warmup``; one torch thread by default.  Wall-clock
per phase (``time.perf_counter``): run it on a quiet machine.  ``--cprofile N`` adds a cProfile
of N library forward passes (sorted by own time), to see which operations the excess is made of.

    python benchmarks/profile_hypernet_step.py --guide hypernet8
    python benchmarks/profile_hypernet_step.py --guide hypernet0 --steps 500 --cprofile 200
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time

import torch
from bench_fmnist_speed import NUM_TRAIN, build
from bench_reference import hypernet_reference_leaves, hypernet_reference_loss, hypernet_reference_params

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.training.guide_setup import setup_guide
from pyro_bnn.training.optimizer import default_optimizer

PHASES = ("forward", "backward", "adam")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guide", default="hypernet8", choices=["hypernet0", "hypernet8"])
    p.add_argument("--steps", type=int, default=250, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile N library forward passes (0: no profile)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _step(loss_fn, optimizer, times):
    t0 = time.perf_counter()
    loss = loss_fn()
    t1 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
        times[phase].append(seconds * 1e3)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = torch.randn(128, 784, generator=gen), torch.randint(0, 10, (128,), generator=gen)
    model, guide, _ = build(args.guide, "mlp", seed=args.seed)
    setup_guide(model, guide, x[:2], y[:2], NUM_TRAIN)
    ref = hypernet_reference_params(model, guide)
    ref_opt = torch.optim.Adam(hypernet_reference_leaves(ref), lr=1e-3, fused=True)
    model, guide = copy.deepcopy(model), copy.deepcopy(guide)
    with local_params(model, guide):
        params = list(model.parameters()) + list(guide.parameters())
    lib_opt = default_optimizer(params, 1e-3, pb.guides.guide_contract(guide).learning_rate_factors())
    objective = guide.make_objective(1)

    def lib_loss():
        out = objective(model, guide, x, y, NUM_TRAIN)
        return out[0] if isinstance(out, tuple) else out

    times = {"reference": {k: [] for k in PHASES}, "library": {k: [] for k in PHASES}}
    with local_params(model, guide):
        for i in range(args.warmup + args.steps):
            ref_times = times["reference"] if i >= args.warmup else {k: [] for k in PHASES}
            lib_times = times["library"] if i >= args.warmup else {k: [] for k in PHASES}
            _step(lambda: hypernet_reference_loss(ref, x, y, NUM_TRAIN), ref_opt, ref_times)
            _step(lib_loss, lib_opt, lib_times)
        print(f"{args.guide}, Fashion-MNIST MLP, batch 128, {args.threads} thread(s), medians of "
              f"{args.steps} alternating steps, ms")
        print(f"  {'phase':<10}{'reference':>11}{'library':>11}{'excess':>9}{'ratio':>8}")
        totals = {}
        for phase in PHASES + ("step",):
            if phase == "step":
                r, lib = totals["reference"], totals["library"]
            else:
                r = statistics.median(times["reference"][phase])
                lib = statistics.median(times["library"][phase])
                totals["reference"] = totals.get("reference", 0.0) + r
                totals["library"] = totals.get("library", 0.0) + lib
            print(f"  {phase:<10}{r:>11.3f}{lib:>11.3f}{lib - r:>+9.3f}{lib / r:>8.2f}")
        if args.cprofile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.cprofile):
                lib_loss()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
