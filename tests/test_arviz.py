"""pb.to_arviz and per-draw guide densities, for every registered guide and Pyro autoguides.

Each guide is trained once (module fixture) on 200 digits with a 64-4-10 MLP; the DataTree
holds 60 draws on 120 training points, enough for PSIS (tail of at least 5 draws).
"""

import math
import warnings
from contextlib import contextmanager

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from helpers import HandWritten
from pyro import poutine
from pyro.infer.autoguide import AutoDelta, AutoLowRankMultivariateNormal, AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides import init_to_network, registered_guides
from pyro_bnn.posterior.arviz import (
    MIN_PSIS_DRAWS,
    MIN_PSIS_TAIL,
    loo_approximate,
    psis_loo,
    psis_loo_pointwise,
)
from pyro_bnn.posterior.guide_density import guide_log_density, sample_with_log_density

S, N = 60, 120
PYRO_GUIDES = {
    "AutoNormal": lambda m: AutoNormal(m, init_loc_fn=init_to_network(m), init_scale=0.01),
    "AutoLowRank": lambda m: AutoLowRankMultivariateNormal(m, init_loc_fn=init_to_network(m),
                                                           init_scale=0.01, rank=2),
    "AutoDelta": lambda m: AutoDelta(m, init_loc_fn=init_to_network(m)),
}
ALL = {**registered_guides(), **PYRO_GUIDES}
#: guides whose draws differ (a point mass makes every draw identical: PSIS is undefined)
SPREAD = sorted(n for n in ALL if n != "AutoDelta")


