"""Small models shared by the core tests."""

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_bnn.invariance import evidence_step


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


def check_evidence_step_against_dense(model, values, batches, delta, dense_evidence, *, atol, min_grad):
    """``evidence_step``'s log evidence and batched η-gradient against a dense whole-data
    reference ``dense_evidence(model, values, batches, seeds, delta)`` (draws under seeds
    7, 8), and the reference's η-gradient against central finite differences.

    ``atol``: absolute tolerance of the gradient comparison (relative 1e-7); ``min_grad``: the
    smallest |∂ev/∂η_k| accepted as a non-trivial gradient.
    """
    aug, seeds = model.augmentation, [7, 8]
    num_data = sum(len(x) for x, _ in batches)
    aug.eta.requires_grad_(True)
    ev_ref = dense_evidence(model, values, batches, seeds, delta)
    grad_ref, = torch.autograd.grad(ev_ref, aug.eta)
    aug.eta.requires_grad_(False)
    opt = torch.optim.SGD([aug.eta], lr=1.0)
    eta0 = aug.eta.detach().clone()
    value = evidence_step(model, values, batches, delta.log(), eta_optimizer=opt, seed=seeds[0])
    grad = (eta0 - aug.eta.detach()) * -num_data          # SGD on −ev/N: η ← η + ∂ev/∂η / N
    ev_ref = ev_ref.detach()
    assert abs(value - float(ev_ref)) < 1e-9 * abs(float(ev_ref))
    assert torch.allclose(grad, grad_ref, rtol=1e-7, atol=atol)
    assert grad.abs().min() > min_grad
    # Bilinear resampling (and ReLU, max-pool) are piecewise smooth in η, with kinks where a
    # sample point crosses a pixel edge: a tiny central step avoids straddling a kink.
    eps = 1e-7
    with torch.no_grad():
        aug.eta.copy_(eta0)
        for k in range(len(eta0)):
            aug.eta[k] += eps
            up = dense_evidence(model, values, batches, seeds, delta)
            aug.eta[k] -= 2 * eps
            down = dense_evidence(model, values, batches, seeds, delta)
            aug.eta[k] += eps
            assert abs((up - down) / (2 * eps) - grad_ref[k]) < 1e-5 * (1 + abs(grad_ref[k]))
