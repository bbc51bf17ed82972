"""Weight normalisation (Salimans & Kingma 2016) as used by Bayesian hypernetworks.

Each output unit ``j`` of a Linear layer (a row) or a Conv layer (a filter) has weights

    W_j = g_j · v_j / ‖v_j‖,

so only the scales ``g`` (one scalar per output unit, shape ``(out,)``) need to be random;
the directions ``v`` (``weight_v``, same shape as the original weight) and the biases are
point estimates.  In a :class:`pyro_bnn.BNN` built with ``weight_norm=True`` the scales are
``PyroSample`` sites named ``"net.<path>.weight_g"`` with prior ``N(0, 1/λ)``.

:class:`WeightNormLinear` and :class:`WeightNormConv2d` subclass ``nn.Linear`` and
``nn.Conv2d`` (``isinstance`` checks and hooks keep working); their ``weight`` is a property
computed from ``weight_g`` and ``weight_v``.  They work as plain modules, inside
``pb.BNN`` and in hand-written ``PyroModule`` models (set ``layer.weight_g = PyroSample(...)``).

Examples
--------
>>> import torch.nn as nn, pyro_bnn as pb
>>> model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
...                weight_norm=True, weight_norm_precision=1.0)
>>> model.site_names
['net.0.weight_g', 'net.2.weight_g']
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from .batchnorm import layers_feeding_normalization, short_list
from .priors import IIDNormal, Prior, real_scalar

__all__ = ["WeightNormLinear", "WeightNormConv2d", "weight_norm_weight", "to_weight_norm",
           "is_weight_norm_layer", "weight_norm_setup", "normalize_directions_", "direction_radius"]


def weight_norm_weight(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``W_j = g_j v_j / ‖v_j‖`` for every output unit ``j``.

    Parameters
    ----------
    g : Tensor, shape (..., out)
        Scales; leading batch dimensions are allowed (one weight per batch element).
    v : Tensor, shape (out, *rest)
        Directions; the norm is taken over everything but the first dimension.

    Returns
    -------
    Tensor, shape (..., out, *rest)
    """
    if (g.dim() == 1 and v.device.type == "cpu" and v.dim() > 1 and g.shape[0] == v.shape[0]
            and not _functorch_wrapped(g, v)):
        # PyTorch's fused weight-norm kernel (forward and backward in one pass each; ~2.5×
        # faster than the composite below on CPU); the composite handles zero-norm rows and
        # torch.func transforms (vmap/jacrev: no data-dependent check there).
        w, norm = torch._weight_norm_interface(v, g.reshape(_column_shape(v)), 0)
        # "no norm below 1e-12": one reduction read as a number (~6× cheaper on CPU than
        # ``(norm < 1e-12).any()``); only a NaN minimum needs the entrywise test
        smallest = float(norm.detach().min())
        if smallest >= 1e-12 or (smallest != smallest and not bool((norm < 1e-12).any())):
            return w
    norm = v.flatten(1).norm(dim=1).clamp_min(1e-12)
    scale = g / norm
    return scale.reshape(scale.shape + (1,) * (v.dim() - 1)) * v


def _column_shape(v: torch.Tensor) -> tuple[int, ...]:
    """``(-1, 1, …, 1)``: the shape that broadcasts a per-row scale over ``v``."""
    return (-1, 1) if v.dim() == 2 else (-1,) + (1,) * (v.dim() - 1)


#: torch's test for tensors inside a torch.func transform (None on builds without it)
_IS_FUNCTORCH_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _functorch_wrapped(g: torch.Tensor, v: torch.Tensor) -> bool:
    check = _IS_FUNCTORCH_WRAPPED
    return check is None or check(g) or check(v)


class _WeightNormMixin:
    """``weight`` from ``weight_g`` and ``weight_v``; converts a base layer's weight."""

    def _split_weight_(self) -> None:
        w = self._parameters.pop("weight").detach()
        self.weight_v = nn.Parameter(w.clone())
        self.weight_g = nn.Parameter(w.flatten(1).norm(dim=1).clone())

    @property
    def weight(self) -> torch.Tensor:
        # During the base class's __init__ the plain weight still exists.
        if "weight" in self._parameters:
            return self._parameters["weight"]
        return weight_norm_weight(self.weight_g, self.weight_v)