@contextmanager
def quiet():
    """ArviZ warns about large Pareto k for high-dimensional approximate posteriors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _mlp():
    return nn.Sequential(nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 10))


@pytest.fixture(scope="module")
def data():
    d = pb.datasets.digits()
    return d.x_train[:200], d.y_train[:200]


@pytest.fixture(scope="module")
def trained(data):
    """{name: (model, guide, DataTree)} trained once per module."""
    x, y = data
    out = {}
    for name, factory in ALL.items():
        pyro.set_rng_seed(0)
        model = pb.BNN(_mlp(), likelihood="categorical")
        guide = factory(model)
        pb.fit(model, guide, (x, y), epochs=4, batch_size=50, lr=1e-2, progress=False, seed=0)
        dt = pb.to_arviz(model, guide, x[:N], y[:N], num_samples=S, batch_size=50, seed=1)
        out[name] = (model, guide, dt)
    return out


@pytest.mark.parametrize("name", sorted(ALL))
def test_groups_and_dims(name, trained):
    model, _, dt = trained[name]
    assert {"posterior", "log_likelihood", "posterior_predictive", "observed_data",
            "sample_stats"} <= set(dt.children)
    post = dt["posterior"]
    assert post.sizes["chain"] == 1 and post.sizes["draw"] == S
    assert set(post.data_vars) == set(model.site_names)
    assert post["net.0.weight"].dims == ("chain", "draw", "net.0.out", "net.0.in")
    assert post["net.0.bias"].dims == ("chain", "draw", "net.0.out")
    assert post.sizes["net.0.in"] == 64 and post.sizes["net.2.out"] == 10
    assert dt["log_likelihood"]["obs"].dims == ("chain", "draw", "obs_id")
    assert dt["log_likelihood"].sizes["obs_id"] == N
    assert dt["posterior_predictive"]["obs"].shape == (1, S, N)
    assert dt["observed_data"]["obs"].dims == ("obs_id",)
    stats = dt["sample_stats"]
    for var in ("lp", "log_prior", "log_q"):
        assert stats[var].dims == ("chain", "draw")
        assert np.isfinite(stats[var].values).all()
    pp = dt["posterior_predictive"]["obs"].values
    assert pp.min() >= 0 and pp.max() <= 9


@pytest.mark.parametrize("name", SPREAD)
def test_loo_and_approximate_loo_finite(name, trained):
    _, _, dt = trained[name]
    with quiet():
        plain = az.loo(dt)
        corrected = az.loo_approximate_posterior(dt, log_p=dt["sample_stats"]["lp"],
                                                 log_q=dt["sample_stats"]["log_q"])
    assert math.isfinite(plain.elpd) and math.isfinite(corrected.elpd)
    assert corrected.approx_posterior
    # a sum of N log predictive densities of class labels: negative
    assert corrected.elpd < 0 and plain.elpd < 0
    assert loo_approximate(dt).elpd == pytest.approx(corrected.elpd)


def test_psis_loo_scores_observations_without_a_tail(trained):
    """Saturated log-likelihoods (0 for every draw, as a float32 log-softmax gives for confident
    predictions) make arviz-stats' PSIS refuse the whole data set; ``psis_loo`` scores them by
    plain importance sampling and the rest by PSIS, and equals arviz-stats where it works."""
    import arviz_stats

    _, _, dt = trained["meanfield"]
    with quiet():
        ref = arviz_stats.loo(dt, pointwise=True)
        assert psis_loo(dt) == (pytest.approx(float(ref.elpd), rel=1e-12),
                                pytest.approx(float(ref.se), rel=1e-12), 0)
    ll = dt["log_likelihood"]["obs"]
    values = ll.values.copy()
    values[..., :3] = 0.0                                     # every draw saturated
    tied = np.sort(values[..., 3].reshape(-1))
    values[..., 3] = np.maximum(values[..., 3], tied[MIN_PSIS_TAIL - 1])  # the tail's draws tie
    broken = dt.copy()
    broken["log_likelihood"]["obs"] = ll.copy(data=values)
    with quiet(), pytest.raises(ValueError, match="All tail values are the same"):
        arviz_stats.loo(broken)
    with quiet():
        elpd, se, plain = psis_loo(broken)
        rest = arviz_stats.loo(broken.isel(obs_id=np.arange(4, N), missing_dims="ignore"), pointwise=True)
    draws = values[..., 3].reshape(-1)
    expected_3 = -np.log(np.mean(np.exp(-draws)))             # plain importance sampling
    assert plain == 4
    assert elpd == pytest.approx(float(rest.elpd) + 0.0 + expected_3, rel=1e-12)
    assert math.isfinite(se) and se > 0
    # pointwise: the saturated three score 0, the tied one plain IS, the rest arviz-stats' own
    with quiet():
        pointwise, num_plain, pareto_k, good_k = psis_loo_pointwise(broken)
    assert num_plain == 4 and pointwise.shape == (N,)
    assert np.array_equal(pointwise[:3], np.zeros(3)) and pointwise[3] == pytest.approx(expected_3, rel=1e-12)
    np.testing.assert_allclose(pointwise[4:], np.asarray(rest.elpd_i), rtol=1e-12)
    assert se == pytest.approx(math.sqrt(N * pointwise.var(ddof=1)), rel=1e-12)  # ArviZ's se formula
    # k-hat: arviz-stats' own for the observations it scored, NaN for those scored by plain IS
    assert np.isnan(pareto_k[:4]).all()
    np.testing.assert_allclose(pareto_k[4:], np.asarray(rest.pareto_k), rtol=1e-12)
    assert good_k == pytest.approx(float(rest.good_k), rel=1e-12)


@pytest.mark.parametrize("draws", [25, 29, 30])
def test_psis_needs_30_draws(trained, data, draws):
    """arviz-stats fits a tail of floor(S/5) draws and gives up on 5 of them (every k-hat NaN,
    weights unsmoothed, no warning): fewer than MIN_PSIS_DRAWS = 30 draws are refused by name."""
    import arviz_stats

    model, guide, _ = trained["meanfield"]
    x, y = data
    dt = pb.to_arviz(model, guide, x[:N], y[:N], num_samples=draws, batch_size=50, seed=2)
    with quiet():
        k = np.asarray(arviz_stats.loo(dt, pointwise=True).pareto_k)
    # the premise, measured on arviz-stats itself
    assert bool(np.isnan(k).all()) is (draws < MIN_PSIS_DRAWS) and MIN_PSIS_DRAWS == 30
    if draws < MIN_PSIS_DRAWS:
        for fn, name in ((psis_loo, "psis_loo"), (loo_approximate, "loo_approximate")):
            with pytest.raises(ValueError, match=rf"{name} needs at least 30 draws .* got {draws}"):
                fn(dt)
    else:
        with quiet():
            assert math.isfinite(psis_loo(dt)[0]) and math.isfinite(float(loo_approximate(dt).elpd))


def test_point_mass_guide_has_identical_draws(trained, data):
    """AutoDelta: log q = 0, every draw is the MAP, lp = log joint; PSIS cannot run."""
    model, guide, dt = trained["AutoDelta"]
    w = dt["posterior"]["net.0.weight"].values[0]
    assert np.all(w == w[0])
    assert np.all(dt["sample_stats"]["log_q"].values == 0.0)
    with pytest.raises(ValueError):
        az.loo(dt)


@pytest.mark.parametrize("name", SPREAD)
def test_compare_ranks_two_guides(name, trained):
    """az.compare orders two guides' DataTrees by their PSIS-LOO ELPD."""
    other = "AutoNormal" if name != "AutoNormal" else "meanfield"
    dts = {name: trained[name][2], other: trained[other][2]}
    with quiet():
        table = az.compare(dts)
        elpd = {k: az.loo(v).elpd for k, v in dts.items()}
    assert sorted(table.index) == sorted(dts)
    assert list(table["rank"]) == [0, 1]
    assert list(table.index) == sorted(elpd, key=elpd.get, reverse=True)
    assert table["elpd"].to_dict() == pytest.approx(elpd, rel=0.05)  # 2 significant digits
    assert table["weight"].sum() == pytest.approx(1.0)


