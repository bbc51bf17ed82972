"""The functional forward of HypernetELBO (``pyro_bnn.guides.hypernet_forward``, issue 27): the
same loss and gradients, bit for bit, as the general ``model.run_with`` path, and the general
path wherever the shortcut does not apply."""

from __future__ import annotations

import pyro
import pytest
import torch
from helpers import spy_on_plan
from pyro.infer import SVI
from torch import nn

import pyro_bnn as pb
import pyro_bnn.guides.hypernet_objective as hypernet_module
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.hypernet_forward import direct_calls_allowed, weight_norm_plan
from pyro_bnn.training.guide_setup import setup_guide


def _model(flatten=False, bias=True, seed=0, random_directions=False):
    torch.manual_seed(seed)
    layers = [nn.Flatten()] if flatten else []
    layers += [nn.Linear(12, 10, bias=bias), nn.ReLU(), nn.Linear(10, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)]
    return pb.BNN(nn.Sequential(*layers), "categorical", weight_norm=True, random_directions=random_directions)


def _data(flatten=False):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 3, 4, generator=gen) if flatten else torch.randn(20, 12, generator=gen)
    return x, torch.randint(0, 3, (20,), generator=gen)


def _loss_and_grads(model, guide, x, y, objective, fast: bool, monkeypatch):
    plan = hypernet_module.weight_norm_plan
    calls = spy_on_plan(monkeypatch, hypernet_module, "weight_norm_plan", fast)
    with local_params(model, guide):
        torch.manual_seed(5)
        loss, extras = objective(model, guide, x, y, 200)
        params = list(model.parameters()) + list(guide.parameters())
        grads = torch.autograd.grad(loss, params)
    monkeypatch.setattr(hypernet_module, "weight_norm_plan", plan)
    return loss, extras, grads, calls


@pytest.mark.parametrize("options, flatten, particles", [
    ({"num_flows": 0}, False, 1),
    ({"num_flows": 2, "hidden": 6, "init_gain": 0.5}, True, 1),
    ({"num_flows": 2, "hidden": 6, "alpha": 0.5}, False, 2),
    ({"num_flows": 1, "hidden": 6, "layout": "paper", "prob_clip": (1e-3, 0.999)}, False, 1),
    ({"num_flows": 2, "hidden": 6, "init_gain": 0.5, "random_directions": True}, True, 1),
    ({"num_flows": 1, "hidden": 6, "random_directions": True}, False, 2),
])
def test_functional_forward_is_bit_identical(options, flatten, particles, monkeypatch):
    x, y = _data(flatten)
    options = dict(options)
    model = _model(flatten, random_directions=options.pop("random_directions", False))
    guide = pb.guides.Hypernet(model, **options)
    setup_guide(model, guide, x[:2], y[:2], 200)
    objective = guide.make_objective(particles)
    fast = _loss_and_grads(model, guide, x, y, objective, True, monkeypatch)
    slow = _loss_and_grads(model, guide, x, y, objective, False, monkeypatch)
    assert fast[3] == [True] and slow[3] == [False]   # each path really ran
    assert torch.equal(fast[0], slow[0])
    assert all(torch.equal(fast[1][k], slow[1][k]) for k in ("nll", "kl"))
    assert all(torch.equal(a, b) for a, b in zip(fast[2], slow[2]))


def test_plan_covers_plain_weight_norm_mlps_only():
    model = _model(bias=False)
    sites = model.site_names
    assert weight_norm_plan(model, sites) is not None
    assert weight_norm_plan(model, sites[:-1]) is None          # a site the plan would not fill
    hooked = _model()
    hooked.net[2].register_forward_hook(lambda *a: None)
    assert weight_norm_plan(hooked, sites) is None               # a hook the direct calls would skip
    hooked = _model()
    hooked.net.register_forward_pre_hook(lambda *a: None)
    assert weight_norm_plan(hooked, sites) is None
    torch.manual_seed(0)
    other = pb.BNN(nn.Sequential(nn.Linear(12, 10), nn.LayerNorm(10), nn.Linear(10, 3)), "categorical",
                   weight_norm=True)
    assert weight_norm_plan(other, other.site_names) is None     # a layer the plan does not know

    class OwnTanh(nn.Tanh):
        def forward(self, x):
            return super().forward(x) * 2

    other = pb.BNN(nn.Sequential(nn.Linear(12, 10), OwnTanh(), nn.Linear(10, 3)), "categorical", weight_norm=True)
    assert weight_norm_plan(other, other.site_names) is None     # a forward of its own
    padded = pb.BNN(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten(),
                                  nn.Linear(2 * 16, 3)), "categorical", weight_norm=True)
    assert weight_norm_plan(padded, padded.site_names) is None   # a padding mode that pads first
    ordinary = pb.BNN(nn.Sequential(nn.Linear(12, 3)), "categorical")
    assert weight_norm_plan(ordinary, ordinary.site_names) is None

    class Custom(pb.BNN):
        def function(self, x):
            return super().function(x) * 2

    torch.manual_seed(0)
    custom = Custom(nn.Sequential(nn.Linear(12, 3)), "categorical", weight_norm=True)
    assert weight_norm_plan(custom, custom.site_names) is None   # a forward of its own


