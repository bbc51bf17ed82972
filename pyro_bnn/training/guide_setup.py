"""Setting a guide up before training or loading: one blocked run creates its lazy parameters."""

from __future__ import annotations

import warnings

import torch
from pyro import poutine

from ..contract.guide import GuideStateWarning
from ..contract.local_params import local_params
from ..contract.pyro_objective import call_model
from ..model.modes import buffers_kept

__all__ = ["setup_guide"]


def setup_guide(model, guide, x, y=None, num_data=None) -> None:
    """Run ``guide`` once so that lazily created parameters exist (no other side effect: the
    buffers of ``model`` and ``guide``, e.g. BatchNorm's running statistics, are put back)."""
    args, kwargs, _ = call_model(model, x, y, num_data if num_data is not None else len(x))
    with local_params(model, guide), torch.no_grad(), buffers_kept(model, guide), warnings.catch_warnings():
        warnings.simplefilter("ignore", GuideStateWarning)  # a set-up run: its draw is discarded
        poutine.block(guide)(*args, **kwargs)
