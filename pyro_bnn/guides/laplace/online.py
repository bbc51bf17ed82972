"""Online marginal-likelihood training for the Laplace guide (Immer et al. 2021).

The :func:`pyro_bnn.fit` hooks of :class:`~pyro_bnn.guides.Laplace`: MAP phase as a Delta
guide, every ``marglik["every"]`` epochs after ``burnin`` a curvature refit and evidence steps
on the prior precision (and a learned Gaussian noise, and a learnable augmentation's ``η``,
LILA), keeping the state of the best evidence and restoring it at the end of ``fit``.

The evidence that selects the best state comes from a deterministic full-data curvature
pass: unshuffled batches over all the data under a fixed RNG seed, so a random
augmentation (LILA) draws the same transformations at every evaluation and states are
compared on common random numbers.  For such a model a second pass with another seed
measures the estimate's own noise, recorded per evaluation in
``history["log_evidence_noise"]`` (0 where the pass is exact: no random augmentation).
Differences between evaluations beyond that noise are real differences of the evidence
between the SGD iterates θ_t (``docs/results/laplace.md``).
"""

from __future__ import annotations

import math

import torch

from ... import marglik as ml
from ...data import TensorBatches, make_loader
from ...likelihoods import Gaussian
from .prior import POSTHOC_LR, POSTHOC_STEPS, PriorPrecision

__all__ = ["OnlineMarglik", "EVIDENCE_SEED"]

#: RNG seed of the deterministic curvature pass whose evidence selects the best state.
EVIDENCE_SEED = 20_240_601


