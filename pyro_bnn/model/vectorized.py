"""Batched weight draws in :class:`~pyro_bnn.model.bnn.BNN`'s Pyro model.

Pyro vectorises over draws by running the model inside an outer plate:
``Predictive(model, guide=guide, num_samples=S, parallel=True)`` and
``Trace_ELBO(num_particles=K, vectorize_particles=True)`` hand the model weight values with
leading batch dimensions, ``(S, *shape)`` or ``(K, 1, *shape)``.  A torch network cannot take
such weights (``F.linear`` expects a matrix), so the model evaluates the network once per draw
and stacks the outputs to ``(S, M, ...)``: the layout a hand-written Pyro model gets from
broadcasting, with the draws on the plate dimension left of the data plate.
"""

from __future__ import annotations

import inspect
import math

import torch
from pyro.poutine.runtime import get_plates

__all__ = ["under_outer_plate", "batched_function", "observation_distribution"]


def under_outer_plate() -> bool:
    """Whether the model runs inside a plate of its caller's (checked before the data plate)."""
    return bool(get_plates())


def _draw_prefix(value: torch.Tensor, shape: torch.Size) -> torch.Size:
    """The leading batch dimensions of a site value of event shape ``shape``, without the
    trailing ones that stand for the data plate's dimension (``(K, 1)`` -> ``(K,)``)."""
    if value.shape[value.dim() - len(shape):] != shape:
        raise ValueError(f"a weight draw of shape {tuple(value.shape)} does not end with the "
                         f"site's shape {tuple(shape)}")
    prefix = list(value.shape[:value.dim() - len(shape)])
    while prefix and prefix[-1] == 1:
        prefix.pop()
    return torch.Size(prefix)


def _read_site(model, site: str) -> torch.Tensor:
    """The value of a ``PyroSample`` site, read as the network would read it (drawn or
    replayed once, then cached in the module context for the rest of the call)."""
    path, _, attr = site.rpartition(".")
    return getattr(model.get_submodule(path), attr)


def batched_function(model, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The network output for every weight draw of the sites' current values.

    Reads each random site of ``model`` (which draws it from the guide being replayed, or the
    prior, under the caller's plates) and, if the draws carry batch dimensions ``P``, runs the
    network once per draw.

    Parameters
    ----------
    model : BNN
        Called from inside its ``forward`` (the Pyro module context is active).
    x : Tensor, shape (M, ...)
        Inputs, shared by every draw.

    Returns
    -------
    f : Tensor, shape (*P, M, ...)
        Outputs; ``P`` is empty when no draw is batched.
    num_batch_dims : int
        ``len(P)``.
    """
    shapes = {site: model.site_prior(site).event_shape for site in model.site_names}
    values = {site: _read_site(model, site) for site in shapes}
    prefixes = {site: _draw_prefix(values[site], shapes[site]) for site in shapes}
    batch = torch.broadcast_shapes(*prefixes.values())
    if not batch:
        return model.function(x), 0
    num = math.prod(batch)
    flat = {site: values[site].reshape(prefixes[site] + shapes[site])
            .expand(batch + shapes[site]).reshape(num, *shapes[site]) for site in shapes}
    outputs = [model.run_with({site: draws[i] for site, draws in flat.items()}, x)
               for i in range(num)]
    f = torch.stack(outputs)
    return f.reshape(batch + f.shape[1:]), len(batch)


def observation_distribution(likelihood, f: torch.Tensor, batch_dims: int):
    """``likelihood.distribution(f)`` for outputs ``f`` of shape ``(*P, M, ...)`` with
    ``len(P) = batch_dims``; a likelihood of the user's whose ``distribution`` takes ``f`` only
    serves unbatched draws and is named when the draws are batched."""
    if not batch_dims:
        return likelihood.distribution(f)
    if "batch_dims" not in inspect.signature(likelihood.distribution).parameters:
        raise TypeError(f"{type(likelihood).__name__}.distribution(f) takes no batch_dims argument, which "
                        "batched weight draws (Predictive(parallel=True), vectorize_particles=True) "
                        f"need: the outputs have shape {tuple(f.shape)}, of which the first "
                        f"{batch_dims + 1} are batch dimensions; define distribution(self, f, batch_dims=1) "
                        "or use Predictive(parallel=False)")
    return likelihood.distribution(f, batch_dims=batch_dims + 1)
