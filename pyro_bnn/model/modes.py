"""A module's state around a look-up run: train/eval flags and buffers put back afterwards.

:func:`evaluation_mode` runs the model and guide in eval mode (prediction; public as
:func:`pyro_bnn.posterior.prediction.evaluation_mode`); :func:`buffers_kept` runs them in train
mode without moving BatchNorm's running statistics (guide set-up, objective look-ups, probes).
In the model layer so that every layer above, the model's own checks included, uses the same two.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["evaluation_mode", "buffers_kept"]


@contextmanager
def evaluation_mode(*modules):
    """Run the body with every submodule of ``modules`` in eval mode, then restore each flag.

    Prediction must not depend on which other inputs share a batch, nor change the model:
    in train mode ``BatchNorm`` normalises with the batch's statistics (so an input's
    prediction depends on its batch) and updates ``running_mean``/``running_var``/
    ``num_batches_tracked`` with the data it sees, and ``Dropout`` drops units.  In eval
    mode neither happens.

    Each submodule's own ``training`` flag is recorded and set back on exit, exceptions
    included, so a model that had some layers in train mode and others in eval mode is
    left exactly as it was (``module.train(flag)`` would set the whole subtree alike).
    Buffers are not touched; eval mode is what keeps them unchanged.

    Parameters
    ----------
    *modules : nn.Module or other
        The model and the guide; anything that is not an ``nn.Module`` (a plain-function
        guide, ``None``) is ignored.

    Examples
    --------
    >>> with evaluation_mode(model, guide):          # doctest: +SKIP
    ...     probs = model.run_with(values, x)
    """
    flags: dict[int, tuple[nn.Module, bool]] = {}
    for module in modules:
        if isinstance(module, nn.Module):
            for sub in module.modules():
                flags.setdefault(id(sub), (sub, sub.training))
    try:
        for sub, _ in flags.values():
            sub.training = False
        yield
    finally:
        for sub, flag in flags.values():
            sub.training = flag


@contextmanager
def buffers_kept(*modules):
    """Run the body, then copy every buffer of ``modules`` back to its value on entry.

    For code that must run a model in train mode (a training objective: BatchNorm on batch
    statistics) without moving its running statistics.  Non-modules are ignored.
    """
    saved = [(b, b.detach().clone()) for m in modules if isinstance(m, nn.Module) for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
