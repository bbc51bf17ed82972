"""The default prior of pb.BNN (issue 26): FanInNormal(DEFAULT_PRIOR_GAIN), N(0, gain²/fan_in)."""

import math

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.priors import DEFAULT_PRIOR_GAIN, FanInNormal, default_prior


def test_default_gain_is_four():
    assert DEFAULT_PRIOR_GAIN == 4.0
    prior = default_prior()
    assert isinstance(prior, FanInNormal) and float(prior.gain) == 4.0
    assert default_prior() is not prior  # a fresh module each call, no shared state


def test_default_prior_scale_per_layer():
    """σ = 4/√fan_in for every weight and bias: a bias takes its layer's fan-in (Linear:
    in_features; Conv2d: in_channels·kh·kw)."""
    net = nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 200), nn.ReLU(),
                        nn.Linear(200, 10))
    model = pb.BNN(net, "categorical")
    expected = {"net.0.weight": 75, "net.0.bias": 75, "net.3.weight": 96, "net.3.bias": 96,
                "net.5.weight": 200, "net.5.bias": 200}
    assert model.site_names == list(expected)
    for site, fan_in in expected.items():
        loc, scale = model.site_normal_prior(site)
        assert float(loc) == 0.0
        assert float(scale) == pytest.approx(4.0 / math.sqrt(fan_in), rel=1e-6), site
        d = model.site_prior(site)
        assert d.event_shape == model._initial_values[site].shape
        assert float(d.base_dist.scale.reshape(-1)[0]) == pytest.approx(4.0 / math.sqrt(fan_in), rel=1e-6)


def test_explicit_prior_still_wins():
    model = pb.BNN(nn.Sequential(nn.Linear(784, 10)), "categorical", prior=pb.priors.IIDNormal(1.0))
    assert float(model.site_normal_prior("net.0.weight")[1]) == 1.0


@pytest.mark.parametrize("width", [16, 1024])
def test_prior_preactivation_variance_is_independent_of_width(width):
    """The property the default is chosen for: with inputs of E[x²] = 1 the prior variance
    of a unit's pre-activation w·x + b is gain²(width + 1)/width ≈ 16 for any width (the old
    N(0, 1) default gave width + 1: 17 and 1,025).  4,000 prior draws: the sample variance
    has a relative standard error of √(2/4000) = 2.2 %; the tolerance is 9 % (4 SE)."""
    torch.manual_seed(0)
    model = pb.BNN(nn.Linear(width, 1), "gaussian", noise=1.0)
    draws = 4000
    w = model.site_prior("net.weight").sample((draws,)).reshape(draws, width)
    b = model.site_prior("net.bias").sample((draws,)).reshape(draws)
    x = torch.ones(width)
    pre = w @ x + b
    exact = DEFAULT_PRIOR_GAIN ** 2 * (width + 1) / width
    assert float(pre.var()) == pytest.approx(exact, rel=0.09)
    old = pb.BNN(nn.Linear(width, 1), "gaussian", noise=1.0, prior=pb.priors.IIDNormal(1.0))
    w_old = old.site_prior("net.weight").sample((draws,)).reshape(draws, width)
    assert float((w_old @ x).var()) == pytest.approx(width, rel=0.09)  # the control: grows with width
