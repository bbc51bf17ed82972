"""Predictive metrics and uncertainty scores — pure functions on tensors.

Conventions: ``probs`` are Monte Carlo class probabilities of shape ``(S, N, C)`` (S
posterior samples); ``mean_probs`` are ``(N, C)``; labels ``y`` are ``(N,)`` integers.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "variation_ratio",
    "predicted_class_std",
    "accuracy",
    "negative_log_likelihood",
    "expected_calibration_error",
    "calibration_bins",
    "brier_score",
    "classification_metrics",
    "check_labels",
    "rmse",
    "gaussian_mixture_nll",
    "interval_coverage",
    "regression_metrics",
]

_EPS = 1e-12


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(_EPS))).sum(-1)


def predictive_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``H[p̄]`` with ``p̄ = mean_s p_s``; ``(S, N, C) -> (N,)`` in nats."""
    return _entropy(probs.mean(0))


def expected_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``mean_s H[p_s]`` (aleatoric part); ``(S, N, C) -> (N,)``."""
    return _entropy(probs).mean(0)


def mutual_information(probs: torch.Tensor) -> torch.Tensor:
    """BALD score ``H[p̄] − mean_s H[p_s]`` (epistemic part); ``(S, N, C) -> (N,)``, ≥ 0."""
    return (predictive_entropy(probs) - expected_entropy(probs)).clamp_min(0.0)


def variation_ratio(probs: torch.Tensor) -> torch.Tensor:
    """``1 − (count of the modal predicted class) / S``; ``(S, N, C) -> (N,)``."""
    s, n, c = probs.shape
    votes = torch.nn.functional.one_hot(probs.argmax(-1), c).sum(0)
    return 1.0 - votes.max(-1).values.to(probs.dtype) / s


def predicted_class_std(probs: torch.Tensor) -> torch.Tensor:
    """Std over samples of the probability of the predicted (argmax of ``p̄``) class."""
    pred = probs.mean(0).argmax(-1)
    picked = probs.gather(-1, pred.expand(probs.shape[0], -1).unsqueeze(-1)).squeeze(-1)
    return picked.std(0, unbiased=False)


def accuracy(mean_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of argmax predictions equal to ``y``."""
    return float((mean_probs.argmax(-1) == y).double().mean())


def negative_log_likelihood(mean_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean ``−log p̄(y_n)`` of the Bayesian model average."""
    p = mean_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return float(-torch.log(p.clamp_min(_EPS)).double().mean())


def calibration_bins(mean_probs: torch.Tensor, y: torch.Tensor, *, num_bins: int = 15):
    """Confidence, accuracy and count per equal-width confidence bin (for reliability plots).

    Returns
    -------
    conf, acc, count : Tensor, each ``(num_bins,)``
        Mean confidence and accuracy in each bin (0 where empty) and the bin counts.
    """
    conf, pred = mean_probs.max(-1)
    correct = (pred == y).double()
    conf = conf.double()
    edges = torch.linspace(0, 1, num_bins + 1, dtype=torch.float64, device=conf.device)
    idx = torch.bucketize(conf, edges[1:-1], right=False)
    count = torch.bincount(idx, minlength=num_bins).double()
    sum_conf = torch.bincount(idx, weights=conf, minlength=num_bins)
    sum_acc = torch.bincount(idx, weights=correct, minlength=num_bins)
    safe = count.clamp_min(1)
    return sum_conf / safe, sum_acc / safe, count


def expected_calibration_error(mean_probs: torch.Tensor, y: torch.Tensor, *, num_bins: int = 15) -> float:
    """ECE = ``Σ_b (n_b / N) |acc_b − conf_b|`` over ``num_bins`` equal-width bins."""
    conf, acc, count = calibration_bins(mean_probs, y, num_bins=num_bins)
    return float(((count / count.sum()) * (acc - conf).abs()).sum())


def brier_score(mean_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over examples of ``Σ_c (p̄_c − 1[y = c])²``."""
    onehot = torch.nn.functional.one_hot(y, mean_probs.shape[-1]).to(mean_probs.dtype)
    return float(((mean_probs - onehot) ** 2).sum(-1).double().mean())


def check_labels(y: torch.Tensor, num_classes: int, num_examples: int | None = None) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``y`` holds ``num_examples`` integer labels
    of shape ``(N,)`` in ``[0, num_classes)``; a float label would be truncated and a −1 or
    −100 would index from the end (``gather``) or be dropped (``cross_entropy``)."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(y).__name__}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(f"expected integer class labels, got dtype {y.dtype}")
    if y.dim() != 1 or (num_examples is not None and len(y) != num_examples):
        n = "N" if num_examples is None else num_examples
        raise ValueError(f"expected labels of shape ({n},), got {tuple(y.shape)}")
    if y.numel():
        lo, hi = (int(v) for v in torch.aminmax(y))
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"expected labels in [0, {num_classes - 1}], got labels in [{lo}, {hi}]")


