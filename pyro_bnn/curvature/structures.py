"""Posterior-precision blocks: small matrix types for ``P = s·H + diag(δ)``.

Each block covers the parameters of one layer (Kronecker, diagonal) or of all layers
(dense), flattened as the rows of ``W̃ = [W, b]`` (shape ``(out, in')``, row-major, see
:class:`pyro_bnn.curvature.layers.Layer`).  ``s`` is the likelihood's curvature scale
(``1/σ²`` for a Gaussian likelihood whose factors were computed with ``Λ = I``; 1
otherwise) and ``δ`` the prior precision, a 0-d tensor or a vector of the block's size.
Everything stays differentiable in ``δ`` and ``s`` (the eigendecompositions are computed
once, from ``H`` only).

Shared methods

``logdet(delta, scale)``
    ``log det(s H + δ)``.
``sample(eps, delta, scale)``
    Map standard normal ``eps`` (``(S, numel)``) to draws of ``N(0, P⁻¹)``.
``covariance(delta, scale)``
    Dense ``P⁻¹`` (tests and small nets only).
``matvec(v, scale)``, ``solve(v, delta, scale)``
    ``s H v`` and ``P⁻¹ v`` for a flat ``W̃``-order vector ``v`` (the linearised model's
    mode, :func:`pyro_bnn.curvature.marglik.linearized_evidence_terms`).
``functional_variance(...)``, ``functional_variances(...)``
    ``J P⁻¹ Jᵀ`` from per-layer Jacobian factors, without building ``J`` (Kron, Diag); the
    second at a list of δ, the δ-independent work done once (the validation grid search).
``logdet_derivative(dA, dG, delta, scale)`` (Kronecker blocks)
    ``tr(P⁻¹ s (dG ⊗ A + G ⊗ dA))``: the derivative of ``log det P`` along a change of the
    factors, differentiable in ``dA`` and ``dG`` (the η-gradient of invariance learning).
"""

from __future__ import annotations

import torch

__all__ = ["KronBlock", "SplitBiasKronBlock", "DiagBlock", "DenseBlock", "as_delta", "robust_eigh", "weighted_grams"]

#: Up to this many δ at once ``functional_variances`` weights the rotated Jacobians δ by δ, with the
#: operations of ``functional_variance`` (bit for bit its results); more go through :func:`weighted_grams`.
PER_DELTA_PRODUCTS = 4
#: Values of the pairs' products (:func:`weighted_grams`) formed at a time, to stay in cache.
DELTA_BLOCK_VALUES = 2 ** 18

#: Relative jitters (times the mean |diagonal|) tried, in float64, when ``eigh`` fails.
EIGH_JITTERS = (0.0, 1e-12, 1e-10, 1e-8, 1e-6, 1e-4)


