"""Seeding without side effects: a seeded block leaves the caller's random streams as they were."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyro
import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed: int | None, *, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block with the random streams seeded by ``seed``; restore the caller's afterwards.

    Parameters
    ----------
    seed : int or None
        ``None``: do nothing (the block uses and advances the caller's streams).
    device : torch.device or str, optional
        Seed torch's stream only (``torch.manual_seed(seed)``, any int), forking the CPU stream
        and that device's: the cheap form for per-batch draws that are replayed
        (:mod:`pyro_bnn.invariance`'s augmentation draws, whose seeds exceed NumPy's range).
        Default (``None``): every stream, with a seed ``>= 0`` — torch on the CPU and on every
        CUDA device, Python's ``random`` and NumPy (``pyro.set_rng_seed``).

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
    if device is not None:
        device = torch.device(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(int(seed))
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