def test_general_path_outside_module_local_mode_and_under_handlers():
    assert not direct_calls_allowed() or not pyro.settings.get("module_local_params")
    with local_params():
        assert direct_calls_allowed()
        with pyro.poutine.trace():
            assert not direct_calls_allowed()


def _spy_on_plans(monkeypatch) -> list:
    """Record every plan the Hypernet objective builds (``None``: the general path)."""
    plans = []
    build = hypernet_module.weight_norm_plan

    def spy(*args):
        plans.append(build(*args))
        return plans[-1]
    monkeypatch.setattr(hypernet_module, "weight_norm_plan", spy)
    return plans


def test_svi_still_trains_the_directions(monkeypatch):
    """Under SVI the general path runs (its parameter capture needs the model's statements)."""
    x, y = _data()
    model = _model()
    guide = pb.guides.Hypernet(model, num_flows=0)
    calls = _spy_on_plans(monkeypatch)
    pyro.clear_param_store()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    svi.step(x, y)   # set-up
    before = model.net[0].weight_v.detach().clone()
    svi.step(x, y)
    assert not torch.equal(before, model.net[0].weight_v.detach())
    assert calls == []


def test_fit_takes_the_functional_forward(monkeypatch):
    x, y = _data()
    model = _model()
    guide = pb.guides.Hypernet(model, num_flows=0)
    used = _spy_on_plans(monkeypatch)
    with pytest.warns(pb.ConvergenceWarning):
        pb.fit(model, guide, (x, y), epochs=1, batch_size=10, progress=False)
    assert used and all(plan is not None for plan in used)


def test_weight_norm_weight_keeps_zero_row_safety():
    """The cheaper zero-norm test (one minimum) takes the same branch as ``(norm < 1e-12).any()``:
    a zero row gives a zero row (the clamped composite), also next to a NaN row."""
    from pyro_bnn.model.weight_norm import weight_norm_weight
    gen = torch.Generator().manual_seed(0)
    g, v = torch.randn(5, generator=gen), torch.randn(5, 7, generator=gen)
    expected = (g / v.norm(dim=1))[:, None] * v
    assert torch.allclose(weight_norm_weight(g, v), expected, rtol=1e-6, atol=0)
    v[2] = 0.0
    w = weight_norm_weight(g, v)
    assert torch.isfinite(w).all() and torch.equal(w[2], torch.zeros(7))
    v[4, 1] = float("nan")
    w = weight_norm_weight(g, v)
    assert torch.equal(w[2], torch.zeros(7)) and torch.isnan(w[4]).all()


@pytest.mark.parametrize("options, particles, random_directions", [
    ({"num_flows": 0}, 1, False), ({"num_flows": 2, "hidden": 6}, 2, False), ({"num_flows": 2, "hidden": 6}, 1, True)])
