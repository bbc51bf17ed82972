"""Checkpoint files: safe to read, written atomically, loaded all-or-nothing, with RNG states.

A checkpoint is a ``dict`` of plain data only (tensors, numbers, strings, ``None``, and
lists, tuples and dicts of them), so it loads with ``torch.load(..., weights_only=True)``,
which never runs code from the file.  This module holds the mechanics that
:func:`pyro_bnn.fit`, :func:`pyro_bnn.save_checkpoint` and :func:`pyro_bnn.load_checkpoint`
share:

* :func:`write_atomic` stores a SHA-256 digest of the content in the file (:func:`content_digest`)
  and writes through a temporary file of its own, created exclusively (``O_EXCL``, never
  following a link) under a unique name ``.<name>.<random>.tmp`` next to the target, flushed
  and renamed into place: a crash never leaves a half-written checkpoint, two writers never
  share a temporary file, and a link planted in the folder is never written through;
* :func:`read_checkpoint` reads with ``weights_only=True``, verifies the digest (a flipped bit
  is an error, not a different result) and turns torch's errors for truncated, foreign or
  unsafe files into one clear ``ValueError``;
* :class:`CheckpointLock` is the lock ``fit`` holds on its checkpoint path for the whole fit
  (``<path>.lock``, ``fcntl.flock``), so a second fit on the same path stops at its start;
* :func:`load_states` loads several ``state_dict``s as one transaction: everything is checked
  against the targets first, and a failure part-way restores what was already loaded;
* :func:`rng_state` / :func:`set_rng_state` capture and restore every random stream a fit
  draws from (torch CPU and CUDA, Python ``random``, NumPy) as plain data, and
  :func:`loader_rng_state` the ``torch.Generator`` of a loader that brings its own.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import random
import tempfile
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from .guide_setup import setup_guide

try:
    import fcntl
except ImportError:  # not POSIX (Windows): fit's checkpoint lock is unavailable
    fcntl = None

__all__ = ["save_checkpoint", "load_checkpoint", "write_atomic", "read_checkpoint", "check_plain_data", "load_states", "rng_state",
           "set_rng_state", "loader_rng_state", "set_loader_rng_state", "content_digest",
           "CheckpointLock", "CheckpointInUseError", "CHECKSUM_KEY", "replace_atomically"]

#: the entry of every checkpoint written by :func:`write_atomic` that holds its digest
CHECKSUM_KEY = "checksum"
_DIGEST_SCHEME = "pyro_bnn.sha256/1"

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


def write_atomic(path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically, with a digest of the content.

    ``state`` gets the entry ``"checksum"`` (:data:`CHECKSUM_KEY`: the SHA-256 of
    :func:`content_digest`), which :func:`read_checkpoint` verifies.  The data go to a new
    temporary file in the target's folder, created with ``O_CREAT | O_EXCL`` under a random
    name ``.<name>.<random>.tmp`` (:func:`tempfile.mkstemp`: it never opens an existing file
    or follows a link, so neither a link planted there nor a second writer can make it write
    elsewhere), are flushed to disk, and the file is renamed over ``path``.  A crash at any
    point leaves either the previous ``path`` or the new one, never a mixture; a failure
    removes the temporary file.  The file gets the permissions ``open`` would give it
    (``0o666`` less the umask).
    """
    if CHECKSUM_KEY in state:
        raise ValueError(f"the checkpoint entry {CHECKSUM_KEY!r} is reserved for the file's digest")
    check_plain_data(state)
    state = {**state, CHECKSUM_KEY: {"scheme": _DIGEST_SCHEME, "sha256": content_digest(state)}}
    replace_atomically(path, lambda fh: torch.save(state, fh))


