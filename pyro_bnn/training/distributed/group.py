"""The process group: joining it from torchrun's variables, seeding, collectives, DDP.

See :mod:`pyro_bnn.training.distributed` for the overall scheme.
"""

from __future__ import annotations

import datetime
import os
import random
import warnings
from dataclasses import dataclass

import pyro
import torch
import torch.distributed as dist

from .sharding import unpadded_shard

__all__ = [
    "DistributedOptions", "DistributedState", "default_backend", "torchrun_env",
    "init_process_group", "start", "is_distributed", "is_main_process", "get_rank",
    "get_world_size", "all_reduce_sum_", "all_reduce_mean_", "all_reduce_sums", "broadcast_seed",
    "leave_process_group",
]

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedOptions:
    """Options for ``pb.fit(..., distributed=DistributedOptions(...))``.

    Parameters
    ----------
    backend : {"nccl", "gloo"}, optional
        Default: NCCL when training on CUDA, Gloo on CPU.
    shared_noise : bool
        All ranks draw the same guide noise each step (default).  Training then equals
        single-process training with the same global batch.  ``False`` seeds rank ``r``
        with ``seed + r``: independent weight samples per rank (still an unbiased gradient,
        lower variance, but no longer identical to one process).
    find_unused_parameters : bool, optional
        Passed to ``DistributedDataParallel``; ``None`` (default) detects it with one
        gradient evaluation before training.
    timeout_s : float
        Timeout of collective operations (seconds).
    """

    backend: str | None = None
    shared_noise: bool = True
    find_unused_parameters: bool | None = None
    timeout_s: float = 1800.0


