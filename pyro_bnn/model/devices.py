"""The one device rule: work happens where the model is.

Every entry point (``pb.fit``, ``pb.predict``/``pb.evaluate``, ``pb.to_arviz``, the data
checks, the main job's report and the analysis tools) asks :func:`module_device` where the
model lives and moves its inputs there; an explicit ``device=`` argument overrides it where a
function has one.
"""

from __future__ import annotations

import torch

__all__ = ["module_device"]


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
