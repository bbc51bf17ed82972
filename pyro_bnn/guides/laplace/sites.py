"""Which sites a Laplace guide covers and how: layer parameters, Normal prior precisions,
point-estimate transforms for the other sites, the batched Gaussian log prior."""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.transforms import biject_to
from torch import nn

from ...curvature.layers import site_module
from ...model.batchnorm import NORMALIZATION_LAYERS, layers_feeding_normalization
from ...model.devices import device_memory_bytes

#: The named ``subset=`` choices of :class:`~pyro_bnn.guides.Laplace`.
NAMED_SUBSETS = ("all", "last_layer", "unnormalized")

__all__ = ["NAMED_SUBSETS", "refuse_dense_beyond_memory", "gaussian_log_prior_batched", "is_layer_parameter", "unwrap_handlers", "normal_precision", "point_estimate_transforms", "select_sites", "concat_deltas"]



#: Dense P × P matrices that ``structure="full"`` needs at once at its peak.  Measured by the
#: process's peak resident memory (P = 4,510, digits MLP 64-60-10, float32, batches of 32):
#: 6.1 matrices over ``fit_curvature``, ``optimize_prior_precision`` and the GLM predictive.
#: The guide keeps the GGN in a buffer and a symmetrised copy in its fitted blocks, the
#: eigendecomposition adds its eigenvectors, its input's copy and LAPACK's workspace of
#: 2 P² values (``syevd``), and the predictive forms ``Q diag((sλ+δ)^{-1/2})``.  Counting
#: 2 accepted a LeNet (P = 44,426: 7.4 GiB per matrix) on a 23.5 GiB machine, where it needs
#: about 45 GiB and would be killed for memory after hours of GGN accumulation.
DENSE_COPIES = 7


def refuse_dense_beyond_memory(num_params: int, like: torch.Tensor) -> None:
    """Refuse ``structure="full"`` when its dense matrices cannot fit in the device's memory.

    Without it the curvature fit trains the MAP first and then fails inside torch's allocator
    (on the CPU: "can't allocate memory: you tried to allocate 158738496400 bytes"), or, when
    one matrix fits but not the :data:`DENSE_COPIES` its computation needs, the process is
    killed by the out-of-memory killer after hours of curvature accumulation.

    Parameters
    ----------
    num_params : int
        P, the number of weights in the Laplace sites.
    like : Tensor
        A tensor of the curvature's dtype and device (the matrices' element size and where
        they live).

    Raises
    ------
    ValueError
        ``DENSE_COPIES · P² · element_size`` exceeds the device's memory.
    """
    per_matrix = num_params ** 2 * like.element_size()
    total = device_memory_bytes(like.device)
    if total is not None and DENSE_COPIES * per_matrix > total:
        raise ValueError(
            f"structure='full' keeps dense P x P matrices: P = {num_params:,} parameters in the Laplace "
            f"sites -> {per_matrix / 2 ** 30:,.1f} GiB per matrix ({like.dtype}); computing and using the "
            f"posterior needs {DENSE_COPIES} at once, {DENSE_COPIES * per_matrix / 2 ** 30:,.1f} GiB, more than "
            f"the {total / 2 ** 30:,.1f} GiB of memory of {like.device}. Use structure='kron' or 'diag', or "
            "fewer sites with subset= (e.g. subset='last_layer')")


def gaussian_log_prior_batched(layers, values: dict, deltas: list) -> torch.Tensor:
    """``Σ_l log N(W̃_l | 0, δ_l⁻¹)`` for draws ``values[site]`` of shape ``(S, *shape)`` → ``(S,)``."""
    total = 0.0
    for layer, d in zip(layers, deltas):
        w = _leading(layer, values).flatten(1)
        log_det = layer.numel * torch.log(d) if d.dim() == 0 else torch.log(d).sum()
        total = total + 0.5 * (log_det - (d * w ** 2).sum(-1) - layer.numel * math.log(2 * math.pi))
    return total


def _leading(layer, values):
    """``W̃`` of draws with a leading sample dim: ``(S, out, in')``."""
    parts = []
    if layer.weight is not None:
        v = values[layer.weight]
        parts.append(v.reshape(v.shape[0], layer.out_features, -1))
    if layer.bias is not None:
        v = values[layer.bias]
        parts.append(v.reshape(v.shape[0], layer.out_features, 1))
    return torch.cat(parts, -1)


def is_layer_parameter(model, name: str) -> bool:
    """Whether site ``name`` is the weight or bias of a module of ``model`` (never an observation)."""
    try:
        module, pname = site_module(model, name)
    except (AttributeError, KeyError, ValueError):
        return False
    return module is not None and pname in ("weight", "bias")


def unwrap_handlers(model):
    """The model under ``poutine`` handler wrappers (``functools.wraps`` chains: ``__wrapped__``)."""
    seen = 0
    while not isinstance(model, nn.Module) and hasattr(model, "__wrapped__") and seen < 32:
        model, seen = model.__wrapped__, seen + 1
    return model


