"""Jobs of :func:`~pyro_bnn.reporting.comparison.compare` run side by side in worker processes.

``compare(..., workers=2)`` trains two guides at once, one process each: on a CPU the small
networks of a comparison gain little from a second torch thread (``docs/results/speed.md``), but
two fits on two cores take about half the wall time.  Each job runs in a process forked from the
caller, so the model factory and the data need no pickling and every worker starts from the
caller's state; the job's result (the trained model, guide, fit history and ``DataTree``) comes
back through ``torch.save`` into a private temporary folder, written under a temporary name and
renamed (a worker that dies mid-write leaves no half file).  The warnings a job raises (under
the caller's filters, which the fork copies) are raised again in the caller as its result comes
in, so ``pytest.warns`` and ``warnings.catch_warnings`` see them as with ``workers=1``.  Workers
ignore Ctrl-C; the caller stops them (:func:`run_jobs` terminates every running worker when it is
interrupted).

Fork is POSIX-only and must not follow CUDA work in the workers, so ``workers > 1`` is for CPU
comparisons on Linux or macOS; :func:`check_workers` says so before any training.  Each worker
runs **one torch thread**: a forked child that uses more than one thread after its parent has used
torch's intra-op thread pool with more than one hangs (measured: parent 2 threads, child 2 threads;
the pool's threads do not survive a fork), so the workers do what torch's ``DataLoader`` workers
do.  Python 3.12+ warns (``DeprecationWarning``, hidden by default) when a process with more than
one thread forks — torch's thread pool counts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch

from ..arguments import check_int

__all__ = ["JobOutcome", "check_workers", "run_jobs"]


@dataclass
class JobOutcome:
    """What one worker sent back: its job's return value, or the exception it raised.

    ``error`` is the exception (re-created in the caller; a ``RuntimeError`` with the original's
    text when it could not be pickled, or when the worker died without a result).
    """

    name: str
    value: Any = None
    error: BaseException | None = None
    seconds: float = float("nan")


def check_workers(workers, device=None) -> int:
    """``workers`` as an int ``>= 1``; ``> 1`` needs the ``fork`` start method and the CPU.

    Raises
    ------
    TypeError, ValueError
        ``workers`` is not an int ``>= 1``; ``workers > 1`` with a CUDA or MPS ``device`` (one
        accelerator is not shared between processes here: train on it one guide at a time), or on
        a platform without ``fork`` (Windows).
    """
    workers = check_int("workers", workers, 1)
    if workers > 1:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"workers > 1 trains guides in parallel CPU processes; got workers={workers} "
                             f"with device {str(device)!r}: use workers=1 on an accelerator")
        if "fork" not in mp.get_all_start_methods():
            raise ValueError(f"workers > 1 needs the 'fork' start method (Linux, macOS), which this "
                             f"platform lacks (it has {mp.get_all_start_methods()}); use workers=1")
    return workers


def _work(job: Callable[[], Any], name: str, path: str) -> None:
    """The worker: run ``job`` and save ``{"value" or "error", "seconds", "warnings"}`` to ``path``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the caller decides when to stop
    torch.set_num_threads(1)   # more would hang in the thread pool the parent may have used
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:   # the caller's filters (inherited) apply
        try:
            outcome = {"value": job()}
        except BaseException as exc:  # sent back; the caller re-raises or records it
            outcome = {"error": exc}
    outcome["seconds"] = time.perf_counter() - t0
    outcome["warnings"] = [(w.category, str(w.message), w.filename, w.lineno) for w in caught]
    partial = f"{path}.partial"
    try:
        torch.save(outcome, partial)
    except Exception as exc:   # an unpicklable guide, exception or warning class: say which, by name
        error = outcome.get("error")
        reason = ("".join(traceback.format_exception(error)).strip() if error is not None else
                  f"the result of {name!r} could not be sent back from its worker process "
                  f"({type(exc).__name__}: {exc})")
        torch.save({"error": RuntimeError(reason), "seconds": outcome["seconds"],
                    "warnings": [(UserWarning if "<locals>" in w[0].__qualname__ else w[0], *w[1:])
                                 for w in outcome["warnings"]]}, partial)
    os.replace(partial, path)


def _collect(name: str, path: str, exitcode: int | None) -> JobOutcome:
    if not os.path.exists(path):
        return JobOutcome(name, error=RuntimeError(
            f"the worker process of {name!r} exited with code {exitcode} and no result "
            "(killed: out of memory, or a crash in native code?)"))
    saved = torch.load(path, weights_only=False)
    os.remove(path)
    for category, message, filename, lineno in saved["warnings"]:   # as if raised here
        warnings.warn_explicit(message, category, filename, lineno)
    return JobOutcome(name, value=saved.get("value"), error=saved.get("error"), seconds=saved["seconds"])


def run_jobs(jobs: Sequence[tuple[str, Callable[[], Any]]], workers: int, *,
             on_start: Callable[[int, str], None] | None = None,
             on_done: Callable[[int, JobOutcome], None] | None = None) -> dict[str, JobOutcome]:
    """Run ``jobs`` (``(name, job)`` pairs) in at most ``workers`` forked processes at a time.

    Jobs start in the given order as workers free up; each worker runs one torch thread (see
    the module docstring).

    Parameters
    ----------
    jobs : sequence of (str, callable)
        Unique names and zero-argument callables; a callable's return value must be picklable
        by ``torch.save``.
    workers : int
        Processes at once (see :func:`check_workers`).
    on_start, on_done : callable, optional
        ``on_start(index, name)`` when a job's worker starts, ``on_done(index, outcome)`` when
        its outcome is in (in the caller's process; ``index`` counts from 1).

    Returns
    -------
    dict
        ``{name: JobOutcome}`` in completion order.  On ``KeyboardInterrupt`` every running
        worker is terminated and the interrupt propagates; the outcomes collected so far are
        passed to ``on_done`` as they arrive, so the caller keeps them.
    """
    workers = check_workers(workers)
    names = [name for name, _ in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique, got {names}")
    context = mp.get_context("fork")
    pending = list(enumerate(jobs, 1))
    running: dict[int, tuple[int, str, Any, str]] = {}
    outcomes: dict[str, JobOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="pyro-bnn-workers-") as folder:
        try:
            while pending or running:
                while pending and len(running) < workers:
                    index, (name, job) = pending.pop(0)
                    path = os.path.join(folder, f"job{index}.pt")
                    process = context.Process(target=_work, args=(job, name, path),
                                              name=f"pyro-bnn {name}", daemon=True)
                    process.start()
                    running[process.sentinel] = (index, name, process, path)
                    if on_start is not None:
                        on_start(index, name)
                for sentinel in wait(list(running)):
                    index, name, process, path = running.pop(sentinel)
                    process.join()
                    outcomes[name] = outcome = _collect(name, path, process.exitcode)
                    if on_done is not None:
                        on_done(index, outcome)
        finally:
            for _, _, process, _ in running.values():
                process.terminate()
            for _, _, process, _ in running.values():
                process.join()
    return outcomes
