"""The one device rule: work happens where the model is.

Every entry point (``pb.fit``, ``pb.predict``/``pb.evaluate``, ``pb.to_arviz``, the data
checks, the main job's report and the analysis tools) asks :func:`module_device` where the
model lives and moves its inputs there; an explicit ``device=`` argument overrides it where a
function has one.
"""

from __future__ import annotations

import os

import torch

__all__ = ["module_device", "device_memory_bytes"]


def module_device(*modules, default: torch.device | str | None = "cpu") -> torch.device | None:
    """The device of the first parameter or buffer of the first of ``modules`` that has one.

    Parameters
    ----------
    *modules : torch.nn.Module or object
        Checked in order (e.g. ``model, guide``); objects that are not modules are skipped.
    default : torch.device, str or None
        Returned when no module holds a tensor (a hand-written model without parameters,
        a guide not set up yet); ``None``: return ``None`` (the data checks then leave the
        tensors where they are).

    Returns
    -------
    torch.device or None
    """
    for module in modules:
        if isinstance(module, torch.nn.Module):
            for t in module.parameters():
                return t.device
            for t in module.buffers():
                return t.device
    return None if default is None else torch.device(default)


def device_memory_bytes(device: torch.device | str) -> int | None:
    """Total memory of ``device``: a CUDA device's own, the machine's physical memory for the
    CPU; ``None`` where it cannot be read (other devices, platforms without ``sysconf``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None
