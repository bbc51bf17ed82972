"""Lower bounds on the entropy gap ``H(q_G) − H(q)`` of a permutation-symmetrised mean field.

``q = N(μ, diag σ²)`` is a mean-field Gaussian over the weights ω and ``q_G`` the uniform
mixture of its hidden-unit relabelings ``q(g·ω)``, ``g ∈ G`` (:mod:`pyro_bnn.guides.symmetry`).  The
symmetrised ELBO is ``ELBO(q) + H(q_G) − H(q)``; both estimators here are lower bounds of the
gap (in expectation over ω ∼ q and their own randomness), so the objective stays a lower
bound of ``L^G``.  The derivation is in ``docs/symmetrized_estimator.md``.

* ``"uniform"`` (:func:`uniform_entropy_gap`, Gelberg et al. 2024): ``K − 1`` permutations
  drawn uniformly from G, ``log K − logsumexp(0, d_1, …, d_{K−1})`` with
  ``d_j = log q(g_j·ω) − log q(ω)``.  Never above ``log K``.
* ``"local"`` (:func:`local_entropy_gap`): an assignment distribution ``ρ(g | ω)`` over G
  that is equivariant (it looks at ω's units only through their content) and normalised,
  built from the Sinkhorn-balanced matrix of how well each of ω's units fits each slot
  ``(μ_r, σ_r)``.  ``K = 1``: ``log|G| + log ρ(e | ω)`` (a Barber–Agakov bound: no sampling,
  exact gradients).  ``K > 1``: the importance-weighted bound with ``K − 1`` proposals
  ``g_j ∼ ρ(·|ω)`` and weights ``q(g_j·ω) / (|G| ρ(g_j|ω))`` against the uniform measure,
  ``log K + log|G| − logsumexp(−log ρ(e|ω), d_j − log ρ(g_j|ω))``; its gradient includes the
  score-function term of the discrete proposals (leave-one-out baselines).

Conventions: a group element is one index tensor ``p`` per group; slot ``r`` of the
permuted weights holds unit ``p[r]`` of ω (``(g·ω)[r] = ω[p[r]]``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .symmetry import group_sizes, log_group_order, permute_batched

__all__ = ["assignment_cost", "group_assignment_cost", "log_density_ratios", "uniform_entropy_gap", "assignment_logits",
           "log_assignment_probability", "log_identity_probability", "sample_assignments",
           "local_entropy_gap", "local_bound_sites"]


# ------------------------------------------------------------------- building blocks
def assignment_cost(value: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``M[a, r] = Σ_c (ω[a, c] − μ[r, c])² / σ[r, c]²``: unit a of ω placed in slot r.

    Parameters
    ----------
    value : Tensor, shape (..., d, C)
        ω's units (rows), possibly with leading batch dimensions.
    loc, scale : Tensor, shape (d, C)
        μ and σ of the slots.

    Returns
    -------
    Tensor, shape (..., d, d)
        ``−½ M[a, r]`` is the log-density of unit a under slot r's Gaussian, up to a
        constant per slot; the log-density ratio of a relabeling is
        ``−½ Σ_r (M[p(r), r] − M[r, r])``.

    Notes
    -----
    The diagonal is computed elementwise (so the identity gives exactly 0); off-diagonal
    entries by matmuls on values centred per column.  In float32 their absolute error is
    about ``1e-7 · Σ_c ((ω_a − m)² + (μ_r − m)²)/σ_r²`` (m: the column mean of μ); it only
    matters where two units agree to within σ while far from the layer's mean.  Unbatched
    inputs go through one autograd node with a hand-written backward (the training hot path).
    """
    if value.dim() == 2:
        return _UnitCost.apply(False, value, loc, scale)
    return _unit_cost(value, loc, scale)


def _unit_cost(value, loc, scale):
    prec = scale.reciprocal().square()
    centre = loc.mean(-2, keepdim=True)
    w_c, mu_c = value - centre, loc - centre
    cost = (w_c.square() @ prec.T - 2.0 * (w_c @ (mu_c * prec).T)
            + (mu_c.square() * prec).sum(-1)[None, :])
    diag = ((value - loc).square() * prec).sum(-1)
    return torch.diagonal_scatter(cost, diag, dim1=-2, dim2=-1)


