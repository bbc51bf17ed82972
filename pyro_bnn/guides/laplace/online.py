"""Online marginal-likelihood training for the Laplace guide (Immer et al. 2021).

:class:`OnlineEvidence`, composed into :class:`~pyro_bnn.guides.Laplace` for one
:func:`pyro_bnn.fit` with ``marglik=``: every ``marglik.every`` epochs after ``burnin`` a
curvature refit and evidence steps on the prior precision (and a learned Gaussian noise, and
a learnable augmentation's ``η``, LILA), keeping the state of the best evidence and restoring
it at the end of ``fit``.

The evidence that selects the best state comes from a deterministic full-data curvature
pass: unshuffled batches over all the data under a fixed RNG seed, so a random
augmentation (LILA) draws the same transformations at every evaluation and states are
compared on common random numbers.  For such a model a second pass with another seed
measures the estimate's own noise, recorded per evaluation in
``history["log_evidence_noise"]`` (0 where the pass is exact: no random augmentation).
Differences between evaluations beyond that noise are real differences of the evidence
between the SGD iterates θ_t (``docs/results/laplace.md``).  Its terms at each evaluation
(:meth:`~pyro_bnn.guides.Laplace.evidence_terms`) are recorded beside it, as
``history["evidence_log_likelihood"]``, ``["evidence_log_det_ratio"]`` and
``["evidence_scatter"]``, so a change of the evidence between lengths of training can be read as
a change of the fit or of the Occam factor.
"""

from __future__ import annotations

import math
import warnings

import torch

from ...arguments import check_int
from ...curvature import marglik as ml
from ...data.batches import BatchCheck, TensorBatches, dataset_size, make_loader
from ...invariance.guide_step import guide_curvature_source, guide_online_eta_step
from ...invariance.learning import guide_eta_optimizer
from ...model.bnn import model_likelihood, num_augmentations
from ...model.likelihoods import Gaussian

__all__ = ["OnlineEvidence", "deterministic_curvature", "EVIDENCE_SEED"]

#: RNG seed of the deterministic curvature pass whose evidence selects the best state.
EVIDENCE_SEED = 20_240_601


class OnlineEvidence:
    """The online-evidence schedule of one :func:`pyro_bnn.fit` of a Laplace guide.

    Made by the guide's ``on_fit_start`` when ``fit(..., marglik=...)`` is given and dropped
    at ``on_fit_end``; it holds everything that lives only during that fit: the
    hyperparameter leaves (log δ, a learned log σ) and their optimiser, a learnable
    augmentation's ``η`` optimiser (LILA) and the best-evidence state.  It talks to the guide
    through its public methods only (``fit_curvature``, ``log_evidence``,
    ``evidence_hyperparameters``, ``evidence_steps``, ``state_dict``).

    Parameters
    ----------
    guide : pyro_bnn.guides.Laplace
    options : pyro_bnn.MarglikOptions
        The ``marglik=`` options: ``every``, ``burnin``, ``steps``, ``lr``.
    """

    def __init__(self, guide, options: ml.MarglikOptions):
        self.guide = guide
        self.options = options
        self.best: tuple | None = None     # (log evidence, guide state, model state)
        lik = model_likelihood(guide.base_model)
        self.noise_frozen = isinstance(lik, Gaussian) and lik.learned
        if self.noise_frozen:      # learned by the evidence, not by the MAP objective
            lik.log_noise.requires_grad_(False)
        self.hyper = guide.evidence_hyperparameters(True if self.noise_frozen else None)
        self.hyper_optimizer = torch.optim.Adam([p for p in self.hyper if p is not None],
                                                lr=options.lr)
        # A learnable augmentation (LILA): η follows the evidence too (pyro_bnn.invariance).
        self.eta_optimizer = guide_eta_optimizer(guide.base_model, options.lr)

    def after_epoch(self, ctx) -> None:
        """Evidence steps when due; keeps the state of the best evidence."""
        history = ctx.history
        if not ml.marglik_due(ctx.epoch, self.options):
            history.setdefault("log_evidence", []).append(float("nan"))
            return
        guide = self.guide
        deterministic_curvature(guide, ctx, lila=self.eta_optimizer is not None)
        value = guide.evidence_steps(self.options.steps, self.options.lr,
                                     params=self.hyper, optimizer=self.hyper_optimizer)
        history.setdefault("log_evidence", []).append(value)
        history.setdefault("log_evidence_noise", []).append(self.evidence_noise(ctx, value))
        history.setdefault("prior_precision", []).append(float(guide.prior_precision.mean()))
        with torch.no_grad():   # the evidence's terms at the stepped δ (see Laplace.evidence_terms)
            for name, term in guide.evidence_terms().items():
                history.setdefault(f"evidence_{name}", []).append(float(term))
        if self.eta_optimizer is not None:
            # reuses the curvature of deterministic_curvature (same seed: its draws replayed)
            guide_online_eta_step(guide, ctx, self.eta_optimizer, seed=EVIDENCE_SEED)
            history.setdefault("extent", []).append(guide.base_model.augmentation.extent.tolist())
        if self.best is None or value > self.best[0]:
            # The state of this evidence step: the guide's (θ*, δ) and the model's own
            # parameters and buffers — point-estimated weights (e.g. the body under
            # subset="last_layer"), a learned Gaussian noise, a learnable augmentation's η.
            # Hyperparameters are kept after this step's updates, as laplace-torch's
            # marglik_training keeps them.
            self.best = (value, _copy(guide.state_dict()), _copy(guide.base_model.state_dict()))

    def evidence_noise(self, ctx, value: float) -> float:
        """Standard deviation of one pass's evidence: 0 for an exact (non-random) pass; with
        a random augmentation ``|L₁ − L₂|/√2`` from a second pass with another seed (the
        first pass's curvature is kept)."""
        guide = self.guide
        if num_augmentations(guide.base_model) <= 1:
            return 0.0
        first = guide.posterior
        deterministic_curvature(guide, ctx, lila=self.eta_optimizer is not None, seed=EVIDENCE_SEED + 1)
        with torch.no_grad():
            other = float(guide.log_evidence())
        guide.posterior = first
        return abs(other - value) / math.sqrt(2.0)

    def finish(self, ctx) -> None:
        """Restore the best-evidence state (if any) and unfreeze a learned noise."""
        guide = self.guide
        if self.best is not None:
            _, guide_state, model_state = self.best
            guide.load_state_dict(guide_state)
            guide.base_model.load_state_dict(model_state)
            ctx.history["best_log_evidence"] = [self.best[0]]
        if self.noise_frozen:
            guide.base_model.likelihood.log_noise.requires_grad_(True)

    def state_dict(self) -> dict:
        """For ``fit(..., resume=True)``: the hyperparameter leaves and their optimiser, the
        η optimiser (LILA) and the best-evidence state."""
        state = {"hyper": [None if p is None else p.detach().clone() for p in self.hyper],
                 "hyper_optimizer": self.hyper_optimizer.state_dict(), "best": None}
        if self.eta_optimizer is not None:
            state["eta_optimizer"] = self.eta_optimizer.state_dict()
        if self.best is not None:
            value, guide_state, model_state = self.best
            state["best"] = {"log_evidence": value, "guide": guide_state, "model": model_state}
        return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for leaf, value in zip(self.hyper, state["hyper"]):
                if leaf is not None:
                    leaf.copy_(value)
        self.hyper_optimizer.load_state_dict(state["hyper_optimizer"])
        if self.eta_optimizer is not None:
            self.eta_optimizer.load_state_dict(state["eta_optimizer"])
        best = state["best"]
        self.best = None if best is None else (best["log_evidence"], best["guide"], best["model"])


