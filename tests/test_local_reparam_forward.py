"""The functional forward of MeanField's local reparameterisation
(``pyro_bnn.guides.local_reparam_forward``, issue 27): the same loss and gradients, bit for bit,
as the forward hooks around ``model.run_with``, and the hooks wherever the shortcut does not apply."""

from __future__ import annotations

import pytest
import torch
from helpers import spy_on_plan
from torch import nn

import pyro_bnn as pb
import pyro_bnn.guides.meanfield as meanfield
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.local_reparam_forward import local_reparam_plan
from pyro_bnn.training.guide_setup import setup_guide

NETS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), (6,)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(2, 3, 3, padding=1),
                                  nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 3)), (1, 6, 6)),
    "conv1d_strided": (lambda: nn.Sequential(nn.Conv1d(1, 2, 3, padding=1, stride=2, bias=False), nn.GELU(),
                                             nn.AvgPool1d(2), nn.Flatten(), nn.Linear(6, 3)), (1, 12)),
    "dropout": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Dropout(0.4), nn.Linear(5, 3)),
                (2, 3)),
}


def _setup(net_kind, stochastic=None, seed=0):
    make, shape = NETS[net_kind]
    torch.manual_seed(seed)
    model = pb.BNN(make(), "categorical", stochastic=stochastic)
    guide = pb.guides.MeanField(model, init_scale=0.1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, *shape, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    setup_guide(model, guide, x[:2], y[:2], 100)
    return model, guide, x, y


def _loss_and_grads(model, guide, x, y, fast, monkeypatch, particles=1):
    used = spy_on_plan(monkeypatch, meanfield, "local_reparam_plan", fast)
    with local_params(model, guide):
        params = [p for p in list(model.parameters()) + list(guide.parameters()) if p.requires_grad]
        torch.manual_seed(3)
        loss = meanfield.meanfield_loss(model, guide, x, y, 100, num_particles=particles)
        grads = torch.autograd.grad(loss, params)
    return loss, grads, used


@pytest.mark.parametrize("particles", [1, 2])
@pytest.mark.parametrize("weights_only", [False, True], ids=["random_biases", "deterministic_biases"])
@pytest.mark.parametrize("net_kind", sorted(NETS))
def test_functional_forward_is_bit_identical(net_kind, weights_only, particles, monkeypatch):
    stochastic = (lambda name, module, param: name.endswith("weight")) if weights_only else None
    model, guide, x, y = _setup(net_kind, stochastic)
    loss_fast, grads_fast, used_fast = _loss_and_grads(model, guide, x, y, True, monkeypatch, particles)
    loss_hooks, grads_hooks, used_hooks = _loss_and_grads(model, guide, x, y, False, monkeypatch, particles)
    assert used_fast == [True] and used_hooks == [False]
    assert torch.equal(loss_fast, loss_hooks)
    assert len(grads_fast) == len(grads_hooks) > 0
    for a, b in zip(grads_fast, grads_hooks):
        assert torch.equal(a, b)
    if weights_only:   # the deterministic biases are trained too (read straight from the layers)
        assert any(g.abs().sum() > 0 for g, p in zip(grads_fast, model.parameters()))


def _model_with(change):
    model, guide, x, y = _setup("mlp")
    change(model)
    return model, guide, x, y


class _OwnLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _OwnReLU(nn.ReLU):
    def forward(self, x):
        return super().forward(x) + 1


@pytest.mark.parametrize("case", ["hook_on_layer", "hook_on_net", "batchnorm", "own_linear", "own_relu",
                                  "not_sequential", "missing_site"])
def test_anything_else_takes_the_hooks(case):
    if case == "hook_on_layer":
        model, guide, x, y = _model_with(lambda m: m.net[1].register_forward_hook(lambda *a: None))
    elif case == "hook_on_net":
        model, guide, x, y = _model_with(lambda m: m.net.register_forward_pre_hook(lambda *a: None))
    elif case in ("batchnorm", "own_linear", "own_relu"):
        torch.manual_seed(0)
        layers = {"batchnorm": [nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)],
                  "own_linear": [_OwnLinear(6, 5), nn.ReLU(), nn.Linear(5, 3)],
                  "own_relu": [nn.Linear(6, 5), _OwnReLU(), nn.Linear(5, 3)]}[case]
        model = pb.BNN(nn.Sequential(*layers), "categorical",
                       stochastic=lambda name, module, param: isinstance(module, nn.Linear))
        guide = pb.guides.MeanField(model)
        setup_guide(model, guide, torch.randn(2, 6), torch.tensor([0, 1]), 10)
    elif case == "not_sequential":
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)

            def forward(self, x):
                return self.b(torch.relu(self.a(x)))
        torch.manual_seed(0)
        model = pb.BNN(Net(), "categorical")
        guide = pb.guides.MeanField(model)
        setup_guide(model, guide, torch.randn(2, 6), torch.tensor([0, 1]), 10)
    else:
        model, guide, x, y = _setup("mlp")
    with local_params(model, guide):
        qs = {name: guide.loc_and_scale(name) for name in model.site_names}
        if case == "missing_site":
            qs.pop(model.site_names[-1])
        assert guide.local_reparameterization
        assert local_reparam_plan(model, qs) is None
        if case == "hook_on_layer":   # and the hook does run in the objective
            calls = []
            model.net[1].register_forward_hook(lambda *a: calls.append(1))
            meanfield.meanfield_loss(model, guide, x, y, 100)
            assert calls == [1]


def test_outside_module_local_mode_the_model_forward_runs(monkeypatch):
    """Under plain SVI (global parameter mode) the shortcut is not taken."""
    model, guide, x, y = _setup("mlp")
    used = []
    monkeypatch.setattr(meanfield, "local_reparam_plan", lambda m, qs: used.append(1))
    loss = meanfield.meanfield_loss(model, guide, x, y, 100)
    assert torch.isfinite(loss) and used == []


def test_fit_takes_the_functional_forward(monkeypatch):
    model, guide, x, y = _setup("cnn")
    used = []

    def plan(m, qs):
        out = local_reparam_plan(m, qs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(meanfield, "local_reparam_plan", plan)
    pb.fit(model, guide, (x, y), epochs=2, batch_size=4, progress=False, num_data=100, lr_schedule="constant")
    assert used and all(used)


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_the_plan_settles_the_setting_as_the_guide_does(setting, monkeypatch):
    """Where the plan applies the objective reparameterises locally exactly when the guide's
    ``local_reparameterization`` says so (``False``: weight noise, no plan)."""
    model, guide, x, y = _setup("mlp")
    guide.local_reparameterization_setting = setting
    used = []
    monkeypatch.setattr(meanfield, "local_reparam_plan",
                        lambda m, sites: used.append(1) or local_reparam_plan(m, sites))
    with local_params(model, guide):
        meanfield.meanfield_loss(model, guide, x, y, 100)
    assert bool(used) == (setting is not False) == guide.local_reparameterization
