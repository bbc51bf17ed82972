"""Laplace-KFAC log evidence of an invariant model and its gradient in ``η`` by minibatches.

Per layer ``l`` the posterior precision is ``P_l = G_l ⊗ A_l / (N T_l) + δ_l I`` and::

    log p(D | δ, η) ≈ Σ_n log p(y_n | f̂_n) − ½ Σ_l [δ_l ‖θ_l‖² + log det P_l − p_l log δ_l]

with ``log det P_l = Σ_ij log(λ^G_i λ^A_j / (N T_l) + δ_l)`` from the factors' eigenvalues.

The ``η``-gradient of ``log det P_l`` is ``tr(P_l⁻¹ ∂H_l/∂η)``.  ``H_l`` is a product of
sums over the data, so by the product rule
``∂H_l = Σ_b (G_l ⊗ ∂A_b + ∂G_b ⊗ A_l) / (N T_l)`` over minibatches ``b``.  In the eigenbasis
of ``P_l`` only diagonals matter::

    tr(P_l⁻¹ (G ⊗ X)) = Σ_ij λ^G_i (Q_Aᵀ X Q_A)_jj / (λ^G_i λ^A_j s + δ_l)

so :func:`batch_surrogate` rebuilds one batch's factors with autograd on, and its
gradient — ``∂ log p(y_b | f̂) − ½ tr(P⁻¹ ∂H_b)`` — summed over batches is exactly the
gradient of the full-data evidence (for fixed ``θ``), with memory of one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..likelihoods import log_likelihood
from .kfac import LayerFactors, invariant_kfac_factors

__all__ = ["KronEigen", "eigen_factors", "log_det_posterior", "log_evidence", "batch_surrogate",
           "accumulate_factors"]


@dataclass
class KronEigen:
    """Eigen form of one layer's Kronecker curvature ``G ⊗ A · scale``.

    Attributes
    ----------
    qa, la : Tensor (D_A, D_A), (D_A,)
        Eigenvectors and eigenvalues of ``A``.
    qg, lg : Tensor (D_G, D_G), (D_G,)
        Eigenvectors and eigenvalues of ``G``.
    scale : float
        ``1 / (N T)``.
    """

    qa: torch.Tensor
    la: torch.Tensor
    qg: torch.Tensor
    lg: torch.Tensor
    scale: float

    def eigenvalues(self) -> torch.Tensor:
        """Eigenvalues of ``G ⊗ A · scale``, shape ``(D_G, D_A)``."""
        return self.lg[:, None] * self.la[None, :] * self.scale


def accumulate_factors(model, values: dict, batches, *, seeds=None) -> list[LayerFactors]:
    """Sum :func:`invariant_kfac_factors` over ``batches`` (iterable of ``(x, y)``), no graph."""
    total: list[LayerFactors] | None = None
    for i, (x, _) in enumerate(batches):
        with _seeded(None if seeds is None else seeds[i], x.device):
            facs, _ = invariant_kfac_factors(model, values, x)
        if total is None:
            total = facs
        else:
            for t, f in zip(total, facs):
                t.A = t.A + f.A
                t.G = t.G + f.G
    if total is None:
        raise ValueError("no batches given")
    return total


def eigen_factors(factors: list[LayerFactors], num_data: int) -> list[KronEigen]:
    """Symmetric eigendecompositions of every layer's factors (eigenvalues clamped at 0)."""
    out = []
    for fac in factors:
        la, qa = torch.linalg.eigh(fac.A.detach())
        lg, qg = torch.linalg.eigh(fac.G.detach())
        out.append(KronEigen(qa, la.clamp_min(0), qg, lg.clamp_min(0),
                             1.0 / (num_data * fac.positions)))
    return out


def log_det_posterior(eig: list[KronEigen], prior_precision: torch.Tensor) -> torch.Tensor:
    """``Σ_l log det P_l`` with ``P_l = H_l + δ_l I``; ``prior_precision``: (L,) (differentiable)."""
    return sum(torch.log(e.eigenvalues() + d).sum() for e, d in zip(eig, prior_precision))


def log_evidence(log_lik: torch.Tensor, values: dict, factors: list[LayerFactors],
                 eig: list[KronEigen], prior_precision: torch.Tensor) -> torch.Tensor:
    """Laplace-KFAC log marginal likelihood (module docstring); differentiable in ``δ``.

    Parameters
    ----------
    log_lik : Tensor, scalar
        ``Σ_n log p(y_n | f̂_n)`` at the MAP.
    values : dict
        MAP weights ``{site: tensor}``.
    factors, eig : per-layer factors and their eigen forms (same order).
    prior_precision : Tensor, shape (L,)
        ``δ_l`` per layer.
    """
    total = log_lik
    for fac, e, d in zip(factors, eig, prior_precision):
        sq = values[fac.weight].detach().pow(2).sum()
        if fac.bias is not None:
            sq = sq + values[fac.bias].detach().pow(2).sum()
        p = fac.num_params
        total = total - 0.5 * (d * sq + torch.log(e.eigenvalues() + d).sum() - p * torch.log(d))
    return total


def batch_surrogate(model, values: dict, x: torch.Tensor, y: torch.Tensor,
                    factors: list[LayerFactors], eig: list[KronEigen],
                    prior_precision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's share of the evidence, whose ``η``-gradient is that batch's share of ``∂ log p(D)``.

    Returns ``(log p(y_b | f̂(x_b)) − ½ Σ_l tr(P_l⁻¹ H_l^{(b)}), log p(y_b | f̂))`` where
    ``H^{(b)} = (G ⊗ A_b + G_b ⊗ A) s`` with the full-data ``A, G`` held fixed and the
    batch's ``A_b, G_b`` rebuilt with autograd on (the product rule of ``∂(G ⊗ A)``).
    The value of the trace term is not the evidence; only its gradient is meaningful.
    """
    batch, f = invariant_kfac_factors(model, values, x, create_graph=True)
    ll = log_likelihood(model.likelihood, f, y).sum()
    trace = 0.0
    for fb, e, d in zip(batch, eig, prior_precision.detach()):
        w = 1.0 / (e.eigenvalues() + d)                         # (D_G, D_A): diag of P⁻¹
        da = (e.qa * (fb.A @ e.qa)).sum(0)                       # diag(Q_Aᵀ A_b Q_A)
        dg = (e.qg * (fb.G @ e.qg)).sum(0)
        trace = trace + e.scale * (e.lg @ w @ da + dg @ w @ e.la)
    return ll - 0.5 * trace, ll.detach()


class _seeded:
    """Replay the same augmentation draws: fork the RNG and seed it (``None``: no-op)."""

    def __init__(self, seed, device):
        self.seed, self.device = seed, torch.device(device)
        self._fork = None

    def __enter__(self):
        if self.seed is None:
            return self
        devices = [self.device] if self.device.type == "cuda" else []
        self._fork = torch.random.fork_rng(devices=devices)
        self._fork.__enter__()
        torch.manual_seed(int(self.seed))
        return self

    def __exit__(self, *exc):
        if self._fork is not None:
            self._fork.__exit__(*exc)
        return False
