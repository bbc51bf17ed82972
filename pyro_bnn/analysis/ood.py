"""Out-of-distribution detection from predictive uncertainty (BHN paper, §5.3).

A score ``s(x)`` (higher = "more out of distribution") is computed from Monte Carlo class
probabilities ``p_t`` (``(S, N, C)``) for in-distribution and OOD inputs; OOD inputs are
the positive class.  Detection quality is summarised threshold-free by AUROC and AUPR.

Scores: ``max_prob`` (``1 − max_c p̄_c``), ``entropy`` (``H[p̄]``), ``mutual_information``
(BALD), ``variation_ratio``, ``std`` (std over samples of the predicted class's
probability); see :mod:`pyro_bnn.posterior.metrics`.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..data.prediction_data import prediction_data, read_loader
from ..posterior import metrics
from ..posterior.prediction import predict_checked
from .tool_support import class_probabilities, seeded, to_model_device

__all__ = ["auroc", "aupr", "uncertainty_scores", "evaluate", "evaluate_probs", "SCORES"]

SCORES = ("max_prob", "entropy", "mutual_information", "variation_ratio", "std")


def _check(scores, labels):
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).cpu()
    labels = torch.as_tensor(labels).reshape(-1).cpu()
    if scores.shape != labels.shape:
        raise ValueError(f"scores and labels must have the same length, got {scores.numel()} "
                         f"and {labels.numel()}")
    if not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).sum())
        raise ValueError(f"{bad} of {scores.numel()} scores are NaN or infinite (e.g. from non-finite "
                         "predictive probabilities); a rank statistic would place them arbitrarily")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("labels must be 0 (negative / in-distribution) or 1 (positive / OOD)")
    labels = labels.bool()
    n_pos = int(labels.sum())
    if n_pos == 0 or n_pos == labels.numel():
        raise ValueError(f"need both positive and negative labels, got {n_pos} positives out "
                         f"of {labels.numel()}")
    return scores, labels


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: ``P(s⁺ > s⁻) + ½ P(s⁺ = s⁻)`` (Mann–Whitney U / n⁺n⁻).

    Parameters
    ----------
    scores : Tensor, shape (N,)
        Higher = more likely positive.
    labels : Tensor, shape (N,)
        1 for positives (OOD), 0 for negatives.

    Returns
    -------
    float
        1 for a perfect score, 0.5 for a constant or random one, 0 for a reversed one.
    """
    scores, labels = _check(scores, labels)
    ranks = _average_ranks(scores)
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks with ties sharing their average rank."""
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    n = x.numel()
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg = ends - (counts.double() - 1) / 2.0
    ranks_sorted = avg[inverse]
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = ranks_sorted
    return ranks


def aupr(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the precision–recall curve as average precision.

    ``AP = Σ_k (R_k − R_{k−1}) P_k`` over the distinct thresholds (scores sorted from
    high to low, tied scores entering together) — scikit-learn's
    ``average_precision_score``.  A random score gives about the positive rate.
    """
    scores, labels = _check(scores, labels)
    order = torch.argsort(-scores, stable=True)
    s, lab = scores[order], labels[order].double()
    tp = torch.cumsum(lab, 0)
    fp = torch.cumsum(1 - lab, 0)
    # keep the last index of each run of tied scores (a threshold admits all of them)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    tp, fp = tp[last], fp[last]
    precision = tp / (tp + fp)
    recall = tp / tp[-1]
    prev = torch.cat([torch.zeros(1, dtype=torch.float64), recall[:-1]])
    return float(((recall - prev) * precision).sum())