def classification_metrics(probs: torch.Tensor, y: torch.Tensor, *, num_bins: int = 15) -> dict:
    """accuracy, nll, ece, brier of the model average of ``probs`` ``(S, N, C)``.

    ``y``: ``(N,)`` integer labels in ``[0, C)`` (:func:`check_labels`; other integer
    dtypes are used as int64)."""
    check_labels(y, probs.shape[-1], probs.shape[-2])
    y = y.long()
    mean_probs = probs.mean(0)
    return {
        "accuracy": accuracy(mean_probs, y),
        "nll": negative_log_likelihood(mean_probs, y),
        "ece": expected_calibration_error(mean_probs, y, num_bins=num_bins),
        "brier": brier_score(mean_probs, y),
    }


def rmse(loc: torch.Tensor, y: torch.Tensor) -> float:
    """RMSE of the predictive mean ``mean_s loc_s`` (``loc`` is ``(S, N, D)``)."""
    return float(((loc.mean(0) - y) ** 2).double().mean().sqrt())


def gaussian_mixture_nll(loc: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over points of ``−log (1/S) Σ_s N(y | loc_s, scale_s²)`` (summed over output dims).

    ``loc`` is ``(S, N)`` or ``(S, N, ...)``; ``y`` has the shape of one draw, ``loc.shape[1:]``.
    """
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device).expand_as(loc)
    lp = torch.distributions.Normal(loc, scale).log_prob(y.expand_as(loc))
    lp = lp.reshape(loc.shape[0], loc.shape[1], -1).sum(-1)
    return float(-(torch.logsumexp(lp, 0) - math.log(loc.shape[0])).double().mean())


def interval_coverage(loc: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, *,
                      level: float = 0.95) -> float:
    """Fraction of targets inside the central ``level`` interval of the predictive mixture.

    Uses the mixture CDF ``F(y) = mean_s Φ((y − loc_s)/scale_s)``: ``y`` is covered iff
    ``(1 − level)/2 ≤ F(y) ≤ (1 + level)/2`` — exact, no quantile sampling.
    """
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device).expand_as(loc)
    cdf = torch.distributions.Normal(loc, scale).cdf(y.expand_as(loc)).mean(0)
    lo, hi = (1 - level) / 2, (1 + level) / 2
    return float(((cdf >= lo) & (cdf <= hi)).double().mean())


def regression_metrics(loc: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> dict:
    """rmse, nll (Gaussian mixture), coverage_95 for predictive samples ``(S, N)`` or ``(S, N, D)``.

    ``y`` must have the shape of one draw, ``loc.shape[1:]``.
    """
    if loc.dim() < 2:
        raise ValueError(f"loc must be predictive draws of shape (S, N) or (S, N, D), got {tuple(loc.shape)}")
    if tuple(y.shape) != tuple(loc.shape[1:]):
        raise ValueError(f"targets of shape {tuple(y.shape)} do not match the predictive draws "
                         f"{tuple(loc.shape)} (expected {tuple(loc.shape[1:])})")
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"targets contain {int((~torch.isfinite(y)).sum())} NaN/inf values; "
                         "expected finite numbers")
    return {
        "rmse": rmse(loc, y),
        "nll": gaussian_mixture_nll(loc, scale, y),
        "coverage_95": interval_coverage(loc, scale, y, level=0.95),
    }
