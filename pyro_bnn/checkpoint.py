"""Checkpoint files: safe to read, written atomically, loaded all-or-nothing, with RNG states.

A checkpoint is a ``dict`` of plain data only (tensors, numbers, strings, ``None``, and
lists, tuples and dicts of them), so it loads with ``torch.load(..., weights_only=True)``,
which never runs code from the file.  This module holds the mechanics that
:func:`pyro_bnn.fit`, :func:`pyro_bnn.save_checkpoint` and :func:`pyro_bnn.load_checkpoint`
share:

* :func:`write_atomic` writes through a fixed temporary file next to the target
  (``.<name>.tmp``) and renames it into place, so a crash never leaves a half-written
  checkpoint and an interrupted save leaves at most that one file, replaced by the next save;
* :func:`read_checkpoint` reads with ``weights_only=True`` and turns torch's errors for
  truncated, foreign or unsafe files into one clear ``ValueError``;
* :func:`load_states` loads several ``state_dict``s as one transaction: everything is checked
  against the targets first, and a failure part-way restores what was already loaded;
* :func:`rng_state` / :func:`set_rng_state` capture and restore every random stream a fit
  draws from (torch CPU and CUDA, Python ``random``, NumPy) as plain data, and
  :func:`loader_rng_state` the ``torch.Generator`` of a loader that brings its own.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["write_atomic", "read_checkpoint", "check_plain_data", "load_states", "rng_state",
           "set_rng_state", "loader_rng_state", "set_loader_rng_state", "temporary_path"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def check_plain_data(value, where: str = "checkpoint") -> None:
    """Raise ``TypeError`` unless ``value`` loads with ``torch.load(weights_only=True)``.

    Allowed: tensors, ``bool``/``int``/``float``/``str``/``bytes``/``None``, ``torch.Size``,
    ``torch.dtype``/``torch.device``, and lists, tuples and dicts (``OrderedDict`` too) of these.
    """
    if isinstance(value, (torch.Tensor, torch.dtype, torch.device) + _SCALARS):
        return
    if type(value) in (list, tuple, torch.Size):
        for i, item in enumerate(value):
            check_plain_data(item, f"{where}[{i}]")
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; checkpoint dict "
                                "keys must be strings or numbers")
            check_plain_data(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, numbers, "
                    "strings, None and lists/tuples/dicts of them (so that it loads with "
                    "torch.load(weights_only=True), which never runs code from the file)")


def temporary_path(path) -> str:
    """The fixed temporary file :func:`write_atomic` uses for ``path``: ``<dir>/.<name>.tmp``."""
    path = os.path.abspath(os.fspath(path))
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")


def write_atomic(path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically.

    The data go to :func:`temporary_path` (truncated first, so a file left by an interrupted
    save is replaced), are flushed to disk, and the file is renamed over ``path``.  A crash
    at any point leaves either the previous ``path`` or the new one, never a mixture.
    """
    check_plain_data(state)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_checkpoint(path, map_location=None) -> dict:
    """Read a checkpoint with ``torch.load(..., weights_only=True)``.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    ValueError
        The file is truncated or corrupt, is not a pyro_bnn checkpoint, or holds objects
        other than plain data (refused without running them).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():  # torch names the class or function it refused
            raise ValueError(
                f"checkpoint {path!r} holds objects other than tensors and plain containers; "
                "pyro_bnn refuses to unpickle them because unpickling can run code. Checkpoints "
                "written by pyro_bnn never contain such objects. If you trust the file, read it "
                "with torch.load(path, weights_only=False) yourself.") from None
        raise ValueError(f"cannot read checkpoint {path!r}: the file is truncated, corrupt or not "
                         f"written by torch.save ({_detail(exc)})") from None
    except (RuntimeError, EOFError, KeyError, OSError, ValueError) as exc:
        raise ValueError(f"cannot read checkpoint {path!r}: the file is truncated, corrupt or not "
                         f"written by torch.save ({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(state, dict) or not {"model", "guide"} <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path!r} is not a pyro_bnn checkpoint: expected a dict with 'model' and "
                         f"'guide' state dicts, got {got}")
    return state


def _detail(exc: BaseException) -> str:
    """The informative line of torch's unpickling error (it starts with general advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "operand" in line.lower() or "error" in line.lower()]
    return (useful[-1] if useful else lines[0] if lines else type(exc).__name__)[:200]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else repr(exc)


