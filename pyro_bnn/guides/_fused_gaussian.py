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

import torch
import torch.nn.functional as F

__all__ = ["sample_and_kl", "can_fuse"]


def can_fuse(loc: torch.Tensor, prior_loc: torch.Tensor, prior_scale: torch.Tensor) -> bool:
    """Whether :func:`sample_and_kl` applies: the prior's parameters take no gradient and
    broadcast to the site's shape."""
    if prior_loc.requires_grad or prior_scale.requires_grad:
        return False
    try:
        shape = torch.broadcast_shapes(loc.shape, prior_loc.shape, prior_scale.shape)
    except RuntimeError:
        return False
    return shape == loc.shape


def _is_zero_on_cpu(t: torch.Tensor) -> bool:
    # Only checked for one-number CPU tensors: reading a CUDA value would synchronise.
    return t.device.type == "cpu" and t.numel() == 1 and float(t) == 0.0


def _kl_terms(loc, sigma, prior_loc, prior_scale):
    """``(μ − m, 1/s², Σ (σ² + (μ − m)²) / s², Σ log s)`` for the closed-form KL."""
    # μ − m; skipped (one pass less each way) for the usual zero-mean prior
    diff = loc if _is_zero_on_cpu(prior_loc) else loc - prior_loc
    inv_var = prior_scale.reciprocal().square()
    if inv_var.numel() == 1:
        s, d = sigma.reshape(-1), diff.reshape(-1)
        quad = (torch.dot(s, s) + torch.dot(d, d)) * inv_var.reshape(())
        log_prior_scale = loc.numel() * prior_scale.log().reshape(())
    else:
        quad = (torch.addcmul(sigma.square(), diff, diff) * inv_var).sum()
        log_prior_scale = prior_scale.log().expand(loc.shape).sum()
    return diff, inv_var, quad, log_prior_scale


class _SampleAndKLExp(torch.autograd.Function):
    """``σ = exp(ρ)``: no transcendental pass besides the ``exp`` (``log σ = ρ``)."""

    @staticmethod
    def forward(ctx, loc, rho, eps, prior_loc, prior_scale):
        sigma = rho.exp()
        w = torch.addcmul(loc, sigma, eps)
        diff, inv_var, quad, log_prior_scale = _kl_terms(loc, sigma, prior_loc, prior_scale)
        kl = 0.5 * quad - rho.sum() + log_prior_scale - 0.5 * loc.numel()
        ctx.save_for_backward(sigma, eps, diff, inv_var)
        return w, kl

    @staticmethod
    def backward(ctx, grad_w, grad_kl):
        sigma, eps, diff, inv_var = ctx.saved_tensors
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
        diff, inv_var, quad, log_prior_scale = _kl_terms(loc, sigma, prior_loc, prior_scale)
        kl = 0.5 * quad - sigma.log().sum() + log_prior_scale - 0.5 * loc.numel()
        ctx.save_for_backward(rho, sigma, eps, diff, inv_var)
        return w, kl

    @staticmethod
    def backward(ctx, grad_w, grad_kl):
        rho, sigma, eps, diff, inv_var = ctx.saved_tensors
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
