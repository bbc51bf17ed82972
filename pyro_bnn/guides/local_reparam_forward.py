"""Per-example weight noise for MeanField's Linear/Conv layers, and a functional forward of
plain Linear/Conv networks that uses it.

**Per-example noise.**  Each training example gets its own draw of the weights without drawing
them one example at a time: the layer runs with the posterior means and a noise term is added
to its output.  Which term is exact depends on the layer (:func:`add_layer_noise`):

* a Linear layer on ``(batch, features)`` inputs: **local reparameterisation** (Kingma et al.
  2015), ``out + √(x² σ_W² + σ_b²) ε`` — each output unit depends on its own row of
  independent weights, so sampling the pre-activations independently is exactly sampling the
  weights per example;
* a Conv layer, or a Linear layer on inputs with more axes (``(batch, time, features)``):
  **Flipout** (Wen et al. 2018), ``out + r ⊙ layer(x ⊙ s; σ_W ⊙ E) + σ_b ε_b`` with one
  ``E ~ N(0, I)`` for the batch and random signs ``s`` (per example and input channel) and ``r``
  (per example and output channel).  The outputs of one image at different positions share one
  weight draw, and local reparameterisation would draw their noise independently: a different
  distribution, whose "ELBO" on a CNN came out 7 standard errors above the true one (400 digits,
  σ 0.5).  Flipout's perturbation ``E ⊙ r sᵀ`` is distributed as ``E`` for any signs, so each
  example sees one exact draw of ``N(μ, σ²)`` shared by all its positions; the draws of
  different examples are decorrelated by the signs (two layer calls, as local
  reparameterisation needs).

Both need every example to pass each layer once, along the batch axis: a layer called twice in
one forward (weight sharing) or on an example's rows folded into the batch axis would give one
example several draws.  The hooks raise :class:`PerExampleNoiseError` then, and MeanField's
``"auto"`` setting falls back to weight noise (the folded rows' "ELBO": −545 against the true
−580).

Masked weights (:mod:`pyro_bnn.model.weight_masks`, set by pruning) must be given as
``σ = 0`` (and ``μ = 0``) by the caller: neither term draws weights the masks could act on.

**The functional forward.**  :func:`~pyro_bnn.guides.meanfield.meanfield_loss` runs the
network with the posterior means as weights and adds each layer's noise term through forward
hooks (:func:`install_layer_noise`), installed and removed every step, around
``model.run_with`` (which goes through ``PyroModule.__call__`` and ``PyroModule.__getattr__``
per layer).  For a :class:`~pyro_bnn.BNN` whose network is a plain ``nn.Sequential`` of
Linear/zero-padded Conv layers (each weight random, the bias random, absent or a plain
parameter) and parameter-free torch layers (activations, pooling, ``Flatten``, ``Dropout``:
:data:`~pyro_bnn.guides.direct_forward.PARAMETER_FREE_LAYERS`),
:func:`local_reparam_plan` reads the layers once per step and :func:`run_local_reparam` makes
the calls the layers and hooks make — the layer function of the input with the means, then
:func:`add_layer_noise` — on the same tensors in the same order (every layer's noise
parameters first, as the hooks are installed; the noise drawn layer by layer), so outputs and
gradients are bit-identical (``tests/test_local_reparam_forward.py``).

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

__all__ = ["local_reparam_plan", "run_local_reparam", "noise_parameters", "add_layer_noise", "install_layer_noise",
           "layer_function", "PerExampleNoiseError"]

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
    """:func:`layer_function` of a layer whose ``forward`` is its class's own (the plan calls the
    function in its place), else ``None``."""
    function = layer_function(layer)
    if function is None:
        return None
    base = nn.Linear if function is F.linear else next(cls for cls, fn in _CONVOLUTIONS if fn is function)
    plain = type(layer).forward is base.forward and (
        base is nn.Linear or type(layer)._conv_forward is base._conv_forward)
    return function if plain else None


def noise_parameters(layer: nn.Module, scale_w: torch.Tensor, scale_b: torch.Tensor | None) -> tuple:
    """What :func:`add_layer_noise` needs of a layer's posterior scales: ``(σ_W², σ_b², σ_W, σ_b)``
    for a Linear layer (``σ²`` for local reparameterisation, ``σ`` for Flipout on inputs with more
    axes), ``(None, None, σ_W, σ_b)`` for a convolution."""
    if isinstance(layer, nn.Linear):
        return scale_w ** 2, None if scale_b is None else scale_b ** 2, scale_w, scale_b
    return None, None, scale_w, scale_b


def add_layer_noise(out: torch.Tensor, x: torch.Tensor, layer: nn.Module, function, params: tuple,
                    noise) -> torch.Tensor:
    """The output of a Linear/Conv layer under per-example weight draws from ``N(μ, σ²)``, given
    its output ``out`` with the means ``μ`` (see the module docstring).

    Parameters
    ----------
    out : Tensor
        The layer's output with the posterior means as weights (and bias).
    x : Tensor
        The layer's input, ``(batch, ...)``.
    layer : nn.Module
        The Linear or Conv layer (its stride, padding, dilation and groups).
    function : callable
        ``F.linear`` or ``F.conv1d``/``F.conv2d``/``F.conv3d``.
    params : tuple
        From :func:`noise_parameters`.
    noise : callable
        ``noise(t)``: standard normal noise shaped like ``t``.

    Returns
    -------
    Tensor
        ``out`` plus local-reparameterisation noise (Linear on 2-D inputs) or Flipout noise.
    """
    var_w, var_b, scale_w, scale_b = params
    if function is not F.linear and x.dim() == scale_w.dim() - 1:  # one unbatched example (C, ...)
        return add_layer_noise(out.unsqueeze(0), x.unsqueeze(0), layer, function, params, noise).squeeze(0)
    if function is F.linear and x.dim() <= 2:
        var = F.linear(x ** 2, var_w, var_b)
        return out + var.clamp_min(1e-30).sqrt() * noise(out)
    # Flipout: one E for the batch, signs per example and channel (channels: axis 1 of a
    # convolution's input and output, the last axis of a Linear layer's)
    if function is F.linear:
        shape_in = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        shape_out = (out.shape[0],) + (1,) * (out.dim() - 2) + (out.shape[-1],)
    else:
        shape_in = (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2)
        shape_out = (out.shape[0], out.shape[1]) + (1,) * (out.dim() - 2)
    perturbation = scale_w * noise(scale_w)
    signs_in = _random_signs(x.new_empty(shape_in), noise)
    signs_out = _random_signs(out.new_empty(shape_out), noise)
    if function is F.linear:
        delta = F.linear(x * signs_in, perturbation)
    else:
        delta = function(x * signs_in, perturbation, None, layer.stride, layer.padding, layer.dilation,
                         layer.groups)
    out = out + delta * signs_out
    if scale_b is not None:  # one bias draw per example, shared by its positions
        out = out + scale_b.reshape(shape_out[1:] if function is F.linear else (-1,) + shape_out[2:]) \
            * noise(out.new_empty(shape_out))
    return out


def _random_signs(like: torch.Tensor, noise) -> torch.Tensor:
    """±1 with probability ½ each, shaped like ``like`` (the signs of standard normal noise, so that
    every random number comes from ``noise``)."""
    return torch.where(noise(like) >= 0, 1.0, -1.0).to(like)


class PerExampleNoiseError(ValueError):
    """A network calls a layer in a way per-example noise cannot follow: twice in one forward
    (weight sharing: the calls of one example must share one draw), or on an input whose first
    axis is not the model's batch (rows of one example folded into the batch axis)."""


