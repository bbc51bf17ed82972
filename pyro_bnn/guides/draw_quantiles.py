"""Pyro's ``quantiles`` / ``median`` for guides whose marginals have no closed form.

Pyro's ``AutoContinuous.quantiles`` reads a Gaussian's location and scale and raises a bare
``NotImplementedError`` for a normalizing flow; a KFAC Laplace posterior's marginal variances
need its dense blocks.  These helpers estimate per-coordinate quantiles from joint draws made
with their own seeded generator (the global random streams are not used), so the answer is
reproducible and training is not disturbed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..arguments import check_int

__all__ = ["QUANTILE_DRAWS", "QUANTILE_SEED", "check_quantiles", "column_quantiles", "gaussian_quantiles",
           "quantile_draws", "seeded_generator"]

#: Joint draws behind a Monte Carlo quantile: the 5 % quantile of a Gaussian marginal then has a
#: standard error of ≈ 0.07 of its σ, the median ≈ 0.04 σ.
QUANTILE_DRAWS = 1000

#: Seed of the draws' own generator.
QUANTILE_SEED = 20_261_204

#: ``torch.quantile`` refuses inputs of more elements than this; wider draws go in column chunks.
_QUANTILE_INPUT_LIMIT = 2 ** 24


def check_quantiles(quantiles: Iterable[float] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``quantiles`` as a 1-D tensor of the dtype and device of ``like``, each in [0, 1]."""
    try:
        q = torch.as_tensor(quantiles, dtype=like.dtype, device=like.device).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"quantiles must be a list of numbers in [0, 1], got {quantiles!r}") from exc
    if q.numel() == 0 or not bool(((q >= 0) & (q <= 1)).all()):
        raise ValueError(f"quantiles must be a non-empty list of numbers in [0, 1], got {quantiles!r}")
    return q


def quantile_draws(num_samples) -> int:
    """``num_samples`` checked: an int of at least 2 (one draw has no spread)."""
    return check_int("num_samples", num_samples, 2)


def seeded_generator(like: torch.Tensor, seed) -> torch.Generator:
    """A ``torch.Generator`` on ``like``'s device seeded by ``seed``."""
    return torch.Generator(device=like.device).manual_seed(int(check_int("seed", seed, 0)))


def column_quantiles(draws: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Empirical quantiles ``(Q, D)`` of the columns of ``draws`` ``(S, D)`` (linear interpolation)."""
    width = max(1, _QUANTILE_INPUT_LIMIT // draws.shape[0])
    return torch.cat([torch.quantile(part, q, dim=0) for part in draws.split(width, dim=1)], dim=1)


def gaussian_quantiles(loc: torch.Tensor, draws: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Quantiles ``(Q, D)`` of Gaussian marginals centred at ``loc`` ``(D,)`` whose spread is the
    root mean square of ``draws − loc`` ``(S, D)``: ``loc + σ̂ Φ⁻¹(q)`` (the median is ``loc``)."""
    sigma = (draws - loc).pow(2).mean(0).sqrt()
    z = math.sqrt(2.0) * torch.erfinv(2 * q - 1)
    return loc + z[:, None] * sigma
