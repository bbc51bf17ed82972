"""Turning user data (tensors, a ``Dataset`` or a ``DataLoader``) into checked minibatches.

Training data is checked before it reaches torch or Pyro internals, where a mistake either
fails with an unclear message or, worse, is absorbed silently (``F.cross_entropy`` ignores
labels equal to −100).  Tensors are checked once, up front (:func:`validate_data`); batches
from a ``Dataset`` or ``DataLoader`` are checked as they are yielded (:class:`CheckedBatches`)
by a :class:`BatchCheck`: a few vectorised reductions per batch, on the batch as the loader
yields it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from pyro import poutine
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from ..contract.local_params import local_params
from ..model.bnn import check_input_of, initial_values_of, model_likelihood, network_function_of
from ..model.devices import module_device
from ..model.input_scale import end_input_watch, inputs_warned, warn_unscaled_pixels
from ..model.likelihoods import Likelihood, make_likelihood
from ..model.modes import evaluation_mode

__all__ = ["as_tensors", "make_loader", "TensorBatches", "CheckedBatches", "BatchCheck", "check_finite",
           "check_inputs", "validate_data", "check_data", "checked_source", "check_targets", "as_labels", "as_targets",
           "model_dtype", "dataset_size", "split_batch"]


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
    parts = list(data) if isinstance(data, Sequence) and not isinstance(data, str) else []
    names = [type(t).__name__ for t in parts[:3]] + ([f"... {len(parts)} items"] if len(parts) > 3 else [])
    got = type(data).__name__ + (f" of ({', '.join(names)})" if parts else "")
    hint = ("; convert arrays with torch.as_tensor(x, dtype=torch.float32) and labels with "
            "torch.as_tensor(y, dtype=torch.long)" if any(hasattr(t, "__array__") for t in parts[:2]) else "")
    if len(parts) > 2 and all(isinstance(t, (tuple, list)) for t in parts[:3]):
        hint = ("; a list of (x, y) examples is a dataset: pass a DataLoader over it, e.g. "
                "DataLoader(examples, batch_size=64, shuffle=True), or stack it into tensors")
    raise TypeError(f"data must be a tensor, a tuple (x, y) of tensors or a TensorDataset, got {got}{hint}")


def check_finite(t: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` if a floating tensor holds NaN or inf.

    Fast path: one NaN or inf makes the sum NaN or inf whatever the order of summation, so a
    finite sum proves every value finite (a sum ~20× cheaper than ``isfinite(t).all()`` on
    a 128×784 batch); only a non-finite sum (which finite values can also give by
    overflow) pays for the element-wise test.
    """
    if not t.is_floating_point() or math.isfinite(float(t.sum())):
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"{what} contains {bad} NaN/inf values; expected finite numbers")


