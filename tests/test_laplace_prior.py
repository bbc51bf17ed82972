"""Laplace replaces the model's prior: by default it starts from the model's own Normal prior
(issue 24), so on Pyro's tutorial regression (weights N(0, 1), bias N(0, 10²), known noise)
the Laplace is the exact conjugate posterior; a structure that cannot hold the prior warns."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.laplace import PriorMismatchWarning

SIGMA = 1.0
_ZERO = torch.zeros((), dtype=torch.float64)


@pytest.fixture(autouse=True)
def _float64():
    """float64 throughout (the guide's first θ for a weight-less PyroSample site is drawn in the
    default dtype)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class TutorialRegression(PyroModule):
    """Pyro's Bayesian-regression tutorial model, with a known noise σ."""

    def __init__(self, in_features=3, bias_scale=10.0, obs="obs"):
        super().__init__()
        self.obs = obs
        self.linear = PyroModule[nn.Linear](in_features, 1).double()
        self.linear.weight = PyroSample(dist.Normal(_ZERO, 1.0).expand([1, in_features]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(_ZERO, bias_scale).expand([1]).to_event(1))

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample(self.obs, dist.Normal(mean, SIGMA), obs=y)
        return mean


def _data(n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 2.0 \
        + SIGMA * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def _conjugate(x, y):
    """Closed-form posterior mean, covariance and log evidence (dense linear algebra)."""
    X = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    P0 = torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.01], dtype=x.dtype))
    cov = torch.linalg.inv(X.T @ X / SIGMA ** 2 + P0)
    mean = cov @ X.T @ y / SIGMA ** 2
    marginal = SIGMA ** 2 * torch.eye(len(y), dtype=x.dtype) + X @ torch.linalg.inv(P0) @ X.T
    evidence = dist.MultivariateNormal(torch.zeros(len(y), dtype=x.dtype), marginal).log_prob(y)
    return mean, cov, evidence


def _flat(values):
    return torch.cat([values["linear.weight"].reshape(-1), values["linear.bias"].reshape(-1)])


def _posterior_cov(guide):
    (block,), (delta,) = guide.posterior.blocks, guide.layer_prior_precisions()
    return block.covariance(delta, SIGMA ** -2)


@pytest.mark.parametrize("structure", ["kron", pytest.param("full", marks=pytest.mark.slow)])
def test_default_laplace_is_the_conjugate_posterior(structure):
    """pb.fit's MAP within 1 % of the posterior mean (and of its sd), sds within 1 %, the
    evidence within 1e-3 nats: with the DEFAULT prior options (was: one δ = 0.7525, the
    bias 0.3 posterior sd off, evidence +0.65 nats)."""
    x, y = _data()
    mean, cov, evidence = _conjugate(x, y)
    pyro.set_rng_seed(0)
    model = TutorialRegression()
    guide = pb.guides.Laplace(model, structure)
    pb.fit(model, guide, (x, y), epochs=400, batch_size=len(x), lr=5e-2, progress=False, seed=0)
    assert guide.prior_structure == "sitewise"
    assert torch.allclose(guide.prior_precision.double(), torch.tensor([1.0, 0.01], dtype=torch.float64))
    theta = _flat(guide.median())
    sd = cov.diagonal().sqrt()
    assert ((theta - mean).abs() <= 0.01 * torch.maximum(mean.abs(), sd)).all(), (theta, mean)
    torch.testing.assert_close(_posterior_cov(guide).diagonal().sqrt(), sd, rtol=0.01, atol=0.0)
    assert abs(float(guide.log_evidence()) - float(evidence)) < 1e-3


def test_default_laplace_at_the_exact_map_is_exact_to_rounding():
    """With θ* set to the exact posterior mean the KFAC block (per-site δ, joint [W, b]) gives
    the posterior covariance and the evidence to float64 rounding."""
    x, y = _data()
    mean, cov, evidence = _conjugate(x, y)
    guide = pb.guides.Laplace(TutorialRegression()).fit_curvature((x, y))
    with torch.no_grad():
        guide.theta["linear__weight"].copy_(mean[:3].reshape(1, 3))
        guide.theta["linear__bias"].copy_(mean[3:])
    guide.fit_curvature((x, y))
    torch.testing.assert_close(_posterior_cov(guide), cov, rtol=1e-9, atol=1e-12)
    assert abs(float(guide.log_evidence()) - float(evidence)) < 1e-9 * abs(float(evidence))


def test_uniform_prior_resolves_to_one_delta():
    """All covered sites with the same prior (pb.BNN's IIDNormal): auto is one δ, as before."""
    model = pb.BNN(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)), "gaussian",
                   prior=pb.priors.IIDNormal(0.5), noise=0.1)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    guide = pb.guides.Laplace(model, "kron").fit_curvature((x, y))
    assert guide.prior_structure == "scalar"
    assert float(guide.prior_precision) == pytest.approx(4.0, rel=1e-5)


def test_scalar_structure_that_cannot_hold_the_prior_warns():
    """One δ for sites with prior precisions 1 and 0.01: a PriorMismatchWarning naming the
    sites and the default that fits; no warning when prior_precision= is chosen."""
    x, y = _data()
    with pytest.warns(PriorMismatchWarning, match=r"prior_structure='scalar' cannot represent.*"
                                                  r"'linear.bias': 0.01.*0.7525.*'sitewise'"):
        pb.guides.Laplace(TutorialRegression(), prior_structure="scalar").fit_curvature((x, y))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", PriorMismatchWarning)
        pb.guides.Laplace(TutorialRegression(), prior_structure="scalar",
                          prior_precision=1.0).fit_curvature((x, y))
        pb.guides.Laplace(TutorialRegression()).fit_curvature((x, y))


def test_non_normal_prior_warns():
    """A Laplace(0, 1) prior on the weight: the Gaussian prior cannot represent it."""
    x, y = _data()
    model = TutorialRegression()
    model.linear.weight = PyroSample(dist.Laplace(_ZERO, 1.0).expand([1, 3]).to_event(2))
    with pytest.warns(PriorMismatchWarning, match=r"'linear.weight': a Laplace prior, not a Normal"):
        pb.guides.Laplace(model, "full").fit_curvature((x, y))