class _UnitCost(torch.autograd.Function):
    """Sum of :func:`assignment_cost` over several (d, C_s) blocks (one per site), backward
    by hand: no concatenation of the sites, fewer passes over the weights.

    Per block, ``M = [w̃², w̃] [P, −2A]ᵀ + 1 (Σ_c μ̃² P)ᵀ`` with ``w̃ = ω − m``, ``μ̃ = μ − m``,
    ``P = σ⁻²``, ``A = μ̃ P`` (one matmul).  With ``G = ∂L/∂M``, ``[X, Y] = G [P, −2A]``,
    ``[U, V] = Gᵀ [w̃², w̃]``, ``c = Gᵀ1`` and ``T = V − μ̃ c``: ``∂L/∂ω = 2 w̃ X + Y``,
    ``∂L/∂μ = −2 P T``, ``∂L/∂P = U − μ̃ (V + T)``, and ``∂L/∂σ = −2 σ⁻³ ∂L/∂P`` or, for
    log-scales ``s`` (``P = e^{−2s}``), ``∂L/∂s = −2 P ∂L/∂P``.  The centring m cancels in M,
    so it carries no gradient.
    """

    @staticmethod
    def forward(ctx, log_scales, *blocks):
        cost = diag = None
        saved = []
        for value, loc, scale in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
            d, c = value.shape
            centre = loc.mean(0, keepdim=True)
            mu_c = loc - centre
            squares = value.new_empty(d, 2 * c)          # [w̃², w̃]
            w_c = torch.sub(value, centre, out=squares[:, c:])
            torch.square(w_c, out=squares[:, :c])
            weights = value.new_empty(d, 2 * c)          # [P, −2A]
            if log_scales:
                prec = torch.exp(scale * -2.0, out=weights[:, :c])
            else:
                prec = torch.pow(scale, -2.0, out=weights[:, :c])
            torch.mul(mu_c, prec, out=weights[:, c:]).mul_(-2.0)
            part = squares @ weights.T
            part += (-0.5 * (mu_c * weights[:, c:])).sum(1)[None, :]
            part_diag = ((value - loc).square() * prec).sum(1)
            cost = part if cost is None else cost.add_(part)
            diag = part_diag if diag is None else diag.add_(part_diag)
            saved += [squares, weights, mu_c, scale]
        cost.diagonal().copy_(diag)
        ctx.log_scales = log_scales
        ctx.save_for_backward(*saved)
        return cost

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        col = grad.sum(0)[:, None]
        grads = [None]
        for squares, weights, mu_c, scale in zip(saved[0::4], saved[1::4], saved[2::4], saved[3::4]):
            c = mu_c.shape[1]
            xy = grad @ weights
            uv = grad.T @ squares
            prec, w_c, v = weights[:, :c], squares[:, c:], uv[:, c:]
            g_value = torch.addcmul(xy[:, c:], w_c, xy[:, :c], value=2.0)
            t = torch.addcmul(v, mu_c, col, value=-1.0)
            g_loc = (prec * t).mul_(-2.0)
            g_prec = torch.addcmul(uv[:, :c], mu_c, v + t, value=-1.0)
            g_scale = (g_prec * prec).mul_(-2.0)
            if not ctx.log_scales:
                g_scale = g_scale.div_(scale)
            grads += [g_value, g_loc, g_scale]
        return tuple(grads)


def group_assignment_cost(values, locs, scales, group: Mapping[str, int], sites: Sequence[str], *,
                          log_scales: bool = False) -> torch.Tensor:
    """:func:`assignment_cost` of a group's units over ``sites``.

    Large sites (≥ 256 numbers per unit, e.g. a first layer's weights) enter as their own
    block, without a copy; the small ones are concatenated into one block.

    Parameters
    ----------
    values, locs, scales : dict site -> Tensor
        ω, μ and σ (or ``log σ`` with ``log_scales=True``), unbatched.
    group : dict site -> axis
    sites : list of str
        The sites of ``group`` to include.

    Returns
    -------
    Tensor, shape (d, d)
    """
    def unit_rows(t, site):
        t = t.movedim(group[site], 0)
        return t.reshape(t.shape[0], -1)

    large = [s for s in sites if values[s].numel() >= 256 * values[s].shape[group[s]]]
    small = [s for s in sites if s not in large]
    blocks = []
    for s in large:
        blocks += [unit_rows(t[s], s) for t in (values, locs, scales)]
    if small:
        blocks += [torch.cat([unit_rows(t[s], s) for s in small], 1) for t in (values, locs, scales)]
    return _UnitCost.apply(log_scales, *blocks)


