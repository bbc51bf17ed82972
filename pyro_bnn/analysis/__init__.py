"""Analysis tools for a trained posterior: pruning by signal-to-noise, out-of-distribution
detection, adversarial robustness, active learning, corruption sweeps, and their plots.

Each tool takes ``(model, guide, ...)`` for any guide, moves inputs to the model's device,
and seeds its own random streams without touching the caller's (``seed=``):
``pb.analysis.pruning``, ``pb.analysis.ood``, ``pb.analysis.adversarial``,
``pb.analysis.active`` and ``pb.analysis.corruption``; ``uncertainty_plots`` (matplotlib) is
imported on first use.
"""

from __future__ import annotations

import importlib

from . import active, adversarial, corruption, ood, pruning

__all__ = ["active", "adversarial", "corruption", "ood", "pruning", "uncertainty_plots"]


def __getattr__(name: str):
    if name == "uncertainty_plots":      # matplotlib only when plots are asked for
        return importlib.import_module(f"{__name__}.uncertainty_plots")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
