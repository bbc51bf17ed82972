"""The optimiser :func:`pyro_bnn.fit` builds: Adam (fused where it can be) over the trained
parameters of model and guide, with the guide's per-parameter learning-rate factors as
parameter groups."""

from __future__ import annotations

import math

import torch

__all__ = ["default_optimizer", "parameter_groups", "trained_parameters"]


def default_optimizer(params, lr: float, factors=()) -> torch.optim.Optimizer:
    """Adam, fused (one kernel for all parameters) where the parameters allow it.

    ``factors``: ``(parameter, factor)`` pairs (the guide's ``learning_rate_factors()``)
    trained at ``factor × lr`` in their own parameter groups; the rest at ``lr``.
    On a 478k-weight MLP the fused step measured ~30× faster than the default per-tensor
    loop on CPU, which matters for mean-field guides with twice the network's parameters.
    """
    params = list(params)
    groups = parameter_groups(params, lr, factors)
    fusable = params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                             for p in params) and len({p.device for p in params}) == 1
    if fusable:
        try:
            return torch.optim.Adam(groups, lr=lr, fused=True)
        except (RuntimeError, ValueError):  # older torch or unsupported dtype/device
            pass
    return torch.optim.Adam(groups, lr=lr)


def parameter_groups(params, lr: float, factors) -> list[dict]:
    """One group at ``lr`` and one per distinct factor (in order of first appearance)."""
    factor_of = {}
    for p, factor in factors:
        factor = float(factor)
        if not factor > 0 or not math.isfinite(factor):
            raise ValueError(f"learning-rate factors must be positive and finite, got {factor!r}")
        factor_of[id(p)] = factor
    by_factor: dict[float, list] = {}
    base = []
    for p in params:
        factor = factor_of.get(id(p), 1.0)
        (base if factor == 1.0 else by_factor.setdefault(factor, [])).append(p)
    groups = [{"params": base, "lr": lr}] if base else []
    groups += [{"params": ps, "lr": lr * f} for f, ps in by_factor.items()]
    return groups


def trained_parameters(*modules) -> list:
    """The parameters of ``modules`` that require gradients, each once, in module order."""
    seen, out = set(), []
    for m in modules:
        if isinstance(m, torch.nn.Module):
            for p in m.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append(p)
    return out
