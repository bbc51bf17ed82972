"""MeanField against closed forms: Bayesian linear regression, Pyro's own ELBO, minibatch scaling."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from helpers import HandWritten
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.contract.pyro_objective import PyroObjective
from pyro_bnn.guides.meanfield import meanfield_loss
from pyro_bnn.training.guide_setup import setup_guide

NOISE, PRIOR_SCALE = 0.5, 1.0


def _blr_data(n=40, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:d]
    y = x @ w + NOISE * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y.unsqueeze(-1)


def _blr_exact(x, y):
    """Posterior N(mu, cov) and log evidence of y = x w + eps, w ~ N(0, s^2 I), eps ~ N(0, noise^2)."""
    n, d = x.shape
    prec = x.T @ x / NOISE**2 + torch.eye(d, dtype=x.dtype) / PRIOR_SCALE**2
    cov = torch.linalg.inv(prec)
    mu = cov @ x.T @ y.squeeze(-1) / NOISE**2
    marg_cov = PRIOR_SCALE**2 * x @ x.T + NOISE**2 * torch.eye(n, dtype=x.dtype)
    log_ev = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=x.dtype), marg_cov).log_prob(y.squeeze(-1))
    return mu, prec, float(log_ev)


def _blr_model():
    return pb.BNN(nn.Linear(3, 1, bias=False).double(), likelihood="gaussian", noise=NOISE,
                  prior=pb.priors.IIDNormal(PRIOR_SCALE)).double()


def test_meanfield_recovers_blr_posterior_mean_and_bounds_evidence():
    x, y = _blr_data()
    mu, prec, log_ev = _blr_exact(x, y)
    model = _blr_model()
    guide = pb.guides.MeanField(model, init_scale=0.05)
    pb.fit(model, guide, (x, y), epochs=1500, batch_size=len(x), lr=2e-2, progress=False,
           num_particles=4, seed=0)
    pb.fit(model, guide, (x, y), epochs=1000, batch_size=len(x), lr=3e-3, progress=False,
           num_particles=8)
    pb.fit(model, guide, (x, y), epochs=1000, batch_size=len(x), lr=5e-4, progress=False,
           num_particles=16)
    with local_params(model, guide):
        loc, scale = guide.loc_and_scale("net.weight")
    post_std = torch.linalg.inv(prec).diagonal().sqrt()
    # Mean-field optimum for a Gaussian target: exact posterior mean, precision = diag(P).
    # Tolerance: 0.15 posterior standard deviations (SGD noise of the final iterates).
    assert torch.all((loc.detach().squeeze(0) - mu).abs() < 0.15 * post_std), (loc, mu)
    torch.testing.assert_close(scale.detach().squeeze(0), prec.diagonal().rsqrt(), rtol=0.15, atol=0)
    # ELBO is a lower bound of the exact log evidence (estimate with many particles).
    with local_params(model, guide):
        losses = [float(meanfield_loss(model, guide, x, y, len(x), num_particles=50).detach()) for _ in range(20)]
    elbo = -sum(losses) / len(losses)
    assert elbo < log_ev
    # and a tight one for this nearly-factorised posterior (gap < 1 nat here)
    assert log_ev - elbo < 1.0


def test_fast_meanfield_loss_equals_pyro_trace_meanfield_elbo():
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)))
    guide = pb.guides.MeanField(model, init_scale=1e-9)  # deterministic samples: w = mu
    x, y = torch.randn(20, 5), torch.randint(0, 3, (20,))
    setup_guide(model, guide, x, y, 100)
    with local_params(model, guide):
        fast = meanfield_loss(model, guide, x, y, num_data=100)
        ref = PyroObjective(TraceMeanField_ELBO())(model, guide, x, y, num_data=100)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-3)


def test_fast_meanfield_loss_matches_pyro_in_expectation():
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    guide = pb.guides.MeanField(model, init_scale=0.3)
    x, y = torch.randn(30, 4), torch.randint(0, 3, (30,))
    setup_guide(model, guide, x, y, 30)
    with local_params(model, guide):
        fast = torch.stack([meanfield_loss(model, guide, x, y, 30) for _ in range(400)]).detach()
        ref = torch.stack([PyroObjective(TraceMeanField_ELBO())(model, guide, x, y, 30)
                           for _ in range(400)]).detach()
    se = (fast.var() / len(fast) + ref.var() / len(ref)).sqrt()
    assert abs(fast.mean() - ref.mean()) < 4 * se


def test_local_reparameterization_same_expected_loss():
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    g1 = pb.guides.MeanField(model, init_scale=0.3, local_reparameterization=False)
    x, y = torch.randn(1, 4).expand(30, 4).contiguous(), torch.randint(0, 3, (30,))
    setup_guide(model, g1, x, y, 30)
    g2 = pb.guides.MeanField(model, init_scale=0.3, local_reparameterization=True)
    setup_guide(model, g2, x, y, 30)
    g2.load_state_dict(g1.state_dict())
    # For a single input the first layer's pre-activations have the same law either way;
    # the loss expectation differs only through the second layer's shared vs per-example
    # weight noise, which does not change the *expected* per-example log-likelihood.
    with local_params(model, g1, g2):
        a = torch.stack([meanfield_loss(model, g1, x, y, 30) for _ in range(400)]).detach()
        b = torch.stack([meanfield_loss(model, g2, x, y, 30) for _ in range(400)]).detach()
    se = (a.var() / len(a) + b.var() / len(b)).sqrt()
    assert abs(a.mean() - b.mean()) < 4 * se
    assert b.var() < a.var()  # lower-variance estimator: its point of existing


@pytest.mark.parametrize("kind", ["bnn", "hand"])
def test_minibatch_losses_sum_to_full_data_loss(kind):
    """With a Delta guide the ELBO is deterministic: mean over a partition of minibatch
    losses (each scaled by N/M) equals the full-data loss exactly."""
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))) if kind == "bnn" else HandWritten(d_hidden=8)
    guide = AutoDelta(model, init_loc_fn=pb.guides.init_to_network(model))
    x, y = torch.rand(60, 64), torch.randint(0, 10, (60,))
    setup_guide(model, guide, x, y, 60)
    objective = PyroObjective(Trace_ELBO())
    with local_params(model, guide):
        full = objective(model, guide, x, y, num_data=60)
        parts = [objective(model, guide, x[i:i + 15], y[i:i + 15], num_data=60) for i in range(0, 60, 15)]
    torch.testing.assert_close(torch.stack(parts).mean(), full, rtol=1e-5, atol=1e-4)


def test_meanfield_minibatch_scaling_deterministic():
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)))
    guide = pb.guides.MeanField(model, init_scale=1e-9)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    setup_guide(model, guide, x, y, 40)
    with local_params(model, guide):
        full = meanfield_loss(model, guide, x, y, 40)
        parts = torch.stack([meanfield_loss(model, guide, x[i:i + 10], y[i:i + 10], 40) for i in range(0, 40, 10)])
    torch.testing.assert_close(parts.mean(), full, rtol=1e-5, atol=1e-3)


def test_scale_mixture_prior_uses_monte_carlo_kl():
    torch.manual_seed(0)
    prior = pb.priors.ScaleMixture(0.5, 1.0, math.exp(-6))
    model = pb.BNN(nn.Linear(3, 2), prior=prior)
    guide = pb.guides.MeanField(model, init_scale=0.1)
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    setup_guide(model, guide, x, y, 10)
    with local_params(model, guide):
        mc = torch.stack([meanfield_loss(model, guide, x, y, 10) for _ in range(400)]).detach()
        ref = torch.stack([PyroObjective(Trace_ELBO())(model, guide, x, y, 10) for _ in range(400)]).detach()
    se = (mc.var() / len(mc) + ref.var() / len(ref)).sqrt()
    assert abs(mc.mean() - ref.mean()) < 4 * se


def test_fit_publishes_to_pyro_store_without_sharing_between_guides():
    """After pb.fit Pyro's global store holds the guide's own trained tensors (so ``save``
    writes them); a second guide of the same structure trains its own values and the
    first keeps its values."""
    pyro.clear_param_store()
    model = pb.BNN(nn.Linear(3, 2))
    guide = pb.guides.MeanField(model)
    data = (torch.randn(8, 3), torch.randint(0, 2, (8,)))
    pb.fit(model, guide, data, epochs=1, progress=False)
    store = dict(pyro.get_param_store().named_parameters())
    assert set(store) == {"MeanField.locs.net.weight", "MeanField.scales.net.weight",
                          "MeanField.locs.net.bias", "MeanField.scales.net.bias"}
    with local_params(model, guide):
        assert store["MeanField.scales.net.weight"] is guide.loc_and_raw_scale("net.weight")[1]
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    guide2 = pb.guides.MeanField(model, init_scale=0.5)
    pb.fit(model, guide2, data, epochs=1, progress=False)
    with local_params(model, guide, guide2):
        assert not torch.allclose(guide.loc_and_scale("net.weight")[1], guide2.loc_and_scale("net.weight")[1])
        assert dict(pyro.get_param_store().named_parameters())["MeanField.scales.net.weight"] \
            is guide2.loc_and_raw_scale("net.weight")[1]
    assert all(torch.equal(v, guide.state_dict()[k]) for k, v in before.items())
    assert isinstance(dist.Normal(0, 1), dist.Distribution)


def test_kl_annealing_weights_the_kl_term():
    """loss(w) = data term + w·KL exactly; w = epoch/K during the first K epochs of a fit."""
    from pyro_bnn.guides.meanfield import closed_form_kl
    from pyro_bnn.training.loop import FitContext

    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)))
    guide = pb.guides.MeanField(model, init_scale=1e-9, kl_annealing=4)  # deterministic samples
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    setup_guide(model, guide, x, y, 12)
    with local_params(model, guide):
        full = meanfield_loss(model, guide, x, y, 12)
        kl, _ = closed_form_kl(model, {n: guide.loc_and_scale(n) for n in model.site_names})
        weights = []
        for epoch in (1, 2, 3, 4, 5):
            guide.on_epoch_start(FitContext(model, guide, None, 12, torch.device("cpu"), 5, epoch=epoch))
            weights.append(guide.kl_weight)
            if epoch == 1:
                annealed = meanfield_loss(model, guide, x, y, 12)
    assert weights == [0.25, 0.5, 0.75, 1.0, 1.0]
    torch.testing.assert_close(annealed, full - 0.75 * kl, rtol=1e-5, atol=1e-3)
    seen = []
    objective = guide.make_objective()

    def recording(model, guide, x, y, num_data=None):
        seen.append(guide.kl_weight)
        return objective(model, guide, x, y, num_data)

    pb.fit(model, guide, (x, y), epochs=5, batch_size=12, progress=False, objective=recording)
    assert seen == [0.25, 0.5, 0.75, 1.0, 1.0] and guide.kl_weight == 1.0
    with pytest.raises(ValueError, match="kl_annealing"):
        pb.guides.MeanField(model, kl_annealing=-1)
