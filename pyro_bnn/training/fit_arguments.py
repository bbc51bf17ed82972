"""The argument checks of :func:`pyro_bnn.fit`, run before anything is set up: types and
ranges, combinations that cannot work together (each error names the argument and what was
expected), and the refusal to replace an existing checkpoint the call did not ask to replace."""

from __future__ import annotations

import os

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from ..arguments import check_bool, check_int, check_positive
from ..curvature.marglik import check_marglik_options
from ..data.batches import CheckedBatches
from .lr_schedule import probe_lr_schedule

__all__ = ["check_fit_arguments", "check_checkpoint_path", "refuse_overwrite", "resolve_batching", "DEFAULT_BATCH_SIZE"]

#: ``fit``'s minibatch size for tensors and a ``Dataset``.
DEFAULT_BATCH_SIZE = 64


def resolve_batching(data, batch_size, shuffle, distributed=False) -> tuple[int, bool]:
    """``fit``'s ``(batch_size, shuffle)``: as given, else 64 and ``True`` for tensors and a
    ``Dataset``; a ``DataLoader``'s own, which ``fit`` uses as they are.

    A ``DataLoader`` given with another ``batch_size`` or ``shuffle`` is an error: both were
    ignored in silence (``pb.fit(model, guide, loader, batch_size=256)`` trained on the
    loader's batches of 32, at 8 times the steps).  With ``distributed=`` a loader's batch
    size is per process and ``batch_size`` the global one, so they are not compared; where a
    sampler of one's own decides the batches or their order, the given values stand.

    Raises
    ------
    TypeError
        ``batch_size`` not an int >= 1 or None, ``shuffle`` not a bool or None.
    ValueError
        They contradict the ``DataLoader``'s.
    """
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
    if shuffle is not None:
        check_bool("shuffle", shuffle)
    loader = data.loader if isinstance(data, CheckedBatches) else data
    if not isinstance(loader, DataLoader) or distributed:
        return (DEFAULT_BATCH_SIZE if batch_size is None else batch_size), (True if shuffle is None else bool(shuffle))
    own_batch, own_shuffle, sampler = _loader_batching(loader)
    if batch_size is not None and own_batch is not None and batch_size != own_batch:
        raise ValueError(f"batch_size={batch_size} but the DataLoader yields batches of {own_batch}: pb.fit trains "
                         f"on a loader's batches as it makes them. Build the loader with batch_size={batch_size}, "
                         "or leave batch_size out")
    if shuffle is not None and own_shuffle is not None and bool(shuffle) != own_shuffle:
        order = f"shuffles ({type(sampler).__name__})" if own_shuffle else f"reads in order ({type(sampler).__name__})"
        raise ValueError(f"shuffle={shuffle} but the DataLoader {order}: a loader's sampler sets the order "
                         f"pb.fit trains in. Build the loader with shuffle={shuffle}, or leave shuffle out")
    return (batch_size or own_batch or DEFAULT_BATCH_SIZE), (shuffle if shuffle is not None else
                                                              own_shuffle if own_shuffle is not None else True)


#: Samplers that draw in a random order (``DistributedSampler`` says so itself).
_RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _loader_batching(loader: DataLoader):
    """``(batch size, shuffles, sampler)`` of a ``DataLoader`` as far as they can be read
    (``None`` where a sampler of one's own decides); ``sampler`` is the index sampler."""
    size, sampler = loader.batch_size, loader.sampler
    if size is None and isinstance(loader.batch_sampler, BatchSampler):   # batch_sampler= of torch's class
        size = loader.batch_sampler.batch_size
        sampler = loader.batch_sampler.sampler
    if size is None and isinstance(sampler, BatchSampler):   # batch_size=None, sampler=BatchSampler(...)
        size, sampler = sampler.batch_size, sampler.sampler
    if isinstance(sampler, _RANDOM_SAMPLERS):
        shuffles = True
    elif isinstance(sampler, SequentialSampler):
        shuffles = False
    elif isinstance(sampler, DistributedSampler):
        shuffles = bool(sampler.shuffle)
    else:
        shuffles = None
    return size, shuffles, sampler