def check_inputs(x, what: str = "x", dtype: torch.dtype | None = None, allow_integer: bool = False) -> None:
    """Clear errors for inputs a network cannot take: not a tensor, empty, integer, wrong
    floating dtype, NaN/inf.

    Parameters
    ----------
    x : Tensor, shape (N, ...)
        Inputs.
    what : str
        How to name ``x`` in messages (``"x"``, ``"x in batch 3 of the DataLoader"``).
    dtype : torch.dtype, optional
        The model's floating dtype; floating ``x`` must have it.
    allow_integer : bool
        Accept integer ``x`` (token ids for an ``nn.Embedding``).

    Raises
    ------
    TypeError
        ``x`` is not a tensor, or has an integer (unless allowed) or other floating dtype.
    ValueError
        ``x`` is empty or holds NaN/inf.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{what} must have a batch dimension (N, ...), got a 0-d tensor")
    if len(x) == 0:
        raise ValueError(f"{what} is empty (shape {tuple(x.shape)}); expected at least one example")
    if allow_integer and not x.is_floating_point() and not x.is_complex():
        return
    _check_x_dtype(x, what, dtype)
    check_finite(x, what)


def _check_x_dtype(x, what, dtype):
    if not x.is_floating_point():
        raise TypeError(f"{what} has dtype {x.dtype}; expected floating-point inputs "
                        f"(convert with x.float(), scaling integer pixels e.g. by x.float() / 255)")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(
            f"{what} has dtype {x.dtype} but the model's weights are {dtype}; convert the inputs "
            f"with x.to({dtype}) or build the network in {x.dtype} before pb.BNN "
            f"(e.g. net.to({x.dtype})) to train in {x.dtype}")


def model_dtype(model) -> torch.dtype | None:
    """Floating dtype of a model's weights: a BNN's initial values, else its first floating
    parameter or buffer; ``None`` if it has none (a hand-written model without weights)."""
    for t in initial_values_of(model).values():
        if t.is_floating_point():
            return t.dtype
    if isinstance(model, torch.nn.Module):
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                return t.dtype
    return None


#: Words of torch's errors for an input the layers cannot take (a wrong image size reaching
#: a Linear layer after Flatten, a pooling that shrinks it to nothing).
_SHAPE_ERRORS = ("shape", "size", "channels", "dimension")


class BatchCheck:
    """Vectorised checks of one minibatch ``(x, y)`` before it reaches the model.

    ``x``: a non-empty floating tensor of the model's dtype with finite values; ``y``: as
    many targets as inputs, finite if floating, and valid for the model's likelihood
    (:meth:`pyro_bnn.model.likelihoods.Likelihood.validate`: integer labels in ``[0, C−1]`` for a
    categorical likelihood, 0/1 for a Bernoulli one, target shapes).  The network's output
    shape, which the label range needs, is computed once from the first batch (two
    examples, without touching the random number streams) and cached.

    Integer ``x`` is accepted for a model with an ``nn.Embedding`` (token ids), and without a
    model, which cannot tell.

    Parameters
    ----------
    model : BNN or PyroModule, optional
        The model; without it only the model-free checks run (no dtype, no label range).
    device : torch.device, optional
        Where the model is (the output-shape pass moves two examples there).
    likelihood : Likelihood, optional
        The likelihood the targets are checked against (default: the model's).
    inputs_of : BNN or PyroModule, optional
        Without ``model``: the model whose inputs the batches are (the curvature pass checks
        against a likelihood only).  They are looked at for unscaled pixels only if nobody has
        warned about that model's inputs (:func:`~pyro_bnn.model.input_scale.inputs_warned`),
        and the model is told when they are: one warning per model.
    """

    def __init__(self, model=None, device=None, *, likelihood: Likelihood | None = None, inputs_of=None):
        self.model = model
        self.inputs_of = model if model is not None else inputs_of
        self.dtype = model_dtype(model) if model is not None else None
        self.integer_inputs = model is None or (isinstance(model, torch.nn.Module) and any(
            isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) for m in model.modules()))
        lik = likelihood if likelihood is not None else model_likelihood(model)
        self.likelihood = lik if isinstance(lik, Likelihood) else None
        self.device = device
        self._output_shape: tuple[int, ...] | None = None
        self._pixels_looked_at = False

    def __call__(self, x, y=None, where: str = "") -> None:
        """Raise ``TypeError``/``ValueError`` naming the problem and ``where`` it is; warn once
        (the first call) if ``x`` looks like unscaled 8-bit pixels (:mod:`pyro_bnn.model.input_scale`);
        the model warned about is told (:func:`~pyro_bnn.model.input_scale.end_input_watch`), so
        that neither a ``pb.BNN``'s own look at its inputs nor the look of a hand-written model's
        pyro_bnn guide warns a second time."""
        at = f" in {where}" if where else ""
        check_inputs(x, f"x{at}", self.dtype, allow_integer=self.integer_inputs)
        if not self._pixels_looked_at:
            self._pixels_looked_at = True
            warned = self.model is None and inputs_warned(self.inputs_of)
            if not warned and warn_unscaled_pixels(x, f"x{at}"):
                end_input_watch(self.inputs_of)
        if y is None:
            return
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"y{at} must be a torch.Tensor, got {type(y).__name__}")
        if y.dim() == 0 or len(y) != len(x):
            raise ValueError(f"x and y{at} must have the same length, got {len(x)} inputs and "
                             f"{len(y) if y.dim() else 'a 0-d'} targets (shape {tuple(y.shape)})")
        if self.likelihood is None:
            check_finite(y, f"y{at}")
        else:
            check_targets(self.likelihood, y, self._output_carrier(x), f"y{at}")

    def labels(self, y):
        """``y`` with integer class labels as int64 for a categorical likelihood
        (:func:`as_labels`); anything else unchanged."""
        return as_labels(self.likelihood, y)

    def targets(self, x, y):
        """``y`` as targets for inputs ``x``: :meth:`labels`, and Gaussian or Bernoulli
        targets ``(N,)`` of a network with one output as ``(N, 1)`` (:func:`as_targets`; the
        output shape is learnt from ``x`` once, the random streams restored)."""
        return _one_output_column(self, x, self.labels(y))

    def learn_output_shape(self, x, isolate_rng: bool = True) -> None:
        """Run the network once on two examples of ``x`` to learn its output shape.

        The weights are drawn from the prior; with ``isolate_rng`` the global random state is
        restored afterwards, so checking a loader's first batch does not shift training.
        """
        function = network_function_of(self.model)
        if function is None or self._output_shape is not None:
            return
        check_input_of(self.model, x)  # the error names x's own shape, not the probe's two rows
        xs = x[:2] if self.device is None else x[:2].to(self.device)
        devices = [xs.device] if xs.device.type == "cuda" else []
        rng = torch.random.fork_rng(devices=devices) if isolate_rng else contextlib.nullcontext()
        # eval mode: the probe must not update BatchNorm's running statistics (nor drop units)
        try:
            with rng, torch.no_grad(), poutine.block(), local_params(self.model), evaluation_mode(self.model):
                self._output_shape = tuple(function(xs).shape[1:])
        except RuntimeError as exc:
            if not any(word in str(exc) for word in _SHAPE_ERRORS):
                raise
            raise ValueError(
                f"the network cannot run on inputs of shape (N, {', '.join(map(str, x.shape[1:]))}) (tried on "
                f"{len(xs)} of them: {str(exc).splitlines()[0]}); expected inputs of the shape the network "
                "was built for (e.g. a CNN's Linear layer after Flatten fixes the image size)") from exc

    def set_output_shape(self, f: torch.Tensor) -> None:
        """Take the output shape from a network output ``f`` ``(M, ...)`` already computed."""
        self._output_shape = tuple(f.shape[1:])

    def _output_carrier(self, x) -> torch.Tensor | None:
        """An empty tensor of shape ``(0, *output_shape)``: carries the shape to ``validate``."""
        self.learn_output_shape(x)
        return None if self._output_shape is None else torch.empty((0, *self._output_shape))


def as_labels(likelihood, y):
    """Integer class labels (``int32``, ``uint8``, ...) as ``int64`` for a categorical
    likelihood (a :class:`~pyro_bnn.model.likelihoods.Likelihood` or the kind ``"categorical"``):
    the same values in the dtype torch's indexing needs.  Floating, bool and
    complex labels, other likelihoods and ``None`` are returned unchanged (the check refuses
    what is wrong)."""
    if (getattr(likelihood, "name", likelihood) == "categorical" and isinstance(y, torch.Tensor)
            and not (y.is_floating_point() or y.is_complex() or y.dtype in (torch.bool, torch.int64))):
        return y.long()
    return y


def check_targets(likelihood, y: torch.Tensor, f: torch.Tensor | None = None, what: str = "y") -> None:
    """Raise ``TypeError``/``ValueError`` if ``y`` cannot be targets of ``likelihood``.

    Parameters
    ----------
    likelihood : Likelihood or str
        A :class:`~pyro_bnn.model.likelihoods.Likelihood`, or its kind (``"categorical"``,
        ``"bernoulli"``, ``"gaussian"``).
    y : Tensor
        Targets: ``(N,)`` integer labels in ``[0, C)`` (categorical), 0/1 values shaped like
        the output (Bernoulli), finite floats shaped like the output (Gaussian).
    f : Tensor, optional
        Carries the network's output shape ``(M, *output_shape)`` (``M`` may be 0).
    what : str
        How ``y`` is named in the message (``"y in pb.evaluate"``).
    """
    if isinstance(likelihood, str):
        likelihood = make_likelihood(likelihood)
    check_finite(y, what)
    try:
        likelihood.validate(y, f)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}{_offending_value(likelihood, y)}") from None


def _offending_value(likelihood, y) -> str:
    """`` (got 0.7 at index 3)``: the first target that is not 0 or 1 (Bernoulli)."""
    if getattr(likelihood, "name", None) != "bernoulli" or not y.numel():
        return ""
    bad = ((y != 0) & (y != 1)).reshape(-1).nonzero()
    if not len(bad):
        return ""
    i = int(bad[0])
    return f" (got {y.reshape(-1)[i].item():g} at flat index {i}; expected exactly 0 or 1)"


def check_data(model, x, y=None, *, where: str = "pb.evaluate", device=None):
    """Check inputs and targets given to ``where`` for ``model``; return ``(x, y)``.

    The check of :func:`validate_data` (which ``pb.fit`` runs) for data passed to every other
    entry point (``pb.evaluate``, ``pb.to_arviz``, the Laplace curvature, evidence, grid
    search and GLM predictive, ``learn_invariance``): ``x`` non-empty, floating in the
    model's dtype, finite; ``y`` as many as ``x``, finite, and valid for the model's
    likelihood — ``(N,)`` integer labels in ``[0, C)`` (categorical: PyTorch's ignore_index
    −100 and float labels are refused), exactly 0 or 1 (Bernoulli), floats of the output's
    shape (Gaussian).  Integer labels of another integer dtype (``int32``, ``uint8``) are
    returned as ``int64``: the same values, which torch's indexing needs; Gaussian or
    Bernoulli targets of shape ``(N,)`` for a network with one output as ``(N, 1)``.

    Parameters
    ----------
    model : BNN or PyroModule
    x : Tensor, shape (N, ...)
    y : Tensor, optional
    where : str
        The entry point, named in messages (``"y in pb.evaluate: labels must lie in ..."``).
    device : torch.device, optional
        Where the model is (default: where its parameters are).

    Returns
    -------
    x, y : Tensor
        ``x`` unchanged, ``y`` with int64 labels (categorical) or unchanged.

    Raises
    ------
    TypeError, ValueError
        Naming ``where``, what was expected and what was received.
    """
    check = BatchCheck(model, device if device is not None else module_device(model, default=None))
    y = check.targets(x, y)
    check(x, y, where)
    return x, y


def _one_output_column(check, x, y):
    """:func:`as_targets` with the output shape of ``check``'s network (one pass on two
    examples of ``x``, the random streams restored)."""
    if getattr(check.likelihood, "name", None) not in ("gaussian", "bernoulli") or not isinstance(y, torch.Tensor) \
            or y.dim() != 1 or not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) == 0 or len(y) != len(x):
        return y
    check.learn_output_shape(x)
    return as_targets(check.likelihood, y, check._output_shape)


def as_targets(likelihood, y, output_shape=None):
    """:func:`as_labels`, and Gaussian or Bernoulli targets of shape ``(N,)`` for a network
    with one output (``output_shape == (1,)``) as ``(N, 1)``: unambiguous, and what the
    metrics have always accepted."""
    y = as_labels(likelihood, y)
    if getattr(likelihood, "name", likelihood) in ("gaussian", "bernoulli") and isinstance(y, torch.Tensor) \
            and y.dim() == 1 and output_shape is not None and tuple(output_shape) == (1,):
        return y[:, None]
    return y


def checked_source(model, data, *, where: str, device=None):
    """``data`` for ``where`` with :func:`check_data` applied: tensors, ``(x, y)`` and a
    ``TensorDataset`` are checked in full now and returned as ``(x, y)`` (int64 labels); a
    ``DataLoader`` is wrapped so that each batch is checked as it is read
    (:class:`CheckedBatches`, integer labels yielded as int64); anything else (a ``Dataset``, batches already checked by
    ``pb.fit``) is returned as it is."""
    if isinstance(data, (CheckedBatches, TensorBatches)):
        return data
    if isinstance(data, DataLoader):
        return CheckedBatches(data, BatchCheck(model, device if device is not None else module_device(model, default=None)),
                              where=where, convert_labels=True)
    try:
        x, y = as_tensors(data)
    except TypeError:
        return data
    return check_data(model, x, y, where=where, device=device)


def validate_data(model, data, device=None) -> BatchCheck:
    """Check training data for ``model`` before training; return the check for its batches.

    Tensors (``(x, y)``, ``x`` or a ``TensorDataset``) are checked here, once, in full:
    :class:`BatchCheck` on the whole data.  A ``Dataset`` or ``DataLoader`` is checked for
    emptiness here and batch by batch as it is read (pass the returned check to
    :func:`make_loader`).

    Raises
    ------
    TypeError, ValueError
        The message names the argument, what was expected and what was received.
    """
    check = BatchCheck(model, device)
    if isinstance(data, CheckedBatches):  # already wrapped: its own check runs per batch
        return data.check
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, Dataset) and not isinstance(dataset, (TensorDataset, IterableDataset)):
        try:
            size = len(dataset)
        except TypeError:  # a map-style dataset without __len__: checked per batch only
            return check
        if size == 0:
            raise ValueError(f"data is empty: the {type(dataset).__name__} has 0 examples; "
                             "expected at least one")
        return check
    if isinstance(data, DataLoader) or isinstance(dataset, IterableDataset):
        return check
    try:
        x, y = as_tensors(data)
    except TypeError:  # not data at all: make_loader names the accepted forms
        return check
    if isinstance(x, torch.Tensor) and x.dim() > 0 and len(x) == 0:
        raise ValueError(f"data is empty: x has shape {tuple(x.shape)}; expected at least one example")
    check_inputs(x, "x", check.dtype, allow_integer=check.integer_inputs)
    if y is not None and check.likelihood is not None:
        # This draw from the global RNG is the one fit's tensor check always made: seeded
        # results stay what they were.  (Loader batches are checked with the RNG restored.)
        check.learn_output_shape(x, isolate_rng=False)
    check(x, y)
    return check


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
                yield _rows(self.x, idx), (None if self.y is None else _rows(self.y, idx))


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` (rows ``idx`` of ``t``, a copy).  For a contiguous ``t``, ``index_select``
    gives the same contiguous tensor and copies whole rows (on the CPU, 128 Fashion-MNIST
    images: ~90 µs instead of ~190 µs for the element-wise gather of ``t[idx]``); any other
    layout keeps ``t[idx]`` and its memory format."""
    return torch.index_select(t, 0, idx) if t.is_contiguous() else t[idx]


