"""One hyperparameter step of invariance learning: ``δ`` by the evidence, ``η`` by its gradient.

:func:`evidence_step` makes two passes over the data (never one big graph: memory of one
batch): a full-data KFAC pass without a graph (:func:`~.evidence.invariant_curvature`),
then — to move ``η`` — a second pass that replays each batch's augmentation draws and
backpropagates :func:`~.evidence.eta_surrogate`.  Between the two, ``log δ`` takes Adam
steps on the closed-form evidence (:func:`pyro_bnn.curvature.marglik.log_evidence`, no data pass).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..model.modes import evaluation_mode
from ..training.seeding import seeded
from .evidence import (
    batch_seeds,
    eta_surrogate,
    invariant_curvature,
    invariant_layers,
    likelihood_scale,
    log_evidence_at,
)

__all__ = ["evidence_step", "eta_gradient_pass", "eta_grad"]


@contextmanager
def eta_grad(aug, on: bool):
    """Let ``η`` receive gradients inside the block only (``aug=None``: no-op)."""
    if aug is None:
        yield
        return
    old = aug.eta.requires_grad
    aug.eta.requires_grad_(on)
    try:
        yield
    finally:
        aug.eta.requires_grad_(old)


def eta_gradient_pass(model, values: dict, batches, seeds, layers, blocks, prior_precision,
                      num_data: int, *, reduce_fn=None) -> None:
    """Accumulate ``−∂ log p(D)/∂η / N`` into ``η.grad`` by replaying each batch's draws.

    ``blocks`` must be the full-data curvature of the same draws (batch ``i`` under
    ``seeds[i]``); ``reduce_fn`` all-reduces the gradient over ranks (this rank's
    ``batches`` only are run).  The caller zeroes ``η.grad`` before and steps after.
    """
    aug = model._modules["augmentation"]
    with eta_grad(aug, True):
        for (xb, yb), sd in zip(batches, seeds):
            with seeded(sd, device=xb.device):
                sur, _ = eta_surrogate(model, values, xb, yb, layers, blocks, prior_precision, num_data)
            (-sur / num_data).backward(inputs=[aug.eta])
    if reduce_fn is not None:
        grad = aug.eta.grad if aug.eta.grad is not None else torch.zeros_like(aug.eta)
        aug.eta.grad = reduce_fn({"eta": grad.detach()})["eta"].clone()


def evidence_step(model, values: dict, batches, log_delta: torch.Tensor, *,
                  delta_optimizer=None, delta_steps: int = 0, eta_optimizer=None,
                  seed: int = 0, rank: int = 0, world_size: int = 1, reduce_fn=None) -> float:
    """One hyperparameter step: refit KFAC, update ``log δ`` (closed form) and ``η`` (batched).

    Parameters
    ----------
    model : pyro_bnn.BNN
        With an augmentation whose ``η`` ``eta_optimizer`` updates (``None``: δ only).
    values : dict
        MAP weights.
    batches : sequence of (x, y)
        The training data in minibatches (the first pass builds the curvature, the second
        replays the same draws batch by batch).
    log_delta : Tensor, shape (L,)
        Log prior precisions per layer (:func:`~.evidence.invariant_layers` order); updated
        in place by ``delta_optimizer`` (``delta_steps`` Adam steps on the closed-form
        evidence) when one is given.
    eta_optimizer : torch.optim.Optimizer, optional
        Over the augmentation's ``η``; takes one step up the evidence gradient.
    seed : int
        Base seed of the augmentation draws: batch ``i`` (its index among *all* the data's
        batches) is drawn with seed ``seed + i`` (:func:`~.evidence.batch_seeds`).
    rank, world_size, reduce_fn : int, int, callable, optional
        Data-parallel evidence step (``fit(distributed=True)``): ``batches`` are the whole
        data's batches (same on every rank) and this rank takes batches ``i ≡ rank (mod
        world_size)``, with the same seeds as one process; ``reduce_fn`` (e.g.
        :func:`pyro_bnn.training.distributed.all_reduce_sums`) sums the Kronecker factors, ``N``,
        the log-likelihood and the ``η`` gradient over ranks, so every rank takes the
        single-process step (up to summation order).

    Returns
    -------
    float
        The log evidence, a **total** over the data set (not per datum), at the start of
        the ``η`` step (after the ``δ`` steps).
    """
    indexed = list(enumerate(batches))
    if not indexed:
        raise ValueError("no batches given")
    mine = [(i, b) for i, b in indexed if i % world_size == rank]
    local, seeds = [b for _, b in mine], batch_seeds(seed, [i for i, _ in mine])
    reduce_curvature = reduce_fn
    if not local:       # more ranks than batches: contribute zeros of the right shapes
        if reduce_fn is None:
            raise ValueError(f"rank {rank} of {world_size} has no batch and no reduce_fn")
        local_run, seeds_run = [indexed[0][1]], batch_seeds(seed, [0])

        def reduce_curvature(sums):
            return reduce_fn({k: v * 0 for k, v in sums.items()})
    else:
        local_run, seeds_run = local, seeds
    with evaluation_mode(model):      # BatchNorm's running statistics, no Dropout, as fit_curvature
        vals = {k: v.detach().requires_grad_() for k, v in values.items()}
        layers = invariant_layers(model, vals)
        aug = model._modules.get("augmentation")
        with eta_grad(aug, False):
            curvature = invariant_curvature(model, vals, local_run, seeds_run, layers=layers,
                                            reduce_fn=reduce_curvature)
        n = curvature.num_data
        _, _, noise = likelihood_scale(model, vals, local_run[0][0][:2])
        for _ in range(delta_steps if delta_optimizer is not None else 0):
            delta_optimizer.zero_grad()
            (-log_evidence_at(curvature, layers, vals, log_delta.exp(), noise) / n).backward()
            delta_optimizer.step()
        delta = list(log_delta.detach().exp())
        with torch.no_grad():
            value = float(log_evidence_at(curvature, layers, vals, delta, noise))
        if eta_optimizer is not None and aug is not None:
            eta_optimizer.zero_grad()
            eta_gradient_pass(model, vals, local, seeds, layers, curvature.blocks, delta, n,
                              reduce_fn=reduce_fn)
            eta_optimizer.step()
    return value