def deterministic_curvature(guide, ctx, *, lila: bool = False, seed: int = EVIDENCE_SEED) -> None:
    """Full-data curvature pass of ``guide`` under a fixed RNG seed (the caller's RNG state is
    kept); with ``lila`` each batch's augmentation draws are seeded so that the η step can
    replay them."""
    device = next(iter(guide.theta.values())).device if guide.prototype_trace is not None else None
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if lila:
            guide.fit_curvature(**guide_curvature_source(ctx, guide.curvature_batch_size, seed))
        else:
            guide.fit_curvature(**_curvature_source(ctx))


def _copy(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def curvature_batch_size(batch_size, default: int) -> int:
    """``Laplace.fit_curvature``'s ``batch_size`` (``None``: ``default``), checked.

    ``fit_curvature(x, y)`` (two tensors, as ``pb.fit``'s data is often written out) put ``y``
    here, and the guide stopped at ``bool(y)``: "Boolean value of Tensor with more than one
    value is ambiguous".

    Raises
    ------
    TypeError
        A tensor (the targets given as a second argument) or another non-integer.
    ValueError
        An integer below 1.
    """
    if batch_size is None:
        return default
    if isinstance(batch_size, torch.Tensor):
        raise TypeError(f"Laplace.fit_curvature takes the data as its first argument: (x, y) tensors as one tuple, "
                        f"fit_curvature((x, y)), a Dataset or a DataLoader; its second is batch_size, an int, "
                        f"got a Tensor of shape {tuple(batch_size.shape)}")
    return check_int("batch_size", batch_size, 1)


def _batches(data, batch_size, model=None, default: int | None = None):
    """Unshuffled batches of ``data``; loaders (also ``fit``'s own) are used as they are.  A
    ``Dataset``'s batches are checked as read, and looked at for unscaled pixels once per
    ``model`` (:class:`~pyro_bnn.data.batches.BatchCheck`'s ``inputs_of``: ``fit_curvature``
    reads them twice).  With ``default``, ``batch_size`` is checked by
    :func:`curvature_batch_size` (``None``: ``default``)."""
    if default is not None:
        batch_size = curvature_batch_size(batch_size, default)
    if isinstance(data, TensorBatches):
        return TensorBatches(data.x, data.y, batch_size, shuffle=False)
    try:
        return make_loader(data, batch_size, shuffle=False, check=BatchCheck(inputs_of=model))
    except TypeError:
        if hasattr(data, "__iter__"):
            return data
        raise


def _curvature_source(ctx) -> dict:
    """``fit_curvature`` arguments in a fit hook.  Under ``fit(distributed=True)`` each rank
    reads its share of the data and the sums are all-reduced (:mod:`pyro_bnn.training.distributed`),
    so curvature and evidence equal the single-process ones."""
    if getattr(ctx, "distributed", None) is None:
        return {"data": ctx.loader}
    data, reduce_fn = ctx.distributed.curvature_data(ctx.loader)
    return {"data": data, "reduce_fn": reduce_fn}


def warn_if_examples_left_out(data, seen: int) -> None:
    """Warn when the curvature saw fewer examples than ``data``'s data set holds (a
    ``DataLoader`` with ``drop_last=True``, a sampler over a subset): the GGN and the evidence
    then describe a smaller data set than the one the MAP was trained on, and nothing else
    would say so.  Sources without a length are not judged."""
    try:
        total = dataset_size(data)
    except TypeError:
        return
    if seen < total:
        warnings.warn(f"the curvature saw {seen:,} of the data set's {total:,} examples (a DataLoader with "
                      "drop_last=True, or a sampler that draws fewer examples than it covers): the GGN and the log evidence "
                      f"leave {total - seen:,} out. Call fit_curvature with the (x, y) tensors or a loader "
                      "that yields every example once", UserWarning, stacklevel=3)
