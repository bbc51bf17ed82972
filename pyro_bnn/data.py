"""Turning user data (tensors, a ``Dataset`` or a ``DataLoader``) into minibatches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["as_tensors", "make_loader", "TensorBatches", "check_finite", "dataset_size"]


def as_tensors(data) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accept ``(x, y)``, ``x`` alone, or a ``TensorDataset``; return ``(x, y)``."""
    if isinstance(data, torch.Tensor):
        return data, None
    if isinstance(data, TensorDataset):
        tensors = data.tensors
        return tensors[0], (tensors[1] if len(tensors) > 1 else None)
    if isinstance(data, Sequence) and 1 <= len(data) <= 2 and all(
        isinstance(t, torch.Tensor) or t is None for t in data
    ):
        x, y = (data[0], data[1]) if len(data) == 2 else (data[0], None)
        if y is not None and len(y) != len(x):
            raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
        return x, y
    raise TypeError(
        "data must be a tensor, a tuple (x, y) of tensors or a TensorDataset, "
        f"got {type(data).__name__}"
    )


def check_finite(t: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` if a floating tensor holds NaN or inf."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{what} contains {bad} NaN/inf values; expected finite numbers")


class TensorBatches:
    """Shuffled minibatches of in-memory tensors by index slicing.

    Much faster than a ``DataLoader`` over a ``TensorDataset`` (which gathers and collates
    example by example).  Re-iterable: each pass reshuffles.
    """

    def __init__(self, x, y, batch_size: int, shuffle: bool = True, drop_last: bool = False,
                 generator: torch.Generator | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.generator = generator
        self.dataset = TensorDataset(*(t for t in (x, y) if t is not None))

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        n = len(self.x)
        if self.shuffle:
            perm = torch.randperm(n, generator=self.generator).to(self.x.device)
        else:
            perm = None
        for i in range(len(self)):
            if perm is None:
                sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
                yield self.x[sl], (None if self.y is None else self.y[sl])
            else:
                idx = perm[i * self.batch_size:(i + 1) * self.batch_size]
                yield self.x[idx], (None if self.y is None else self.y[idx])


def dataset_size(loader) -> int:
    """Number of training examples N behind a loader."""
    ds = getattr(loader, "dataset", None)
    if ds is None:
        raise TypeError("cannot tell the data set size; pass num_data= explicitly")
    return len(ds)  # the global N, also under a DistributedSampler


def make_loader(data, batch_size: int = 64, shuffle: bool = True, drop_last: bool = False,
                device: torch.device | str | None = None):
    """Return an iterable of ``(x, y)`` minibatches for tensors, a ``Dataset`` or a ``DataLoader``.

    Tensors are moved to ``device`` once and batched by slicing; datasets get a
    ``DataLoader``; loaders are used as they are (batches are moved to the device per step).
    """
    if isinstance(data, DataLoader):
        return data
    if isinstance(data, Dataset) and not isinstance(data, TensorDataset):
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    x, y = as_tensors(data)
    if device is not None:
        x = x.to(device)
        y = None if y is None else y.to(device)
    return TensorBatches(x, y, batch_size, shuffle=shuffle, drop_last=drop_last)


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, y)`` from whatever a loader yields (tuple/list of 1–2 tensors or a tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 2:
        return batch[0], (batch[1] if len(batch) == 2 else None)
    raise TypeError(f"a batch must be x or (x, y), got {type(batch).__name__} of length {len(batch)}")
