"""Cost of one invariance-learning hyperparameter step (LILA) vs a plain KFAC fit; memory vs N.

1. Time: median wall time of one evidence step on η (KFAC refit with S copies + batched
   trace/likelihood backprop, :func:`pyro_bnn.invariance.evidence_step`) against a plain
   KFAC fit of the non-invariant model over the same data (the Laplace guide's
   ``fit_curvature``), in the same process.  The ratio is compared with S.
2. Memory: peak RSS of one evidence step for growing N, in a fresh subprocess each, with
   minibatches (bounded: should stay flat) and with one whole-data batch (grows with N).
3. ``--baseline DIR``: the same η evidence step of an older ``pyro_bnn/invariance``
   (e.g. a ``git archive`` of the commit before the curvature-stack rewrite under
   ``runs/``), loaded as a separate package and timed alternately with the current one in
   this process (same model, data, seeds); and the Laplace guide's evidence step in
   ``fit(..., marglik=)`` (curvature pass + η step): the current one reuses the guide's
   factors, the baseline's ``guide_eta_step`` recomputed them.  Medians and ratios.

    python benchmarks/bench_invariance.py --quick
    python benchmarks/bench_invariance.py --samples 8 16 31 --repeats 3
    git archive <old-commit> pyro_bnn | tar -x -C runs/inv_before
    python benchmarks/bench_invariance.py --baseline runs/inv_before/pyro_bnn/invariance --samples 8 16 --repeats 5 --memory-n
    python benchmarks/bench_invariance.py --baseline runs/inv_before/pyro_bnn/invariance --samples --memory-n --trajectory 30
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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


def load_baseline(directory):
    """An older ``pyro_bnn/invariance`` folder as the package ``pyro_bnn._invariance_baseline``
    (its ``..`` imports resolve to the current ``pyro_bnn``)."""
    name = "pyro_bnn._invariance_baseline"
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, "__init__.py"),
                                                  submodule_search_locations=[directory])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _median_pair(run_a, run_b, repeats):
    """Alternate ``run_a()`` and ``run_b()`` ``repeats`` times; median seconds of each."""
    ta, tb = [], []
    for r in range(repeats):
        for run, out in ((run_a, ta), (run_b, tb)) if r % 2 == 0 else ((run_b, tb), (run_a, ta)):
            t0 = time.perf_counter()
            run(r)
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def compare_learn_step(baseline, samples, n, hidden, batch_size, repeats):
    """Median seconds of one ``evidence_step`` (δ steps + η step): current vs baseline."""
    x, y = _data(n)
    inv = _model(samples, hidden)
    values = inv.initial_values()
    opt = torch.optim.Adam([inv.augmentation.eta], lr=0.0)        # lr 0: η stays put

    def step(mod):
        def run(r):
            log_delta = torch.zeros(2, requires_grad=True)
            dopt = torch.optim.Adam([log_delta], lr=0.1)
            return mod.evidence_step(inv, values, _batches(x, y, batch_size), log_delta,
                                     delta_optimizer=dopt, delta_steps=20, eta_optimizer=opt, seed=r)
        return run

    ev_new, ev_old = step(pb.invariance)(0), step(baseline)(0)
    t_new, t_old = _median_pair(step(pb.invariance), step(baseline), repeats)
    return t_new, t_old, ev_new, ev_old


def compare_guide_step(baseline, samples, n, hidden, batch_size, repeats):
    """Median seconds of the Laplace guide's LILA evidence step (curvature pass + η step):
    current (η step reuses the guide's factors) vs baseline (η step recomputes them)."""
    from pyro_bnn.data.batches import TensorBatches
    from pyro_bnn.guides.laplace.online import EVIDENCE_SEED
    from pyro_bnn.invariance import guide_step
    from pyro_bnn.training.loop import FitContext

    x, y = _data(n)
    inv = _model(samples, hidden)
    guide = pb.guides.Laplace(inv, structure="kron", curvature_batch_size=batch_size)
    pb.fit(inv, guide, (x[:64], y[:64]), epochs=1, batch_size=64, progress=False)
    ctx = FitContext(inv, guide, TensorBatches(x, y, batch_size, shuffle=False), n, torch.device("cpu"), 1)
    opt = torch.optim.Adam([inv.augmentation.eta], lr=0.0)

    def current(r):
        with torch.random.fork_rng():
            torch.manual_seed(EVIDENCE_SEED)
            guide.fit_curvature(**guide_step.guide_curvature_source(ctx, batch_size, EVIDENCE_SEED))
        guide_step.guide_online_eta_step(guide, ctx, opt, seed=EVIDENCE_SEED)

    def old(r):
        with torch.random.fork_rng():
            torch.manual_seed(EVIDENCE_SEED)
            guide.fit_curvature((x, y))
        baseline.learning.guide_eta_step(guide, inv, _batches(x, y, batch_size), opt, seed=r)

    return _median_pair(current, old, repeats)


def compare_trajectories(baseline, epochs, samples=16, hidden=256, size=16):
    """LILA with the current and the baseline package from the same seed (rotated digits,
    ``size``×``size``): largest extent difference over the epochs, accuracy, last evidence."""
    import math

    from pyro_bnn.invariance import transformed_digits

    d = transformed_digits("rotate", math.pi, seed=0, size=size)
    out = {}
    for name, mod in (("current", pb.invariance), ("baseline", baseline)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(d.x_train.shape[1], hidden), nn.Tanh(), nn.Linear(hidden, 10))
        model = pb.BNN(net, "categorical", augmentation=AffineAugmentation(num_samples=samples))
        res = mod.learn_invariance(model, d.train, method="lila", epochs=epochs, batch_size=128, lr=1e-2,
                                   hyper_lr=0.05, burnin=10, seed=0, marglik_batch_size=512)
        probs = pb.invariance.map_predict(model, res.values, d.x_test)
        out[name] = (torch.tensor(res.history["extent"]), float((probs.argmax(-1) == d.y_test).float().mean()),
                     res.history["log_evidence"][-1], statistics.median(res.history["hyper_seconds"]))
    (ea, acc_a, ev_a, ta), (eb, acc_b, ev_b, tb) = out["current"], out["baseline"]
    print(f"LILA {size}x{size} rotated digits, S={samples}, {epochs} epochs: max |extent diff| "
          f"{float((ea - eb).abs().max()):.2e}; rotation extent {ea[-1, 2]:.4f} vs {eb[-1, 2]:.4f}; "
          f"accuracy {acc_a:.4f} vs {acc_b:.4f}; last log evidence {ev_a:.2f} (total) vs baseline "
          f"{ev_b:.6f} (x N = {ev_b * len(d.x_train):.2f}); median η step {ta:.2f} s vs {tb:.2f} s")


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
    p.add_argument("--samples", type=int, nargs="*", default=[8, 16, 31])
    p.add_argument("--n", type=int, default=1348)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-n", type=int, nargs="*", default=[500, 1000, 2000, 4000])
    p.add_argument("--memory-samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--baseline", default=None, help="an older pyro_bnn/invariance folder to time against")
    p.add_argument("--trajectory", type=int, default=0,
                   help="with --baseline: also train LILA for this many epochs with both packages")
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
    if args.baseline:
        baseline = load_baseline(args.baseline)
        print(f"\nη evidence step, current vs baseline {args.baseline} (alternating, median of {args.repeats})")
        print(f"{'S':>4} {'what':>28} {'current s':>10} {'baseline s':>11} {'baseline/current':>17}")
        for s in args.samples:
            tn, to, ev_new, ev_old = compare_learn_step(baseline, s, args.n, args.hidden,
                                                        args.batch_size, args.repeats)
            print(f"{s:>4} {'evidence_step (20 δ + η)':>28} {tn:10.3f} {to:11.3f} {to / tn:17.2f}"
                  f"   log evidence: current {ev_new:.2f} (total), baseline {ev_old:.6f} (per datum: "
                  f"x N = {ev_old * args.n:.2f})", flush=True)
            tn, to = compare_guide_step(baseline, s, args.n, args.hidden, args.batch_size, args.repeats)
            print(f"{s:>4} {'Laplace fit: curvature + η':>28} {tn:10.3f} {to:11.3f} {to / tn:17.2f}", flush=True)
        if args.trajectory:
            compare_trajectories(baseline, args.trajectory)
    s = args.memory_samples
    if not args.memory_n:
        return
    print(f"\npeak RSS added by one evidence step (S={s}), minibatches of {args.batch_size} "
          f"vs one whole-data batch")
    print(f"{'N':>6} {'minibatch MB':>13} {'whole-data MB':>14}")
    for n in args.memory_n:
        mb = peak_memory(n, s, args.hidden, args.batch_size)
        full = peak_memory(n, s, args.hidden, n)
        print(f"{n:>6} {mb['added_mb']:13.1f} {full['added_mb']:14.1f}", flush=True)


if __name__ == "__main__":
    main()
