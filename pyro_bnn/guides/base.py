"""What every pyro_bnn guide shares: initialisation from the network, the hook contract.

A guide is any Pyro guide (``AutoGuide`` subclasses and plain callables work with
:func:`pyro_bnn.fit`).  A guide may additionally implement any of these optional methods,
which :func:`pyro_bnn.fit` and :func:`pyro_bnn.predict` look for:

``make_objective(num_particles) -> callable``
    The training loss ``objective(model, guide, x, y, num_data=N)`` returning a scalar
    tensor or ``(loss, extras)`` where ``extras`` is a dict of scalar tensors recorded in
    the fit history.  Default: Pyro's ``Trace_ELBO``.
``on_fit_start(ctx)``, ``on_epoch_start(ctx)``, ``on_epoch_end(ctx)``, ``on_fit_end(ctx)``
    Called with a :class:`pyro_bnn.training.FitContext` (model, loader, device, epoch,
    history, options such as ``marglik``).
``predict(model, x, method=..., num_samples=..., batch_size=...)``
    Alternative predictives (``method != "sample"``), e.g. Laplace's linearised one.
``log_density(values) -> Tensor``
    ``log q(θ)`` (0-d) at a joint draw ``values = {site: tensor}``.  Used by
    :func:`pyro_bnn.to_arviz` (``sample_stats.log_q``, needed by
    ``az.loo_approximate_posterior``) and ELBO estimates in :func:`pyro_bnn.compare`.
    Without it, ``log q`` is read from the guide's own trace of the draw (the summed
    ``log_prob`` of its sample sites, auxiliary ones included), which is right for
    ``AutoNormal``/``MeanField``, ``AutoDelta`` (0), ``AutoContinuous`` guides and any guide
    that puts its density in its sample sites; see :mod:`pyro_bnn.guide_density`.
``log_evidence() -> Tensor``, ``num_variational_parameters``
    Optional extra columns of :func:`pyro_bnn.compare` (e.g. Laplace's evidence).

New guides join the registry with :func:`register_guide` so the parametrised contract tests
and ``pb.compare`` pick them up.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from pyro.infer.autoguide.initialization import init_to_median

__all__ = ["init_to_network", "register_guide", "registered_guides", "GUIDE_REGISTRY"]

#: name -> factory(model, **options) -> guide
GUIDE_REGISTRY: dict[str, Callable] = {}


def register_guide(name: str, factory: Callable | None = None):
    """Register a guide factory under ``name`` (usable as a decorator)."""

    def deco(f):
        GUIDE_REGISTRY[name] = f
        return f

    return deco(factory) if factory is not None else deco


def registered_guides() -> dict[str, Callable]:
    """A copy of the registry of guide factories."""
    return dict(GUIDE_REGISTRY)


class init_to_network:
    """Initialisation strategy: start each site at the network's own weights.

    For a :class:`pyro_bnn.BNN` these are the weights of the network it was built from (so
    a pretrained network's weights become the posterior means' starting point).  For a
    hand-written ``PyroModule`` whose weights are ``PyroSample`` attributes the original
    weights are gone, so weights of shape ``(out, in, ...)`` get PyTorch's default
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` and vectors (biases) the same bound from the
    matching weight when found; other sites fall back to ``fallback`` (the prior median).

    Parameters
    ----------
    model : torch.nn.Module
        The model the guide approximates.
    fallback : callable
        Pyro init strategy for sites it cannot place.
    """

    def __init__(self, model, fallback=init_to_median):
        values = getattr(model, "initial_values", None)
        self.values = values() if callable(values) else {}
        self.model = model
        self.fallback = fallback

    def __call__(self, site):
        name = site["name"]
        fn = site["fn"]
        device = getattr(fn, "mean", torch.zeros(())).device
        if name in self.values:
            return self.values[name].to(device)
        shape = fn.event_shape if len(fn.event_shape) else fn.batch_shape
        if len(shape) >= 2:
            bound = 1.0 / math.sqrt(max(1, math.prod(shape[1:])))
            return torch.empty(shape, device=device).uniform_(-bound, bound)
        if len(shape) == 1 and name.endswith("bias"):
            w_shape = _sibling_weight_shape(self.model, name)
            if w_shape is not None and len(w_shape) >= 2:
                bound = 1.0 / math.sqrt(max(1, math.prod(w_shape[1:])))
                return torch.empty(shape, device=device).uniform_(-bound, bound)
        return self.fallback(site)


def _sibling_weight_shape(model, bias_site: str):
    path = bias_site.rsplit(".", 1)[0]
    try:
        module = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    samples = module.__dict__.get("_pyro_samples", {})
    if "weight" in samples:
        prior = samples["weight"]
        if not hasattr(prior, "sample"):
            prior = prior(module)
        return prior.event_shape if len(prior.event_shape) else prior.batch_shape
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return None if weight is None else weight.shape
