"""Seconds per epoch: plain PyTorch MAP vs plain Pyro (AutoNormal + SVI) vs ``pb.fit`` + MeanField.

Same MLP 784-400-400-10 on the first 5,000 digits of the MNIST test file, same batch size,
one process.  Blocks of ``--block`` epochs of each method are interleaved (a, b, c, d, a, b,
...) ``--repeats`` times so machine noise hits all of them alike; ``pb.fit`` runs one call per
block, so its set-up is paid (amortised) as a user pays it, and its Adam state carries over.
Medians of seconds per epoch, wall clock and process CPU time, and their ratios are reported
(CPU time is less disturbed by other processes on a shared machine).

Two reference lines that are not targets: (a') the same MAP with PyTorch's fused Adam, and
(f) a floor for any weight-noise mean-field method — the fused-Adam MAP step plus one N(0, 1)
draw per weight and Adam over twice the parameters, with no σ, KL or sampling arithmetic.

    python benchmarks/bench_core.py --data-dir ../shared/data/mnist --block 5 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import pyro
import torch
from _common import PlainPyroMLP, map_epoch, sync
from _common import mnist_mlp as mlp  # benchmarks/_common.py (on sys.path when run as a script)
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_bnn as pb
from pyro_bnn.data.batches import TensorBatches
from pyro_bnn.training.optimizer import default_optimizer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data/mnist")
    ap.add_argument("--block", type=int, default=5, help="epochs per timed block")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (CPU time is then not meaningful)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved blocks per method")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1; 0 leaves torch's default). On a shared 2-core "
                         "machine two threads made small ops in every method far slower")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    split = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
    x, y = (t.to(device) for t in split.train)
    x_test, y_test = (t.to(device) for t in split.test)
    n = len(x)
    torch.manual_seed(0)
    pyro.set_rng_seed(0)

    # (a) plain PyTorch MAP
    net_a = mlp(args.hidden).to(device)
    opt_a = torch.optim.Adam(net_a.parameters(), lr=1e-3)
    batches_a = TensorBatches(x, y, args.batch_size)

    def epoch_a():
        map_epoch(net_a, opt_a, batches_a)

    # (b) plain Pyro: PyroModule + AutoNormal + SVI
    model_b = PlainPyroMLP(n, args.hidden, device).to(device)
    guide_b = AutoNormal(model_b, init_scale=0.01)
    svi = SVI(model_b, guide_b, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    batches_b = TensorBatches(x, y, args.batch_size)

    def epoch_b():
        for xb, yb in batches_b:
            svi.step(xb, yb)

    # (c) pb.fit with MeanField; one persistent optimizer so Adam's state carries over blocks,
    # with the parameter groups pb.fit's default builds (the wide layers' means at a lower lr)
    model_c = pb.BNN(mlp(args.hidden), likelihood="categorical")
    guide_c = pb.guides.MeanField(model_c, local_reparameterization=False)  # weight noise (the default "auto" picks local for this net)
    # (d) the same with local reparameterisation (noise on pre-activations, not weights)
    model_d = pb.BNN(mlp(args.hidden), likelihood="categorical")
    guide_d = pb.guides.MeanField(model_d, local_reparameterization=True)

    def fit_block(model, guide, store):
        def run(epochs):
            with warnings.catch_warnings():   # timed blocks of a few epochs: nothing to judge
                warnings.simplefilter("ignore", pb.ConvergenceWarning)
                pb.fit(model, guide, (x, y), epochs=epochs, batch_size=args.batch_size, device=device,
                       optimizer=lambda params: store.setdefault("opt", default_optimizer(
                           params, 1e-3, pb.guides.guide_contract(guide).learning_rate_factors())),
                       lr_schedule="constant", progress=False)
        return run

    # (a') MAP with fused Adam, and (f) the weight-noise floor (see the module docstring)
    net_e = mlp(args.hidden).to(device)
    opt_e = torch.optim.Adam(net_e.parameters(), lr=1e-3, fused=True)
    net_f = mlp(args.hidden).to(device)
    extra_f = {torch.zeros_like(p, requires_grad=True): torch.zeros_like(p) for p in net_f.parameters()}
    opt_f = torch.optim.Adam(list(net_f.parameters()) + list(extra_f), lr=1e-3, fused=True)
    noise_f = [torch.empty_like(p) for p in net_f.parameters()]

    def epoch_e():
        map_epoch(net_e, opt_e, batches_a)

    def epoch_f():
        map_epoch(net_f, opt_f, batches_a, noise=noise_f, fixed_grads=extra_f)

    def per_epoch(fn):
        def run(epochs):
            for _ in range(epochs):
                fn()
        return run

    methods = {"a": per_epoch(epoch_a), "b": per_epoch(epoch_b), "c": fit_block(model_c, guide_c, {}),
               "d": fit_block(model_d, guide_d, {}), "a'": per_epoch(epoch_e), "f": per_epoch(epoch_f)}
    wall = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    for run in methods.values():  # warm-up (also sets up the guides and optimizers)
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
    print(f"MNIST {n} train, MLP 784-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, {device}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} blocks of {args.block} epochs "
          "per method (median s/epoch: wall, cpu)")
    labels = {"a": "(a) PyTorch MAP (torch.optim.Adam)", "b": "(b) Pyro AutoNormal + SVI",
              "c": "(c) pb.fit + MeanField", "d": "(d) pb.fit + MeanField, local reparam.",
              "a'": "(a') PyTorch MAP, fused Adam", "f": "(f) floor: (a') + noise + 2x Adam"}
    for key, label in labels.items():
        print(f"  {label:<42} {med[key]:.3f}  {med_cpu[key]:.3f}")
    for num, den, note in (("c", "a", "target <= 1.5"), ("b", "c", "target >= 2"), ("b", "a", ""),
                           ("d", "a", "local reparameterisation"), ("f", "a", "floor"),
                           ("c", "f", "MeanField over the floor")):
        print(f"  ratio ({num})/({den}) = {med[num] / med[den]:.2f} wall, "
              f"{med_cpu[num] / med_cpu[den]:.2f} cpu   {note}")
    epochs_run = 1 + args.repeats * args.block
    for key, (m, g) in (("c", (model_c, guide_c)), ("d", (model_d, guide_d))):
        acc = pb.evaluate(m, g, x_test, y_test, num_samples=16)["accuracy"]
        print(f"  ({key}) test accuracy after {epochs_run} epochs: {acc:.4f}")
    return med, med_cpu


if __name__ == "__main__":
    main()
