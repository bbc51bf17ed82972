"""Transformed digits, MNIST and Fashion-MNIST: each example gets one fixed, seeded random
transform.

As in the LILA paper: "rotated" data have every image rotated by an angle drawn uniformly
from ``[−extent, extent]`` (``extent = π``: fully rotated), "translated" by uniform shifts,
"scaled" by ``exp(u·extent)``.  Train and test sets are transformed independently with
different seeds.
"""

from __future__ import annotations

import math
import os

import torch

from ..data import datasets as _datasets
from .augmentation import GENERATORS, affine_generators, affine_matrices, apply_affine

__all__ = ["transform_images", "transformed_digits", "transformed_mnist", "transformed_fashion_mnist",
           "TRANSFORMS"]

#: Kind of transform → generators it draws (with the same extent each).
TRANSFORMS: dict[str, tuple[str, ...]] = {
    "none": (),
    "rotate": ("rot",),
    "translate": ("tx", "ty"),
    "scale": ("sx", "sy"),
}


def transform_images(x: torch.Tensor, kind: str, extent: float, seed: int = 0,
                     image_shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Apply one fixed random transform per example.

    Parameters
    ----------
    x : Tensor, shape (N, C, H, W) or (N, D)
    kind : {"none", "rotate", "translate", "scale"}
    extent : float
        Uniform range ``[−extent, extent]`` of the generator coefficient: radians for
        rotation, normalised coordinates ([−1, 1] spans the image) for translation, log-scale
        for scaling.
    seed : int
        Seed of the per-example draws.
    image_shape : (C, H, W), optional
        For flat inputs; default a square grey image.

    Returns
    -------
    Tensor, same shape as ``x``.
    """
    if kind not in TRANSFORMS:
        raise ValueError(f"kind must be one of {sorted(TRANSFORMS)}, got {kind!r}")
    if kind == "none" or extent == 0:
        return x.clone()
    flat = x.dim() == 2
    if flat:
        side = math.isqrt(x.shape[1])
        shape = image_shape or (1, side, side)
        img = x.reshape(len(x), *shape)
    else:
        img = x
    g = torch.Generator().manual_seed(seed)
    u = 2.0 * torch.rand(len(x), len(GENERATORS), generator=g) - 1.0
    coef = torch.tensor([extent if n in TRANSFORMS[kind] else 0.0 for n in GENERATORS])
    out = torch.empty_like(img)
    for i in range(0, len(x), 2048):   # bounded memory on 60k-image sets
        a = affine_matrices(u[i:i + 2048], coef, affine_generators())
        out[i:i + 2048] = apply_affine(img[i:i + 2048], a.to(img.dtype))
    return out.reshape(x.shape) if flat else out


def transformed_digits(kind: str = "rotate", extent: float = math.pi, seed: int = 0,
                       test_fraction: float = 0.25, image: bool = False,
                       size: int = 8) -> _datasets.DataSplit:
    """scikit-learn's 8×8 digits with one fixed random transform per example.

    ``transformed_digits("rotate", math.pi)`` is fully rotated digits (uniform ±180°);
    ``kind="none"`` gives the plain digits.  Split as :func:`pyro_bnn.data.datasets.digits`.
    ``size > 8`` first upsamples the images bilinearly to ``size × size`` (less
    interpolation blur when they are rotated again by a model's augmentation).
    """
    d = _datasets.digits(test_fraction=test_fraction, seed=seed, image=True)
    if size != 8:
        up = lambda t: torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear",  # noqa: E731
                                                       align_corners=True)
        d = _datasets.DataSplit(up(d.x_train), d.y_train, up(d.x_test), d.y_test)
    if not image:
        d = _datasets.DataSplit(d.x_train.flatten(1), d.y_train, d.x_test.flatten(1), d.y_test)
    return _datasets.DataSplit(transform_images(d.x_train, kind, extent, seed=seed + 1),
                               d.y_train,
                               transform_images(d.x_test, kind, extent, seed=seed + 2),
                               d.y_test)


def transformed_mnist(root: str | os.PathLike, kind: str = "rotate", extent: float = math.pi,
                      num_train: int = 5000, num_test: int = 5000, seed: int = 0,
                      flatten: bool = True) -> _datasets.DataSplit:
    """The MNIST ``num_train``/``num_test`` split (:func:`pyro_bnn.data.datasets.mnist_split`) with one
    fixed random transform per example (``"rotate"`` with ``extent=π``: rotated MNIST)."""
    d = _datasets.mnist_split(root, num_train, num_test, flatten=flatten)
    return _datasets.DataSplit(transform_images(d.x_train, kind, extent, seed=seed + 1),
                               d.y_train,
                               transform_images(d.x_test, kind, extent, seed=seed + 2),
                               d.y_test)


def transformed_fashion_mnist(root: str | os.PathLike | None = None, kind: str = "rotate",
                              extent: float = math.pi, num_train: int | None = None,
                              num_test: int | None = None, seed: int = 0,
                              flatten: bool = True) -> _datasets.DataSplit:
    """Fashion-MNIST (:func:`pyro_bnn.data.datasets.fashion_mnist`) with one fixed random
    transform per image: ``kind="rotate"``, ``extent=π`` is fully rotated Fashion-MNIST
    (every image rotated by its own angle from U[−π, π], bilinear, zero padding).

    Parameters
    ----------
    root : path, optional
        Folder of the four IDX files; default as :func:`~pyro_bnn.data.datasets.fashion_mnist`
        (``$PYRO_BNN_FASHION_MNIST``, else Debian's ``dataset-fashion-mnist`` folder).
    kind, extent : see :func:`transform_images`.
    num_train : int, optional
        Train on a seeded random subset of this many of the 60,000 training images (the
        subset depends on ``seed`` only, not on ``kind``); default all of them.
    num_test : int, optional
        The first ``num_test`` test images; default all 10,000.
    seed : int
        Seeds the subset (``seed``) and the transforms of train (``seed + 1``) and test
        (``seed + 2``) images, drawn independently.
    flatten : bool
        ``(N, 784)`` vectors (default) or ``(N, 1, 28, 28)`` images.

    Returns
    -------
    DataSplit
        float32 inputs in [0, 1] (up to interpolation), int64 labels.

    Raises
    ------
    FileNotFoundError
        The files are not found (the message names the Debian package and ``root=``).
    ValueError
        ``num_train`` or ``num_test`` not in ``[1, available]``; a wrong ``kind``.
    """
    x, y = _datasets.fashion_mnist(root, "train", flatten=False)
    xt, yt = _datasets.fashion_mnist(root, "test", flatten=False)
    for name, value, size in (("num_train", num_train, len(x)), ("num_test", num_test, len(xt))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= size):
            raise ValueError(f"{name} must be an int in [1, {size}], got {value!r}")
    if num_train is not None and num_train < len(x):
        idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:num_train]
        x, y = x[idx], y[idx]
    if num_test is not None:
        xt, yt = xt[:num_test], yt[:num_test]
    x = transform_images(x, kind, extent, seed=seed + 1)
    xt = transform_images(xt, kind, extent, seed=seed + 2)
    if flatten:
        x, xt = x.flatten(1), xt.flatten(1)
    return _datasets.DataSplit(x, y, xt, yt)
