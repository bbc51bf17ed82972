"""The weight masks a model carries (pruning), readable by every guide.

:func:`pyro_bnn.analysis.pruning.prune_` masks weights on the *model* (a forward pre-hook
multiplies each drawn weight by a 0/1 mask).  A guide or predictive that does not draw the
weights themselves — MeanField's local reparameterisation, which samples pre-activations from
``σ²``, and Laplace's GLM predictive, which pushes the posterior covariance through the
network's Jacobians — must apply the same masks to the quantities it uses instead, or the
masked weights' uncertainty stays in its outputs.  This module is where the masks are kept:
the pruning tools (an upper layer) set them, the guides (below it) read them.
"""

from __future__ import annotations

import torch

__all__ = ["weight_masks", "set_weight_masks", "clear_weight_masks"]

_ATTR = "_pyro_bnn_weight_masks"


def weight_masks(model) -> dict[str, torch.Tensor]:
    """The masks on ``model``'s sites, ``{site: 0/1 tensor shaped like the site}`` (1 = kept);
    empty if the model is not pruned."""
    return dict(getattr(model, "__dict__", {}).get(_ATTR, {}))


def set_weight_masks(model, masks: dict[str, torch.Tensor]) -> None:
    """Record ``masks`` as ``model``'s weight masks (replacing any earlier ones)."""
    model.__dict__[_ATTR] = dict(masks)


def clear_weight_masks(model) -> None:
    """Forget ``model``'s weight masks (idempotent)."""
    model.__dict__.pop(_ATTR, None)
