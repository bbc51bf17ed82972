"""Unit-wise curvature block: one small dense block per output unit (BatchNorm's ``γ_c, β_c``).

A BatchNorm layer's output channel ``c`` is ``γ_c x̂_c + β_c``; its GGN couples ``γ_c`` and
``β_c`` of the same channel strongly and different channels only through the later layers.
The block keeps the exact ``in' × in'`` GGN of every channel (``in'`` = 2, or 1 when only one
of the affine parameters is random) and drops the cross-channel terms (the "unit-wise"
structure of K-FAC implementations for normalisation layers).  With ``C`` channels the
block has ``C·in'²`` numbers; everything is a batched Cholesky of ``C`` tiny matrices and
differentiable in ``δ`` and ``s``.
"""

from __future__ import annotations

import torch

from .structures import as_delta

__all__ = ["UnitBlock", "unit_ggn_sums"]


def unit_ggn_sums(J: torch.Tensor) -> torch.Tensor:
    """``Σ_{k,m} v vᵀ`` per unit from the per-example rows ``J`` of shape ``(K, M, C, in')``
    (:meth:`~pyro_bnn.curvature.layers.Layer.per_example`) → ``(C, in', in')``."""
    return torch.einsum("kmci,kmcj->cij", J, J)


class UnitBlock:
    """``H = blockdiag_c(U_c)`` with ``U`` of shape ``(C, in', in')``, in ``W̃ = [γ, β]`` order.

    Same interface as :class:`~pyro_bnn.curvature.structures.KronBlock`: ``logdet``,
    ``sample``, ``matvec``, ``solve``, ``covariance``, ``to_dense`` and the functional variance
    (here from per-example Jacobian rows, :meth:`functional_variance_rows`).  δ is a scalar
    or a ``(C·in',)`` vector in ``W̃`` order.
    """

    def __init__(self, U: torch.Tensor):
        self.U = 0.5 * (U + U.mT)
        self.shape = (U.shape[0], U.shape[1])
        self.numel = self.shape[0] * self.shape[1]

    def precision(self, delta, scale=1.0) -> torch.Tensor:
        """``P_c = s U_c + diag(δ_c)``, shape ``(C, in', in')``."""
        d = as_delta(delta, self.numel, self.U)
        d = d.expand(self.numel) if d.dim() == 0 else d
        return scale * self.U + torch.diag_embed(d.reshape(self.shape))

    def _chol(self, delta, scale):
        return torch.linalg.cholesky(self.precision(delta, scale))

    def logdet(self, delta, scale=1.0) -> torch.Tensor:
        return 2 * torch.log(torch.diagonal(self._chol(delta, scale), dim1=-2, dim2=-1)).sum()

    def sample(self, eps: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``(S, numel)`` normal ``eps`` → draws of ``N(0, P⁻¹)``: ``x_c = L_c⁻ᵀ ε_c``."""
        L = self._chol(delta, scale)                                         # (C, i, i)
        e = eps.reshape(len(eps), *self.shape).transpose(0, 1).unsqueeze(-1)  # (C, S, i, 1)
        x = torch.linalg.solve_triangular(L.mT.unsqueeze(1), e, upper=True)
        return x.squeeze(-1).transpose(0, 1).reshape(len(eps), -1)

    def to_dense(self, scale=1.0) -> torch.Tensor:
        return torch.block_diag(*(scale * self.U))

    def matvec(self, v: torch.Tensor, scale=1.0) -> torch.Tensor:
        """``s H v`` for a flat ``(numel,)`` vector."""
        return (scale * self.U @ v.reshape(*self.shape, 1)).reshape(-1)

    def solve(self, v: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``P⁻¹ v`` for a flat ``(numel,)`` vector."""
        return torch.cholesky_solve(v.reshape(*self.shape, 1), self._chol(delta, scale)).reshape(-1)

    def covariance(self, delta, scale=1.0) -> torch.Tensor:
        return torch.block_diag(*torch.cholesky_inverse(self._chol(delta, scale)))

    def functional_variance_rows(self, J: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``J P⁻¹ Jᵀ`` from per-example Jacobian rows ``J`` of shape ``(C_out, M, C, in')``
        → ``(M, C_out, C_out)``."""
        L = self._chol(delta, scale)                                          # (C, i, i)
        # V = J L⁻ᵀ per unit: J_c P_c⁻¹ J_cᵀ = (L_c⁻¹ J_cᵀ)ᵀ (L_c⁻¹ J_cᵀ)
        rows = J.permute(2, 3, 0, 1).reshape(self.shape[0], self.shape[1], -1)   # (C, i, C_out·M)
        V = torch.linalg.solve_triangular(L, rows, upper=False).reshape(*self.shape, *J.shape[:2])
        return torch.einsum("cikm,cilm->mkl", V, V)
