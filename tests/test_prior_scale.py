"""Learned prior scales of MeanField (empirical Bayes, ``learn_prior_scale``) against closed forms."""

import math
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.meanfield import normal_kl
from pyro_bnn.guides.prior_scale import optimal_normal_scale, own_normal_priors_
from pyro_bnn.training.guide_setup import setup_guide


def _mlp_model(prior=None, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return pb.BNN(net, "categorical", prior=prior)


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _argmax_on_grid(f, lo, hi, rounds=3, points=201):
    """``argmax f`` on ``[lo, hi]`` by a grid refined ``rounds`` times around its best point."""
    for _ in range(rounds):
        grid = torch.linspace(lo, hi, points, dtype=torch.float64)
        best = int(torch.stack([f(t) for t in grid]).argmax())
        step = (hi - lo) / (points - 1)
        lo, hi = float(grid[best]) - step, float(grid[best]) + step
    return 0.5 * (lo + hi)


def _set_up(model, x, y, seed=1):
    guide = pb.guides.MeanField(model)
    setup_guide(model, guide, x, y)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a q that is not at its initial values: random μ, σ
        for site in model.site_names:
            loc, rho = guide.loc_and_raw_scale(site)
            loc.copy_(torch.randn(loc.shape, generator=g))
            rho.copy_(torch.rand(rho.shape, generator=g) * 2 - 2)
    return guide


def test_optimal_scale_minimises_the_closed_form_kl():
    g = torch.Generator().manual_seed(0)
    loc, scale = torch.randn(50, generator=g, dtype=torch.float64), torch.rand(50, generator=g, dtype=torch.float64)
    m = torch.tensor(0.3, dtype=torch.float64)
    s = optimal_normal_scale(loc, scale, m)
    assert float(s) == pytest.approx(math.sqrt(float(((loc - m) ** 2 + scale ** 2).mean())), rel=1e-12)
    # the reference: KL(q‖N(m, s²)) summed with torch.distributions, minimised over log s on a fine grid
    best = _argmax_on_grid(lambda t: -torch.distributions.kl_divergence(
        torch.distributions.Normal(loc, scale), torch.distributions.Normal(m, t.exp())).sum(), -3.0, 2.0)
    assert math.exp(best) == pytest.approx(float(s), rel=1e-5)
    # stationary: the derivative of the library's KL in s is zero there
    t = s.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(normal_kl(loc, scale, m, t), t)
    assert abs(float(grad)) < 1e-9


def test_optimal_scale_checks_shapes():
    with pytest.raises(ValueError, match="one shape"):
        optimal_normal_scale(torch.zeros(3), torch.ones(2))


def test_update_sets_each_site_to_its_closed_form_and_raises_the_elbo():
    x, y = _data()
    shared = pb.priors.IIDNormal(1.0)
    model = _mlp_model(prior=shared)
    guide = _set_up(model, x, y)
    with local_params(model, guide):
        qs = {s: tuple(t.detach().clone() for t in guide.loc_and_scale(s)) for s in model.site_names}
        kl_before = sum(float(normal_kl(*qs[s], *model.site_normal_prior(s))) for s in model.site_names)
        new = guide.update_prior_scales_()
        kl_after = sum(float(normal_kl(*qs[s], *model.site_normal_prior(s))) for s in model.site_names)
    for site, (loc, scale) in qs.items():
        expected = math.sqrt(float((loc ** 2 + scale ** 2).mean()))
        assert new[site] == pytest.approx(expected, rel=1e-6)
        assert float(model.site_normal_prior(site)[1]) == pytest.approx(expected, rel=1e-6)
        assert float(model.site_prior(site).base_dist.scale.flatten()[0]) == pytest.approx(expected, rel=1e-6)
    assert len(set(new.values())) == len(new)  # one scale per site
    assert kl_after < kl_before  # the likelihood term does not depend on the prior: the ELBO rose
    assert float(shared.scale) == 1.0  # the user's prior object is left as it was


def test_fanin_prior_starts_from_its_scales():
    x, y = _data()
    model = _mlp_model(prior=pb.priors.FanInNormal(2.0))
    before = {s: float(model.site_normal_prior(s)[1]) for s in model.site_names}
    own_normal_priors_(model)
    after = {s: float(model.site_normal_prior(s)[1]) for s in model.site_names}
    assert after == pytest.approx(before, rel=1e-6)
    assert all(isinstance(p, pb.priors.IIDNormal) for p in model.priors.values())


def test_mackay_fixed_point_on_orthogonal_linear_regression():
    """With an orthogonal design the mean-field posterior is exact, the ELBO at the optimal q is
    the log evidence, and iterating (exact q, then the update) must reach the scale that
    maximises the closed-form evidence."""
    n, d, noise = 30, 3, 0.5
    q_mat, _ = torch.linalg.qr(torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    x = q_mat * torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)  # XᵀX = diag(16, 4, 1)
    y = x @ torch.tensor([0.8, -0.5, 0.3], dtype=torch.float64) + noise * torch.randn(
        n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = pb.BNN(nn.Linear(d, 1, bias=False).double(), "gaussian", noise=noise,
                   prior=pb.priors.IIDNormal(1.0)).double()
    guide = pb.guides.MeanField(model)
    setup_guide(model, guide, x, y.unsqueeze(-1))
    xtx = (x * x).sum(0)
    with local_params(model, guide):
        loc, rho = guide.loc_and_raw_scale("net.weight")
        for _ in range(500):
            s = float(model.site_normal_prior("net.weight")[1])
            prec = xtx / noise ** 2 + 1 / s ** 2
            with torch.no_grad():
                loc.copy_(((x.T @ y) / noise ** 2 / prec).unsqueeze(0))
                rho.copy_((prec ** -0.5).log().unsqueeze(0))
            guide.update_prior_scales_()
    s_fit = float(model.site_normal_prior("net.weight")[1])

    def log_evidence(log_s):
        cov = log_s.exp() ** 2 * x @ x.T + noise ** 2 * torch.eye(n, dtype=x.dtype)
        return torch.distributions.MultivariateNormal(torch.zeros(n, dtype=x.dtype), cov).log_prob(y)

    assert s_fit == pytest.approx(math.exp(_argmax_on_grid(log_evidence, -4.0, 2.0)), rel=1e-4)


def test_fit_ends_with_the_closed_form_scales_of_its_final_q():
    x, y = _data()
    model = _mlp_model()
    guide = pb.guides.MeanField(model, learn_prior_scale=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)  # 5 epochs: a contract test
        pb.fit(model, guide, (x, y), epochs=5, batch_size=20, seed=0, progress=False)
    with local_params(model, guide):
        for site in model.site_names:
            loc, scale = guide.loc_and_scale(site)
            assert float(model.site_normal_prior(site)[1]) == pytest.approx(
                float(optimal_normal_scale(loc.detach(), scale.detach())), rel=1e-5)
    assert "learned prior scales" in guide.settings_description()


def test_plain_svi_and_predictive_use_the_learned_priors():
    x, y = _data()
    model = _mlp_model()
    pyro.clear_param_store()
    guide = pb.guides.MeanField(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for _ in range(3):
        svi.step(x, y)
        new = guide.update_prior_scales_()
    trace = pyro.poutine.trace(model).get_trace(x, y)
    for site, s in new.items():
        assert float(trace.nodes[site]["fn"].base_dist.scale.flatten()[0]) == pytest.approx(s, rel=1e-6)
    draws = Predictive(model, guide=guide, num_samples=4)(x)
    assert draws["net.0.weight"].shape[0] == 4 and draws["net.0.weight"].shape[-2:] == (7, 5)


def test_learned_scales_round_trip_through_state_dict():
    x, y = _data()
    model = _mlp_model()
    guide = _set_up(model, x, y)
    with local_params(model, guide):
        new = guide.update_prior_scales_()
    other = _mlp_model(seed=3)
    own_normal_priors_(other)
    other.load_state_dict(model.state_dict())
    assert {s: float(other.site_normal_prior(s)[1]) for s in other.site_names} == pytest.approx(new, rel=1e-6)


def test_bad_values_are_clear_errors():
    x, y = _data()
    with pytest.raises(TypeError, match="learn_prior_scale must be True or False"):
        pb.guides.MeanField(_mlp_model(), learn_prior_scale="yes")
    model = _mlp_model(prior=pb.priors.ScaleMixture())
    guide = pb.guides.MeanField(model, learn_prior_scale=True)
    with pytest.raises(ValueError, match="i.i.d. Normal prior"):
        pb.fit(model, guide, (x, y), epochs=1, progress=False)  # at the fit's start, before any step
    with pytest.raises(RuntimeError, match="set up first"):
        pb.guides.MeanField(_mlp_model()).update_prior_scales_()
    with pytest.raises(KeyError, match="not a random site"):
        _mlp_model().set_prior_("net.9.weight", pb.priors.IIDNormal(1.0))
    with pytest.raises(TypeError, match="must be a pyro_bnn.model.priors.Prior"):
        _mlp_model().set_prior_("net.0.weight", 1.0)


def _full_elbo(model, guide, x, y, draws=50):
    from pyro_bnn.guides.meanfield import meanfield_loss
    from pyro_bnn.training.seeding import seeded

    with torch.no_grad(), local_params(model, guide), seeded(7):
        return -sum(float(meanfield_loss(model, guide, x, y, len(x))) for _ in range(draws)) / draws


@pytest.mark.slow
def test_learned_scales_raise_the_elbo_of_a_small_fit():
    """Synthetic 3-class data, MLP 5-7-3, 300 epochs of 6 steps, seed 0 (both fits diagnosed
    converged): the learned scales end with a higher full-data ELBO (50 draws) than the fixed
    N(0, 1) prior.  Measured: −133.7 vs −145.5 (600 epochs: −127.7 vs −145.5, the scales still
    growing); the tolerance is 5 nats.  At 150 epochs of 3 steps the learned scales were *behind*
    (−159.7 vs −148.3): they move only as fast as q does, so a short fit can end lower."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 5, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    elbos = {}
    for learn in (False, True):
        model = _mlp_model()
        guide = pb.guides.MeanField(model, learn_prior_scale=learn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            pb.fit(model, guide, (x, y), epochs=300, batch_size=50, seed=0, progress=False)
        elbos[learn] = _full_elbo(model, guide, x, y)
    assert elbos[True] > elbos[False] + 5.0, elbos


def test_a_resumed_fit_learns_the_same_scales(tmp_path):
    """The learned scales live in the model's state_dict: a fit resumed from its checkpoint ends
    where the uninterrupted one does."""
    x, y = _data()
    path = str(tmp_path / "fit.pt")
    kw = dict(batch_size=20, seed=0, progress=False, lr_schedule="constant")
    runs = []
    for epochs, extra in ((3, dict(checkpoint=path)), (5, dict(checkpoint=path, resume=True)), (5, {})):
        model = _mlp_model()
        guide = pb.guides.MeanField(model, learn_prior_scale=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            pb.fit(model, guide, (x, y), epochs=epochs, **kw, **extra)
        runs.append({s: float(model.site_normal_prior(s)[1]) for s in model.site_names})
    assert runs[1] == pytest.approx(runs[2], rel=1e-6)
    assert runs[1] != pytest.approx(runs[0], rel=1e-3)
