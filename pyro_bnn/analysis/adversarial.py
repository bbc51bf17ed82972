"""Adversarial examples (FGSM) against a Bayesian network, and uncertainty vs step size.

Fast gradient sign method (Goodfellow et al. 2015) with the gradient taken through the
posterior predictive of ``n`` posterior draws (the BHN paper's adversarial-detection
experiment uses one draw):

    x_adv = clip(x + ε · sign(∇_x L(x, y))),   L = −Σ_n log( (1/n) Σ_t p(y_n | x_n, w_t) ),

with ``w_1..w_n`` drawn from the guide.  ``n = 1`` attacks one sampled network; larger
``n`` attacks the Monte Carlo model average.  The attack needs weight draws to
differentiate through, so it always uses the sampled predictive (no ``predictive=``).

Inputs are moved to the model's device, and ``x_adv`` is returned there.

:func:`fgsm_curve` scores a test set and takes it as tensors or as a ``DataLoader`` of
``(x, y)`` batches (read once, :func:`pyro_bnn.data.prediction_data.read_loader`; the attack then
differentiates the gathered tensors).  :func:`fgsm` and :func:`fgsm_from_latents` return the
attacked inputs themselves, ``x_adv`` paired row by row with ``x``: they take tensors only, and
refuse a loader (whose order, shuffled or not, the caller would have to reconstruct).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..data.prediction_data import prediction_data
from ..posterior import metrics
from ..posterior.draws import draw_latents, probs_from_latents
from .tool_support import seeded, to_model_device

__all__ = ["fgsm", "fgsm_from_latents", "fgsm_curve"]


def _check_eps(epsilon):
    if not isinstance(epsilon, (int, float)) or epsilon < 0:
        raise ValueError(f"epsilon must be a non-negative number, got {epsilon!r}")


def _check_tensors(x, y, where: str) -> None:
    """``TypeError`` unless ``x`` and ``y`` are tensors, naming what was received (a
    ``DataLoader`` with the way to score one: :func:`fgsm_curve`)."""
    for name, t in (("x", x), ("y", y)):
        if isinstance(t, torch.Tensor):
            continue
        hint = ("; the attack returns the perturbed inputs paired row by row with x, so it takes tensors: "
                "stack the loader's batches (x, y = map(torch.cat, zip(*loader))), or score a loader with "
                "fgsm_curve" if isinstance(t, DataLoader) else "")
        raise TypeError(f"{name} in {where} must be a torch.Tensor, got {type(t).__name__}{hint}")


def fgsm_from_latents(model, latents: list[dict], x: torch.Tensor, y: torch.Tensor, *,
                      epsilon: float, clamp: tuple[float, float] | None = None,
                      batch_size: int = 1024) -> torch.Tensor:
    """FGSM inputs with the gradient of the predictive NLL under the given weight draws
    (``x``, ``y``: tensors; a ``DataLoader`` is refused, see the module docstring)."""
    _check_tensors(x, y, "pb.analysis.adversarial.fgsm_from_latents")
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
        Inputs (a tensor: ``x_adv`` is paired with it row by row; a ``DataLoader`` is refused,
        see the module docstring).
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

    Raises
    ------
    TypeError
        ``x`` or ``y`` is not a tensor (a ``DataLoader`` included).
    """
    _check_tensors(x, y, "pb.analysis.adversarial.fgsm")
    _check_eps(epsilon)
    x, y = to_model_device(model, guide, x, y)
    if epsilon == 0:
        return x.clone()
    with seeded(seed):
        latents = draw_latents(model, guide, x, num_samples=num_samples)
    return fgsm_from_latents(model, latents, x, y, epsilon=epsilon, clamp=clamp, batch_size=batch_size)


def fgsm_curve(model, guide, x, y: torch.Tensor | None = None, *, epsilons=(0.0, 0.05, 0.1, 0.2, 0.3),
               num_samples: int = 1, eval_num_samples: int = 32, clamp: tuple[float, float] | None = None,
               seed: int | None = 0, batch_size: int = 1024) -> dict[str, list[float]]:
    """Accuracy and uncertainty of the posterior predictive on FGSM inputs vs step size.

    The attack draws (``num_samples``) and the evaluation draws (``eval_num_samples``) are fixed
    once (seeded by ``seed`` without touching the caller's random streams), so the curve
    changes with ε only through the inputs.

    Parameters
    ----------
    model, guide
        Trained classification model and guide.
    x : Tensor, shape (N, ...), or DataLoader
        Test inputs, or a ``DataLoader`` of the test set yielding ``(x, y)`` batches, read once
        and each batch checked as :func:`pyro_bnn.evaluate` reads one
        (:func:`pyro_bnn.data.prediction_data.read_loader`); the attack differentiates the
        gathered tensors, and the curve is that of the same tensors, bit for bit at the same
        ``seed``.  A shuffled loader gives the same curve up to rounding (means over the examples).
    y : Tensor, shape (N,), optional
        Labels of tensor ``x``; not with a loader (its batches hold them).
    epsilons : sequence of float
        Step sizes ε ≥ 0.
    num_samples, eval_num_samples : int
        Posterior draws attacked, and draws of the evaluated predictive.
    clamp : (float, float), optional
        Valid input range.
    seed : int, optional
        Seeds both sets of draws (``None``: the caller's streams).
    batch_size : int
        Inputs per forward pass.

    Returns
    -------
    dict
        Lists over ``epsilon``: ``accuracy``, ``nll``, mean ``entropy``,
        ``mutual_information``, ``variation_ratio``, ``max_prob`` (mean confidence).

    Raises
    ------
    TypeError, ValueError
        ``x`` neither a tensor nor a ``DataLoader``, tensor ``x`` without ``y``, ``y`` with a
        loader, a loader's batch without labels, an empty loader, inputs or labels the model
        cannot take; a negative ε.
    """
    for e in epsilons:
        _check_eps(e)
    x, y = prediction_data(model, x, y, where="pb.analysis.adversarial.fgsm_curve", targets=True)
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
