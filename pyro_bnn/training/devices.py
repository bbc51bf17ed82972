"""CPU arithmetic modes for training: flushing denormal floats to zero.

Where work happens (the device of the model) is :func:`pyro_bnn.model.devices.module_device`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["flush_denormals", "flushing_denormals"]


def flushing_denormals() -> bool:
    """Whether CPU arithmetic currently flushes denormal floats to zero (probed: torch has
    no getter for the flag that ``torch.set_flush_denormal`` sets)."""
    tiny = torch.tensor([torch.finfo(torch.float32).tiny])
    return bool((tiny / 2 == 0).item())


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush denormal floats to zero on the CPU inside the block; the previous mode after.

    Long CPU fits otherwise slow down several-fold once weights that only the prior pulls
    on (e.g. those of always-blank MNIST pixels) decay into the denormal range, where every
    arithmetic operation on them takes a slow path (``docs/training.md``).  Values below
    1.2e-38 (float32) become 0, far below anything a posterior can resolve.
    """
    before = flushing_denormals()
    if not torch.set_flush_denormal(True):      # a CPU without the flag: nothing to do
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(before)