def test_trained_guide_ranks_above_untrained(trained, data):
    x, y = data
    pyro.set_rng_seed(0)
    model = pb.BNN(_mlp(), likelihood="categorical")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=0, progress=False)   # set up, not trained
    untrained = pb.to_arviz(model, guide, x[:N], y[:N], num_samples=S, seed=1)
    with quiet():
        table = az.compare({"trained": trained["meanfield"][2], "untrained": untrained})
    assert list(table.index) == ["trained", "untrained"]
    assert table["elpd"].iloc[0] > table["elpd"].iloc[1] + 10


@pytest.mark.parametrize("name", sorted(ALL))
def test_log_likelihood_and_lp_match_the_model(name, trained, data):
    """Replay the stored draws through the Pyro model: pointwise log p(y|θ) and log p(θ, y).
    (Laplace guides default to linearised draws, checked in the GLM tests below; their
    ``predictive="sample"`` DataTree is checked here.)"""
    x, y = data
    model, guide, dt = trained[name]
    if isinstance(guide, pb.guides.Laplace):
        assert dt.attrs["method"] == "glm"
        dt = pb.to_arviz(model, guide, x[:N], y[:N], num_samples=S, batch_size=50, seed=1, predictive="sample")
    post = dt["posterior"]
    for s in (0, S // 2, S - 1):
        values = {k: torch.as_tensor(post[k].values[0, s]) for k in model.site_names}
        with torch.no_grad():
            tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x[:N], y[:N])
        tr.compute_log_prob()
        direct = tr.nodes["obs"]["log_prob"].double().numpy()
        np.testing.assert_allclose(dt["log_likelihood"]["obs"].values[0, s], direct, rtol=1e-5, atol=1e-4)
        lp = float(tr.log_prob_sum())
        assert dt["sample_stats"]["lp"].values[0, s] == pytest.approx(lp, rel=1e-4, abs=0.05)


