"""Checks of :func:`~pyro_bnn.reporting.comparison.compare`'s arguments, before any training.

Every option is checked for every guide it applies to (one value or ``{guide: value}``); a
per-guide option that names a guide not compared is an error that suggests the closest name;
``data`` is accepted in its three shapes (:func:`as_split`), ``guides`` in its four
(:func:`resolve_guides`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..arguments import check_int, check_positive, did_you_mean
from ..contract.guide import registered_guides
from ..data.datasets import DataSplit

__all__ = ["MAX_SEED", "check_seed", "check_device", "as_split", "resolve_guides", "per_guide",
           "check_options"]


#: The largest seed numpy (and so ``pyro.set_rng_seed``) accepts.
MAX_SEED = 2 ** 32 - 1


def check_seed(seed, *, optional: bool = False) -> int | None:
    """``seed`` as an int in ``0 .. 2**32 - 1`` (numpy's and torch's common range)."""
    seed = check_int("seed", seed, 0, optional=optional)
    if seed is not None and seed > MAX_SEED:
        raise ValueError(f"seed must be an int in 0..{MAX_SEED} (2**32 - 1), got {seed}")
    return seed


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device`` that exists here (a tiny tensor is made on it).

    Raises
    ------
    ValueError
        Not a device name (``"gpu"``), the ``meta`` device, or a device this machine lacks
        (``"cuda"`` without a GPU, ``"cuda:3"`` with one); the message says which are available.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"expected a torch device such as 'cpu', 'cuda', 'cuda:0' or 'mps', "
                         f"got {device!r}") from None
    if dev.type == "meta":
        raise ValueError("the 'meta' device holds no values; expected e.g. 'cpu' or 'cuda'")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have = "cpu" + (f", cuda:0..cuda:{gpus - 1}" if gpus else " (no CUDA GPU)")
    if dev.type == "cuda" and not gpus:
        raise ValueError(f"device {device!r} is not available here (torch.cuda.is_available() is False); "
                         f"available: {have}")
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"device {device!r} is not available here ({first}); available: {have}") from None
    return dev


def as_split(data) -> DataSplit:
    """Accept a :class:`DataSplit`, ``((x_tr, y_tr), (x_te, y_te))`` or ``(x_tr, y_tr, x_te, y_te)``."""
    if isinstance(data, DataSplit):
        return data
    if isinstance(data, Mapping):
        return DataSplit(data["x_train"], data["y_train"], data["x_test"], data["y_test"])
    if isinstance(data, Sequence) and len(data) == 2 and all(isinstance(p, Sequence) and len(p) == 2 for p in data):
        (a, b), (c, d) = data
        return DataSplit(a, b, c, d)
    if isinstance(data, Sequence) and len(data) == 4:
        return DataSplit(*data)
    raise TypeError("data must be a DataSplit, ((x_train, y_train), (x_test, y_test)) or "
                    f"(x_train, y_train, x_test, y_test); got {type(data).__name__}")


def resolve_guides(guides) -> dict[str, Callable]:
    """``{row name: guide factory}`` from :func:`compare`'s ``guides``: ``None`` (every registered
    guide), one name, a list of names, or ``{row name: registered name, callable or None}``."""
    registry = registered_guides()
    if guides is None:
        guides = list(registry)
    if isinstance(guides, str):
        guides = [guides]
    if not isinstance(guides, Mapping):
        guides = {name: name for name in guides}
    out = {}
    for name, spec in guides.items():
        spec = name if spec is None else spec
        if isinstance(spec, str):
            if spec not in registry:
                raise ValueError(f"unknown guide {spec!r}; registered guides: {sorted(registry)}")
            out[name] = registry[spec]
        elif callable(spec):
            out[name] = spec
        else:
            raise TypeError(f"guide {name!r}: expected a registered name or a callable "
                            f"guide_fn(model), got {type(spec).__name__}")
    if not out:
        raise ValueError("no guides to compare")
    return out


def per_guide(value, name, default):
    """The value of a per-guide option for guide ``name``: ``value[name]`` for a mapping (``default``
    if absent), else ``value`` itself (``default`` for ``None``)."""
    if isinstance(value, Mapping):
        return value.get(name, default)
    return default if value is None else value


def _check_guide_keys(option: str, value, names) -> None:
    """A ``{guide: value}`` option names only compared guides (a typo is an error, not ignored)."""
    if not isinstance(value, Mapping):
        return
    for key in value:
        if key not in names:
            hint = did_you_mean(str(key), names, noun="guides")
            raise ValueError(f"compare(): {option} has an entry for {key!r}, which is not one of the "
                             f"guides compared (expected {option}={{guide: value}}){hint}")


def _check_each(option: str, value, names, check) -> None:
    """Check the value of ``option`` for every guide (one value or ``{guide: value}``)."""
    _check_guide_keys(option, value, names)
    values = value.items() if isinstance(value, Mapping) else [(None, value)]
    for key, v in values:
        check(option if key is None else f"{option}[{key!r}]", v)


def _mapping_or_none(name, value) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of options or None, got {value!r} ({type(value).__name__})")


def _str_or_none(name, value) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a predictive name (str) or None, got {value!r} ({type(value).__name__})")


def _check_bool(name, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_options(names, *, epochs, lr, batch_size, num_samples, loo_samples, loo_observations, seed,
                   progress, details, guide_options, fit_options, predictive) -> None:
    """Every option of :func:`compare`, before any training: types, ranges and guide names."""
    _check_each("epochs", epochs, names, lambda n, v: check_int(n, v, 0))
    _check_each("lr", lr, names, lambda n, v: check_positive(n, v, optional=True))
    check_int("batch_size", batch_size, 1)
    check_int("num_samples", num_samples, 1)
    check_int("loo_samples", loo_samples, 0)
    if loo_observations is not None:
        check_int("loo_observations", loo_observations, 1)
    check_seed(seed, optional=True)
    _check_bool("progress", progress)
    _check_bool("details", details)
    for option, value in (("guide_options", guide_options), ("fit_options", fit_options)):
        _mapping_or_none(option, value)
        _check_each(option, value or {}, names, _mapping_or_none)
    _check_each("predictive", predictive, names, _str_or_none)
