"""One fused autograd node for a mean-field site: ``w = μ + σ(ρ) ε`` and its KL.

Bayes by Backprop spends most of its extra time (over a MAP step) in elementwise passes over
every weight: the reparameterised sample, the closed-form KL and their backward graphs.
Left to autograd, ``softplus``, ``σ ε``, ``μ + ·``, ``σ²``, ``(μ − m)²``, ``log σ`` and their
backward functions make some twenty-five passes over each weight tensor.  Written out by
hand, forward and backward need about twelve, and the KL's quadratic terms become dot
products (reads only) when the prior's scale is one number per site.

With ``σ = exp(ρ)`` the softplus, ``log σ`` and sigmoid passes go too.

The maths, per weight with prior ``N(m, s²)``::

    KL   = log s − log σ + (σ² + (μ − m)²) / (2 s²) − 1/2
    ∂KL/∂μ = (μ − m) / s²
    ∂KL/∂σ = σ / s² − 1 / σ
    ∂w/∂μ = 1,   ∂w/∂σ = ε,   ∂σ/∂ρ = σ (exp) or sigmoid(ρ) (softplus)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["sample_and_kl", "can_fuse", "normal_kl_node", "normal_kl_node_log_scale", "can_fuse_kl",
           "normal_kl_sites_log_scale", "can_fuse_kl_sites"]


def can_fuse(loc: torch.Tensor, prior_loc: torch.Tensor, prior_scale: torch.Tensor) -> bool:
    """Whether :func:`sample_and_kl` applies: the prior's parameters take no gradient and
    broadcast to the site's shape."""
    if prior_loc.requires_grad or prior_scale.requires_grad:
        return False
    if prior_loc.numel() == 1 and prior_scale.numel() == 1 and prior_loc.dim() <= loc.dim() \
            and prior_scale.dim() <= loc.dim():
        return True  # the usual case, without broadcast_shapes' Python overhead
    try:
        shape = torch.broadcast_shapes(loc.shape, prior_loc.shape, prior_scale.shape)
    except RuntimeError:
        return False
    return shape == loc.shape


def _cpu_floats(prior_loc, prior_scale):
    """``(m, s)`` as Python floats for a one-number CPU prior (reading a CUDA value would
    synchronise), else ``None``."""
    if prior_scale.numel() == 1 and prior_loc.numel() == 1 and prior_scale.device.type == "cpu":
        return float(prior_loc), float(prior_scale)
    return None


def _kl_terms(loc, sigma, prior_loc, prior_scale):
    """``(μ − m, 1/s², ½ Σ (σ² + (μ − m)²) / s² + Σ log s − n/2)`` for the closed-form KL.

    For a one-number prior on the CPU the constants are Python floats: a dozen fewer
    scalar tensor operations per site and step.
    """
    n = loc.numel()
    floats = _cpu_floats(prior_loc, prior_scale)
    if floats is not None:
        m, s = floats
        diff = loc if m == 0.0 else loc - m    # one pass less each way for a zero-mean prior
        inv_var, log_s = 1.0 / (s * s), math.log(s)
    else:
        diff = loc - prior_loc
        inv_var = prior_scale.reciprocal().square()
        if inv_var.numel() != 1:               # a prior per weight (or per row)
            quad = (torch.addcmul(sigma.square(), diff, diff) * inv_var).sum()
            return diff, inv_var, 0.5 * quad + prior_scale.log().expand(loc.shape).sum() - 0.5 * n
        inv_var, log_s = inv_var.reshape(()), prior_scale.log().reshape(())
    sig, d = sigma.reshape(-1), diff.reshape(-1)
    quad = (torch.dot(sig, sig) + torch.dot(d, d)) * (0.5 * inv_var)
    return diff, inv_var, quad + n * (log_s - 0.5)


