"""Shared pieces of the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import json

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
