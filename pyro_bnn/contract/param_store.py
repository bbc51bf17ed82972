"""Pyro's global parameter store and the parameters of pyro_bnn's modules, kept consistent.

Pyro keeps parameters in one of two places.  By default they live in a process-wide
*param store* keyed by name (``"MeanField.locs.net.0.weight"``): ``SVI`` optimises what the
store holds, ``Predictive`` reads it, ``pyro.get_param_store().save()`` writes it.  With
``pyro.settings.set(module_local_params=True)`` they live in the modules instead.
:func:`pyro_bnn.fit`, :func:`pyro_bnn.predict` and the other tools run in module-local mode,
so that two guides of the same class never share values by name.

So that a guide trained either way can be used either way, pyro_bnn guides (and any model
or guide that :func:`pyro_bnn.fit` has trained) follow these rules whenever they run while
the global store is in use (:func:`sync_param_store`):

1. A parameter the store does not hold yet is registered under its Pyro name, as the
   module's own tensor (so ``SVI`` optimises the module's tensor and the store's ``save``
   writes it).
2. A store entry that pyro_bnn registered for *another* module (another guide of the same
   class, trained earlier) is replaced by this module's tensor: one guide's call never
   changes another guide's values.
3. Any other store entry -- values loaded with ``pyro.get_param_store().load()``, set with
   ``set_state`` or ``pyro.param`` -- is Pyro's: its values are copied into the module's
   tensor, which then replaces the entry.  So a fresh model and guide pick up a loaded
   store, as with Pyro's own guides.

Pyro guides set up for the first time are set up in module-local mode (see
:meth:`pyro_bnn.guides.BNNGuide.__call__`), so rule 3 applies to them at once instead of
Pyro silently sharing another module's tensor.

The store has no public call that registers an *existing* tensor under a name, except
``set_state``, which is what :func:`_register` uses.  Which entries pyro_bnn registered is
remembered in a ``weakref.WeakValueDictionary`` attached to the store object itself, so it
lives exactly as long as the store does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pyro
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule
from pyro.params.param_store import param_with_module_name

__all__ = ["ParamEntry", "param_entries", "global_param_mode", "sync_param_store",
           "publish_to_param_store", "emit_param_statements", "install_param_store_sync",
           "expose_unconstrained", "publish_after_fit"]

_REGISTRY_ATTRIBUTE = "_pyro_bnn_registered"


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of a module as Pyro names it.

    Attributes
    ----------
    name : str
        The Pyro name (``"MeanField.locs.net.0.weight"``, ``"Hypernet.flow$$$affine.loc"``).
    tensor : torch.nn.Parameter
        The module's unconstrained tensor.
    constraint : torch.distributions.constraints.Constraint
        Its constraint (``real`` unless it is a ``PyroParam``).
    path : tuple of str
        Attribute path from the root module to the attribute whose access makes
        ``PyroModule`` emit the ``param`` statement (the parameter, or the plain
        ``nn.Module`` that holds it).
    """

    name: str
    tensor: torch.Tensor
    constraint: constraints.Constraint
    path: tuple[str, ...]


def global_param_mode() -> bool:
    """Whether Pyro keeps parameters in its global store (``module_local_params`` off)."""
    return not pyro.settings.get("module_local_params")


def param_entries(root: torch.nn.Module, *, frozen: bool = False) -> list[ParamEntry]:
    """Every trainable parameter of ``root`` (every parameter with ``frozen``) with the name
    Pyro gives it in the store.

    Follows ``PyroModule``'s naming: ``PyroParam`` attributes and plain ``nn.Parameter``
    attributes of a ``PyroModule`` are named by their attribute path under the root's Pyro
    name; the parameters of a plain ``nn.Module`` held by a ``PyroModule`` are registered
    by ``pyro.module`` under ``"<module path>$$$<parameter path>"``.  A root that is not a
    ``PyroModule`` has no Pyro names (empty list).

    Parameters
    ----------
    root : torch.nn.Module
    frozen : bool
        Also list the frozen parameters (``requires_grad=False``, which ``pb.BNN`` keeps
        fixed): ``PyroModule`` emits ``param`` statements for them too.
    """
    if not isinstance(root, PyroModule):
        return []
    return list(_walk(root, root.__dict__.get("_pyro_name", ""), (), frozen))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _walk(module: PyroModule, prefix: str, path: tuple[str, ...], frozen: bool) -> Iterator[ParamEntry]:
    pyro_params = module.__dict__.get("_pyro_params", {})
    for name, (constraint, _) in pyro_params.items():
        tensor = module._parameters.get(name + "_unconstrained")
        if tensor is not None and (frozen or tensor.requires_grad):
            yield ParamEntry(_join(prefix, name), tensor, constraint, path + (name,))
    for name, tensor in module._parameters.items():
        if tensor is None or not (frozen or tensor.requires_grad) or name.endswith("_unconstrained"):
            continue
        yield ParamEntry(_join(prefix, name), tensor, constraints.real, path + (name,))
    for name, child in module._modules.items():
        if child is None:
            continue
        if isinstance(child, PyroModule):
            yield from _walk(child, _join(prefix, name), path + (name,), frozen)
            continue
        module_name = _join(prefix, name)
        for param_name, tensor in child.named_parameters():
            if frozen or tensor.requires_grad:
                yield ParamEntry(param_with_module_name(module_name, param_name), tensor,
                                 constraints.real, path + (name,))