@pytest.mark.parametrize("name", ["meanfield", "AutoDelta", "laplace"])
def test_netcdf_round_trip(name, trained, tmp_path):
    if name not in trained:
        pytest.skip(f"{name} is not registered")
    _, _, dt = trained[name]
    path = tmp_path / f"{name}.nc"
    dt.to_netcdf(path)
    back = xr.open_datatree(path)
    for group in ("log_likelihood", "posterior", "sample_stats", "observed_data", "posterior_predictive"):
        xr.testing.assert_identical(back[group].to_dataset(), dt[group].to_dataset())
    if name != "AutoDelta":
        assert az.loo(back).elpd == pytest.approx(az.loo(dt).elpd)


def test_guide_log_density_matches_draws(trained, data):
    x, _ = data
    for name in ("meanfield", "AutoNormal", "AutoDelta"):
        model, guide, _ = trained[name]
        values, log_q = sample_with_log_density(model, guide, x[:1])
        at_values = guide_log_density(guide, values)
        assert float(at_values.detach()) == pytest.approx(float(log_q.detach()), rel=1e-5, abs=1e-3)
    model, guide, _ = trained["meanfield"]
    values, log_q = sample_with_log_density(model, guide, x[:1])
    manual = sum(dist.Normal(*guide.loc_and_scale(k)).log_prob(v).sum() for k, v in values.items())
    assert float(log_q.detach()) == pytest.approx(float(manual.detach()), rel=1e-5)
    # a guide with auxiliary sites and no hook cannot be evaluated at arbitrary values
    model, guide, _ = trained["AutoLowRank"]
    with pytest.raises(TypeError, match="log_density"):
        guide_log_density(guide, values, model=model, x=x[:1])


def test_log_density_hook_is_used(data):
    x, y = data
    class ConstantDensity(pb.guides.BNNGuide, AutoNormal):
        def log_density(self, values):
            return torch.tensor(-7.0)

    model = pb.BNN(_mlp(), likelihood="categorical")
    guide = ConstantDensity(model)
    pb.fit(model, guide, (x, y), epochs=1, progress=False)
    dt = pb.to_arviz(model, guide, x[:40], y[:40], num_samples=3)
    assert np.all(dt["sample_stats"]["log_q"].values == -7.0)


def test_var_names_and_errors(trained, data, monkeypatch):
    x, y = data
    model, guide, _ = trained["meanfield"]
    dt = pb.to_arviz(model, guide, x[:30], y[:30], num_samples=4, var_names=["net.2.bias"])
    assert list(dt["posterior"].data_vars) == ["net.2.bias"]
    assert dt["log_likelihood"].sizes["obs_id"] == 30
    with pytest.raises(ValueError, match="var_names"):
        pb.to_arviz(model, guide, x[:30], y[:30], num_samples=2, var_names=["nope"])
    monkeypatch.setattr(pb.posterior.arviz, "MAX_POSTERIOR_VALUES", 100)
    with pytest.raises(ValueError, match="var_names="):
        pb.to_arviz(model, guide, x[:30], y[:30], num_samples=2)
    assert "net.2.bias" in pb.to_arviz(model, guide, x[:30], y[:30], num_samples=2,
                                       var_names=["net.2.bias"])["posterior"]
    with pytest.raises(ValueError, match="same length"):
        pb.to_arviz(model, guide, x[:30], y[:20])
    with pytest.raises(ValueError, match="num_samples"):
        pb.to_arviz(model, guide, x[:30], y[:30], num_samples=0)
    with pytest.raises(TypeError):
        pb.to_arviz(model, guide, x[:30].numpy(), y[:30])


def test_batches_do_not_change_results(trained, data):
    x, y = data
    model, guide, _ = trained["meanfield"]
    a = pb.to_arviz(model, guide, x[:50], y[:50], num_samples=5, batch_size=7, seed=3)
    b = pb.to_arviz(model, guide, x[:50], y[:50], num_samples=5, batch_size=1000, seed=3)
    np.testing.assert_allclose(a["log_likelihood"]["obs"].values, b["log_likelihood"]["obs"].values,
                               rtol=1e-5, atol=1e-5)


