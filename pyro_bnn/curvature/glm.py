"""Linearised (GLM) predictive, streamed over input batches.

Linearising ``f`` at ``θ*``: ``f_lin(x; θ) = f(x; θ*) + J(x)(θ − θ*)``, so under
``θ ~ N(θ*, P⁻¹)`` the function is Gaussian with covariance ``Σ_f(x) = J P⁻¹ Jᵀ``
(``C × C`` per input).  ``J`` is never formed for all parameters: per batch the layer
factors ``ã, g`` (``g`` against the identity: one backward pass per output) give
``Σ_f`` from the Kronecker or diagonal blocks directly, and ``J Δθ`` for given weight
offsets; only the dense structure builds the batch's ``(C, M, P)`` Jacobian.  Memory is
one batch's factors.

Classification uses the probit approximation (MacKay 1992):
``p(y|x) ≈ softmax(f / √(1 + π/8 · diag Σ_f))`` (sigmoid for Bernoulli), or Monte Carlo
over ``f ~ N(f*, Σ_f)`` (``link_approx="mc"``).  Regression: ``y ~ N(f*, Σ_f + σ² I)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..data.batches import as_targets, check_targets
from ..model.likelihoods import inverse_link
from .ggn import per_example_gradients
from .layers import Layer, capture_factors
from .masks import flat_mask, masked_layer_variances
from .network import identity_columns
from .structures import DenseBlock

__all__ = ["JacobianFactors", "jacobian_factors", "batch_covariance", "batch_covariances", "functional_covariance",
           "linearized_offsets", "probit_probs", "glm_predictive", "glm_log_predictive",
           "pointwise_log_likelihood", "sample_observations", "checked_targets"]


@dataclass
class JacobianFactors:
    """One batch's ``f(x; θ*)`` (``(M, C)``) and Jacobian factors.

    ``a[path]`` ``(M, T, in')`` and ``g[path]`` ``(C, M, T, out)`` per layer (see
    :func:`~pyro_bnn.curvature.layers.capture_factors`); ``J`` ``(C, M, P)`` over all
    layers when a dense block needs it, else ``None``.
    """

    f: torch.Tensor
    a: dict
    g: dict
    J: torch.Tensor | None = None


def _is_dense(blocks) -> bool:
    return len(blocks) == 1 and isinstance(blocks[0], DenseBlock)


def jacobian_factors(layers: list[Layer], run: Callable, x: torch.Tensor, batch_size: int = 256,
                     num_augmentations: int = 1, dense: bool = False) -> Iterator[JacobianFactors]:
    """Yield :class:`JacobianFactors` for consecutive batches of ``x`` (one backward pass
    per output per batch); ``dense=True`` adds the per-example Jacobian ``J``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    with torch.enable_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start:start + batch_size]
            f, a, g = capture_factors(layers, lambda xb=xb: run(xb), identity_columns,
                                      num_augmentations=num_augmentations)
            J = per_example_gradients(layers, a, g) if dense else None
            yield JacobianFactors(f.reshape(len(xb), -1).detach(), a, g, J)


def batch_covariance(layers: list[Layer], blocks: list, deltas: list, scale,
                     factors: JacobianFactors, masks: list | None = None) -> torch.Tensor:
    """``Σ_f = J P⁻¹ Jᵀ`` of one batch, shape ``(M, C, C)``; with ``masks`` (per layer a 0/1
    mask in the ``W̃`` layout or ``None``, :func:`~pyro_bnn.curvature.masks.layer_masks`) that of
    the pruned network, ``(J M) P⁻¹ (J M)ᵀ`` (:mod:`~pyro_bnn.curvature.masks`)."""
    return batch_covariances(layers, blocks, [deltas], scale, factors, masks)[0]


def batch_covariances(layers: list[Layer], blocks: list, candidates: list, scale,
                      factors: JacobianFactors, masks: list | None = None) -> torch.Tensor:
    """:func:`batch_covariance` at several prior precisions, shape ``(K, M, C, C)``.

    Parameters
    ----------
    layers, blocks, scale, factors, masks
        As for :func:`batch_covariance`.
    candidates : list
        ``K`` lists of per-block prior precisions (each as ``deltas`` of :func:`batch_covariance`).

    Notes
    -----
    The δ-independent work is done once per layer for all candidates: an unmasked layer's
    factors rotated into its eigenbasis and a convolution's per-example ``J``
    (``functional_variances`` of the blocks: up to ``PER_DELTA_PRODUCTS`` candidates bit for
    bit the results of :func:`batch_covariance`, with more equal up to rounding); a masked
    layer's rotated Jacobian (:func:`~pyro_bnn.curvature.masks.masked_layer_variances`), equal
    to the one-δ results up to rounding.  The dense structure takes each candidate in turn.
    """
    masks = masks if masks is not None else [None] * len(layers)
    if _is_dense(blocks):
        J = factors.J if factors.J is not None else per_example_gradients(layers, factors.a, factors.g)
        if any(m is not None for m in masks):
            J = J * flat_mask(layers, masks, J)
        return torch.stack([blocks[0].functional_variance_dense(J, deltas[0], scale)
                            for deltas in candidates]).detach()
    total = None
    for i, (layer, block, mask) in enumerate(zip(layers, blocks, masks)):
        a, g, deltas = factors.a[layer.path], factors.g[layer.path], [c[i] for c in candidates]
        if mask is not None:
            part = masked_layer_variances(layer, block, a, g, mask, deltas, scale)
        elif layer.unitwise:
            J = layer.per_example(a, g)
            part = torch.stack([block.functional_variance_rows(J, d, scale) for d in deltas])
        else:
            part = block.functional_variances(a, g, deltas, scale)
        total = part if total is None else total + part
    return total.detach()


