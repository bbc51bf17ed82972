"""Permutation symmetries of a network's hidden units, and how a permutation acts on weights.

Permuting the hidden units of a layer — the rows of ``W_l`` and ``b_l`` together with the
columns of ``W_{l+1}`` — leaves the function a network computes unchanged (Gelberg et al.
2024; ``docs/METHODS.md`` §3).  The group of all such relabelings is
``G = S_{d_1} × … × S_{d_{L-1}}``, ``|G| = Π_l d_l!``.

Representation
--------------
A *symmetry group* (one factor ``S_d``) is a dict mapping site names to the axis that is
permuted, e.g. ``{"net.0.weight": 0, "net.0.bias": 0, "net.2.weight": 1}``; a symmetry is a
list of such groups.  A group element is one index permutation ``p`` (a ``LongTensor`` of
shape ``(d,)``) per group; it acts on a dict of site tensors by
``(g·ω)[site] = ω[site].index_select(axis, p)``, i.e. ``(g·ω)[site][..., i, ...] =
ω[site][..., p[i], ...]``.  With this convention ``g_p · g_r = g_{r[p]}`` (see
:func:`compose_permutations`).

Discovery (:func:`find_symmetries`) — supported architectures
-------------------------------------------------------------
* ``nn.Sequential`` containers anywhere in the model (``pb.BNN(nn.Sequential(...))`` and
  hand-written ``PyroModule`` s holding Sequentials whose Linear/Conv weights are
  ``PyroSample`` sites; nested Sequentials are flattened);
* ``Linear → (elementwise activations, Dropout, Identity)* → Linear`` with matching widths;
* ``ConvNd → (activations, pooling, channel Dropout)* → ConvNd`` (same N, ``groups=1``):
  output channels (filters and bias) of the first, input channels of the second;
* normalisation layers between the two, per unit: ``BatchNorm`` / ``InstanceNorm`` with
  ``num_features`` equal to the width, and ``LayerNorm`` over the width after a Linear.  Their
  affine parameters γ, β move with the units, so they must be random sites too (e.g.
  ``pb.BNN(net, stochastic=...)`` selecting them) or absent (``affine=False``);
* a group is only formed when every tensor that must move is random: the weight of both
  layers, the first layer's bias (if it has one) and the normalisation layers' γ, β.  A
  deterministic (point-estimate) parameter in the way breaks the symmetry, and so does any
  other module in between (Flatten, attention, ...).  The last layer's outputs are never
  permuted, and the ``Conv → Flatten → Linear`` boundary is left alone (a subgroup of the
  true symmetry: still a valid, slightly looser bound).
* a BatchNorm (or InstanceNorm) layer that keeps running statistics is a symmetry only while it
  normalises with the batch's statistics (train mode, as the bound is trained): its running
  statistics are one buffer shared by every weight draw, so in eval mode a permuted draw
  computes another function.  :func:`discover_symmetries` names these layers, and the
  symmetrised bound refuses to run while one of them is in eval mode
  (:func:`check_batch_statistics`).

* Linear/Conv layers called from a hand-written ``forward`` (not in a Sequential): chained in
  the order they run on an example batch (with the normalisation layers called between
  them), and each candidate group is kept only if it is verified numerically: permuting it
  leaves observation densities and the return value unchanged on random weights, with the
  model's deterministic parameters set to random values for the check (a point estimate that
  is uniform at initialisation, such as BatchNorm's γ = 1, would otherwise pass and break the
  symmetry once trained).  Layers called twice disable this path.

Anything else (residual connections, fixed output weights as in the paper's toy) is
declared by the user with the same list-of-dicts form and can be checked with
:func:`check_symmetries`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..contract.pyro_objective import observed_sites
from ..model.modes import buffers_kept, evaluation_mode

__all__ = [
    "find_symmetries", "discover_symmetries", "check_batch_statistics", "running_statistics_layers",
    "check_declared_symmetries",
    "resolve_symmetries", "group_sizes", "log_group_order",
    "sample_permutations", "apply_permutation", "permute_batched", "invert_permutation",
    "compose_permutations", "enumerate_group", "check_symmetries",
]

Symmetry = list[dict[str, int]]

_LINEAR_CHAIN = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish,
    nn.Hardsigmoid, nn.Tanhshrink, nn.LogSigmoid, nn.Identity, nn.Dropout, nn.AlphaDropout,
)
_CONV_CHAIN = _LINEAR_CHAIN + (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Normalisation layers that act on each channel alone (statistics over the batch / positions).
_PER_CHANNEL_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


# ----------------------------------------------------------------------------- discovery
def _flatten_sequential(prefix: str, seq: nn.Sequential) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in seq.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Sequential):
            out.extend(_flatten_sequential(path, child))
        else:
            out.append((path, child))
    return out


def _link(a: nn.Module, b: nn.Module) -> int | None:
    """Width of the hidden units between layers ``a`` and ``b``, or None if they don't chain."""
    if isinstance(a, nn.Linear) and isinstance(b, nn.Linear):
        return a.out_features if a.out_features == b.in_features else None
    for conv in _CONVS:
        if isinstance(a, conv) and isinstance(b, conv):
            if a.groups == 1 and b.groups == 1 and a.out_channels == b.in_channels:
                return a.out_channels
    return None