def _owners(groups) -> dict[str, list[int]]:
    owners: dict[str, list[int]] = {}
    for k, group in enumerate(groups):
        for site in group:
            owners.setdefault(site, []).append(k)
    return owners


def _unit_block(tensors: Mapping[str, torch.Tensor], group: Mapping[str, int], sites, batch: int = 0):
    """The sites' tensors side by side as one ``(..., d, C)`` block, units along dim −2."""
    parts = []
    for s in sites:
        t = tensors[s].movedim(group[s] + batch, batch)
        parts.append(t.reshape(*t.shape[:batch + 1], -1))
    return torch.cat(parts, -1)


def log_density_ratios(values: Mapping[str, torch.Tensor], locs: Mapping[str, torch.Tensor],
                       scales: Mapping[str, torch.Tensor], groups, perms) -> torch.Tensor:
    """``d_j = log q(g_j·ω) − log q(ω)`` for a mean-field ``q`` and ``K'`` group elements.

    .. math:: d_j = −\\tfrac12 \\sum_i \\big(z_{j,i}^2 − ε_i^2\\big),\\quad
              z_j = (g_j·ω − μ)/σ,\\; ε = (ω − μ)/σ.

    The sites a single group moves use one :func:`assignment_cost` matrix per group
    (``Σ_i z_{j,i}² = Σ_r M[p_j(r), r]``), so the cost is ``O(d² C + K d)`` instead of
    ``O(K d C)``; sites moved by two groups (inner layers of deep MLPs) are gathered
    explicitly.

    Parameters
    ----------
    values, locs, scales : dict site -> Tensor
        ω, μ, σ (same shapes).
    groups : list of dict
        The symmetry (see :mod:`pyro_bnn.guides.symmetry`).
    perms : list of Tensor
        One ``(K', d_k)`` index tensor per group.

    Returns
    -------
    Tensor, shape (K',)
    """
    num = perms[0].shape[0] if perms else 0
    first = values[next(iter(values))]
    total = first.new_zeros(num)
    owners = _owners(groups)
    multi = [k for k, g in enumerate(groups) if any(len(owners[s]) > 1 for s in g)]
    for k, group in enumerate(groups):
        single = [s for s in group if len(owners[s]) == 1]
        if not single:
            continue
        w, mu, sd = (_unit_block(t, group, single) for t in (values, locs, scales))
        cost = _unit_cost(w, mu, sd)   # plain autograd: works under torch.vmap too
        rows = torch.arange(cost.shape[0], device=cost.device)
        moved = cost[perms[k], rows].sum(-1) - cost.diagonal().sum()
        total = total - 0.5 * moved.to(total.dtype)
    if multi:
        sub_groups = [{s: a for s, a in groups[k].items() if len(owners[s]) > 1} for k in multi]
        permuted = permute_batched(values, sub_groups, [perms[k] for k in multi])
        for site, wp in permuted.items():
            loc, scale = locs[site], scales[site]
            z = (wp - loc) / scale
            z0 = (values[site] - loc) / scale
            total = total - 0.5 * (z.square() - z0.square()).flatten(1).sum(1)
    return total


def uniform_entropy_gap(values, locs, scales, groups, perms) -> torch.Tensor:
    """One-sample uniform-proposal bound ``Ĥ_K − H(q) = log K − logsumexp(0, d_1..d_{K−1})``.

    ``perms`` hold the ``K − 1`` uniform random elements (``(K−1, d_k)`` each); the identity
    is the mixture's own component.  Returns a scalar tensor ``≤ log K``.
    """
    d = log_density_ratios(values, locs, scales, groups, perms)
    logits = torch.cat([d.new_zeros(1), d])
    return math.log(logits.shape[0]) - torch.logsumexp(logits, 0)