class WeightNormLinear(_WeightNormMixin, nn.Linear):
    """``nn.Linear`` with weight ``W_j = g_j v_j/‖v_j‖``; parameters ``weight_g`` (out,),
    ``weight_v`` (out, in) and ``bias`` (out,).  Initial ``g`` = row norms of the
    PyTorch-initialised weight, so the layer starts as a standard ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._split_weight_()

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> WeightNormLinear:
        """The same function as ``layer``: ``g`` = row norms, ``v`` = its weight."""
        new = copy.deepcopy(layer)
        new.__class__ = cls
        new._split_weight_()
        return new


class WeightNormConv2d(_WeightNormMixin, nn.Conv2d):
    """``nn.Conv2d`` with filters ``W_j = g_j v_j/‖v_j‖``; ``weight_g`` has shape (out,),
    ``weight_v`` (out, in/groups, kh, kw)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._split_weight_()

    @classmethod
    def from_conv2d(cls, layer: nn.Conv2d) -> WeightNormConv2d:
        """The same function as ``layer``: ``g`` = filter norms, ``v`` = its weight."""
        new = copy.deepcopy(layer)
        new.__class__ = cls
        new._split_weight_()
        return new


def is_weight_norm_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a :class:`WeightNormLinear` / :class:`WeightNormConv2d`."""
    return isinstance(module, _WeightNormMixin)


def direction_radius(v: torch.Tensor) -> float:
    """The radius ``√fan_in`` on which :func:`normalize_directions_` keeps each row of ``v``:
    entries of order 1, so an Adam step of size ``lr`` per entry turns a direction by about
    ``lr`` radians whatever the layer's fan-in."""
    return float(v[0].numel()) ** 0.5


def normalize_directions_(net: nn.Module) -> int:
    """Rescale, in place, every row (filter) of every weight-norm layer's ``weight_v`` to norm
    :func:`direction_radius`; returns the number of layers.

    The layer computes ``g v/‖v‖``, so this changes no function and no density: ``‖v_j‖`` is a
    gauge (a direction of parameter space the model cannot see).  Left free, it drifts: a
    gradient of a scale-invariant function is orthogonal to ``v``, so every optimiser step
    lengthens ``v`` and the same step then turns the direction less, an effective learning rate
    that decays with training (``docs/results/fmnist_guides.md``).  Fixing the radius before
    each step keeps the turning rate at ``lr``.
    """
    count = 0
    with torch.no_grad():
        for module in net.modules():
            if is_weight_norm_layer(module):
                v = module.weight_v
                norm = v.flatten(1).norm(dim=1).clamp_min(1e-12)
                v.mul_((direction_radius(v) / norm).reshape((-1,) + (1,) * (v.dim() - 1)))
                count += 1
    return count


def _convert(module: nn.Module) -> nn.Module:
    if is_weight_norm_layer(module):
        return module
    if isinstance(getattr(module, "weight", None), nn.Parameter) and not module.weight.requires_grad:
        return module  # frozen (requires_grad=False): stays as it is, deterministic and fixed
    if type(module) is nn.Linear:
        return WeightNormLinear.from_linear(module)
    if type(module) is nn.Conv2d:
        return WeightNormConv2d.from_conv2d(module)
    return module


