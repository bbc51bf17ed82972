"""The Laplace GLM predictive of a pruned model (``prune_`` then ``pb.predict``).

``prune_`` masks weights on the model, so the pruned network is ``f(x; M ⊙ θ)`` and its GLM
has ``Σ_f = (J M) P⁻¹ (J M)ᵀ`` (``M`` the diagonal 0/1 mask): checked against a dense
reference — the full Jacobian by ``torch.autograd.functional.jacobian`` of the plain network
at ``M ⊙ θ*``, masked, times the dense ``P⁻¹`` of the guide's blocks — for every curvature
structure (Kronecker with a joint or a separate bias, and a per-site δ; diagonal; full), on
all layers and the last layer, on an MLP, a CNN (``T > 1`` positions per example) and a net
with random BatchNorm affine parameters (unit-wise blocks), in float64 to 1e-9 relative.
Unpruned models keep the unmasked computation bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.pruning import prune_, unprune_
from pyro_bnn.curvature import functional_covariance

RTOL, ATOL = 1e-9, 1e-12


def _norm_affine_too(name, module, param):
    return isinstance(module, (nn.Linear, nn.Conv2d, nn.BatchNorm1d))


def _setup(kind="mlp", structure="kron", subset="all", kron_bias="joint", prior_structure="auto", seed=0):
    """A tiny float64 model, its Laplace guide with curvature at the initial weights, the plain
    network (for the reference Jacobian) and inputs."""
    torch.manual_seed(seed)
    stochastic = None
    if kind == "conv":
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3))
        x = torch.randn(12, 1, 5, 5, dtype=torch.float64)
    elif kind == "batchnorm":
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
        with torch.no_grad():
            net(torch.randn(30, 3) * 2 + 0.5)                   # running statistics ≠ (0, 1)
            net[1].weight.uniform_(0.5, 1.5)
            net[1].bias.normal_()
        stochastic = _norm_affine_too
        x = torch.randn(12, 3, dtype=torch.float64)
    else:
        net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))
        x = torch.randn(12, 3, dtype=torch.float64)
    net = net.double().eval()
    y = torch.randint(0, 3, (len(x),))
    model = pb.BNN(copy.deepcopy(net), "categorical", stochastic=stochastic).double().eval()
    guide = pb.guides.Laplace(model, structure=structure, subset=subset, kron_bias=kron_bias,
                              prior_structure=prior_structure)
    guide.fit_curvature((x, y))
    return model, guide, net, x


def _score(model, seed=1):
    """Random pruning scores; row 0 of the last layer's weight lowest (a fully pruned row)."""
    gen = torch.Generator().manual_seed(seed)
    values = model.initial_values()
    score = {s: torch.rand(v.shape, generator=gen, dtype=torch.float64) for s, v in values.items()}
    last = [s for s in score if s.endswith("weight")][-1]
    score[last][0] = -1.0
    return score


def _flat(layer, values: dict, shapes: dict) -> torch.Tensor:
    """``W̃ = [W, b]`` of a layer flattened row-major, with leading draw dimensions kept."""
    ref = values[layer.sites[0]]
    lead = ref.shape[:ref.dim() - len(shapes[layer.sites[0]])]
    parts = []
    if layer.weight is not None:
        parts.append(values[layer.weight].reshape(*lead, layer.out_features, -1))
    if layer.bias is not None:
        parts.append(values[layer.bias].reshape(*lead, layer.out_features, 1))
    return torch.cat(parts, -1).reshape(*lead, -1)


def _dense_posterior_covariance(guide) -> torch.Tensor:
    _, deltas = guide._block_inputs()
    _, _, scale = guide._kind_and_scale()
    return torch.block_diag(*[b.covariance(d, scale) for b, d in zip(guide.posterior.blocks, deltas)])


def _reference(guide, net, x, masks):
    """``f(x; M ⊙ θ*)`` ``(N, C)``, the masked Jacobian ``J M`` ``(N, C, P)`` and
    ``Σ_f = (J M) P⁻¹ (J M)ᵀ``, by autograd on the plain network."""
    theta = {s: v.detach() for s, v in guide.map_values().items()}
    pruned = {s: v * masks[s].to(v) if s in masks else v for s, v in theta.items()}
    layers = guide.layers

    def f(vec):
        values, start = dict(pruned), 0
        for layer in layers:
            values.update(layer.unflatten_flat(vec[start:start + layer.numel], guide.site_shapes))
            start += layer.numel
        # contiguous: torch 2.14's CPU batch_norm (eval) backward gives wrong input gradients
        # for a strided γ view that requires grad (γ is column 0 of BatchNorm's W̃ = [γ, β])
        params = {s[len("net."):]: v.contiguous() for s, v in values.items()}
        return torch.func.functional_call(net, params, (x,))

    at = torch.cat([_flat(layer, pruned, guide.site_shapes) for layer in layers])
    J = torch.autograd.functional.jacobian(f, at)                             # (N, C, P)
    ones = {s: torch.ones_like(v) for s, v in theta.items()}
    kept = {**ones, **{s: masks[s].to(v) for s, v in theta.items() if s in masks}}
    m = torch.cat([_flat(layer, kept, guide.site_shapes) for layer in layers])
    JM = J * m
    cov = torch.einsum("ncp,pq,ndq->ncd", JM, _dense_posterior_covariance(guide), JM)
    return f(at).detach(), JM, cov