def assignment_logits(log_weights: torch.Tensor, iterations: int = 3,
                      floor: float = 1e-3) -> torch.Tensor:
    """Logits ``Λ`` of the sequential assignment distribution ``ρ`` (units to slots).

    ``log_weights[a, r]`` scores unit a in slot r (``−½ M``).  Sinkhorn balancing
    (``iterations`` rounds, columns then rows, in log space; after the first column
    normalisation the log-weights are clamped at −30, i.e. a unit less than e⁻³⁰ as likely in
    a slot as the slot's units together counts as e⁻³⁰) gives a near doubly-stochastic
    ``S``; then ``Λ[a, r] = log S[a, r] + Σ_{s>r} log(1 − (1 − floor) S[a, s])`` discounts
    units that later slots need (this makes ρ exact for two units).  Any finite ``Λ`` gives a
    valid (normalised, equivariant) ρ; these choices only make it close to the posterior
    over relabelings.

    Parameters
    ----------
    log_weights : Tensor, shape (..., d, d)
    iterations : int
        Sinkhorn rounds, at least 1 (the correction needs ``S ≤ 1``).
    floor : float
        Keeps ``Λ`` finite when a unit fits one later slot with certainty.

    Returns
    -------
    Tensor, shape (..., d, d)
    """
    _check_iterations(iterations)
    log_s = log_weights
    for t in range(iterations):
        log_s = log_s - torch.logsumexp(log_s, -2, keepdim=True)
        if t == 0:
            log_s = log_s.clamp_min(-_CLAMP)
        log_s = log_s - torch.logsumexp(log_s, -1, keepdim=True)
    later = torch.log1p(-(1.0 - floor) * _exp(log_s))
    # Σ_{s > r} later[a, s]: exclusive reverse cumulative sum over slots
    after = torch.cat([later[..., 1:].flip(-1).cumsum(-1).flip(-1), torch.zeros_like(later[..., :1])], -1)
    return log_s + after


#: Floor of the column-normalised log-weights (see :func:`assignment_logits`): keeps later
#: log-softmaxes off ``exp``'s slow path for arguments below float32's underflow threshold.
_CLAMP = 30.0


def _lower_mask(d: int, device) -> torch.Tensor:
    return torch.ones(d, d, dtype=torch.bool, device=device).tril()


def log_assignment_probability(logits: torch.Tensor, perms: torch.Tensor | None = None) -> torch.Tensor:
    """``log ρ(p)`` of the sequential assignment distribution with logits ``Λ``.

    Slots are filled in the order ``r = 0, 1, …``; slot r takes unit a among the units not
    yet used with probability ``∝ exp Λ[a, r]``:

    .. math:: \\log ρ(p) = \\sum_r \\Big[Λ[p(r), r] − \\log \\sum_{s ≥ r} \\exp Λ[p(s), r]\\Big].

    Parameters
    ----------
    logits : Tensor, shape (d, d) or (B, d, d)
    perms : Tensor, shape (B, d), optional
        Index maps (slot r holds unit ``perms[b, r]``); default: the identity.

    Returns
    -------
    Tensor, shape () for the identity with unbatched logits, else (B,)
    """
    d = logits.shape[-1]
    if perms is None:
        rows = logits
    elif logits.dim() == 2:
        rows = logits[perms]                 # rows[b, s, r] = Λ[p_b(s), r]
    else:
        rows = torch.take_along_dim(logits, perms[..., :, None].expand(*perms.shape, d), dim=-2)
    den = torch.logsumexp(rows.masked_fill(~_lower_mask(d, logits.device), -math.inf), -2)
    return (rows.diagonal(dim1=-2, dim2=-1) - den).sum(-1)


def log_identity_probability(log_weights: torch.Tensor, iterations: int = 3,
                             floor: float = 1e-3) -> torch.Tensor:
    """``log ρ(e)`` from the unit-slot log-weights: :func:`assignment_logits` followed by
    :func:`log_assignment_probability` at the identity, as one autograd node with a
    hand-written backward (the training hot path; same value and gradient).

    Parameters
    ----------
    log_weights : Tensor, shape (d, d)

    Returns
    -------
    Tensor, shape ()
    """
    _check_iterations(iterations)
    return _IdentityLogProb.apply(log_weights, iterations, floor)


def _check_iterations(iterations) -> None:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")


def _exp(log_values: torch.Tensor) -> torch.Tensor:
    """``exp`` of log-probabilities, clamped at ``e^−80``: on CPU, ``exp`` of arguments below
    float32's underflow threshold took a slow path (10–20× slower), and entries that small
    (probabilities < 2e-35) change nothing here."""
    return log_values.clamp_min(-80.0).exp()


