"""KFAC: Kronecker-factored GGN from forward/backward hooks (Martens & Grosse 2015).

Per layer, with layer inputs ``ã`` and the pulled-back factor columns
``g_{n,k} = J_{s,n}ᵀ L_n[:, k]`` (``Λ_n = L_n L_nᵀ``, exact with C columns):

    A = Σ_{n,t} ã_{n,t} ã_{n,t}ᵀ,    G = Σ_{n,k,t} g_{n,k,t} g_{n,k,t}ᵀ,
    H_l ≈ G/N' ⊗ A       (N' = N·T: examples times output positions).

This is exact for a single Linear layer whenever ``Λ_n`` does not depend on ``n``
(Gaussian regression) or for one example.  Computation is split so other code can hook in:

* :func:`batch_kfac_factors` — one batch's factor *sums*; pure, and differentiable when
  ``create_graph=True`` (e.g. to backpropagate ``½⟨H_b, P⁻¹⟩`` into augmentation
  parameters).  ``num_augmentations`` averages factors over augmented copies.
* :func:`kfac_blocks` — the single point where the summed factors become
  :class:`~pyro_bnn.curvature.structures.KronBlock`\\ s (after any all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers import Layer, capture_factors
from .network import hessian_columns
from .structures import KronBlock, SplitBiasKronBlock

__all__ = ["batch_kfac_factors", "kfac_sums_from_factors", "kfac_blocks"]


def kfac_sums_from_factors(a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"A": Σ ã ãᵀ, "G": Σ g gᵀ, "count": M·T}`` from ``ã`` (M,T,in') and ``g`` (K,M,T,out)."""
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
        Return factors with autograd graph.

    Returns
    -------
    f : Tensor, shape (M, C)
    sums : dict path -> {"A": (in', in'), "G": (out, out), "count": 0-d}
    """
    f, a, g = capture_factors(layers, forward, lambda out: hessian_columns(kind, out),
                              num_augmentations=num_augmentations, create_graph=create_graph)
    return f, {layer.path: kfac_sums_from_factors(a[layer.path], g[layer.path]) for layer in layers}


def kfac_blocks(layers: list[Layer], sums: dict, split_bias: bool = False) -> list:
    """Turn summed factors into blocks: ``H_l = (G/N') ⊗ A``.

    ``split_bias=True`` drops the weight-bias cross terms of ``A`` (the bias gets its own
    block ``G/N' · Σ 1``, as in laplace-torch) for layers that have a bias site.
    """
    blocks = []
    for layer in layers:
        A, G = sums[layer.path]["A"], sums[layer.path]["G"] / sums[layer.path]["count"]
        use_split = split_bias and layer.bias is not None and layer.weight is not None
        blocks.append(SplitBiasKronBlock(A, G) if use_split else KronBlock(A, G))
    return blocks