def robust_eigh(M: torch.Tensor, what: str = "matrix") -> tuple[torch.Tensor, torch.Tensor]:
    """``M = Q diag(λ) Qᵀ`` for a symmetric (PSD) curvature factor, retried before giving up.

    ``torch.linalg.eigh`` can fail on a factor that is fine for our purposes: LAPACK stops
    with "failed to converge" on an ill-conditioned matrix, and a float32 factor with a huge
    dynamic range overflows inside the algorithm and comes back as NaN *without* an error.
    A long run should not die on that.  So: plain ``eigh`` first (the result is unchanged
    where it works); then, on an error or a non-finite result, ``eigh`` of the symmetrised
    matrix ``½(M + Mᵀ)`` in float64, with an increasing jitter ``ε·mean|diag M|·I``
    (``ε`` in :data:`EIGH_JITTERS`, starting at 0) whose shift is subtracted from the
    eigenvalues again; the result is cast back to ``M``'s dtype.

    Parameters
    ----------
    M : Tensor, shape (n, n)
        Symmetric matrix (only its lower triangle is read by the plain attempt).
    what : str
        How to name ``M`` in an error (e.g. ``"KFAC factor A (65×65) of layer 'net.0'"``).

    Returns
    -------
    (Tensor, Tensor)
        Eigenvalues ``(n,)`` in ascending order and eigenvectors ``(n, n)`` (columns).

    Raises
    ------
    ValueError
        ``M`` holds NaN/inf (no retry can fix that: the curvature pass itself went wrong).
    torch.linalg.LinAlgError
        Every attempt failed; the message names ``what`` and the matrix's condition.
    """
    try:
        lam, Q = torch.linalg.eigh(M)
        if bool(torch.isfinite(lam).all()) and bool(torch.isfinite(Q).all()):
            return lam, Q
    except torch.linalg.LinAlgError:
        pass
    if not bool(torch.isfinite(M).all()):
        bad = int((~torch.isfinite(M)).sum())
        raise ValueError(f"{what} has {bad} NaN/inf entries; its eigendecomposition cannot be "
                         "computed (the network or the data gave non-finite curvature)")
    M64 = 0.5 * (M + M.mT).to(torch.float64)
    eye = torch.eye(M.shape[-1], dtype=torch.float64, device=M.device)
    scale = float(M64.diagonal().abs().mean()) or float(M64.abs().max()) or 1.0
    for eps in EIGH_JITTERS:
        shift = eps * scale
        try:
            lam, Q = torch.linalg.eigh(M64 + shift * eye if shift else M64)
        except torch.linalg.LinAlgError:
            continue
        if bool(torch.isfinite(lam).all()) and bool(torch.isfinite(Q).all()):
            return (lam - shift).to(M.dtype), Q.to(M.dtype)
    raise torch.linalg.LinAlgError(
        f"eigendecomposition of {what} failed, also symmetrised, in float64 and with jitter up to "
        f"{EIGH_JITTERS[-1]:g}·mean|diag|; {_condition(M64)}")


def _condition(M64: torch.Tensor) -> str:
    """A description of how ill-conditioned ``M64`` is, for error messages."""
    diag = M64.diagonal()
    text = (f"diagonal in [{float(diag.min()):.3g}, {float(diag.max()):.3g}], "
            f"max |entry| {float(M64.abs().max()):.3g}")
    try:
        sv = torch.linalg.svdvals(M64)
        cond = float(sv[0] / sv[-1]) if float(sv[-1]) > 0 else float("inf")
        text += f", singular values in [{float(sv[-1]):.3g}, {float(sv[0]):.3g}] (condition number {cond:.3g})"
    except RuntimeError:
        pass
    return text


def as_delta(delta, numel: int, like: torch.Tensor, allow_vector: bool = True) -> torch.Tensor:
    """Validate a prior precision: a 0-d tensor or a vector of length ``numel``."""
    delta = torch.as_tensor(delta, dtype=like.dtype, device=like.device)
    if delta.dim() == 0:
        return delta
    if not allow_vector:
        raise ValueError("a Kronecker-factored block needs a scalar prior precision per layer; "
                         f"got a tensor of shape {tuple(delta.shape)} (use structure='diag' or "
                         "'full' for per-weight prior precisions)")
    if delta.shape != (numel,):
        raise ValueError(f"prior precision must be scalar or of shape ({numel},), got {tuple(delta.shape)}")
    return delta


