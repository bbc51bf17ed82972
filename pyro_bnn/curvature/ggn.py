"""Diagonal and full generalised Gauss-Newton ``H = Σ_n J_nᵀ Λ_n J_n`` from layer factors.

Per example and factor column ``k`` the gradient of ``L_n[:, k]ᵀ f_n`` w.r.t. ``W̃`` is
``Σ_t g_{n,k,t} ã_{n,t}ᵀ`` (see :mod:`pyro_bnn.curvature.layers`), so

* ``diag(H) = Σ_{n,k} (Σ_t g_{n,k,t} ã_{n,t}ᵀ)²`` — for ``T = 1`` simply
  ``Σ_{n,k} g² (ã²)ᵀ`` without forming the per-example gradients;
* ``H = Σ_{n,k} v_{n,k} v_{n,k}ᵀ`` with ``v`` the per-example gradients concatenated over
  layers (``P × P``: small networks only — it is the test oracle for KFAC and diag).
"""

from __future__ import annotations

import torch

from .layers import Layer
from .structures import DenseBlock, DiagBlock

__all__ = ["diag_ggn_sums", "per_example_gradients", "full_ggn_sum", "diag_blocks", "full_block"]


def diag_ggn_sums(a: torch.Tensor, g: torch.Tensor, layer: Layer | None = None) -> torch.Tensor:
    """``Σ_{n,k} (Σ_t g ã ᵀ)²`` of shape ``(out, in')`` from ``ã`` (M,T,in'), ``g`` (K,M,T,out);
    a unit-wise ``layer`` (``ã`` of shape ``(M, T, out, in')``) through its per-example rows."""
    if layer is not None and layer.unitwise:
        return (layer.per_example(a, g) ** 2).sum((0, 1))
    if a.shape[1] == 1:
        return torch.einsum("kmo,mi->oi", g[:, :, 0] ** 2, a[:, 0] ** 2)
    total = a.new_zeros(g.shape[-1], a.shape[-1])
    for gk in g:                                             # bounds memory by one column
        total += (torch.einsum("mto,mti->moi", gk, a) ** 2).sum(0)
    return total


def per_example_gradients(layers: list[Layer], a: dict, g: dict) -> torch.Tensor:
    """Per-example, per-column gradients over all layers, shape ``(K, M, P)``."""
    parts = [layer.per_example(a[layer.path], g[layer.path]).flatten(2) for layer in layers]
    return torch.cat(parts, -1)


def full_ggn_sum(layers: list[Layer], a: dict, g: dict) -> torch.Tensor:
    """``Σ_{n,k} v vᵀ`` (shape ``(P, P)``) for one batch."""
    v = per_example_gradients(layers, a, g).flatten(0, 1)
    return v.T @ v


def diag_blocks(layers: list[Layer], sums: dict) -> list[DiagBlock]:
    """One :class:`DiagBlock` per layer from the summed ``"diag"`` entries."""
    return [DiagBlock(sums[layer.path]["diag"]) for layer in layers]


def full_block(sums: dict) -> list[DenseBlock]:
    return [DenseBlock(sums["full"])]
