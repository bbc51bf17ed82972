"""Run Pyro with parameters kept in modules (``module_local_params``), whatever the user set.

Pyro's global parameter store keys parameters by name, so two guides with the same
structure (``AutoNormal.locs.net.0.weight``) silently share values.  pyro_bnn runs its own
loops in Pyro's module-local mode instead.  A ``PyroModule`` created while that mode was off
lacks the per-context state the mode needs; :func:`local_params` adds it.

*Global* ``pyro.param`` statements of a model (``sigma = pyro.param("sigma", ...)`` in a
``PyroModule``'s ``forward``, or in a plain function model) are values the user put in Pyro's
global store.  Pyro cannot run them in module-local mode ("global pyro.param statements in
PyroModules with local param mode enabled is not yet implemented"), so inside
:func:`local_params` they are served by :class:`GlobalParamBridge` from a copy of the global
store taken when the block starts: an existing entry is the store's own tensor (training it
trains the store's value), a new one is created as Pyro would and registered in the global
store when the block ends.  :func:`global_param_tensors` lists them, so :func:`pyro_bnn.fit`
trains them with the other parameters (maximising the ELBO, as ``SVI`` does).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager

import pyro
import torch
from pyro import poutine
from pyro.params.param_store import ParamStoreDict
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK

from ..model.modes import buffers_kept

__all__ = ["local_params", "prepare_local_params", "GlobalParamBridge", "global_param_tensors",
           "unwrap_model"]

#: ``infer`` key marking a param site served by :class:`GlobalParamBridge`
GLOBAL_PARAM_KEY = "pyro_bnn_global_param"


def prepare_local_params(*modules) -> None:
    """Give ``PyroModule``s created while ``module_local_params`` was off the per-context
    state that the mode needs (Pyro creates it only for modules built in the mode).

    A model wrapped in Pyro handlers (``pyro.condition(model, ...)``, ``poutine.scale``)
    is prepared through the module it wraps (:func:`unwrap_model`).
    """
    for module in modules:
        module = unwrap_model(module)
        if isinstance(module, torch.nn.Module):
            for m in module.modules():
                ctx = getattr(m, "_pyro_context", None)
                if ctx is not None and not hasattr(ctx, "param_state"):
                    ctx.param_state = {"params": {}, "constraints": {}}


def unwrap_model(model):
    """The callable under Pyro handlers: ``poutine.scale(model, 0.1)``,
    ``pyro.condition(model, data)`` and ``poutine.block(model, ...)`` return a
    ``functools.partial`` whose last argument is the wrapped callable (possibly wrapped
    again); anything else is returned as it is."""
    while isinstance(model, functools.partial) and model.args and callable(model.args[-1]):
        model = model.args[-1]
    return model


class _BridgeState:
    """The copy of Pyro's global store that one outermost :func:`local_params` block serves
    global ``param`` statements from, and the names it created (registered at the end)."""

    def __init__(self):
        self.store = ParamStoreDict()
        self.store.set_state(pyro.get_param_store().get_state())
        self.created: list[str] = []

    def get_param(self, name, *args, **kwargs) -> torch.Tensor:
        if name not in self.store:
            self.created.append(name)
        return self.store.get_param(name, *args, **kwargs)

    def publish(self) -> None:
        """Register the created parameters in Pyro's global store (existing entries are
        the store's own tensors already)."""
        if not self.created:
            return
        names = [n for n in self.created if n in self.store]
        pyro.get_param_store().set_state({"params": {n: self.store._params[n] for n in names},
                                          "constraints": {n: self.store._constraints[n] for n in names}})


class GlobalParamBridge(Messenger):
    """Serve global ``pyro.param`` statements (those Pyro would send to its global store)
    from a :class:`_BridgeState` instead of whichever store Pyro's module-local mode has
    swapped in; module parameters (which Pyro reports with their own values) pass."""

    def __init__(self, state: _BridgeState):
        super().__init__()
        self.state = state

    def _pyro_param(self, msg) -> None:
        if msg["value"] is not None or getattr(msg["fn"], "__self__", None) is not pyro.get_param_store():
            return
        msg["value"] = self.state.get_param(*msg["args"], **msg["kwargs"])
        msg["infer"][GLOBAL_PARAM_KEY] = True