def to_weight_norm(net: nn.Module) -> nn.Module:
    """A copy of ``net`` with every ``nn.Linear`` / ``nn.Conv2d`` in weight-norm form.

    The function is unchanged (``g`` = row/filter norms, ``v`` = the weights).  Layers that
    already are weight-norm layers are kept, and so are frozen layers (weight with
    ``requires_grad=False``).

    Raises
    ------
    ValueError
        If the network has no Linear or Conv2d layer.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(net).__name__}")
    net = copy.deepcopy(net)
    root = _convert(net)
    if root is not net:
        return root
    for module in list(net.modules()):
        for child_name, child in list(module.named_children()):
            new = _convert(child)
            if new is not child:
                setattr(module, child_name, new)
    if not any(is_weight_norm_layer(m) for m in net.modules()):
        raise ValueError("weight_norm=True needs Linear or Conv2d layers that are not frozen "
                         "(requires_grad=False layers stay as they are); the network has "
                         f"none (modules: {sorted({type(m).__name__ for m in net.modules()})})")
    return net


#: Scale of the directions' prior ``v ~ N(0, s² I)`` with ``random_directions=True``: any isotropic
#: Normal makes ``v/‖v‖`` uniform on the sphere, so s only fixes the parametrisation (with rows
#: started at norm √fan_in, entries of order 1)
DIRECTION_PRIOR_SCALE = 1.0


def weight_norm_setup(net: nn.Module, prior, stochastic, precision: float | None,
                      random_directions: bool = False):
    """What :class:`pyro_bnn.BNN` does for ``weight_norm=True``.

    Returns the converted network, the prior (default ``N(0, 1/λ)`` with ``λ = precision``,
    default 1, for the scales; with ``random_directions`` ``N(0, I)`` for the directions
    ``weight_v``, whose rows are rescaled to norm √fan_in) and the selection (default: the
    ``weight_g`` of every weight-norm layer, and its ``weight_v`` with ``random_directions``).
    """
    if precision is not None and prior is not None:
        raise ValueError("give either prior= or weight_norm_precision=, not both "
                         f"(got prior={prior!r}, weight_norm_precision={precision!r})")
    if random_directions and stochastic is not None:
        raise ValueError("random_directions=True chooses the random parameters itself (every weight-norm "
                         "layer's scales and directions); do not pass stochastic= with it "
                         f"(got stochastic={stochastic!r})")
    lam = 1.0 if precision is None else real_scalar(precision, "weight_norm_precision", positive=True)
    net = to_weight_norm(net)
    if stochastic is None:
        warn_scales_under_batchnorm(net)
    if prior is None:
        prior = IIDNormal(lam ** -0.5)
    leaves = ("weight_g", "weight_v") if random_directions else ("weight_g",)
    if stochastic is None:
        def stochastic(name, module, param):
            return is_weight_norm_layer(module) and name.rsplit(".", 1)[-1] in leaves
    if random_directions:
        normalize_directions_(net)
        prior = _with_direction_priors(prior, net)
    return net, prior, stochastic


def warn_scales_under_batchnorm(net: nn.Module) -> None:
    """Warn when a weight-norm layer feeds a BatchNorm layer (in an ``nn.Sequential`` or a
    traced ``forward``, with at most pooling, Flatten, Dropout, Identity or a reshape between,
    which commute with a positive scale;
    :func:`~pyro_bnn.model.batchnorm.layers_feeding_normalization`): in training BatchNorm
    divides each unit's scale ``g`` out (only its sign can matter), so the data say nothing about ``|g|`` (its exact posterior is the
    prior), and the running statistics, averaged over draws of other scales, fit no single
    draw at prediction (measured on digits, BatchNorm MLP 64-100-10, Hypernet 100 epochs,
    ``benchmarks/batchnorm_draws.py --guide hypernet``: test NLL 0.124 with the running
    statistics, 0.059 with per-draw statistics)."""
    pairs = [f"net.{path}" for path, layer in  # the BNN's paths
             layers_feeding_normalization(net, (nn.modules.batchnorm._BatchNorm,)) if is_weight_norm_layer(layer)]
    if pairs:
        warnings.warn(
            f"weight_norm=True on layers that feed BatchNorm ({short_list(pairs)}): BatchNorm divides "
            "their scales g out in training, so the data do not inform |g| (its exact posterior is the "
            "prior) and the running statistics fit no single draw; predict with pb.predict(..., "
            "bn_data=training inputs), which re-estimates the statistics under each draw, or drop "
            "weight_norm or the BatchNorm layers", UserWarning, stacklevel=4)


def _with_direction_priors(prior, net: nn.Module):
    """``prior`` for the scales, ``N(0, DIRECTION_PRIOR_SCALE² I)`` for every layer's ``weight_v``
    (a dict entry of the user's for a direction site wins)."""
    directions = {f"net.{name}.weight_v": IIDNormal(DIRECTION_PRIOR_SCALE)
                  for name, module in net.named_modules() if is_weight_norm_layer(module)}
    if isinstance(prior, Mapping):
        return {**directions, **prior}
    if callable(prior) and not isinstance(prior, (Prior, torch.distributions.Distribution)):
        def chosen(name, param):
            return directions[name] if name in directions else prior(name, param)
        return chosen
    return {"*": prior, **directions}
