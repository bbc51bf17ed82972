"""A folder written whole or not at all (the main job's report folder), that replaces only
a folder this program wrote itself."""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from .._version import __version__

__all__ = ["StagedFolder", "NotAReportFolder", "MARKER", "read_marker", "check_replaceable"]

#: The marker file in every folder this program writes: JSON with ``program``, ``version``,
#: ``written`` (UTC time), ``status`` (``complete``, ``partial`` or ``failed``) and ``files``
#: (every file written, relative paths).  Only a folder with this marker, holding no file
#: outside ``files``, is ever replaced.
MARKER = ".pyro-bnn-report"
PROGRAM = "pyro-bnn"


class NotAReportFolder(FileExistsError):
    """``out`` holds something this program did not write: it is never replaced."""


def read_marker(folder: str | os.PathLike) -> dict | None:
    """The marker of a report folder written by this program, else ``None``."""
    path = Path(folder) / MARKER
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("program") == PROGRAM else None


def _entries(folder: Path) -> list[str]:
    """Every path below ``folder`` (files, links and folders; links are not followed)."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel = Path(root).relative_to(folder)
        found += [(rel / n).as_posix() for n in dirs + files]
    return found


def _refuse(out: Path, what: str, fix: str = "or move those files away") -> NotAReportFolder:
    return NotAReportFolder(errno.EEXIST, f"refusing to write the report to {out}: {what}; choose "
                            f"another --out (a new or empty folder){', ' + fix if fix else ''}")


def check_replaceable(out: str | os.PathLike) -> None:
    """Raise unless ``out`` may be replaced by a new report.

    ``out`` may be missing, an empty folder, or a folder with this program's marker
    (:data:`MARKER`) that holds only the files the marker lists.  The current folder may only
    be an earlier marked report (its entries are then replaced; the folder itself stays); a
    folder above it is never replaced; a symbolic link is refused.

    Raises
    ------
    ValueError
        ``out`` is empty text.
    NotADirectoryError
        ``out`` is a file.
    NotAReportFolder
        ``out`` is a link, the current folder, or holds files this program did not write;
        the message names ``out`` and what to do.
    """
    if str(out) == "":
        raise ValueError("the report folder is empty text; expected a folder name such as 'pyro-bnn-report'")
    out = Path(out).absolute()
    if out.is_symlink():
        raise _refuse(out, "it is a symbolic link (only a real folder is replaced)", "")
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"cannot write the report to {out}: it exists and is not a folder")
    if _contains_cwd(out):
        raise _refuse(out, "it contains the current folder, which is never removed",
                      "such as a subfolder 'pyro-bnn-report'")
    entries = _entries(out)
    marker = read_marker(out)
    if _is_cwd(out) and marker is None:  # the current folder: only an earlier report, updated in place
        raise _refuse(out, f"it is the current folder and not a report written by {PROGRAM} (no {MARKER} "
                      "marker)", "such as a subfolder 'pyro-bnn-report'")
    if not entries:
        return
    if marker is None:
        raise _refuse(out, f"the folder is not empty and was not written by {PROGRAM} (it has no "
                      f"{MARKER} marker; it holds {_sample(entries)})")
    listed = set(marker.get("files", [])) | {MARKER}
    # a real (not linked) folder is never "extra" by itself: the files in it are checked
    extra = [e for e in entries if (out / e).is_symlink() or not ((out / e).is_dir() or e in listed)]
    if extra:
        raise _refuse(out, f"it is an earlier report, but holds files it did not write: {_sample(extra)}")


def _is_cwd(path: Path) -> bool:
    cwd = Path.cwd()
    return path == cwd or (path.exists() and cwd.exists() and os.path.samefile(path, cwd))


def _contains_cwd(path: Path) -> bool:
    """Whether the current folder lies strictly inside ``path``."""
    cwd = Path.cwd()
    return path in cwd.parents or (path.exists() and any(
        p.exists() and os.path.samefile(path, p) for p in cwd.resolve().parents))


def _sample(names: list[str], most: int = 3) -> str:
    shown = ", ".join(sorted(names)[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class StagedFolder:
    """A folder written whole or not at all: files go to a temporary sibling, then swap in.

    Creating it checks that ``out`` may be replaced (:func:`check_replaceable`: missing,
    empty, or an earlier report of this program) and can be written (the temporary sibling
    is made at once), so a wrong ``--out`` fails before any work is done.  :meth:`commit`
    writes the marker (:data:`MARKER`) and replaces ``out`` (or another target, such as a
    ``<out>.partial`` sibling) by the staged folder: the target is checked again, renamed
    aside, the staged folder renamed into place, the old one deleted (links are removed, never
    followed), with Ctrl-C (SIGINT) held back during the two renames.  :meth:`discard`
    deletes the staged folder.  As a context manager it commits on success and discards on
    any exception (``KeyboardInterrupt`` included).

    Folders left by a process that was killed (SIGKILL) are cleaned up by the next
    ``StagedFolder`` for the same ``out``: staged ones are deleted; a previous report left
    aside mid-swap is renamed back to ``out`` if ``out`` is missing.

    Parameters
    ----------
    out : path
        The folder to (re)write.

    Raises
    ------
    OSError
        ``out`` may not be replaced (:class:`NotAReportFolder`), is a file, or its parent
        cannot be written; the message names ``out``.
    ValueError
        ``out`` is empty text.
    """

    def __init__(self, out: str | os.PathLike):
        check_replaceable(out)
        self.out = Path(out).absolute()
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            _clean_stale(self.out)
            self.path = parent / f".{self.out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            self.path.mkdir()
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot write the report to {out}: {exc.strerror or exc}") from None
        self.committed = False

    def write_marker(self, *, status: str = "complete", info: Mapping | None = None) -> Path:
        """Write the marker into the staged folder, listing every file in it."""
        files = sorted(e for e in _entries(self.path) if (self.path / e).is_file())
        payload = {"program": PROGRAM, "version": __version__, "status": status,
                   "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   **dict(info or {}), "files": files}
        path = self.path / MARKER
        path.write_text(json.dumps(payload, indent=2))
        return path

    def commit(self, target: str | os.PathLike | None = None, *, status: str = "complete",
               info: Mapping | None = None) -> Path:
        """Write the marker and swap the staged folder into ``target`` (default ``out``).

        Returns
        -------
        Path
            The folder written.

        Raises
        ------
        NotAReportFolder, NotADirectoryError
            ``target`` may not be replaced (checked again: files may have appeared since).
        """
        target = self.out if target is None else Path(target).absolute()
        check_replaceable(target)
        self.write_marker(status=status, info=info)
        aside = target.parent / f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        if _is_cwd(target):  # an earlier report that is the current folder: swap its entries
            self._swap_entries(target, aside)
            return target
        with _sigint_held():
            had_old = target.exists()
            if had_old:
                os.rename(target, aside)
            try:
                os.rename(self.path, target)
            except BaseException:
                if had_old:
                    os.rename(aside, target)
                raise
            self.committed = True
        if had_old:
            _remove_tree(aside)
        return target

    def _swap_entries(self, target: Path, aside: Path) -> None:
        """Replace the entries of ``target`` (the current folder, never removed) by the staged ones."""
        aside.mkdir()
        moved_old, moved_new = [], []
        with _sigint_held():
            try:
                for name in os.listdir(target):
                    os.rename(target / name, aside / name)
                    moved_old.append(name)
                for name in os.listdir(self.path):
                    os.rename(self.path / name, target / name)
                    moved_new.append(name)
            except BaseException:
                for name in moved_new:
                    os.rename(target / name, self.path / name)
                for name in moved_old:
                    os.rename(aside / name, target / name)
                aside.rmdir()
                raise
            self.committed = True
        _remove_tree(aside)
        self.path.rmdir()

    def discard(self) -> None:
        """Delete the staged folder (no-op after :meth:`commit`)."""
        if not self.committed:
            _remove_tree(self.path)

    def __enter__(self) -> StagedFolder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def _remove_tree(path: Path) -> None:
    """Delete a folder this module made; a link is unlinked, never followed."""
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)  # rmtree removes links inside, never follows them


@contextlib.contextmanager
def _sigint_held():
    """Hold back SIGINT (delivered on exit) where the OS allows it, from the main thread."""
    can = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    if can:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if can:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _clean_stale(out: Path) -> None:
    """Remove staged/aside folders of ``out`` whose process no longer runs (POSIX only)."""
    if os.name != "posix" or not out.parent.is_dir():
        return
    for kind in ("tmp", "old"):
        for p in out.parent.glob(f".{out.name}.{kind}-*-*"):
            pid = p.name[len(f".{out.name}.{kind}-"):].split("-")[0]
            if not pid.isdigit() or _pid_alive(int(pid)) or p.is_symlink() or not p.is_dir():
                continue
            if kind == "old" and not out.exists():
                os.rename(p, out)  # killed mid-swap: the previous report comes back
            else:
                _remove_tree(p)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
