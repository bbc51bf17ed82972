"""Layers of a model as curvature groups, and the hooks that capture their Jacobian factors.

A :class:`Layer` is one Linear or Conv2d module whose weight and/or bias are sample sites.
Its parameters are handled as one matrix ``W̃ = [W, b]`` of shape ``(out, in')``
(``in' = in·k_h·k_w (+1 for the bias)``), flattened row-major.  For one example the
Jacobian of an output ``f_c`` w.r.t. ``W̃`` is ``Σ_t g_{c,t} ã_tᵀ``: ``ã_t`` are the layer
inputs (unfolded patches for a convolution, ``t`` runs over output positions; a trailing 1
for the bias) and ``g_{c,t} = ∂f_c/∂s_t`` the gradients w.r.t. the layer outputs.
:func:`capture_factors` gets ``ã`` from forward hooks and ``g`` (against any set of
column vectors, e.g. the factor ``L`` of ``Λ = L Lᵀ``) from autograd, never forming ``J``.

A normalisation layer's affine parameters (BatchNorm, GroupNorm: per channel; LayerNorm: per
element of its normalised shape) form a *unit-wise* layer (:attr:`Layer.unitwise`):
``W̃ = [γ, β]`` of shape ``(C, in')`` (``in'`` 2, or 1 with only one of them random), and
channel ``c``'s output ``s_{c,t} = γ_c x̂_{c,t} + β_c`` sees its own input, so ``ã`` carries
the channel: ``(M, T, C, in')`` with ``ã_{t,c} = [x̂_{c,t}, 1]`` (``x̂`` the input normalised
with the statistics the layer uses in its current mode).  Row ``c`` of the Jacobian is then
``Σ_t g_{c,t} ã_{t,c}ᵀ`` (:meth:`Layer.per_example`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.bnn import site_module

__all__ = ["Layer", "find_layers", "capture_factors"]

#: Normalisation layers whose affine parameters (γ, β) can be Laplace sites (unit-wise layers).
UNITWISE_MODULES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm,
                    nn.LayerNorm)


@dataclass
class Layer:
    """One curvature group: a Linear/Conv2d module with its weight/bias sites, or a normalisation
    layer (BatchNorm, InstanceNorm, GroupNorm, LayerNorm) with its affine sites (:attr:`unitwise`)."""

    path: str
    module: nn.Module
    weight: str | None
    bias: str | None
    out_features: int
    in_dim: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_dim)

    @property
    def numel(self) -> int:
        return self.out_features * self.in_dim

    @property
    def unitwise(self) -> bool:
        """Each output row has its own input (a normalisation layer's ``γ_c, β_c``): no Kronecker factors."""
        return isinstance(self.module, UNITWISE_MODULES)

    @property
    def sites(self) -> list[str]:
        return [s for s in (self.weight, self.bias) if s is not None]

    def flatten(self, values: dict) -> torch.Tensor:
        """``W̃ = [W.reshape(out, -1), b]``, shape ``(out, in')``."""
        parts = []
        if self.weight is not None:
            parts.append(values[self.weight].reshape(self.out_features, -1))
        if self.bias is not None:
            parts.append(values[self.bias].reshape(self.out_features, 1))
        return torch.cat(parts, 1)

    def unflatten(self, mat: torch.Tensor, shapes: dict) -> dict:
        """Inverse of :meth:`flatten`: ``mat`` of shape ``(..., out, in')`` → site values
        (with the same leading dimensions) shaped as ``shapes``.  For the flat form
        ``(..., out · in')`` use :meth:`unflatten_flat` (the two cannot be told apart by shape
        when ``out`` is 1)."""
        if tuple(mat.shape[-2:]) != self.shape:
            raise ValueError(f"layer {self.path!r}: expected a matrix of shape (..., {self.out_features}, "
                             f"{self.in_dim}), got {tuple(mat.shape)}")
        lead = mat.shape[:-2]
        out = {}
        # contiguous copies, not strided views of ``mat``: torch 2.14's CPU batch_norm in eval mode
        # back-propagates wrong input gradients through a strided γ (measured: −0.096 against the
        # finite difference 0.442), which reached gradients through Laplace-sampled BatchNorm γ, β
        if self.weight is not None:
            w = mat[..., :-1] if self.bias is not None else mat
            out[self.weight] = w.reshape(*lead, *shapes[self.weight]).contiguous()
        if self.bias is not None:
            out[self.bias] = mat[..., -1].reshape(*lead, *shapes[self.bias]).contiguous()
        return out

    def unflatten_flat(self, vec: torch.Tensor, shapes: dict) -> dict:
        """Inverse of ``flatten(values).reshape(-1)``: ``vec`` of shape ``(..., out · in')``."""
        if vec.shape[-1] != self.numel:
            raise ValueError(f"layer {self.path!r}: expected a flat vector of {self.numel} entries in the last "
                             f"dimension, got {tuple(vec.shape)}")
        return self.unflatten(vec.reshape(*vec.shape[:-1], *self.shape), shapes)

    def expand_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Layer input → ``ã`` of shape ``(M, T, in')`` (unit-wise: ``(M, T, C, in')``)."""
        m = self.module
        if self.unitwise:
            return self._normalized_inputs(x)
        if isinstance(m, nn.Conv2d):
            a = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride).transpose(1, 2)
        else:
            a = x.reshape(len(x), -1, x.shape[-1])
        if self.weight is None:
            a = a[..., :0]
        if self.bias is not None:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1)
        return a

    def _normalized_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Normalisation-layer input → ``[x̂, 1]`` of shape ``(M, T, C, in')``, ``x̂`` normalised as
        the layer does before its affine map (BatchNorm: with the running statistics in eval mode,
        the batch's in train mode or without running statistics; InstanceNorm likewise, with each
        example's own statistics), without updating statistics."""
        m = self.module
        if isinstance(m, nn.LayerNorm):
            xhat = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
        elif isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
        elif isinstance(m, nn.modules.instancenorm._InstanceNorm):   # per example and channel
            own_stats = m.training or not m.track_running_stats
            xhat = F.instance_norm(x, None if own_stats else m.running_mean, None if own_stats else m.running_var,
                                   None, None, own_stats, 0.0, m.eps)
        else:
            batch_stats = m.training or m.running_mean is None
            xhat = F.batch_norm(x, None if batch_stats else m.running_mean, None if batch_stats else m.running_var,
                                None, None, batch_stats, 0.0, m.eps)
        xhat = self.expand_grads(xhat)                                   # (M, T, C), the outputs' layout
        parts = ([xhat] if self.weight is not None else []) + ([torch.ones_like(xhat)] if self.bias is not None else [])
        return torch.stack(parts, -1)

    def expand_grads(self, g: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the layer output → ``(M, T, out)``."""
        if isinstance(self.module, nn.LayerNorm):                        # units: the trailing dims
            return g.reshape(len(g), -1, self.out_features)
        if isinstance(self.module, nn.Conv2d) or (self.unitwise and g.dim() > 2):
            return g.flatten(2).transpose(1, 2)
        return g.reshape(len(g), -1, g.shape[-1])

    def per_example(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Per-example, per-column Jacobian rows ``Σ_t g_{k,t} ã_tᵀ``: ``a`` ``(M, T, in')``
        (unit-wise ``(M, T, out, in')``) and ``g`` ``(K, M, T, out)`` → ``(K, M, out, in')``."""
        if self.unitwise:
            return torch.einsum("kmto,mtoi->kmoi", g, a)
        return torch.einsum("kmto,mti->kmoi", g, a)

    def summed_rows(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``Σ_m Σ_t g_{m,t} ã_{m,t}ᵀ`` for one column ``g`` ``(M, T, out)``: shape ``(out, in')``
        (without the per-example rows of :meth:`per_example`)."""
        if self.unitwise:
            return torch.einsum("mto,mtoi->oi", g, a)
        return torch.einsum("mto,mti->oi", g, a)

    def output_offsets(self, a: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
        """``ΔW̃ ã_t`` at every position for weight offsets ``dw`` ``(S, out, in')``: ``(S, M, T, out)``."""
        if self.unitwise:
            return torch.einsum("mtoi,soi->smto", a, dw.to(a.dtype))
        return torch.einsum("mti,soi->smto", a, dw.to(a.dtype))


def find_layers(model: nn.Module, site_shapes: dict[str, torch.Size]) -> list[Layer]:
    """Group sample sites by the Linear/Conv2d module that owns them.

    Raises
    ------
    ValueError
        A site is not the weight or bias of a Linear or (ungrouped, zero-padded) Conv2d.
    """
    groups: dict[str, dict] = {}
    for site in site_shapes:
        module, pname = site_module(model, site)
        path = site.rpartition(".")[0]
        ok = (isinstance(module, (nn.Linear, *UNITWISE_MODULES))
              or (isinstance(module, nn.Conv2d) and module.groups == 1
                  and module.padding_mode == "zeros")) and pname in ("weight", "bias")
        if not ok and not isinstance(model, nn.Module):
            raise ValueError(
                f"Laplace needs the model's network to find the layer of site {site!r}: the model must "
                "be (or expose) its nn.Module — a pb.BNN or a PyroModule whose Linear/Conv2d layers hold "
                f"the weight sites — got a {type(model).__name__} (e.g. a poutine handler-wrapped "
                "function), whose layers cannot be reached. Pass the PyroModule itself")
        if not ok:
            raise ValueError(
                "Laplace curvature supports sites that are the weight or bias of nn.Linear / "
                "nn.Conv2d layers (groups=1, padding_mode='zeros') or the affine parameters of "
                f"BatchNorm / InstanceNorm / GroupNorm / LayerNorm layers; site {site!r} belongs to "
                f"{_layer_description(module)}")
        groups.setdefault(path, {"module": module})[pname] = site
    layers = []
    for path, g in groups.items():
        m = g["module"]
        if isinstance(m, UNITWISE_MODULES):          # γ_c multiplies one input, x̂_c
            out_f = m.num_channels if isinstance(m, nn.GroupNorm) else (
                math.prod(m.normalized_shape) if isinstance(m, nn.LayerNorm) else m.num_features)
            in_f = 1
        elif isinstance(m, nn.Conv2d):
            out_f, in_f = m.out_channels, m.in_channels * m.kernel_size[0] * m.kernel_size[1]
        else:
            out_f, in_f = m.out_features, m.in_features
        w, b = g.get("weight"), g.get("bias")
        layers.append(Layer(path, m, w, b, out_f, (in_f if w else 0) + (1 if b else 0)))
    return layers


def _layer_description(module: nn.Module | None) -> str:
    """The layer type, with what rules out a ``Conv2d`` (groups, padding mode)."""
    if module is None:
        return "no module"
    name = type(module).__name__
    if isinstance(module, nn.Conv2d):
        unsupported = [f"groups={module.groups}"] if module.groups != 1 else []
        unsupported += [f"padding_mode={module.padding_mode!r}"] if module.padding_mode != "zeros" else []
        return f"a {name} with {' and '.join(unsupported)}"
    return name


def capture_factors(layers: list[Layer], forward: Callable[[], torch.Tensor],
                    columns: Callable[[torch.Tensor], torch.Tensor], *,
                    num_augmentations: int = 1, create_graph: bool = False,
                    residual: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Run ``forward`` once; return ``f``, per-layer inputs ``ã`` and output gradients ``g``.

    Parameters
    ----------
    layers : list of Layer
    forward : callable
        ``forward() -> f`` of shape ``(M, C)``; runs the network (each layer once).  The
        weights must require grad (or the input must), so the outputs have a graph.
    columns : callable
        ``columns(f) -> L`` of shape ``(M, C, K)``: the vectors pulled back through the
        network (``L`` with ``Λ = L Lᵀ`` for the GGN; the identity for Jacobians).
    num_augmentations : int
        ``S``: the network saw ``M·S`` rows ordered example-major (row ``n·S + s``) and
        ``f`` averages over copies; then ``ã_n = mean_s ã_{n,s}`` and
        ``g_n = Σ_s g_{n,s}`` (the 1/S is already in ``g``).
    create_graph : bool
        Keep the graph of ``ã`` and ``g`` (to differentiate the curvature).
    residual : callable, optional
        ``residual(f) -> r`` of shape ``(M, C)``: a vector pulled back and contracted with the
        layer inputs of every row (all ``M·S`` copies, exactly), giving ``Σ_n J_nᵀ r_n`` per
        layer, e.g. the gradient of the negative log-likelihood for ``r = ∂(−log p)/∂f``.

    Returns
    -------
    f : Tensor, shape (M, C)
    a : dict path -> Tensor (M, T, in')
        Unit-wise layers (normalisation affine parameters): ``(M, T, C, in')``.
    g : dict path -> Tensor (K, M, T, out)
    grads : dict path -> Tensor (out, in')
        Only when ``residual`` is given: ``Σ_n J_nᵀ r_n`` in each layer's ``W̃`` layout.
    """
    inputs, outputs = {}, {}

    def make_hook(path):
        def hook(module, inp, out):
            if path in outputs:
                raise ValueError(f"layer {path!r} ran twice in one forward pass; curvature "
                                 "hooks support each layer being applied once")
            inputs[path], outputs[path] = inp[0], out
        return hook

    handles = [layer.module.register_forward_hook(make_hook(layer.path)) for layer in layers]
    try:
        f = forward()
    finally:
        for h in handles:
            h.remove()
    missing = [layer.path for layer in layers if layer.path not in outputs]
    if missing:
        raise ValueError(f"layers {missing} did not run in the forward pass")
    L = columns(f)
    if not create_graph:
        L = L.detach()
    outs = [outputs[layer.path] for layer in layers]
    S = int(num_augmentations)
    grads_out = None
    if residual is not None:
        r = residual(f).detach().reshape(f.shape)
        pulled = _pull_back_column(f, outs, r, False)
        # every row's own inputs (no averaging over copies): Σ_rows Σ_t e_t ã_tᵀ is exact
        grads_out = {layer.path: layer.summed_rows(layer.expand_inputs(inputs[layer.path].detach()),
                                                   layer.expand_grads(e[0]))
                     for layer, e in zip(layers, pulled)}

    def per_example(layer, gl):
        """``(K, M·S, *out)`` gradients → ``(K, M, T, out)``, summed over the copies.

        The sum runs on the contiguous layer-output layout, before :meth:`Layer.expand_grads`
        transposes a convolution's gradients (summing after it copied ``S`` times more)."""
        if S > 1:
            gl = gl.reshape(gl.shape[0], -1, S, *gl.shape[2:]).sum(2)
        return layer.expand_grads(gl.flatten(0, 1)).unflatten(0, gl.shape[:2])

    if create_graph or S > 1:
        # One backward per column, each reduced over the copies before the K columns are
        # joined: vmapping the double backward through the augmentation's grid_sample took
        # 2.1× the loop's time (one η evidence step, 16×16 rotated digits, MLP 256-256-10,
        # S = 16, CPU) and 3.4× on the LeNet CNN (512 rotated Fashion-MNIST images, S = 8),
        # and K columns of all M·S copies are S times the memory traffic.
        cols = [_pull_back_column(f, outs, L[..., k], create_graph) for k in range(L.shape[-1])]
        grads = [torch.cat([per_example(layer, c[i]) for c in cols]) for i, layer in enumerate(layers)]
    else:
        grads = [per_example(layer, gl) for layer, gl in zip(layers, _pull_back(f, outs, L, False))]
    a_out, g_out = {}, {}
    for layer, g in zip(layers, grads):
        x_in = inputs[layer.path] if create_graph else inputs[layer.path].detach()
        if S > 1 and layer.unitwise:
            # normalised first: in train mode the statistics are those of all M·S rows
            a = layer.expand_inputs(x_in)
            a_out[layer.path] = a.reshape(-1, S, *a.shape[1:]).mean(1)
        elif S > 1:
            # ã is linear in the layer input (unfolded patches, a constant 1 for the bias),
            # so averaging the inputs over the copies before unfolding gives the same ã with
            # S times less memory (and, with a graph, an S times smaller unfold backward).
            a_out[layer.path] = layer.expand_inputs(x_in.reshape(-1, S, *x_in.shape[1:]).mean(1))
        else:
            a_out[layer.path] = layer.expand_inputs(x_in)
        g_out[layer.path] = g
    if not create_graph:
        f = f.detach()
    if grads_out is not None:
        return f, a_out, g_out, grads_out
    return f, a_out, g_out


def _pull_back(f, outs, L, create_graph):
    """``[Σ_c L[:, c, k] ∂f_c/∂out]_k`` for every layer output, stacked: ``(K, *out.shape)``.

    One vmapped backward pass (``is_grads_batched``); falls back to a loop over ``k`` where
    vmap is not supported.
    """
    K = L.shape[-1]
    try:
        gs = torch.autograd.grad(f, outs, grad_outputs=L.movedim(-1, 0), retain_graph=True,
                                 create_graph=create_graph, allow_unused=True, is_grads_batched=True)
        return [torch.zeros(K, *o.shape, dtype=o.dtype, device=o.device) if g is None else g
                for g, o in zip(gs, outs)]
    except RuntimeError:
        return _pull_back_loop(f, outs, L, create_graph)


def _pull_back_loop(f, outs, L, create_graph):
    """:func:`_pull_back` as a loop over the ``K`` columns (one backward pass each)."""
    cols = [_pull_back_column(f, outs, L[..., k], create_graph) for k in range(L.shape[-1])]
    return [torch.cat([c[i] for c in cols]) for i in range(len(outs))]


def _pull_back_column(f, outs, column, create_graph):
    """``[Σ_c column[:, c] ∂f_c/∂out]`` for every layer output, each of shape ``(1, *out.shape)``
    (one backward pass; a view of autograd's result, not a copy)."""
    gs = torch.autograd.grad(f, outs, grad_outputs=column, retain_graph=True,
                             create_graph=create_graph, allow_unused=True)
    return [(torch.zeros_like(o) if g is None else g).unsqueeze(0) for g, o in zip(gs, outs)]