def dataset_size(loader) -> int:
    """Number of training examples N behind a loader: the data set one epoch draws from.

    N is what each minibatch's log-likelihood is scaled to (by ``N / B``), so it must count
    the examples the loader actually draws from, not every example of the data set it reads
    from.  Read from the loader's sampler (that of its batch sampler, when it has one):

    * a ``SubsetRandomSampler`` (a train/validation split of one data set): ``len(indices)``;
    * a ``SequentialSampler`` or ``RandomSampler`` (``shuffle=False``/``True``, with or
      without replacement, any ``num_samples``): the size of its data source.  Every draw is
      uniform over it, so ``N / B`` times a minibatch's log-likelihood is an unbiased estimate
      of the data source's, whatever the length of an epoch;
    * a ``DistributedSampler``: its whole data set, the global N (each rank reads a shard);
    * no sampler (:class:`TensorBatches`): ``len(loader.dataset)``;
    * a ``WeightedRandomSampler``: the examples it can draw (those of non-zero weight), whatever
      the length of an epoch (class rebalancing: the data set; zero weights on a held-out part:
      the rest);
    * any other sampler (a sampler or batch sampler of one's own):
      ``len(loader.dataset)`` if it draws that many examples per epoch; otherwise which
      examples it covers cannot be known, and this raises rather than guess.

    Parameters
    ----------
    loader : DataLoader, TensorBatches or CheckedBatches
        The training batches (anything with a ``dataset``, and optionally a ``sampler`` or
        ``batch_sampler`` as a ``DataLoader`` has).

    Returns
    -------
    int
        N.

    Raises
    ------
    TypeError
        The loader has no ``dataset``, its data set has no length (an ``IterableDataset``), or
        its sampler's epoch differs from the data set and its examples cannot be known: pass
        ``num_data=N`` to say how many training examples there are.
    """
    ds = getattr(loader, "dataset", None)
    if ds is None:
        raise TypeError("cannot tell the data set size; pass num_data= explicitly")
    try:
        total = len(ds)
    except TypeError:  # an IterableDataset (a stream) has no length
        raise TypeError(f"cannot tell the data set size: the DataLoader's {type(ds).__name__} has no "
                        "len() (an IterableDataset streams its examples); pass num_data=N, the "
                        "number of training examples, which scales the likelihood of each "
                        "minibatch to the whole data set") from None
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = batch_sampler if batch_sampler is not None else getattr(loader, "sampler", None)
    while isinstance(sampler, BatchSampler):
        sampler = sampler.sampler
    if sampler is None:
        return total
    if isinstance(sampler, SubsetRandomSampler):
        return len(sampler.indices)
    if isinstance(sampler, (SequentialSampler, RandomSampler)):
        return len(sampler.data_source)
    if isinstance(sampler, DistributedSampler):
        return len(sampler.dataset)  # the global N
    if isinstance(sampler, WeightedRandomSampler):  # the examples it can draw, whatever its epoch's length
        return int((sampler.weights > 0).sum())
    try:
        draws = len(sampler)
    except (TypeError, NotImplementedError):  # a sampler without a length
        draws = None
    if draws == total and sampler is not batch_sampler:  # one data set's worth of examples per epoch
        return total
    per_epoch = "an unknown number of" if draws is None else f"{draws:,}"
    unit = "batches" if sampler is batch_sampler else "indices"
    raise TypeError(
        f"cannot tell the number of training examples N: the DataLoader's {type(sampler).__name__} yields "
        f"{per_epoch} {unit} per epoch over a data set of {total:,} examples, and which examples it covers "
        "cannot be read from it (only a SubsetRandomSampler's indices, a SequentialSampler's or "
        "RandomSampler's data source, a WeightedRandomSampler's weights and a DistributedSampler's data set "
        "can); pass num_data=N, the number "
        "of training examples, which scales the likelihood of each minibatch to the whole data set "
        "(e.g. num_data=len(dataset), or the size of the part of it you train on)")


