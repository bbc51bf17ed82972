"""Output files of the scripts (``examples/``, ``benchmarks/``): never replaced unasked, written
atomically.  A script calls :func:`check_new_file` for every path it will write right after parsing its
arguments, before any training, so a long run never ends in a refusal; at the end it writes
through :func:`write_json`, :func:`write_text`, :func:`save_figure` or :func:`save_torch`
(all :func:`write_file`), with ``overwrite=args.overwrite`` (the scripts' ``--overwrite``).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import torch

from ..training.checkpoint import replace_atomically

__all__ = ["check_new_file", "write_file", "write_text", "write_json", "save_figure", "save_torch"]


def check_new_file(path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Refuse an output path that would replace something unasked.

    Parameters
    ----------
    path : str or os.PathLike
        The file to be written.
    overwrite : bool, default False
        Allow replacing an existing file (or link) at ``path``.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    IsADirectoryError
        ``path`` is a folder (or a link to one), even with ``overwrite``.
    FileExistsError
        Something exists at ``path`` (a dangling link too) and ``overwrite`` is False.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a folder; choose a file path for the output")
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{str(path)!r} already exists; pass --overwrite (overwrite=True) to "
                              "replace it, or choose another path")
    return path


def write_file(path: str | os.PathLike, write: Callable, *, overwrite: bool = False,
               binary: bool = False) -> Path:
    """Write a file atomically through ``write(fh)``, refusing to replace one unasked.

    The content goes to a new temporary file ``.<name>.<random>.tmp`` in the target's folder
    (created if missing), is flushed to disk and renamed over ``path``: a crash or an error
    leaves the previous file (or none) intact, and the temporary file is removed.  A new file
    gets the permissions ``open`` would give it (``0o666`` less the umask); a replaced regular
    file keeps its own.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write.
    write : callable
        Called once with the open file handle (text, UTF-8; or binary).
    overwrite : bool, default False
        Allow replacing an existing file (a link at ``path`` is replaced, not written through).
    binary : bool, default False
        Open the handle in binary mode.

    Returns
    -------
    pathlib.Path
        The path written.

    Raises
    ------
    FileExistsError, IsADirectoryError
        As :func:`check_new_file` (checked again here).
    """
    path = check_new_file(path, overwrite=overwrite)
    st = path.lstat() if os.path.lexists(path) else None
    mode = stat.S_IMODE(st.st_mode) if st is not None and stat.S_ISREG(st.st_mode) else None
    replace_atomically(path, write, binary=binary, mode=mode)
    return path


def write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` with :func:`write_file`."""
    return write_file(path, lambda fh: fh.write(text), overwrite=overwrite)


def write_json(path: str | os.PathLike, obj, *, overwrite: bool = False, indent: int | None = 2,
               **dump_kwargs) -> Path:
    """``json.dump(obj, fh, indent=indent, **dump_kwargs)`` to ``path`` with :func:`write_file`."""
    return write_file(path, lambda fh: json.dump(obj, fh, indent=indent, **dump_kwargs), overwrite=overwrite)


def save_figure(fig, path: str | os.PathLike, *, overwrite: bool = False, **savefig_kwargs) -> Path:
    """``fig.savefig`` to ``path`` with :func:`write_file`, in the format of its suffix (``.png``)."""
    fmt = Path(path).suffix.lstrip(".").lower() or None
    return write_file(path, lambda fh: fig.savefig(fh, format=fmt, **savefig_kwargs),
                      overwrite=overwrite, binary=True)


def save_torch(obj, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """``torch.save(obj)`` to ``path`` with :func:`write_file`."""
    return write_file(path, lambda fh: torch.save(obj, fh), overwrite=overwrite, binary=True)
