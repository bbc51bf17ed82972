"""The fast paths of the pruned GLM covariance (:mod:`pyro_bnn.curvature.masks`) and of the δ grid search.

* Both ways a masked Kronecker layer is taken into its eigenbasis — the rotation of the masked
  per-example Jacobian and the mask-pattern factors — forced one at a time, against the dense
  autograd reference of ``test_laplace_pruned_glm`` (float64, 1e-9), for a joint and a separate
  bias, a per-site δ that differs between weight and bias (a whitened basis of its own), an MLP
  and a CNN.
* :func:`pyro_bnn.curvature.glm.batch_covariances` (all δ at once) against
  :func:`~pyro_bnn.curvature.glm.batch_covariance` δ by δ: to 1e-12 for pruned models; for
  unpruned ones bit for bit up to ``PER_DELTA_PRODUCTS`` δ and to 1e-12 beyond; and
  ``validation_nll`` on a grid against one candidate at a time (bit for bit for an unpruned MLP
  with a scalar δ, whose dense layers keep the per-δ operations).
"""

from __future__ import annotations

import pytest
import torch
from test_laplace_pruned_glm import ATOL, RTOL, _reference, _score, _setup

from pyro_bnn.analysis.pruning import prune_, unprune_
from pyro_bnn.curvature import jacobian_factors, structures
from pyro_bnn.curvature import masks as masks_module
from pyro_bnn.curvature.glm import batch_covariance, batch_covariances

KRON_CASES = [                       # (kind, kron_bias, prior_structure, per-site δ distinct)
    ("mlp", "joint", "auto", False),
    ("mlp", "joint", "sitewise", False),     # the same δ for weight and bias: the block's own basis
    ("mlp", "joint", "sitewise", True),      # different ones: a whitened basis
    ("mlp", "separate", "sitewise", True),
    ("conv", "joint", "auto", False),
    ("conv", "joint", "sitewise", True),
    ("conv", "separate", "sitewise", True),
]


def _distinct_site_deltas(guide):
    """Per-site δ that differ between sites (so a joint ``[W, b]`` block whitens its own basis)."""
    n = guide.log_prior_precision.numel()
    with torch.no_grad():
        guide.log_prior_precision.copy_(torch.linspace(-1.0, 1.5, n, dtype=torch.float64).reshape(
            guide.log_prior_precision.shape))