def _save(ctx, inv_var, *tensors):
    if isinstance(inv_var, float):
        ctx.inv_var = inv_var
        ctx.save_for_backward(*tensors)
    else:
        ctx.inv_var = None
        ctx.save_for_backward(*tensors, inv_var)


def _saved(ctx):
    saved = ctx.saved_tensors
    return (ctx.inv_var, saved) if ctx.inv_var is not None else (saved[-1], saved[:-1])


class _SampleAndKLExp(torch.autograd.Function):
    """``σ = exp(ρ)``: no transcendental pass besides the ``exp`` (``log σ = ρ``)."""

    @staticmethod
    def forward(ctx, loc, rho, eps, prior_loc, prior_scale):
        sigma = rho.exp()
        w = torch.addcmul(loc, sigma, eps)
        diff, inv_var, kl_rest = _kl_terms(loc, sigma, prior_loc, prior_scale)
        kl = kl_rest - rho.sum()
        _save(ctx, inv_var, sigma, eps, diff)
        return w, kl

    @staticmethod
    def backward(ctx, grad_w, grad_kl):
        inv_var, (sigma, eps, diff) = _saved(ctx)
        k = grad_kl * inv_var                                  # scalar or per-weight
        grad_loc = diff * k if grad_w is None else torch.addcmul(grad_w, diff, k)
        # ∂L/∂ρ = σ ∂L/∂σ = σ (ε ∂L/∂w + σ k) − ∂L/∂KL
        grad_rho = sigma * k if grad_w is None else torch.addcmul(grad_w * eps, sigma, k)
        grad_rho.mul_(sigma).sub_(grad_kl)
        return grad_loc, grad_rho, None, None, None


class _SampleAndKLSoftplus(torch.autograd.Function):
    """``σ = softplus(ρ)`` (Blundell et al.); ``∂σ/∂ρ = sigmoid(ρ)``."""

    @staticmethod
    def forward(ctx, loc, rho, eps, prior_loc, prior_scale):
        sigma = F.softplus(rho)
        w = torch.addcmul(loc, sigma, eps)
        diff, inv_var, kl_rest = _kl_terms(loc, sigma, prior_loc, prior_scale)
        kl = kl_rest - sigma.log().sum()
        _save(ctx, inv_var, rho, sigma, eps, diff)
        return w, kl

    @staticmethod
    def backward(ctx, grad_w, grad_kl):
        inv_var, (rho, sigma, eps, diff) = _saved(ctx)
        k = grad_kl * inv_var
        grad_loc = diff * k if grad_w is None else torch.addcmul(grad_w, diff, k)
        # ∂L/∂σ = ε ∂L/∂w + (σ / s² − 1 / σ) ∂L/∂KL
        grad_sigma = sigma * k if grad_w is None else torch.addcmul(grad_w * eps, sigma, k)
        grad_sigma.addcdiv_(-grad_kl, sigma)
        return grad_loc, grad_sigma.mul_(torch.sigmoid(rho)), None, None, None


_FUNCTIONS = {"exp": _SampleAndKLExp, "softplus": _SampleAndKLSoftplus}


