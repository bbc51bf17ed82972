"""Refuse per-example latents that :func:`pyro_bnn.fit`'s batches would mismatch.

A hand-written model may sample a latent inside its data plate, ``with pyro.plate("data",
len(x)): z = pyro.sample("z", ...)``: one value per example, a *local* latent.  Its guide
keeps one parameter per position in the batch, not per example, so the values are tied to
the right examples only when every step sees the same examples in the same order.
``pb.fit`` shuffles and slices the training set into minibatches: each step would then
pair an example with another example's value, in silence (Pyro's ``obs_mask`` makes
``<site>_unobserved`` such a latent, and a mask held by the model no longer matched the
shuffled targets: the slope of ``y = 2 x`` fitted to 0.98).  :func:`refuse_local_latents` finds
latents in a plate of the batch's size whose shape follows the number of examples and stops
the fit before its first step, naming them.
"""

from __future__ import annotations

import pyro
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch.utils.data import SequentialSampler

from ..contract.local_params import local_params
from ..contract.pyro_objective import call_model
from ..model.bnn import is_bnn
from ..model.modes import buffers_kept

__all__ = ["batches_fixed", "local_latent_sites", "refuse_local_latents"]


def _latent_sites(model, guide, x, y) -> dict[str, dict]:
    args, kwargs, _ = call_model(model, x, y, len(x))
    devices = [x.device] if x.device.type == "cuda" else []
    with local_params(model, guide), torch.no_grad(), torch.random.fork_rng(devices=devices), buffers_kept(model), \
            pyro.validation_enabled(False), poutine.block(hide_types=["sample"]):
        trace = poutine.trace(model).get_trace(*args, **kwargs)
    return {name: site for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)}


def local_latent_sites(model, guide, x: torch.Tensor, y: torch.Tensor | None) -> list[str]:
    """The latent sites of ``model`` sampled inside a plate of ``len(x)`` (two or more) whose
    shape follows the number of examples: checked against a run on the first row alone,
    unless the model cannot run on one row (then a plate of the batch's size is taken for
    the data plate).  Empty for a :class:`~pyro_bnn.BNN`, which has no local latents.  Runs
    the model from its prior (its ``pyro.param`` values as ``guide``'s fit sees them: under
    :func:`~pyro_bnn.contract.local_params.local_params`), without gradients, on forked random
    streams, with its buffers put back; a model that fails here is left to the fit to report."""
    if is_bnn(model) or len(x) < 2:
        return []
    try:
        sites = _latent_sites(model, guide, x, y)
    except Exception:  # noqa: BLE001
        return []
    candidates = [name for name, site in sites.items()
                  if any(f.vectorized and f.size == len(x) for f in site["cond_indep_stack"])]
    if not candidates:
        return []
    try:
        one = _latent_sites(model, guide, x[:1], None if y is None else y[:1])
    except Exception:  # noqa: BLE001 -- e.g. a mask held by the model for the whole batch
        return candidates
    return [name for name in candidates if name not in one or one[name]["value"].shape != sites[name]["value"].shape]


def batches_fixed(loader) -> bool:
    """Whether every step of a fit sees the same examples in the same order: one batch, not
    shuffled (``TensorBatches``, or a loader with a sequential sampler)."""
    try:
        if len(loader) != 1:
            return False
    except TypeError:  # an iterable without a length
        return False
    if hasattr(loader, "shuffle"):
        return not loader.shuffle
    return isinstance(getattr(loader, "sampler", None), SequentialSampler)


def refuse_local_latents(model, guide, x: torch.Tensor, y: torch.Tensor | None, loader) -> None:
    """Raise ``ValueError`` if ``model`` has local latents (:func:`local_latent_sites` on the
    first batch ``x, y``) and ``loader``'s batches change from step to step
    (:func:`batches_fixed`)."""
    if batches_fixed(loader):
        return
    names = local_latent_sites(model, guide, x, y)
    if not names:
        return
    masked = [n for n in names if n.endswith("_unobserved")]
    hint = (f" ({', '.join(map(repr, masked))} comes from Pyro's obs_mask: pass only the observed "
            "examples instead)") if masked else ""
    raise ValueError(
        f"latent site(s) {names} have one value per example: they are sampled inside the data plate "
        f"(local latents){hint}. pb.fit shuffles the examples and splits them into minibatches, so the "
        "guide's per-position values would be paired with other examples at every step. Sample global "
        "latents outside the data plate; or fit one fixed batch, pb.fit(..., batch_size=len(x), "
        "shuffle=False); or train with pyro.infer.SVI on batches whose order you control")
