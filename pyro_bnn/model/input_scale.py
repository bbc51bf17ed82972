"""Inputs that look like unscaled 8-bit pixels, and a :class:`pyro_bnn.BNN`'s own look at them.

Image data sets store pixels as bytes 0-255; ``x.float()`` keeps that range.  A network (and
the weight prior of :class:`pyro_bnn.BNN`, sized for inputs of order 1) then sees
pre-activations hundreds of times too large, and training fails without an error: on
Fashion-MNIST (first 3,000 training images, MLP 784-100-10, MeanField, 30 epochs) the test
accuracy was 0.139 on ``x · 255`` against 0.745 on ``x`` in [0, 1] (``pb.fit``'s convergence
check blamed the learning rate), and the model trained on [0, 1] and evaluated on 0-255 test
inputs scored NLL 2.22 instead of 0.68 (ECE 0.175 instead of 0.092).  Both ran without an
error.  The loaders of :mod:`pyro_bnn.data.datasets` and torchvision's ``ToTensor`` scale by 1/255.

Such inputs are warned about (:class:`UnscaledPixelsWarning`) where they enter the library
(``pb.fit``, ``pb.evaluate``, ``pb.predict``, ``pb.to_arviz``, the Laplace curvature:
:class:`pyro_bnn.data.batches.BatchCheck`), and by a ``pb.BNN`` itself, for a Pyro user's own loop
(``SVI(...).step(x, y, num_data=N)``, ``Predictive(model, guide=guide, ...)(x)``): the model
holds an :class:`InputScaleWatch` that looks at the inputs of its first training call and of its
first prediction call, then costs one boolean test per call.  A caller that has warned tells the
model's watch (:func:`end_input_watch`), so one fit gives one warning.

A hand-written model (a ``PyroModule`` of the user's, not a ``pb.BNN``) has no watch of its own;
a pyro_bnn guide of it holds one (:class:`WatchesInputs`) and looks at the model's arguments in
its own first calls, which ``SVI`` and ``Predictive`` make with the model's arguments.  For such a
model :func:`end_input_watch` leaves a mark on the model instead (:func:`inputs_warned`), which
its guides' watches read before they look, so ``pb.fit`` on a hand-written model warns once too.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pyro
import torch

__all__ = ["UnscaledPixelsWarning", "warn_unscaled_pixels", "looks_like_unscaled_pixels", "ROWS_LOOKED_AT",
           "InputScaleWatch", "WatchesInputs", "end_input_watch", "inputs_warned"]

#: Examples looked at (the first ones): the check costs the same for 100 or 60,000 images.
ROWS_LOOKED_AT = 1024

#: The key of the mark :func:`end_input_watch` leaves in a hand-written model's ``__dict__``.
_WARNED_MARK = "_pyro_bnn_inputs_warned"

#: Frames the warning skips to reach the user's line: this package's, and Pyro's and torch's
#: (``svi.step`` and ``Predictive`` reach a ``pb.BNN``'s ``forward`` through both); each folder
#: as imported and with links resolved.
_SKIPPED = tuple(dict.fromkeys(str(folder) + os.sep for path in (Path(pyro.__file__).parent, Path(torch.__file__).parent,
                                                                 Path(__file__).parents[1])
                               for folder in (path, path.resolve())))


class UnscaledPixelsWarning(UserWarning):
    """Floating inputs hold whole numbers from 0 up to 255: bytes not divided by 255."""


def looks_like_unscaled_pixels(x) -> float | None:
    """The largest value of ``x``'s first :data:`ROWS_LOOKED_AT` examples if they look like
    unscaled 8-bit pixels, else ``None``.

    They do when ``x`` is a floating tensor of examples with at least 64 values each (images,
    not a handful of count features), and those examples hold only whole numbers in
    ``[0, 255]`` with a largest value of at least 128 (a thousand real 8-bit images reach 255;
    sklearn's raw 8×8 digits stop at 16, word counts rarely reach 128).

    Parameters
    ----------
    x : Tensor, shape (N, ...)
        Inputs.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2 or len(x) == 0 \
            or x[0].numel() < 64:
        return None
    head = x[:ROWS_LOOKED_AT]
    low, high = float(head.min()), float(head.max())
    if low < 0 or not 128 <= high <= 255 or not torch.equal(head, torch.round(head)):
        return None
    return high


def warn_unscaled_pixels(x, what: str = "x") -> bool:
    """Warn (:class:`UnscaledPixelsWarning`, at the caller's line outside the package, Pyro and
    torch) when ``x`` looks like unscaled 8-bit pixels (:func:`looks_like_unscaled_pixels`).

    Parameters
    ----------
    x : Tensor, shape (N, ...)
        Inputs.
    what : str
        How ``x`` is named in the message (``"x in batch 1 of the DataLoader given to pb.fit"``).

    Returns
    -------
    bool
        Whether it warned.
    """
    high = looks_like_unscaled_pixels(x)
    if high is None:
        return False
    shown = min(len(x), ROWS_LOOKED_AT)
    warnings.warn(
        f"{what} holds whole numbers from 0 to {high:g} (its first {shown:,} examples): unscaled 8-bit "
        "pixel values? Networks and pb.BNN's weight priors expect inputs of order 1 (on Fashion-MNIST an "
        "MLP trained on pixels 0-255 reached test accuracy 0.14, against 0.74 on pixels / 255). Divide by "
        "255, as pb.datasets and torchvision's ToTensor do, and scale the test inputs the same way",
        UnscaledPixelsWarning, skip_file_prefixes=_SKIPPED)
    return True


class InputScaleWatch:
    """A model's own look at its inputs for unscaled 8-bit pixels: once at its first training
    call (targets given) and once at its first prediction call (none), and no more once it has
    warned (one warning per model).

    A ``pb.BNN`` holds one, as ``model.input_watch``; its ``forward`` tests one flag per call,
    ``watch.looking[y is None]``, and calls :meth:`see` only while it is set.

    Parameters
    ----------
    what : str
        How the warning names the inputs.

    Attributes
    ----------
    looking : list of bool
        ``[training, prediction]``: whether the next call of that kind is looked at.
    warned : bool
        Whether the model's inputs were warned about (here or by a caller, :func:`end_input_watch`).
    """

    def __init__(self, what: str = "x given to pb.BNN"):
        self.what = what
        self.looking = [True, True]
        self.warned = False

    def see(self, x, prediction: bool) -> None:
        """Look at one call's inputs ``x`` (``prediction``: a call without targets) if that kind
        of call is still looked at; warn if they look like unscaled pixels.

        A one-row input of zeros (the dummy input with which a guide is set up or drawn from
        without data, :func:`pyro_bnn.model.bnn.example_input`) says nothing: the next call is
        looked at instead.
        """
        if not self.looking[prediction]:
            return
        if isinstance(x, torch.Tensor) and x.dim() and len(x) == 1 and not bool(x.any()):
            return
        self.looking[prediction] = False
        if warn_unscaled_pixels(x, self.what):
            self.end(warned=True)

    def end(self, warned: bool = False) -> None:
        """Stop looking (``warned``: the inputs were warned about)."""
        self.looking = [False, False]
        self.warned = self.warned or warned


class WatchesInputs:
    """Mixin of the guides that look at their hand-written model's inputs (pyro_bnn's
    ``BNNGuide``): the watch, ``guide.input_watch``, is created at its first use and names the
    inputs as given to the model of this guide (one warning per guide)."""

    @property
    def input_watch(self) -> InputScaleWatch:
        """The guide's :class:`InputScaleWatch` over its model's inputs."""
        watch = self.__dict__.get("_input_watch")
        if watch is None:
            watch = self.__dict__["_input_watch"] = InputScaleWatch(
                f"x given to the model of this {type(self).__name__} guide")
        return watch


def end_input_watch(model) -> None:
    """Tell the watches over ``model``'s inputs that they have been warned about (by ``pb.fit``,
    ``pb.evaluate``, ...: :class:`pyro_bnn.data.batches.BatchCheck`), so that none warns a second
    time.

    A ``pb.BNN``'s own :class:`InputScaleWatch` ends.  Any other model (a hand-written one) is
    marked instead, an entry of its ``__dict__`` that :func:`inputs_warned` reads: the watches of
    its pyro_bnn guides (:class:`WatchesInputs`) end when they see it.  An object without a
    ``__dict__`` is left as it is.

    Parameters
    ----------
    model : torch.nn.Module or callable
        The model whose inputs were warned about.
    """
    marks, watch = _marks_of(model), _own_watch(model)
    if watch is not None:
        watch.end(warned=True)
    elif marks is not None:
        marks[_WARNED_MARK] = True


def inputs_warned(model) -> bool:
    """Whether ``model``'s inputs have been warned about: by a caller (:func:`end_input_watch`),
    or, for a ``pb.BNN``, by its own :class:`InputScaleWatch`.

    A check that looks at data another check of the same call has looked at already (the
    curvature pass of ``Laplace.fit_curvature`` after ``pb.fit``'s or ``fit_curvature``'s own check)
    reads it to warn once per model.

    Parameters
    ----------
    model : torch.nn.Module or callable or None
        A model, as a guide holds it.
    """
    marks, watch = _marks_of(model), _own_watch(model)
    if marks is None:
        return False
    return bool(marks.get(_WARNED_MARK, False)) or (watch is not None and watch.warned)


def _own_watch(model) -> InputScaleWatch | None:
    """A ``pb.BNN``'s own :class:`InputScaleWatch` (its ``input_watch``), else ``None``."""
    marks = _marks_of(model) if isinstance(model, torch.nn.Module) else None
    watch = marks.get("input_watch") if marks is not None else None
    return watch if isinstance(watch, InputScaleWatch) else None


def _marks_of(model) -> dict | None:
    """``model.__dict__`` if it has one that can hold a mark, else ``None``."""
    marks = getattr(model, "__dict__", None) if model is not None else None
    return marks if isinstance(marks, dict) else None
