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
from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoNormal
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
    assert math.isfinite(float(replayed.log_prob_sum().detach()))
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
    """Was a crash (gather on float labels): pb.evaluate(predictive="glm") of a Bernoulli model;
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
    mc = pb.evaluate(model, guide, x, y, predictive="glm", link_approx="mc", num_samples=20_000)
    probit = pb.evaluate(model, guide, x, y, predictive="glm_probit")
    assert mc["nll"] == pytest.approx(ref_nll, abs=3e-3)
    assert probit["nll"] == pytest.approx(ref_nll, abs=2e-2)
    assert mc["accuracy"] == pytest.approx(float(((p1 > 0.5).double() == y[:, 0]).double().mean()))


class _NoisyRegression(PyroModule):
    """The tutorial regression with the noise as a latent ``sigma ~ HalfNormal(1)``."""

    def __init__(self):
        super().__init__()
        self.linear = PyroModule[nn.Linear](3, 1).double()
        self.linear.weight = PyroSample(dist.Normal(torch.tensor(0.0), 1.0).expand([1, 3]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(torch.tensor(0.0), 10.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0)))
        mean = self.linear(x).squeeze(-1)                     # weights sampled outside the plate
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


class _FixedBias(PyroModule):
    """The tutorial regression with the bias fixed in the code (the control of conditioning it)."""

    def __init__(self, bias):
        super().__init__()
        self.bias = bias
        self.linear = PyroModule[nn.Linear](3, 1, bias=False).double()
        self.linear.weight = PyroSample(dist.Normal(torch.tensor(0.0), 1.0).expand([1, 3]).to_event(2))

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1) + self.bias
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, 1.0), obs=y)
        return mean


def _conjugate_dense(X, y, prior_var, sigma):
    """Posterior mean and covariance, log evidence of y = Xθ + N(0, σ²), θ ~ N(0, diag(prior_var))."""
    P0 = torch.diag(1 / prior_var)
    cov = torch.linalg.inv(X.T @ X / sigma ** 2 + P0)
    mean = cov @ X.T @ y / sigma ** 2
    marginal = sigma ** 2 * torch.eye(len(y)) + X @ torch.diag(prior_var) @ X.T
    return mean, cov, dist.MultivariateNormal(torch.zeros(len(y)), marginal).log_prob(y)


def _dense_cov(guide):
    (block,), (delta,) = guide.posterior.blocks, guide._block_inputs()[1]
    return block.covariance(delta, guide._kind_and_scale()[2])


def _set_theta(guide, values):
    with torch.no_grad():
        for name, v in values.items():
            guide.theta[name.replace(".", "__")].copy_(v)


@pytest.mark.parametrize("held", ["linear.bias", "sigma"])
def test_a_conditioned_latent_is_held_at_its_value(held):
    """pyro.condition(model, {latent: v}): the curvature, evidence and GLM predictive run the
    network with the latent at v, so the Laplace equals the exact posterior of the model with v
    written into its code (was: a ValueError; the curvature would have redrawn the latent).
    Conditioned bias: the tutorial regression vs the same model with the bias fixed in code;
    conditioned noise: a latent sigma conditioned to 0.7 vs the closed form with σ = 0.7."""
    x, y = _data()
    X = torch.cat([x, torch.ones(len(x), 1)], 1)
    if held == "linear.bias":
        value = torch.tensor([2.0])
        model = pyro.condition(TutorialRegression(), data={held: value})
        control = _FixedBias(value)
        mean, cov, evidence = _conjugate_dense(x, y - 2.0, torch.ones(3), 1.0)
        sites = {"linear.weight": mean.reshape(1, 3)}
    else:
        value = torch.tensor(0.7)
        model = pyro.condition(_NoisyRegression(), data={held: value})
        control = None
        mean, cov, evidence = _conjugate_dense(X, y, torch.tensor([1.0, 1.0, 1.0, 100.0]), 0.7)
        sites = {"linear.weight": mean[:3].reshape(1, 3), "linear.bias": mean[3:]}
    guide = pb.guides.Laplace(model, "full")
    pb.fit(model, guide, (x, y), epochs=400, batch_size=len(x), lr=5e-2, progress=False, seed=0)
    assert held not in guide.site_shapes
    theta = torch.cat([guide.median()[k].reshape(-1) for k in sites])
    sd = cov.diagonal().sqrt()
    assert ((theta - mean).abs() <= 0.01 * torch.maximum(mean.abs(), sd)).all(), (theta, mean)
    _set_theta(guide, sites)                       # at the exact MAP: exact to rounding
    guide.fit_curvature((x, y))
    torch.testing.assert_close(_dense_cov(guide), cov, rtol=1e-8, atol=1e-12)
    assert float(guide.log_evidence()) == pytest.approx(float(evidence), rel=1e-9)
    f, fcov = guide.functional_covariance(x)
    design = x if held == "linear.bias" else X
    torch.testing.assert_close(f.squeeze(-1), design @ mean + (2.0 if held == "linear.bias" else 0.0))
    torch.testing.assert_close(fcov.reshape(-1), ((design @ cov) * design).sum(-1), rtol=1e-8, atol=1e-12)
    if control is not None:
        ref = pb.guides.Laplace(control, "full").fit_curvature((x, y))
        _set_theta(ref, sites)
        ref.fit_curvature((x, y))
        assert float(guide.log_evidence()) == pytest.approx(float(ref.log_evidence()), rel=1e-12)
        torch.manual_seed(0)
        ours = pb.evaluate(model, guide, x, y)
        torch.manual_seed(0)
        theirs = pb.evaluate(control, ref, x, y)
        assert ours.pop("predictive") == theirs.pop("predictive") == "glm-mc(64)"
        assert ours == pytest.approx(theirs, rel=1e-9)
    else:
        assert guide.likelihood_kind() == ("gaussian", pytest.approx(0.7))


@pytest.mark.parametrize("s", [0.5, pytest.param(3.0, marks=pytest.mark.slow)])
def test_scaled_model_evidence_is_the_closed_form(s):
    """poutine.scale(model, s) scales the whole log joint (Pyro's semantics): the Laplace of
    p(y, θ)^s, exact for the linear-Gaussian model: mode = the posterior mean (pb.fit's MAP),
    covariance Σ/s, log ∫ p(y, θ)^s dθ = s·log p(y, θ*) + d/2·log 2π − ½·log det(sΣ⁻¹)
    (was: s ignored by the curvature and evidence, silently; the old test used s = 1)."""
    x, y = _data()
    mean, cov, evidence = _conjugate(x, y)
    d = len(mean)
    X = torch.cat([x, torch.ones(len(x), 1)], 1)
    prior = dist.Normal(torch.zeros(d), torch.tensor([1.0, 1.0, 1.0, 10.0]))
    log_joint = dist.Normal(X @ mean, 1.0).log_prob(y).sum() + prior.log_prob(mean).sum()
    closed = s * log_joint + 0.5 * d * math.log(2 * math.pi) - 0.5 * torch.logdet(torch.linalg.inv(cov) * s)
    assert abs(float(closed) - float(evidence)) > 0.5          # the scale matters here
    model = poutine.scale(TutorialRegression(), scale=s)
    guide = pb.guides.Laplace(model, "full")
    pb.fit(model, guide, (x, y), epochs=400, batch_size=len(x), lr=5e-2, progress=False, seed=0)
    theta = _flat(guide.median())
    sd = cov.diagonal().sqrt()
    assert ((theta - mean).abs() <= 0.01 * torch.maximum(mean.abs(), sd)).all(), (theta, mean)
    _set_theta(guide, {"linear.weight": mean[:3].reshape(1, 3), "linear.bias": mean[3:]})
    guide.fit_curvature((x, y))
    torch.testing.assert_close(_dense_cov(guide), cov / s, rtol=1e-8, atol=1e-12)
    assert float(guide.log_evidence()) == pytest.approx(float(closed), rel=1e-9)
    # the evidence's gradient in δ is that of the scaled model too: δ by the evidence is its maximiser
    grad = torch.autograd.functional.jacobian(
        lambda d_: guide.log_evidence(d_), guide.prior_precision.detach().clone())

    def exact(delta):
        var = torch.cat([1 / delta[0].expand(3), 1 / delta[1:]])
        P = X.T @ X + torch.diag(1 / var)
        th = torch.linalg.solve(P, X.T @ y)
        lj = dist.Normal(X @ th, 1.0).log_prob(y).sum() + dist.Normal(0, var.sqrt()).log_prob(th).sum()
        return s * lj + 0.5 * d * math.log(2 * math.pi) - 0.5 * torch.logdet(s * P)

    # exact() re-centres θ* at each δ; at δ₀ θ* is the MAP, so its gradient equals the fixed-θ one
    torch.testing.assert_close(grad, torch.autograd.functional.jacobian(exact, guide.prior_precision.detach().clone()),
                               rtol=1e-6, atol=1e-9)


def _autoguidelist(make_noise_guide):
    model = _NoisyRegression()
    guides = AutoGuideList(model)
    laplace = pb.guides.Laplace(poutine.block(model, hide=["sigma"]), "full")
    guides.append(laplace)
    guides.append(make_noise_guide(poutine.block(model, expose=["sigma"])))
    return model, guides, laplace


@pytest.mark.parametrize("noise_guide", ["AutoDelta", pytest.param("AutoNormal", marks=pytest.mark.slow)])
def test_laplace_in_an_autoguidelist_trains_under_svi_and_predicts(noise_guide):
    """Laplace on the weights beside AutoDelta / AutoNormal on the noise: trains under plain SVI
    (was: a ValueError), fit_curvature holds sigma at the other guide's median, so the Laplace
    equals the exact posterior given that σ (and a Laplace of the model conditioned on it), and
    Predictive draws both."""
    x, y = _data()
    pyro.clear_param_store()
    model, guides, laplace = _autoguidelist(AutoDelta if noise_guide == "AutoDelta" else AutoNormal)
    svi = SVI(model, guides, pyro.optim.Adam({"lr": 5e-2}), Trace_ELBO())
    pyro.set_rng_seed(0)
    for _ in range(150):
        svi.step(x, y)
    sigma = guides[1].median()["sigma"]
    assert 0.5 < float(sigma) < 3.0, sigma         # trained (not converged: any σ serves the check)
    laplace.fit_curvature((x, y))
    X = torch.cat([x, torch.ones(len(x), 1)], 1)
    _, cov, _ = _conjugate_dense(X, y, torch.tensor([1.0, 1.0, 1.0, 100.0]), float(sigma))
    torch.testing.assert_close(_dense_cov(laplace), cov, rtol=1e-8, atol=1e-12)
    assert laplace.likelihood_kind()[1] == pytest.approx(float(sigma))
    ref = pb.guides.Laplace(pyro.condition(_NoisyRegression(), data={"sigma": sigma}), "full")
    ref.fit_curvature((x, y))
    _set_theta(ref, laplace.median())
    ref.fit_curvature((x, y))
    assert float(laplace.log_evidence()) == pytest.approx(float(ref.log_evidence()), rel=1e-12)
    pyro.set_rng_seed(1)
    num = 500
    out = Predictive(model, guide=guides, num_samples=num, return_sites=["linear.weight", "linear.bias", "sigma",
                                                                         "obs"])(x)
    assert out["obs"].shape == (num, len(x))
    draws = torch.cat([out["linear.weight"].reshape(num, -1), out["linear.bias"].reshape(num, -1)], -1)
    torch.testing.assert_close(draws.var(0), cov.diagonal(), rtol=0.25, atol=0.0)   # 4 sd of a variance
    if noise_guide == "AutoDelta":
        assert torch.equal(out["sigma"].reshape(-1), sigma.expand(num))
    else:
        assert float(out["sigma"].std()) > 0.01                 # drawn from its AutoNormal


def test_hidden_latents_without_an_owner_are_a_clear_error():
    """Genuinely unsupported: a latent that poutine.block hides from a stand-alone Laplace guide
    is drawn from its prior by the model on every run; and in an AutoGuideList whose other
    guides give no median for it."""
    x, y = _data()
    with pytest.raises(ValueError, match=r"hides the latent site\(s\) \['sigma'\].*redrawn from its prior"):
        pb.guides.Laplace(poutine.block(_NoisyRegression(), hide=["sigma"])).fit_curvature((x, y))
    model = _NoisyRegression()
    guides = AutoGuideList(model)
    laplace = pb.guides.Laplace(poutine.block(model, hide=["sigma"]), "full")
    guides.append(laplace)
    guides(x, y)
    with pytest.raises(ValueError, match=r"holds the site\(s\) \['sigma'\].*no other guide"):
        laplace.fit_curvature((x, y))


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


def _classifier(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(90, 2, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()           # 3 classes, overlapping
    x = x + 0.4 * torch.randn(90, 2, generator=g)
    torch.manual_seed(seed)
    model = pb.BNN(nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)), "categorical").double()
    return model, x, y


def test_one_predictive_by_default_evaluate_guide_predict_and_grid_search():
    """pb.evaluate's default, guide.predict's default and the validation grid search score the
    same predictive, the Monte-Carlo GLM (was: guide.predict and the grid search used probit):
    on a fixed seed the same function draws, so the same numbers; probit by name
    (predictive="glm_probit", link_approx="probit") gives the other, distinguishable, one."""
    model, x, y = _classifier()
    guide = pb.guides.Laplace(model, "kron")
    pb.fit(model, guide, (x, y), epochs=100, lr=5e-2, progress=False, seed=0)
    S, delta = 100, guide.prior_precision.detach().clone()
    torch.manual_seed(0)
    probs = guide.predict(model, x)                                   # its defaults
    assert probs.shape == (S, len(x), 3)
    nll = -float(probs.mean(0)[torch.arange(len(x)), y].log().mean())
    torch.manual_seed(0)
    assert torch.equal(pb.predict(model, guide, x, num_samples=S), probs)
    torch.manual_seed(0)
    scores = pb.evaluate(model, guide, x, y, num_samples=S)
    assert scores["predictive"] == "glm-mc(100)"
    assert scores["nll"] == pytest.approx(nll, rel=1e-10)
    grid = guide.optimize_prior_precision(method="gridsearch", val=(x, y), grid=[delta])   # seed 0 draws
    assert grid == pytest.approx(nll, rel=1e-10)
    assert torch.equal(guide.prior_precision, delta)
    probit = pb.evaluate(model, guide, x, y, predictive="glm_probit")
    assert abs(probit["nll"] - nll) > 1e-3, (probit["nll"], nll)     # the test tells the two apart
    torch.testing.assert_close(guide.predict(model, x, predictive="glm_probit"),
                               pb.predict(model, guide, x, predictive="glm_probit"), rtol=0, atol=0)
    assert guide.optimize_prior_precision(method="gridsearch", val=(x, y), grid=[delta], link_approx="probit") \
        == pytest.approx(probit["nll"], rel=1e-10)
    with pytest.raises(ValueError, match="glm_probit.*probit link"):
        guide.predict(model, x, predictive="glm_probit", link_approx="mc")
    with pytest.raises(ValueError, match="'glm', 'glm_probit' or 'sample'"):
        guide.predict(model, x, predictive="probit")


def _batchnorm_cnn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4),
                        nn.Dropout(0.3), nn.Linear(4, 3))
    model = pb.BNN(net, "categorical").double()
    bn = net[1]
    with torch.no_grad():                       # running statistics unlike a batch's
        bn.running_mean.copy_(torch.tensor([0.5, -0.3, 0.2]))
        bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
        bn.num_batches_tracked.fill_(7)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(60, 1, 8, 8, generator=g), torch.randint(0, 3, (60,), generator=g)


def _buffers(model):
    return {k: v.clone() for k, v in model.named_buffers()}


def test_fit_curvature_runs_in_eval_mode_and_leaves_mode_and_buffers():
    """A BatchNorm + Dropout CNN left in train mode: fit_curvature and the GLM predictive of
    guide.predict run in eval mode (was train mode: batch statistics, dropped units and the
    running statistics updated by the curvature pass): the buffers stay bit-identical, every
    module's flag as it was, the curvature equals the one of the model put in eval mode by the
    user, and an input's GLM prediction does not depend on its batch."""
    model, x, y = _batchnorm_cnn()
    model.train()
    flags = {name: m.training for name, m in model.named_modules()}
    before = _buffers(model)
    guide = pb.guides.Laplace(model, "kron").fit_curvature((x, y), batch_size=20)
    assert all(torch.equal(before[k], v) for k, v in model.named_buffers())
    assert {name: m.training for name, m in model.named_modules()} == flags
    evidence = guide.log_evidence()
    f, cov = guide.functional_covariance(x)
    model.eval()
    ref = pb.guides.Laplace(model, "kron", init_loc_fn=lambda site: guide.median()[site["name"]])
    ref.fit_curvature((x, y), batch_size=20)
    model.train()
    torch.testing.assert_close(evidence, ref.log_evidence(), rtol=1e-12, atol=0)
    f_ref, cov_ref = ref.functional_covariance(x)
    torch.testing.assert_close((f, cov), (f_ref, cov_ref), rtol=1e-12, atol=1e-14)
    alone = guide.predict(model, x[:5], predictive="glm_probit")
    inside = guide.predict(model, x, predictive="glm_probit")[:, :5]
    torch.testing.assert_close(alone, inside, rtol=0, atol=1e-12)
    assert all(torch.equal(before[k], v) for k, v in model.named_buffers())
    assert {name: m.training for name, m in model.named_modules()} == flags
    # control: in train mode this network's output does depend on the mode (BatchNorm, Dropout)
    with torch.no_grad():
        theta = guide.median()
        train_out = model.run_with(theta, x)
        model.eval()
        eval_out = model.run_with(theta, x)
        model.train()
    assert float((train_out - eval_out).abs().max()) > 1e-2


def test_fit_of_a_fitted_then_svi_moved_laplace_guide_does_not_warn_stale_at_set_up():
    # SVI after pb.fit moves θ off the fitted θ*: the guide says its curvature is stale (the
    # control); a second pb.fit refits the curvature at its end, so its set-up run must not say it
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()
    model = pb.BNN(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)), "categorical")
    guide = pb.guides.Laplace(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=2, batch_size=32, lr=1e-2, progress=False, seed=0)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with pytest.warns(StaleCurvatureWarning, match="stale"):
        for _ in range(3):
            svi.step(x, y)
    assert guide.curvature_is_stale()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pb.fit(model, guide, (x, y), epochs=2, batch_size=32, lr=1e-2, progress=False, seed=0)
    assert not [w for w in caught if issubclass(w.category, StaleCurvatureWarning)], \
        [str(w.message) for w in caught]
    assert not guide.curvature_is_stale()


