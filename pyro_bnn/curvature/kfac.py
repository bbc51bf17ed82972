"""KFAC: Kronecker-factored GGN from forward/backward hooks (Martens & Grosse 2015).

Per layer, with layer inputs ``ã`` and the pulled-back factor columns
``g_{n,k} = J_{s,n}ᵀ L_n[:, k]`` (``Λ_n = L_n L_nᵀ``, exact with C columns):

    A = Σ_{n,t} ã_{n,t} ã_{n,t}ᵀ,    G = Σ_{n,k,t} g_{n,k,t} g_{n,k,t}ᵀ,
    H_l ≈ G/N' ⊗ A       (N' = N·T: examples times output positions).

This is exact for a single Linear layer whenever ``Λ_n`` does not depend on ``n``
(Gaussian regression) or for one example.  Computation is split so other code can hook in:

* :func:`batch_kfac_factors` — one batch's factor *sums*; pure, and differentiable when
  ``create_graph=True`` (invariance learning backpropagates
  :meth:`~pyro_bnn.curvature.structures.KronBlock.logdet_derivative` of a batch's factors
  into the augmentation extents η).  ``num_augmentations`` averages factors over augmented
  copies (the invariant models of :mod:`pyro_bnn.invariance`).
* :func:`kfac_blocks` — the single point where the summed factors become
  :class:`~pyro_bnn.curvature.structures.KronBlock`\\ s (after any all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers import Layer, capture_factors
from .network import hessian_columns
from .structures import KronBlock, SplitBiasKronBlock
from .unitwise import UnitBlock, unit_ggn_sums

__all__ = ["batch_kfac_factors", "kfac_sums_from_factors", "kfac_blocks",
           "differentiable_hessian_columns"]

#: Floor under ``p`` (resp. ``p(1 − p)``) before the square root of a differentiated column.
_SQRT_FLOOR = 1e-30


def differentiable_hessian_columns(kind: str, f: torch.Tensor) -> torch.Tensor:
    """:func:`~pyro_bnn.curvature.network.hessian_columns` whose gradient stays finite.

    ``√p`` has an infinite derivative where a softmax (sigmoid) probability underflows to
    0 (float32 logits about 100 apart), and ``∞ · 0`` makes the whole η-gradient NaN.  The
    argument of the square root is floored at 1e-30 (its effect on the value is below
    float32 resolution of the other entries).  Shape ``(M, C, C)``.
    """
    f2 = f.reshape(len(f), -1)
    if kind == "categorical":
        p = torch.softmax(f2, -1)
        s = p.clamp_min(_SQRT_FLOOR).sqrt()
        return torch.diag_embed(s) - p.unsqueeze(-1) * s.unsqueeze(-2)
    if kind == "bernoulli":
        p = torch.sigmoid(f2)
        return torch.diag_embed((p * (1 - p)).clamp_min(_SQRT_FLOOR).sqrt())
    return hessian_columns(kind, f)


def kfac_sums_from_factors(a: torch.Tensor, g: torch.Tensor, layer: Layer | None = None) -> dict[str, torch.Tensor]:
    """``{"A": Σ ã ãᵀ, "G": Σ g gᵀ, "count": M·T}`` from ``ã`` (M,T,in') and ``g`` (K,M,T,out).

    A unit-wise ``layer`` (BatchNorm's affine parameters) has no Kronecker factors: its
    entry is ``{"U": Σ v vᵀ}`` per unit (:func:`~pyro_bnn.curvature.unitwise.unit_ggn_sums`),
    the exact GGN of each channel's ``(γ_c, β_c)``."""
    if layer is not None and layer.unitwise:
        return {"U": unit_ggn_sums(layer.per_example(a, g))}
    a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    A, G = a2.T @ a2, g2.T @ g2
    count = torch.tensor(float(a.shape[0] * a.shape[1]), dtype=a.dtype, device=a.device)
    return {"A": A, "G": G, "count": count}


def batch_kfac_factors(layers: list[Layer], forward: Callable[[], torch.Tensor], kind: str, *,
                       num_augmentations: int = 1, create_graph: bool = False):
    """KFAC factor sums of one batch.

    Parameters
    ----------
    layers : list of Layer
        From :func:`~pyro_bnn.curvature.layers.find_layers`.
    forward : callable
        ``forward() -> f`` (shape ``(M, C)``) running the network once on the batch.
    kind : {"categorical", "bernoulli", "gaussian"}
        Likelihood; the Gaussian factors use ``Λ = I`` (scale by ``1/σ²`` afterwards).
    num_augmentations : int
        Copies per example averaged inside ``forward`` (see
        :func:`~pyro_bnn.curvature.layers.capture_factors`).
    create_graph : bool
        Return factors with autograd graph (the columns ``L`` are then differentiated too,
        with ``√p`` kept off 0: :func:`differentiable_hessian_columns`).

    Returns
    -------
    f : Tensor, shape (M, C)
    sums : dict path -> {"A": (in', in'), "G": (out, out), "count": 0-d}
    """
    unitwise = [layer.path for layer in layers if layer.unitwise]
    if unitwise:
        raise ValueError(f"differentiable KFAC factors (invariance learning) support Linear and Conv2d "
                         f"layers; {unitwise} are BatchNorm affine parameters, which have no Kronecker "
                         "factors: leave them out of the random sites")
    columns = differentiable_hessian_columns if create_graph else hessian_columns
    f, a, g = capture_factors(layers, forward, lambda out: columns(kind, out),
                              num_augmentations=num_augmentations, create_graph=create_graph)
    return f, {layer.path: kfac_sums_from_factors(a[layer.path], g[layer.path]) for layer in layers}


def kfac_blocks(layers: list[Layer], sums: dict, split_bias: bool = False) -> list:
    """Turn summed factors into blocks: ``H_l = (G/N') ⊗ A``.

    Unit-wise layers (BatchNorm's affine parameters) get a
    :class:`~pyro_bnn.curvature.unitwise.UnitBlock`.  ``split_bias=True`` drops the weight-bias cross terms of ``A`` (the bias gets its own
    block ``G/N' · Σ 1``, as in laplace-torch) for layers that have a bias site.
    """
    blocks = []
    for layer in layers:
        if layer.unitwise:
            blocks.append(UnitBlock(sums[layer.path]["U"]))
            continue
        A, G = sums[layer.path]["A"], sums[layer.path]["G"] / sums[layer.path]["count"]
        use_split = split_bias and layer.bias is not None and layer.weight is not None
        blocks.append(SplitBiasKronBlock(A, G) if use_split else KronBlock(A, G))
    return blocks