class CheckedBatches:
    """A ``DataLoader`` whose batches pass a :class:`BatchCheck` as they are yielded.

    Everything else (``len``, ``dataset``, ``sampler``, ``batch_size``, ...) is the wrapped
    loader's.  A pass that yields no batch at all (an empty data set, or ``drop_last`` with
    fewer examples than one batch) raises ``ValueError`` instead of ending silently.
    """

    def __init__(self, loader, check: BatchCheck | None = None, *, where: str = "",
                 convert_labels: bool = False):
        self.loader = loader
        self.check = check if check is not None else BatchCheck()
        self.where = where
        self.convert_labels = convert_labels

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        if name in ("loader", "check", "where", "convert_labels"):  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        count = 0
        given = f" given to {self.where}" if getattr(self, "where", "") else ""
        for count, batch in enumerate(self.loader, 1):
            x, y = split_batch(batch)
            if getattr(self, "convert_labels", False) and y is not None:
                label = self.check.labels(y)
                if label is not y:   # int32/uint8 class labels: yielded as int64
                    y, batch = label, (x, label)
            self.check(x, y, f"batch {count} of the DataLoader{given}")
            yield batch
        if count == 0:
            raise ValueError(f"data is empty: the DataLoader yielded no batch ({loader_summary(self.loader)}); "
                             "expected at least one")