@pytest.mark.parametrize("make_conv, named", [
    (lambda: nn.Conv2d(2, 4, 3, groups=2), r"a PyroConv2d with groups=2\. Leave such sites out"),
    (lambda: nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"), r"a PyroConv2d with padding_mode='reflect'"),
    (lambda: nn.Conv1d(2, 4, 3), r"belongs to PyroConv1d\. Leave such sites out"),
], ids=["grouped", "reflect-padded", "conv1d"])
def test_unsupported_conv_layers_name_what_rules_them_out(make_conv, named):
    """A grouped or reflect-padded Conv2d was reported as 'belongs to PyroConv2d' after 'supports
    ... nn.Conv2d': the message now names the setting that the curvature does not support."""
    conv = make_conv()  # built under the module's default dtype
    x = torch.randn(8, 2, 5) if isinstance(conv, nn.Conv1d) else torch.randn(8, 2, 5, 5)
    net = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"uninitialised lazy parameters \(LazyLinear 'net\.3'\); run it once"):
        pb.BNN(net)
    net(x)  # materialise the lazy layer, as the message says
    model = pb.BNN(net)
    guide = pb.guides.Laplace(model)
    with pytest.raises(ValueError, match=named):
        guide.fit_curvature((x, torch.randint(0, 3, (8,))))


