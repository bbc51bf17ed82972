"""Laplace-GGN log marginal likelihood and its use for hyperparameter learning.

    log p(D | δ, σ) ≈ log p(D | θ*) + log p(θ* | δ) − ½ log det(P / 2π)
                    = log p(D | θ*) − ½ [ log det P − log det P₀ + θ*ᵀ P₀ θ* ],

``P = s·H + P₀``, ``P₀ = diag(δ)`` (zero prior mean), ``s = 1/σ²`` for a Gaussian
likelihood (whose factors use ``Λ = I``) and 1 otherwise.  Everything is a differentiable
function of ``δ`` and ``σ``, so post-hoc and online hyperparameter learning are plain
gradient ascent (Immer et al. 2021, Algorithm 1; MacKay 1992).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..arguments import check_int, check_positive

__all__ = ["log_evidence", "evidence_terms", "linearized_evidence_terms", "combine_evidence_terms", "log_likelihood_from_stats",
           "maximize_evidence", "marglik_due", "MarglikOptions", "check_marglik_options"]


@dataclass(frozen=True)
class MarglikOptions:
    """Options of the online evidence schedule, ``pb.fit(..., marglik=MarglikOptions(...))``.

    Every ``every`` epochs after ``burnin`` burn-in epochs, take ``steps`` Adam steps with
    learning rate ``lr`` on the log hyperparameters (Immer et al. 2021, Algorithm 1: F, B, K,
    γ); the defaults are theirs.  Fields are checked on construction: ``every`` (>= 1),
    ``burnin`` and ``steps`` (>= 0) must be ints (a fractional ``burnin=1.5`` or a bool is an
    error, not truncated), ``lr`` a finite number > 0 (stored as ``float``).

    Parameters
    ----------
    every : int
        Epochs between hyperparameter updates (F).
    burnin : int
        Epochs of plain MAP training before the first update (B).
    steps : int
        Adam steps on the log hyperparameters per update (K).
    lr : float
        Adam learning rate of those steps (γ); also that of a learnable augmentation's η.

    Examples
    --------
    >>> pb.fit(model, pb.guides.Laplace(model), data, epochs=100,           # doctest: +SKIP
    ...        marglik=pb.MarglikOptions(every=5, burnin=10, steps=50))
    """

    every: int = 1
    burnin: int = 0
    steps: int = 100
    lr: float = 0.1

    def __post_init__(self):
        for name, minimum in (("every", 1), ("burnin", 0), ("steps", 0)):
            object.__setattr__(self, name, check_int(f"MarglikOptions.{name}", getattr(self, name), minimum))
        object.__setattr__(self, "lr", check_positive("MarglikOptions.lr", self.lr))


def log_likelihood_from_stats(stats: dict, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_n log p(y_n|f_n)``: ``stats["loglik"]``, or for a Gaussian
    ``−sse/(2σ²) − count·log(σ√(2π))`` (differentiable in σ)."""
    if "loglik" in stats:
        return stats["loglik"]
    if noise is None:
        raise ValueError("a Gaussian log-likelihood needs the noise σ")
    return -0.5 * stats["sse"] / noise ** 2 - stats["count"] * (torch.log(noise) + 0.5 * math.log(2 * math.pi))


def evidence_terms(log_lik: torch.Tensor, blocks: Sequence, theta: Sequence[torch.Tensor],
                   prior_precision: Sequence[torch.Tensor], scale: torch.Tensor | float = 1.0) -> dict:
    """The three terms of the Laplace-GGN log evidence (0-d tensors, differentiable in δ and σ).

    Parameters
    ----------
    log_lik : Tensor, 0-d
        ``log p(D | θ*)``.
    blocks : sequence of KronBlock / DiagBlock / DenseBlock
        The curvature ``H`` (``P = s H + diag(δ)`` block-diagonal).
    theta : sequence of Tensor
        ``θ*`` per block, flattened (``(numel_b,)``).
    prior_precision : sequence of Tensor
        ``δ`` per block: 0-d or ``(numel_b,)``.
    scale : float or Tensor
        ``s`` (``1/σ²`` for a Gaussian likelihood).

    Returns
    -------
    dict of str to Tensor
        ``"log_likelihood"``: ``log p(D|θ*)`` (the fit); ``"log_det_ratio"``:
        ``Σ_b [log det P_b − log det P₀_b]`` (the Occam factor: how much the data sharpened
        the posterior over the prior); ``"scatter"``: ``Σ_b δ_b θ_b²`` (the prior's cost of
        the weights).  The evidence is ``log_likelihood − ½ (log_det_ratio + scatter)``
        (:func:`log_evidence`); laplace-torch names the last two terms the same way.
    """
    if not (len(blocks) == len(theta) == len(prior_precision)):
        raise ValueError(f"blocks, theta and prior_precision must have one entry per block, got "
                         f"{len(blocks)}, {len(theta)}, {len(prior_precision)}")
    _check_prior_precision(prior_precision)
    log_det_ratio = scatter = torch.zeros((), dtype=log_lik.dtype, device=log_lik.device)
    for block, th, delta in zip(blocks, theta, prior_precision):
        n = th.numel()
        log_det_prior = n * torch.log(delta) if delta.dim() == 0 else torch.log(delta).sum()
        log_det_ratio = log_det_ratio + (block.logdet(delta, scale) - log_det_prior)
        scatter = scatter + (delta * th.reshape(-1) ** 2).sum()
    return {"log_likelihood": log_lik, "log_det_ratio": log_det_ratio, "scatter": scatter}