class KronBlock:
    """``H = G ⊗ A`` for one layer, in eigen form ``(Q_G ⊗ Q_A) diag(λ_G ⊗ λ_A) (Q_G ⊗ Q_A)ᵀ``.

    With row-major flattening of ``W̃`` (shape ``(out, in')``), ``(G ⊗ A) vec(W̃) =
    vec(G W̃ A)``.  ``log det(sH + δI) = Σ_ij log(s λ^G_i λ^A_j + δ)``.  δ may also be a
    ``W̃``-order vector that is the same in every output row (one precision per input column,
    e.g. a weight's and its bias's own δ): then ``A`` is whitened by ``D^{-1/2}`` and
    eigendecomposed per call, still exact (no weight-bias cross term is dropped).

    Parameters
    ----------
    A : Tensor, shape (in', in')
        Input factor (already normalised so that ``H = G ⊗ A``).
    G : Tensor, shape (out, out)
        Output-gradient factor.
    name : str, optional
        The layer's name, for errors (see :func:`robust_eigh`).
    """

    def __init__(self, A: torch.Tensor, G: torch.Tensor, name: str | None = None):
        self.A, self.G = A, G
        layer = f" of layer {name!r}" if name else ""
        la, self.QA = robust_eigh(A, f"KFAC factor A ({A.shape[0]}×{A.shape[1]}){layer}")
        lg, self.QG = robust_eigh(G, f"KFAC factor G ({G.shape[0]}×{G.shape[1]}){layer}")
        self.lA, self.lG = la.clamp_min(0), lg.clamp_min(0)
        self.shape = (G.shape[0], A.shape[0])
        self.numel = self.shape[0] * self.shape[1]

    def eigenvalues(self, scale=1.0) -> torch.Tensor:
        """``s λ^G_i λ^A_j``, shape ``(out, in')``."""
        return scale * torch.outer(self.lG, self.lA)

    def _column_delta(self, delta):
        """``None`` for a scalar δ; else the ``(in',)`` column precisions ``d`` of a ``W̃``-order
        vector that is the same in every row (``δ = 1_out ⊗ d``: a weight's and its bias's
        own δ, or any per-input-column δ)."""
        d = as_delta(delta, self.numel, self.A)
        if d.dim() == 0:
            return None
        mat = d.reshape(self.shape)
        col = mat[0]
        if not bool((mat == col).all()):
            raise ValueError("a Kronecker-factored block takes a scalar prior precision or one per input "
                             "column (the same in every output row: e.g. one for the weight and one for "
                             "the bias); got a per-weight vector that varies across rows (use "
                             "structure='diag' or 'full' for per-weight prior precisions)")
        return col

    def _whitened(self, col):
        """``KronBlock(D^{-1/2} A D^{-1/2}, G)`` for ``D = diag(col)``: with it
        ``P = s G⊗A + I⊗D = (I⊗D^{1/2}) (s G⊗Ã + I) (I⊗D^{1/2})`` exactly."""
        r = col.rsqrt()
        return KronBlock(self.A * r[:, None] * r[None, :], self.G)

    def _dinv(self, delta, scale):
        return 1.0 / (self.eigenvalues(scale) + as_delta(delta, self.numel, self.A))

    def logdet(self, delta, scale=1.0) -> torch.Tensor:
        col = self._column_delta(delta)
        if col is not None:
            return self._whitened(col).logdet(torch.ones((), dtype=col.dtype, device=col.device), scale) \
                + self.shape[0] * torch.log(col).sum()
        return torch.log(self.eigenvalues(scale) + as_delta(delta, self.numel, self.A)).sum()

    def sample(self, eps: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``(S, numel)`` normal ``eps`` → draws of ``N(0, P⁻¹)``: ``Q_G (ε ⊘ √D) Q_Aᵀ``."""
        col = self._column_delta(delta)
        if col is not None:
            one = torch.ones((), dtype=col.dtype, device=col.device)
            x = self._whitened(col).sample(eps, one, scale).reshape(-1, *self.shape)
            return (x * col.rsqrt()).reshape(len(eps), -1)
        e = eps.reshape(-1, *self.shape) * self._dinv(delta, scale).sqrt()
        return (self.QG @ e @ self.QA.T).reshape(len(eps), -1)

    def to_dense(self, scale=1.0) -> torch.Tensor:
        return scale * torch.kron(self.G, self.A)

    def matvec(self, v: torch.Tensor, scale=1.0) -> torch.Tensor:
        """``s H v`` for a flat ``(numel,)`` vector, through the eigenbasis (the clamped
        eigenvalues of :meth:`logdet`)."""
        V = self.QG.T @ v.reshape(self.shape) @ self.QA
        return (self.QG @ (V * self.eigenvalues(scale)) @ self.QA.T).reshape(-1)

    def solve(self, v: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``P⁻¹ v`` for a flat ``(numel,)`` vector (differentiable in δ and ``s``)."""
        col = self._column_delta(delta)
        if col is not None:
            r = col.rsqrt()
            one = torch.ones((), dtype=col.dtype, device=col.device)
            inner = self._whitened(col).solve((v.reshape(self.shape) * r).reshape(-1), one, scale)
            return (inner.reshape(self.shape) * r).reshape(-1)
        V = self.QG.T @ v.reshape(self.shape) @ self.QA
        return (self.QG @ (V * self._dinv(delta, scale)) @ self.QA.T).reshape(-1)

    def covariance(self, delta, scale=1.0) -> torch.Tensor:
        col = self._column_delta(delta)
        if col is not None:
            one = torch.ones((), dtype=col.dtype, device=col.device)
            r = col.rsqrt().repeat(self.shape[0])
            return self._whitened(col).covariance(one, scale) * r[:, None] * r[None, :]
        Q = torch.kron(self.QG, self.QA)
        return (Q * self._dinv(delta, scale).reshape(-1)) @ Q.T

    def logdet_derivative(self, dA: torch.Tensor, dG: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """Directional derivative of ``log det P`` when the factors move by ``(dA, dG)``.

        ``d/dt log det(s (G + t·dG) ⊗ (A + t·dA) + δI)`` at ``t = 0`` equals
        ``s·tr(P⁻¹ (dG ⊗ A + G ⊗ dA))``; in the eigenbasis of ``P`` only diagonals are needed::

            Σ_ij s [λ^G_i (Q_Aᵀ dA Q_A)_jj + (Q_Gᵀ dG Q_G)_ii λ^A_j] / (s λ^G_i λ^A_j + δ)

        The eigen parts are constants, so the result is linear in ``dA`` and ``dG`` and its
        gradient through them (e.g. factors rebuilt with ``create_graph=True``) is the
        gradient of ``log det P`` by the product rule.  Eigenvalues are clamped at 0 as
        in :meth:`logdet`.  A per-column δ is handled in the whitened basis (``dA`` is
        whitened like ``A``).

        Parameters
        ----------
        dA : Tensor, shape (in', in')
            Change of the input factor (same normalisation as ``A``).
        dG : Tensor, shape (out, out)
            Change of the output factor (same normalisation as ``G``).
        delta : Tensor, 0-d or (numel,) per column
        scale : float or Tensor

        Returns
        -------
        Tensor, 0-d
        """
        if dA.shape != self.A.shape or dG.shape != self.G.shape:
            raise ValueError(f"expected factor changes of shapes {tuple(self.A.shape)} and "
                             f"{tuple(self.G.shape)}, got {tuple(dA.shape)} and {tuple(dG.shape)}")
        col = self._column_delta(delta)
        if col is not None:
            r = col.rsqrt()
            one = torch.ones((), dtype=col.dtype, device=col.device)
            return self._whitened(col).logdet_derivative(dA * r[:, None] * r[None, :], dG, one, scale)
        w = self._dinv(delta, scale)                                   # (out, in')
        da = (self.QA * (dA @ self.QA)).sum(0)                         # diag(Q_Aᵀ dA Q_A)
        dg = (self.QG * (dG @ self.QG)).sum(0)                         # diag(Q_Gᵀ dG Q_G)
        return scale * (self.lG @ w @ da + dg @ w @ self.lA)

    def functional_variance(self, a: torch.Tensor, g: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``J P⁻¹ Jᵀ`` for ``J_c = Σ_t g_{c,t} a_tᵀ`` (per example), shape ``(M, C, C)``.

        Parameters
        ----------
        a : Tensor, shape (M, T, in')
            Layer inputs (bias column included).
        g : Tensor, shape (C, M, T, out)
            Gradients of each output ``f_c`` w.r.t. the layer outputs.
        """
        return self.functional_variances(a, g, [delta], scale)[0]

    def functional_variances(self, a: torch.Tensor, g: torch.Tensor, deltas: list, scale=1.0) -> torch.Tensor:
        """:meth:`functional_variance` at each δ of ``deltas``, ``(K, M, C, C)``.

        The rotated factors (and a convolution's per-example ``J``) are formed once for every
        scalar δ.  Up to :data:`PER_DELTA_PRODUCTS` δ each result is :meth:`functional_variance`'s
        bit for bit (the same operations); with more, a per-column δ that is the same in every
        column counts as scalar (the same ``P``, without whitening ``A`` again) and a
        convolution's ``J`` goes through :func:`weighted_grams` with all of them: equal up to
        rounding.  A per-column δ that varies over the columns takes its own whitened basis."""
        shared, own = self._group_deltas(deltas, scale, len(deltas) > PER_DELTA_PRODUCTS)
        out = [None] * len(deltas)
        if shared:
            values = _apply_all(_factored_terms(a @ self.QA, g @ self.QG), [d for _, d in shared])
            for (k, _), value in zip(shared, values):
                out[k] = value
        for k, col in own:
            one = torch.ones((), dtype=col.dtype, device=col.device)
            out[k] = self._whitened(col).functional_variances(a * col.rsqrt(), g, [one], scale)[0]
        return torch.stack(out)

    def _group_deltas(self, deltas: list, scale, constant_shared: bool) -> tuple[list, list]:
        """The δ of ``deltas`` by the eigenbasis of their ``P``: ``(shared, own)``, ``shared`` the
        ``(k, D⁻¹)`` of those in the block's own basis (scalar δ, and with ``constant_shared`` a
        per-column δ that is the same in every column: the same ``P``), ``own`` the ``(k, col)``
        of the per-column δ that whiten ``A`` (:meth:`_whitened`) and take a basis of their own."""
        shared, own = [], []
        for k, delta in enumerate(deltas):
            col = self._column_delta(delta)
            if col is None:
                shared.append((k, self._dinv(delta, scale)))
            elif constant_shared and bool((col == col[0]).all()):
                shared.append((k, 1.0 / (self.eigenvalues(scale) + col)))
            else:
                own.append((k, col))
        return shared, own


class SplitBiasKronBlock:
    """KFAC with the bias as its own block (laplace-torch's convention).

    ``H = blockdiag(G ⊗ A_WW, G ⊗ A_bb)``: the joint factors without the weight-bias
    cross terms of ``A``.  Same interface and ``W̃`` layout as :class:`KronBlock`.  δ may
    be a scalar or a ``(numel,)`` vector in ``W̃`` order that is constant over the weight
    entries and over the bias entries (a weight's and a bias's own δ).
    """

    def __init__(self, A: torch.Tensor, G: torch.Tensor, name: str | None = None):
        self.w = KronBlock(A[:-1, :-1], G, name and f"{name} (weight block)")
        self.b = KronBlock(A[-1:, -1:], G, name and f"{name} (bias block)")
        self.A, self.G = A, G
        self.shape = (G.shape[0], A.shape[0])
        self.numel = self.shape[0] * self.shape[1]
        idx = torch.arange(self.numel, device=A.device).reshape(self.shape)
        self._perm = torch.cat([idx[:, :-1].reshape(-1), idx[:, -1]])   # W̃ order -> [W, b]

    def _deltas(self, delta):
        """``(δ_W, δ_b)`` as 0-d tensors from a scalar or a per-site ``W̃``-order vector."""
        d = as_delta(delta, self.numel, self.A)
        if d.dim() == 0:
            return d, d
        mat = d.reshape(self.shape)
        dw, db = mat[:, :-1].reshape(-1), mat[:, -1]
        if not (bool((dw == dw[0]).all()) and bool((db == db[0]).all())):
            raise ValueError("a split-bias Kronecker block takes one prior precision for the weight and one "
                             "for the bias; got a per-weight vector that varies within them")
        return dw[0], db[0]

    def logdet(self, delta, scale=1.0):
        dw, db = self._deltas(delta)
        return self.w.logdet(dw, scale) + self.b.logdet(db, scale)

    def sample(self, eps, delta, scale=1.0):
        dw, db = self._deltas(delta)
        e = eps.reshape(-1, *self.shape)
        w = self.w.sample(e[..., :-1].reshape(len(eps), -1), dw, scale).reshape(-1, self.shape[0], self.shape[1] - 1)
        b = self.b.sample(e[..., -1:].reshape(len(eps), -1), db, scale).reshape(-1, self.shape[0], 1)
        return torch.cat([w, b], -1).reshape(len(eps), -1)

    def logdet_derivative(self, dA, dG, delta, scale=1.0):
        """As :meth:`KronBlock.logdet_derivative`, for the weight and the bias block."""
        dw, db = self._deltas(delta)
        return (self.w.logdet_derivative(dA[:-1, :-1], dG, dw, scale)
                + self.b.logdet_derivative(dA[-1:, -1:], dG, db, scale))

    def _split(self, v):
        V = v.reshape(self.shape)
        return V[:, :-1].reshape(-1), V[:, -1:].reshape(-1)

    def _join(self, w, b):
        return torch.cat([w.reshape(self.shape[0], -1), b.reshape(self.shape[0], 1)], 1).reshape(-1)

    def matvec(self, v, scale=1.0):
        """``s H v`` (flat ``W̃`` order)."""
        w, b = self._split(v)
        return self._join(self.w.matvec(w, scale), self.b.matvec(b, scale))

    def solve(self, v, delta, scale=1.0):
        """``P⁻¹ v`` (flat ``W̃`` order)."""
        dw, db = self._deltas(delta)
        w, b = self._split(v)
        return self._join(self.w.solve(w, dw, scale), self.b.solve(b, db, scale))

    def _unpermute(self, M):
        out = torch.empty_like(M)
        out[self._perm[:, None], self._perm[None, :]] = M
        return out

    def to_dense(self, scale=1.0):
        return self._unpermute(torch.block_diag(self.w.to_dense(scale), self.b.to_dense(scale)))

    def covariance(self, delta, scale=1.0):
        dw, db = self._deltas(delta)
        return self._unpermute(torch.block_diag(self.w.covariance(dw, scale), self.b.covariance(db, scale)))

    def functional_variance(self, a, g, delta, scale=1.0):
        return self.functional_variances(a, g, [delta], scale)[0]

    def functional_variances(self, a, g, deltas, scale=1.0):
        """:meth:`functional_variance` at each δ of ``deltas``, ``(K, M, C, C)`` (see
        :meth:`KronBlock.functional_variances`)."""
        dw, db = zip(*[self._deltas(d) for d in deltas])
        return (self.w.functional_variances(a[..., :-1], g, list(dw), scale)
                + self.b.functional_variances(a[..., -1:], g, list(db), scale))


class DiagBlock:
    """Diagonal ``H = diag(h)`` for one layer; ``h`` has shape ``(out, in')``."""

    def __init__(self, h: torch.Tensor):
        self.h = h.clamp_min(0)
        self.shape = tuple(h.shape)
        self.numel = h.numel()

    def _dinv(self, delta, scale):
        d = as_delta(delta, self.numel, self.h)
        return 1.0 / (scale * self.h + d.reshape(self.shape) if d.dim() else scale * self.h + d)

    def logdet(self, delta, scale=1.0) -> torch.Tensor:
        return -torch.log(self._dinv(delta, scale)).sum()

    def sample(self, eps, delta, scale=1.0):
        return eps * self._dinv(delta, scale).reshape(-1).sqrt()

    def to_dense(self, scale=1.0):
        return torch.diag(scale * self.h.reshape(-1))

    def matvec(self, v, scale=1.0):
        """``s H v`` (flat)."""
        return scale * self.h.reshape(-1) * v

    def solve(self, v, delta, scale=1.0):
        """``P⁻¹ v`` (flat)."""
        return self._dinv(delta, scale).reshape(-1) * v

    def covariance(self, delta, scale=1.0):
        return torch.diag(self._dinv(delta, scale).reshape(-1))

    def functional_variance(self, a, g, delta, scale=1.0):
        """As :meth:`KronBlock.functional_variance`, with ``P⁻¹`` diagonal."""
        return self.functional_variances(a, g, [delta], scale)[0]

    def functional_variances(self, a, g, deltas, scale=1.0):
        """:meth:`functional_variance` at each δ of ``deltas``, ``(K, M, C, C)``, the
        δ-independent products formed once (as :meth:`KronBlock.functional_variances`)."""
        return torch.stack(_apply_all(_factored_terms(a, g), [self._dinv(d, scale) for d in deltas]))

    def functional_variance_rows(self, J, delta, scale=1.0):
        """``J P⁻¹ Jᵀ`` from per-example Jacobian rows ``J`` ``(C, M, out, in')`` (unit-wise layers)."""
        return torch.einsum("cmoi,dmoi,oi->mcd", J, J, self._dinv(delta, scale))


class DenseBlock:
    """Dense ``H`` (shape ``(P, P)``) over all layers.

    For a scalar δ (and an ``H`` without a graph) everything goes through one cached
    eigendecomposition ``H = Q diag(λ) Qᵀ``: ``log det(sH + δI) = Σ_i log(s λ_i + δ)``,
    ``P^{-1/2} = Q diag((sλ + δ)^{-1/2})``, so optimising δ costs ``O(P)`` per step instead
    of a ``O(P³)`` Cholesky.  A per-weight δ (or an ``H`` that requires grad) uses a
    Cholesky factor of ``P``.
    """

    def __init__(self, H: torch.Tensor):
        self.H = 0.5 * (H + H.T)
        self.numel = H.shape[0]
        self._eig = None

    def _eigen(self, d):
        """``(λ, Q)`` of ``H`` when ``d`` is scalar and ``H`` is constant, else ``None``."""
        if d.dim() != 0 or self.H.requires_grad:
            return None
        if self._eig is None:
            lam, Q = robust_eigh(self.H, f"dense GGN ({self.numel}×{self.numel})")
            self._eig = (lam.clamp(min=0), Q)
        return self._eig

    def precision(self, delta, scale=1.0) -> torch.Tensor:
        d = as_delta(delta, self.numel, self.H)
        return scale * self.H + torch.diag(d.expand(self.numel))

    def _chol(self, delta, scale):
        return torch.linalg.cholesky(self.precision(delta, scale))

    def logdet(self, delta, scale=1.0):
        d = as_delta(delta, self.numel, self.H)
        eig = self._eigen(d)
        if eig is not None:
            return torch.log(scale * eig[0] + d).sum()
        return 2 * torch.log(torch.diagonal(self._chol(delta, scale))).sum()

    def _inv_sqrt(self, delta, scale):
        """``R`` with ``R Rᵀ = P⁻¹`` and a flag: ``Q diag((sλ+δ)^{-1/2})`` (True) or ``L`` (False)."""
        d = as_delta(delta, self.numel, self.H)
        eig = self._eigen(d)
        if eig is not None:
            return eig[1] * (scale * eig[0] + d).rsqrt(), True
        return self._chol(delta, scale), False

    def sample(self, eps, delta, scale=1.0):
        R, is_eig = self._inv_sqrt(delta, scale)
        if is_eig:
            return eps @ R.T
        # x = L⁻ᵀ ε has covariance (L Lᵀ)⁻¹ = P⁻¹
        return torch.linalg.solve_triangular(R.T, eps.T, upper=True).T

    def to_dense(self, scale=1.0):
        return scale * self.H

    def matvec(self, v, scale=1.0):
        """``s H v``."""
        return scale * (self.H @ v)

    def solve(self, v, delta, scale=1.0):
        """``P⁻¹ v`` (eigenbasis for a scalar δ, else a Cholesky solve)."""
        d = as_delta(delta, self.numel, self.H)
        eig = self._eigen(d)
        if eig is not None:
            lam, Q = eig
            return Q @ ((Q.T @ v) / (scale * lam + d))
        return torch.cholesky_solve(v.unsqueeze(-1), self._chol(delta, scale)).squeeze(-1)

    def covariance(self, delta, scale=1.0):
        R, is_eig = self._inv_sqrt(delta, scale)
        return R @ R.T if is_eig else torch.cholesky_inverse(R)

    def functional_variance_dense(self, J: torch.Tensor, delta, scale=1.0) -> torch.Tensor:
        """``J P⁻¹ Jᵀ`` for a per-example Jacobian ``J`` of shape ``(C, M, P)`` → ``(M, C, C)``."""
        R, is_eig = self._inv_sqrt(delta, scale)
        flat = J.reshape(-1, self.numel)
        V = flat @ R if is_eig else torch.linalg.solve_triangular(R, flat.T, upper=False).T
        V = V.reshape(J.shape)
        return torch.einsum("cmp,dmp->mcd", V, V)


def _factored_terms(a, g):
    """The δ-independent part of ``Σ_ij J_c[i,j] J_d[i,j] D⁻¹[i,j]`` with
    ``J_c = Σ_t g[c,:,t,i] a[:,t,j]`` (:func:`_apply_factored`): ``(a², g)`` of a single
    position, else the per-example ``J``."""
    if a.shape[1] == 1:
        return a[:, 0] ** 2, g[:, :, 0], None                # (M, in'), (C, M, out)
    return None, None, torch.einsum("cmto,mti->cmoi", g, a)


def _apply_all(terms, dinvs: list) -> list:
    """:func:`_apply_factored` at each ``D⁻¹`` of ``dinvs``; a per-example ``J`` at more than
    :data:`PER_DELTA_PRODUCTS` of them through :func:`weighted_grams` (equal up to rounding)."""
    J = terms[2]
    if J is None or len(dinvs) <= PER_DELTA_PRODUCTS:
        return [_apply_factored(terms, d) for d in dinvs]
    return list(weighted_grams(J.flatten(2), torch.stack([d.reshape(-1) for d in dinvs])).unbind())


def _apply_factored(terms, dinv):
    """``Σ_ij J_c[i,j] J_d[i,j] D⁻¹[i,j]`` from its :func:`_factored_terms` at one ``D⁻¹``."""
    a2, u, J = terms
    if J is None:
        w = a2 @ dinv.T                                      # (M, out)
        return torch.einsum("cmo,dmo,mo->mcd", u, u, w)
    return torch.einsum("cmoi,dmoi,oi->mcd", J, J, dinv)


def weighted_grams(R: torch.Tensor, dinv: torch.Tensor) -> torch.Tensor:
    """``Σ_n R[c, m, n] R[c', m, n] dinv[k, n]``, shape ``(K, batch, C, C)``, for rows ``R``
    ``(C, batch, N)`` and weights ``dinv`` ``(K, N)``.

    Up to :data:`PER_DELTA_PRODUCTS` δ: one batched product ``(R ⊙ d_k) Rᵀ`` each.  More: the
    ``C(C+1)/2`` products of pairs of rows, formed once in blocks of columns that stay in cache,
    go through one matrix product with all the weights (100 δ, ``C = 10``, ``N = 157,000`` as in
    a 784-200-200-10 MLP's first layer, one thread of a loaded machine: 19 ms per input, against
    107 ms with the pairs' products formed whole and about 250 ms δ by δ)."""
    C, num, N = R.shape
    K = len(dinv)
    Rt = R.transpose(0, 1)                                              # (batch, C, N)
    if K <= PER_DELTA_PRODUCTS:
        return torch.stack([(Rt * d) @ Rt.mT for d in dinv])
    pairs = C * (C + 1) // 2
    width = min(N, max(1, DELTA_BLOCK_VALUES // (pairs * num)))
    V = R.new_zeros(K, pairs * num)
    Z = R.new_empty(pairs, num, width)
    for s in range(0, N, width):
        e = min(N, s + width)
        Zb, row = Z[..., :e - s], 0
        for c in range(C):
            torch.mul(R[c:c + 1, :, s:e], R[c:, :, s:e], out=Zb[row:row + C - c])
            row += C - c
        V.addmm_(dinv[:, s:e], Zb.reshape(pairs * num, e - s).T)
    i, j = torch.triu_indices(C, C, device=R.device)                   # the order of the rows of Z
    V = V.reshape(K, pairs, num).transpose(1, 2)                        # (K, batch, pairs)
    out = R.new_empty(K, num, C, C)
    out[:, :, i, j] = V
    out[:, :, j, i] = V
    return out
