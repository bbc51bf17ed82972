"""The GLM covariance of a pruned network: Jacobians with 0/1 weight masks.

Pruning (:func:`pyro_bnn.analysis.pruning.prune_`) makes the network ``f(x; M ⊙ θ)``.  Its
linearisation at θ* is ``f(x; M ⊙ θ*) + J M (θ − θ*)`` (``J`` the Jacobian of the pruned
network, ``M`` the diagonal 0/1 mask), so its GLM has ``Σ_f = (J M) P⁻¹ (J M)ᵀ``: the
covariance of the sampling predictive that draws ``θ ~ N(θ*, P⁻¹)`` and zeroes the masked
entries, linearised — the *marginal* posterior of the kept weights under the unpruned ``P``
(not the conditional given the pruned ones at 0, whose covariance would be ``(P_kept,kept)⁻¹``).
:func:`~pyro_bnn.curvature.batch_covariance` takes the masks of :func:`layer_masks` and calls
:func:`masked_layer_variances` for each masked layer (at one δ, or at a grid of them:
:func:`~pyro_bnn.curvature.glm.batch_covariances`).

Cost (``benchmarks/pruned_glm.py``, float32, one thread of a 2-core machine loaded by other
jobs, 90 % of the weights pruned, ranges over three runs): a 784-200-200-10 MLP 13–20 ms per
input (the pattern factors for every layer before: 31–55 ms), a LeNet CNN 2–3 ms (8–13 ms); the
grid search's 100 δ on 200 inputs 8–12 s and 1.7–2.6 s (820–910 s and 170–260 s when every δ
redid the Jacobian work).  The dense layers' exact masked covariance costs
``out·in'² + C·out²·in'`` multiplications per input in the eigenbasis (no factorisation
survives the mask), which dominates the MLP.
"""

from __future__ import annotations

import torch

from .layers import Layer
from .structures import DiagBlock, KronBlock, SplitBiasKronBlock, weighted_grams
from .unitwise import UnitBlock

__all__ = ["layer_masks", "masked_layer_variance", "masked_layer_variances", "flat_mask", "MASKED_CHUNK_VALUES"]

#: Values (entries of the per-example Jacobian rows and masked factors) one step of the masked
#: GLM covariance holds; larger batches of inputs are split into chunks of examples.
MASKED_CHUNK_VALUES = 2 ** 24


def layer_masks(layers: list[Layer], masks: dict[str, torch.Tensor],
                site_shapes: dict) -> list[torch.Tensor | None]:
    """Per layer its 0/1 weight mask in the ``W̃ = [W, b]`` layout, ``(out, in')``.

    Parameters
    ----------
    layers : list of Layer
    masks : dict
        ``{site: 0/1 tensor shaped like the site}`` (:func:`~pyro_bnn.model.weight_masks.weight_masks`);
        sites of no layer (point estimates) are left to the network's own masking.
    site_shapes : dict
        ``{site: shape}`` of every layer site.

    Returns
    -------
    list of (Tensor or None)
        ``None`` for a layer none of whose entries is masked (an unmasked site counts as all
        ones), so unpruned layers keep the unmasked computation.

    Raises
    ------
    ValueError
        A mask's shape is not its site's.
    """
    out = []
    for layer in layers:
        if not any(s in masks for s in layer.sites):
            out.append(None)
            continue
        like = next(masks[s] for s in layer.sites if s in masks)
        parts = {}
        for site in layer.sites:
            shape = tuple(site_shapes[site])
            mask = masks.get(site)
            if mask is None:
                mask = torch.ones(shape, dtype=like.dtype, device=like.device)
            elif tuple(mask.shape) != shape:
                raise ValueError(f"the pruning mask of site {site!r} has shape {tuple(mask.shape)}, expected the "
                                 f"site's shape {shape}")
            parts[site] = mask
        mat = layer.flatten(parts)
        out.append(None if bool((mat != 0).all()) else (mat != 0).to(mat.dtype))
    return out


