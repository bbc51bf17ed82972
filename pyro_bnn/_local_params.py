"""Run Pyro with parameters kept in modules (``module_local_params``), whatever the user set.

Pyro's global parameter store keys parameters by name, so two guides with the same
structure (``AutoNormal.locs.net.0.weight``) silently share values.  pyro_bnn runs its own
loops in Pyro's module-local mode instead.  A ``PyroModule`` created while that mode was off
lacks the per-context state the mode needs; :func:`local_params` adds it.
"""

from __future__ import annotations

from contextlib import contextmanager

import pyro
import torch

__all__ = ["local_params", "prepare_local_params"]


def prepare_local_params(*modules) -> None:
    """Give ``PyroModule``s created while ``module_local_params`` was off the per-context
    state that the mode needs (Pyro creates it only for modules built in the mode)."""
    for module in modules:
        if isinstance(module, torch.nn.Module):
            for m in module.modules():
                ctx = getattr(m, "_pyro_context", None)
                if ctx is not None and not hasattr(ctx, "param_state"):
                    ctx.param_state = {"params": {}, "constraints": {}}


@contextmanager
def local_params(*modules):
    """Enable ``module_local_params`` for the block, preparing ``modules`` for it."""
    prepare_local_params(*modules)
    with pyro.settings.context(module_local_params=True):
        yield
