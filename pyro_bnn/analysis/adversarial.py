"""Adversarial examples (FGSM) against a Bayesian network, and uncertainty vs step size.

Fast gradient sign method (Goodfellow et al. 2015) with the gradient taken through the
posterior predictive of ``n`` posterior draws (the BHN paper's adversarial-detection
experiment uses one draw):

    x_adv = clip(x + ε · sign(∇_x L(x, y))),   L = −Σ_n log( (1/n) Σ_t p(y_n | x_n, w_t) ),

with ``w_1..w_n`` drawn from the guide.  ``n = 1`` attacks one sampled network; larger
``n`` attacks the Monte Carlo model average.  The attack needs weight draws to
differentiate through, so it always uses the sampled predictive (no ``predictive=``).

Inputs are moved to the model's device, and ``x_adv`` is returned there.
"""

from __future__ import annotations

import torch

from ..posterior import metrics
from ..posterior.draws import draw_latents, probs_from_latents
from .tool_support import seeded, to_model_device

__all__ = ["fgsm", "fgsm_from_latents", "fgsm_curve"]


def _check_eps(epsilon):
    if not isinstance(epsilon, (int, float)) or epsilon < 0:
        raise ValueError(f"epsilon must be a non-negative number, got {epsilon!r}")


def fgsm_from_latents(model, latents: list[dict], x: torch.Tensor, y: torch.Tensor, *,
                      epsilon: float, clamp: tuple[float, float] | None = None,
                      batch_size: int = 1024) -> torch.Tensor:
    """FGSM inputs with the gradient of the predictive NLL under the given weight draws."""
    _check_eps(epsilon)
    x, y = to_model_device(model, None, x, y)
    if epsilon == 0:
        return x.clone()
    x_req = x.detach().clone().requires_grad_(True)
    probs = probs_from_latents(model, latents, x_req, batch_size=batch_size, grad=True).mean(0)
    p_y = probs.gather(-1, y.to(probs.device).reshape(-1, 1)).squeeze(-1)
    loss = -torch.log(p_y.clamp_min(1e-12)).sum()
    (grad,) = torch.autograd.grad(loss, x_req)
    x_adv = x.detach() + epsilon * grad.sign()
    if clamp is not None:
        x_adv = x_adv.clamp(*clamp)
    return x_adv


def fgsm(model, guide, x: torch.Tensor, y: torch.Tensor, *, epsilon: float, num_samples: int = 1,
         clamp: tuple[float, float] | None = None, batch_size: int = 1024,
         seed: int | None = None) -> torch.Tensor:
    """Adversarial inputs by one FGSM step.

    Parameters
    ----------
    model, guide
        Trained classification model and guide.
    x : Tensor, shape (N, ...)
        Inputs.
    y : Tensor, shape (N,)
        True labels (the attack increases their NLL).
    epsilon : float
        Step size ε ≥ 0 (in input units, L∞); ``0`` returns a copy of ``x``.
    num_samples : int
        Posterior draws n whose averaged predictive is attacked.
    clamp : (float, float), optional
        Valid input range, e.g. ``(0, 1)`` for pixels.
    seed : int, optional
        Seeds the attacked draws without touching the caller's random streams
        (``None``: draw from them).

    Returns
    -------
    Tensor
        ``x_adv``, same shape as ``x``, on the model's device; ``|x_adv − x|_∞ ≤ ε``.
    """
    _check_eps(epsilon)
    x, y = to_model_device(model, guide, x, y)
    if epsilon == 0:
        return x.clone()
    with seeded(seed):
        latents = draw_latents(model, guide, x, num_samples=num_samples)
    return fgsm_from_latents(model, latents, x, y, epsilon=epsilon, clamp=clamp, batch_size=batch_size)


def fgsm_curve(model, guide, x: torch.Tensor, y: torch.Tensor, *, epsilons=(0.0, 0.05, 0.1, 0.2, 0.3),
               num_samples: int = 1, eval_num_samples: int = 32, clamp: tuple[float, float] | None = None,
               seed: int | None = 0, batch_size: int = 1024) -> dict[str, list[float]]:
    """Accuracy and uncertainty of the posterior predictive on FGSM inputs vs step size.

    The attack draws (``num_samples``) and the evaluation draws (``eval_num_samples``) are fixed
    once (seeded by ``seed`` without touching the caller's random streams), so the curve
    changes with ε only through the inputs.

    Returns
    -------
    dict
        Lists over ``epsilon``: ``accuracy``, ``nll``, mean ``entropy``,
        ``mutual_information``, ``variation_ratio``, ``max_prob`` (mean confidence).
    """
    for e in epsilons:
        _check_eps(e)
    x, y = to_model_device(model, guide, x, y)
    with seeded(seed):
        attack = draw_latents(model, guide, x, num_samples=num_samples)
        evaluation = draw_latents(model, guide, x, num_samples=eval_num_samples)
    out = {k: [] for k in ("epsilon", "accuracy", "nll", "entropy", "mutual_information",
                           "variation_ratio", "max_prob")}
    for e in epsilons:
        x_adv = fgsm_from_latents(model, attack, x, y, epsilon=float(e), clamp=clamp, batch_size=batch_size)
        probs = probs_from_latents(model, evaluation, x_adv, batch_size=batch_size)
        mean = probs.mean(0)
        y_ = y.to(mean.device)
        out["epsilon"].append(float(e))
        out["accuracy"].append(metrics.accuracy(mean, y_))
        out["nll"].append(metrics.negative_log_likelihood(mean, y_))
        out["entropy"].append(float(metrics.predictive_entropy(probs).mean()))
        out["mutual_information"].append(float(metrics.mutual_information(probs).mean()))
        out["variation_ratio"].append(float(metrics.variation_ratio(probs).mean()))
        out["max_prob"].append(float(mean.max(-1).values.mean()))
    return out