def install_layer_noise(modules, params: Mapping[str, tuple], noise, batch_size: int) -> list:
    """Forward hooks that add :func:`add_layer_noise` to the output of each Linear/Conv module.

    Parameters
    ----------
    modules : iterable of (str, nn.Module, callable)
        ``(weight site, module, its layer_function)``, in the order the noise parameters were
        computed.
    params : mapping weight site -> tuple
        From :func:`noise_parameters`.
    noise : callable
        ``noise(t)``: standard normal noise shaped like ``t``.
    batch_size : int
        The model input's batch size: each module's input must have it as its first axis.

    Returns
    -------
    list
        The hook handles (remove them after the forward).

    Raises
    ------
    PerExampleNoiseError
        (from the forward) A module is called a second time, or on an input whose first axis is
        not the batch: each call would draw its own weights for the same example.
    """
    return [module.register_forward_hook(_noise_hook(site, function, params[site], noise, batch_size))
            for site, module, function in modules]


def _noise_hook(site: str, function, params: tuple, noise, batch_size: int):
    """The forward hook of :func:`install_layer_noise` for one module (it counts its calls)."""
    calls = 0

    def hook(module, inputs, out):
        nonlocal calls
        calls += 1
        x = inputs[0]
        if calls > 1 or x.dim() == 0 or x.shape[0] != batch_size:
            how = ("is called more than once in one forward" if calls > 1 else
                   f"gets an input of shape {tuple(x.shape)}, whose first axis is not the batch of "
                   f"{batch_size} examples")
            raise PerExampleNoiseError(
                f"the layer of site {site!r} {how}: per-example weight noise would give one example several "
                "weight draws; use local_reparameterization=False (weight noise)")
        return add_layer_noise(out, x, module, function, params, noise)
    return hook


def layer_function(module: nn.Module):
    """``F.linear`` for a Linear module, the ``F.conv*d`` of a zero-padded Conv module, else
    ``None``: the layers per-example noise applies to."""
    if isinstance(module, nn.Linear):
        return F.linear
    for cls, function in _CONVOLUTIONS:
        if isinstance(module, cls) and module.padding_mode == "zeros":
            return function
    return None


def run_local_reparam(plan: tuple, qs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                      x: torch.Tensor, noise) -> torch.Tensor:
    """The network output with per-example weight noise, as the hooks compute it around
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
    # every layer's noise parameters first, as install_layer_noise's callers compute them
    params = [None if function is None else
              noise_parameters(layer, qs[weight][1], None if bias is None else qs[bias][1])
              for layer, function, weight, bias in steps]
    model.check_input(x)
    f = x
    for (layer, function, weight, bias), p in zip(steps, params):
        if function is None:
            f = layer.forward(f)
            continue
        mean_bias = qs[bias][0] if bias is not None else layer._parameters.get("bias")
        if function is F.linear:
            out = F.linear(f, qs[weight][0], mean_bias)
        else:
            out = function(f, qs[weight][0], mean_bias, layer.stride, layer.padding, layer.dilation, layer.groups)
        f = add_layer_noise(out, f, layer, function, p, noise)
    return f