def _width(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels


def _unit_norm(path: str, module: nn.Module, layer: nn.Module, shapes) -> bool:
    """Whether ``module`` normalises each of ``layer``'s output units on its own, with affine
    parameters that are random sites (or none), so that it can move with a permutation."""
    width = _width(layer)
    if isinstance(module, _PER_CHANNEL_NORMS):
        fits = module.num_features == width
    elif isinstance(module, nn.LayerNorm):
        fits = isinstance(layer, nn.Linear) and tuple(module.normalized_shape) == (width,)
    else:
        return False
    return fits and all(f"{path}.{name}" in shapes for name in ("weight", "bias")
                        if _has_parameter(module, name))


def _keeps_running_statistics(module: nn.Module) -> bool:
    return isinstance(module, _PER_CHANNEL_NORMS) and getattr(module, "running_mean", None) is not None


def find_symmetries(model: nn.Module, sites: Mapping[str, torch.Size] | Iterable[str],
                    example: tuple | None = None, example_kwargs: dict | None = None) -> Symmetry:
    """Permutable hidden units of ``model`` whose weights are the random ``sites``.

    Layers inside ``nn.Sequential`` containers are chained structurally.  Other Linear/Conv
    layers (called from a hand-written ``forward``) are chained in the order they run on
    ``example`` (model arguments, e.g. ``(x, y)``), and each such candidate group is kept
    only if permuting it leaves the model's observation densities and return value
    unchanged on random weights (:func:`check_symmetries`).

    Parameters
    ----------
    model : torch.nn.Module
        A :class:`pyro_bnn.BNN` or a hand-written ``PyroModule``; site names are module
        paths from this root (``"net.0.weight"``).
    sites : mapping site -> shape, or iterable of site names
        The random sites (with shapes, when given, used to check the widths).
    example, example_kwargs : tuple, dict, optional
        Arguments of ``model(*example, **example_kwargs)`` for the execution-order
        discovery (needs shapes).

    Returns
    -------
    list of dict
        One ``{site: axis}`` group per permutable hidden layer, in network order.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    >>> model = pb.BNN(net)                                         # doctest: +SKIP
    >>> find_symmetries(model, model.site_names)                    # doctest: +SKIP
    [{'net.0.weight': 0, 'net.0.bias': 0, 'net.2.weight': 1}]
    """
    return discover_symmetries(model, sites, example, example_kwargs)[0]


def discover_symmetries(model: nn.Module, sites: Mapping[str, torch.Size] | Iterable[str],
                        example: tuple | None = None,
                        example_kwargs: dict | None = None) -> tuple[Symmetry, list[str]]:
    """:func:`find_symmetries`, and the normalisation layers with running statistics that the
    groups pass through.

    Returns
    -------
    (list of dict, list of str)
        The groups, and the module paths of the BatchNorm / InstanceNorm layers with running
        statistics between a group's two layers: the groups are symmetries only while these
        normalise with batch statistics (:func:`check_batch_statistics`).
    """
    shapes = dict(sites) if isinstance(sites, Mapping) else {s: None for s in sites}
    groups: Symmetry = []
    running: list[str] = []
    covered: set[int] = set()
    for path, module in model.named_modules():
        if not isinstance(module, nn.Sequential) or id(module) in covered:
            continue
        for m in module.modules():
            covered.add(id(m))
        prev, norms = None, []  # the last Bayesian layer of an unbroken chain; norms since it
        for child_path, child in _flatten_sequential(path, module):
            if isinstance(child, (nn.Linear,) + _CONVS):
                if prev is not None:
                    group = _group_between(prev, (child_path, child), shapes, norms)
                    if group is not None:
                        groups.append(group)
                        running += [p for p, m in norms if _keeps_running_statistics(m)]
                prev, norms = (child_path, child), []
            elif prev is None:
                continue
            elif _unit_norm(child_path, child, prev[1], shapes):
                norms.append((child_path, child))
            elif not isinstance(child, _CONV_CHAIN if isinstance(prev[1], _CONVS) else _LINEAR_CHAIN):
                prev = None
    if example is not None and isinstance(sites, Mapping):
        found = _groups_by_execution(model, shapes, covered, example, example_kwargs or {})
        groups += [g for g, _ in found]
        running += [p for _, paths in found for p in paths]
    return groups, running


def check_batch_statistics(model: nn.Module, paths: Iterable[str]) -> None:
    """Raise if a normalisation layer a symmetry passes through uses its running statistics.

    Parameters
    ----------
    model : torch.nn.Module
        The root the ``paths`` are relative to.
    paths : iterable of str
        Module paths, as :func:`discover_symmetries` returns them.

    Raises
    ------
    ValueError
        One of the layers is in eval mode with running statistics: permuting its units moves
        the weights but not the statistics, so the permutation changes the function and the
        symmetrised bound would count mixture components that are not posterior modes.
    """
    in_eval = [p for p in paths if not model.get_submodule(p).training]
    if in_eval:
        raise ValueError(
            f"the permutation symmetry passes through normalisation layers in eval mode ({', '.join(in_eval)}): "
            "they normalise with running statistics shared by every weight draw, so a permuted draw computes "
            "another function and the symmetrised bound would be wrong. Evaluate it in train mode "
            "(model.train(); it is trained so), where each batch's own statistics are used")


def running_statistics_layers(model: nn.Module, groups: Symmetry) -> list[str]:
    """Paths of the BatchNorm / InstanceNorm layers with running statistics whose γ or β some
    group permutes (:func:`check_declared_symmetries` also finds the layers without affine
    parameters that a declared group passes through)."""
    permuted = {site for group in groups for site in group}
    return [path for path, m in model.named_modules()
            if _keeps_running_statistics(m) and {f"{path}.weight", f"{path}.bias"} & permuted]


def check_declared_symmetries(model: nn.Module, groups: Symmetry, shapes: Mapping[str, torch.Size],
                              example: tuple, example_kwargs: dict | None = None,
                              ) -> tuple[list[bool], list[str]]:
    """Verify declared groups on ``example`` and find the running-statistics layers they need.

    The model runs in eval mode on random values of the sites, with its point estimates as
    they are (a declaration may rely on them, e.g. equal fixed output weights) and the running
    statistics of every BatchNorm / InstanceNorm set alike across units (mean 0, variance 1).
    A group is a symmetry if permuting it leaves the observation densities and the return
    value unchanged (:func:`check_symmetries`).  Then each such layer's statistics are
    scrambled in turn: a layer whose scrambled statistics break a verified group lies on the
    group's path, and the group is a symmetry only while that layer uses batch statistics.
    This finds the layers between a group's two layers that have no affine parameters to
    permute, which :func:`running_statistics_layers` cannot see.  Buffers, parameters and
    train/eval flags are restored.

    Parameters
    ----------
    model : torch.nn.Module
        The network whose random sites the groups permute (site names are module paths).
    groups : list of dict
        Declared groups ``{site: axis}`` (:func:`resolve_symmetries`).
    shapes : mapping site -> shape
        Every random site of the model.
    example, example_kwargs : tuple, dict
        Arguments of ``model(*example, **example_kwargs)`` (a few inputs suffice).

    Returns
    -------
    (list of bool, list of str)
        Per group, whether it was verified as a symmetry; the paths of the layers with running
        statistics that a verified group passes through.  If the model cannot run on random
        site values, no group is verified and every such layer is returned.
    """
    norms = [(path, m) for path, m in model.named_modules() if _keeps_running_statistics(m)]
    gen = torch.Generator().manual_seed(0)
    device = next((t.device for t in example if isinstance(t, torch.Tensor)), torch.device("cpu"))
    values = {k: torch.randn(tuple(v), generator=gen).to(device) for k, v in shapes.items()}
    outputs = _conditioned_outputs(model, example, example_kwargs or {})

    with buffers_kept(model), torch.no_grad(), evaluation_mode(model):
        for _, m in norms:
            m.reset_running_stats()  # mean 0, variance 1: alike across units
        try:
            verified = check_symmetries(outputs, values, groups, generator=gen)
        except (ValueError, RuntimeError):  # the model rejects random site values: nothing verified
            return [False] * len(groups), [path for path, _ in norms]
        needed = []
        for path, m in norms:
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen))
            m.running_var.copy_(0.2 + 5.0 * torch.rand(m.running_var.shape, generator=gen))
            flags = check_symmetries(outputs, values, groups, generator=gen)
            if any(ok and not still for ok, still in zip(verified, flags)):
                needed.append(path)
            m.reset_running_stats()
    return verified, needed


