"""Cost of pb.fit's divergence guard: seconds per epoch with its checks on vs off.

Same problem as ``bench_core.py`` (MLP 784-400-400-10 on the first 5,000 MNIST test digits,
batch 128, MeanField), one process, blocks of ``--block`` epochs (one ``pb.fit`` call each, as
in ``bench_core.py``) interleaved ``--repeats`` times: (a) plain PyTorch MAP (the reference of
``bench_core.py``), (c) ``pb.fit`` as shipped, (c1) the per-step gradient check replaced by a
zero norm, (c0) every check the guard added switched off (gradient norms, the epoch-end and
initial state checks, the final loss evaluation); the loss check and the per-epoch snapshot,
which ``fit`` always had, stay.  Medians of wall and process-CPU seconds per epoch and ratios.

    python benchmarks/bench_guard.py --data-dir ../shared/data/mnist --block 2 --repeats 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import pyro
import torch
from _common import map_epoch, sync  # benchmarks/_common.py (on sys.path when run as a script)
from bench_core import mlp

import pyro_bnn as pb
from pyro_bnn.data.batches import TensorBatches
from pyro_bnn.training import loop as training
from pyro_bnn.training.divergence import DivergenceGuard
from pyro_bnn.training.optimizer import default_optimizer


@contextlib.contextmanager
def guard_checks_off(everything: bool):
    """Replace the guard's gradient norms by a constant zero (no reduction over gradients) and,
    with ``everything``, skip its state checks and the final loss evaluation too."""
    patches = [(DivergenceGuard, "gradient_norms", lambda self: torch.zeros(0))]
    if everything:
        patches += [(DivergenceGuard, "check_state", lambda self, epoch: None),
                    (DivergenceGuard, "check_initial", lambda self, epoch=0: None),
                    (training, "_verify_final_state", lambda run: training._confirm_state(run)
                     if run.guard.pending else None)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def gradient_norm_timing(x, y, args, repeats: int = 300) -> tuple[float, float]:
    """Median CPU milliseconds of the guard's gradient reduction (``torch._foreach_norm`` over
    one step's real MeanField gradients) and of that step's forward + backward."""
    from pyro_bnn.contract.local_params import local_params

    model = pb.BNN(mlp(args.hidden), likelihood="categorical")
    guide = pb.guides.MeanField(model, init_scale=0.1)
    xb, yb = x[:args.batch_size], y[:args.batch_size]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (xb, yb), epochs=1, batch_size=args.batch_size, progress=False)
    objective = guide.make_objective()
    params = [p for p in guide.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        with local_params(model, guide):
            objective(model, guide, xb, yb, len(x)).backward()

    def timed(fn, n):
        times = []
        for _ in range(n):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return 1e3 * statistics.median(times)

    step_ms = timed(step, repeats // 3)
    grads = [p.grad for p in params if p.grad is not None]
    norm_ms = timed(lambda: torch.stack(torch._foreach_norm(grads)).tolist(), repeats)
    return norm_ms, step_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data/mnist")
    ap.add_argument("--block", type=int, default=2, help="epochs per timed block")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved blocks per method")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=400)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    split = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
    x, y = (t.to(device) for t in split.train)
    torch.manual_seed(0)
    pyro.set_rng_seed(0)

    net_a = mlp(args.hidden).to(device)
    opt_a = torch.optim.Adam(net_a.parameters(), lr=1e-3)
    batches_a = TensorBatches(x, y, args.batch_size)

    def fit_block(off):
        model = pb.BNN(mlp(args.hidden), likelihood="categorical")
        guide = pb.guides.MeanField(model, init_scale=0.1)
        store = {}

        def run(epochs):
            ctx = contextlib.nullcontext() if off is None else guard_checks_off(off == "all")
            with ctx, warnings.catch_warnings():
                warnings.simplefilter("ignore", pb.ConvergenceWarning)
                pb.fit(model, guide, (x, y), epochs=epochs, batch_size=args.batch_size, device=device,
                       optimizer=lambda p: store.setdefault("opt", default_optimizer(p, 1e-3)), progress=False)
        return run

    def map_block(epochs):
        for _ in range(epochs):
            map_epoch(net_a, opt_a, batches_a)

    methods = {"a": map_block, "c": fit_block(None), "c1": fit_block("gradient"), "c0": fit_block("all")}
    wall = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    for run in methods.values():  # warm-up, set-up of guides and optimisers
        run(1)
    for _ in range(args.repeats):
        for key, run in methods.items():
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            run(args.block)
            sync(device)
            wall[key].append((time.perf_counter() - t0) / args.block)
            cpu[key].append((time.process_time() - c0) / args.block)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"MNIST {len(x)} train, MLP 784-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, {device}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} blocks of {args.block} epochs per method "
          "(median s/epoch: wall, cpu)")
    labels = {"a": "(a) PyTorch MAP", "c": "(c) pb.fit + MeanField, guard as shipped",
              "c1": "(c1) the same, gradient check off", "c0": "(c0) the same, all new checks off"}
    for key, label in labels.items():
        print(f"  {label:<48} {med[key]:.3f}  {med_cpu[key]:.3f}")
    norm_ms, step_ms = gradient_norm_timing(x, y, args)
    print(f"  one fused norm over a step's gradients: {norm_ms:.3f} ms; forward + backward: {step_ms:.3f} ms "
          f"(CPU, medians)  -> {100 * norm_ms / step_ms:.1f} % of forward + backward")
    for num, den, note in (("c", "c0", "cost of the guard's checks"), ("c", "c1", "cost of the gradient check"),
                           ("c", "a", "bench_core's (c)/(a)"), ("c0", "a", "")):
        print(f"  ratio ({num})/({den}) = {med[num] / med[den]:.3f} wall, {med_cpu[num] / med_cpu[den]:.3f} cpu"
              f"   {note}")
    return med, med_cpu


if __name__ == "__main__":
    main()
