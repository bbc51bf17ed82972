"""Seeding without side effects: a seeded block leaves the caller's random streams as they were."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyro
import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Run the block with all random streams seeded by ``seed``; restore the caller's afterwards.

    Parameters
    ----------
    seed : int or None
        ``None``: do nothing (the block uses and advances the caller's streams).

    Examples
    --------
    >>> with seeded(0):
    ...     a = torch.randn(2)
    >>> with seeded(0):
    ...     b = torch.randn(2)
    >>> bool((a == b).all())
    True
    """
    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    state = pyro.util.get_rng_state()
    with torch.random.fork_rng(devices=devices):
        try:
            pyro.set_rng_seed(seed)
            yield
        finally:
            pyro.util.set_rng_state(state)
