"""Where a ``pb.fit`` step spends its time on a GPU: kernel launches, host–device
synchronisations and the heaviest operators, per training step, against plain PyTorch MAP.

Same set-up as ``bench_core.py`` (MNIST 5,000, MLP 784-400-400-10, batch 128).  Each method
is warmed up for one epoch, then one epoch runs under ``torch.profiler``; the counts are
divided by the number of steps.  On a CPU-only machine the script profiles the CPU (no
kernel counts).

    python benchmarks/profile_fit_cuda.py --data-dir ../shared/data/mnist --device cuda
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from _common import map_epoch, sync
from _common import mnist_mlp as mlp  # benchmarks/_common.py (on sys.path when run as a script)
from torch.profiler import ProfilerActivity, profile

import pyro_bnn as pb
from pyro_bnn.data.batches import TensorBatches


def summarise(prof, steps: int, label: str, top: int) -> None:
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaEventSynchronize"))
    copies = sum(e.count for e in events if e.key in ("aten::item", "aten::_local_scalar_dense"))
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    print(f"\n== {label}: per step {kernels / steps:.1f} GPU kernels, {launches / steps:.1f} launches, "
          f"{syncs / steps:.2f} synchronisations, {copies / steps:.2f} scalar reads")
    sort = "self_cuda_time_total" if kernels else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=top, max_name_column_width=48))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=400)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    split = pb.datasets.mnist_split(args.data_dir)
    x, y = split.x_train.to(device), split.y_train.to(device)
    steps = -(-len(x) // args.batch_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    torch.manual_seed(0)
    net = mlp(args.hidden).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    batches = TensorBatches(x, y, args.batch_size, shuffle=True)
    map_epoch(net, opt, batches)
    sync(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        map_epoch(net, opt, batches)
        sync(device)
    print(f"PyTorch MAP: {time.perf_counter() - t:.3f} s/epoch under the profiler")
    summarise(prof, steps, "PyTorch MAP (torch.optim.Adam)", args.top)

    for local in (False, True):
        torch.manual_seed(0)
        model = pb.BNN(mlp(args.hidden), "categorical").to(device)
        guide = pb.guides.MeanField(model, local_reparameterization=local)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            pb.fit(model, guide, (x, y), epochs=1, batch_size=args.batch_size, progress=False, device=device)
            sync(device)
            t = time.perf_counter()
            with profile(activities=activities) as prof:
                pb.fit(model, guide, (x, y), epochs=1, batch_size=args.batch_size, progress=False,
                       device=device)
                sync(device)
        print(f"\npb.fit + MeanField (local={local}): {time.perf_counter() - t:.3f} s/epoch under the profiler")
        summarise(prof, steps, f"pb.fit + MeanField, local reparameterisation {local}", args.top)


if __name__ == "__main__":
    main()
