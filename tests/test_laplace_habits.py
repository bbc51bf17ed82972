"""Laplace guide under Pyro habits (issue 24): SVI after fit_curvature, Predictive with a stale
or missing curvature, replayed log densities, the observed site's name, Bernoulli GLM
evaluation, AutoGuideList and handler-wrapped models."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroModule, PyroSample
from test_laplace_prior import TutorialRegression, _conjugate, _data, _flat
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.laplace import StaleCurvatureWarning


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _fitted(obs="obs"):
    x, y = _data()
    model = TutorialRegression(obs=obs)
    guide = pb.guides.Laplace(model).fit_curvature((x, y))
    mean, _, _ = _conjugate(x, y)
    with torch.no_grad():
        guide.theta["linear__weight"].copy_(mean[:3].reshape(1, 3))
        guide.theta["linear__bias"].copy_(mean[3:])
    return model, guide.fit_curvature((x, y)), x, y


def test_svi_after_fit_curvature_trains_theta_and_marks_the_curvature_stale():
    """Was: 300 SVI steps moved θ by exactly 0.  Now the draws are reparameterised in θ, so
    SVI moves it (here from the exact posterior mean, by the Gaussian's E_q[log p] gradient
    noise), the curvature is then stale: warned under SVI and at Predictive, cleared by
    fit_curvature."""
    model, guide, x, y = _fitted()
    pyro.set_rng_seed(0)
    theta0 = _flat(guide.median()).clone()
    assert not guide.curvature_is_stale()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with pytest.warns(StaleCurvatureWarning, match="fit_curvature"):
        for _ in range(20):
            svi.step(x, y)
    assert float((_flat(guide.median()) - theta0).abs().max()) > 1e-3
    assert guide.curvature_is_stale()
    with pytest.warns(StaleCurvatureWarning, match=r"stale.*fit_curvature"):
        Predictive(model, guide=guide, num_samples=2)(x)
    with pytest.warns(StaleCurvatureWarning):
        guide.predict(model, x)
    guide.fit_curvature((x, y))
    assert not guide.curvature_is_stale()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)
        Predictive(model, guide=guide, num_samples=2)(x)


def test_svi_with_the_map_objective_moves_theta_to_the_map():
    """Under plain SVI with ``loss=guide.make_objective()`` the guide trains its MAP θ."""
    x, y = _data()
    model = TutorialRegression()
    guide = pb.guides.Laplace(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 5e-2}), guide.make_objective())
    for _ in range(400):
        svi.step(x, y)
    mean, cov, _ = _conjugate(x, y)
    assert ((_flat(guide.median()) - mean).abs() < 0.02 * cov.diagonal().sqrt()).all()


def test_predictive_without_curvature_warns_point_mass():
    x, y = _data()
    model = TutorialRegression()
    guide = pb.guides.Laplace(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCurvatureWarning)    # MAP training: no warning
        svi.step(x, y)
    with pytest.warns(StaleCurvatureWarning, match=r"not fitted.*point mass.*fit_curvature"):
        Predictive(model, guide=guide, num_samples=2)(x)


@pytest.mark.parametrize("structure,kron_bias", [("full", "joint"), ("kron", "joint"),
                                                 ("kron", "separate"), ("diag", "joint")])
def test_replayed_log_q_is_the_gaussian_log_density(structure, kron_bias):
    """Was −inf: ``poutine.replay`` of a Laplace draw gives log N(θ | θ*, P⁻¹) (dense check)."""
    torch.manual_seed(0)
    x, y = torch.randn(20, 2), torch.randn(20, 2)
    model = pb.BNN(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2)), "gaussian", noise=0.5).double()
    guide = pb.guides.Laplace(model, structure, kron_bias=kron_bias, prior_precision=2.0).fit_curvature((x, y))
    tr = poutine.trace(guide).get_trace(x, y)
    replayed = poutine.trace(poutine.replay(guide, tr)).get_trace(x, y)
    theta = {k: v.detach() for k, v in guide.map_values().items()}
    mean = torch.cat([layer.flatten(theta).reshape(-1) for layer in guide.layers])
    blocks, deltas, scale = guide.posterior.blocks, guide.layer_prior_precisions(), 0.5 ** -2
    cov = torch.block_diag(*[b.covariance(d, scale) for b, d in zip(blocks, deltas)]) if structure != "full" \
        else blocks[0].covariance(torch.cat([d.expand(layer.numel) for layer, d in zip(guide.layers, deltas)]),
                                  scale)
    values = {k: tr.nodes[k]["value"] for k in guide.site_shapes}
    draw = torch.cat([layer.flatten(values).reshape(-1) for layer in guide.layers])
    ref = torch.distributions.MultivariateNormal(mean, cov).log_prob(draw)
    assert math.isfinite(float(replayed.log_prob_sum()))
    torch.testing.assert_close(replayed.log_prob_sum().detach(), ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tr.log_prob_sum().detach(), ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(guide.log_density(values).detach(), ref, rtol=1e-9, atol=1e-9)


def test_observed_site_is_taken_from_the_model():
    """A hand-written regression whose observed site is "y" (was: ``model has no observed site
    'obs'``): curvature and evidence exact; a fresh guide set up by Predictive works."""
    model, guide, x, y = _fitted(obs="y")
    _, _, evidence = _conjugate(x, y)
    assert abs(float(guide.log_evidence()) - float(evidence)) < 1e-9 * abs(float(evidence))
    fresh = pb.guides.Laplace(TutorialRegression(obs="y"))
    with pytest.warns(StaleCurvatureWarning, match="not fitted"):
        out = Predictive(fresh.model, guide=fresh, num_samples=3)(x)
    assert set(out) == {"linear.weight", "linear.bias", "y"} and out["y"].shape == (3, len(x))
    assert fresh.site_shapes.keys() == {"linear.weight", "linear.bias"}


class _TwoObservations(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](1, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 1]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        m = self.fc(x).squeeze(-1)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(m, 1.0), obs=y)
            pyro.sample("z", dist.Normal(m, 2.0), obs=None if y is None else 2 * y)


def test_several_observed_sites_need_obs_site():
    x = torch.randn(10, 1)
    y = x[:, 0]
    with pytest.raises(ValueError, match=r"one observed site.*\['y', 'z'\].*obs_site="):
        pb.guides.Laplace(_TwoObservations(), "full").fit_curvature((x, y))
    guide = pb.guides.Laplace(_TwoObservations(), "full", obs_site="y").fit_curvature((x, y))
    assert guide.likelihood_kind()[1] == pytest.approx(1.0)
    with pytest.raises(TypeError, match="obs_site"):
        pb.guides.Laplace(_TwoObservations(), obs_site=1)


def test_bernoulli_glm_evaluate_matches_monte_carlo():
    """Was a crash (gather on float labels): pb.evaluate(method="glm") of a Bernoulli model;
    the MC link equals a Monte Carlo reference over f ~ N(f*, Σ_f), the probit link is close."""
    torch.manual_seed(0)
    x = torch.randn(60, 2)
    y = (x[:, :1] + 0.5 * torch.randn(60, 1) > 0).double()
    model = pb.BNN(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)), "bernoulli").double()
    guide = pb.guides.Laplace(model, "full")
    pb.fit(model, guide, (x, y), epochs=100, lr=5e-2, progress=False, seed=0)
    f, cov = guide.functional_covariance(x)
    g = torch.Generator().manual_seed(1)
    fs = f + cov.squeeze(-1).sqrt() * torch.randn(200_000, *f.shape, generator=g)
    p1 = torch.sigmoid(fs).mean(0).squeeze(-1)
    ref_nll = -float(torch.where(y[:, 0] > 0, p1, 1 - p1).log().mean())
    mc = pb.evaluate(model, guide, x, y, method="glm", link_approx="mc", num_samples=20_000)
    probit = pb.evaluate(model, guide, x, y, method="glm")
    assert mc["nll"] == pytest.approx(ref_nll, abs=3e-3)
    assert probit["nll"] == pytest.approx(ref_nll, abs=2e-2)
    assert mc["accuracy"] == pytest.approx(float(((p1 > 0.5).double() == y[:, 0]).double().mean()))


def test_laplace_in_autoguidelist_refuses_clearly():
    """Laplace for the net and AutoNormal for a noise scale: the noise is hidden from Laplace,
    whose curvature needs it fixed: a clear error naming the site and why."""
    class Noisy(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](1, 1)
            self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 1]).to_event(2))
            self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

        def forward(self, x, y=None):
            s = pyro.sample("sigma", dist.HalfNormal(1.0))
            m = self.fc(x).squeeze(-1)                          # weights sampled outside the plate
            with pyro.plate("data", len(x)):
                pyro.sample("obs", dist.Normal(m, s), obs=y)

    x = torch.randn(20, 1)
    y = 2 * x[:, 0]
    model = Noisy()
    guides = AutoGuideList(model)
    guides.append(pb.guides.Laplace(poutine.block(model, hide=["sigma"]), "full"))
    guides.append(AutoNormal(poutine.block(model, expose=["sigma"])))
    svi = SVI(model, guides, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with pytest.raises(ValueError, match=r"hides the latent site\(s\) \['sigma'\].*redrawn from its prior"):
        svi.step(x, y)


def test_handler_wrapped_models():
    """A poutine-wrapped PyroModule is unwrapped to its network (works); a plain function that
    calls the model says the model must expose its network (was 'belongs to no module')."""
    x, y = _data()
    model = TutorialRegression()
    _, _, evidence = _conjugate(x, y)
    guide = pb.guides.Laplace(poutine.scale(model, 1.0)).fit_curvature((x, y))
    mean, _, _ = _conjugate(x, y)
    with torch.no_grad():
        guide.theta["linear__weight"].copy_(mean[:3].reshape(1, 3))
        guide.theta["linear__bias"].copy_(mean[3:])
    assert float(guide.fit_curvature((x, y)).log_evidence()) == pytest.approx(float(evidence), rel=1e-9)

    def fn(x, y=None):
        return model(x, y)

    with pytest.raises(ValueError, match=r"must be \(or expose\) its nn.Module.*got a function"):
        pb.guides.Laplace(fn).fit_curvature((x, y))