def test_full_structure_beyond_memory_is_refused_before_training():
    """structure='full' on 2 million weights needs 2 x 16 TB: refused at set-up, naming P, the size and
    the alternatives — not torch's allocator failing after the MAP was trained."""
    from pyro_bnn.model.devices import device_memory_bytes

    assert device_memory_bytes("cpu") > 2 ** 28
    model = pb.BNN(nn.Sequential(nn.Linear(2000, 1000), nn.ReLU(), nn.Linear(1000, 2)))
    guide = pb.guides.Laplace(model, "full")
    with pytest.raises(ValueError, match=r"P = 2,003,002 parameters .* GiB per matrix .*structure='kron' or 'diag'"):
        pb.fit(model, guide, (torch.randn(8, 2000), torch.randint(0, 2, (8,))), epochs=1, progress=False)
    assert not hasattr(guide, "curvature_state")  # refused in set-up, before any step


def test_a_loader_that_drops_examples_is_named_and_every_example_counts_otherwise():
    """``drop_last=True`` leaves the last incomplete batch out of the curvature and evidence:
    warned with the counts; the same data as tensors or a full loader give the exact same fit."""
    _, guide, x, y = _fitted()   # θ at the conjugate posterior mean
    full = float(guide.log_evidence())
    ds = torch.utils.data.TensorDataset(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.fit_curvature(torch.utils.data.DataLoader(ds, batch_size=7))
    assert float(guide.log_evidence()) == pytest.approx(full, rel=1e-12)
    left_out = len(x) % 7
    assert left_out > 0
    with pytest.warns(UserWarning, match=rf"saw {len(x) - left_out:,} of the data set's {len(x):,} examples.*"
                                         rf"leave {left_out} out"):
        guide.fit_curvature(torch.utils.data.DataLoader(ds, batch_size=7, drop_last=True))
    assert float(guide.log_evidence()) != pytest.approx(full, rel=1e-6)
