"""Small models shared by the core tests."""

import pyro
import pyro.distributions as dist
from pyro.nn import PyroModule, PyroSample
from torch import nn


class HandWritten(PyroModule):
    """A user's own PyroModule: PyroSample weights and its own "obs" site."""

    def __init__(self, d_in=64, d_hidden=16, d_out=10):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](d_in, d_hidden)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_hidden, d_in]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_hidden]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](d_hidden, d_out)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, d_hidden]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc2(self.fc1(x).relu())
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def mlp(d_in=64, d_hidden=16, d_out=10):
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))


def spy_on_plan(monkeypatch, module, name: str, fast: bool) -> list:
    """Replace ``module.<name>`` (a guide's fast-path planner, returning a plan or None) by a
    spy that returns the real plan if ``fast`` else None (the general path); returns the list
    that records, per call, whether a plan was used."""
    real = getattr(module, name)
    used = []

    def spy(*args):
        out = real(*args) if fast else None
        used.append(out is not None)
        return out

    monkeypatch.setattr(module, name, spy)
    return used