def test_functional_forward_of_a_convolutional_net_is_bit_identical(options, particles, random_directions, monkeypatch):
    """Weight-norm Conv2d layers, pooling, other activations (their own forward), Flatten; also
    with the directions random (4-D filter directions drawn by the guide)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, stride=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, padding=1),
                        nn.Tanh(), nn.AvgPool2d(1), nn.Flatten(), nn.Linear(4 * 3 * 3, 5), nn.ReLU(), nn.Linear(5, 3))
    model = pb.BNN(net, "categorical", weight_norm=True, random_directions=random_directions)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    guide = pb.guides.Hypernet(model, **options, alpha=0.5 if particles > 1 else 1.0)
    setup_guide(model, guide, x[:2], y[:2], 200)
    assert [kind for kind, *_ in weight_norm_plan(model, model.site_names)[2]][:6] == \
        ["conv2d", "relu", "module", "conv2d", "module", "module"]
    objective = guide.make_objective(particles)
    fast = _loss_and_grads(model, guide, x, y, objective, True, monkeypatch)
    slow = _loss_and_grads(model, guide, x, y, objective, False, monkeypatch)
    assert fast[3] == [True] and slow[3] == [False]
    assert torch.equal(fast[0], slow[0])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], slow[2]))


def _objective_loss_and_grads(model, guide, x, y, particles):
    objective = guide.make_objective(particles)
    with local_params(model, guide):
        torch.manual_seed(5)
        loss, extras = objective(model, guide, x, y, 200)
        params = list(model.parameters()) + list(guide.parameters())
        grads = torch.autograd.grad(loss, params)
    return loss, extras["kl"], grads


@pytest.mark.parametrize("options, particles, random_directions", [
    ({"num_flows": 0}, 1, False),
    ({"num_flows": 2, "hidden": 6, "init_gain": 0.5}, 3, False),
    ({"num_flows": 1, "hidden": 6, "init_gain": 0.5}, 2, True),
])
def test_packed_prior_is_the_per_site_prior_bit_for_bit(options, particles, random_directions, monkeypatch):
    # the N(0, 1) prior computed once over the packed draws against the per-site terms
    # (the packed path switched off), values and gradients; and the packed path really ran
    x, y = _data()
    model = _model(random_directions=random_directions)
    guide = pb.guides.Hypernet(model, **options)
    setup_guide(model, guide, x[:2], y[:2], 200)
    per_site = hypernet_module._prior_log_prob
    calls = []
    monkeypatch.setattr(hypernet_module, "_prior_log_prob", lambda *a: calls.append(a[1]) or per_site(*a))
    packed = _objective_loss_and_grads(model, guide, x, y, particles)
    assert calls == []   # every site's prior came from the packed terms
    monkeypatch.setattr(hypernet_module, "_packed_standard_normal_log_prob", lambda *a: None)
    plain = _objective_loss_and_grads(model, guide, x, y, particles)
    assert len(calls) == len(guide.site_names())
    assert torch.equal(packed[0], plain[0]) and torch.equal(packed[1], plain[1])
    assert all(torch.equal(a, b) for a, b in zip(packed[2], plain[2]))


def test_packed_prior_only_for_a_standard_normal_prior():
    # a prior other than N(0, 1) on the sites: no packed path (the per-site terms keep their scale)
    x, y = _data()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))
    model = pb.BNN(net, "categorical", weight_norm=True, weight_norm_precision=4.0)
    guide = pb.guides.Hypernet(model, num_flows=0)
    setup_guide(model, guide, x[:2], y[:2], 200)
    packed = torch.randn(2, guide.flow.dim)
    values = guide.unpack(packed)
    assert hypernet_module._packed_standard_normal_log_prob(model, values, packed) is None
    # the same sites under N(0, 1): the packed terms are the closed form of N(0, I)
    standard = pb.BNN(nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3)), "categorical",
                      weight_norm=True)
    got = hypernet_module._packed_standard_normal_log_prob(standard, values, packed)
    want = torch.distributions.Normal(0.0, 1.0).log_prob(packed).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # values that do not cover the packed draws, or another number of draws: no packed path
    assert hypernet_module._packed_standard_normal_log_prob(standard, values, packed[:, :-1]) is None
    assert hypernet_module._packed_standard_normal_log_prob(standard, values, packed[:1]) is None


def test_objective_honours_an_overridden_sampler():
    # a subclass that changes how draws are made: the objective uses its draws (no packed shortcut)
    class Shifted(pb.guides.Hypernet):
        def sample_with_log_prob(self, num_samples=1):
            values, log_q = super().sample_with_log_prob(num_samples)
            return {name: v + 1.0 for name, v in values.items()}, log_q

    x, y = _data()
    losses = []
    for cls in (pb.guides.Hypernet, Shifted):
        model = _model()
        guide = cls(model, num_flows=0)
        setup_guide(model, guide, x[:2], y[:2], 200)
        losses.append(_objective_loss_and_grads(model, guide, x, y, 1)[0])
    assert not torch.equal(losses[0], losses[1])
    # and its values are those the objective scores: the same loss as log_weights of its draws
    torch.manual_seed(5)
    with local_params(model, guide):
        values, log_q = guide.sample_with_log_prob(1)
        want = -hypernet_module.log_weights(model, values, log_q, x, y, 200)[0].reshape(())
    torch.testing.assert_close(losses[1], want, rtol=1e-6, atol=1e-4)
