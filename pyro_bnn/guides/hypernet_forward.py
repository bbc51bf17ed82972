"""A functional forward of plain weight-norm networks for :class:`~pyro_bnn.guides.HypernetELBO`.

The training objective of a Hypernet guide runs the network once per particle with the scales
``g`` fixed to a draw.  Through ``model.run_with`` every layer goes through
``PyroModule.__call__`` and ``PyroModule.__getattr__`` (a Pyro ``param`` statement per
deterministic parameter, a context look-up per scale), which for a short step (a few ms)
is a measurable share of its time (``docs/results/speed.md``).  For a :class:`~pyro_bnn.BNN`
whose network is a plain ``nn.Sequential`` of weight-norm Linear and zero-padded Conv2d layers
and parameter-free torch layers (ReLU, Flatten, pooling, other activations:
:data:`~pyro_bnn.guides.direct_forward.PARAMETER_FREE_LAYERS`), :func:`weight_norm_plan` reads
the layers once (through the public readers of :mod:`pyro_bnn.model.bnn`) and :func:`run_plan`
computes the same operations directly: per layer the weight ``W = g v/‖v‖``
(:func:`~pyro_bnn.model.weight_norm.weight_norm_weight`, zero-row safety included), then
``F.linear`` / ``F.conv2d``, ``F.relu`` or the parameter-free layer's own ``forward`` — the
calls ``nn.Linear.forward``, ``nn.Conv2d.forward`` and the layers' ``__call__`` make, so the
outputs and gradients are bit-identical to ``run_with``.

Any other model (other layers, hooks, an augmentation, a subclass that changes the forward,
PyroParams, other random sites) gets ``None`` from :func:`weight_norm_plan` and the general
path.  The model stays an ordinary ``PyroModule`` for ``Predictive``, SVI and traces; Pyro's
``param`` statements that the general path emits are emitted by
:class:`~pyro_bnn.contract.objective.GuideObjective` where SVI needs them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..model.bnn import BNN, augmentation_of, network_of
from ..model.weight_norm import WeightNormConv2d, WeightNormLinear, weight_norm_weight
from .direct_forward import direct_calls_allowed, has_hooks, is_plain_parameter_free

__all__ = ["weight_norm_plan", "run_plan", "direct_calls_allowed"]


def weight_norm_plan(model, site_names) -> tuple | None:
    """The layers of a plain weight-norm MLP model, or ``None`` (use ``model.run_with``).

    Parameters
    ----------
    model : pyro_bnn.BNN
    site_names : sequence of str
        The random sites the guide samples (all must be the ``weight_g`` of the plan's layers, or
        their ``weight_v`` where the directions are random, and every weight-norm layer's
        ``weight_g`` must be one of them).

    Returns
    -------
    tuple or None
        ``(model, net, steps)`` with ``steps`` a tuple of ``("linear" | "conv2d", layer, (scale
        site, direction site or None))``,
        ``("relu", inplace, None)``, ``("flatten", (start, end), None)`` or
        ``("module", layer, None)`` (a parameter-free layer); ``None`` when the model is
        anything else.
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
        weight_norm = _weight_norm_kind(layer)
        if weight_norm is not None:
            site, direction = f"net.{name}.weight_g", f"net.{name}.weight_v"
            random = set(layer.__dict__.get("_pyro_samples", {}))
            if random == {"weight_g", "weight_v"} and direction in sites:   # random directions
                seen.add(direction)
            elif random != {"weight_g"} or "weight_v" not in layer._parameters:
                return None
            else:
                direction = None
            if site not in sites or layer.__dict__.get("_pyro_params"):
                return None
            steps.append((weight_norm, layer, (site, direction)))
            seen.add(site)
        elif type(layer).forward is nn.ReLU.forward and isinstance(layer, nn.ReLU):
            steps.append(("relu", bool(layer.inplace), None))
        elif type(layer).forward is nn.Flatten.forward and isinstance(layer, nn.Flatten):
            steps.append(("flatten", (layer.start_dim, layer.end_dim), None))
        elif is_plain_parameter_free(layer):   # pooling, other activations: their own forward
            steps.append(("module", layer, None))
        else:
            return None
        if layer.__dict__.get("_pyro_params") or (weight_norm is None and layer.__dict__.get("_pyro_samples")):
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
            f = F.linear(f, _weight(values, site, params), params["bias"])
        elif kind == "conv2d":   # nn.Conv2d._conv_forward with zero padding
            params = item._parameters
            f = F.conv2d(f, _weight(values, site, params), params["bias"],
                         item.stride, item.padding, item.dilation, item.groups)
        elif kind == "relu":
            f = F.relu(f, inplace=item)
        elif kind == "flatten":
            f = f.flatten(*item)
        else:
            f = item.forward(f)
    return f


def _weight(values: Mapping[str, torch.Tensor], sites: tuple, params) -> torch.Tensor:
    """``g v/‖v‖`` of a layer: ``g`` drawn, ``v`` drawn (random directions) or the parameter."""
    scale, direction = sites
    return weight_norm_weight(values[scale], params["weight_v"] if direction is None else values[direction])


def _weight_norm_kind(layer: nn.Module) -> str | None:
    """``"linear"`` / ``"conv2d"`` for a weight-norm layer running the torch class's own forward
    (zero-padded convolutions only), else ``None``."""
    if isinstance(layer, WeightNormLinear) and type(layer).forward is nn.Linear.forward:
        return "linear"
    if (isinstance(layer, WeightNormConv2d) and type(layer).forward is nn.Conv2d.forward
            and type(layer)._conv_forward is nn.Conv2d._conv_forward and layer.padding_mode == "zeros"):
        return "conv2d"
    return None
