"""Laplace-KFAC evidence of an invariant model and its η-gradient by minibatches.

Built on :mod:`pyro_bnn.curvature` and :func:`pyro_bnn.curvature.marglik.log_evidence`, with their
conventions: per layer ``l`` the posterior precision is the
:class:`~pyro_bnn.curvature.structures.KronBlock` ``P_l = s·G_l ⊗ A_l + δ_l I`` (``A_l`` the
summed input factor, ``G_l`` the output factor divided by ``N·T_l``), ``s = 1/σ²`` for a
Gaussian likelihood (whose factors use ``Λ = I``) and 1 otherwise, and::

    log p(D | δ, η) ≈ Σ_n log p(y_n | f̂_n) − ½ Σ_l [log det P_l − p_l log δ_l + δ_l ‖θ_l‖²]

is a **total over the data set** (nats), never a per-datum value.

The invariant model averages the network over ``S`` transformed copies,
``f̂(x) = (1/S) Σ_s f(T_s x)``; its KFAC factors average the layer inputs and sum the
output gradients over the copies (``num_augmentations`` of
:func:`~pyro_bnn.curvature.kfac.batch_kfac_factors`).  The draws ``T_s`` of batch ``i`` are
made under the seed ``seeds[i]`` (:func:`pyro_bnn.training.seeding.seeded` with ``device=``),
so a second pass can replay them.

The η-gradient of ``log det P_l`` is ``tr(P_l⁻¹ ∂H_l/∂η)``.  ``H_l`` is a product of sums
over the data, so by the product rule ``∂H_l = Σ_b (G_l ⊗ ∂A_b + ∂G_b ⊗ A_l)`` over
minibatches ``b``: :func:`eta_surrogate` rebuilds one batch's factors with autograd on and
takes :meth:`~pyro_bnn.curvature.structures.KronBlock.logdet_derivative` against the
full-data blocks; the gradients of its values, summed over the batches, are exactly the
gradient of the full-data evidence (for fixed θ and fixed draws), with the memory of one
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..curvature import CurvatureFit, Layer, accumulate_curvature, batch_kfac_factors, find_layers
from ..curvature import marglik as ml
from ..curvature.network import likelihood_kind, log_likelihood_terms
from ..model.bnn import num_augmentations
from ..training.seeding import seeded

__all__ = ["invariant_layers", "likelihood_scale",
           "batch_seeds", "invariant_curvature", "eta_surrogate", "log_evidence_at"]


def invariant_layers(model, values: dict) -> list[Layer]:
    """The model's curvature groups (Linear/Conv2d layers whose weights are ``values``' sites).

    Raises
    ------
    ValueError
        A site is not the weight or bias of a Linear or Conv2d layer
        (:func:`~pyro_bnn.curvature.layers.find_layers`).
    """
    return find_layers(model, {k: v.shape for k, v in values.items()})


def likelihood_scale(model, values: dict, x: torch.Tensor):
    """``(kind, s, σ)``: the likelihood kind, the curvature scale ``s`` (``1/σ²`` for a
    Gaussian, else 1) and the Gaussian noise (``None`` otherwise), all without a graph."""
    kind, noise = likelihood_kind(model, values, x)
    if noise is None:
        return kind, 1.0, None
    noise = noise.detach()
    return kind, noise ** -2, noise


def batch_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """Seeds of the augmentation draws of batches ``indices`` (their positions among all the
    data's batches): batch ``i`` is drawn with ``seed + i``, on any rank."""
    return [int(seed) + int(i) for i in indices]


def invariant_curvature(model, values: dict, batches: Sequence, seeds: Sequence[int], *,
                        layers: list[Layer] | None = None,
                        reduce_fn: Callable[[dict], dict] | None = None) -> CurvatureFit:
    """Full-data KFAC curvature and log-likelihood of ``f̂`` at ``values``, batch ``i`` drawn
    under ``seeds[i]`` (one :func:`~pyro_bnn.curvature.fit.accumulate_curvature` pass, no graph).

    Parameters
    ----------
    model : pyro_bnn.BNN
        With or without an augmentation (without: ordinary KFAC).
    values : dict
        ``{site: tensor}`` weights; they must require grad (the layer outputs need a graph).
    batches : sequence of (x, y)
    seeds : sequence of int
        One per batch.
    layers : list of Layer, optional
        Default: :func:`invariant_layers`.
    reduce_fn : callable, optional
        All-reduce of the flat dict of sums (distributed passes).

    Returns
    -------
    CurvatureFit
        ``blocks``: one :class:`~pyro_bnn.curvature.structures.KronBlock` per layer;
        ``loglik_stats`` and ``num_data`` summed over the batches (and ranks).
    """
    if len(seeds) != len(batches):
        raise ValueError(f"expected one seed per batch, got {len(seeds)} seeds for {len(batches)} batches")
    layers = invariant_layers(model, values) if layers is None else layers
    x0 = batches[0][0]
    kind, _, _ = likelihood_scale(model, values, x0[:2])
    stream = iter(seeds)

    def run(x):
        with seeded(next(stream), device=x.device):
            return model.run_with(values, x)

    return accumulate_curvature(layers, batches, run, kind, "kron", reduce_fn=reduce_fn,
                                num_augmentations=num_augmentations(model), model=model)


def eta_surrogate(model, values: dict, x: torch.Tensor, y: torch.Tensor, layers: list[Layer],
                  blocks: Sequence, prior_precision: Sequence[torch.Tensor], num_data: int,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's share of the evidence whose η-gradient is that batch's share of ``∂ log p(D)``.

    Run it under the batch's seed (:func:`pyro_bnn.training.seeding.seeded` with ``device=``),
    with ``η`` requiring grad.

    Parameters
    ----------
    model, values : the invariant model and its MAP weights.
    x, y : Tensor
        The batch.
    layers : list of Layer
        The curvature groups of ``blocks`` (same order).
    blocks : sequence of KronBlock or SplitBiasKronBlock
        The full-data curvature (the same draws as this pass).
    prior_precision : sequence of Tensor
        ``δ_l`` per block, 0-d (no graph needed).
    num_data : int
        ``N`` of the full-data curvature.

    Returns
    -------
    surrogate : Tensor, 0-d
        ``log p(y_b | f̂(x_b)) − ½ Σ_l logdet_derivative(A_b, G_b/(N T_l))``; only its
        gradient is meaningful (its value is not the evidence).
    log_lik : Tensor, 0-d
        ``log p(y_b | f̂(x_b))`` without a graph.
    """
    kind, scale, noise = likelihood_scale(model, values, x[:2])
    f, sums = batch_kfac_factors(layers, lambda: model.run_with(values, x), kind,
                                 num_augmentations=num_augmentations(model), create_graph=True)
    ll = ml.log_likelihood_from_stats(log_likelihood_terms(kind, f, y), noise)
    trace = 0.0
    for layer, block, delta in zip(layers, blocks, prior_precision):
        part = sums[layer.path]
        positions = part["count"] / len(x)                            # T_l
        trace = trace + block.logdet_derivative(part["A"], part["G"] / (num_data * positions),
                                                delta.detach(), scale)
    return ll - 0.5 * trace, ll.detach()


def log_evidence_at(curvature: CurvatureFit, layers: list[Layer], values: dict,
                    prior_precision: Sequence[torch.Tensor], noise: torch.Tensor | None = None,
                    ) -> torch.Tensor:
    """:func:`pyro_bnn.curvature.marglik.log_evidence` of a KFAC curvature fit (total, differentiable in δ).

    ``noise``: the Gaussian σ (``None`` otherwise); ``s = 1/σ²``.
    """
    theta = [layer.flatten(values).reshape(-1).detach() for layer in layers]
    log_lik = ml.log_likelihood_from_stats(curvature.loglik_stats, noise)
    scale = 1.0 if noise is None else noise ** -2
    return ml.log_evidence(log_lik, curvature.blocks, theta, list(prior_precision), scale)