def default_backend(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` for the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"distributed training supports cpu and cuda devices, got {kind!r}")


def torchrun_env() -> dict[str, int | str] | None:
    """torchrun's variables (``rank``, ``world_size``, ``local_rank``, ...) or ``None``."""
    if not all(v in os.environ for v in _ENV_VARS):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "master_addr": os.environ["MASTER_ADDR"], "master_port": os.environ["MASTER_PORT"]}


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def leave_process_group() -> None:
    """End of a distributed script: every rank waits for the others, then all leave the group.

    ``pb.fit(..., distributed=True)`` joins the process group and leaves it open (later fits
    reuse it).  Destroying it while another rank still works in it (rank 0 evaluating) made Gloo
    abort that rank at exit now and then, hence the barrier first.  Nothing to do without a
    process group.
    """
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on rank 0, or when not running distributed: the process that logs and saves."""
    return get_rank() == 0


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (a no-op without a process group)."""
    if is_distributed() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum a dict of tensors over all ranks (one collective per dtype).

    The ``reduce_fn`` of :func:`pyro_bnn.curvature.accumulate_curvature`: per-rank KFAC /
    GGN factor sums, log-likelihood statistics and counts become the sums over the whole
    data set, so curvature, posterior and evidence equal the single-process ones.  Every
    rank must pass the same keys and shapes.  The results carry no autograd graph.

    Parameters
    ----------
    sums : dict of str -> Tensor
        This rank's partial sums.

    Returns
    -------
    dict of str -> Tensor
        New tensors (inputs are not modified), same keys, shapes and dtypes.
    """
    if not is_distributed() or get_world_size() == 1:
        return dict(sums)
    keys = sorted(sums)
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k in keys:
        by_dtype.setdefault(sums[k].dtype, []).append(k)
    for group in by_dtype.values():
        flat = torch.cat([sums[k].detach().reshape(-1) for k in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for k, part in zip(group, flat.split([sums[k].numel() for k in group])):
            out[k] = part.view_as(sums[k])
    return {k: out[k] for k in sums}


def all_reduce_mean_(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over all ranks in place (a no-op without a process group)."""
    return all_reduce_sum_(tensor).div_(get_world_size())


def broadcast_seed(seed: int | None, device: torch.device | str = "cpu") -> int:
    """Rank 0's ``seed`` on every rank; rank 0 draws a fresh one when ``seed`` is None."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**31) if is_main_process() else 0
    if not is_distributed():
        return int(seed)
    t = torch.tensor([int(seed)], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def _resolve_device(device, local_rank: int) -> torch.device:
    if device is None:
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"this process (local rank {local_rank}) would train on {device}, but "
            f"{torch.cuda.device_count()} CUDA device(s) are visible; launch at most that many "
            "processes per node, or train on the CPU (device='cpu', the gloo backend)")
    return device


@dataclass
class DistributedState:
    """Where this process stands in the group; made by :func:`init_process_group`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    options: DistributedOptions
    seed: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks in place."""
        return all_reduce_sum_(tensor)

    def reduce_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:func:`all_reduce_sums`: the ``reduce_fn`` for curvature accumulation."""
        return all_reduce_sums(sums)

    def sync_rng_(self) -> None:
        """Set every rank's torch RNG (CPU, and this CUDA device) to rank 0's.

        ``fit`` calls it after the guide's epoch hooks: a pass over each rank's own shard
        (e.g. curvature with random augmentations on shards of unequal size) may draw a
        different amount of random numbers per rank, which would end the shared noise.
        A no-op for the stream when the ranks are already in step.
        """
        if self.world_size == 1:
            return
        on = self.device if self.backend == "nccl" else torch.device("cpu")
        state = torch.get_rng_state().to(on)
        dist.broadcast(state, src=0)
        torch.set_rng_state(state.cpu())
        if self.device.type == "cuda":
            state = torch.cuda.get_rng_state(self.device).to(on)
            dist.broadcast(state, src=0)
            torch.cuda.set_rng_state(state.cpu(), self.device)

    def mean_of(self, values: dict[str, float]) -> dict[str, float]:
        """Average a dict of floats over ranks (one collective)."""
        if not values or self.world_size == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        all_reduce_mean_(t)
        return dict(zip(keys, t.tolist()))

    def curvature_data(self, loader):
        """``(data, reduce_fn)`` for a pass over the whole data set split across ranks:
        this rank's :func:`unpadded_shard` and :func:`all_reduce_sums` (Laplace hooks)."""
        return unpadded_shard(loader, self.rank, self.world_size), all_reduce_sums

    def wrap(self, module: torch.nn.Module, x, y) -> torch.nn.Module:
        """``module`` in ``DistributedDataParallel`` (its parameters must already exist)."""
        from torch.nn.parallel import DistributedDataParallel

        find_unused = self.options.find_unused_parameters
        if find_unused is None:
            find_unused = _has_unused_parameters(module, x, y)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, output_device=None if ids is None else ids[0],
                                       find_unused_parameters=find_unused)


def init_process_group(device=None, options: DistributedOptions | None = None) -> DistributedState:
    """Join (or reuse) the ``torch.distributed`` process group.

    Parameters
    ----------
    device : str or torch.device, optional
        Training device; ``"cuda"`` (or ``None`` with CUDA available) becomes
        ``cuda:LOCAL_RANK``.  Decides the default backend.
    options : DistributedOptions, optional
        Backend and timeout.

    Returns
    -------
    DistributedState

    Raises
    ------
    ValueError
        No process group exists and the torchrun variables are not set.
    """
    options = options or DistributedOptions()
    env = torchrun_env()
    if is_distributed():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(env["local_rank"]) if env else int(os.environ.get("LOCAL_RANK", 0))
        device = _resolve_device(device, local_rank)
        backend = str(dist.get_backend())
    else:
        if env is None:
            raise ValueError(
                "distributed=True expected a process group or the torchrun variables "
                f"{', '.join(_ENV_VARS)}; got none (launch with `torchrun --nproc_per_node=K "
                "script.py`, or call torch.distributed.init_process_group first)")
        rank, world, local_rank = int(env["rank"]), int(env["world_size"]), int(env["local_rank"])
        device = _resolve_device(device, local_rank)
        backend = options.backend or default_backend(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=options.timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return DistributedState(rank, world, local_rank, device, backend, options)


def warn_if_undistributed_launch() -> None:
    """Warn when several torchrun processes each run an ordinary (non-distributed) ``fit``."""
    env = torchrun_env()
    if env is not None and int(env["world_size"]) > 1:
        warnings.warn(
            f"this process is one of {env['world_size']} started by torchrun, but fit() got "
            "distributed=False: every process trains on all the data on its own (and writes "
            "the same checkpoint). Pass distributed=True for data-parallel training.",
            stacklevel=3)


def start(distributed, device=None, seed: int | None = None) -> DistributedState:
    """What ``fit(distributed=...)`` does first: join the group, then seed every rank.

    With ``shared_noise`` all ranks get rank 0's seed (so identical guide noise);
    otherwise rank ``r`` gets ``seed + r``.
    """
    if distributed is True:
        options = DistributedOptions()
    elif isinstance(distributed, DistributedOptions):
        options = distributed
    else:
        raise TypeError(f"distributed must be a bool or DistributedOptions, got {type(distributed).__name__}")
    state = init_process_group(device, options)
    state.seed = broadcast_seed(seed, state.device if state.backend == "nccl" else "cpu")
    pyro.set_rng_seed(state.seed if options.shared_noise else state.seed + state.rank)
    return state


def _has_unused_parameters(module: torch.nn.Module, x, y) -> bool:
    """One gradient evaluation (RNG state restored): does any parameter get no gradient?"""
    params = [p for p in module.parameters() if p.requires_grad]
    rng = pyro.util.get_rng_state()
    try:
        out = module(x, y)
        loss = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        pyro.util.set_rng_state(rng)
    return any(g is None for g in grads)
