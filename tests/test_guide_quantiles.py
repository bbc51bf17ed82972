"""``guide.quantiles`` / ``guide.median`` (Pyro's AutoGuide API) for the guides without closed-form
marginals: Hypernet (a flow; Pyro's own raises a bare NotImplementedError) and Laplace (KFAC).

References: the Gaussian a Hypernet without blocks is (z = μ + softplus(ρ) ε, exactly), and the
closed-form Bayesian linear regression posterior, which Laplace reproduces exactly.
"""

import math

import pytest
import torch
from test_laplace_prior import SIGMA, TutorialRegression, _conjugate, _data
from torch import nn

import pyro_bnn as pb


@pytest.fixture
def float64():
    """float64 throughout (the Laplace guide's first θ of a weight-less PyroSample site is drawn in
    the default dtype), as in test_laplace_prior."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


Z = {0.05: -1.6448536269514722, 0.5: 0.0, 0.95: 1.6448536269514722}


def _hypernet(num_flows):
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)), weight_norm=True)
    guide = pb.guides.Hypernet(model, num_flows=num_flows, hidden=8)
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    pb.fit(model, guide, (x, y), epochs=3, progress=False)
    return guide


def test_hypernet_quantiles_match_its_gaussian_without_blocks():
    guide = _hypernet(num_flows=0)
    loc = guide.unpack(guide.flow.affine.loc.detach())
    sigma = guide.unpack(guide.flow.affine.scale.detach())
    num = 20_000
    out = guide.quantiles(list(Z), num_samples=num)
    assert set(out) == set(guide.site_names()) == {"net.0.weight_g", "net.2.weight_g"}
    for site, values in out.items():
        assert values.shape == (3, *loc[site].shape)
        for k, (q, z) in enumerate(Z.items()):
            # standard error of an empirical quantile: sqrt(q(1-q)/S) / φ(z) in units of σ
            se = math.sqrt(q * (1 - q) / num) / math.exp(-z * z / 2) * math.sqrt(2 * math.pi)
            err = (values[k] - (loc[site] + z * sigma[site])) / sigma[site]
            assert err.abs().max() < 5 * se, (site, q, err.abs().max(), se)


def test_hypernet_quantiles_are_reproducible_and_leave_the_random_state_alone():
    guide = _hypernet(num_flows=2)
    state = torch.get_rng_state()
    first = guide.quantiles([0.1, 0.9])
    assert torch.equal(torch.get_rng_state(), state)
    again = guide.quantiles([0.1, 0.9])
    other = guide.quantiles([0.1, 0.9], seed=1)
    for site in first:
        assert torch.equal(first[site], again[site])
        assert (first[site][0] <= first[site][1]).all()
        assert not torch.equal(first[site], other[site])
    median = guide.median()
    assert all(torch.equal(median[s], guide.quantiles([0.5])[s][0]) for s in median)
    with pytest.raises(ValueError, match=r"numbers in \[0, 1\]"):
        guide.quantiles([0.5, 1.5])
    with pytest.raises(ValueError, match="num_samples"):
        guide.quantiles([0.5], num_samples=1)
    with pytest.raises(RuntimeError, match="set up first"):
        pb.guides.Hypernet(pb.BNN(nn.Sequential(nn.Linear(2, 2)), weight_norm=True)).quantiles([0.5])


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_laplace_quantiles_match_the_closed_form_posterior(structure, float64):
    x, y = _data()
    model = TutorialRegression()
    mean, cov, _ = _conjugate(x, y)
    guide = pb.guides.Laplace(model, structure).fit_curvature((x, y))
    with torch.no_grad():  # θ* at the exact posterior mean: the Laplace posterior is then exact
        guide.theta["linear__weight"].copy_(mean[:3].reshape(1, 3))
        guide.theta["linear__bias"].copy_(mean[3:])
    guide.fit_curvature((x, y))
    num = 20_000
    out = guide.quantiles(list(Z), num_samples=num)
    if structure == "kron":  # the one Kronecker block of a single-output layer is the full GGN
        sd = cov.diagonal().sqrt()
    else:  # the diagonal GGN's own posterior: 1 / (diag(XᵀX)/σ² + δ)
        sd = guide.posterior.blocks[0].covariance(guide.layer_prior_precisions()[0], SIGMA ** -2).diagonal().sqrt()
    got = torch.cat([out["linear.weight"].reshape(3, -1), out["linear.bias"].reshape(3, -1)], 1)
    assert torch.allclose(got[1], mean, atol=1e-12)  # the median is θ*, exactly
    for k, z in enumerate(Z.values()):
        if z:  # σ̂ from 20,000 draws: relative standard error 1/√(2S) = 0.5 %
            assert torch.allclose((got[k] - mean) / (z * sd), torch.ones_like(sd), atol=0.03)
    state = torch.get_rng_state()
    assert torch.equal(guide.quantiles([0.2])["linear.weight"], guide.quantiles([0.2])["linear.weight"])
    assert torch.equal(torch.get_rng_state(), state)


def test_laplace_quantiles_repeat_the_point_estimates_and_need_the_curvature():
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    guide = pb.guides.Laplace(model, subset="last_layer")
    guide(torch.randn(2, 4), None)  # set up: the MAP point, no curvature yet
    with pytest.raises(ValueError, match="curvature is not fitted"):
        guide.quantiles([0.5])
    pb.fit(model, guide, (torch.randn(30, 4), torch.randint(0, 3, (30,))), epochs=2, lr=1e-2, progress=False)
    out, theta = guide.quantiles([0.05, 0.95]), guide.median()
    assert torch.equal(out["net.0.weight"], theta["net.0.weight"].expand(2, 5, 4))
    assert (out["net.2.weight"][0] < theta["net.2.weight"]).all() and (out["net.2.weight"][1] > theta["net.2.weight"]).all()
