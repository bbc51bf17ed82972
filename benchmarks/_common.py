"""Shared pieces of the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import json
import math
import time

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule, PyroSample
from torch import nn


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


def emit_row(row: dict, out: str | None) -> None:
    """Print ``row`` as one JSON line and append it to ``out`` (a JSON-lines file) if given."""
    line = json.dumps(row, default=float)
    print(line, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mnist_mlp(hidden: int = 400) -> nn.Module:
    """The MNIST benchmark network, MLP 784-hidden-hidden-10 with ReLU."""
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


class PlainPyroMLP(PyroModule):
    """:func:`mnist_mlp` as a Pyro user writes it by hand: N(0, 1) ``PyroSample`` priors on
    every weight and bias, a subsampled data plate, categorical observations."""

    def __init__(self, num_data: int, hidden: int = 400, device="cpu"):
        super().__init__()
        self.num_data = num_data
        net = mnist_mlp(hidden)
        pyro.nn.module.to_pyro_module_(net)
        self.net = net
        zero, one = torch.zeros((), device=device), torch.ones((), device=device)
        for layer in (self.net[0], self.net[2], self.net[4]):
            layer.weight = PyroSample(dist.Normal(zero, one).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(zero, one).expand(layer.bias.shape).to_event(1))

    def forward(self, x, y=None):
        logits = self.net(x)
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def train_map_(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int,
               weight_decay: float, lr: float = 1e-3, batch_size: int = 64) -> tuple[list, list]:
    """Train ``net`` in place as a plain PyTorch MAP classifier: Adam with weight decay, a
    per-step cosine decay of the lr to 0, mean cross-entropy, minibatches from a permutation
    seeded by ``seed``.

    Returns
    -------
    (losses, seconds)
        Per epoch: the MAP objective per data point (mean NLL + ``weight_decay``·‖w‖²/2 at the
        epoch's end) and the epoch's wall seconds.
    """
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(x) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * t / steps)))
    g = torch.Generator().manual_seed(seed)
    losses, seconds = [], []
    for _ in range(epochs):
        t0, total = time.perf_counter(), 0.0
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        with torch.no_grad():
            reg = 0.5 * weight_decay * sum(float((p ** 2).sum()) for p in net.parameters())
        losses.append(total / len(x) + reg)
        seconds.append(time.perf_counter() - t0)
    return losses, seconds
