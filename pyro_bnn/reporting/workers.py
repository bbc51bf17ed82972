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
ignore Ctrl-C from their first instruction (SIGINT is blocked across the fork); the caller stops
them (:func:`run_jobs` terminates every running worker when it is interrupted).

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
from contextlib import AbstractContextManager, nullcontext
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


def _work(job: Callable[[Callable[[Any], None]], Any], name: str, path: str, channel) -> None:
    """The worker: run ``job(report)`` and save ``{"value" or "error", "seconds", "warnings"}`` to
    ``path``; ``report(message)`` sends ``message`` to the caller through ``channel``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the caller decides when to stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})   # blocked by run_jobs for the fork
    torch.set_num_threads(1)   # more would hang in the thread pool the parent may have used
    report = channel.send
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:   # the caller's filters (inherited) apply
        try:
            outcome = {"value": job(report)}
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
    channel.close()


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


def run_jobs(jobs: Sequence[tuple[str, Callable[[Callable[[Any], None]], Any]]], workers: int, *,
             on_start: Callable[[int, str], None] | None = None,
             on_done: Callable[[int, JobOutcome], None] | None = None,
             on_message: Callable[[int, Any], None] | None = None,
             output: Callable[[], AbstractContextManager] = nullcontext) -> dict[str, JobOutcome]:
    """Run ``jobs`` (``(name, job)`` pairs) in at most ``workers`` forked processes at a time.

    Jobs start in the given order as workers free up; each worker runs one torch thread (see
    the module docstring).

    Parameters
    ----------
    jobs : sequence of (str, callable)
        Unique names and callables of one argument, ``job(report)``: ``report(message)`` sends
        a picklable ``message`` (progress, say) to the caller while the job runs.  A job's
        return value must be picklable by ``torch.save``.
    workers : int
        Processes at once (see :func:`check_workers`).
    on_start, on_done, on_message : callable, optional
        ``on_start(index, name)`` when a job's worker starts, ``on_message(index, message)`` for
        each message its job reports (in the order sent; every one before ``on_done``), and
        ``on_done(index, outcome)`` when its outcome is in — all in the caller's process;
        ``index`` counts from 1.
    output : callable, optional
        ``output()`` is a context entered while a finished job's warnings are raised again and
        its ``on_done`` runs (the caller's progress bars cleared while they print, say).

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
    running: dict[int, _Worker] = {}   # by process sentinel
    outcomes: dict[str, JobOutcome] = {}

    def relay(worker: _Worker) -> None:
        """Pass on every message the worker has sent so far (all of them once it has exited)."""
        while worker.channel is not None and worker.channel.poll():
            try:
                message = worker.channel.recv()
            except EOFError:   # the worker closed its end: nothing more will come
                worker.channel.close()
                worker.channel = None
                return
            if on_message is not None:
                on_message(worker.index, message)

    with tempfile.TemporaryDirectory(prefix="pyro-bnn-workers-") as folder:
        try:
            while pending or running:
                while pending and len(running) < workers:
                    index, (name, job) = pending.pop(0)
                    path = os.path.join(folder, f"job{index}.pt")
                    receive, send = context.Pipe(duplex=False)
                    process = context.Process(target=_work, args=(job, name, path, send),
                                              name=f"pyro-bnn {name}", daemon=True)
                    # SIGINT blocked across the fork: the worker inherits the mask and ignores
                    # Ctrl-C before it can arrive (else one could hit its start-up code); here it
                    # is delivered once the worker is registered, so the worker is stopped
                    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                    try:
                        process.start()
                        send.close()   # the worker's end: closed here, so its exit ends the channel
                        running[process.sentinel] = _Worker(index, name, process, path, receive)
                    finally:
                        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                    if on_start is not None:
                        on_start(index, name)
                channels = {w.channel: w for w in running.values() if w.channel is not None}
                for ready in wait([*running, *channels]):
                    if ready in channels:
                        relay(channels[ready])
                        continue
                    if ready not in running:
                        continue
                    worker = running.pop(ready)
                    worker.process.join()
                    relay(worker)
                    if worker.channel is not None:
                        worker.channel.close()
                    with output():
                        outcomes[worker.name] = outcome = _collect(worker.name, worker.path,
                                                                   worker.process.exitcode)
                        if on_done is not None:
                            on_done(worker.index, outcome)
        finally:
            for worker in running.values():
                worker.process.terminate()
            for worker in running.values():
                worker.process.join()
                if worker.channel is not None:
                    worker.channel.close()
    return outcomes


@dataclass
class _Worker:
    """A running job: its index and name, process, result file and the end of its channel the
    caller reads (``None`` once closed)."""

    index: int
    name: str
    process: Any
    path: str
    channel: Any
