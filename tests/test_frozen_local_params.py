"""Frozen layers (``requires_grad=False``, kept fixed by ``pb.BNN``) under Pyro's
``module_local_params=True`` and plain ``SVI``.

``PyroModule`` emits a ``param`` statement for every parameter, frozen ones included, and
``SVI`` asks each for ``value.unconstrained()``; pyro_bnn's guides gave that reference only to
trainable parameters, so a step crashed with "'Parameter' object has no attribute
'unconstrained'".  The frozen parameters must get it and still stay where they are.
"""

import copy
import io

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_bnn as pb

GUIDES = ["MeanField", "Laplace", "Symmetrized", "Hypernet"]


@pytest.fixture
def module_local():
    """Pyro's module-local parameters for one test; the previous setting is restored."""
    old = pyro.settings.get("module_local_params")
    pyro.settings.set(module_local_params=True)
    yield
    pyro.settings.set(module_local_params=old)


def _data():
    torch.manual_seed(0)
    return torch.randn(32, 6), torch.randint(0, 3, (32,))


def _make(name):
    """A frozen first layer before a permutable hidden layer (for Symmetrized)."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 3))
    net[0].requires_grad_(False)
    model = pb.BNN(net, likelihood="categorical", weight_norm=name == "Hypernet")
    return model, getattr(pb.guides, name)(model)


def _frozen(model) -> dict:
    return {name: p for name, p in model.named_parameters() if not p.requires_grad}


def _snapshot(params: dict) -> dict:
    return {name: p.detach().clone() for name, p in params.items()}


def _assert_fixed(model, before: dict):
    frozen = _frozen(model)
    assert frozen.keys() == before.keys()
    for name, p in frozen.items():
        assert not p.requires_grad and p.grad is None
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=f"frozen {name} moved")


@pytest.mark.parametrize("name", GUIDES)
def test_plain_svi_trains_around_frozen_layer(module_local, name):
    x, y = _data()
    model, guide = _make(name)
    assert set(_frozen(model)) == {"net.0.weight", "net.0.bias"}
    before = _snapshot(_frozen(model))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    svi.step(x, y)   # sets the guide up
    start = _snapshot(dict(guide.named_parameters()))
    assert start
    for _ in range(2):
        svi.step(x, y)
    _assert_fixed(model, before)
    trained = dict(guide.named_parameters())
    assert any(not torch.equal(trained[k].detach(), v) for k, v in start.items())  # the guide did train


@pytest.mark.parametrize("name", ["MeanField", "Laplace"])
def test_fit_after_svi_keeps_frozen_layer(module_local, name):
    x, y = _data()
    model, guide = _make(name)
    before = _snapshot(_frozen(model))
    SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO()).step(x, y)
    pb.fit(model, guide, (x, y), epochs=2, batch_size=16, progress=False)
    _assert_fixed(model, before)


def test_saved_and_loaded_as_before(module_local):
    """After plain SVI steps: the model's state_dict holds the frozen values (as it always
    did), the guide's none of them; pickling and copying work, and the loaded layer is frozen."""
    x, y = _data()
    model, guide = _make("MeanField")
    before = _snapshot(_frozen(model))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for _ in range(2):
        svi.step(x, y)
    state = model.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    assert not any(key.endswith(("net.0.weight", "net.0.bias")) for key in guide.state_dict())

    fresh, _ = _make("MeanField")
    with torch.no_grad():
        for p in _frozen(fresh).values():
            p.zero_()
    fresh.load_state_dict(state)
    _assert_fixed(fresh, before)

    buffer = io.BytesIO()
    torch.save((model, guide), buffer)
    buffer.seek(0)
    loaded, loaded_guide = torch.load(buffer, weights_only=False)
    _assert_fixed(loaded, before)
    copied, copied_guide = copy.deepcopy((model, guide))
    SVI(copied, copied_guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO()).step(x, y)
    _assert_fixed(copied, before)
    _assert_fixed(model, before)


def test_global_store_gets_no_frozen_parameter_from_fit():
    """In Pyro's global mode ``fit`` publishes the trained parameters, not the frozen ones."""
    x, y = _data()
    model, guide = _make("MeanField")
    before = _snapshot(_frozen(model))
    pb.fit(model, guide, (x, y), epochs=1, batch_size=16, progress=False)
    names = set(pyro.get_param_store().keys())
    assert names and not any(name.startswith("net.0.") for name in names)
    _assert_fixed(model, before)
