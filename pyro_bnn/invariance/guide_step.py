"""Invariance learning inside ``pb.fit(model, pb.guides.Laplace(...), marglik=...)``.

The Laplace guide's online schedule (:mod:`pyro_bnn.guides.laplace.online`) calls two
functions when the model has a learnable augmentation:

* :func:`guide_curvature_source` — the data of the guide's full-data curvature pass:
  unshuffled whole-data batches, batch ``i`` drawn under its own seed, split across ranks
  by batch index under ``fit(distributed=True)`` (so the draws, and the curvature, equal
  the single-process ones);
* :func:`guide_online_eta_step` — one ``η`` step along the gradient of the guide's own
  evidence, *reusing the guide's curvature* (the full-data factors are not recomputed): it
  replays that pass's draws batch by batch (:func:`~.step.eta_gradient_pass`).

:func:`guide_eta_step` is the stand-alone version (own full-data pass, explicit batches).
"""

from __future__ import annotations

import torch

from ..curvature import KronBlock, SplitBiasKronBlock
from ..data.batches import TensorBatches, split_batch
from ..model.bnn import is_bnn
from ..model.modes import evaluation_mode
from ..training.distributed import unsharded_batches
from .augmentation import _Augmentation
from .evidence import batch_seeds, invariant_curvature, likelihood_scale, log_evidence_at
from .step import eta_grad, eta_gradient_pass

__all__ = ["learnable_augmentation", "guide_eta_optimizer", "guide_eta_step",
           "guide_curvature_source", "guide_online_eta_step"]


def learnable_augmentation(model):
    """The model's augmentation if invariance learning may train it, else ``None``."""
    if not is_bnn(model):
        return None
    aug = model._modules.get("augmentation")
    return aug if isinstance(aug, _Augmentation) and aug.learnable else None


def guide_eta_optimizer(model, lr: float):
    """Adam over ``η`` for the online schedule of a Laplace guide (``None``: nothing to learn)."""
    aug = learnable_augmentation(model)
    return None if aug is None else torch.optim.Adam([aug.eta], lr=float(lr))


class _SeededBatches:
    """Re-iterable ``(x, y)`` batches that seed torch's RNG with ``seeds[i]`` just before
    yielding batch ``i``, so the augmentation draws of a curvature pass over them (which
    runs the model on each batch as it comes) can be replayed.  Iterate it inside
    ``torch.random.fork_rng`` (the guide's deterministic pass does)."""

    def __init__(self, batches, seeds):
        self.batches, self.seeds = batches, seeds

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch, seed in zip(self.batches, self.seeds):
            torch.manual_seed(int(seed))
            yield batch


def _pass_seed(seed: int) -> int:
    """Base seed of a guide pass: passes with neighbouring seeds (the evidence-noise pass
    uses ``seed + 1``) get disjoint per-batch seeds."""
    return int(seed) * 1_000_003


def _share(batches: list, rank: int, world: int, seed: int, reduce_fn):
    """This rank's batches and seeds; a rank without a batch runs batch 0 and contributes
    zeros (the returned curvature reduce zeroes its sums before the all-reduce)."""
    mine = [i for i in range(len(batches)) if i % world == rank]
    local, seeds = [batches[i] for i in mine], batch_seeds(seed, mine)
    if local:
        return local, seeds, local, seeds, reduce_fn
    if reduce_fn is None:
        raise ValueError(f"rank {rank} of {world} has no batch and no reduce_fn")
    return [], [], [batches[0]], batch_seeds(seed, [0]), (
        lambda sums: reduce_fn({k: v * 0 for k, v in sums.items()}))


def _whole_data_batches(ctx, batch_size: int, device):
    """Unshuffled ``(x, y)`` batches of all the training data (the same on every rank)."""
    dstate = getattr(ctx, "distributed", None)
    if isinstance(ctx.loader, TensorBatches):
        loader = TensorBatches(ctx.loader.x, ctx.loader.y, batch_size, shuffle=False)
    else:
        loader = unsharded_batches(ctx.loader, batch_size)
    rank, world = (0, 1) if dstate is None else (dstate.rank, dstate.world_size)
    batches = [split_batch(b) for b in loader]
    batches = [(x.to(device), y.to(device)) if i % world == rank or i == 0 else (x, y)
               for i, (x, y) in enumerate(batches)]
    return batches, rank, world, None if dstate is None else dstate.reduce_sums


def _guide_device(guide):
    return next(iter(guide.map_values().values())).device


