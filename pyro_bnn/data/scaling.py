"""Inputs that look like unscaled 8-bit pixels.

Image data sets store pixels as bytes 0-255; ``x.float()`` keeps that range.  A network (and
the weight prior of :class:`pyro_bnn.BNN`, sized for inputs of order 1) then sees
pre-activations hundreds of times too large, and training fails without an error: on
Fashion-MNIST (first 3,000 training images, MLP 784-100-10, MeanField, 30 epochs) the test
accuracy was 0.139 on ``x · 255`` against 0.745 on ``x`` in [0, 1] (``pb.fit``'s convergence
check blamed the learning rate), and the model trained on [0, 1] and evaluated on 0-255 test
inputs scored NLL 2.22 instead of 0.68 (ECE 0.175 instead of 0.092).  Both ran without an
error; now the inputs are warned about wherever they enter (``pb.fit``, ``pb.evaluate``,
``pb.predict``, ``pb.to_arviz``, the Laplace curvature).  The loaders of
:mod:`pyro_bnn.data.datasets` and torchvision's ``ToTensor`` scale by 1/255.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

__all__ = ["UnscaledPixelsWarning", "warn_unscaled_pixels", "looks_like_unscaled_pixels", "ROWS_LOOKED_AT"]

#: Examples looked at (the first ones): the check costs the same for 100 or 60,000 images.
ROWS_LOOKED_AT = 1024

_PACKAGE = str(Path(__file__).resolve().parents[1])


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


def warn_unscaled_pixels(x, what: str = "x") -> None:
    """Warn (:class:`UnscaledPixelsWarning`, at the caller's line outside the package) when
    ``x`` looks like unscaled 8-bit pixels (:func:`looks_like_unscaled_pixels`).

    Parameters
    ----------
    x : Tensor, shape (N, ...)
        Inputs.
    what : str
        How ``x`` is named in the message (``"x in batch 1 of the DataLoader given to pb.fit"``).
    """
    high = looks_like_unscaled_pixels(x)
    if high is None:
        return
    shown = min(len(x), ROWS_LOOKED_AT)
    warnings.warn(
        f"{what} holds whole numbers from 0 to {high:g} (its first {shown:,} examples): unscaled 8-bit "
        "pixel values? Networks and pb.BNN's weight priors expect inputs of order 1 (on Fashion-MNIST an "
        "MLP trained on pixels 0-255 reached test accuracy 0.14, against 0.74 on pixels / 255). Divide by "
        "255, as pb.datasets and torchvision's ToTensor do, and scale the test inputs the same way",
        UnscaledPixelsWarning, skip_file_prefixes=(_PACKAGE,))
