"""The fused mean-field sample-and-KL node against plain autograd and finite differences."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, kl_divergence

from pyro_bnn.guides import _fused_gaussian as fused
from pyro_bnn.guides._fused_gaussian import can_fuse, sample_and_kl


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _reference(loc, rho, eps, prior_loc, prior_scale, positive):
    sigma = rho.exp() if positive == "exp" else F.softplus(rho)
    kl = kl_divergence(Normal(loc, sigma), Normal(prior_loc.expand(loc.shape), prior_scale.expand(loc.shape)))
    return loc + sigma * eps, kl.sum()


PRIORS = {
    "scalar": lambda shape: (torch.tensor(0.0), torch.tensor(0.7)),
    "scalar_nonzero_loc": lambda shape: (torch.tensor(0.3), torch.tensor(1.5)),
    "per_row": lambda shape: (torch.zeros(shape[0], 1), torch.rand(shape[0], 1) + 0.5),
    "per_weight": lambda shape: (torch.randn(shape), torch.rand(shape) + 0.5),
}


@pytest.mark.parametrize("tensor_constants", [False, True], ids=["cpu_floats", "tensor_path"])
@pytest.mark.parametrize("positive", ["exp", "softplus"])
@pytest.mark.parametrize("prior", sorted(PRIORS))
def test_matches_autograd_value_and_gradient(prior, positive, tensor_constants, float64, monkeypatch):
    if tensor_constants:  # the path a CUDA prior takes (no host read of its value)
        monkeypatch.setattr(fused, "_cpu_floats", lambda prior_loc, prior_scale: None)
    torch.manual_seed(0)
    shape = (5, 4)
    loc = torch.randn(shape, requires_grad=True)
    rho = (torch.randn(shape) - 2).requires_grad_()
    eps = torch.randn(shape)
    prior_loc, prior_scale = PRIORS[prior](shape)
    gw = torch.randn(shape)
    w, kl = sample_and_kl(loc, rho, eps, prior_loc, prior_scale, positive)
    w_ref, kl_ref = _reference(loc, rho, eps, prior_loc, prior_scale, positive)
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((w * gw).sum() + 1.7 * kl, (loc, rho))
    want = torch.autograd.grad((w_ref * gw).sum() + 1.7 * kl_ref, (loc, rho))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("positive", ["exp", "softplus"])
def test_gradcheck_finite_differences(positive, float64):
    torch.manual_seed(1)
    loc = torch.randn(3, 2, requires_grad=True)
    rho = torch.randn(3, 2, requires_grad=True)
    eps = torch.randn(3, 2)
    assert torch.autograd.gradcheck(
        lambda m, r: sample_and_kl(m, r, eps, torch.tensor(0.2), torch.tensor(0.9), positive), (loc, rho))


def test_kl_only_gradient(float64):
    """When the sample is unused (grad_w is None) the KL gradient alone comes back."""
    loc = torch.tensor([0.5, -1.0], requires_grad=True)
    rho = torch.tensor([-1.0, 0.3], requires_grad=True)
    _, kl = sample_and_kl(loc, rho, torch.zeros(2), torch.tensor(0.0), torch.tensor(1.0), "softplus")
    kl.backward()
    sigma = F.softplus(rho.detach())
    torch.testing.assert_close(loc.grad, loc.detach())                      # (μ − 0)/1
    torch.testing.assert_close(rho.grad, (sigma - 1 / sigma) * torch.sigmoid(rho.detach()))


def test_can_fuse():
    loc = torch.zeros(3, 4)
    assert can_fuse(loc, torch.tensor(0.0), torch.tensor(1.0))
    assert can_fuse(loc, torch.zeros(3, 1), torch.ones(4))
    assert not can_fuse(loc, torch.zeros(5), torch.tensor(1.0))            # does not broadcast
    assert not can_fuse(loc, torch.zeros(2, 3, 4), torch.tensor(1.0))      # would grow the site
    assert not can_fuse(loc, torch.tensor(0.0), torch.tensor(1.0, requires_grad=True))