def _conditioned_outputs(model: nn.Module, example: tuple, kwargs: dict) -> Callable:
    """``outputs(values)``: the model's observation log-densities and return value on ``example``
    with the random sites set to ``values`` (what a symmetry must leave unchanged)."""
    from pyro import poutine

    def outputs(vals):
        tr = poutine.trace(poutine.condition(model, data=vals)).get_trace(*example, **kwargs)
        parts = [site["fn"].log_prob(site["value"]).reshape(-1) for _, site in observed_sites(tr, vals)]
        ret = tr.nodes["_RETURN"]["value"]
        if isinstance(ret, torch.Tensor):
            parts.append(ret.reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0)

    return outputs


def _groups_by_execution(model, shapes, covered, example, kwargs) -> list[tuple[dict[str, int], list[str]]]:
    """Chain Linear/Conv layers outside Sequentials in call order; keep verified groups (with
    the paths of the running-statistics layers each passes through)."""
    paths = {id(m): (path, m) for path, m in model.named_modules()}
    layers = {k: (path, m) for k, (path, m) in paths.items()
              if isinstance(m, (nn.Linear,) + _CONVS) and k not in covered and f"{path}.weight" in shapes}
    if len(layers) < 2:
        return []
    calls: list[int] = []
    watched = [m for _, m in paths.values() if id(m) in layers or isinstance(m, _PER_CHANNEL_NORMS + (nn.LayerNorm,))]
    hooks = [m.register_forward_hook(lambda mod, inp, out: calls.append(id(mod))) for m in watched]
    gen = torch.Generator().manual_seed(0)
    device = next((t.device for t in example if isinstance(t, torch.Tensor)), torch.device("cpu"))
    values = {k: torch.randn(tuple(v), generator=gen).to(device) for k, v in shapes.items()}

    outputs = _conditioned_outputs(model, example, kwargs)
    with buffers_kept(model), torch.no_grad(), _deterministic_parameters_randomised(model, shapes, gen):
        try:
            outputs(values)
        except (ValueError, RuntimeError):  # the model rejects the random values: nothing verified
            return []
        finally:
            for h in hooks:
                h.remove()
        layer_calls = [i for i, c in enumerate(calls) if c in layers]
        if len({calls[i] for i in layer_calls}) != len(layer_calls):  # a layer used twice: no simple chain
            return []
        candidates = []
        for i, j in zip(layer_calls, layer_calls[1:]):
            (pa, la), between = layers[calls[i]], [paths[c] for c in calls[i + 1:j]]
            if all(_unit_norm(p, m, la, shapes) for p, m in between):
                group = _group_between((pa, la), layers[calls[j]], shapes, between)
                if group is not None:
                    candidates.append((group, [p for p, m in between if _keeps_running_statistics(m)]))
        if not candidates:
            return []
        flags = check_symmetries(outputs, values, [g for g, _ in candidates], generator=gen)
    return [c for c, ok in zip(candidates, flags) if ok]


