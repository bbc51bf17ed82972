"""BatchNorm layers of a network, the warning when a prediction runs them in train mode, and
the weight layers whose scale a normalisation layer divides out.

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

__all__ = ["batchnorm_layers", "warn_batchnorm_in_train_mode", "BatchNormTrainModeWarning",
           "layers_feeding_normalization", "NORMALIZATION_LAYERS"]

#: Layers that divide their input's scale out: BatchNorm / InstanceNorm (per channel), LayerNorm
#: and GroupNorm (per example, so at least a whole layer's common scale).
NORMALIZATION_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)

#: Modules that commute with a positive scale of their input, so the scale reaches the next layer.
_SCALE_COMMUTING = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.MaxPool1d, nn.MaxPool2d,
                    nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.Flatten)


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


def layers_feeding_normalization(root: nn.Module, kinds: tuple = NORMALIZATION_LAYERS) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` of every Linear / Conv layer of ``root`` that feeds a layer of ``kinds``.

    Found inside ``nn.Sequential`` containers: the layer's next module is of ``kinds``, possibly
    after pooling, Flatten, Dropout or Identity (they commute with a positive scale).  A ReLU in
    between does not count: it comes after the bias, which breaks the scale invariance.  Layers
    called from a hand-written ``forward`` are not seen.
    """
    found = []
    for prefix, seq in root.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (name, layer) in enumerate(children):
            if not isinstance(layer, (nn.Linear, nn.modules.conv._ConvNd)):
                continue
            following = [m for _, m in children[i + 1:]]
            while following and isinstance(following[0], _SCALE_COMMUTING):
                following.pop(0)
            if following and isinstance(following[0], kinds):
                found.append((f"{prefix}.{name}" if prefix else name, layer))
    return found
