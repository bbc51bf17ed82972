"""KFAC for invariant models: augmentation-averaged Kronecker factors (LILA, §4 of METHODS).

For ``f̂(x) = (1/S) Σ_s f(T_s x)`` the Jacobian of a Linear/Conv2d layer is a sum over
the ``S`` copies.  One Kronecker product approximates it with averaged factors::

    ā_{n,t} = mean_s a_{n,s,t}          (layer inputs, bias as an extra 1; t: conv positions)
    ē_{n,t,c} = Σ_s e_{n,s,t,c}         (output gradients of L_cᵀ f̂_n, which carry the 1/S)
    A = Σ_{n,t} ā ā ᵀ,   G = Σ_{n,t,c} ē_c ē_cᵀ,   H_l ≈ G ⊗ A / (N·T)

with ``Λ_n = L_n L_nᵀ`` the likelihood Hessian in ``f`` (softmax: ``L = diag(√p) − p √pᵀ``,
exact ``C``-column factorisation).  For ``S = 1`` (or ``η = 0``) these are the ordinary KFAC
factors; for a one-layer model with a Gaussian likelihood ``G ⊗ A / N`` is the exact GGN
of ``f̂`` (tested).  Parameters are ordered ``vec([W, b])`` row-major (output-major), so
the Kronecker product is ``G ⊗ A``.

Everything is computed from forward hooks and ``torch.autograd.grad`` on the layer
outputs — no per-example Jacobians.  With ``create_graph=True`` the factors are
differentiable in the augmentation extents ``η`` (needed for the evidence gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerFactors", "kfac_layers", "likelihood_hessian_factor", "invariant_kfac_factors"]


@dataclass
class LayerFactors:
    """Kronecker factors of one layer summed over a batch.

    Attributes
    ----------
    weight, bias : str, str or None
        Site names of the layer's weight and bias.
    A : Tensor, shape (D_in + has_bias, D_in + has_bias)
        ``Σ_{n,t} ā ā ᵀ`` (input factor).
    G : Tensor, shape (D_out, D_out)
        ``Σ_{n,t,c} ē ēᵀ`` (output-gradient factor).
    positions : int
        ``T``: spatial positions per example (1 for Linear).
    """

    weight: str
    bias: str | None
    A: torch.Tensor
    G: torch.Tensor
    positions: int

    @property
    def num_params(self) -> int:
        return self.A.shape[0] * self.G.shape[0]


def kfac_layers(model) -> list[tuple[str, nn.Module, str, str | None]]:
    """``(path, module, weight_site, bias_site)`` of every Linear/Conv2d layer with random weights.

    Raises
    ------
    ValueError
        If the model has random sites KFAC does not cover (other layer types).
    """
    sites = set(model.site_names)
    out, covered = [], set()
    for path, module in model.net.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        w = f"net.{path}.weight" if path else "net.weight"
        b = f"net.{path}.bias" if path else "net.bias"
        if w not in sites:
            continue
        if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"):
            raise ValueError(f"KFAC supports Conv2d with groups=1 and zero padding; layer {path!r} "
                             f"has groups={module.groups}, padding_mode={module.padding_mode!r}")
        out.append((path, module, w, b if b in sites else None))
        covered |= {w, b}
    missing = sites - covered
    if missing:
        raise ValueError(f"KFAC covers the weights of Linear and Conv2d layers; the model also has "
                         f"random sites {sorted(missing)}")
    return out


def likelihood_hessian_factor(likelihood, f: torch.Tensor) -> torch.Tensor:
    """``L`` with ``L Lᵀ = Λ = −∇²_f log p(y | f)``, shape ``(N, C, C)`` (exact, C columns).

    Categorical: ``diag(√p) − p √pᵀ``; Gaussian: ``I/σ``; Bernoulli: ``√(p(1 − p))``.
    """
    name = getattr(likelihood, "name", None)
    n, c = f.shape[0], f.shape[-1]
    if name == "categorical":
        p = torch.softmax(f, -1)
        s = p.clamp_min(1e-30).sqrt()
        return torch.diag_embed(s) - p.unsqueeze(-1) * s.unsqueeze(-2)
    if name == "gaussian":
        eye = torch.eye(c, dtype=f.dtype, device=f.device).expand(n, c, c)
        return eye / likelihood.noise.to(device=f.device, dtype=f.dtype)
    if name == "bernoulli":
        p = torch.sigmoid(f)
        return torch.diag_embed((p * (1 - p)).sqrt())
    raise ValueError(f"KFAC needs a categorical, gaussian or bernoulli likelihood, got {name!r}")


def _layer_input_rows(module: nn.Module, a: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """Inputs as rows ``(B, T, D)`` (conv: unfolded patches), with a column of ones for the bias."""
    if isinstance(module, nn.Conv2d):
        rows = F.unfold(a, module.kernel_size, dilation=module.dilation,
                        padding=module.padding, stride=module.stride).transpose(1, 2)
    else:
        rows = a.reshape(a.shape[0], -1, a.shape[-1])
    if has_bias:
        rows = torch.cat([rows, torch.ones_like(rows[..., :1])], -1)
    return rows


def _output_rows(module: nn.Module, e: torch.Tensor) -> torch.Tensor:
    if isinstance(module, nn.Conv2d):
        return e.flatten(2).transpose(1, 2)          # (B, T, O)
    return e.reshape(e.shape[0], -1, e.shape[-1])


def invariant_kfac_factors(model, values: dict, x: torch.Tensor, *,
                           create_graph: bool = False) -> tuple[list[LayerFactors], torch.Tensor]:
    """Augmentation-averaged KFAC factors of one batch, and ``f̂(x)``.

    Parameters
    ----------
    model : pyro_bnn.BNN
        With or without ``augmentation`` (without: ``S = 1``, ordinary KFAC).
    values : dict
        ``{site: tensor}`` weights (the MAP).
    x : Tensor, shape (M, ...)
    create_graph : bool
        Keep the graph so the factors (and ``f̂``) are differentiable in ``η``.

    Returns
    -------
    factors : list of LayerFactors
        Sums over the batch (not normalised).
    f : Tensor, shape (M, C)
        ``f̂(x)`` of the same forward pass (same augmentation draws).
    """
    layers = kfac_layers(model)
    # The layer outputs need a graph to take gradients in: weights become leaves if needed.
    values = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in values.items()}
    aug = model._modules.get("augmentation")
    s = 1 if aug is None else int(aug.num_samples)
    m = len(x)
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for path, module, _, _ in layers:
        def hook(mod, inp, out, path=path):
            inputs[path] = inp[0]
            outputs[path] = out
        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.enable_grad():
            f = model.run_with(values, x)
    finally:
        for h in hooks:
            h.remove()
    lam = likelihood_hessian_factor(model.likelihood, f if create_graph else f.detach())
    outs = [outputs[path] for path, *_ in layers]
    grads_per_col = []
    for c in range(lam.shape[-1]):
        g = torch.autograd.grad(f, outs, grad_outputs=lam[:, :, c], retain_graph=True,
                                create_graph=create_graph)
        grads_per_col.append(g)
    factors = []
    for i, (path, module, w, b) in enumerate(layers):
        a = inputs[path] if create_graph else inputs[path].detach()
        rows = _layer_input_rows(module, a, b is not None)              # (M·S, T, D)
        abar = rows.reshape(m, s, *rows.shape[1:]).mean(1)              # (M, T, D)
        t = abar.shape[1]
        abar = abar.reshape(-1, abar.shape[-1])
        big_a = abar.T @ abar
        big_g = 0.0
        for g in grads_per_col:
            e = _output_rows(module, g[i])                              # (M·S, T, O)
            ebar = e.reshape(m, s, *e.shape[1:]).sum(1).reshape(-1, e.shape[-1])
            big_g = big_g + ebar.T @ ebar
        factors.append(LayerFactors(w, b, big_a, big_g, t))
    if not create_graph:
        f = f.detach()
    return factors, f