def check_fit_arguments(*, epochs, batch_size, lr, optimizer, lr_schedule, num_particles, seed,
                        clip_norm, num_data, objective, checkpoint, resume, overwrite, distributed, shuffle,
                        progress, marglik, compile, cuda_graph=False) -> float:
    """Validate ``fit``'s arguments; return the learning rate to use."""
    check_int("epochs", epochs, 0)
    check_int("batch_size", batch_size, 1)
    check_int("num_particles", num_particles, 1)
    check_int("num_data", num_data, 1, optional=True)
    check_int("seed", seed, 0, optional=True)
    check_positive("clip_norm", clip_norm, optional=True)
    check_positive("lr", lr, optional=True)
    if not callable(progress):
        try:
            check_bool("progress", progress)
        except TypeError:
            raise TypeError(f"progress must be True, False or a callable progress(epoch, epochs, loss), "
                            f"got {progress!r} ({type(progress).__name__})") from None
    for name, value in (("shuffle", shuffle), ("resume", resume),
                        ("overwrite", overwrite), ("compile", compile), ("cuda_graph", cuda_graph)):
        check_bool(name, value)
    probe_lr_schedule(lr_schedule)
    for name, value in (("optimizer", optimizer), ("objective", objective)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a callable or None, got {type(value).__name__}")
    if optimizer is not None and lr is not None:
        raise ValueError(f"lr={lr!r} is the learning rate of fit's default optimiser, which optimizer= "
                         "replaces; fit cannot pass lr to your factory. Set the rate in the factory "
                         "(e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) and leave lr=None")
    check_marglik_options(marglik)
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path (str or os.PathLike) or None, got "
                        f"{type(checkpoint).__name__}")
    check_checkpoint_path(checkpoint)
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=<path> (the file to resume from and to keep writing)")
    if overwrite and checkpoint is None:
        raise ValueError("overwrite=True needs checkpoint=<path> (the file to replace)")
    if resume and overwrite:
        raise ValueError("resume=True continues the checkpoint and overwrite=True replaces it; pass one")
    if compile and distributed:
        raise NotImplementedError("compile=True is not supported with distributed= yet; train the "
                                  "distributed fit eagerly (compile=False)")
    if cuda_graph and distributed:
        raise NotImplementedError("cuda_graph=True is not supported with distributed= yet; train the "
                                  "distributed fit without it")
    if cuda_graph and compile:
        raise ValueError("cuda_graph=True and compile=True are two ways to speed up the step; pass one "
                         "(cuda_graph=True replays the whole eager step, compile=True compiles the objective)")
    if resume and distributed:
        raise NotImplementedError("resume=True is not supported with distributed= yet; resume the fit in "
                                  "one process, or start the distributed fit afresh")
    return lr


def check_checkpoint_path(checkpoint) -> None:
    """A checkpoint path must name a file, before any training: a folder there (or a file where
    its folder should be) failed only at the first epoch's write, after that epoch's work, with
    ``IsADirectoryError`` from the temporary file's rename.

    Raises
    ------
    ValueError
        ``checkpoint`` is an existing folder, or one of its parents is an existing file.
    """
    if checkpoint is None:
        return
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        raise ValueError(f"checkpoint must be the path of a file, got the folder {path!r}; name a file in it, "
                         f"e.g. checkpoint={os.path.join(path, 'fit.pt')!r}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)      # the nearest parent that exists (fit creates the rest)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"checkpoint {path!r} lies under {parent!r}, which is a file, not a folder; "
                         "choose a path in a folder")


def refuse_overwrite(checkpoint, resume: bool, overwrite: bool) -> None:
    """A fresh fit does not replace an existing checkpoint unless told to."""
    if checkpoint is None or resume or overwrite or not os.path.lexists(checkpoint):
        return
    raise FileExistsError(f"checkpoint {os.fspath(checkpoint)!r} already exists; this fit would replace "
                          "it. Pass resume=True to continue the fit it holds, overwrite=True to start "
                          "afresh and replace it, or another checkpoint path")
