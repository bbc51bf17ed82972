"""When and through which layers the guides' objectives may run a network by direct calls.

The training objectives of :class:`~pyro_bnn.guides.MeanField` (local reparameterisation,
:mod:`.local_reparam_forward`) and :class:`~pyro_bnn.guides.Hypernet` (:mod:`.hypernet_forward`)
run a plain ``nn.Sequential`` network as functional calls, the operations its layers make,
skipping ``PyroModule.__call__``/``__getattr__`` per layer.  That is exact only where
skipping the model's Pyro statements changes nothing (:func:`direct_calls_allowed`), for
layers without hooks (:func:`has_hooks`) whose own ``forward`` is the torch class's; the
parameter-free layers both plans call through their ``forward`` are
:data:`PARAMETER_FREE_LAYERS` (:func:`is_plain_parameter_free`).
"""

from __future__ import annotations

import pyro
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn
from torch.nn.modules import module as _nn_module

from ..contract.local_params import GlobalParamBridge

__all__ = ["direct_calls_allowed", "has_hooks", "PARAMETER_FREE_LAYERS", "is_plain_parameter_free"]

#: torch layers without parameters that a plan calls through their own ``forward`` (what
#: ``Module.__call__`` does for a layer without hooks)
PARAMETER_FREE_LAYERS = (nn.ReLU, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softplus,
                         nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                         nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.Flatten,
                         nn.Identity, nn.Dropout)


def direct_calls_allowed() -> bool:
    """Whether skipping the model's Pyro ``param`` statements changes nothing: Pyro's
    module-local parameter mode is on (a statement registers nothing) and the only handlers
    running are :func:`~pyro_bnn.contract.local_params.local_params`' bridges (which pass
    module parameters through), as in :func:`pyro_bnn.fit`."""
    return bool(pyro.settings.get("module_local_params")) and all(
        type(frame) is GlobalParamBridge for frame in _PYRO_STACK)


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` (or a global registration) has forward hooks a direct call would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


def is_plain_parameter_free(layer: nn.Module) -> bool:
    """Whether ``layer`` is one of :data:`PARAMETER_FREE_LAYERS` running its torch class's own
    ``forward``, without parameters, buffers, submodules, Pyro sites or hooks."""
    return (any(isinstance(layer, cls) and type(layer).forward is cls.forward for cls in PARAMETER_FREE_LAYERS)
            and not (layer._parameters or layer._buffers or layer._modules or has_hooks(layer)
                     or layer.__dict__.get("_pyro_samples") or layer.__dict__.get("_pyro_params")))
