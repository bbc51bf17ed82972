"""The data given to ``pb.evaluate``, ``pb.predict``, ``pb.predictive_samples``, ``pb.to_arviz`` and
the ``pb.analysis`` tools that score test inputs: tensors, or a ``DataLoader`` of the test set,
read once.

A predictive averages over joint weight draws, and each draw is used for every input
(:func:`pyro_bnn.posterior.prediction.predictive_samples` streams the inputs in ``batch_size``
chunks under one draw after another).  A loader is therefore read once, each batch checked as
it is yielded, as ``pb.fit`` checks a loader's batches (:class:`~pyro_bnn.data.batches.BatchCheck`:
dtype, shape, finite values, target range, the unscaled-pixel warning on the first batch), and
its inputs (and targets) are concatenated, where the loader yields them (usually the CPU), into
the tensors that the predictive streams: a loader gives exactly the result of its tensors.  The
alternatives are worse: reading the loader again for every draw costs ``S`` passes of decoding
and transforms and, with ``shuffle=True``, pairs each draw with another order of the inputs;
drawing weights per loader batch gives every batch other posterior draws.  What it costs: the
test set's inputs in memory, ``N ×`` the input size, of the order of the ``(S, N, C)``
predictive that ``pb.predict`` returns.

Iterating a ``DataLoader`` draws from torch's global random stream (its base seed, a shuffle);
it is read with that stream forked, so the weight draws that follow are those of the same call
on tensors (same seed, same draws).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from ..model.devices import module_device
from .batches import BatchCheck, check_data, loader_summary, split_batch

__all__ = ["prediction_data", "read_loader", "data_type_error"]


def prediction_data(model, x, y=None, *, where: str, targets: bool | None, device=None):
    """Checked inputs (and targets) for ``where`` from tensors or a ``DataLoader``.

    Parameters
    ----------
    model : BNN or PyroModule
        The model the data is for (its dtype, output shape and likelihood are checked against).
    x : Tensor or DataLoader
        Inputs ``(N, ...)``, or a ``DataLoader`` (:func:`read_loader`) whose batches are
        ``(x, y)`` (``targets``) or ``x``, ``(x,)``, ``(x, y)`` (otherwise; a ``y`` is not read).
    y : Tensor, optional
        Targets ``(N, ...)`` of tensor ``x``; ``None`` with a loader (its batches hold them).
    where : str
        The entry point, named in messages (``"pb.evaluate"``).
    targets : bool or None
        Whether ``where`` scores targets (``pb.evaluate``, ``pb.to_arviz``) or predicts only;
        ``None``: targets are optional (the corruption curves' accuracy), read where tensor
        ``y`` is given or the loader's batches hold them.
    device : torch.device, optional
        Where the model is (default: where its parameters are).

    Returns
    -------
    x : Tensor, shape (N, ...)
    y : Tensor or None
        ``(N, ...)`` targets (int64 labels for a categorical likelihood); ``None`` if
        ``targets`` is ``False``, or ``None`` and there are none.

    Raises
    ------
    TypeError
        ``x`` is neither a tensor nor a ``DataLoader``, a batch is not of the expected structure,
        or tensor ``x`` comes without the ``y`` that ``where`` scores against.
    ValueError
        ``y`` given with a loader, a batch without targets, an empty loader, batches of
        different shapes, and every check of :func:`~pyro_bnn.data.batches.check_data`.

    Examples
    --------
    >>> x, y = prediction_data(model, test_loader, where="pb.evaluate", targets=True)  # doctest: +SKIP
    """
    if isinstance(x, DataLoader):
        if y is not None:
            raise ValueError(f"{where} got a DataLoader and y= ({type(y).__name__}); the loader's batches "
                             "hold the targets: pass the loader alone, or tensors x and y")
        return read_loader(model, x, where=where, targets=targets, device=device)
    if not isinstance(x, torch.Tensor):
        raise data_type_error(x, where, targets)
    if targets and y is None:
        raise TypeError(f"{where} scores predictions against targets: pass y (N targets) with tensor x, "
                        "or a DataLoader of (x, y) batches in place of x")
    x, y = check_data(model, x, y if targets is not False else None, where=where, device=device)
    return x, y


def data_type_error(x, where: str, targets: bool | None, name: str = "x") -> TypeError:
    """The error for ``x`` given to ``where`` that is neither a tensor nor a ``DataLoader``:
    what was expected (``targets``: ``(x, y)`` batches, else ``x`` or ``(x, y)``) and what was
    received, with a hint for a ``Dataset`` or an ``(x, y)`` pair.

    Parameters
    ----------
    x : object
        What was received.
    where : str
        The entry point, named in the message.
    targets : bool or None
        As for :func:`prediction_data`.
    name : str
        The argument's name (``"in_x"``).
    """
    return TypeError(f"{name} in {where} must be a torch.Tensor or a DataLoader of "
                     f"{'(x, y)' if targets else 'x or (x, y)'} batches, got {type(x).__name__}{_hint(x)}")


def _hint(x) -> str:
    if isinstance(x, Dataset):
        return " (a Dataset: pass DataLoader(dataset, batch_size=1024), or stack its tensors)"
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return " (pass the inputs and the targets as two arguments, x and y)"
    return ""


def read_loader(model, loader, *, where: str, targets: bool | None, device=None):
    """Read a ``DataLoader`` once, checking each batch; return its inputs and targets as tensors.

    Each batch passes the checks tensors get (:class:`~pyro_bnn.data.batches.BatchCheck`,
    messages naming ``"batch k of the DataLoader given to <where>"``; the unscaled-pixel warning
    looks at the first batch) and must have the first batch's shape after the batch dimension,
    dtype and device.  The batches are concatenated in the order the loader yields them (with
    ``shuffle=True``, an order of this pass only).  Torch's global random stream is forked while
    the loader is read (module docstring).  With ``targets=None`` the first batch says whether
    targets are read: every batch must then hold them, or none.

    Parameters
    ----------
    model : BNN or PyroModule
    loader : DataLoader
        Batches ``(x, y)`` (``targets``), or ``x``, ``(x,)``, ``(x, y)`` (otherwise; ``y`` not read),
        as tuples or lists.
    where : str
        The entry point, named in messages.
    targets : bool or None
        Whether the batches must hold targets (returned as int64 labels for a categorical
        likelihood, ``(N, 1)`` for one Gaussian or Bernoulli output); ``None``: read them if
        the batches hold them (``x``, ``(x,)`` or ``(x, y)`` batches).
    device : torch.device, optional
        Where the model is.

    Returns
    -------
    x : Tensor, shape (N, ...)
        Every input the loader yielded in one pass.
    y : Tensor or None
        Their targets; ``None`` if ``targets`` is ``False``, or ``None`` and the batches hold none.

    Raises
    ------
    TypeError, ValueError
        As :func:`prediction_data`.
    """
    check = BatchCheck(model, device if device is not None else module_device(model, default=None))
    given = f"the DataLoader given to {where}"
    xs, ys = [], []
    with torch.random.fork_rng(devices=[]):
        for count, batch in enumerate(loader, 1):
            at = f"batch {count} of {given}"
            x, y = _split(batch, at, where, targets)
            if xs and targets is None and (y is None) != (ys[0] is None):
                held = "holds no targets but batch 1 did" if y is None else "holds targets but batch 1 held none"
                raise ValueError(f"{at} {held} ({_describe(batch)}); expected every batch to hold targets, "
                                 "(x, y), or none")
            if y is not None:
                y = check.targets(x, y)
            check(x, y, at)
            if xs:
                _same_layout("x", x, xs[0], at)
                if y is not None:
                    _same_layout("y", y, ys[0], at)
            xs.append(x)
            ys.append(y)
    if not xs:
        raise ValueError(f"{given} is empty: it yielded no batch ({loader_summary(loader)}); "
                         "expected at least one")
    return torch.cat(xs), (None if ys[0] is None else torch.cat(ys))


def _describe(batch) -> str:
    if isinstance(batch, torch.Tensor):
        return f"a Tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, dict):
        return f"a dict with keys {list(batch)[:5]}"
    if isinstance(batch, (tuple, list)):
        kinds = ", ".join(type(t).__name__ for t in batch[:4]) + (", ..." if len(batch) > 4 else "")
        return f"a {type(batch).__name__} of {len(batch)} ({kinds})"
    return f"a {type(batch).__name__}"


def _split(batch, at: str, where: str, targets: bool | None):
    """``(x, y)`` of one batch (:func:`~pyro_bnn.data.batches.split_batch`); ``y`` is ``None``
    if ``targets`` is ``False`` (and where the batch holds none, ``targets=None``)."""
    expected = "(x, y) batches" if targets else "batches x, (x,) or (x, y)"
    try:
        x, y = split_batch(batch)
    except TypeError:
        hint = (": give the DataLoader a collate_fn that returns (x, y), or a data set whose examples are "
                "(x, y)" if isinstance(batch, dict) else "")
        raise TypeError(f"{at} is {_describe(batch)}; expected {expected} (a tuple or list of tensors){hint}") from None
    if targets is False:
        return x, None
    if y is None and targets:
        raise ValueError(f"{at} holds no targets ({_describe(batch)}); {where} scores predictions against "
                         "targets: expected (x, y) batches, as a DataLoader over TensorDataset(x, y) or "
                         "torchvision's data sets yields them")
    return x, y


def _same_layout(what: str, t: torch.Tensor, first: torch.Tensor, at: str) -> None:
    """Refuse a batch that cannot be concatenated with the first one into the N examples."""
    if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
        raise ValueError(
            f"{what} in {at} has shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}, but batch 1 had "
            f"{tuple(first.shape)}, {first.dtype} on {first.device}; every batch must have the same shape "
            "after its first dimension, dtype and device (the batches are the N examples scored together)")
