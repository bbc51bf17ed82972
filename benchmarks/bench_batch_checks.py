"""Cost of checking every DataLoader batch: ``pb.fit`` + MeanField epochs with and without it.

bench_core's MeanField task (MLP 784-400-400-10 on the first 5,000 digits of the MNIST test
file, batch 128, ``pb.fit`` + ``MeanField``), fed by a ``DataLoader`` (a batch sampler over a
``TensorDataset``, so one indexing per batch and no per-example collation that would hide
the check's cost).  Side by side in one process, interleaved blocks of ``--block`` epochs:

* (a) the batches pass ``pyro_bnn.data.batches.BatchCheck`` for the model as they are read (what
  ``pb.fit`` does with a loader: finite float inputs of the model's dtype, lengths, labels
  in range for the likelihood);
* (b) the same loader and wrapper with a check that does nothing;
* (c) the same data as tensors (checked once up front, batched by slicing), for reference.

Reports median seconds per epoch (wall and process CPU time), the ratio (a)/(b), and the
check's own median time per batch measured alone.

    python benchmarks/bench_batch_checks.py --data-dir ../shared/data/mnist --block 3 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from _common import sync  # benchmarks/_common.py (on sys.path when run as a script)
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import pyro_bnn as pb
from pyro_bnn.data.batches import BatchCheck, CheckedBatches
from pyro_bnn.training.optimizer import default_optimizer


def mlp(d_in, hidden):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def batch_loader(x, y, batch_size, seed):
    """A DataLoader yielding whole batches by one index operation each."""
    ds = TensorDataset(x, y)
    sampler = BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(seed)), batch_size, False)
    return DataLoader(ds, sampler=sampler, batch_size=None)


def no_check(x, y=None, where=""):
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data/mnist")
    ap.add_argument("--dataset", choices=["mnist", "digits"], default="mnist",
                    help="mnist: 5,000 MNIST digits (bench_core's task); digits: the offline 8x8 digits")
    ap.add_argument("--block", type=int, default=3, help="epochs per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved blocks per method")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dataset == "mnist":
        split = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
    else:
        split = pb.datasets.digits()
    x, y = split.train
    torch.manual_seed(0)
    pyro.set_rng_seed(0)

    def method(checked: bool | None):
        model = pb.BNN(mlp(x.shape[1], args.hidden), likelihood="categorical")
        guide = pb.guides.MeanField(model)
        if checked is None:
            data = (x, y)
        else:
            data = CheckedBatches(batch_loader(x, y, args.batch_size, 0), BatchCheck(model) if checked else no_check)
        store = {}

        def run(epochs):
            pb.fit(model, guide, data, epochs=epochs, batch_size=args.batch_size, progress=False,
                   optimizer=lambda params: store.setdefault("opt", default_optimizer(params, 1e-3)))
        return run

    methods = {"a": method(True), "b": method(False), "c": method(None)}
    wall = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    for run in methods.values():  # warm-up: guides and optimisers set up
        run(1)
    device = torch.device("cpu")
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

    # the check alone, on the batches of one epoch
    check = BatchCheck(pb.BNN(mlp(x.shape[1], args.hidden), likelihood="categorical"))
    batches = list(batch_loader(x, y, args.batch_size, 1))
    check(*batches[0])  # computes the output shape once
    per_batch = []
    for _ in range(5):
        t0 = time.perf_counter()
        for xb, yb in batches:
            check(xb, yb)
        per_batch.append((time.perf_counter() - t0) / len(batches))

    print(f"{args.dataset} {len(x)} train, MLP {x.shape[1]}-{args.hidden}-{args.hidden}-10, batch "
          f"{args.batch_size}, {len(batches)} batches/epoch, torch threads {torch.get_num_threads()}, "
          f"{args.repeats} blocks of {args.block} epochs per method (median s/epoch: wall, cpu)")
    labels = {"a": "(a) DataLoader, every batch checked", "b": "(b) DataLoader, no check",
              "c": "(c) tensors, checked once up front"}
    for key, label in labels.items():
        print(f"  {label:<40} {med[key]:.3f}  {med_cpu[key]:.3f}")
    print(f"  ratio (a)/(b) = {med['a'] / med['b']:.3f} wall, {med_cpu['a'] / med_cpu['b']:.3f} cpu")
    print(f"  the check alone: {statistics.median(per_batch) * 1e6:.0f} us per batch "
          f"({statistics.median(per_batch) * len(batches) / med['b'] * 100:.2f} % of an epoch of (b))")
    return med, med_cpu


if __name__ == "__main__":
    main()
