"""The weight masks a model carries (pruning), readable by every guide.

:func:`pyro_bnn.analysis.pruning.prune_` masks weights on the *model* (a forward pre-hook
multiplies each drawn weight by a 0/1 mask) and attaches its handle to the model here.  A
guide or predictive that does not draw the weights themselves — MeanField's per-example noise,
which samples pre-activations, and Laplace's GLM predictive, which pushes the posterior
covariance through the network's Jacobians — must apply the same masks to the quantities it
uses instead, or the masked weights' uncertainty stays in its outputs.  The pruning tools (an
upper layer) attach the handle; the guides (below them) read its masks through
:func:`weight_masks`.
"""

from __future__ import annotations

import torch

__all__ = ["weight_masks", "attach_masking", "masking_of", "detach_masking"]

_ATTR = "_pyro_bnn_pruning"


def attach_masking(model, handle) -> None:
    """Attach ``handle`` (anything with a ``masks`` dict ``{site: 0/1 tensor}``) to ``model``,
    replacing an earlier one."""
    model.__dict__[_ATTR] = handle


def masking_of(model):
    """The handle attached to ``model``, or ``None``."""
    return getattr(model, "__dict__", {}).get(_ATTR)


def detach_masking(model, handle) -> None:
    """Detach ``handle`` from ``model`` if it is the one attached (idempotent)."""
    if masking_of(model) is handle:
        model.__dict__.pop(_ATTR, None)


def weight_masks(model) -> dict[str, torch.Tensor]:
    """The masks on ``model``'s sites, ``{site: 0/1 tensor shaped like the site}`` (1 = kept);
    empty if the model is not pruned."""
    handle = masking_of(model)
    return {} if handle is None else dict(handle.masks)
