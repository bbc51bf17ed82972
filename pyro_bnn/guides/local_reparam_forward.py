"""A functional forward of plain Linear/Conv networks for MeanField's local reparameterisation.

With local reparameterisation :func:`~pyro_bnn.guides.meanfield.meanfield_loss` runs the
network with the posterior means as weights and adds ``√(x² σ_W² + σ_b²) ε`` to each
Linear/Conv output through forward hooks, installed and removed every step, around
``model.run_with`` (which goes through ``PyroModule.__call__`` and ``PyroModule.__getattr__``
per layer).  For a :class:`~pyro_bnn.BNN` whose network is a plain ``nn.Sequential`` of
Linear/zero-padded Conv layers (each weight random, the bias random, absent or a plain
parameter) and parameter-free torch layers (activations, pooling, ``Flatten``, ``Dropout``:
:data:`~pyro_bnn.guides.direct_forward.PARAMETER_FREE_LAYERS`),
:func:`local_reparam_plan` reads the layers once per step and :func:`run_local_reparam` makes
the calls the layers and hooks make — ``F.linear``/``F.conv*d`` of the input with the means,
the same of ``x²`` with ``σ²``, ``out + var.clamp_min(1e-30).sqrt() · ε`` — on the same
tensors in the same order (the ``σ²`` first, for every layer, as the hooks were installed;
the noise drawn layer by layer), so outputs and gradients are bit-identical
(``tests/test_local_reparam_forward.py``).

It is taken only where skipping the model's Pyro statements changes nothing
(:func:`~pyro_bnn.guides.direct_forward.direct_calls_allowed`: :func:`pyro_bnn.fit`'s
module-local mode); any other network, hook, augmentation, subclass with its own
``function``/``run_with``, PyroParam or site gets ``None`` and the hooks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..model.bnn import BNN, augmentation_of, network_of
from .direct_forward import has_hooks, is_plain_parameter_free

__all__ = ["local_reparam_plan", "run_local_reparam"]

_CONVOLUTIONS = ((nn.Conv1d, F.conv1d), (nn.Conv2d, F.conv2d), (nn.Conv3d, F.conv3d))


def local_reparam_plan(model, sites) -> tuple | None:
    """The layers of a plain Linear/Conv network, or ``None`` (use the hooks).

    Parameters
    ----------
    model : pyro_bnn.BNN
    sites : collection of str
        The random sites (all must be a Linear/Conv layer's ``weight`` or ``bias``, and every
        such layer's weight one of them).

    Returns
    -------
    tuple or None
        ``(model, steps)``, each step ``(layer, function, weight site, bias site or None)``
        for a Linear/Conv layer (``function`` ``F.linear`` or ``F.conv*d``) or
        ``(layer, None, None, None)`` for a parameter-free layer.
    """
    if type(model).run_with is not BNN.run_with or type(model).function is not BNN.function \
            or augmentation_of(model) is not None:
        return None
    net = network_of(model)
    if not isinstance(net, nn.Sequential) or type(net).forward is not nn.Sequential.forward \
            or has_hooks(net) or net.__dict__.get("_pyro_samples") or net.__dict__.get("_pyro_params"):
        return None
    steps, seen = [], set()
    for name, layer in net.named_children():
        step = _layer_step(name, layer, sites)
        if step is None:
            return None
        steps.append(step)
        seen.update(s for s in step[2:] if s is not None)
    if seen != set(sites):
        return None
    return model, tuple(steps)


def _layer_step(name: str, layer: nn.Module, sites) -> tuple | None:
    """One step of the plan (see :func:`local_reparam_plan`), or ``None`` if the layer is not covered."""
    if has_hooks(layer) or layer.__dict__.get("_pyro_params"):
        return None
    samples = set(layer.__dict__.get("_pyro_samples", ()))
    function = _layer_function(layer)
    if function is None:
        return (layer, None, None, None) if is_plain_parameter_free(layer) else None
    weight, bias = f"net.{name}.weight", f"net.{name}.bias"
    bias_random = "bias" in samples
    if (weight not in sites or "weight" not in samples or samples - {"weight", "bias"} or layer._buffers
            or layer._modules or bias_random != (bias in sites) or set(layer._parameters) - {"bias"}
            or any(getattr(type(layer), attr, None) is not None for attr in ("weight", "bias"))):
        return None
    return layer, function, weight, bias if bias_random else None


def _layer_function(layer: nn.Module):
    """``F.linear`` for a plain Linear, ``F.conv*d`` for a plain zero-padded Conv, else ``None``."""
    if isinstance(layer, nn.Linear):
        return F.linear if type(layer).forward is nn.Linear.forward else None
    for cls, function in _CONVOLUTIONS:
        if isinstance(layer, cls):
            plain = (type(layer).forward is cls.forward and type(layer)._conv_forward is cls._conv_forward
                     and layer.padding_mode == "zeros")
            return function if plain else None
    return None


def run_local_reparam(plan: tuple, qs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                      x: torch.Tensor, noise) -> torch.Tensor:
    """The network output with local reparameterisation, as the hooks compute it around
    ``model.run_with({site: μ}, x)`` (bit-identical outputs and gradients).

    Parameters
    ----------
    plan : tuple
        From :func:`local_reparam_plan`.
    qs : mapping site -> (μ, σ)
        The posterior means and standard deviations.
    x : Tensor
        Inputs.
    noise : callable
        ``noise(out)``: standard normal noise shaped like a layer's output (the hooks' own).

    Returns
    -------
    Tensor
        ``f(x)``, shape ``(M, outputs)``.
    """
    model, steps = plan
    # σ² of every layer first, as _install_local_reparam computes them (same graph, same order)
    variances = [None if function is None else
                 (qs[weight][1] ** 2, None if bias is None else qs[bias][1] ** 2)
                 for _, function, weight, bias in steps]
    model.check_input(x)
    f = x
    for (layer, function, weight, bias), var_params in zip(steps, variances):
        if function is None:
            f = layer.forward(f)
            continue
        mean_bias = qs[bias][0] if bias is not None else layer._parameters.get("bias")
        var_w, var_b = var_params
        if function is F.linear:
            out = F.linear(f, qs[weight][0], mean_bias)
            var = F.linear(f ** 2, var_w, var_b)
        else:
            conv = (layer.stride, layer.padding, layer.dilation, layer.groups)
            out = function(f, qs[weight][0], mean_bias, *conv)
            var = function(f ** 2, var_w, var_b, *conv)
        f = out + var.clamp_min(1e-30).sqrt() * noise(out)
    return f