def functional_covariance(layers: list[Layer], blocks: list, deltas: list, scale, run: Callable,
                          x: torch.Tensor, batch_size: int = 256, num_augmentations: int = 1,
                          masks: list | None = None):
    """``f(x; θ*)`` (``(N, C)``) and ``Σ_f = J P⁻¹ Jᵀ`` (``(N, C, C)``), batch by batch
    (``masks``: as for :func:`batch_covariance`)."""
    means, covs = [], []
    for fac in jacobian_factors(layers, run, x, batch_size, num_augmentations, _is_dense(blocks)):
        means.append(fac.f)
        covs.append(batch_covariance(layers, blocks, deltas, scale, fac, masks))
    return torch.cat(means), torch.cat(covs)


#: Floats of one layer's ``ΔW̃ ã_t`` block ``(draws, M, T, out)`` in :func:`linearized_offsets`
#: (64 MiB in float32); more draws than fit are taken in turns.
OFFSET_BLOCK_VALUES = 2 ** 24


def linearized_offsets(layers: list[Layer], factors: JacobianFactors, offsets: list[torch.Tensor], *,
                       max_values: int = OFFSET_BLOCK_VALUES) -> torch.Tensor:
    """``J (θ_s − θ*)`` for one batch, shape ``(S, M, C)``.

    Parameters
    ----------
    layers : list of Layer
    factors : JacobianFactors
    offsets : list of Tensor
        Per layer ``θ_s − θ*`` as ``(S, out, in')`` (``W̃`` layout).
    max_values : int
        At most this many floats in one layer's ``(draws, M, T, out)`` block: the draws are
        taken in turns of ``max(1, max_values // (M T out))``.

    Notes
    -----
    ``J_c Δθ = Σ_t g_{c,t}ᵀ ΔW̃ ã_t`` per layer: ``S`` matrix products with the layer
    inputs, no per-parameter Jacobian.  The block ``ΔW̃ ã_t`` holds ``S · M · T · out``
    floats: for a convolution ``T`` is its number of output positions, so all draws at once
    cost ``S ×`` the layer's activations for the batch (LeNet's first convolution, ``S`` = 200,
    ``M`` = 1,024: 2.8 GB, and ``pb.to_arviz`` peaked 5.8 GB above its start on 2,000 test
    images); in turns they cost ``max_values`` floats whatever ``S`` and ``M``.  A Linear
    layer (``T`` = 1) takes every draw in one turn.
    """
    max_values = int(max_values)
    if max_values < 1:
        raise ValueError(f"max_values must be >= 1, got {max_values}")
    total = 0.0
    for layer, dw in zip(layers, offsets):
        a, g = factors.a[layer.path], factors.g[layer.path]
        turn = max(1, max_values // max(1, g[0].numel()))              # g[0]: (M, T, out)
        parts = [torch.einsum("cmto,smto->smc", g, layer.output_offsets(a, dw[s:s + turn]))
                 for s in range(0, dw.shape[0], turn)]
        total = total + (parts[0] if len(parts) == 1 else torch.cat(parts))
    return total


def probit_probs(f: torch.Tensor, cov: torch.Tensor, kind: str) -> torch.Tensor:
    """Probit-approximated class probabilities from ``f`` (N, C) and ``Σ_f`` (N, C, C)."""
    kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
    if kind == "categorical":
        return torch.softmax(kappa * f, -1)
    return torch.sigmoid(kappa * f)


def _function_draws(f, cov, num_samples, generator):
    C = f.shape[-1]
    eye = torch.eye(C, dtype=f.dtype, device=f.device)
    size = torch.diagonal(cov, dim1=-2, dim2=-1).amax(-1)[:, None, None]
    L, info = torch.linalg.cholesky_ex(cov + 1e-8 * (1 + size) * eye)
    bad = info != 0
    if bool(bad.any()):   # float32 Σ_f = J P⁻¹ Jᵀ can be numerically indefinite: PSD square root
        sym = (0.5 * (cov[bad] + cov[bad].transpose(-1, -2))).double()
        lam, Q = torch.linalg.eigh(sym)
        L = L.clone()
        L[bad] = (Q * lam.clamp_min(0).sqrt().unsqueeze(-2)).to(L.dtype)
    eps = torch.randn(num_samples, *f.shape, dtype=f.dtype, device=f.device, generator=generator)
    return f + torch.einsum("ncd,snd->snc", L, eps)


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
    return inverse_link(kind, _function_draws(f, cov, num_samples, generator))


def pointwise_log_likelihood(kind: str, f: torch.Tensor, y: torch.Tensor,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
    """``log p(y_n | f_n)`` for ``f`` of shape ``(..., N, C)``, summed over output dims → ``(..., N)``.

    Categorical: ``log softmax(f)[y]``; Bernoulli: ``y log σ(f) + (1−y) log σ(−f)``;
    Gaussian: ``log N(y | f, σ² I)``.
    """
    y = checked_targets(kind, y, f)
    if kind == "categorical":
        idx = y.reshape(-1, 1).expand(*f.shape[:-1], 1) if f.dim() > 2 else y.reshape(-1, 1)
        return f.log_softmax(-1).gather(-1, idx).squeeze(-1)
    yy = y.reshape(f.shape[-2:]).to(f.dtype)
    if kind == "bernoulli":
        return -torch.nn.functional.binary_cross_entropy_with_logits(
            f, yy.expand_as(f), reduction="none").sum(-1)
    if kind == "gaussian":
        if noise is None:
            raise ValueError("a Gaussian log-likelihood needs the noise σ")
        return torch.distributions.Normal(f, noise).log_prob(yy).sum(-1)
    raise ValueError(f"unknown likelihood kind {kind!r}")


def checked_targets(kind: str, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``y`` checked against the likelihood ``kind`` and the output ``f`` (``(..., N, C)``):
    :func:`pyro_bnn.data.batches.check_targets`, the check of ``pb.fit`` (integer labels in
    ``[0, C)``, 0/1, finite values of the output's width).  Returns int64 labels
    (categorical), or ``(N, 1)`` for ``(N,)`` targets of a one-output network."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    one = f.reshape(-1, *f.shape[-2:])[0]                         # (N, C)
    y = as_targets(kind, y, one.shape[1:])
    if y.dim() == 0 or len(y) != len(one):
        raise ValueError(f"expected {len(one)} targets, one per input, got shape {tuple(y.shape)}")
    check_targets(kind, y, one[:0])
    return y


def sample_observations(kind: str, f: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One replicate ``y ~ p(y | f)`` per row of ``f`` (``(..., N, C)``): labels ``(..., N)``
    for a categorical likelihood, else values shaped like ``f``."""
    if kind == "categorical":
        return torch.distributions.Categorical(logits=f).sample()
    if kind == "bernoulli":
        return torch.distributions.Bernoulli(logits=f).sample()
    return torch.distributions.Normal(f, noise).sample()


def glm_log_predictive(f: torch.Tensor, cov: torch.Tensor, y: torch.Tensor, kind: str,
                       link_approx: str = "probit", num_samples: int = 100,
                       noise: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-point log predictive density ``log p(y_n | x_n, D)`` of the GLM, shape ``(N,)``.

    Classification: log of the probit probabilities (``link_approx="probit"``) or
    ``log mean_s p(y_n | f_s)`` over ``num_samples`` draws ``f_s ~ N(f*, Σ_f)``
    (``"mc"``).  Regression: ``log N(y_n | f*_n, Σ_f(x_n) + σ² I)`` in closed form.
    """
    if link_approx not in ("probit", "mc"):
        raise ValueError(f"link_approx must be 'probit' or 'mc', got {link_approx!r}")
    y = checked_targets(kind, y, f)
    if kind == "gaussian":
        if noise is None:
            raise ValueError("a Gaussian predictive needs the noise σ")
        C = f.shape[-1]
        total = cov + noise ** 2 * torch.eye(C, dtype=f.dtype, device=f.device)
        return torch.distributions.MultivariateNormal(f, total).log_prob(y.reshape(f.shape).to(f.dtype))
    if link_approx == "probit":
        p = probit_probs(f, cov, kind)
        if kind == "categorical":
            return p.clamp_min(torch.finfo(p.dtype).tiny).log().gather(-1, y.reshape(-1, 1)).squeeze(-1)
        yy = y.reshape(f.shape).to(f.dtype)
        tiny = torch.finfo(p.dtype).tiny
        return (yy * p.clamp_min(tiny).log() + (1 - yy) * (1 - p).clamp_min(tiny).log()).sum(-1)
    fs = _function_draws(f, cov, num_samples, generator)
    ll = pointwise_log_likelihood(kind, fs, y)                        # (S, N)
    return torch.logsumexp(ll, 0) - math.log(num_samples)