CASES = [
    ("mlp", "kron", "all", "joint", "auto"),
    ("mlp", "kron", "all", "joint", "sitewise"),          # per-column δ: the whitened Kronecker path
    ("mlp", "kron", "all", "separate", "sitewise"),       # SplitBiasKronBlock
    ("mlp", "kron", "last_layer", "joint", "auto"),
    ("mlp", "diag", "all", "joint", "diagonal"),
    ("mlp", "diag", "last_layer", "joint", "auto"),
    ("mlp", "full", "all", "joint", "auto"),
    ("mlp", "full", "last_layer", "joint", "auto"),
    ("conv", "kron", "all", "joint", "auto"),
    ("conv", "kron", "all", "separate", "sitewise"),
    ("conv", "diag", "all", "joint", "auto"),
    ("conv", "full", "all", "joint", "auto"),
    ("batchnorm", "kron", "all", "joint", "auto"),        # BatchNorm's γ, β: UnitBlock
    ("batchnorm", "diag", "all", "joint", "auto"),
]


@pytest.mark.parametrize("kind,structure,subset,kron_bias,prior_structure", CASES)
def test_pruned_glm_matches_dense_masked_reference(kind, structure, subset, kron_bias, prior_structure):
    model, guide, net, x = _setup(kind, structure, subset, kron_bias, prior_structure)
    f0, cov0 = guide.functional_covariance(x)
    # the reference itself: without masks it is the guide's unpruned GLM
    _, _, ref0 = _reference(guide, net, x, {})
    torch.testing.assert_close(cov0, ref0, rtol=RTOL, atol=ATOL)
    handle = prune_(model, guide, fraction=0.5, score=_score(model))
    try:
        assert 0 < handle.num_pruned < handle.num_total
        f, cov = guide.functional_covariance(x, batch_size=5)
        f_ref, _, cov_ref = _reference(guide, net, x, handle.masks)
        torch.testing.assert_close(f, f_ref, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(cov, cov_ref, rtol=RTOL, atol=ATOL)
        assert not torch.allclose(cov, cov0)
    finally:
        unprune_(model)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_weights_only_pruning_keeps_the_bias_uncertainty(structure):
    """``sites=`` of weights only: the biases are unmasked entries of the same layers."""
    model, guide, net, x = _setup("mlp", structure)
    handle = prune_(model, guide, fraction=0.6, score=_score(model), sites=lambda s: s.endswith("weight"))
    try:
        assert set(handle.masks) == {s for s in model.site_names if s.endswith("weight")}
        _, cov = guide.functional_covariance(x)
        _, _, cov_ref = _reference(guide, net, x, handle.masks)
        torch.testing.assert_close(cov, cov_ref, rtol=RTOL, atol=ATOL)
    finally:
        unprune_(model)


@pytest.mark.parametrize("structure,subset", [("kron", "all"), ("diag", "all"), ("full", "all"),
                                              ("kron", "last_layer")])
def test_everything_pruned_has_no_predictive_uncertainty(structure, subset):
    """Every weight and bias masked: ``f ≡ 0`` for every θ, so ``Σ_f`` is exactly 0 and the GLM
    predictive is the masked mean (uniform), as the sampling predictive is."""
    model, guide, _, x = _setup("mlp", structure, subset)
    with prune_(model, guide, fraction=1.0, score=_score(model)):
        f, cov = guide.functional_covariance(x)
        assert torch.equal(f, torch.zeros_like(f))
        assert torch.equal(cov, torch.zeros_like(cov))
        uniform = torch.full((1, len(x), 3), 1 / 3, dtype=torch.float64)
        probit = pb.predict(model, guide, x, predictive="glm_probit")
        torch.testing.assert_close(probit, uniform, rtol=0, atol=1e-15)
        # glm_predictive's Cholesky adds a 1e-8·(1 + max var) jitter: function draws deviate
        # from f by ~1e-4 at most (before the fix: by up to O(1))
        draws = pb.predict(model, guide, x, num_samples=64)
        assert draws.shape == (64, len(x), 3)
        assert float((draws - 1 / 3).abs().max()) < 1e-3
        lin = guide.linearized_samples(x, num_samples=8)
        assert torch.equal(lin.f, torch.zeros_like(lin.f))
        sampled = pb.predict(model, guide, x, num_samples=8, predictive="sample")
        torch.testing.assert_close(sampled, torch.full_like(sampled, 1 / 3), rtol=0, atol=1e-15)


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_validation_nll_of_a_pruned_model_uses_the_masked_glm(structure):
    """The grid search's validation NLL (``optimize_prior_precision(method="gridsearch")``) of an
    everything-pruned model is log C for every δ: f ≡ 0 and Σ_f = 0 (it used the unmasked Σ_f)."""
    model, guide, _, x = _setup("mlp", structure)
    y = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(2))
    with prune_(model, guide, fraction=1.0, score=_score(model)):
        # Monte Carlo over f ~ N(f, Σ_f) (the probit link would map f = 0 to uniform whatever Σ_f);
        # the GLM's Cholesky jitter leaves ~1e-4 of noise in the draws
        nll = guide.validation_nll(x, y, prior_precisions=[0.01, 1.0], link_approx="mc", num_samples=200)
    torch.testing.assert_close(nll, torch.full((2,), math.log(3), dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("structure,subset", [("kron", "all"), ("diag", "last_layer"), ("full", "all")])
def test_pruned_linearized_samples_use_the_masked_jacobian(structure, subset):
    """``f_lin(x; θ_s) = f(x; M ⊙ θ*) + J M (θ_s − θ*)`` for the returned (unmasked) draws θ_s."""
    model, guide, net, x = _setup("mlp", structure, subset)
    with prune_(model, guide, fraction=0.5, score=_score(model)) as handle:
        draws = guide.linearized_samples(x, num_samples=6, generator=torch.Generator().manual_seed(3))
        f_ref, JM, _ = _reference(guide, net, x, handle.masks)
    theta = {s: v.detach() for s, v in guide.map_values().items()}
    shapes = guide.site_shapes
    offsets = torch.cat([_flat(layer, draws.values, shapes) - _flat(layer, theta, shapes) for layer in guide.layers], -1)
    expected = f_ref + torch.einsum("ncp,sp->snc", JM, offsets)
    torch.testing.assert_close(draws.f, expected, rtol=RTOL, atol=1e-11)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_unpruned_glm_is_unchanged_bit_for_bit(structure):
    """No masks, masks of nothing (fraction 0) and after ``unprune_``: the unmasked path of
    :func:`pyro_bnn.curvature.functional_covariance`, to the bit."""
    model, guide, _, x = _setup("conv", structure)
    with guide._linearization() as (run, device):
        _, deltas = guide._block_inputs()
        _, _, scale = guide._kind_and_scale()
        f_old, cov_old = functional_covariance(guide.layers, guide.posterior.blocks, [d.detach() for d in deltas],
                                               scale, run, x, 256)
    f0, cov0 = guide.functional_covariance(x)
    assert torch.equal(f0, f_old) and torch.equal(cov0, cov_old)
    with prune_(model, guide, fraction=0.0, score=_score(model)):
        f, cov = guide.functional_covariance(x)
        assert torch.equal(f, f0) and torch.equal(cov, cov0)
    prune_(model, guide, fraction=0.5, score=_score(model))
    _, cov_pruned = guide.functional_covariance(x)
    assert not torch.allclose(cov_pruned, cov0)
    assert unprune_(model)
    f, cov = guide.functional_covariance(x)
    assert torch.equal(f, f0) and torch.equal(cov, cov0)
    p0 = pb.predict(model, guide, x, predictive="glm_probit")
    with prune_(model, guide, fraction=0.5, score=_score(model)):
        assert not torch.equal(pb.predict(model, guide, x, predictive="glm_probit"), p0)
    assert torch.equal(pb.predict(model, guide, x, predictive="glm_probit"), p0)


def test_pruned_glm_variance_matches_masked_weight_sampling():
    """The statistical meaning: Σ_f equals the covariance of ``J M (θ − θ*)`` for
    ``θ ~ N(θ*, P⁻¹)`` with the masked entries zeroed (4000 draws, 10 % on the trace)."""
    model, guide, net, x = _setup("mlp", "kron")
    with prune_(model, guide, fraction=0.5, score=_score(model)) as handle:
        _, cov = guide.functional_covariance(x)
        draws = guide.linearized_samples(x, num_samples=4000, generator=torch.Generator().manual_seed(0))
    emp = torch.einsum("snc,snd->ncd", draws.f - draws.f.mean(0), draws.f - draws.f.mean(0)) / 3999
    tr, tr_emp = cov.diagonal(dim1=-2, dim2=-1).sum(-1), emp.diagonal(dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(tr_emp, tr, rtol=0.1, atol=0.0)
    assert handle.num_pruned > 0


@pytest.mark.parametrize("structure,kron_bias", [("kron", "joint"), ("kron", "separate"), ("diag", "joint")])
def test_pruned_glm_with_fewer_column_than_row_patterns(structure, kron_bias):
    """A mask of the first layer's ``W̃ = [W, b]`` (5 × 4) with 2 distinct columns and 4 distinct
    rows: the Kronecker path groups it by columns."""
    model, guide, net, x = _setup("mlp", structure, kron_bias=kron_bias)
    keep = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]],
                        dtype=torch.float64)
    score = {"net.0.weight": keep[:, :3] * 2 - 1, "net.0.bias": keep[:, 3] * 2 - 1}
    with prune_(model, guide, fraction=8 / 20, score=score) as handle:
        assert torch.equal(handle.masks["net.0.weight"], keep[:, :3].float())
        _, cov = guide.functional_covariance(x)
        _, _, cov_ref = _reference(guide, net, x, handle.masks)
    torch.testing.assert_close(cov, cov_ref, rtol=RTOL, atol=ATOL)