class OnlineMarglik(PriorPrecision):
    """Mixin with the ``fit`` hooks; the host provides ``fit_curvature``, ``log_evidence``,
    ``prior_precision``, ``base_model``, ``tune_prior_precision`` and ``curvature_batch_size``."""

    def on_fit_start(self, ctx):
        self._map_mode = True
        self._marglik = ml.check_marglik_options(ctx.options.get("marglik"))
        self._best = None
        lik = getattr(self.base_model, "likelihood", None)
        self._noise_frozen = bool(self._marglik) and isinstance(lik, Gaussian) and lik.learned
        if self._noise_frozen:      # learned by the evidence, not by the MAP objective
            lik.log_noise.requires_grad_(False)
        if self._marglik:
            self._hyper = self._hyper_params(None if not self._noise_frozen else True)
            leaves = [p for p in self._hyper if p is not None]
            self._hyper_opt = torch.optim.Adam(leaves, lr=float(self._marglik["lr"]))
            # A learnable augmentation (LILA): η follows the evidence too (pyro_bnn.invariance).
            from ...invariance.learning import guide_eta_optimizer
            self._eta_opt = guide_eta_optimizer(self.base_model, self._marglik["lr"])

    def on_epoch_end(self, ctx):
        if not ml.marglik_due(ctx.epoch, self._marglik):
            if self._marglik:
                ctx.history.setdefault("log_evidence", []).append(float("nan"))
            return
        self._deterministic_curvature(ctx)
        value = self._hyper_steps(int(self._marglik["steps"]), float(self._marglik["lr"]),
                                  params=self._hyper, optimizer=self._hyper_opt)
        ctx.history.setdefault("log_evidence", []).append(value)
        ctx.history.setdefault("log_evidence_noise", []).append(self._evidence_noise(ctx, value))
        ctx.history.setdefault("prior_precision", []).append(float(self.prior_precision.mean()))
        if getattr(self, "_eta_opt", None) is not None:
            # reuses the curvature of _deterministic_curvature (same seed: its draws replayed)
            from ...invariance.guide_step import guide_online_eta_step
            guide_online_eta_step(self, ctx, self._eta_opt, seed=EVIDENCE_SEED)
            ctx.history.setdefault("extent", []).append(self.base_model.augmentation.extent.tolist())
        if self._best is None or value > self._best[0]:
            # The state of this evidence step: the guide's (θ*, δ) and the model's own
            # parameters and buffers — point-estimated weights (e.g. the body under
            # subset="last_layer"), a learned Gaussian noise, a learnable augmentation's η.
            # Hyperparameters are kept after this step's updates, as laplace-torch's
            # marglik_training keeps them.
            self._best = (value, _copy(self.state_dict()), _copy(self.base_model.state_dict()))

    def fit_state(self) -> dict:
        """The online-evidence state for ``fit(..., resume=True)``: the hyperparameter leaves
        and their optimiser, the η optimiser (LILA) and the best-evidence state."""
        if not getattr(self, "_marglik", None) or getattr(self, "_hyper_opt", None) is None:
            return {}
        state = {"hyper": [None if p is None else p.detach().clone() for p in self._hyper],
                 "hyper_optimizer": self._hyper_opt.state_dict(), "best": None}
        if getattr(self, "_eta_opt", None) is not None:
            state["eta_optimizer"] = self._eta_opt.state_dict()
        if self._best is not None:
            value, guide_state, model_state = self._best
            state["best"] = {"log_evidence": value, "guide": guide_state, "model": model_state}
        return state

    def load_fit_state(self, state: dict) -> None:
        if not state:
            if getattr(self, "_marglik", None):
                raise ValueError("the checkpoint holds no online-evidence state, but this fit has marglik=")
            return
        if not getattr(self, "_marglik", None):
            raise ValueError("the checkpoint holds online-evidence state, but this fit has no marglik=")
        with torch.no_grad():
            for leaf, value in zip(self._hyper, state["hyper"]):
                if leaf is not None:
                    leaf.copy_(value)
        self._hyper_opt.load_state_dict(state["hyper_optimizer"])
        if getattr(self, "_eta_opt", None) is not None:
            self._eta_opt.load_state_dict(state["eta_optimizer"])
        best = state["best"]
        self._best = None if best is None else (best["log_evidence"], best["guide"], best["model"])

    def on_fit_end(self, ctx):
        self._map_mode = False
        lik = getattr(self.base_model, "likelihood", None)
        if self._best is not None:
            _, guide_state, model_state = self._best
            self.load_state_dict(guide_state)
            self.base_model.load_state_dict(model_state)
            ctx.history["best_log_evidence"] = [self._best[0]]
        if getattr(self, "_noise_frozen", False):
            lik.log_noise.requires_grad_(True)
        self._best = self._hyper = self._hyper_opt = self._eta_opt = None
        self._deterministic_curvature(ctx)
        if self.tune_prior_precision == "marglik":
            ctx.history["posthoc_log_evidence"] = [self._hyper_steps(POSTHOC_STEPS, POSTHOC_LR)]

    def _deterministic_curvature(self, ctx, seed: int = EVIDENCE_SEED):
        """Full-data curvature pass under a fixed RNG seed (the caller's RNG state is kept)."""
        device = next(iter(self.theta.values())).device if self.prototype_trace is not None else None
        devices = [device] if device is not None and device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            if getattr(self, "_eta_opt", None) is not None:     # LILA: per-batch seeded draws
                from ...invariance.guide_step import guide_curvature_source
                self.fit_curvature(**guide_curvature_source(ctx, self.curvature_batch_size, seed))
            else:
                self.fit_curvature(**_curvature_source(ctx))

    def _evidence_noise(self, ctx, value: float) -> float:
        """Standard deviation of one pass's evidence: 0 for an exact (non-random) pass; with
        a random augmentation ``|L₁ − L₂|/√2`` from a second pass with another seed (the
        first pass's curvature is kept)."""
        if self._num_augmentations() <= 1:
            return 0.0
        first = self.posterior
        self._deterministic_curvature(ctx, EVIDENCE_SEED + 1)
        with torch.no_grad():
            other = float(self.log_evidence())
        self.posterior = first
        return abs(other - value) / math.sqrt(2.0)


def _copy(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _batches(data, batch_size):
    """Unshuffled batches of ``data``; loaders (also ``fit``'s own) are used as they are."""
    if isinstance(data, TensorBatches):
        return TensorBatches(data.x, data.y, batch_size, shuffle=False)
    try:
        return make_loader(data, batch_size, shuffle=False)
    except TypeError:
        if hasattr(data, "__iter__"):
            return data
        raise


def _curvature_source(ctx) -> dict:
    """``fit_curvature`` arguments in a fit hook.  Under ``fit(distributed=True)`` each rank
    reads its share of the data and the sums are all-reduced (:mod:`pyro_bnn.distributed`),
    so curvature and evidence equal the single-process ones."""
    if getattr(ctx, "distributed", None) is None:
        return {"data": ctx.loader}
    data, reduce_fn = ctx.distributed.curvature_data(ctx.loader)
    return {"data": data, "reduce_fn": reduce_fn}