@contextmanager
def _deterministic_parameters_randomised(model: nn.Module, shapes, generator: torch.Generator):
    """Give every parameter that is not a random site random values of its own sign, then restore it.

    Each entry is scaled by a random factor in about [0.2, 5]; entries that are zero or negative
    also move down by a random amount.  Entries that start alike (γ = 1, β = 0) then differ, and a
    positive entry stays positive (a raw parameter used as a scale stays valid).
    """
    saved = [(p, p.detach().clone()) for name, p in model.named_parameters() if name not in shapes]
    try:
        for p, value in saved:
            factor = torch.exp(0.5 * torch.randn(p.shape, generator=generator)).to(p)
            shift = 0.1 * torch.randn(p.shape, generator=generator).abs().to(p)
            p.copy_(torch.where(value > 0, value * factor, value * factor - shift))
        yield
    finally:
        for p, value in saved:
            p.copy_(value)


def _group_between(a, b, shapes, norms=()) -> dict[str, int] | None:
    (pa, la), (pb, lb) = a, b
    width = _link(la, lb)
    if width is None:
        return None
    w_a, b_a, w_b = f"{pa}.weight", f"{pa}.bias", f"{pb}.weight"
    if w_a not in shapes or w_b not in shapes:
        return None
    has_bias = b_a in shapes or _has_parameter(la, "bias")
    if has_bias and b_a not in shapes:  # a deterministic bias cannot move with its unit
        return None
    group = {w_a: 0, b_a: 0} if has_bias else {w_a: 0}
    for path, _ in norms:  # γ, β of the normalisation layers between (random: see _unit_norm)
        group.update({f"{path}.{n}": 0 for n in ("weight", "bias") if f"{path}.{n}" in shapes})
    group[w_b] = 1
    for site, axis in group.items():
        shape = shapes[site]
        if shape is not None and (len(shape) <= axis or shape[axis] != width):
            return None
    return group


