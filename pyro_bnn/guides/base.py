"""The guide contract: :class:`BNNGuide`, and what every pyro_bnn guide shares.

A guide is any Pyro guide.  Pyro's own autoguides work with :func:`pyro_bnn.fit`,
:func:`pyro_bnn.predict` and the other tools as they are; pyro_bnn's guides additionally
derive from :class:`BNNGuide`, which is the whole contract in one place: the hooks
:func:`pyro_bnn.fit` calls, the training objective, alternative predictives, the density
of a draw, and how the guide's parameters meet Pyro's global parameter store.  The training
loop and the tools read these through :func:`guide_contract`, which gives Pyro's own guides
the default behaviour, so no tool probes a guide with ``hasattr``.

New guides derive from :class:`BNNGuide` (listed *before* the Pyro base class) and join the
registry with :func:`register_guide` so the parametrised contract tests and ``pb.compare``
pick them up.  ``docs/DEVELOPING.md`` walks through an example.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_median

from ..objectives import PyroObjective

__all__ = ["BNNGuide", "guide_contract", "init_to_network", "register_guide", "registered_guides",
           "GUIDE_REGISTRY"]

class BNNGuide:
    """The pyro_bnn guide contract, as a mixin placed before the Pyro guide class.

    ``class MyGuide(BNNGuide, AutoGuide): ...``.  Every method has a default, so a guide
    overrides only what it changes.  :func:`pyro_bnn.fit` calls, in order,
    ``make_objective`` once, ``on_fit_start``, then per epoch ``on_epoch_start``, the
    minibatch steps of the objective, ``on_epoch_end``, and finally ``on_fit_end``; each
    hook receives the :class:`pyro_bnn.training.FitContext`.

    Attributes
    ----------
    supports_marglik : bool
        Whether the guide learns hyperparameters online from ``fit(..., marglik=...)``
        (the Laplace guide).  ``fit`` rejects ``marglik=`` for other guides.
    default_lr : float or None
        Learning rate :func:`pyro_bnn.fit` uses when none is given (``None``: fit's own).
    """

    supports_marglik: bool = False
    default_lr: float | None = None

    # ------------------------------------------------------------ training
    def make_objective(self, num_particles: int = 1):
        """The training loss ``objective(model, guide, x, y, num_data=N)``.

        Returns a callable giving a scalar tensor, or ``(loss, extras)`` with ``extras`` a
        dict of scalar tensors that ``fit`` records per epoch.  Default: Pyro's
        ``Trace_ELBO`` with minibatch scaling (:class:`pyro_bnn.objectives.PyroObjective`).
        """
        return PyroObjective(Trace_ELBO(num_particles=num_particles))

    def on_fit_start(self, ctx) -> None:
        """Called once before the first epoch."""

    def on_epoch_start(self, ctx) -> None:
        """Called before each epoch (``ctx.epoch`` counts from 1)."""

    def on_epoch_end(self, ctx) -> None:
        """Called after each epoch's steps, before the epoch is recorded and checkpointed."""

    def on_fit_end(self, ctx) -> None:
        """Called once after the last epoch."""

    def scale_parameters(self) -> list[torch.Tensor]:
        """The unconstrained parameters of the posterior scales (``ρ`` with ``σ = exp ρ`` or
        ``softplus ρ``), which :func:`pyro_bnn.fit` watches to detect scales still limited by
        the learning rate.  Default: none."""
        return []

    # ---------------------------------------------------------- prediction
    def predict(self, model, x, method: str = "sample", num_samples: int = 64,
                batch_size: int = 1024, **kwargs):
        """Alternative predictives (``method != "sample"``), e.g. Laplace's ``"glm"``.

        The default supports only Monte Carlo over the guide's draws, which
        :func:`pyro_bnn.predict` computes itself.
        """
        raise ValueError(f"{type(self).__name__} supports only method='sample', got {method!r}")

    def log_density(self, values: dict) -> torch.Tensor | None:
        """``log q(θ)`` (0-d) at a joint draw ``{site: tensor}``, or ``None``.

        ``None`` (the default) means: read ``log q`` from the guide's own trace of the draw
        (the summed ``log_prob`` of its sample sites, auxiliary ones included), which is right
        for any guide that puts its density in its sample sites; see
        :mod:`pyro_bnn.guide_density`.
        """
        return None


class _PyroGuideContract(BNNGuide):
    """The contract's defaults for a guide that does not derive from :class:`BNNGuide`."""

    def __init__(self, guide):
        self.guide = guide

    def predict(self, model, x, method="sample", num_samples=64, batch_size=1024, **kwargs):
        raise ValueError(f"{type(self.guide).__name__} supports only method='sample', got {method!r}")

    def scale_parameters(self) -> list[torch.Tensor]:
        if isinstance(self.guide, AutoNormal) and self.guide.prototype_trace is not None:
            return [p for name, p in self.guide.scales.named_parameters()]
        return []


def guide_contract(guide) -> BNNGuide:
    """The guide itself if it is a :class:`BNNGuide`, else an adapter with the defaults.

    This is how :func:`pyro_bnn.fit` and the tools reach hooks, objectives and predictives
    of any guide, Pyro's own autoguides included.
    """
    return guide if isinstance(guide, BNNGuide) else _PyroGuideContract(guide)


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
