"""A folder written whole or not at all (the main job's report folder)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import threading
from pathlib import Path

__all__ = ["StagedFolder"]


class StagedFolder:
    """A folder written whole or not at all: files go to a temporary sibling, then swap in.

    Creating it checks that ``out`` can be written (the temporary sibling is made at once,
    so an unwritable place fails before any work is done).  :meth:`commit` replaces ``out``
    by the staged folder: ``out`` is renamed aside, the staged folder renamed to ``out``,
    the old one deleted, with Ctrl-C (SIGINT) held back during the two renames.
    :meth:`discard` deletes the staged folder.  As a context manager it commits on success
    and discards on any exception (``KeyboardInterrupt`` included).

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
        ``out`` is not a folder or its parent cannot be written; the message names ``out``.
    """

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out).absolute()
        if self.out.exists() and not self.out.is_dir():
            raise NotADirectoryError(f"cannot write the report to {out}: it exists and is not a folder")
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            _clean_stale(self.out)
            self.path = parent / f".{self.out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            self.path.mkdir()
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot write the report to {out}: {exc.strerror or exc}") from None
        self.committed = False

    def commit(self) -> Path:
        """Swap the staged folder into place; returns ``out``."""
        aside = self.out.parent / f".{self.out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        with _sigint_held():
            had_old = self.out.exists()
            if had_old:
                os.rename(self.out, aside)
            try:
                os.rename(self.path, self.out)
            except BaseException:
                if had_old:
                    os.rename(aside, self.out)
                raise
            self.committed = True
        if had_old:
            shutil.rmtree(aside, ignore_errors=True)
        return self.out

    def discard(self) -> None:
        """Delete the staged folder (no-op after :meth:`commit`)."""
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> StagedFolder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


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
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            if kind == "old" and not out.exists():
                os.rename(p, out)  # killed mid-swap: the previous report comes back
            else:
                shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
