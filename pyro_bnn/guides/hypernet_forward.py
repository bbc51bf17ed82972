"""A functional forward of plain weight-norm MLPs for :class:`~pyro_bnn.guides.HypernetELBO`.

The training objective of a Hypernet guide runs the network once per particle with the scales
``g`` fixed to a draw.  Through ``model.run_with`` every layer goes through
``PyroModule.__call__`` and ``PyroModule.__getattr__`` (a Pyro ``param`` statement per
deterministic parameter, a context look-up per scale), which for a short step (a few ms)
is a measurable share of its time (``docs/results/speed.md``).  For a :class:`~pyro_bnn.BNN`
whose network is a plain ``nn.Sequential`` of weight-norm Linear layers, ReLUs and Flattens,
:func:`weight_norm_plan` reads the layers once (through the public readers of
:mod:`pyro_bnn.model.bnn`) and :func:`run_plan` computes the same operations directly: per
layer the weight ``W = g v/‖v‖`` (:func:`~pyro_bnn.model.weight_norm.weight_norm_weight`,
zero-row safety included), ``F.linear`` and ``F.relu`` — the calls ``nn.Linear.forward`` and
``nn.ReLU.forward`` make, so the outputs and gradients are bit-identical to ``run_with``.

Any other model (other layers, hooks, an augmentation, a subclass that changes the forward,
PyroParams, other random sites) gets ``None`` from :func:`weight_norm_plan` and the general
path.  The model stays an ordinary ``PyroModule`` for ``Predictive``, SVI and traces; Pyro's
``param`` statements that the general path emits are emitted by
:class:`~pyro_bnn.contract.objective.GuideObjective` where SVI needs them.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyro
import torch
import torch.nn.functional as F
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn
from torch.nn.modules import module as _nn_module

from ..contract.local_params import GlobalParamBridge
from ..model.bnn import BNN, augmentation_of, network_of
from ..model.weight_norm import WeightNormLinear, weight_norm_weight

__all__ = ["weight_norm_plan", "run_plan", "direct_calls_allowed", "has_hooks"]


def weight_norm_plan(model, site_names) -> tuple | None:
    """The layers of a plain weight-norm MLP model, or ``None`` (use ``model.run_with``).

    Parameters
    ----------
    model : pyro_bnn.BNN
    site_names : sequence of str
        The random sites the guide samples (all must be the ``weight_g`` of the plan's layers,
        and every weight-norm layer's ``weight_g`` must be one of them).

    Returns
    -------
    tuple or None
        ``(model, net, steps)`` with ``steps`` a tuple of ``("linear", layer, site)``,
        ``("relu", inplace, None)`` or ``("flatten", (start, end), None)``; ``None`` when the
        model is anything else.
    """
    if type(model).run_with is not BNN.run_with or type(model).function is not BNN.function:
        return None
    if augmentation_of(model) is not None:   # (hooks of the model itself: run_with never calls it)
        return None
    net = network_of(model)
    if not isinstance(net, nn.Sequential) or type(net).forward is not nn.Sequential.forward \
            or has_hooks(net) or net.__dict__.get("_pyro_samples") or net.__dict__.get("_pyro_params"):
        return None
    sites = set(site_names)
    steps, seen = [], set()
    for name, layer in net.named_children():
        if has_hooks(layer):
            return None
        if isinstance(layer, WeightNormLinear):
            site = f"net.{name}.weight_g"
            if (type(layer).forward is not nn.Linear.forward or site not in sites
                    or set(layer.__dict__.get("_pyro_samples", {})) != {"weight_g"}
                    or layer.__dict__.get("_pyro_params") or "weight_v" not in layer._parameters):
                return None
            steps.append(("linear", layer, site))
            seen.add(site)
        elif type(layer).forward is nn.ReLU.forward and isinstance(layer, nn.ReLU):
            steps.append(("relu", bool(layer.inplace), None))
        elif type(layer).forward is nn.Flatten.forward and isinstance(layer, nn.Flatten):
            steps.append(("flatten", (layer.start_dim, layer.end_dim), None))
        else:
            return None
        if layer.__dict__.get("_pyro_params") or (
                not isinstance(layer, WeightNormLinear) and layer.__dict__.get("_pyro_samples")):
            return None
    if seen != sites or not steps:
        return None
    return model, net, tuple(steps)


def run_plan(plan: tuple, values: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``model.run_with(values, x)`` for a model with a :func:`weight_norm_plan`: the same
    operations on the same tensors (bit-identical outputs and gradients)."""
    model, _, steps = plan
    model.check_input(x)
    f = x
    for kind, item, site in steps:
        if kind == "linear":
            params = item._parameters
            f = F.linear(f, weight_norm_weight(values[site], params["weight_v"]), params["bias"])
        elif kind == "relu":
            f = F.relu(f, inplace=item)
        else:
            f = f.flatten(*item)
    return f


def direct_calls_allowed() -> bool:
    """Whether skipping the model's Pyro ``param`` statements changes nothing: Pyro's
    module-local parameter mode is on (a statement registers nothing) and the only handlers
    running are :func:`~pyro_bnn.contract.local_params.local_params`' bridges (which pass
    module parameters through), as in :func:`pyro_bnn.fit`."""
    return bool(pyro.settings.get("module_local_params")) and all(
        type(frame) is GlobalParamBridge for frame in _PYRO_STACK)


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` (or a global registration) has forward hooks a direct call would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)