def test_hand_written_model_and_regression(data):
    x, y = data
    model = HandWritten(d_hidden=4)
    guide = AutoNormal(model, init_scale=0.01)
    pb.fit(model, guide, (x, y), epochs=2, progress=False)
    dt = pb.to_arviz(model, guide, x[:40], y[:40], num_samples=35)
    assert dt["posterior"]["fc1.weight"].dims == ("chain", "draw", "fc1.weight_dim_0", "fc1.weight_dim_1")
    values = {k: torch.as_tensor(dt["posterior"][k].values[0, 0]) for k in dt["posterior"].data_vars}
    tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x[:40], y[:40])
    tr.compute_log_prob()
    np.testing.assert_allclose(dt["log_likelihood"]["obs"].values[0, 0],
                               tr.nodes["obs"]["log_prob"].detach().numpy(), rtol=1e-5, atol=1e-4)
    assert math.isfinite(loo_approximate(dt).elpd)
    # regression: targets (N, 1); the pointwise log-likelihood sums over output dims
    xr_, yr = pb.datasets.toy_regression(40)
    reg = pb.BNN(nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)), "gaussian", noise=0.1)
    g = pb.guides.MeanField(reg)
    pb.fit(reg, g, (xr_, yr), epochs=2, progress=False)
    dtr = pb.to_arviz(reg, g, xr_, yr, num_samples=5)
    assert dtr["log_likelihood"]["obs"].dims == ("chain", "draw", "obs_id")
    assert dtr["observed_data"]["obs"].dims == ("obs_id", "obs_dim_1")
    assert dtr["posterior_predictive"]["obs"].shape == (1, 5, 40, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model(data):
    x, y = data
    model = pb.BNN(_mlp(), likelihood="categorical").to("cuda")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=1, device="cuda", progress=False)
    dt = pb.to_arviz(model, guide, x[:64], y[:64], num_samples=4, batch_size=16)
    assert dt["log_likelihood"]["obs"].shape == (1, 4, 64)
    assert np.isfinite(dt["sample_stats"]["log_q"].values).all()


# ----------------------------------------------------------------- Laplace: linearised draws
def _small_laplace(structure="kron", subset="all", likelihood="categorical", seed=0):
    """A float64 Laplace of a 64-5-C tanh MLP (tanh: the linearisation differs from the net)."""
    d = pb.datasets.digits()
    torch.manual_seed(seed)
    if likelihood == "categorical":
        x, y = d.x_train[:150].double(), d.y_train[:150]
        net = nn.Sequential(nn.Linear(64, 5), nn.Tanh(), nn.Linear(5, 10)).double()
        model = pb.BNN(net, "categorical").double()
    else:
        x = d.x_train[:150].double()
        y = (x[:, :3].sum(1, keepdim=True) - 0.5 * x[:, 20:22].sum(1, keepdim=True)).double()
        net = nn.Sequential(nn.Linear(64, 5), nn.Tanh(), nn.Linear(5, 1)).double()
        model = pb.BNN(net, "gaussian", noise=0.3).double()
    guide = pb.guides.Laplace(model, structure, subset=subset, prior_precision=2.0)
    pb.fit(model, guide, (x, y), epochs=15, lr=1e-2, batch_size=50, progress=False, seed=seed)
    return model, guide, net, x, y