def _registry(store) -> weakref.WeakValueDictionary:
    registry = store.__dict__.get(_REGISTRY_ATTRIBUTE)
    if registry is None:
        registry = weakref.WeakValueDictionary()
        setattr(store, _REGISTRY_ATTRIBUTE, registry)
    return registry


def _register(store, entry: ParamEntry) -> None:
    store.set_state({"params": {entry.name: entry.tensor}, "constraints": {entry.name: entry.constraint}})
    _registry(store)[entry.name] = entry.tensor


def _adopt(entry: ParamEntry, stored: torch.Tensor) -> None:
    if stored.shape != entry.tensor.shape:
        raise ValueError(
            f"Pyro's param store holds {entry.name!r} with shape {tuple(stored.shape)}, but this "
            f"module's parameter has shape {tuple(entry.tensor.shape)}: the store was saved from a "
            "different architecture. Call pyro.clear_param_store() or load the matching store.")
    with torch.no_grad():
        entry.tensor.copy_(stored)


def sync_param_store(*modules: torch.nn.Module) -> None:
    """Apply the module rules above between ``modules`` and Pyro's global store.

    Does nothing in module-local mode.

    Raises
    ------
    ValueError
        A store entry to be copied in has another shape than the module's parameter.
    """
    if not global_param_mode():
        return
    store = pyro.get_param_store()
    held = dict(store.named_parameters())
    registry = _registry(store)
    for module in modules:
        for entry in param_entries(module):
            stored = held.get(entry.name)
            if stored is entry.tensor:
                registry[entry.name] = entry.tensor
                continue
            if stored is not None and registry.get(entry.name) is not stored:
                _adopt(entry, stored)   # rule 3: values that Pyro put there
            _register(store, entry)     # rules 1-3: the module's tensor is the entry


def publish_to_param_store(*modules: torch.nn.Module) -> None:
    """Register the modules' current tensors in the global store, replacing any entry.

    Used after training (:func:`pyro_bnn.fit`), when the modules hold the newest values.
    Does nothing in module-local mode.
    """
    if not global_param_mode():
        return
    store = pyro.get_param_store()
    for module in modules:
        for entry in param_entries(module):
            _register(store, entry)


def emit_param_statements(root: torch.nn.Module) -> None:
    """Make ``root`` emit Pyro ``param`` statements for all its parameters.

    Each statement comes from ``PyroModule``'s own attribute access, so handlers such as
    the one ``SVI`` uses to collect the parameters it optimises see exactly what a
    ``forward`` that read every parameter would show them (in either parameter mode).
    Used by objectives that compute their loss without going through Pyro primitives.
    """
    if not isinstance(root, PyroModule):
        return
    seen = set()
    with root._pyro_context:
        for entry in param_entries(root):
            if entry.path in seen:
                continue
            seen.add(entry.path)
            obj = root
            for part in entry.path:
                obj = getattr(obj, part)


def expose_unconstrained(*modules: torch.nn.Module) -> None:
    """Let ``SVI`` collect the modules' plain parameters in module-local mode.

    ``SVI`` optimises ``value.unconstrained()`` of every ``param`` statement.  Pyro's
    ``PyroParam`` values carry that attribute; the plain ``nn.Parameter``s that
    ``PyroModule`` reports in module-local mode do not (in global mode the param store
    adds it).  This gives them the same self-reference the store would.  Frozen parameters
    (``requires_grad=False``) get it too, since ``PyroModule`` reports them as well; they
    stay fixed: without a gradient an optimiser's ``step`` leaves them as they are.
    """
    for module in modules:
        for entry in param_entries(module, frozen=True):
            if entry.path[-1] in getattr(_owner(module, entry.path), "_pyro_params", {}):
                continue
            if "unconstrained" not in entry.tensor.__dict__:
                entry.tensor.unconstrained = weakref.ref(entry.tensor)


def _owner(root, path):
    obj = root
    for part in path[:-1]:
        obj = obj._modules[part]
    return obj


def _sync_hook(module, args, kwargs=None):
    sync_param_store(module)


def install_param_store_sync(module: torch.nn.Module) -> None:
    """Make ``module`` follow the rules above before each of its calls (a forward pre-hook).

    For models and Pyro's own guides trained by :func:`pyro_bnn.fit`; pyro_bnn's guides
    do this themselves.  Installing twice is a no-op.
    """
    if not isinstance(module, PyroModule) or any(h is _sync_hook for h in module._forward_pre_hooks.values()):
        return
    module.register_forward_pre_hook(_sync_hook)


def publish_after_fit(model, guide) -> None:
    """After :func:`pyro_bnn.fit`: register the trained values in Pyro's store and make
    model and guide follow the rules above on every later call (global mode only)."""
    if not global_param_mode():
        return
    modules = [m for m in (model, guide) if isinstance(m, torch.nn.Module)]
    publish_to_param_store(*modules)
    for module in modules:
        install_param_store_sync(module)