def _has_parameter(module: nn.Module, name: str) -> bool:
    if module.__dict__.get("_parameters", {}).get(name) is not None:
        return True
    return name in module.__dict__.get("_pyro_samples", {})


def resolve_symmetries(declared: Sequence[Mapping[str, int]], shapes: Mapping[str, torch.Size]) -> Symmetry:
    """Validate user-declared groups against the sites' shapes.

    Site names may omit the ``"net."`` prefix of :class:`pyro_bnn.BNN` sites; negative
    axes count from the end.

    Raises
    ------
    TypeError
        ``declared`` is not a list of dicts mapping site names to int axes.
    ValueError
        Unknown site, axis out of range, or sizes that differ within a group.
    """
    if isinstance(declared, Mapping) or not isinstance(declared, Sequence):
        raise TypeError("permutations must be a list of dicts {site name: axis}, got "
                        f"{type(declared).__name__}")
    out: Symmetry = []
    for group in declared:
        if not isinstance(group, Mapping) or not group:
            raise TypeError(f"each symmetry group must be a non-empty dict {{site: axis}}, got {group!r}")
        resolved, size = {}, None
        for site, axis in group.items():
            name = site if site in shapes else f"net.{site}" if f"net.{site}" in shapes else None
            if name is None:
                raise ValueError(f"symmetry names site {site!r}, which is not a random site; "
                                 f"sites are {sorted(shapes)}")
            if not isinstance(axis, int) or isinstance(axis, bool):
                raise TypeError(f"axis of site {site!r} must be an int, got {axis!r}")
            ndim = len(shapes[name])
            if not -ndim <= axis < ndim:
                raise ValueError(f"axis {axis} of site {name!r} is out of range for shape "
                                 f"{tuple(shapes[name])}")
            axis = axis % ndim
            if size is not None and shapes[name][axis] != size:
                raise ValueError(f"all axes of a symmetry group must have the same size; got "
                                 f"{shapes[name][axis]} for {name!r} axis {axis}, expected {size}")
            size = shapes[name][axis]
            resolved[name] = axis
        out.append(resolved)
    return out