def sample_and_kl(loc: torch.Tensor, rho: torch.Tensor, eps: torch.Tensor,
                  prior_loc: torch.Tensor, prior_scale: torch.Tensor, positive: str = "exp"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reparameterised weight and ``KL(N(μ, σ²) ‖ N(m, s²))`` summed, in one autograd node.

    Parameters
    ----------
    loc, rho : Tensor
        Posterior mean ``μ`` and unconstrained scale ``ρ``, same shape.
    eps : Tensor
        Standard normal noise of that shape (no gradient).
    prior_loc, prior_scale : Tensor
        Prior mean ``m`` and standard deviation ``s``, broadcastable to ``loc`` (no gradient;
        see :func:`can_fuse`).
    positive : {"exp", "softplus"}
        ``σ = exp(ρ)`` or ``σ = softplus(ρ)``.

    Returns
    -------
    w : Tensor
        ``μ + σ ε``.
    kl : Tensor
        Scalar ``Σ KL`` over the site's weights.
    """
    return _FUNCTIONS[positive].apply(loc, rho, eps, prior_loc, prior_scale)


# ================================================== the closed-form KL of given (μ, σ), bit for bit
class _NormalKL(torch.autograd.Function):
    """``normal_kl(μ, σ, m, s)`` of :mod:`.meanfield` as one autograd node, with the values and
    gradients of the autograd graph that formula builds, bit for bit.

    The formula is ``½ [Σ (σ² + (μ − m)²) s⁻² − 2 Σ log σ + n (2 log s − 1)]``.  Left to autograd
    it makes some fourteen elementwise passes per weight tensor (forward and backward,
    ``pow``'s backward alone three: ``x.pow(1)``, ``× 2``, ``× grad``); here the backward
    is three passes, each the same floating-point operation autograd performs:

    * ``∂/∂μ = G · 2(μ − m)`` and ``∂/∂σ (square term) = G · 2σ`` with ``G = ½ g s⁻²`` are
      computed as ``(μ − m) · (2G)`` and ``σ · (2G)``: doubling is exact in binary floating
      point, so both are the one rounding of the same product;
    * ``∂/∂σ (log term) = (−2 · ½ g) / σ``, autograd's ``div`` of the same operands.

    ``σ`` is passed twice (``scale`` for the log term, ``scale_again`` for the square): the
    two contributions reach ``σ``'s gradient buffer as separate terms, in the order
    autograd delivered them (log term, then square term), so a third use of ``σ``
    elsewhere (the local reparameterisation's ``σ²``, a weight sample ``μ + σε``) is summed
    with them in the same order as before.  The exact identities ``μ − 0 = μ`` and
    ``x · 1 = x`` are left out where the CPU prior has mean +0 or ``s⁻² = 1``.

    The backward is written with differentiable operations on the inputs, so a double
    backward (``create_graph=True``) is correct too.
    """

    @staticmethod
    def forward(ctx, loc, scale, scale_again, prior_loc, prior_scale):
        return _kl_forward(ctx, loc, scale, torch.log(scale).sum(), prior_loc, prior_scale)

    @staticmethod
    def backward(ctx, grad):
        grad_loc, grad_square, half = _kl_square_backward(ctx, grad)
        grad_log = (-half * 2.0) / ctx.saved_tensors[1]
        return grad_loc, grad_log, grad_square, None, None


class _NormalKLLogScale(torch.autograd.Function):
    """The closed-form KL of :class:`_NormalKL` with ``log σ`` given (``σ = exp(ρ)``: ``log σ = ρ``).

    The log term is ``− Σ ρ`` instead of ``− Σ log(exp(ρ))``: no ``log`` pass over the weights
    forward, no division backward, and ``ρ`` gets its exact ``−g`` rather than ``σ · (−g/σ)``
    through the exponential.  The same KL mathematically; numerically the log term differs by
    the rounding of ``log(exp(ρ))`` (~1e-7 relative), so this is not bit-identical to
    :func:`pyro_bnn.guides.meanfield.normal_kl`.  The square term is :class:`_NormalKL`'s.
    """

    @staticmethod
    def forward(ctx, loc, scale, log_scale, prior_loc, prior_scale):
        ctx.log_shape = log_scale.shape
        return _kl_forward(ctx, loc, scale, log_scale.sum(), prior_loc, prior_scale)

    @staticmethod
    def backward(ctx, grad):
        grad_loc, grad_square, _ = _kl_square_backward(ctx, grad)
        return grad_loc, grad_square, (-grad).expand(ctx.log_shape), None, None


def _kl_forward(ctx, loc, scale, log_scale_sum, prior_loc, prior_scale):
    """The closed-form KL from ``Σ log σ``, with what the backward needs kept on ``ctx``."""
    inv_var = prior_scale.reciprocal() ** 2
    zero_mean, unit_var = _exact_identities(prior_loc, inv_var)
    diff = loc if zero_mean else loc - prior_loc
    quad = scale ** 2 + diff ** 2
    if not unit_var:
        quad = quad * inv_var
    kl = 0.5 * (quad.sum() - 2.0 * log_scale_sum + loc.numel() * (2.0 * torch.log(prior_scale) - 1.0))
    ctx.save_for_backward(loc, scale, prior_loc)
    ctx.inv_var = None if unit_var else inv_var
    ctx.zero_mean = zero_mean
    return kl


def _kl_square_backward(ctx, grad):
    """``(∂/∂μ, ∂/∂σ of the square term, ½ g)`` of :func:`_kl_forward`."""
    loc, scale, prior_loc = ctx.saved_tensors
    half = grad * 0.5
    g = half if ctx.inv_var is None else half * ctx.inv_var
    twice_g = g * 2.0
    diff = loc if ctx.zero_mean else loc - prior_loc
    return diff * twice_g, scale * twice_g, half


def _exact_identities(prior_loc: torch.Tensor, inv_var: torch.Tensor) -> tuple[bool, bool]:
    """``(m is +0, s⁻² is 1)`` for a one-number CPU prior (reading a CUDA value would
    synchronise: there both are ``False`` and the general operations run)."""
    if prior_loc.device.type != "cpu" or inv_var.device.type != "cpu":
        return False, False
    m, v = float(prior_loc), float(inv_var)
    return m == 0.0 and math.copysign(1.0, m) > 0, v == 1.0


def can_fuse_kl(loc: torch.Tensor, scale: torch.Tensor, prior_loc: torch.Tensor,
                prior_scale: torch.Tensor) -> bool:
    """Whether :func:`normal_kl_node` applies: one-number prior parameters without gradient
    (a prior per weight, or one being learned by gradient, takes the autograd formula)."""
    return (not prior_loc.requires_grad and not prior_scale.requires_grad
            and prior_loc.numel() == 1 and prior_scale.numel() == 1
            and prior_loc.dim() <= loc.dim() and prior_scale.dim() <= loc.dim()
            and loc.shape == scale.shape)


def normal_kl_node(loc: torch.Tensor, scale: torch.Tensor, prior_loc: torch.Tensor,
                   prior_scale: torch.Tensor) -> torch.Tensor:
    """``Σ KL(N(μ, σ²) ‖ N(m, s²))`` as :func:`pyro_bnn.guides.meanfield.normal_kl` computes it
    (the same value and gradients, bit for bit), in one autograd node.

    Parameters
    ----------
    loc, scale : Tensor
        ``μ`` and ``σ`` (any graph behind them), same shape.
    prior_loc, prior_scale : Tensor
        One number each, no gradient (see :func:`can_fuse_kl`).

    Returns
    -------
    Tensor
        Scalar (0-dim).
    """
    return _NormalKL.apply(loc, scale, scale, prior_loc, prior_scale)


def normal_kl_node_log_scale(loc: torch.Tensor, scale: torch.Tensor, log_scale: torch.Tensor,
                             prior_loc: torch.Tensor, prior_scale: torch.Tensor) -> torch.Tensor:
    """``Σ KL(N(μ, σ²) ‖ N(m, s²))`` in one autograd node, with ``log σ`` given.

    For ``σ = exp(ρ)`` pass ``log_scale=ρ``: the log term then costs no pass over the weights
    and its gradient reaches ``ρ`` exactly (see :class:`_NormalKLLogScale`; ~1e-7 relative from
    :func:`normal_kl_node`, which takes ``log σ`` of ``σ``).

    Parameters
    ----------
    loc, scale, log_scale : Tensor
        ``μ``, ``σ`` and ``log σ`` (any graph behind them), same shape.
    prior_loc, prior_scale : Tensor
        One number each, no gradient (see :func:`can_fuse_kl`).

    Returns
    -------
    Tensor
        Scalar (0-dim).
    """
    return _NormalKLLogScale.apply(loc, scale, log_scale, prior_loc, prior_scale)


# ======================================= the closed-form KL of every site in one node (issue 27)
class _NormalKLLogScaleSites(torch.autograd.Function):
    """``Σ_sites`` of :class:`_NormalKLLogScale`, all sites in one autograd node.

    The elementwise passes over the weights run as ``torch._foreach_*`` operations over the
    sites' tensors (one multi-tensor kernel per operation on a GPU when every site has the same
    prior tensors; on the CPU the same per-tensor kernels in a C++ loop) and most of the 0-dim
    arithmetic on the prior's constants on stacked vectors, so a step makes about half the
    operations of the per-site nodes (~15 per site forward, ~7 backward).  Every site's value is the one
    :class:`_NormalKLLogScale` computes (the same floating-point operations on the same
    operands; elementwise arithmetic does not depend on how the elements are batched) and the
    sites are added left to right as ``0.0 + kl_1 + kl_2 + …``, so the sum and its gradients are
    bit for bit those of the per-site nodes on the CPU.  A double backward
    (``create_graph=True``) takes the per-site formulas.

    Called as ``apply(k, *locs, *scales, *log_scales, *prior_locs, *prior_scales)`` with ``k``
    sites; every prior parameter 0-dim (see :func:`can_fuse_kl_sites`).
    """

    @staticmethod
    def forward(ctx, k, *tensors):
        locs, scales, log_scales, prior_locs, prior_scales = (list(tensors[i * k:(i + 1) * k]) for i in range(5))
        inv_vars = torch.stack(prior_scales).reciprocal() ** 2
        identities = [_exact_identities(m, v) for m, v in zip(prior_locs, inv_vars.unbind())]
        # one prior for every site (the usual case): the multi-tensor operations take it as one
        # tensor (a GPU's fast path; a list of 0-dim tensors takes the per-tensor loop there)
        shared = all(m is prior_locs[0] for m in prior_locs) and all(s is prior_scales[0] for s in prior_scales)
        diffs = _diffs(locs, prior_locs, identities, shared)
        quads = list(torch._foreach_add(torch._foreach_pow(scales, 2), torch._foreach_pow(diffs, 2)))
        scaled = [i for i, (_, unit_var) in enumerate(identities) if not unit_var]
        if scaled:
            factors = inv_vars[0] if shared else [inv_vars[i] for i in scaled]
            for i, q in zip(scaled, torch._foreach_mul([quads[i] for i in scaled], factors)):
                quads[i] = q
        quad_sums = torch.stack([q.sum() for q in quads])
        log_sums = torch.stack([s.sum() for s in log_scales])
        # n (2 log s − 1) per site with n a Python number, as the per-site node multiplies it (a
        # tensor of the counts would be a host-to-device copy, a synchronisation, on a GPU)
        per_weight = (2.0 * torch.log(torch.stack(prior_scales)) - 1.0).unbind()
        constants = torch.stack([loc.numel() * c for loc, c in zip(locs, per_weight)])
        kls = (0.5 * (quad_sums - 2.0 * log_sums + constants)).unbind()
        total = 0.0 + kls[0]          # closed_form_kl's order: 0.0 + kl_1 + kl_2 + …
        for kl in kls[1:]:
            total = total + kl
        ctx.k, ctx.identities, ctx.shared = k, identities, shared
        ctx.log_shapes = [s.shape for s in log_scales]
        ctx.save_for_backward(*locs, *scales, *prior_locs, inv_vars)
        return total

    @staticmethod
    def backward(ctx, grad):
        k, identities = ctx.k, ctx.identities
        saved = ctx.saved_tensors
        locs, scales, prior_locs, inv_vars = list(saved[:k]), list(saved[k:2 * k]), saved[2 * k:3 * k], saved[-1]
        # each site's node received ``grad`` itself (the sum passes it on unchanged); per site
        # 2G = ((½ g) · s⁻²) · 2, the operations of _kl_square_backward
        half = grad * 0.5
        if all(unit_var for _, unit_var in identities):
            twice_g = half * 2.0
        elif ctx.shared:
            twice_g = half * inv_vars[0] * 2.0
        else:
            scaled = (half * inv_vars * 2.0).unbind()
            twice_g = [half * 2.0 if unit_var else scaled[i] for i, (_, unit_var) in enumerate(identities)]
        diffs = _diffs(locs, prior_locs, identities, ctx.shared)
        if torch.is_grad_enabled():   # a double backward: per-site operations, differentiable
            factors = twice_g if isinstance(twice_g, list) else [twice_g] * k
            grad_locs = [d * g for d, g in zip(diffs, factors)]
            grad_scales = [s * g for s, g in zip(scales, factors)]
        else:
            grad_locs = torch._foreach_mul(diffs, twice_g)
            grad_scales = torch._foreach_mul(scales, twice_g)
        neg = -grad
        grad_logs = [neg.expand(shape) for shape in ctx.log_shapes]
        return (None, *grad_locs, *grad_scales, *grad_logs, *([None] * (2 * k)))


def _diffs(locs, prior_locs, identities, shared: bool) -> list:
    """``μ − m`` per site, ``μ`` itself where ``m`` is +0 (an exact identity)."""
    shifted = [i for i, (zero_mean, _) in enumerate(identities) if not zero_mean]
    diffs = list(locs)
    if shifted and prior_locs[0].device.type != "cpu":
        # per site: torch._foreach_sub has no tensor-scalar form, so it would read a device
        # mean into a Python number (a synchronisation, which a CUDA graph capture refuses)
        for i in shifted:
            diffs[i] = locs[i] - prior_locs[i]
    elif shifted:
        means = prior_locs[0] if shared else [prior_locs[i] for i in shifted]
        for i, d in zip(shifted, torch._foreach_sub([locs[i] for i in shifted], means)):
            diffs[i] = d
    return diffs


def can_fuse_kl_sites(locs, scales, prior_locs, prior_scales) -> bool:
    """Whether :func:`normal_kl_sites_log_scale` applies: two or more sites, each one
    :func:`can_fuse_kl` takes with 0-dim prior parameters, all tensors on one device and dtype."""
    if len(locs) < 2:
        return False
    first = locs[0]
    for loc, scale, m, s in zip(locs, scales, prior_locs, prior_scales):
        if m.dim() or s.dim() or not can_fuse_kl(loc, scale, m, s):
            return False
        if any(t.device != first.device or t.dtype != first.dtype for t in (loc, scale, m, s)):
            return False
    return True


def normal_kl_sites_log_scale(locs, scales, log_scales, prior_locs, prior_scales) -> torch.Tensor:
    """``Σ_sites Σ KL(N(μ, σ²) ‖ N(m, s²))`` in one autograd node, ``log σ`` given per site.

    The same value and gradients, bit for bit on the CPU, as adding
    :func:`normal_kl_node_log_scale` of each site to ``0.0`` in order; fewer operations per step
    (``torch._foreach_*`` over the sites, see :class:`_NormalKLLogScaleSites`).

    Parameters
    ----------
    locs, scales, log_scales : sequence of Tensor
        Per site ``μ``, ``σ`` and ``log σ`` (any graph behind them), each site's three of one shape.
    prior_locs, prior_scales : sequence of Tensor
        Per site, 0-dim, no gradient (see :func:`can_fuse_kl_sites`).

    Returns
    -------
    Tensor
        Scalar (0-dim).
    """
    k = len(locs)
    return _NormalKLLogScaleSites.apply(k, *locs, *scales, *log_scales, *prior_locs, *prior_scales)