def uncertainty_scores(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """All OOD scores of Monte Carlo probabilities ``(S, N, C)``, each ``(N,)``; higher = more uncertain."""
    if probs.dim() != 3:
        raise ValueError(f"probs must have shape (S, N, C), got {tuple(probs.shape)}")
    return {
        "max_prob": 1.0 - probs.mean(0).max(-1).values,
        "entropy": metrics.predictive_entropy(probs),
        "mutual_information": metrics.mutual_information(probs),
        "variation_ratio": metrics.variation_ratio(probs),
        "std": metrics.predicted_class_std(probs),
    }


#: How :func:`evaluate` is named in messages.
WHERE = "pb.analysis.ood.evaluate"


def evaluate(model, guide, in_x, out_x, *, num_samples: int = 256,
             batch_size: int = 1024, predictive: str = "sample", seed: int | None = 0,
             **kwargs) -> dict[str, dict[str, float]]:
    """AUROC and AUPR of every uncertainty score for separating ``out_x`` from ``in_x``.

    Parameters
    ----------
    model, guide
        Trained classification model and guide.
    in_x, out_x : Tensor, shape (N, ...), or DataLoader
        In-distribution and out-of-distribution inputs (moved to the model's device), each a
        tensor or a ``DataLoader`` whose batches are ``x``, ``(x,)`` or ``(x, y)`` (a ``y`` is
        not read).  A loader is read once, each batch checked as :func:`pyro_bnn.predict` checks
        a loader's (:func:`pyro_bnn.data.prediction_data.read_loader`); the scores are those of
        its inputs as a tensor, bit for bit at the same ``seed``.  A shuffled loader gives each
        input the same scores up to rounding (their order does not enter them), so the same
        AUROC and AUPR but where two scores equal up to rounding change places (on 60 + 60
        digits: the mutual information's AUROC moved by one pair, 1/3600).
    num_samples : int
        Posterior draws S per input.  The Monte Carlo error of the per-input scores
        (mutual information above all) lowers their AUROC: for mean-field posteriors whose
        σ has relaxed towards an N(0, 1) prior, the digits 0–4 vs 5–9 MI AUROC rose by up to
        0.045 from S = 64 to S = 1024 (``docs/results/uncertainty.md``); use ~1000 where
        affordable.
    predictive : str
        The predictive, passed to :func:`pyro_bnn.predict` (``"sample"``, or e.g. a
        Laplace guide's ``"glm"``).
    seed : int, optional
        Seeds the posterior draws (reproducible scores) without touching the caller's random
        streams; ``None`` draws from them.
    **kwargs
        Passed to :func:`pyro_bnn.predict` (e.g. ``link_approx`` for Laplace's ``"glm"``).

    Returns
    -------
    dict
        ``{score: {"auroc", "aupr" (OOD positive), "aupr_in" (in-distribution positive),
        "mean_in", "mean_out"}}`` for every score in :data:`SCORES`.

    Raises
    ------
    TypeError, ValueError
        ``in_x`` or ``out_x`` neither a tensor nor a ``DataLoader``, or of another shape or
        dtype per example than the other; inputs the model cannot take; a loader that yields no
        batch or batches of another structure.

    Examples
    --------
    >>> res = pb.analysis.ood.evaluate(model, guide, x_test_0to4, x_test_5to9)   # doctest: +SKIP
    >>> res["mutual_information"]["auroc"]                               # doctest: +SKIP
    """
    in_x, out_x, x = _inputs(model, in_x, out_x)
    with seeded(seed):
        probs = predict_checked(model, guide, to_model_device(model, guide, x), num_samples=num_samples,
                                batch_size=batch_size, predictive=predictive, **kwargs)
    if probs.dim() == 2:  # deterministic predictive (N, C)
        probs = probs.unsqueeze(0)
    probs = class_probabilities(model, guide, probs)
    labels = torch.cat([torch.zeros(len(in_x)), torch.ones(len(out_x))])
    return evaluate_probs(probs.cpu(), labels)


def _inputs(model, in_x, out_x):
    """``(in_x, out_x, x)``: the two sets as tensors (a loader read once, its batches checked),
    ``x`` their concatenation; the sets given as tensors are checked together (one look for
    unscaled pixels, as :func:`pyro_bnn.predict` on ``x``)."""
    given = {"in_x": in_x, "out_x": out_x}
    read = {name: read_loader(model, t, where=f"{WHERE} ({name})", targets=False)[0]
            for name, t in given.items() if isinstance(t, DataLoader)}
    in_x, out_x = read.get("in_x", in_x), read.get("out_x", out_x)
    _check_same_inputs(in_x, out_x)
    tensors = [t for name, t in (("in_x", in_x), ("out_x", out_x)) if name not in read]
    if tensors:
        prediction_data(model, torch.cat(tensors), where=WHERE, targets=False)
    return in_x, out_x, torch.cat([in_x, out_x])


def _check_same_inputs(in_x, out_x) -> None:
    """``TypeError``/``ValueError`` unless both sets are tensors of the same per-example
    shape and dtype: one model scores both (torch's ``cat`` said only "Tensors must have same
    number of dimensions: got 4 and 2" for Fashion-MNIST images and MNIST loaded flat)."""
    for name, t in (("in_x", in_x), ("out_x", out_x)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise TypeError(f"{name} in {WHERE} must be a tensor of inputs (N, ...) or a DataLoader of x or "
                            "(x, y) batches, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else 'a 0-d tensor'}")
    if in_x.shape[1:] != out_x.shape[1:] or in_x.dtype != out_x.dtype:
        hint = (" (load both with the same flatten=, e.g. pb.datasets.mnist(root, flatten=False) for "
                "a CNN's images)" if in_x.shape[1:] != out_x.shape[1:] and in_x.shape[1:].numel() == out_x.shape[1:].numel()
                else "")
        raise ValueError(f"in_x and out_x go through the same model, so each example must have the same "
                         f"shape and dtype: got in_x {tuple(in_x.shape)} {in_x.dtype} and out_x "
                         f"{tuple(out_x.shape)} {out_x.dtype}{hint}")


def evaluate_probs(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, dict[str, float]]:
    """:func:`evaluate` on given probabilities ``(S, N, C)`` and OOD labels ``(N,)``."""
    out = {}
    labels = torch.as_tensor(labels).reshape(-1)
    for name, s in uncertainty_scores(probs).items():
        s = s.double().cpu()
        out[name] = {
            "auroc": auroc(s, labels),
            "aupr": aupr(s, labels),
            "aupr_in": aupr(-s, 1 - labels),
            "mean_in": float(s[labels == 0].mean()),
            "mean_out": float(s[labels == 1].mean()),
        }
    return out
