"""Online marginal-likelihood training for the Laplace guide (Immer et al. 2021).

The :func:`pyro_bnn.fit` hooks of :class:`~pyro_bnn.guides.Laplace`: MAP phase as a Delta
guide, every ``marglik["every"]`` epochs after ``burnin`` a curvature refit and evidence steps
on the prior precision (and a learned Gaussian noise, and a learnable augmentation's ``η``,
LILA), keeping the state of the best evidence and restoring it at the end of ``fit``.
"""

from __future__ import annotations

import torch

from .. import marglik as ml
from ..data import TensorBatches, make_loader
from ..likelihoods import Gaussian

__all__ = ["OnlineMarglik"]


class OnlineMarglik:
    """Mixin with the ``fit`` hooks; the host provides ``fit_curvature``, ``_hyper_params``,
    ``_hyper_steps``, ``prior_precision``, ``base_model`` and ``curvature_batch_size``."""

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
            from ..invariance.learning import guide_eta_optimizer
            self._eta_opt = guide_eta_optimizer(self.base_model, self._marglik["lr"])

    def on_epoch_end(self, ctx):
        if not ml.marglik_due(ctx.epoch, self._marglik):
            if self._marglik:
                ctx.history.setdefault("log_evidence", []).append(float("nan"))
            return
        self.fit_curvature(**_curvature_source(ctx))
        value = self._hyper_steps(int(self._marglik["steps"]), float(self._marglik["lr"]),
                                  params=self._hyper, optimizer=self._hyper_opt)
        ctx.history.setdefault("log_evidence", []).append(value)
        ctx.history.setdefault("prior_precision", []).append(float(self.prior_precision.mean()))
        if getattr(self, "_eta_opt", None) is not None:
            from ..invariance.learning import guide_eta_step
            dstate = getattr(ctx, "distributed", None)
            if dstate is None:
                batches = _batches(ctx.loader, self.curvature_batch_size)
            else:       # whole-data batches, split across ranks and all-reduced in the step
                from ..distributed import unsharded_batches
                batches = unsharded_batches(ctx.loader, self.curvature_batch_size)
            guide_eta_step(self, self.base_model, batches, self._eta_opt, seed=ctx.epoch,
                           distributed=dstate)
            ctx.history.setdefault("extent", []).append(self.base_model.augmentation.extent.tolist())
        if self._best is None or value > self._best[0]:
            # The state of this evidence step: the guide's (θ*, δ) and the model's own
            # parameters and buffers — point-estimated weights (e.g. the body under
            # subset="last_layer"), a learned Gaussian noise, a learnable augmentation's η.
            # Hyperparameters are kept after this step's updates, as laplace-torch's
            # marglik_training keeps them.
            self._best = (value, _copy(self.state_dict()), _copy(self.base_model.state_dict()))

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
        self.fit_curvature(**_curvature_source(ctx))


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
