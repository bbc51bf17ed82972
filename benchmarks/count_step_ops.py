"""Operations per training step: a CPU stand-in for the GPU's kernel launches (issue 27).

On a GPU a small BNN's step is bound by kernel launches, not arithmetic
(``docs/results/cuda.md``: a MeanField step launched 231 kernels against a MAP step's 40).
Without a GPU the count can be approximated on the CPU from ``torch.profiler``'s operator tree:
the **compute operators** of a step are the ``aten::`` operators that call no other counted
operator (so ``linear`` → ``addmm`` → its bias ``copy_`` counts once), with a multi-tensor
operator (``_foreach_*``, ``_fused_*``: one kernel per device and dtype on a GPU, a loop on the
CPU) counted once, and without the work a GPU step has no kernel for: views and allocations
(:data:`NO_KERNEL`), Python numbers wrapped into tensors inside an operator, the zero fill that
starts a CPU reduction.  Scalar reads (``item``) are counted apart: on the CPU they read CPU
tensors (the prior's constants, fused Adam's step count) and cost nothing; on a GPU the library
keeps those tensors where they were, so they are not host–device synchronisations there.

It is an approximation: at commit 2e4d733 the GPU counted 231 / 363 kernels per MeanField step
(weight noise / local reparameterisation) where this count gives 165 / 342 for the same code.
On CUDA (``--device cuda``) the script prints the GPU kernel count beside it.

Set-up as ``profile_fit_cuda.py`` / ``bench_core.py``: MLP 784-400-400-10, batch 128, 5,120
random MNIST-shaped inputs (40 steps per epoch; the values do not change the count); one warm-up
epoch, then one profiled epoch; counts divided by the steps, so ``pb.fit``'s per-epoch work is
spread over them as in a real epoch.  Only public ``pyro_bnn`` names are used, so the script
runs unchanged against an older checkout (``PYTHONPATH=<checkout>``) for a before/after figure.

    python benchmarks/count_step_ops.py --fused-map                 # CPU
    python benchmarks/count_step_ops.py --fused-map --device cuda   # also the GPU kernel counts
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import pyro_bnn as pb

#: ``aten::`` leaf operators that make a view or an uninitialised allocation: no kernel on a GPU
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "t", "transpose",
    "permute", "expand", "squeeze", "unsqueeze", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "detach", "alias", "lift_fresh", "empty", "empty_like",
    "empty_strided", "resolve_conj", "resolve_neg", "numpy_T", "view_as", "expand_as",
    "unflatten", "flatten", "_nested_tensor_from_mask_left_aligned", "is_nonzero", "result_type",
    "broadcast_tensors", "set_", "contiguous"))

STEPS_PER_EPOCH = 40


def mlp(hidden: int = 400) -> nn.Sequential:
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


#: reductions whose CPU kernel first fills its output (a GPU reduction does not launch that fill)
REDUCTIONS = frozenset(f"aten::{name}" for name in ("sum", "dot", "mean", "norm", "linalg_vector_norm",
                                                     "_foreach_norm", "prod", "amax", "logsumexp"))


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _wrapped_scalar(event) -> bool:
    """An ``aten::to`` called by another ``aten::`` operator (a Python number or a dtype made
    into a tensor inside it: a CPU-side conversion)."""
    parent = event.cpu_parent
    return event.name == "aten::to" and parent is not None and parent.name.startswith("aten::") \
        and parent.name not in ("aten::to", "aten::_to_copy")


def _multi_tensor(event) -> bool:
    """A ``_foreach_*`` / ``_fused_*`` operator: one multi-tensor kernel (per device and dtype) on
    a GPU, a loop of per-tensor operators on the CPU."""
    return event.name.startswith(("aten::_foreach_", "aten::_fused_"))


def _skipped(event) -> bool:
    """Not counted: views and allocations (:data:`NO_KERNEL`), scalar reads (counted apart),
    a CPU reduction's initial zero fill, a wrapped scalar and everything under it, and
    everything under a multi-tensor operator (counted once)."""
    if event.name in NO_KERNEL or event.name in ("aten::item", "aten::_local_scalar_dense"):
        return True
    parent = event.cpu_parent
    if event.name == "aten::fill_" and parent is not None and parent.name in REDUCTIONS:
        return True
    if _wrapped_scalar(event):
        return True
    return any(_wrapped_scalar(a) or _multi_tensor(a) for a in _ancestors(event))


def _is_compute(event) -> bool:
    return event.name.startswith("aten::") and not _skipped(event)


def compute_ops(prof) -> tuple[Counter, int]:
    """The profiled run's compute operators by name, and its scalar reads.

    A compute operator is a counted (not :func:`_skipped`) ``aten::`` operator that is a
    multi-tensor operator or calls no other counted operator (so ``linear`` → ``addmm`` → its
    bias ``copy_`` counts once)."""
    counts, reads = Counter(), 0
    for event in prof.events():
        if event.name == "aten::_local_scalar_dense":
            reads += 1
        if _is_compute(event) and (_multi_tensor(event)
                                   or not any(_is_compute(child) for child in event.cpu_children)):
            counts[event.name] += 1
    return counts, reads


def gpu_kernels(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def map_epoch(net, optimizer, x, y, batch_size):
    for i in range(0, len(x), batch_size):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x[i:i + batch_size]), y[i:i + batch_size]).backward()
        optimizer.step()


def methods(hidden: int):
    """``(label, make)`` with ``make() -> (model, guide)``; ``None`` for the MAP step."""
    def meanfield(local):
        def make():
            model = pb.BNN(mlp(hidden), "categorical")
            return model, pb.guides.MeanField(model, local_reparameterization=local)
        return make

    def hypernet(blocks):
        def make():
            model = pb.BNN(mlp(hidden), "categorical", weight_norm=True)
            return model, pb.guides.Hypernet(model, flow="iaf", num_flows=blocks)
        return make

    def symmetrized():
        model = pb.BNN(mlp(hidden), "categorical")
        return model, pb.guides.Symmetrized(model)

    return [("PyTorch MAP (Adam)", None), ("MeanField, weight noise", meanfield(False)),
            ("MeanField, local reparameterisation", meanfield(True)), ("Hypernet, 0 blocks", hypernet(0)),
            ("Hypernet, 8 IAF blocks", hypernet(8)), ("Symmetrized (default)", symmetrized)]


def profile_method(make, x, y, batch_size, device, hidden: int, fused_map: bool):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    torch.manual_seed(0)
    if make is None:
        net = mlp(hidden).to(device)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused_map or None)
        map_epoch(net, optimizer, x, y, batch_size)
        with profile(activities=activities) as prof:
            map_epoch(net, optimizer, x, y, batch_size)
            torch.cuda.synchronize() if device.type == "cuda" else None
        return prof
    model, guide = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=1, batch_size=batch_size, progress=False, device=device)
        with profile(activities=activities) as prof:
            pb.fit(model, guide, (x, y), epochs=1, batch_size=batch_size, progress=False, device=device)
            torch.cuda.synchronize() if device.type == "cuda" else None
    return prof


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=400)
    p.add_argument("--top", type=int, default=0, help="also list each method's N most frequent operators")
    p.add_argument("--fused-map", action="store_true", help="the MAP baseline with fused Adam")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    n = STEPS_PER_EPOCH * args.batch_size
    x = torch.rand(n, 784, generator=generator).to(device)
    y = torch.randint(0, 10, (n,), generator=generator).to(device)
    print(f"pyro_bnn from {pb.__file__}; torch {torch.__version__}; device {device}; "
          f"{STEPS_PER_EPOCH} steps of {args.batch_size}, MLP 784-{args.hidden}-{args.hidden}-10")
    print(f"{'method':40s} {'compute ops / step':>18s} {'scalar reads':>13s}" + (f" {'GPU kernels / step':>19s}" if device.type == "cuda" else ""))
    for label, make in methods(args.hidden):
        try:
            prof = profile_method(make, x, y, args.batch_size, device, args.hidden, args.fused_map)
        except Exception as exc:   # an older checkout may lack a guide or option: say so, go on
            print(f"{label:40s} failed: {type(exc).__name__}: {exc}")
            continue
        ops, reads = compute_ops(prof)
        line = f"{label:40s} {sum(ops.values()) / STEPS_PER_EPOCH:18.1f} {reads / STEPS_PER_EPOCH:13.1f}"
        if device.type == "cuda":
            line += f" {gpu_kernels(prof) / STEPS_PER_EPOCH:19.1f}"
        print(line, flush=True)
        if args.top:
            for name, count in ops.most_common(args.top):
                print(f"    {count / STEPS_PER_EPOCH:7.1f}  {name}")


if __name__ == "__main__":
    main()
