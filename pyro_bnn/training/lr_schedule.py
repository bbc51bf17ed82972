"""Learning-rate schedules of :func:`pyro_bnn.fit` (and ``learn_invariance``): the named
schedules, a per-step ``LambdaLR``, and the checks that a schedule's factors are finite and >= 0."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["lr_factor_function", "make_lr_scheduler", "probe_lr_schedule", "checked_factor"]


def lr_factor_function(lr_schedule):
    """``factor(fraction_done) -> float`` for an ``lr_schedule`` argument of :func:`fit`."""
    if callable(lr_schedule):
        return lr_schedule
    if lr_schedule == "constant":
        return lambda frac: 1.0
    if lr_schedule == "cosine":
        return lambda frac: 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"lr_schedule must be 'constant', 'cosine' or a callable, got {lr_schedule!r}")


def make_lr_scheduler(optimizer, lr_schedule, total_steps: int):
    """A per-step ``LambdaLR`` applying :func:`lr_factor_function` over ``total_steps`` steps."""
    factor = lr_factor_function(lr_schedule)
    total = max(int(total_steps), 1)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: checked_factor(factor, min(step, total - 1) / total))


def probe_lr_schedule(lr_schedule) -> None:
    """Check a callable schedule at 64 fractions of the fit before anything is set up."""
    factor = lr_factor_function(lr_schedule)
    if callable(lr_schedule):
        for k in range(64):
            checked_factor(factor, k / 64)


def checked_factor(factor, fraction: float) -> float:
    """``factor(fraction)`` as a float, which must be finite and >= 0."""
    value = factor(fraction)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"lr_schedule must return a number, got {value!r} ({type(value).__name__}) at "
                        f"fraction {fraction:.4g} of the fit")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"lr_schedule returned {value!r} at fraction {fraction:.4g} of the fit; a "
                         "learning-rate factor must be a finite number >= 0 (a negative one trains uphill)")
    return float(value)
