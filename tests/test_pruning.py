"""Pruning: hand-worked scores, exact mask counts, reversibility, export; every guide."""

import math

import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoLowRankMultivariateNormal
from pyro.nn import PyroModule
from torch import nn
from uncertainty_helpers import GUIDE_NAMES, digits, mlp, trained

import pyro_bnn as pb
from pyro_bnn.analysis import pruning
from pyro_bnn.guides import init_to_network
from pyro_bnn.posterior.draws import site_moments


def _predict(model, guide, x, seed=3):
    pyro.set_rng_seed(seed)
    return pb.predict(model, guide, x, num_samples=4)


def test_scores_hand_worked():
    # a narrow weight (μ=0.01, σ=0.01, SNR 1) and a wide one (μ=0, σ=1, SNR 0)
    mu, sd = torch.tensor([0.01, 0.0]), torch.tensor([0.01, 1.0])
    torch.testing.assert_close(pruning.score_from_moments(mu, sd, kind="snr"), torch.tensor([1.0, 0.0]))
    # −log q(0) = ½(μ/σ)² + log(√(2π) σ)
    expected = torch.tensor([0.5 + math.log(math.sqrt(2 * math.pi) * 0.01),   # −3.186
                             math.log(math.sqrt(2 * math.pi))])                  # +0.919
    torch.testing.assert_close(pruning.score_from_moments(mu, sd, kind="zero_prob"), expected)
    # the literal zero-probability rule prunes the narrow, informative weight first; SNR the wide one
    assert pruning.score_from_moments(mu, sd, kind="zero_prob").argmin() == 0
    assert pruning.score_from_moments(mu, sd, kind="snr").argmin() == 1
    torch.testing.assert_close(pruning.score_from_moments(mu, sd, kind="magnitude"), torch.tensor([0.01, 0.0]))
    with pytest.raises(ValueError, match="kind must be one of"):
        pruning.score_from_moments(mu, sd, kind="fisher")


def test_meanfield_scores_use_loc_and_scale():
    model, guide = trained("meanfield")
    s = pruning.scores(guide, kind="snr", model=model)
    for site in model.site_names:
        loc, scale = guide.loc_and_scale(site)
        torch.testing.assert_close(s[site], (loc.abs() / scale).detach())


def test_sample_moments_match_exact_low_rank():
    """Guides without per-weight σ: the sampled marginal std matches the exact one."""
    torch.manual_seed(0)
    model = pb.BNN(mlp(d_in=4, d_hidden=3, d_out=2))
    guide = AutoLowRankMultivariateNormal(model, init_loc_fn=init_to_network(model), init_scale=0.1, rank=2)
    x = torch.randn(5, 4)
    pb.training.setup_guide(model, guide, x, torch.zeros(5, dtype=torch.long))
    pyro.set_rng_seed(0)
    mean, std, source = site_moments(model, guide, x, num_samples=500)
    assert source == "samples"
    post = guide.get_posterior()
    exact_std = post.variance.sqrt().detach()
    got = torch.cat([std[s].reshape(-1) for s in model.site_names])
    got_mean = torch.cat([mean[s].reshape(-1) for s in model.site_names])
    # relative sd of a 500-sample std estimate ≈ 1/sqrt(1000) ≈ 3.2%: 16% is 5 sd
    torch.testing.assert_close(got, exact_std.detach(), rtol=0.16, atol=0)
    # sd of a 500-sample mean = σ/sqrt(500) ≈ σ/22: 5 sd
    torch.testing.assert_close(got_mean, post.loc.detach(), atol=5 * float(exact_std.max()) / 22, rtol=0)