def _current_bridge() -> GlobalParamBridge | None:
    for frame in reversed(_PYRO_STACK):
        if isinstance(frame, GlobalParamBridge):
            return frame
    return None


@contextmanager
def _unconstrained_references_kept(store):
    """Put back the ``unconstrained`` weak references of the global store's parameters.

    ``ParamStoreDict.get_state`` removes them from every parameter (to make them
    picklable), and both the bridge's copy of the store and Pyro's own module-local
    ``_Context`` call it.  For an unconstrained parameter that reference sits on the very
    tensor an earlier ``param`` statement of the same step returned, and ``SVI`` reads
    ``value.unconstrained()`` of every statement it recorded: a step in which an
    ``AutoDelta`` ran before a pyro_bnn guide in an ``AutoGuideList`` failed with
    "'Parameter' object has no attribute 'unconstrained'".
    """
    kept = [(p, p.__dict__["unconstrained"]) for _, p in store.named_parameters()
            if "unconstrained" in p.__dict__]
    try:
        yield
    finally:
        for param, reference in kept:
            param.__dict__.setdefault("unconstrained", reference)


@contextmanager
def local_params(*modules):
    """Enable ``module_local_params`` for the block, preparing ``modules`` for it.

    Global ``pyro.param`` statements inside the block are served by a
    :class:`GlobalParamBridge` (one copy of the global store per outermost block; parameters
    created in it are registered in the global store at its end).  An autoguide among
    ``modules`` that is not set up yet traces its model through the bridge too (its set-up
    trace is blocked from the handlers outside it).
    """
    prepare_local_params(*modules)
    outer = _current_bridge()
    with _unconstrained_references_kept(pyro.get_param_store()), ExitStack() as stack:
        state = outer.state if outer is not None else _BridgeState()
        stack.enter_context(pyro.settings.context(module_local_params=True))
        stack.enter_context(GlobalParamBridge(state))
        for module in modules:
            if isinstance(module, torch.nn.Module):
                for m in module.modules():
                    _bridge_set_up(stack, m, state)
        try:
            yield
        finally:
            if outer is None:
                state.publish()


def _bridge_set_up(stack: ExitStack, guide, state: _BridgeState) -> None:
    """Let a not yet set-up autoguide trace its model through the bridge (restored at exit)."""
    wrapped = guide.__dict__.get("_model")
    if getattr(guide, "prototype_trace", True) is not None or not isinstance(wrapped, tuple) or not wrapped:
        return
    guide.__dict__["_model"] = (GlobalParamBridge(state)(wrapped[0]),)

    def restore():
        guide.__dict__["_model"] = wrapped

    stack.callback(restore)


def global_param_tensors(model, guide, args: tuple, kwargs: dict, *, with_sources: bool = False) -> list:
    """The unconstrained tensors of the global ``pyro.param`` statements that one run of
    ``guide`` and ``model`` (replayed on the guide's draw) makes, in order of appearance
    (``with_sources``: ``(tensor, "guide" | "model")`` pairs, the run that made it first, so a
    caller can tell a model's own parameters, e.g. its noise ``sigma``).

    Call inside :func:`local_params`.  Runs without gradients and without drawing from the
    caller's random streams or changing a buffer (BatchNorm's running statistics are put back).
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    # validation off: a broken initial state (say, infinite scales) is for fit's own state
    # check to name, not for a distribution's argument check inside this look-up
    with torch.no_grad(), torch.random.fork_rng(devices=devices), pyro.validation_enabled(False), \
            buffers_kept(model, guide):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
    out, seen = [], set()
    for source, trace in (("guide", guide_trace), ("model", model_trace)):
        for site in trace.nodes.values():
            if site["type"] == "param" and site["infer"].get(GLOBAL_PARAM_KEY):
                tensor = site["value"].unconstrained()
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    out.append((tensor, source))
    return out if with_sources else [tensor for tensor, _ in out]