def loader_summary(loader) -> str:
    """What a ``DataLoader`` holds, for messages: ``"449 examples, batch_size=64, drop_last=True"``."""
    parts = []
    try:
        parts.append(f"{len(loader.dataset)} examples")
    except (AttributeError, TypeError):
        pass
    for name in ("batch_size", "drop_last"):
        if getattr(loader, name, None) is not None:
            parts.append(f"{name}={getattr(loader, name)}")
    return ", ".join(parts) or type(loader).__name__


def make_loader(data, batch_size: int = 64, shuffle: bool = True, drop_last: bool = False,
                device: torch.device | str | None = None, check: BatchCheck | None = None):
    """Return an iterable of ``(x, y)`` minibatches for tensors, a ``Dataset`` or a ``DataLoader``.

    Tensors are moved to ``device`` once and batched by slicing (check them once, up front,
    with :func:`validate_data`); datasets get a ``DataLoader``; loaders are used as they are
    (batches are moved to the device per step).  Batches of datasets and loaders pass
    ``check`` (:class:`BatchCheck`; default: the model-free checks) as they are yielded.
    """
    if isinstance(data, CheckedBatches):
        return data
    if isinstance(data, DataLoader):
        return CheckedBatches(data, check)
    if isinstance(data, Dataset) and not isinstance(data, TensorDataset):
        return CheckedBatches(DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last),
                              check)
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