class _IdentityLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_weights, iterations, floor):
        x = log_weights
        steps = []
        for t in range(iterations):   # a Sinkhorn half-step is a log-softmax
            y = torch.log_softmax(x, 0)
            y_in = y
            if t == 0:
                ctx.kept = y > -_CLAMP
                y_in = y.clamp_min(-_CLAMP)
            x = torch.log_softmax(y_in, 1)
            steps.append((y, x))
        q = (1.0 - floor) * _exp(x)
        later = torch.log1p(-q)
        after = later.sum(1, keepdim=True) - later.cumsum(1)
        upper = torch.ones(x.shape, dtype=torch.bool, device=x.device).triu(1)
        log_p = torch.log_softmax((x + after).masked_fill(upper, -math.inf), 0)
        ctx.steps = steps
        ctx.save_for_backward(log_p, q / (1.0 - q))
        return log_p.diagonal().sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        log_p, odds = ctx.saved_tensors
        # ∂/∂Λ: the identity's entries minus each slot's softmax over the units left
        g = -_exp(log_p)
        g.diagonal().add_(1.0)
        # Λ = log S + Σ_{s>r} log(1 − q[a, s]): exclusive forward cumsum of ∂/∂Λ over slots
        g = g - (g.cumsum(1) - g) * odds
        for t in reversed(range(len(ctx.steps))):   # back through the Sinkhorn half-steps
            y, x = ctx.steps[t]
            g = g - _exp(x) * g.sum(1, keepdim=True)
            if t == 0:
                g = g * ctx.kept
            g = g - _exp(y) * g.sum(0, keepdim=True)
        return grad * g, None, None