def load_states(targets: Sequence[tuple[str, object, dict]]) -> None:
    """Load ``state_dict``s into modules, optimisers and schedulers, all or nothing.

    Parameters
    ----------
    targets : sequence of (name, target, state)
        ``target.load_state_dict(state)`` for each; ``name`` is used in messages.

    Modules are checked first (same keys, same shapes), so the usual mismatches fail before
    anything changes; any other failure part-way restores the targets already loaded.

    Raises
    ------
    ValueError
        A state does not fit its target; every target is left as it was.
    """
    for name, target, state in targets:
        if isinstance(target, torch.nn.Module):
            _check_module_state(name, target, state)
    backups = []
    try:
        for name, target, state in targets:
            backups.append((target, _backup(target)))
            try:
                target.load_state_dict(state)
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                raise ValueError(f"the checkpoint's {name} state does not fit the {name} "
                                 f"({type(exc).__name__}: {_first_line(exc)}); nothing was loaded") from exc
    except BaseException:
        for target, backup in reversed(backups):
            target.load_state_dict(backup)
        raise


def _backup(target) -> dict:
    if isinstance(target, torch.nn.Module):
        return {k: v.detach().clone() for k, v in target.state_dict().items()}
    return copy.deepcopy(target.state_dict())


def _check_module_state(name: str, module: torch.nn.Module, state) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint's {name} state must be a state_dict (dict), got "
                         f"{type(state).__name__}")
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        hint = ""
        if not own and state:
            hint = (f" The {name} has no parameters yet: a guide that creates them lazily (Pyro's "
                    "autoguides, pb.guides.*) must be set up first; load_checkpoint does that "
                    "when given example_x (one batch of inputs).")
        raise ValueError(f"the checkpoint's {name} state does not match the {name} "
                         f"({type(module).__name__}): missing keys {_few(missing)}, unexpected keys "
                         f"{_few(unexpected)}; nothing was loaded.{hint}")
    for key, value in own.items():
        other = state[key]
        if not isinstance(other, torch.Tensor):
            raise ValueError(f"the checkpoint's {name} entry {key!r} is a {type(other).__name__}, "
                             "expected a tensor; nothing was loaded")
        if other.shape != value.shape:
            raise ValueError(f"the checkpoint's {name} entry {key!r} has shape {tuple(other.shape)}, "
                             f"the {name} expects {tuple(value.shape)}; nothing was loaded")


def _few(keys: list[str], n: int = 5) -> str:
    if not keys:
        return "[]"
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)})"


# ----------------------------------------------------------------- random streams
def rng_state() -> dict:
    """Every global random stream a fit draws from, as plain data.

    Keys: ``"torch"`` (CPU generator state), ``"cuda"`` (one state per device, only where
    CUDA is initialised), ``"random"`` (Python) and ``"numpy"`` (NumPy's legacy global
    generator, which ``pyro.set_rng_seed`` seeds).  Pyro has no stream of its own.
    """
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"torch": torch.get_rng_state(),
             "random": [version, list(internal), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the streams captured by :func:`rng_state`."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise ValueError(f"the checkpoint holds the random state of {len(state['cuda'])} CUDA "
                             "device(s), which this process does not have; resume on the same devices")
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _loader_generators(loader) -> dict[str, torch.Generator]:
    """The ``torch.Generator``s a loader shuffles with, if it brings its own."""
    found, seen = {}, set()
    for name, owner in (("generator", loader), ("sampler.generator", getattr(loader, "sampler", None))):
        gen = getattr(owner, "generator", None) if owner is not None else None
        if isinstance(gen, torch.Generator) and id(gen) not in seen:
            seen.add(id(gen))
            found[name] = gen
    return found


def loader_rng_state(loader) -> dict[str, torch.Tensor]:
    """States of the loader's own generators (empty when it shuffles with the global stream,
    which :func:`rng_state` covers)."""
    return {name: gen.get_state() for name, gen in _loader_generators(loader).items()}


def set_loader_rng_state(loader, state: dict) -> None:
    """Restore :func:`loader_rng_state`; the loader must bring the same generators."""
    gens = _loader_generators(loader)
    if set(gens) != set(state):
        raise ValueError(f"the checkpoint's data loader shuffled with generators {sorted(state)}, "
                         f"this loader has {sorted(gens)}; resume with the same kind of loader")
    for name, gen in gens.items():
        gen.set_state(state[name].cpu())
