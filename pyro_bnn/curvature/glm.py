"""Linearised (GLM) predictive, streamed over input batches.

Linearising ``f`` at ``θ*``: ``f(x; θ) ≈ f(x; θ*) + J(x)(θ − θ*)``, so under
``θ ~ N(θ*, P⁻¹)`` the function is Gaussian with covariance ``Σ_f(x) = J P⁻¹ Jᵀ``
(``C × C`` per input).  ``J`` is never formed for all parameters: per batch the layer
factors ``ã, g`` (``g`` against the identity: one backward pass per output) give
``Σ_f`` from the Kronecker or diagonal blocks directly; only the dense structure builds
the batch's ``(C, M, P)`` Jacobian.  Memory is one batch's factors.

Classification uses the probit approximation (MacKay 1992):
``p(y|x) ≈ softmax(f / √(1 + π/8 · diag Σ_f))`` (sigmoid for Bernoulli).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .ggn import per_example_gradients
from .layers import Layer, capture_factors
from .network import identity_columns
from .structures import DenseBlock

__all__ = ["functional_covariance", "probit_probs", "glm_predictive"]


def functional_covariance(layers: list[Layer], blocks: list, deltas: list, scale, run: Callable,
                          x: torch.Tensor, batch_size: int = 256, num_augmentations: int = 1):
    """``f(x; θ*)`` (``(N, C)``) and ``Σ_f = J P⁻¹ Jᵀ`` (``(N, C, C)``), batch by batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    means, covs = [], []
    dense = len(blocks) == 1 and isinstance(blocks[0], DenseBlock)
    with torch.enable_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start:start + batch_size]
            f, a, g = capture_factors(layers, lambda xb=xb: run(xb), identity_columns,
                                      num_augmentations=num_augmentations)
            if dense:
                J = per_example_gradients(layers, a, g)
                cov = blocks[0].functional_variance_dense(J, deltas[0], scale)
            else:
                cov = sum(block.functional_variance(a[layer.path], g[layer.path], delta, scale)
                          for layer, block, delta in zip(layers, blocks, deltas))
            means.append(f.reshape(len(xb), -1).detach())
            covs.append(cov.detach())
    return torch.cat(means), torch.cat(covs)


def probit_probs(f: torch.Tensor, cov: torch.Tensor, kind: str) -> torch.Tensor:
    """Probit-approximated class probabilities from ``f`` (N, C) and ``Σ_f`` (N, C, C)."""
    kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
    if kind == "categorical":
        return torch.softmax(kappa * f, -1)
    return torch.sigmoid(kappa * f)


def glm_predictive(f: torch.Tensor, cov: torch.Tensor, kind: str, link_approx: str = "probit",
                   num_samples: int = 100, generator: torch.Generator | None = None) -> torch.Tensor:
    """Predictive from the function-space Gaussian.

    Returns
    -------
    Tensor
        Classification, ``link_approx="probit"``: ``(1, N, C)`` probabilities;
        ``"mc"``: ``(S, N, C)`` probabilities of function draws.  Regression: ``(S, N, D)``
        draws of ``f`` (the predictive means of ``pb.predict``'s contract).
    """
    if link_approx not in ("probit", "mc"):
        raise ValueError(f"link_approx must be 'probit' or 'mc', got {link_approx!r}")
    if kind != "gaussian" and link_approx == "probit":
        return probit_probs(f, cov, kind).unsqueeze(0)
    C = f.shape[-1]
    eye = torch.eye(C, dtype=f.dtype, device=f.device)
    size = torch.diagonal(cov, dim1=-2, dim2=-1).amax(-1)[:, None, None]
    L = torch.linalg.cholesky(cov + 1e-8 * (1 + size) * eye)
    eps = torch.randn(num_samples, *f.shape, dtype=f.dtype, device=f.device, generator=generator)
    fs = f + torch.einsum("ncd,snd->snc", L, eps)
    if kind == "categorical":
        return torch.softmax(fs, -1)
    if kind == "bernoulli":
        return torch.sigmoid(fs)
    return fs
