"""BatchNorm layers of a network, and the warning when a prediction runs them in train mode.

A ``BatchNorm`` layer in train mode normalises with the statistics of the batch it sees and
writes them into ``running_mean`` / ``running_var``.  During training that is what it should do;
at prediction it makes an input's output depend on the other inputs of its batch and overwrites
the statistics learnt in training with those of the inputs predicted.  ``pb.predict`` runs in
eval mode itself; plain ``pyro.infer.Predictive`` calls the model in whatever mode it is in, and
:func:`pyro_bnn.fit` leaves a new network in train mode.
"""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["batchnorm_layers", "warn_batchnorm_in_train_mode", "BatchNormTrainModeWarning"]


class BatchNormTrainModeWarning(UserWarning):
    """A ``pb.BNN`` predicted (``y=None``) with BatchNorm layers in train mode."""


def _keeps_statistics(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats


def batchnorm_layers(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``module`` that keep running statistics, in module order."""
    return [m for m in module.modules() if _keeps_statistics(m)]


def warn_batchnorm_in_train_mode(module: nn.Module) -> None:
    """Warn if a BatchNorm layer of ``module`` is in train mode (called when the model
    predicts, i.e. runs without observations)."""
    names = [name for name, m in module.named_modules() if _keeps_statistics(m) and m.training]
    if names:
        warnings.warn(
            f"the model predicts (y=None) with BatchNorm layers in train mode ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): each prediction is normalised with its own batch's "
            "statistics and overwrites the running statistics learnt in training with those of the "
            "inputs predicted; call model.eval() before Predictive (and model.train() before training "
            "again), or use pb.predict, which runs in eval mode itself",
            BatchNormTrainModeWarning, stacklevel=2)
