"""``pb.to_arviz`` keeps the model's precision in the ``posterior`` group.

A float64 model's draws are stored as float64 (they were cast to float32, losing digits
beyond ~7); float32 models are unchanged.  Checked for guide draws through the network
(``predictive="sample"``, MeanField and Laplace) and the Laplace guide's linearised draws
(``predictive="glm"``), against the draws themselves, to the bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.posterior.prediction import sample_latents


def _setup(dtype, guide_name):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)
    model = pb.BNN(net, "categorical").to(dtype)
    x = torch.randn(10, 3, dtype=dtype)
    y = torch.randint(0, 3, (10,))
    if guide_name == "Laplace":
        guide = pb.guides.Laplace(model)
        guide.fit_curvature((x, y))
    else:
        guide = pb.guides.MeanField(model)
        guide(x, y)                                            # sets the guide up
    return model, guide, x, y


@pytest.mark.parametrize("guide_name,predictive", [("MeanField", "sample"), ("Laplace", "sample"),
                                                   ("Laplace", "glm")])
@pytest.mark.parametrize("dtype,expected", [(torch.float64, np.float64), (torch.float32, np.float32)])
def test_posterior_group_keeps_the_model_dtype(guide_name, predictive, dtype, expected):
    model, guide, x, y = _setup(dtype, guide_name)
    dt = pb.to_arviz(model, guide, x, y, num_samples=4, predictive=predictive, seed=0)
    posterior = dt["posterior"]
    assert set(posterior.data_vars) == set(model.site_names)
    for name in model.site_names:
        assert posterior[name].dtype == expected, (name, posterior[name].dtype)
    assert dt["log_likelihood"]["obs"].dtype == np.float64


def test_float64_draws_are_stored_exactly():
    """The stored draws are the guide's draws, not a float32 rounding of them."""
    model, guide, x, y = _setup(torch.float64, "MeanField")
    dt = pb.to_arviz(model, guide, x, y, num_samples=3, predictive="sample", seed=5)
    with pb.training.seeding.seeded(5):
        first = sample_latents(model, guide, x[:1])
    site = "net.0.weight"
    stored = dt["posterior"][site].values[0, 0]
    expected = first[site].detach().numpy()
    assert stored.dtype == np.float64
    # a float32 copy would differ from the float64 draw by up to ~1e-8 relative
    assert float(np.abs(expected - expected.astype(np.float32)).max()) > 0
    np.testing.assert_array_equal(stored, expected)