def test_linearized_draws_are_the_jacobian_vector_product():
    """f_lin(x; θ_s) = f(x; θ*) + J(θ_s − θ*) from the layer factors equals torch.func.jvp
    of the network at θ* in the direction of the stored draw (float64, rtol 1e-9)."""
    model, guide, net, x, _ = _small_laplace("kron")
    draws = guide.linearized_samples(x[:40], num_samples=3, batch_size=16, generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in net.named_parameters()]
    theta = {n: guide.map_values()[f"net.{n}"].detach() for n in names}

    def f(params):
        return torch.func.functional_call(net, params, (x[:40],))

    for s in range(3):
        direction = {n: draws.values[f"net.{n}"][s] - theta[n] for n in names}
        f0, jv = torch.func.jvp(f, (theta,), (direction,))
        torch.testing.assert_close(draws.f[s], f0 + jv, rtol=1e-9, atol=1e-10)
        assert not torch.allclose(draws.f[s], f({n: draws.values[f"net.{n}"][s] for n in names}))


def test_linearized_draws_density_and_prior():
    """log q is the density of N(θ*, P⁻¹) (dense, "full" structure) at each draw; log_prior
    the Gaussian prior with the guide's δ; lp = log_prior + Σ log_likelihood."""
    model, guide, _, x, y = _small_laplace("full")
    dt = pb.to_arviz(model, guide, x, y, num_samples=60, seed=0)
    assert dt.attrs["method"] == "glm"
    post = dt["posterior"]
    sites = guide.layers[0].sites + guide.layers[1].sites
    block = guide.posterior.blocks[0]
    delta = float(guide.prior_precision)
    theta_star = torch.cat([layer.flatten(guide.map_values()).reshape(-1).detach() for layer in guide.layers])
    q = torch.distributions.MultivariateNormal(theta_star, block.covariance(guide.prior_precision))
    for s in range(6):
        values = {k: torch.as_tensor(post[k].values[0, s], dtype=torch.float64) for k in sites}
        th = torch.cat([layer.flatten(values).reshape(-1) for layer in guide.layers])
        # the DataTree stores float32 draws: compare the density at the stored point loosely
        assert float(dt["sample_stats"]["log_q"].values[0, s]) == pytest.approx(float(q.log_prob(th)), abs=0.05)
        prior = torch.distributions.Normal(0.0, delta ** -0.5).log_prob(th).sum()
        assert float(dt["sample_stats"]["log_prior"].values[0, s]) == pytest.approx(float(prior), abs=0.05)
    lp = dt["sample_stats"]["lp"].values[0]
    np.testing.assert_allclose(lp, dt["sample_stats"]["log_prior"].values[0]
                               + dt["log_likelihood"]["obs"].values[0].sum(-1), rtol=1e-10)
    with quiet():
        res = loo_approximate(dt)
    assert math.isfinite(res.elpd)


def test_glm_log_likelihood_matches_evaluate_glm():
    """The DataTree's per-point log predictive, log mean_s p(y_n | f_lin(x_n; θ_s)), is the
    GLM's Monte Carlo predictive: it equals ``pb.predict(..., predictive="glm", link_approx="mc")``
    per point and ``pb.evaluate(..., predictive="glm", link_approx="mc")``'s NLL on average.

    Tolerance: with S = 4000 draws on each side, the Monte Carlo standard error of each
    per-point log predictive is sd_s(p)/(√S · p̄); we require every point within 5 of its
    standard errors (plus 1e-3) and the mean within 0.01 nats of evaluate's NLL."""
    model, guide, _, x, y = _small_laplace("kron")
    xs, ys, S_ = x[:60], y[:60], 4000
    dt = pb.to_arviz(model, guide, xs, ys, num_samples=S_, seed=1)
    ll = torch.as_tensor(dt["log_likelihood"]["obs"].values[0])             # (S, N)
    ours = torch.logsumexp(ll, 0) - math.log(S_)
    torch.manual_seed(2)
    probs = pb.predict(model, guide, xs, predictive="glm", link_approx="mc", num_samples=S_)   # (S, N, C)
    p_y = probs[:, torch.arange(len(ys)), ys]                                   # (S, N)
    ref = p_y.mean(0).log()
    se = torch.sqrt(p_y.var(0) / S_) / p_y.mean(0) + ll.exp().std(0) / math.sqrt(S_) / ll.exp().mean(0)
    assert bool(((ours - ref).abs() <= 5 * se + 1e-3).all()), float(((ours - ref).abs() / (se + 1e-12)).max())
    nll = pb.evaluate(model, guide, xs, ys, predictive="glm", link_approx="mc", num_samples=S_)["nll"]
    assert float(-ours.mean()) == pytest.approx(nll, abs=0.01)
    # and against the probit approximation only roughly (it is an approximation of this integral)
    probit = pb.evaluate(model, guide, xs, ys, predictive="glm_probit")["nll"]
    assert float(-ours.mean()) == pytest.approx(probit, rel=0.2)