def test_autonormal_moments_exact():
    model, guide = trained("AutoNormal")
    mean, std, source = site_moments(model, guide)
    assert source == "quantiles"
    for site in model.site_names:
        loc, scale = guide._get_loc_and_scale(site)       # Pyro's own (private) accessor as oracle
        torch.testing.assert_close(mean[site], loc.detach())
        torch.testing.assert_close(std[site], scale.detach(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", GUIDE_NAMES)
def test_fraction_zero_unchanged_and_exact_counts(name):
    model, guide = trained(name)
    x = digits().x_test[:50]
    before = _predict(model, guide, x)
    handle = pruning.prune_(model, guide, fraction=0.0, num_samples=64)
    try:
        assert handle.num_pruned == 0
        torch.testing.assert_close(_predict(model, guide, x), before, rtol=0, atol=0)
    finally:
        handle.remove()
    score = pruning.scores(guide, kind="snr", model=model, num_samples=64)
    total = sum(v.numel() for v in score.values())
    for f in (0.1, 1 / 3, 0.9):
        h = pruning.prune_(model, guide, fraction=f, score=score)
        masked = sum(int((m == 0).sum()) for m in h.masks.values())
        assert h.num_total == total and masked == h.num_pruned == math.floor(f * total)
        after = _predict(model, guide, x)
        assert torch.isfinite(after).all()
    pruning.unprune_(model)
    torch.testing.assert_close(_predict(model, guide, x), before, rtol=0, atol=0)   # reversible


@pytest.mark.parametrize("name", GUIDE_NAMES)
def test_export_pruned_is_plain_and_matches_masked_mean(name):
    model, guide = trained(name)
    x = digits().x_test[:40]
    handle = pruning.prune_(model, guide, fraction=0.5, kind="zero_prob", num_samples=64)
    try:
        # sample-based guides: the same seed gives the same draws, so the same posterior mean
        net = pruning.export_pruned(model, guide, num_samples=64, seed=0)
    finally:
        handle.remove()
    assert not any(isinstance(m, PyroModule) for m in net.modules())
    assert not any(m._forward_pre_hooks for m in net.modules())
    mean = pruning.posterior_mean(model, guide, num_samples=64, seed=0)
    masked = {s: mean[s] * handle.masks[s] for s in mean}
    with torch.no_grad(), pb.contract.local_params.local_params(model):
        expected = model.run_with(masked, x)
        torch.testing.assert_close(net(x), expected)
    params = dict(net.named_parameters())
    zeros = sum(int((params[s[4:]] == 0).sum()) for s in handle.masks)
    assert zeros >= handle.num_pruned


def test_prune_everything_gives_uniform_predictions():
    model, guide = trained("meanfield")
    with pruning.prune_(model, guide, fraction=1.0):       # all weights and biases -> logits 0
        probs = _predict(model, guide, digits().x_test[:10])
    torch.testing.assert_close(probs, torch.full_like(probs, 0.1))


def test_threshold_and_site_selection():
    model, guide = trained("meanfield")
    score = pruning.scores(guide, kind="snr", model=model)
    t = float(torch.cat([v.reshape(-1) for v in score.values()]).median())
    with pruning.prune_(model, guide, threshold=t) as h:
        assert h.num_pruned == sum(int((v < t).sum()) for v in score.values())
    with pruning.prune_(model, guide, fraction=0.5, sites=lambda s: s.endswith("weight")) as h:
        assert set(h.masks) == {s for s in model.site_names if s.endswith("weight")}
        assert h.num_pruned == math.floor(0.5 * sum(score[s].numel() for s in h.masks))


def test_prune_errors():
    model, guide = trained("meanfield")
    with pytest.raises(ValueError, match="exactly one of"):
        pruning.prune_(model, guide, fraction=0.5, threshold=1.0)
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        pruning.prune_(model, guide, fraction=1.5)
    with pytest.raises(TypeError, match="needs model="):
        pruning.scores(object(), kind="snr")


def test_pruning_curve_meanfield():
    model, guide = trained("meanfield")
    d = digits()
    curve = pruning.pruning_curve(model, guide, d.x_test[:200], d.y_test[:200],
                                  fractions=[0.0, 0.5, 1.0], num_samples=8)
    assert curve["fraction"] == [0.0, 0.5, 1.0]
    assert curve["accuracy"][0] > 0.8
    # everything pruned: uniform predictive, NLL = log 10
    assert curve["nll"][-1] == pytest.approx(math.log(10), abs=1e-5)
    assert "_pyro_bnn_pruning" not in model.__dict__        # masks removed afterwards


@pytest.mark.parametrize("likelihood", ["bernoulli", "gaussian"])
def test_pruning_curve_mean_predictive_needs_class_probabilities(likelihood):
    """``predictive="mean"`` takes the softmax of the exported network's outputs: for one
    Bernoulli logit that is 1 for every input (it failed inside ``gather`` with a dtype error),
    for a regression net meaningless; both are refused by name."""
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = torch.randint(0, 2, (40, 1)).float() if likelihood == "bernoulli" else torch.randn(40, 1)
    options = {"noise": 1.0} if likelihood == "gaussian" else {}
    model = pb.BNN(nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)), likelihood, **options)
    guide = pb.guides.MeanField(model)
    guide(x, y)
    with pytest.raises(ValueError, match="expected a categorical model"):
        pruning.pruning_curve(model, guide, x, y, fractions=[0.5], predictive="mean")
