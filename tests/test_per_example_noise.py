"""MeanField's per-example weight noise (``pyro_bnn.guides.local_reparam_forward``) estimates the
true ELBO: local reparameterisation on Linear layers over ``(batch, features)``, Flipout on
convolutions and on Linear layers over more axes, and σ = 0 for weights the model's pruning masks
remove.

Each check compares the mean of the default objective with the mean of the weight-noise
objective (``local_reparameterization=False``: one weight draw per step, an unbiased estimate of
the negative ELBO by construction) over fixed-seed draws, within 4 standard errors of the
difference.  The convolutional cases failed this before Flipout: local reparameterisation drew the
noise of one image's positions independently although they share one weight draw (a CNN with
global average pooling: −ELBO 1,094 ± 1 against 1,130 ± 5 by weight noise, 400 digits), and the
pruned case failed by 10× (the pruned weights' σ still added noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.pruning import prune_, unprune_
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.local_reparam_forward import add_layer_noise, noise_parameters
from pyro_bnn.guides.meanfield import meanfield_loss
from pyro_bnn.training.loop import setup_guide

DRAWS = 400


def _digits(n, shape):
    data = pb.datasets.digits()
    x, y = data.train
    return x[:n].reshape(n, *shape), y[:n]


def _objective_draws(model, guide, x, y, setting, draws=DRAWS, seed=0):
    guide.local_reparameterization_setting = setting
    torch.manual_seed(seed)
    with torch.no_grad(), local_params(model, guide):
        values = torch.stack([meanfield_loss(model, guide, x, y, len(x)) for _ in range(draws)])
    return values.mean().item(), values.std().item() / draws ** 0.5


def _assert_same_expectation(model, guide, x, y):
    fast, fast_se = _objective_draws(model, guide, x, y, "auto")
    ref, ref_se = _objective_draws(model, guide, x, y, False, seed=1)
    se = (fast_se ** 2 + ref_se ** 2) ** 0.5
    assert abs(fast - ref) < 4 * se, (fast, fast_se, ref, ref_se)
    return fast_se, ref_se


NETS = {
    # the positions of one image combined by global pooling: local reparameterisation was biased here
    "conv_global_pool": (lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                               nn.Flatten(), nn.Linear(8, 10)), (1, 8, 8), 0.5),
    "conv_groups_no_bias": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                                                  nn.Conv2d(4, 4, 3, groups=2, bias=False), nn.ReLU(),
                                                  nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, 10)), (1, 8, 8), 0.4),
    "conv1d_strided": (lambda: nn.Sequential(nn.Conv1d(1, 3, 5, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(90, 10)),
                       (1, 64), 0.3),
    # a Linear layer over (batch, rows, features): the rows of one example share its weights
    "linear_on_rows": (lambda: nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Flatten(), nn.Linear(48, 10)),
                       (8, 8), 0.5),
}


@pytest.mark.parametrize("kind", sorted(NETS))
def test_per_example_noise_estimates_the_elbo(kind):
    make, shape, init_scale = NETS[kind]
    x, y = _digits(200, shape)
    torch.manual_seed(0)
    model = pb.BNN(make(), "categorical")
    guide = pb.guides.MeanField(model, init_scale=init_scale)
    setup_guide(model, guide, x[:2], y[:2], len(x))
    assert guide.local_reparameterization
    fast_se, ref_se = _assert_same_expectation(model, guide, x, y)
    assert fast_se < ref_se  # the lower-variance estimator: its point


def test_flipout_draws_one_weight_per_example_shared_by_its_positions():
    """A 1×1 convolution with one input channel and no bias: output = w · x at every position, so
    the ratio output / input is the same at all positions of one image (one weight draw per
    example), and over calls it is distributed as the weight, N(μ, σ²)."""
    layer = nn.Conv2d(1, 1, 1, bias=False)
    mu, sigma = torch.tensor([[[[0.3]]]]), torch.tensor([[[[0.7]]]])
    params = noise_parameters(layer, sigma, None)
    torch.manual_seed(0)
    draws = []
    for _ in range(2000):
        x = torch.rand(3, 1, 3, 3) + 0.5
        out = add_layer_noise(F.conv2d(x, mu), x, layer, F.conv2d, params, torch.randn_like)
        ratio = (out / x).reshape(3, 9)
        torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
        draws.append(ratio[0, 0])
    w = torch.stack(draws)
    assert abs(w.mean().item() - 0.3) < 4 * 0.7 / 2000 ** 0.5
    assert abs(w.std().item() / 0.7 - 1) < 0.06


def test_pruned_weights_add_no_noise_and_get_no_likelihood_gradient():
    x, y = _digits(200, (64,))
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), "categorical")
    guide = pb.guides.MeanField(model, init_scale=0.3)
    setup_guide(model, guide, x[:2], y[:2], len(x))
    handle = prune_(model, guide, fraction=0.9)
    try:
        _assert_same_expectation(model, guide, x, y)
        # everything pruned: the objective's gradient in ρ is the KL's alone (σ² − 1 for N(0, 1))
        unprune_(model)
        prune_(model, guide, fraction=1.0)
        guide.local_reparameterization_setting = "auto"
        with local_params(model, guide):
            loss = meanfield_loss(model, guide, x, y, len(x))
            rhos = [guide.loc_and_raw_scale(s)[1] for s in model.site_names]
            grads = torch.autograd.grad(loss, rhos)
            for rho, grad in zip(rhos, grads):
                torch.testing.assert_close(grad, rho.exp() ** 2 - 1, atol=1e-5, rtol=1e-5)
    finally:
        unprune_(model)
    assert handle.masks
