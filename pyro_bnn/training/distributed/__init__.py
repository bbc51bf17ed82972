"""Data-parallel training with ``torch.distributed``: process group, shards, reductions.

:func:`pyro_bnn.fit` with ``distributed=True`` uses these pieces when a script is
launched by ``torchrun`` (one process per GPU, or several CPU processes):

* :func:`init_process_group` joins the group from torchrun's environment variables
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) with NCCL on
  CUDA and Gloo on CPU;
* every rank seeds Pyro/torch with the same seed (rank 0's, broadcast), so all ranks draw
  the same guide noise (weight samples, the symmetrised guide's permutations) each step;
* each rank reads ``1/world`` of every global minibatch (:class:`ShardedTensorBatches`
  or a ``DataLoader`` with a ``DistributedSampler``) and scales its minibatch log-likelihood
  by the *global* ``N / M_rank``;
* the loss module (model + guide + objective) is wrapped in
  ``DistributedDataParallel``, which averages the gradients:
  ``(1/W) Σ_r ∇[(N/M_r) Σ_{i∈B_r} −log p(y_i|w) + KL] = ∇[(N/M) Σ_{i∈B} −log p(y_i|w) + KL]``
  with ``M = W M_r``, the single-process gradient of the global batch ``B = ∪_r B_r``.

:func:`launch_local` runs a function in several local processes set up as torchrun would
(Gloo on localhost), for tests and CPU experiments.
"""

from .group import (
    DistributedOptions,
    DistributedState,
    all_reduce_mean_,
    all_reduce_sum_,
    all_reduce_sums,
    broadcast_seed,
    default_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_distributed,
    is_main_process,
    leave_process_group,
    start,
    torchrun_env,
    warn_if_undistributed_launch,
)
from .launch import find_free_port, launch_local
from .sharding import (
    ShardedTensorBatches,
    local_batch_size,
    set_epoch,
    shard_loader,
    unpadded_shard,
    unsharded_batches,
)

__all__ = [
    "DistributedOptions", "DistributedState", "default_backend", "torchrun_env",
    "init_process_group", "start", "is_distributed", "is_main_process", "get_rank",
    "get_world_size", "all_reduce_sum_", "all_reduce_mean_", "all_reduce_sums", "broadcast_seed",
    "leave_process_group", "local_batch_size", "ShardedTensorBatches", "shard_loader", "unpadded_shard", "unsharded_batches",
    "set_epoch",
    "launch_local", "find_free_port", "warn_if_undistributed_launch",
]
