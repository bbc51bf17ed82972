"""Per-layer learning rates of MeanField's means (``loc_lr_scaling="fan_in"``).

Adam's first step moves every parameter with a non-zero gradient by ``lr`` (``|m̂/√v̂| = 1``),
so after one step the move of each mean is its learning rate: the tests read the rates
from the moves, under ``pb.fit`` and under ``pyro.infer.SVI``.
"""

import math

import pyro
import pytest
import torch
from pyro.infer import SVI
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.meanfield import REFERENCE_FAN_IN, MeanFieldELBO
from pyro_bnn.training.guide_setup import setup_guide
from pyro_bnn.training.optimizer import default_optimizer

WIDE, NARROW = 400, 16  # fan-ins of the two layers: the first is scaled, the second is not


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(WIDE, NARROW), nn.Tanh(), nn.Linear(NARROW, 3))
    x, y = torch.randn(32, WIDE), torch.randint(0, 3, (32,))
    return pb.BNN(net, likelihood="categorical"), x, y


def _locs(guide):
    return {name: guide.loc_and_raw_scale(name)[0].detach().clone() for name in guide.site_names()}


def _median_moves(guide, before):
    return {name: float((guide.loc_and_raw_scale(name)[0].detach() - before[name]).abs().median())
            for name in guide.site_names()}


def test_factors_follow_the_fan_in():
    model, x, y = _model_and_data()
    guide = pb.guides.MeanField(model)
    setup_guide(model, guide, x, y)
    expected = math.sqrt(REFERENCE_FAN_IN / WIDE)  # 0.5
    assert guide.loc_lr_factors() == pytest.approx(
        {"net.0.weight": expected, "net.0.bias": expected, "net.2.weight": 1.0, "net.2.bias": 1.0})
    factors = guide.learning_rate_factors()
    assert [f for _, f in factors] == pytest.approx([expected, expected])
    assert {id(p) for p, _ in factors} == {id(guide.loc_and_raw_scale(n)[0]) for n in ("net.0.weight", "net.0.bias")}


def test_fit_trains_wide_means_at_the_reduced_rate():
    model, x, y = _model_and_data()
    guide = pb.guides.MeanField(model)
    setup_guide(model, guide, x, y)
    before = _locs(guide)
    lr = 1e-2
    pb.fit(model, guide, (x, y), epochs=1, batch_size=len(x), lr=lr, lr_schedule="constant", progress=False,
           seed=0)
    moves = _median_moves(guide, before)
    factor = math.sqrt(REFERENCE_FAN_IN / WIDE)
    assert moves["net.0.weight"] == pytest.approx(lr * factor, rel=0.02)
    assert moves["net.0.bias"] == pytest.approx(lr * factor, rel=0.02)
    assert moves["net.2.weight"] == pytest.approx(lr, rel=0.02)


def test_scaling_off_trains_every_mean_at_lr():
    model, x, y = _model_and_data()
    guide = pb.guides.MeanField(model, loc_lr_scaling=None)
    setup_guide(model, guide, x, y)
    assert guide.learning_rate_factors() == []
    before = _locs(guide)
    pb.fit(model, guide, (x, y), epochs=1, batch_size=len(x), lr=1e-2, lr_schedule="constant", progress=False,
           seed=0)
    moves = _median_moves(guide, before)
    assert moves["net.0.weight"] == pytest.approx(1e-2, rel=0.02)


def test_svi_with_optim_args_matches_fit_rates():
    model, x, y = _model_and_data()
    pyro.clear_param_store()
    guide = pb.guides.MeanField(model)
    guide(x, y)  # set up, as a Pyro user does before building the optimiser
    before = _locs(guide)
    lr = 1e-2
    svi = SVI(model, guide, pyro.optim.Adam(guide.optim_args(lr)), MeanFieldELBO())
    svi.step(x, y)
    moves = _median_moves(guide, before)
    assert moves["net.0.weight"] == pytest.approx(lr * math.sqrt(REFERENCE_FAN_IN / WIDE), rel=0.02)
    assert moves["net.2.weight"] == pytest.approx(lr, rel=0.02)
    pyro.clear_param_store()


def test_optim_args_before_set_up_is_an_error():
    model, _, _ = _model_and_data()
    with pytest.raises(RuntimeError, match="set up first"):
        pb.guides.MeanField(model).optim_args(1e-2)


def test_optim_args_in_module_local_mode_is_a_clear_error():
    """Pyro's optimiser names a parameter from the global store to call a per-parameter
    callable; module-local parameters have no such name and Pyro failed inside ``step``."""
    model, x, y = _model_and_data()
    guide = pb.guides.MeanField(model)
    guide(x, y)
    pyro.settings.set(module_local_params=True)
    try:
        with pytest.raises(RuntimeError, match="global parameter mode"):
            guide.optim_args(1e-2)
    finally:
        pyro.settings.set(module_local_params=False)


def test_invalid_settings_are_errors():
    model, _, _ = _model_and_data()
    with pytest.raises(ValueError, match="loc_lr_scaling must be 'fan_in' or None, got 'sqrt'"):
        pb.guides.MeanField(model, loc_lr_scaling="sqrt")
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="positive and finite, got 0.0"):
        default_optimizer([p], 1e-2, [(p, 0.0)])


def test_default_optimizer_groups():
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    opt = default_optimizer([a, b, c], 0.1, [(b, 0.5), (c, 0.5)])
    assert [(len(g["params"]), g["lr"]) for g in opt.param_groups] == [(1, 0.1), (2, 0.05)]