def test_glm_log_likelihood_regression_is_the_gaussian_predictive():
    """Regression: log mean_s N(y_n | f_lin(x_n; θ_s), σ²) → log N(y_n | f*_n, Σ_f + σ²) in
    closed form; with S = 4000 each point within 5 Monte Carlo standard errors (+1e-3)."""
    model, guide, _, x, y = _small_laplace("kron", likelihood="gaussian")
    xs, ys, S_ = x[:50], y[:50], 4000
    dt = pb.to_arviz(model, guide, xs, ys, num_samples=S_, seed=0)
    ll = torch.as_tensor(dt["log_likelihood"]["obs"].values[0])
    ours = torch.logsumexp(ll, 0) - math.log(S_)
    f, cov = guide.functional_covariance(xs)
    sigma = model.likelihood.noise.detach()
    exact = torch.distributions.Normal(f[:, 0], (cov[:, 0, 0] + sigma ** 2).sqrt()).log_prob(ys[:, 0])
    se = ll.exp().std(0) / math.sqrt(S_) / ll.exp().mean(0)
    assert bool(((ours - exact).abs() <= 5 * se + 1e-3).all())
    assert dt["posterior_predictive"]["obs"].shape == (1, S_, 50, 1)
    nll = pb.evaluate(model, guide, xs, ys, predictive="glm", num_samples=S_)["nll"]
    assert float(-exact.mean()) == pytest.approx(nll, abs=0.02)


def test_glm_predictive_choices(trained, data):
    x, y = data
    model, guide, _ = trained["meanfield"]
    with pytest.raises(ValueError, match="linearised"):
        pb.to_arviz(model, guide, x[:10], y[:10], num_samples=2, predictive="glm")
    with pytest.raises(ValueError, match="unknown predictive 'probit'; did you mean 'glm_probit'"):
        pb.to_arviz(model, guide, x[:10], y[:10], num_samples=2, predictive="probit")
    assert pb.to_arviz(model, guide, x[:10], y[:10], num_samples=2).attrs["method"] == "sample"
    model, guide, _ = trained["laplace"]
    dt = pb.to_arviz(model, guide, x[:10], y[:10], num_samples=3, var_names=["net.2.bias"])
    assert dt.attrs["method"] == "glm" and list(dt["posterior"].data_vars) == ["net.2.bias"]
    # last-layer Laplace: the body is a point estimate, the same in every draw
    full = pb.to_arviz(model, guide, x[:10], y[:10], num_samples=3)
    w = full["posterior"]["net.0.weight"].values[0]
    assert np.all(w == w[0]) and not np.all(full["posterior"]["net.2.weight"].values[0, 0] ==
                                              full["posterior"]["net.2.weight"].values[0, 1])


def test_seed_leaves_the_callers_random_streams_alone(data):
    """to_arviz(seed=) draws reproducibly without resetting the caller's torch stream."""
    x, y = data
    model = pb.BNN(_mlp(), likelihood="categorical")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=1, progress=False, seed=0)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    a = pb.to_arviz(model, guide, x[:20], y[:20], num_samples=3, seed=2)
    assert torch.equal(torch.rand(3), expected)
    b = pb.to_arviz(model, guide, x[:20], y[:20], num_samples=3, seed=2)
    np.testing.assert_array_equal(a["posterior"]["net.0.weight"].values, b["posterior"]["net.0.weight"].values)
