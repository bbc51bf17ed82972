"""Shared pieces of the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def map_epoch(net, optimizer, batches, *, noise=(), fixed_grads=None) -> None:
    """One epoch of plain PyTorch MAP training (cross-entropy, ``optimizer`` step per batch).

    ``noise``: tensors refilled with N(0, 1) before every step, and ``fixed_grads``:
    ``{param: grad}`` set after every backward — the two extra costs of the weight-noise
    floor in ``bench_core.py`` (a draw per weight, Adam over twice the parameters).
    """
    for xb, yb in batches:
        for buf in noise:
            buf.normal_()
        loss = F.cross_entropy(net(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p, g in (fixed_grads or {}).items():
            p.grad = g
        optimizer.step()


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
