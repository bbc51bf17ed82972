"""The one device rule: work happens where the model is.

Every entry point (``pb.fit``, ``pb.predict``/``pb.evaluate``, ``pb.to_arviz``, the main
job's report and the analysis tools) asks :func:`module_device` where the model lives and
moves its inputs there; an explicit ``device=`` argument overrides it where a function has one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["module_device", "flush_denormals", "flushing_denormals"]


def module_device(*modules, default: torch.device | str = "cpu") -> torch.device:
    """The device of the first parameter or buffer of the first of ``modules`` that has one.

    Parameters
    ----------
    *modules : torch.nn.Module or object
        Checked in order (e.g. ``model, guide``); objects that are not modules are skipped.
    default : torch.device or str
        Returned when no module holds a tensor (a hand-written model without parameters,
        a guide not set up yet).

    Returns
    -------
    torch.device
    """
    for module in modules:
        if isinstance(module, torch.nn.Module):
            for t in module.parameters():
                return t.device
            for t in module.buffers():
                return t.device
    return torch.device(default)


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
