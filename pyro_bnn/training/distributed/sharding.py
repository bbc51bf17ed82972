"""Each rank's share of the data: global minibatches split across ranks, unpadded shards."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from ...data.batches import TensorBatches, as_tensors

__all__ = ["ShardedTensorBatches", "shard_loader", "unpadded_shard", "unsharded_batches", "set_epoch",
           "local_batch_size"]


def local_batch_size(global_batch_size: int, world_size: int) -> int:
    """Per-rank minibatch ``M / W``; raise if the global batch does not split evenly."""
    if global_batch_size < world_size or global_batch_size % world_size:
        raise ValueError(
            f"batch_size is the global minibatch and must be a multiple of the number of "
            f"processes ({world_size}), got {global_batch_size}")
    return global_batch_size // world_size


class ShardedTensorBatches:
    """This rank's share of every global minibatch of in-memory tensors.

    A ``DistributedSampler`` (same ``seed`` on all ranks, reshuffled by
    :meth:`set_epoch`) deals the indices round-robin; rank ``r`` takes its consecutive
    chunks of ``batch_size`` (the *local* size ``M / W``).  The local batches ``i`` of all
    ranks together are the global batch ``i``: with ``shuffle=False`` exactly
    ``x[i M:(i+1) M]``, as in one process.  When ``W`` does not divide ``N`` the sampler
    repeats a few examples to even the shards out.

    Attributes
    ----------
    dataset : TensorDataset
        All ``N`` examples (``len`` gives the global ``N`` used for scaling).
    sampler : DistributedSampler
    """

    def __init__(self, x, y, batch_size: int, *, num_replicas: int, rank: int,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.dataset = TensorDataset(*(t for t in (x, y) if t is not None))
        self.sampler = DistributedSampler(self.dataset, num_replicas=num_replicas, rank=rank,
                                          shuffle=shuffle, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        idx = torch.as_tensor(list(iter(self.sampler)), dtype=torch.long).to(self.x.device)
        for i in range(len(self)):
            chunk = idx[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[chunk], (None if self.y is None else self.y[chunk])


def shard_loader(data, batch_size: int, state, *, shuffle: bool = True,
                 device=None):
    """This rank's minibatches; ``batch_size`` is the global minibatch ``M``.

    Tensors give :class:`ShardedTensorBatches` (moved to ``device`` once), a ``Dataset``
    a ``DataLoader`` with a ``DistributedSampler`` and batch size ``M / W``; a
    ``DataLoader`` is used as it is (its batch size is per rank) and must already have a
    ``DistributedSampler``.
    """
    if isinstance(data, DataLoader):
        if not isinstance(data.sampler, DistributedSampler) and not isinstance(
                getattr(data.batch_sampler, "sampler", None), DistributedSampler):
            raise ValueError(
                "distributed=True with a DataLoader expected one built with a DistributedSampler "
                f"(each rank reads its shard), got sampler {type(data.sampler).__name__}; "
                "or pass tensors / a Dataset and fit builds it")
        return data
    local = local_batch_size(int(batch_size), state.world_size)
    if isinstance(data, Dataset) and not isinstance(data, TensorDataset):
        sampler = DistributedSampler(data, num_replicas=state.world_size, rank=state.rank,
                                     shuffle=shuffle, seed=state.seed)
        return DataLoader(data, batch_size=local, sampler=sampler)
    x, y = as_tensors(data)
    if device is not None:
        x = x.to(device)
        y = None if y is None else y.to(device)
    return ShardedTensorBatches(x, y, local, num_replicas=state.world_size, rank=state.rank,
                                shuffle=shuffle, seed=state.seed)


def unpadded_shard(loader, rank: int, world_size: int):
    """This rank's examples ``rank, rank + W, ...``, each exactly once over all ranks, unshuffled.

    For passes whose per-rank sums are all-reduced (curvature, evidence): unlike the
    training shards, which a ``DistributedSampler`` pads with repeated examples when ``W``
    does not divide ``N``, these shards add up to the data set exactly.

    Parameters
    ----------
    loader : ShardedTensorBatches or DataLoader
        The training loader ``fit`` built (its ``dataset`` is the whole data set).
    rank, world_size : int

    Returns
    -------
    TensorBatches or DataLoader
        Strided views of the tensors, or a ``DataLoader`` over a ``Subset``; same batch size.
    """
    if isinstance(loader, ShardedTensorBatches):
        y = None if loader.y is None else loader.y[rank::world_size]
        return TensorBatches(loader.x[rank::world_size], y, loader.batch_size, shuffle=False)
    dataset = getattr(loader, "dataset", None)
    if isinstance(loader, DataLoader) and dataset is not None:
        subset = Subset(dataset, range(rank, len(dataset), world_size))
        return DataLoader(subset, batch_size=loader.batch_size or 1, collate_fn=loader.collate_fn,
                          num_workers=loader.num_workers)
    raise TypeError(f"expected the loader fit builds (ShardedTensorBatches or DataLoader), "
                    f"got {type(loader).__name__}")


def unsharded_batches(loader, batch_size: int):
    """All ``N`` examples of the training loader ``fit`` built, unshuffled, in batches of
    ``batch_size`` (the same batches on every rank, as in one process).

    For passes that split *batches* across ranks (the invariance evidence step takes
    batches ``i ≡ rank (mod W)`` and seeds batch ``i``'s augmentation draws with ``i``,
    so the draws equal the single-process ones).
    """
    if isinstance(loader, ShardedTensorBatches):
        return TensorBatches(loader.x, loader.y, batch_size, shuffle=False)
    dataset = getattr(loader, "dataset", None)
    if isinstance(loader, DataLoader) and dataset is not None:
        return DataLoader(dataset, batch_size=batch_size, collate_fn=loader.collate_fn,
                          num_workers=loader.num_workers)
    raise TypeError(f"expected the loader fit builds (ShardedTensorBatches or DataLoader), "
                    f"got {type(loader).__name__}")


def set_epoch(loader, epoch: int) -> None:
    """Call ``set_epoch`` on the loader's (or its sampler's) ``DistributedSampler``."""
    for obj in (loader, getattr(loader, "sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return