def linearized_evidence_terms(log_lik: torch.Tensor, blocks: Sequence, theta: Sequence[torch.Tensor],
                              gradients: Sequence[torch.Tensor], prior_precision: Sequence[torch.Tensor],
                              scale: torch.Tensor | float = 1.0) -> dict:
    """The terms of the evidence of the linearised model at **its own** posterior mode.

    The GGN Laplace evidence (:func:`evidence_terms`) is evaluated at the network's weights
    ``θ*`` as if they were the mode of the posterior under the prior ``N(0, δ⁻¹)``.  They are
    not when training stopped early, when δ changed after training (every online evidence
    update), or when no mode exists at all: weights that feed a normalisation layer have a
    likelihood that does not depend on their norm, so under a Gaussian prior their "MAP"
    shrinks for ever.  Antorán et al. (2022, "Adapting the linearised Laplace model evidence
    for modern deep learning", recommendation 1) evaluate instead the evidence of the model
    linearised at ``θ*`` at that linear model's own mode.  Here the linearised model's
    negative log-likelihood is taken to second order at ``θ*`` (exact for a Gaussian
    likelihood, where the evidence then equals the closed-form evidence of the linear model
    for any ``θ*``; for a classifier the quadratic overstates the Newton step's fit where the
    GGN is small, so the Laplace guide refuses it there)::

        ℓ_lin(θ) = ℓ(θ*) − gᵀ(θ − θ*) − ½ (θ − θ*)ᵀ s H (θ − θ*),     g = ∇(−ℓ)(θ*)
        θ̂ = θ* − P⁻¹ (g + δ θ*)          (one Newton step; P = s H + δ)

    and the terms are ``ℓ_lin(θ̂)``, ``log det P − log det P₀`` and ``θ̂ᵀ δ θ̂``.  At a mode of
    the regularised loss (``g = −δ θ*``) ``θ̂ = θ*`` and the terms are those of
    :func:`evidence_terms`; elsewhere this evidence is never lower (``θ̂`` maximises the same
    quadratic of which :func:`evidence_terms` takes the value at ``θ*``).

    Parameters
    ----------
    log_lik : Tensor, 0-d
        ``log p(D | θ*)``.
    blocks : sequence of KronBlock / SplitBiasKronBlock / DiagBlock / DenseBlock
    theta : sequence of Tensor
        ``θ*`` per block, flattened.
    gradients : sequence of Tensor
        Per block, the gradient of the negative log-likelihood at ``θ*`` **divided by**
        ``s`` (``Σ_n J_nᵀ r_n`` of :attr:`~pyro_bnn.curvature.CurvatureFit.gradients`,
        flattened like ``theta``); it is multiplied by ``scale`` here, as ``H`` is.
    prior_precision : sequence of Tensor
        ``δ`` per block: 0-d or ``(numel_b,)``.
    scale : float or Tensor
        ``s``.

    Returns
    -------
    dict of str to Tensor
        ``"log_likelihood"`` (``ℓ_lin(θ̂)``), ``"log_det_ratio"``, ``"scatter"`` (``θ̂ᵀ δ θ̂``):
        combined by :func:`combine_evidence_terms` as the other evidence.
    """
    if len(gradients) != len(blocks):
        raise ValueError(f"gradients must have one entry per block, got {len(gradients)} for {len(blocks)} blocks")
    terms = evidence_terms(log_lik, blocks, theta, prior_precision, scale)   # its Occam factor is this one's
    fit, scatter = log_lik, torch.zeros((), dtype=log_lik.dtype, device=log_lik.device)
    for block, th, grad, delta in zip(blocks, theta, gradients, prior_precision):
        th, g = th.reshape(-1), scale * grad.reshape(-1)
        step = -block.solve(g + delta * th, delta, scale)          # θ̂ − θ*
        fit = fit - (g * step).sum() - 0.5 * (step * block.matvec(step, scale)).sum()
        scatter = scatter + (delta * (th + step) ** 2).sum()
    terms.update(log_likelihood=fit, scatter=scatter)
    return terms


