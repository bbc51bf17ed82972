"""The learning rate ``pb.fit`` uses when it is given none: the guide's ``learning_rate(N)``.

MeanField's falls as ``1/√N`` above ``REFERENCE_NUM_DATA`` training points (measured on
Fashion-MNIST 60k, ``docs/results/fmnist_meanfield.md``); every other guide keeps its
``default_lr`` whatever the size; Pyro's own guides get ``fit``'s 1e-3.
"""

import math
import warnings

import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.meanfield import REFERENCE_NUM_DATA
from pyro_bnn.reporting.comparison import describe_configuration


def _problem(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()
    model = pb.BNN(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)), "categorical")
    return model, x, y


def _fit(lr, num_data, seed=0):
    model, x, y = _problem()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        res = pb.fit(model, guide, (x, y), epochs=2, batch_size=16, lr=lr, num_data=num_data, seed=seed,
                     progress=False)
    return res, torch.cat([p.detach().flatten() for p in guide.parameters()])


def test_meanfield_rate_is_the_default_up_to_the_reference_size_then_falls_as_one_over_root_n():
    guide = pb.guides.MeanField(_problem()[0])
    for n in (1, 1348, 5000, REFERENCE_NUM_DATA):
        assert guide.learning_rate(n) == guide.default_lr == 0.05
    assert guide.learning_rate(60_000) == pytest.approx(0.05 / math.sqrt(6), rel=1e-12)  # 0.0204
    assert guide.learning_rate(4 * REFERENCE_NUM_DATA) == pytest.approx(0.025, rel=1e-12)
    with pytest.raises((TypeError, ValueError), match="num_data"):
        guide.learning_rate(0)


def test_fit_trains_at_the_resolved_rate_and_reports_it():
    # lr=None at N = 40,000 (num_data scales the likelihood) is bit-identical to lr=0.025 given
    # explicitly, and differs from the small-data rate 0.05 (the control)
    res_default, theta_default = _fit(None, 4 * REFERENCE_NUM_DATA)
    res_explicit, theta_explicit = _fit(0.025, 4 * REFERENCE_NUM_DATA)
    _, theta_small_rate = _fit(0.05, 4 * REFERENCE_NUM_DATA)
    assert res_default.lr == pytest.approx(0.025, rel=1e-12) and res_explicit.lr == 0.025
    assert torch.equal(theta_default, theta_explicit)
    assert not torch.allclose(theta_default, theta_small_rate)
    # at the data's own size (64 points) the default stays 0.05
    assert _fit(None, None)[0].lr == 0.05


def test_other_guides_keep_their_default_rate_and_pyro_guides_get_fits_own():
    model = _problem()[0]
    for guide in (pb.guides.Laplace(model), pb.guides.Hypernet(pb.BNN(nn.Linear(3, 2), "categorical",
                                                                       weight_norm=True), num_flows=1)):
        assert guide.learning_rate(10 ** 6) == guide.learning_rate(10) == guide.default_lr
    model, x, y = _problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        res = pb.fit(model, AutoNormal(model), (x, y), epochs=1, progress=False)
    assert res.lr == 1e-3


def test_configuration_column_shows_the_rate_the_fit_used():
    model, x, y = _problem()
    guide = pb.guides.MeanField(model)
    res, _ = _fit(None, 4 * REFERENCE_NUM_DATA)
    text = describe_configuration(model, guide, epochs=2, lr=res.lr, batch_size=16)
    assert "Adam lr 0.025 cosine" in text
    assert "default lr" in describe_configuration(model, guide, epochs=2, lr=None, batch_size=16)
