"""Matplotlib figures for the uncertainty tools (pruning, OOD, FGSM, active learning, corruption).

Every function takes the dict/result the matching tool returns, draws one titled figure
with labelled axes and a legend and returns the ``Figure``: save it with
:func:`pyro_bnn.reporting.output_files.save_figure` (atomic, never replaces a file unasked) or
``fig.savefig``.  matplotlib is imported lazily (Agg backend when no display is configured).
"""

from __future__ import annotations

import os

__all__ = ["plot_pruning_curves", "plot_fgsm_curve", "plot_active_curves", "plot_corruption_curves",
           "plot_ood_scores"]


def _plt():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    if not os.environ.get("DISPLAY") and not os.environ.get("MPLBACKEND"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, ax, title, xlabel, ylabel, **legend_kw):
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(**legend_kw)
    fig.tight_layout()
    return fig


def plot_pruning_curves(curves: dict, *,
                        title: str = "Pruning by posterior uncertainty",
                        baseline: float | None = None):
    """Test accuracy (%) vs fraction of weights removed; ``curves`` maps a label to a
    :func:`pyro_bnn.analysis.pruning.pruning_curve` result."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in curves.items():
        ax.plot([100 * f for f in c["fraction"]], [100 * a for a in c["accuracy"]], "o-", label=label)
    if baseline is not None:
        ax.axhline(100 * baseline, color="gray", ls="--", label="unpruned")
    return _finish(fig, ax, title, "weights removed (%)", "test accuracy (%)")


def plot_fgsm_curve(curves: dict, *,
                    title: str = "FGSM: accuracy and uncertainty vs step size"):
    """Accuracy and mean predictive entropy vs ε; ``curves`` maps a label to a
    :func:`pyro_bnn.analysis.adversarial.fgsm_curve` result."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, c in curves.items():
        ax1.plot(c["epsilon"], c["accuracy"], "o-", label=label)
        ax2.plot(c["epsilon"], c["entropy"], "o-", label=f"{label} entropy")
        ax2.plot(c["epsilon"], c["mutual_information"], "s--", label=f"{label} MI")
    _finish(fig, ax1, "accuracy", "step size ε", "test accuracy")
    return _finish(fig, ax2, title, "step size ε", "mean uncertainty (nats)")


def plot_active_curves(results: dict, *, title: str = "Active learning"):
    """Test accuracy vs number of labels; ``results`` maps an acquisition name to a list
    of :class:`pyro_bnn.analysis.active.ActiveResult` (one per seed): mean ± std over seeds."""
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, runs in results.items():
        runs = runs if isinstance(runs, (list, tuple)) else [runs]
        acc = np.array([r.accuracy for r in runs]) * 100
        n = runs[0].num_labelled
        ax.plot(n, acc.mean(0), "o-", label=f"{label} (n={len(runs)})")
        ax.fill_between(n, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2)
    return _finish(fig, ax, title, "labelled examples", "test accuracy (%)")


def plot_corruption_curves(curves: dict, *, key: str = "entropy",
                           title: str | None = None, xlabel: str = "rotation angle (degrees)"):
    """Mean uncertainty ``key`` vs corruption level; ``curves`` maps a label (guide) to a
    :func:`pyro_bnn.analysis.corruption.corruption_curve` result."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4) if len(curves) <= 4 else (8, 4))
    for label, c in curves.items():
        ax.plot(c["level"], c[key], "o-", label=label)
    ylabel = {"entropy": "mean predictive entropy (nats)", "mutual_information": "mean mutual information (nats)",
              "accuracy": "test accuracy", "max_prob": "mean confidence"}.get(key, key)
    # many curves: legend to the right of the axes so it hides none of them
    legend = {} if len(curves) <= 4 else {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8}
    return _finish(fig, ax, title or f"{key.replace('_', ' ')} vs corruption", xlabel, ylabel, **legend)


def plot_ood_scores(results: dict, *, metric: str = "auroc",
                    title: str = "Out-of-distribution detection"):
    """Grouped bars of AUROC (or AUPR) per score; ``results`` maps a label (guide) to a
    :func:`pyro_bnn.analysis.ood.evaluate` result."""
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(results)
    scores = list(next(iter(results.values())))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        vals = [results[label][s][metric] for s in scores]
        ax.bar(np.arange(len(scores)) + i * width, vals, width, label=label)
    ax.set_xticks(np.arange(len(scores)) + 0.4 - width / 2)
    ax.set_xticklabels([s.replace("_", " ") for s in scores], rotation=15)
    ax.set_ylim(0, 1.25)
    return _finish(fig, ax, title, "uncertainty score", metric.upper(), loc="upper center",
                   ncol=min(5, len(labels)), fontsize=8)