def normal_precision(fn, value) -> tuple[torch.Tensor, str | None]:
    """Elementwise 1/σ² of a (possibly Independent/expanded) zero-mean Normal prior, and
    ``None``; else ones and what the Gaussian ``N(0, 1/δ)`` cannot represent."""
    d = fn
    while isinstance(d, (dist.Independent, dist.ExpandedDistribution)) and not isinstance(d, dist.Normal):
        d = d.base_dist
    if isinstance(d, dist.Normal):
        prec = (d.scale ** -2).expand(value.shape).to(value.dtype)
        if bool((d.loc != 0).any()):
            return prec, f"a Normal prior with non-zero mean (loc in [{float(d.loc.min()):.4g}, " \
                         f"{float(d.loc.max()):.4g}])"
        return prec, None
    return torch.ones_like(value), f"a {type(d).__name__} prior, not a Normal"


def _is_real(support) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def point_estimate_transforms(sites: dict, laplace_sites: list[str]) -> dict:
    """``{site: transform}`` for the constrained point-estimate sites (``biject_to`` of
    their support); raises for a constrained site that the Laplace is asked to cover and
    for discrete sites."""
    transforms = {}
    for name, site in sites.items():
        support = site["fn"].support
        if _is_real(support):
            continue
        if support.is_discrete:
            raise ValueError(f"Laplace needs continuous latent sites; site {name!r} is discrete (support "
                             f"{support}): marginalise or enumerate it in the model")
        if name in laplace_sites:
            raise ValueError(
                f"Laplace puts a Gaussian N(θ*, P⁻¹) on the sites it covers, which must be real-valued; "
                f"site {name!r} has support {support}. Leave it out of subset= (e.g. subset='last_layer' "
                "or a list of the layer sites): it is then a point estimate, the MAP of its own prior "
                "in its support; or use a guide that transforms constrained sites through their "
                "support (pb.guides.MeanField, pyro.infer.autoguide.AutoNormal)")
        transforms[name] = biject_to(support)
    return transforms


def select_sites(subset, names: list[str], network: nn.Module | None = None,
                 feeding: tuple[str, ...] | None = None) -> list[str]:
    """The sites the Laplace covers, in site order (``subset`` as in :class:`Laplace`;
    ``"unnormalized"`` needs the model's ``network``)."""
    if subset == "all":
        return list(names)
    if subset == "last_layer":
        path = names[-1].rpartition(".")[0]
        return [s for s in names if s.rpartition(".")[0] == path]
    if subset == "unnormalized":
        return unnormalized_sites(network, names, feeding)
    unknown = sorted(set(subset) - set(names))
    if unknown:
        raise ValueError(f"subset names sites the model lacks: {unknown}; it has {names}")
    return [s for s in names if s in set(subset)]


def unnormalized_sites(network: nn.Module | None, names: list[str],
                       feeding: tuple[str, ...] | None = None) -> list[str]:
    """The sites whose scale no normalisation layer divides out: every site except the
    weights and biases of layers that feed a BatchNorm/LayerNorm/GroupNorm, directly or
    through a ReLU, which commutes with a positive scale of weight and bias together
    (``whole_layer=True``).  ``feeding`` names those layers as a run of the model found them
    (:func:`~pyro_bnn.model.dataflow.recording_normalization_feeding`, which also reads a
    ``PyroModule``'s hand-written ``forward``); without it the network is read without running
    (:func:`~pyro_bnn.model.batchnorm.layers_feeding_normalization`).

    Raises
    ------
    ValueError
        The network has no layer feeding a normalisation layer (the subset would be every
        site: say ``"all"``), or none of its normalisation layers' affine parameters is a
        random site (the subset would keep only the unnormalised layers, with no posterior
        over the normalised part: make γ, β random, or say ``"last_layer"``)."""
    if not isinstance(network, nn.Module):
        raise ValueError("subset='unnormalized' needs the model's network (a pb.BNN or a PyroModule) to find "
                         f"its normalisation layers, got a {type(network).__name__}")
    read_from_run = feeding is not None
    if feeding is None:
        feeding = [path for path, _ in layers_feeding_normalization(network, whole_layer=True)]
    feeding = set(feeding)
    if not feeding:
        where = ("in the model's set-up run" if read_from_run else
                 "in nn.Sequential containers and in a forward that torch.fx can trace (a PyroModule model's "
                 "forward, with pyro.sample and plates, is read from its run by pb.guides.Laplace)")
        raise ValueError("subset='unnormalized': no Linear/Conv layer of the network feeds a normalisation "
                         "layer (BatchNorm, InstanceNorm, LayerNorm, GroupNorm), so it would cover every site "
                         f"(layers were looked for {where}). Name the sites instead, subset=[...] (the "
                         "normalisation layers' weight/bias and the layers that feed none); without "
                         "normalisation use subset='all'")
    affine = [s for s in names if isinstance(site_module(network, s)[0], NORMALIZATION_LAYERS)]
    if not affine:
        raise ValueError(
            "subset='unnormalized' covers the normalisation layers' affine parameters (γ, β), but none of "
            f"them is a random site of the model (its sites: {names}). Make them random, e.g. pb.BNN(net, "
            "stochastic=lambda name, module, param: isinstance(module, (nn.Linear, nn.Conv2d, "
            "nn.BatchNorm1d, nn.BatchNorm2d))), or use subset='last_layer'")
    return [s for s in names if s.rpartition(".")[0] not in feeding]


def concat_deltas(layers, deltas):
    if all(d.dim() == 0 for d in deltas) and all(d is deltas[0] for d in deltas):
        return deltas[0]
    return torch.cat([d.expand(layer.numel) if d.dim() == 0 else d for layer, d in zip(layers, deltas)])