@pytest.mark.parametrize("path", ["rotation", "pattern"])
@pytest.mark.parametrize("kind,kron_bias,prior_structure,distinct", KRON_CASES)
def test_each_kronecker_path_matches_the_dense_reference(monkeypatch, path, kind, kron_bias, prior_structure,
                                                         distinct):
    model, guide, net, x = _setup(kind, "kron", "all", kron_bias, prior_structure)
    if distinct:
        _distinct_site_deltas(guide)
    else:
        assert guide.prior_precision.unique().numel() == 1
    chosen = []

    def forced(*args):
        chosen.append(args)
        return path == "pattern"

    monkeypatch.setattr(masks_module, "_by_pattern", forced)
    with prune_(model, guide, fraction=0.5, score=_score(model)) as handle:
        f, cov = guide.functional_covariance(x, batch_size=5)
        f_ref, _, cov_ref = _reference(guide, net, x, handle.masks)
    assert chosen, "no masked Kronecker layer went through the choice of path"
    torch.testing.assert_close(f, f_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(cov, cov_ref, rtol=RTOL, atol=ATOL)


def test_the_cheaper_path_is_chosen_by_multiplications():
    # a dense layer whose mask has 1 pattern: the pattern factors (no per-example J at all)
    assert masks_module._by_pattern(10, 1, 1, 200, 785)
    # every row its own pattern: the rotation (Q_A once per example)
    assert not masks_module._by_pattern(10, 1, 200, 200, 785)
    # a convolution (T = 576 positions) with 5 row patterns: the rotation
    assert not masks_module._by_pattern(10, 576, 5, 6, 26)


def _factors_and_candidates(guide, x, grid):
    with guide._linearization() as (run, device):
        factors = list(jacobian_factors(guide.layers, run, x, 5, dense=guide.structure == "full"))
    cands = [guide._block_inputs(guide._candidate(v))[1] for v in grid]
    _, _, scale = guide._kind_and_scale()
    return factors, [[d.detach() for d in c] for c in cands], scale


GRID_CASES = [
    ("mlp", "kron", "joint", "auto"),
    ("mlp", "kron", "joint", "sitewise"),
    ("mlp", "kron", "separate", "sitewise"),
    ("conv", "kron", "joint", "auto"),
    ("conv", "kron", "separate", "sitewise"),
    ("mlp", "diag", "joint", "diagonal"),
    ("conv", "diag", "joint", "auto"),
    ("mlp", "full", "joint", "auto"),
    ("batchnorm", "kron", "joint", "auto"),
]


@pytest.mark.parametrize("num", [2, 7])
@pytest.mark.parametrize("kind,structure,kron_bias,prior_structure", GRID_CASES)
def test_all_delta_covariances_equal_the_per_delta_ones(monkeypatch, num, kind, structure, kron_bias,
                                                        prior_structure):
    """``num`` δ at once (2: δ by δ; 7: the pairs' products in blocks of a few columns) against one
    δ at a time: to 1e-12 when pruned (either path); when not, bit for bit up to
    ``PER_DELTA_PRODUCTS`` δ, to 1e-12 beyond; plus a candidate with distinct per-site δ (its own
    whitened basis) among scalar ones."""
    monkeypatch.setattr(structures, "DELTA_BLOCK_VALUES", 16)
    model, guide, _, x = _setup(kind, structure, "all", kron_bias, prior_structure)
    grid = list(torch.logspace(-2, 2, num, dtype=torch.float64))
    if prior_structure == "sitewise":
        n = guide.log_prior_precision.numel()
        grid[-1] = torch.linspace(0.5, 3.0, n, dtype=torch.float64)
    factors, cands, scale = _factors_and_candidates(guide, x, grid)
    layers, blocks = guide.layers, guide.posterior.blocks
    for fac in factors:
        together = batch_covariances(layers, blocks, cands, scale, fac)
        alone = torch.stack([batch_covariance(layers, blocks, d, scale, fac) for d in cands])
        if num <= structures.PER_DELTA_PRODUCTS:
            assert torch.equal(together, alone)
        else:
            torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-15)
    for path in ("rotation", "pattern"):
        monkeypatch.setattr(masks_module, "_by_pattern", lambda *args, p=path: p == "pattern")
        with prune_(model, guide, fraction=0.5, score=_score(model)):
            masks = guide._layer_masks()
            for fac in factors:
                together = batch_covariances(layers, blocks, cands, scale, fac, masks)
                alone = torch.stack([batch_covariance(layers, blocks, d, scale, fac, masks) for d in cands])
                torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-15)
                assert not torch.allclose(together[0], together[1])


@pytest.mark.parametrize("structure,kron_bias", [("kron", "joint"), ("kron", "separate"), ("diag", "joint")])
@pytest.mark.parametrize("pruned", [False, True])
def test_grid_validation_nll_equals_one_candidate_at_a_time(structure, kron_bias, pruned):
    """The grid search scores all δ per batch (each with its own generator, so the Monte-Carlo
    draws are those of a candidate scored alone): the same losses as one call per δ."""
    model, guide, _, x = _setup("mlp", structure, kron_bias=kron_bias)
    y = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(4))
    grid = [0.01, 0.3, 1.0, 7.0, 50.0, 300.0]
    if pruned:
        prune_(model, guide, fraction=0.5, score=_score(model))
    try:
        for link in ("mc", "probit"):
            together = guide.validation_nll(x, y, grid, link_approx=link, num_samples=50, batch_size=5)
            alone = torch.cat([guide.validation_nll(x, y, [d], link_approx=link, num_samples=50, batch_size=5)
                               for d in grid])
            if pruned:
                torch.testing.assert_close(together, alone, rtol=1e-10, atol=0.0)
            else:
                assert torch.equal(together, alone)
            assert len(set(together.tolist())) == len(grid)
    finally:
        unprune_(model)