def guide_curvature_source(ctx, batch_size: int, seed: int) -> dict:
    """``fit_curvature`` arguments (``data``, ``reduce_fn``) of a Laplace guide's full-data
    pass whose augmentation draws :func:`guide_online_eta_step` replays (same ``seed``)."""
    batches, rank, world, reduce_fn = _whole_data_batches(ctx, batch_size, _guide_device(ctx.guide))
    _, _, run, seeds, reduce_curvature = _share(batches, rank, world, _pass_seed(seed), reduce_fn)
    return {"data": _SeededBatches(run, seeds), "reduce_fn": reduce_curvature}


def _layer_deltas(guide, blocks):
    deltas = [d.detach() for d in guide.layer_prior_precisions()]
    for d, block in zip(deltas, blocks):
        if d.dim() != 0 and not isinstance(block, SplitBiasKronBlock):
            raise ValueError("learning an augmentation with a Laplace guide needs a scalar or "
                             f"layer-wise prior precision, got one of shape {tuple(d.shape)}")
    return deltas


def _eta_step(guide, model, local, seeds, optimizer, curvature, reduce_fn, probe_x) -> float:
    values = {k: v.detach().requires_grad_() for k, v in guide.map_values().items()}
    deltas = _layer_deltas(guide, curvature.blocks)
    optimizer.zero_grad()
    eta_gradient_pass(model, values, local, seeds, guide.layers, curvature.blocks, deltas,
                      curvature.num_data, reduce_fn=reduce_fn)
    optimizer.step()
    _, _, noise = likelihood_scale(model, values, probe_x[:2])
    with torch.no_grad():
        return float(log_evidence_at(curvature, guide.layers, values, deltas, noise))


def guide_online_eta_step(guide, ctx, optimizer, seed: int) -> float:
    """One ``η`` step on the evidence of ``guide``'s current curvature (``fit`` hook).

    ``guide.posterior`` must be the pass over :func:`guide_curvature_source` ``(ctx, ...,
    seed)`` with the same ``seed`` at the current θ* and η: its factors are reused and only
    the replay pass (each batch's factors with autograd on) runs.  A ``diag``/``full``
    guide has no Kronecker factors to reuse: the step then makes its own KFAC pass over the
    same draws.  Returns the log evidence (total) of the KFAC curvature used, before the step.
    """
    model = guide.base_model
    batches, rank, world, reduce_fn = _whole_data_batches(ctx, guide.curvature_batch_size,
                                                          _guide_device(guide))
    local, seeds, run, run_seeds, reduce_curvature = _share(batches, rank, world, _pass_seed(seed),
                                                            reduce_fn)
    curvature = guide.posterior
    with evaluation_mode(model):      # as fit_curvature: BatchNorm's running statistics, no Dropout
        if curvature is None or not all(isinstance(b, (KronBlock, SplitBiasKronBlock))
                                        for b in curvature.blocks):
            curvature = _own_curvature(guide, model, run, run_seeds, reduce_curvature)
        return _eta_step(guide, model, local, seeds, optimizer, curvature, reduce_fn, run[0][0])


def _own_curvature(guide, model, batches, seeds, reduce_fn):
    values = {k: v.detach().requires_grad_() for k, v in guide.map_values().items()}
    with eta_grad(model._modules.get("augmentation"), False):
        return invariant_curvature(model, values, batches, seeds, layers=guide.layers, reduce_fn=reduce_fn)


def guide_eta_step(guide, model, batches, optimizer, seed: int = 0, distributed=None) -> float:
    """One evidence-gradient step on ``η`` at a Laplace guide's MAP and prior precisions.

    Makes its own full-data KFAC pass (joint weight-bias factors) over ``batches``:
    unshuffled ``(x, y)`` minibatches of the *whole* training data, batch ``i`` drawn with
    seed ``seed + i``.  ``distributed``: a :class:`pyro_bnn.training.distributed.DistributedState`
    to split the batches across ranks and all-reduce the sums; ``None``: one process.
    Returns the log evidence (a total over the data, the guide's Laplace layers) before
    the step.
    """
    rank, world = (0, 1) if distributed is None else (distributed.rank, distributed.world_size)
    reduce_fn = None if distributed is None else distributed.reduce_sums
    device = _guide_device(guide)
    data = [(xb.to(device), yb.to(device)) if i % world == rank or i == 0 else (xb, yb)
            for i, (xb, yb) in enumerate(split_batch(b) for b in batches)]
    if not data:
        raise ValueError("no batches given")
    local, seeds, run, run_seeds, reduce_curvature = _share(data, rank, world, seed, reduce_fn)
    with evaluation_mode(model):      # as fit_curvature: BatchNorm's running statistics, no Dropout
        curvature = _own_curvature(guide, model, run, run_seeds, reduce_curvature)
        return _eta_step(guide, model, local, seeds, optimizer, curvature, reduce_fn, run[0][0])