def log_evidence(log_lik: torch.Tensor, blocks: Sequence, theta: Sequence[torch.Tensor],
                 prior_precision: Sequence[torch.Tensor], scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Laplace-GGN log evidence (a 0-d tensor).

    Parameters are those of :func:`evidence_terms`.

    Returns
    -------
    Tensor, 0-d
        ``log p(D|θ*) − ½ Σ_b [log det P_b − Σ log δ_b + Σ δ_b θ_b²]``: a **total** over
        the data set in nats (not per datum), the unit of every ``log_evidence`` in the
        library (``fit``'s history, :mod:`pyro_bnn.invariance`).
    """
    terms = evidence_terms(log_lik, blocks, theta, prior_precision, scale)
    return combine_evidence_terms(terms)


def combine_evidence_terms(terms: dict) -> torch.Tensor:
    """``log_likelihood − ½ (log_det_ratio + scatter)`` of :func:`evidence_terms`' dict."""
    return terms["log_likelihood"] - 0.5 * (terms["log_det_ratio"] + terms["scatter"])


def _check_prior_precision(prior_precision) -> None:
    """``ValueError`` unless every δ is finite and > 0 (``log δ`` is NaN otherwise)."""
    bad = [d for d in prior_precision if not bool((torch.isfinite(d) & (d > 0)).all())]
    if bad:
        d = bad[0].detach().reshape(-1)
        v = d[~(torch.isfinite(d) & (d > 0))][0].item()
        raise ValueError(f"the prior precision δ must be finite and > 0, got {v} "
                         "(the Laplace evidence needs log δ)")


class _NonFinite(Exception):
    """An evidence step left the finite region (caught by :func:`maximize_evidence`)."""


def maximize_evidence(evidence: Callable[[], torch.Tensor], params: list[torch.Tensor],
                      steps: int = 100, lr: float = 0.1, optimizer=None) -> float:
    """``steps`` Adam steps maximising ``evidence()`` w.r.t. the leaf tensors ``params``.

    ``optimizer`` may be an existing ``torch.optim.Optimizer`` over ``params`` (the online
    schedule keeps one across epochs).  Returns the final evidence.

    No non-finite value is kept: if a step makes the evidence, its gradient or a parameter
    non-finite (too large an ``lr``: ``δ = exp(log δ)`` overflows to inf or underflows to 0),
    ``params`` are restored to the last values whose evidence was finite, the steps stop and
    a ``RuntimeWarning`` says so; the evidence there is returned.
    """
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if optimizer is None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    opt = optimizer or torch.optim.Adam(params, lr=lr)
    last = [p.detach().clone() for p in params]
    for step in range(int(steps)):
        opt.zero_grad(set_to_none=True)
        try:
            value = _finite(evidence, step)
            (-value).backward()
            if not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params):
                raise _NonFinite("its gradient became non-finite")
            last = [p.detach().clone() for p in params]
            opt.step()
            if not all(bool(torch.isfinite(p).all()) for p in params):
                raise _NonFinite("a hyperparameter became non-finite")
        except _NonFinite as exc:
            with torch.no_grad():
                for p, v in zip(params, last):
                    p.copy_(v)
            opt.zero_grad(set_to_none=True)
            rate = f"lr={lr:g}" if optimizer is None else "the optimiser's lr"
            warnings.warn(f"evidence step {step + 1} of {int(steps)}: {exc}; the hyperparameters were "
                          f"restored to their last values with a finite evidence and the steps stopped. "
                          f"Use a smaller {rate}.", RuntimeWarning, stacklevel=2)
            break
    with torch.no_grad():
        return float(evidence())


def _finite(evidence, step):
    """``evidence()``; :class:`_NonFinite` if it is not finite, or (after the first step) if
    it refuses the hyperparameters a step produced (δ = 0 or inf)."""
    try:
        value = evidence()
    except ValueError as exc:
        if step == 0 or "prior precision" not in str(exc):
            raise
        raise _NonFinite(f"the prior precision left (0, inf) ({exc})") from None
    number = float(value.detach())
    if not math.isfinite(number):
        raise _NonFinite(f"the evidence became {number}")
    return value


def check_marglik_options(options) -> MarglikOptions | None:
    """``fit``'s ``marglik=`` checked: a :class:`MarglikOptions` (returned as is) or ``None``
    (no online evidence).  Anything else is a ``TypeError`` saying what to write."""
    if options is None or isinstance(options, MarglikOptions):
        return options
    hint = (f"; write marglik=pb.MarglikOptions(**{options!r})" if isinstance(options, dict)
            else "")
    raise TypeError(f"marglik must be a pyro_bnn.MarglikOptions or None, got "
                    f"{type(options).__name__}{hint}")


def marglik_due(epoch: int, options: MarglikOptions | None) -> bool:
    """Whether the online schedule updates hyperparameters after ``epoch`` (1-based)."""
    return (options is not None and epoch > options.burnin
            and (epoch - options.burnin) % options.every == 0)