# ----------------------------------------------------------------------- group algebra
def group_sizes(groups: Symmetry, shapes: Mapping[str, torch.Size]) -> list[int]:
    """Number of permuted units ``d_k`` of each group."""
    return [int(shapes[next(iter(g))][g[next(iter(g))]]) for g in groups]


def log_group_order(sizes: Sequence[int]) -> float:
    """``log|G| = Σ_k log d_k!``."""
    return float(sum(math.lgamma(d + 1) for d in sizes))


def sample_permutations(sizes: Sequence[int], num: int, device=None,
                        generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """``num`` independent uniform group elements: one ``(num, d_k)`` index tensor per group."""
    return [torch.rand(num, d, device=device, generator=generator).argsort(dim=-1) for d in sizes]


def invert_permutation(p: torch.Tensor) -> torch.Tensor:
    """``p⁻¹`` (last axis), so that ``x.index_select(a, p).index_select(a, p⁻¹) == x``."""
    return p.argsort(dim=-1)


def compose_permutations(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Index map of ``g_p · g_r`` (apply ``g_r`` first, then ``g_p``): ``r[p]``."""
    return torch.gather(r, -1, p)


def enumerate_group(sizes: Sequence[int], device=None) -> list[torch.Tensor]:
    """All ``|G|`` elements, as one ``(|G|, d_k)`` index tensor per group (small G only)."""
    factors = [list(itertools.permutations(range(d))) for d in sizes]
    elements = list(itertools.product(*factors))
    return [torch.tensor([e[k] for e in elements], dtype=torch.long, device=device).reshape(len(elements), d)
            for k, d in enumerate(sizes)]


def apply_permutation(values: Mapping[str, torch.Tensor], groups: Symmetry,
                      perms: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``g·ω`` for one group element: ``perms[k]`` (shape ``(d_k,)``) acts on group ``k``.

    Sites that no group touches are returned unchanged.
    """
    out = dict(values)
    for group, p in zip(groups, perms, strict=True):
        for site, axis in group.items():
            out[site] = out[site].index_select(axis, p)
    return out


def permute_batched(values: Mapping[str, torch.Tensor], groups: Symmetry,
                    perms: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``g_j·ω`` for ``K`` elements at once: ``perms[k]`` has shape ``(K, d_k)``.

    Returns ``{site: (K, *shape)}`` for the sites some group touches (only those).
    """
    num = perms[0].shape[0] if perms else 0
    out: dict[str, torch.Tensor] = {}
    for group, p in zip(groups, perms, strict=True):
        for site, axis in group.items():
            x = out.get(site)
            if x is None:
                x = values[site].unsqueeze(0).expand(num, *values[site].shape)
            view = [num] + [1] * (x.dim() - 1)
            view[axis + 1] = p.shape[-1]
            out[site] = torch.take_along_dim(x, p.reshape(view), dim=axis + 1)
    return out


def check_symmetries(function: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                     values: Mapping[str, torch.Tensor], groups: Symmetry, *,
                     num_checks: int = 3, rtol: float = 1e-4, atol: float = 1e-5,
                     generator: torch.Generator | None = None) -> list[bool]:
    """Whether ``function(g·ω) == function(ω)`` for random elements of each group.

    Parameters
    ----------
    function : callable
        ``function(values) -> Tensor``, e.g. the network output on a batch of inputs.
    values : dict
        A weight configuration ω (draw it at random so coincidences are unlikely).
    groups : list of dict
        The symmetry to check.
    num_checks : int
        Random non-identity permutations tried per group.

    Returns
    -------
    list of bool
        One flag per group.
    """
    shapes = {k: v.shape for k, v in values.items()}
    sizes = group_sizes(groups, shapes)
    ref = function(dict(values))
    flags = []
    for group, d in zip(groups, sizes):
        ok = True
        for _ in range(num_checks):
            p = torch.randperm(d, generator=generator)
            if d > 1 and torch.equal(p, torch.arange(d)):
                p = p.roll(1)
            device = next(iter(values.values())).device
            out = function(apply_permutation(values, [group], [p.to(device)]))
            ok = ok and bool(torch.allclose(out, ref, rtol=rtol, atol=atol))
        flags.append(ok)
    return flags