@torch.no_grad()
def sample_assignments(logits: torch.Tensor, num: int,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """``num`` draws from the sequential assignment distribution (see
    :func:`log_assignment_probability`), by Gumbel-max slot after slot.

    Parameters
    ----------
    logits : Tensor, shape (d, d) or (num, d, d)
    num : int

    Returns
    -------
    LongTensor, shape (num, d)
    """
    d = logits.shape[-1]
    lam = logits.detach().expand(num, d, d)
    uniform = torch.rand(lam.shape, generator=generator, device=lam.device, dtype=lam.dtype)
    z = lam - torch.log(-torch.log(uniform.clamp_min(torch.finfo(lam.dtype).tiny)))
    taken = torch.zeros(num, d, dtype=torch.bool, device=lam.device)
    out = torch.empty(num, d, dtype=torch.long, device=lam.device)
    for r in range(d):
        unit = z[:, :, r].masked_fill(taken, -math.inf).argmax(-1)
        out[:, r] = unit
        taken.scatter_(1, unit[:, None], True)
    return out


# ------------------------------------------------------------------- the local bound
def local_bound_sites(groups) -> list[list[str]]:
    """For each group, the sites its assignment distribution looks at.

    ``ρ(g|ω) = Π_k ρ_k(g_k | (g_1..g_{k−1})·ω)`` chooses the groups in list order; group k
    may only use sites that no later group moves (their content must not depend on choices
    still to come), i.e. the sites whose last owner is k.
    """
    last = {}
    for k, group in enumerate(groups):
        for site in group:
            last[site] = k
    return [[s for s in group if last[s] == k] for k, group in enumerate(groups)]


def local_entropy_gap(values: Mapping[str, torch.Tensor], locs: Mapping[str, torch.Tensor],
                      scales: Mapping[str, torch.Tensor], groups: Sequence[Mapping[str, int]],
                      num_evaluations: int = 1, *, iterations: int = 3, floor: float = 1e-3,
                      generator: torch.Generator | None = None, log_scales: bool = False,
                      proposals: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (assignment-proposal) lower bound of ``H(q_G) − H(q)`` at one draw ω ∼ q.

    ``K = num_evaluations``.  ``K = 1``: ``log|G| + log ρ(e | ω)``.  ``K > 1``:

    .. math:: \\log K + \\log|G| − \\operatorname{logsumexp}\\big(−\\log ρ(e|ω),\\;
              d_j − \\log ρ(g_j|ω)\\big)_{j=1}^{K−1}, \\qquad g_j ∼ ρ(·|ω),

    which is at most the ``K = 1`` value plus ``log K`` and increases to the exact gap as K
    grows.  Both are lower bounds of the gap in expectation over ω ∼ q (and the g_j)
    (``docs/symmetrized_estimator.md``).

    Parameters
    ----------
    values, locs, scales : dict site -> Tensor
        ω (drawn from q), μ, σ.
    groups : list of dict
        The symmetry (:mod:`pyro_bnn.guides.symmetry`).
    num_evaluations : int
        K ≥ 1.
    iterations, floor
        Of :func:`assignment_logits`.
    generator : torch.Generator, optional
        For the proposals (K > 1).
    log_scales : bool
        ``scales`` hold ``log σ`` (saves the training step a pass over the weights).
    proposals : list of Tensor, optional
        The ``K − 1`` proposals (one ``(K−1, d_k)`` index tensor per group) instead of
        drawing them from ρ; ``num_evaluations`` must then be ``K``.  For tests and common
        random numbers: the estimate is only a bound in expectation over ``g_j ∼ ρ``.

    Returns
    -------
    (Tensor, Tensor)
        The estimate (a scalar) and a surrogate with the same value whose gradient is an
        unbiased estimate of the bound's gradient (for K > 1 it adds the score-function term
        of the discrete proposals, with leave-one-out baselines).
    """
    if isinstance(num_evaluations, bool) or not isinstance(num_evaluations, int) or num_evaluations < 1:
        raise ValueError(f"num_evaluations must be a positive int, got {num_evaluations!r}")
    first = values[next(iter(values))]
    if not groups:
        zero = first.new_zeros(())
        return zero, zero
    shapes = {k: v.shape for k, v in values.items()}
    sizes = group_sizes(groups, shapes)
    log_order = log_group_order(sizes)
    num = num_evaluations - 1
    if proposals is not None and (len(proposals) != len(groups)
                                  or any(p.shape[0] != num for p in proposals)):
        raise ValueError(f"proposals must be one ({num}, d_k) index tensor per group (K − 1 = "
                         f"{num} rows), got shapes {[tuple(p.shape) for p in proposals]}")
    if num and log_scales:
        scales, log_scales = {k: v.exp() for k, v in scales.items()}, False
    owned = local_bound_sites(groups)
    log_rho_e = first.new_zeros(())
    log_rho_g = first.new_zeros(num)
    perms: list[torch.Tensor] = []
    for k, (group, sites) in enumerate(zip(groups, owned)):
        d = sizes[k]
        if not sites:  # nothing to look at: the uniform distribution on S_d
            log_rho_e = log_rho_e - math.lgamma(d + 1)
            if num:
                perms.append(proposals[k] if proposals is not None else
                             torch.rand(num, d, generator=generator, device=first.device).argsort(-1))
                log_rho_g = log_rho_g - math.lgamma(d + 1)
            continue
        log_weights = -0.5 * group_assignment_cost(values, locs, scales, group, sites,
                                                   log_scales=log_scales)
        if not num:
            log_rho_e = log_rho_e + log_identity_probability(log_weights, iterations, floor)
            continue
        logits = assignment_logits(log_weights, iterations, floor)
        log_rho_e = log_rho_e + log_assignment_probability(logits)
        moved_before = [s for s in sites if any(j < k for j in _owners(groups)[s])]
        if moved_before:  # content depends on the earlier groups' draws: one matrix per draw
            earlier = [{s: a for s, a in groups[j].items() if s in moved_before} for j in range(k)]
            permuted = permute_batched(values, earlier, perms)
            batch_values = {s: permuted.get(s, values[s].expand(num, *values[s].shape)) for s in sites}
            w = _unit_block(batch_values, group, sites, batch=1)
            mu, sd = (_unit_block(t, group, sites) for t in (locs, scales))
            logits = assignment_logits(-0.5 * assignment_cost(w, mu, sd), iterations, floor)
        p = proposals[k] if proposals is not None else sample_assignments(logits, num, generator)
        perms.append(p)
        log_rho_g = log_rho_g + log_assignment_probability(logits, p)
    if not num:
        gap = log_order + log_rho_e
        return gap, gap
    ratios = log_density_ratios(values, locs, scales, groups, perms)
    log_w = torch.cat([-log_rho_e[None], ratios - log_rho_g])  # log(|G| × importance weight)
    gap = math.log(num + 1) + log_order - torch.logsumexp(log_w, 0)
    # leave-one-out baselines: proposal j's log-weight replaced by the mean of the others'
    with torch.no_grad():
        lw = log_w.detach()
        others_mean = (lw.sum() - lw[1:]) / num
        loo = lw[None, :].repeat(num, 1)
        loo[torch.arange(num), torch.arange(1, num + 1)] = others_mean
        baselines = math.log(num + 1) + log_order - torch.logsumexp(loo, 1)
        advantage = gap.detach() - baselines
    score = log_rho_g - log_rho_g.detach()
    return gap, gap + (advantage * score).sum()