def replace_atomically(path, write, *, binary: bool = True, mode: int | None = None) -> None:
    """Write ``path`` through ``write(fh)`` atomically: a new temporary file in the target's folder
    (created if missing), flushed to disk, renamed over ``path``.

    The temporary file is created with ``O_CREAT | O_EXCL`` under a random name
    ``.<name>.<random>.tmp`` (:func:`tempfile.mkstemp`: it never opens an existing file or
    follows a link); a crash leaves the previous ``path`` or the new one, never a mixture, and a
    failure removes the temporary file.  ``mode``: the file's permissions (default: those ``open``
    would give, ``0o666`` less the umask).  ``binary=False`` opens a UTF-8 text handle.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as fh:
            if hasattr(os, "fchmod"):
                os.fchmod(fh.fileno(), 0o666 & ~_process_umask() if mode is None else mode)
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)


def _process_umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc``)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def content_digest(state) -> str:
    """SHA-256 (hex) of a checkpoint's content: every tensor's dtype, shape and bytes, every
    number, string and key, and the nesting, in order.

    It is computed from the values, not from torch's file format, so a file read back gives
    the digest it was written with exactly when its content is what was written.
    """
    hasher = hashlib.sha256()
    _feed(hasher, state)
    return hasher.hexdigest()


def _feed(hasher, value) -> None:
    """Feed one value to ``hasher`` as a tagged, length-prefixed record."""
    def record(tag: bytes, payload: bytes) -> None:
        hasher.update(tag + len(payload).to_bytes(8, "little") + payload)

    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_quantized:
            t = t.int_repr()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous().reshape(-1)
        record(b"T", f"{t.dtype}|{tuple(value.shape)}".encode())
        record(b"D", t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, bool) or value is None:
        record(b"B", repr(value).encode())
    elif isinstance(value, (int, float, complex)):
        record(type(value).__name__[:1].upper().encode(), repr(type(value)(value)).encode())
    elif isinstance(value, str):
        record(b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes):
        record(b"Y", value)
    elif isinstance(value, (torch.dtype, torch.device)):
        record(b"E", str(value).encode())
    elif isinstance(value, dict):
        record(b"M", str(len(value)).encode())
        for key, item in value.items():
            _feed(hasher, key)
            _feed(hasher, item)
    elif isinstance(value, (list, tuple)):
        record(b"L", str(len(value)).encode())
        for item in value:
            _feed(hasher, item)
    else:
        raise TypeError(f"cannot digest a {type(value).__name__}")


def verify_digest(state: dict, path: str) -> None:
    """Raise ``ValueError`` unless ``state`` matches the digest stored in it (a file without
    one, written by ``torch.save`` itself or an older pyro_bnn, passes unverified)."""
    stored = state.get(CHECKSUM_KEY)
    if stored is None:
        damaged = [k for k in state if isinstance(k, str) and len(k) == len(CHECKSUM_KEY)
                   and sum(a != b for a, b in zip(k, CHECKSUM_KEY)) == 1]
        if damaged:  # one flipped bit in the key's name would otherwise skip the check
            raise ValueError(f"checkpoint {path!r} is corrupt: it has an entry {damaged[0]!r} where "
                             f"its digest {CHECKSUM_KEY!r} belongs; nothing was loaded")
        return
    if not (isinstance(stored, dict) and stored.get("scheme") == _DIGEST_SCHEME
            and isinstance(stored.get("sha256"), str)):
        raise ValueError(f"checkpoint {path!r} has a malformed {CHECKSUM_KEY!r} entry (expected "
                         f"{{'scheme': {_DIGEST_SCHEME!r}, 'sha256': <hex>}}, got {stored!r:.200}); "
                         "the file is corrupt or was edited")
    content = {k: v for k, v in state.items() if k != CHECKSUM_KEY}
    try:
        actual = content_digest(content)
    except TypeError as exc:  # a damaged file can unpickle to objects that are not plain data
        actual = f"undigestable ({exc})"
    if actual != stored["sha256"]:
        raise ValueError(f"checkpoint {path!r} is corrupt: its content does not match the SHA-256 "
                         f"digest stored in it ({stored['sha256'][:16]}... expected, {actual[:16]}... "
                         "found), so a bit changed on disk or in transfer, or the file was edited; "
                         "nothing was loaded. Restore the file from a copy or start a new fit")


def _fsync_folder(folder) -> None:
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
    except Exception as exc:  # a damaged file makes torch's reader fail in many ways (IndexError, ...)
        raise ValueError(f"cannot read checkpoint {path!r}: the file is truncated, corrupt or not "
                         f"written by torch.save ({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(state, dict) or not {"model", "guide"} <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path!r} is not a pyro_bnn checkpoint: expected a dict with 'model' and "
                         f"'guide' state dicts, got {got}")
    verify_digest(state, path)
    for key in ("model", "guide"):
        if not isinstance(state[key], dict):
            raise ValueError(f"checkpoint {path!r}: {key!r} must be a state_dict (dict), got "
                             f"{type(state[key]).__name__}")
    epoch = state.get("epoch")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise ValueError(f"checkpoint {path!r}: 'epoch' must be an int >= 0, got {epoch!r}")
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


# ----------------------------------------------------------------- the fit's lock
class CheckpointInUseError(RuntimeError):
    """Another fit holds the lock on this checkpoint path."""


class CheckpointLock:
    """An exclusive, non-blocking lock on a checkpoint path, held by one fit at a time.

    The lock is ``fcntl.flock`` on ``<path>.lock`` (opened with ``O_NOFOLLOW``, holding the
    owner's pid for the message).  The operating system releases it when the process dies, so
    a killed fit never leaves a stale lock; a clean release removes the file.  Where
    ``fcntl`` does not exist (Windows) the lock does nothing.  Use as a context manager.

    Raises
    ------
    CheckpointInUseError
        On entry, when another process (or another fit in this one) holds the lock.
    """

    def __init__(self, path):
        self.lock_path = os.path.abspath(os.fspath(path)) + ".lock"
        self.checkpoint = os.fspath(path)
        self._fd = None

    def __enter__(self):
        if fcntl is None:
            return self
        os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        for _ in range(100):  # the file may be removed by the previous owner meanwhile: retry
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                owner = _read_owner(fd)
                os.close(fd)
                raise CheckpointInUseError(
                    f"checkpoint path {self.checkpoint!r} is in use by another fit ({owner}): two "
                    "fits writing one checkpoint would overwrite each other's; wait for it to end, "
                    f"or give this fit another checkpoint path (lock file {self.lock_path!r})") from None
            if self._same_file(fd):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return self
            os.close(fd)
        raise CheckpointInUseError(f"could not lock {self.lock_path!r}: it is being replaced repeatedly")

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(self.lock_path, flags, 0o644)
        except OSError:
            if os.path.islink(self.lock_path):
                raise ValueError(f"the checkpoint lock file {self.lock_path!r} is a symbolic link; "
                                 "pyro_bnn does not follow it. Remove it if it is not yours") from None
            raise

    def _same_file(self, fd: int) -> bool:
        try:
            now = os.stat(self.lock_path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def __exit__(self, *exc_info):
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._same_file(fd):
                os.remove(self.lock_path)
        finally:
            os.close(fd)  # releases the lock


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"


def save_checkpoint(path, model, guide, optimizer=None, **extra) -> None:
    """Write model, guide (and optimiser) ``state_dict``s and ``extra`` entries to ``path``.

    Replaces a file at ``path`` (this call asks for it).  Atomic
    (:func:`pyro_bnn.training.checkpoint.write_atomic`): written to a new, uniquely named temporary file
    next to ``path`` (created exclusively; never a link), flushed and renamed into place, so a
    crash leaves the previous file intact and two writers never collide.  The file holds a
    SHA-256 digest of its content, which :func:`load_checkpoint` verifies.  Every entry must be
    plain data (tensors, numbers, strings, ``None``, lists/tuples/dicts of them), so the file
    loads with ``torch.load(weights_only=True)``.

    Raises
    ------
    TypeError
        An entry of ``extra`` is not plain data (the message names it).
    """
    state = {"model": model.state_dict(), "guide": guide.state_dict(), **extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    check_plain_data(state)
    write_atomic(path, state)


def load_checkpoint(path, model, guide, example_x=None, example_y=None, map_location=None) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` / ``fit(checkpoint=...)``.

    Reads with ``torch.load(..., weights_only=True)`` (no code from the file runs) and loads
    all or nothing: every state is checked against ``model`` and ``guide`` first, and a
    failure leaves both untouched.  A fresh autoguide creates its parameters lazily: pass
    ``example_x`` (one batch of inputs) so it can be set up before the state is loaded.
    Returns the whole dict (``epoch``, ``history``, ``optimizer``, ... as written).

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    ValueError
        A truncated, corrupt (content not matching its digest), foreign or unsafe file, or
        states that do not fit ``model`` and ``guide`` (a guide not set up yet: the message
        asks for ``example_x``).
    """
    state = read_checkpoint(path, map_location=map_location)
    if example_x is not None:
        setup_guide(model, guide, example_x, example_y)
    targets = [("model", model, state["model"])]
    if isinstance(guide, torch.nn.Module):
        targets.append(("guide", guide, state["guide"]))
    load_states(targets)
    return state