def masked_layer_variance(layer: Layer, block, a: torch.Tensor, g: torch.Tensor, mask: torch.Tensor,
                          delta, scale) -> torch.Tensor:
    """``(J_l ⊙ M_l) P_l⁻¹ (J_l ⊙ M_l)ᵀ`` of one layer, ``(batch, C, C)``: one δ of
    :func:`masked_layer_variances`."""
    return masked_layer_variances(layer, block, a, g, mask, [delta], scale)[0]


def masked_layer_variances(layer: Layer, block, a: torch.Tensor, g: torch.Tensor, mask: torch.Tensor,
                           deltas: list, scale) -> torch.Tensor:
    """``(J_l ⊙ M_l) P_l⁻¹ (J_l ⊙ M_l)ᵀ`` of one layer at each δ of ``deltas``, ``(K, batch, C, C)``.

    The masked per-example Jacobian is taken into the eigenbasis of ``P_l`` once, and only the
    eigenvalues' weights ``d = 1/(s·λ + δ)`` depend on δ: ``Σ_f[c, c'] = Σ_n R_c[n] R_c'[n] d_n``
    (:func:`weighted_grams`), so a grid of δ costs one rotation and one matrix product with
    all the grid's ``d``.  Diagonal blocks take the masked rows ``(Σ_t g_{c,t} ã_tᵀ) ⊙ M_l``
    as they are; unit-wise blocks (``functional_variance_rows``, a Cholesky factor per δ) too.
    For Kronecker blocks ``R_c = Q_Gᵀ ((Σ_t g_{c,t} ã_tᵀ) ⊙ M_l) Q_A`` (:func:`_rotated`);
    with one position (dense layers) ``R_c = Q_Gᵀ diag(g_c) (M_l ⊙ 1ã ᵀ) Q_A``, so the ``Q_A``
    side is one product per example, not per output.  When the mask has few distinct rows or
    columns, grouping them into patterns ``m_p`` (``(Σ_t g_{c,t} ã_tᵀ) ⊙ M_l =
    Σ_t Σ_p (g_{c,t} ⊙ 1_p)(ã_t ⊙ m_p)ᵀ``) can be cheaper: the cheaper of the two by a count
    of multiplications is taken.  A per-column δ (a weight's and its bias's own δ under a
    joint ``[W, b]`` block) that is not the same for every column whitens ``A`` and takes its
    own basis; a scalar or constant one, and the split-bias block's pair of δ, share the
    block's basis.  Examples go in chunks of at most :data:`MASKED_CHUNK_VALUES` values.

    Parameters
    ----------
    layer : Layer
    block : KronBlock, SplitBiasKronBlock, DiagBlock or UnitBlock
    a, g : Tensor
        The layer's factors ``(batch, T, in')`` and ``(C, batch, T, out)``.
    mask : Tensor, shape (out, in')
        0/1 mask in the ``W̃`` layout.
    deltas : list
        Prior precisions of the block (each a 0-d tensor or the block's per-weight vector).
    scale : float or Tensor

    Returns
    -------
    Tensor, shape (K, batch, C, C)

    Raises
    ------
    ValueError
        A block type that cannot take masks (naming ``predictive="sample"`` and ``unprune_``).
    """
    mask = mask.to(a)
    rows = layer.unitwise or isinstance(block, (DiagBlock, UnitBlock))
    if not rows and not isinstance(block, (KronBlock, SplitBiasKronBlock)):
        raise ValueError(f"the GLM predictive of a pruned model masks each layer's Jacobian; the "
                         f"{type(block).__name__} curvature block of layer {layer.path!r} cannot take masks "
                         "exactly: use predictive='sample' (Monte Carlo over the masked weights), or "
                         "pyro_bnn.analysis.pruning.unprune_(model) for the unpruned GLM")
    C, num, T = g.shape[0], g.shape[1], g.shape[2]
    K, N = len(deltas), layer.numel
    out = torch.zeros(K, num, C, C, dtype=g.dtype, device=g.device)
    if rows:
        dinv = (torch.stack([block._dinv(d, scale).reshape(-1) for d in deltas])
                if isinstance(block, DiagBlock) else None)
        chunk = max(1, MASKED_CHUNK_VALUES // (3 * C * N))
        for start in range(0, num, chunk):
            J = layer.per_example(a[start:start + chunk], g[:, start:start + chunk]) * mask
            if dinv is not None:
                out[:, start:start + chunk] = weighted_grams(J.flatten(2), dinv)
            else:
                for k, d in enumerate(deltas):
                    out[k, start:start + chunk] = block.functional_variance_rows(J, d, scale)
        return out
    by_rows, indicators, patterns = _mask_patterns(mask)
    if len(patterns) == 0:                                               # every entry pruned
        return out
    out_f, in_f, S = layer.out_features, layer.in_dim, T * len(patterns)
    by_pattern = _by_pattern(C, T, len(patterns), out_f, in_f)
    per_example = (3 * S * (in_f + C * out_f) if by_pattern else (2 + T) * in_f + out_f * in_f) + 3 * C * N
    chunk = max(1, MASKED_CHUNK_VALUES // per_example)
    for basis, index, dinv in _eigenbases(block, deltas, scale):
        for start in range(0, num, chunk):
            ac, gc = a[start:start + chunk], g[:, start:start + chunk]
            if by_pattern:
                a2, g2 = _pattern_factors(ac, gc, by_rows, indicators, patterns)
                value = _pattern_variances(a2, g2, basis, dinv)
            else:
                value = weighted_grams(_rotated(ac, gc, mask, basis).flatten(2), dinv)
            out[index, start:start + chunk] = value
    return out


def _by_pattern(C: int, T: int, P: int, out_f: int, in_f: int) -> bool:
    """Whether the ``P`` mask patterns (:func:`_pattern_factors`) take fewer multiplications
    than the rotation of the masked Jacobian (:func:`_rotated`) for ``C`` outputs at ``T``
    positions of an ``(out, in')`` layer."""
    S = T * P
    by_pattern = S * (in_f ** 2 + C * out_f ** 2 + (C * out_f * in_f if S > 1 else 0))
    rotation = out_f * in_f ** 2 + C * out_f ** 2 * in_f if T == 1 else C * out_f * in_f * (T + out_f + in_f)
    return by_pattern < rotation


def _eigenbases(block, deltas: list, scale):
    """The eigenbases that ``P = s·H + δ`` of a Kronecker block takes at the δ of ``deltas``.

    Yields ``((Q_G, Q_A, r), index, D⁻¹)``: ``R_c = Q_Gᵀ (J_c ⊙ M) diag(r) Q_A`` (``r`` ``None``
    or a whitening of the columns) has covariance ``diag(D⁻¹[k])`` (``D⁻¹`` ``(len(index), out·in')``)
    for the δ ``deltas[index[k]]``.  Scalar δ, per-column δ that are the same in every column, and
    the split-bias block's weight and bias δ share the block's own basis (the split block's
    bias part in the weight part's ``Q_G``: both diagonalise the same ``G``); a per-column δ that
    varies over the columns whitens ``A`` and gets a basis of its own."""
    if isinstance(block, SplitBiasKronBlock):
        w, b = block.w, block.b
        lam = scale * torch.outer(w.lG, torch.cat([w.lA, b.lA]))
        dinv = []
        for delta in deltas:
            dw, db = block._deltas(delta)
            dinv.append((1.0 / (lam + torch.cat([dw.expand(len(w.lA)), db.reshape(1)]))).reshape(-1))
        yield (w.QG, torch.block_diag(w.QA, b.QA), None), list(range(len(deltas))), torch.stack(dinv)
        return
    shared, own = block._group_deltas(deltas, scale, constant_shared=True)
    if shared:
        yield ((block.QG, block.QA, None), [k for k, _ in shared],
               torch.stack([d.reshape(-1) for _, d in shared]))
    for k, col in own:
        white = block._whitened(col)
        one = torch.ones((), dtype=col.dtype, device=col.device)
        yield (white.QG, white.QA, col.rsqrt()), [k], white._dinv(one, scale).reshape(1, -1)


def _rotated(a: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, basis) -> torch.Tensor:
    """``R_c = Q_Gᵀ ((Σ_t g_{c,t} ã_tᵀ) ⊙ M) diag(r) Q_A`` per example, ``(C, batch, out, in')``."""
    QG, QA, r = basis
    if a.shape[1] == 1:                     # (g_c ã ᵀ) ⊙ M = diag(g_c) (M ⊙ 1ãᵀ): Q_A once per example
        x = a[:, 0] if r is None else a[:, 0] * r
        B = (mask * x[:, None, :]) @ QA                                   # (batch, out, in')
        return QG.T @ (g[:, :, 0, :, None] * B)
    J = torch.einsum("cmto,mti->cmoi", g, a) * (mask if r is None else mask * r)
    return QG.T @ J @ QA


def _pattern_variances(a2: torch.Tensor, g2: torch.Tensor, basis, dinv: torch.Tensor) -> torch.Tensor:
    """:func:`weighted_grams` from the pattern factors of :func:`_pattern_factors`."""
    QG, QA, r = basis
    a_rot = (a2 if r is None else a2 * r) @ QA                          # (batch, S, in')
    g_rot = g2 @ QG                                                     # (C, batch, S, out)
    if a2.shape[1] == 1:                  # one pattern at one position: no per-example J
        K, (num, out_f) = len(dinv), g_rot.shape[1::2]
        w = (a_rot[:, 0] ** 2) @ dinv.reshape(K * out_f, -1).T                 # (batch, K·out)
        u = g_rot[:, :, 0]
        return torch.einsum("cmo,dmo,mko->kmcd", u, u, w.reshape(num, K, out_f))
    return weighted_grams(torch.einsum("cmso,msi->cmoi", g_rot, a_rot).flatten(2), dinv)


def _mask_patterns(mask: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """``mask`` ``(out, in')`` as ``Σ_p u_p v_pᵀ`` with 0/1 vectors, ``u_p`` the indicator of
    the rows (or columns) that share one pattern ``v_p``, over the side with fewer distinct
    patterns; all-zero patterns left out.  Returns ``(by_rows, U, V)``, ``U`` ``(P, out)`` and
    ``V`` ``(P, in')`` by rows, ``U`` ``(P, in')`` and ``V`` ``(P, out)`` by columns."""
    by_rows = torch.unique(mask, dim=0).shape[0] <= torch.unique(mask, dim=1).shape[1]
    m = mask if by_rows else mask.T
    uniq, inverse = torch.unique(m, dim=0, return_inverse=True)
    keep = uniq.any(1)
    U = (inverse == torch.arange(len(uniq), device=m.device)[:, None]).to(mask.dtype)
    return by_rows, U[keep], uniq[keep]


def _pattern_factors(a: torch.Tensor, g: torch.Tensor, by_rows: bool, U: torch.Tensor, V: torch.Tensor):
    """Factors ``ã'`` ``(batch, T·P, in')`` and ``g'`` ``(C, batch, T·P, out)`` with
    ``Σ_s g'_{c,s} ã'_sᵀ = (Σ_t g_{c,t} ã_tᵀ) ⊙ mask`` (see :func:`masked_layer_variances`)."""
    g_mask, a_mask = (U, V) if by_rows else (V, U)
    a2 = (a.unsqueeze(2) * a_mask).flatten(1, 2)                       # (batch, T·P, in')
    g2 = (g.unsqueeze(3) * g_mask).flatten(2, 3)                       # (C, batch, T·P, out)
    return a2, g2


def flat_mask(layers: list[Layer], masks: list, like: torch.Tensor) -> torch.Tensor:
    """The masks of :func:`layer_masks` as one flat vector over all layers' parameters (ones
    for unmasked layers), for a dense Jacobian ``(C, M, P)``."""
    return torch.cat([(torch.ones(layer.shape, dtype=like.dtype, device=like.device) if m is None
                       else m.to(like)).reshape(-1) for layer, m in zip(layers, masks)])
