"""Run a function in several local processes set up as ``torchrun`` would (tests, CPU runs)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .group import is_distributed, leave_process_group

__all__ = ["launch_local", "find_free_port"]


def find_free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, fn: Callable, nprocs: int, port: int, threads: int, args: Sequence):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    torch.set_num_threads(threads)
    try:
        fn(rank, *args)
        leave_process_group()
    finally:   # after an error: leave without waiting for ranks that may never arrive
        if is_distributed():
            dist.destroy_process_group()


def launch_local(fn: Callable, nprocs: int = 2, args: Sequence = (), *, timeout_s: float = 120.0,
                 threads_per_process: int = 1) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` local processes, set up as torchrun would.

    Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and a free ``MASTER_PORT``
    on 127.0.0.1, so ``pb.fit(..., distributed=True)`` inside ``fn`` joins a Gloo group.
    ``fn`` must be importable (a module-level function): processes are spawned.

    Raises
    ------
    TimeoutError
        The processes did not finish within ``timeout_s``; all of them are killed.
    torch.multiprocessing.ProcessRaisedException
        A process raised; the others are terminated.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    port = find_free_port()
    ctx = torch.multiprocessing.start_processes(
        _child, args=(fn, nprocs, port, threads_per_process, tuple(args)), nprocs=nprocs,
        join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.05, deadline - time.monotonic()), grace_period=5):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{nprocs} processes did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
