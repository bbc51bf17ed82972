"""Data sets: digits (offline default), MNIST from IDX files, Blundell's toy regression.

All loaders return a :class:`DataSplit` of tensors; nothing here needs the internet unless
``download=True`` is asked of :func:`mnist`.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["DataSplit", "digits", "mnist", "read_idx", "mnist_split", "toy_regression"]


class DataSplit(NamedTuple):
    """Train/test tensors; ``.train`` and ``.test`` give ``(x, y)`` pairs."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def train(self):
        return self.x_train, self.y_train

    @property
    def test(self):
        return self.x_test, self.y_test


def _split(x, y, test_fraction, seed):
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = int(round(test_fraction * len(x)))
    te, tr = perm[:n_test], perm[n_test:]
    return DataSplit(x[tr], y[tr], x[te], y[te])


def digits(test_fraction: float = 0.25, seed: int = 0, image: bool = False) -> DataSplit:
    """scikit-learn's bundled 1,797 real handwritten 8×8 digits, pixels scaled to [0, 1].

    Parameters
    ----------
    test_fraction : float
        Share held out for testing (seeded random split; default 0.25 → 1,348 / 449).
    seed : int
        Seed of the split.
    image : bool
        Return ``(N, 1, 8, 8)`` images instead of ``(N, 64)`` vectors.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return _split(x, y, test_fraction, seed)


def read_idx(path: str | os.PathLike, ndim: int | None = None) -> np.ndarray:
    """Read an unsigned-byte IDX file (raw or ``.gz``), as used by MNIST.

    The format: a 4-byte magic number ``0x00 0x00 0x08 d`` (``0x08`` = unsigned byte,
    ``d`` = number of dimensions), ``d`` big-endian 32-bit sizes, then the values.

    Parameters
    ----------
    path : path
        The file.
    ndim : int, optional
        Expected number of dimensions (3 for MNIST images, 1 for labels).

    Returns
    -------
    numpy.ndarray
        ``uint8`` array of the shape the header states.

    Raises
    ------
    ValueError
        Not an unsigned-byte IDX file, a wrong number of dimensions, or a file (or gzip
        stream) that is truncated or longer than its header says.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: damaged or truncated gzip file ({exc})") from None
    if len(data) < 4:
        raise ValueError(f"{path}: truncated IDX file: {len(data)} bytes, expected at least a "
                         "4-byte magic number")
    zero, dtype_code, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08 or dims == 0:
        raise ValueError(f"{path} is not an unsigned-byte IDX file: magic number {data[:4].hex()}, "
                         "expected 000008 followed by the number of dimensions")
    if ndim is not None and dims != ndim:
        raise ValueError(f"{path}: expected an IDX file with {ndim} dimension(s) "
                         f"(magic 000008{ndim:02x}), got {dims} (magic {data[:4].hex()})")
    offset = 4 + 4 * dims
    if len(data) < offset:
        raise ValueError(f"{path}: truncated IDX header: {len(data)} bytes, expected {offset}")
    shape = struct.unpack(">" + "I" * dims, data[4:offset])
    expected = math.prod(shape)
    got = len(data) - offset
    if got != expected:
        kind = "truncated" if got < expected else "longer than its header says"
        raise ValueError(f"{path}: {kind}: header says shape {shape} ({expected} values), "
                         f"the file holds {got}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _find(root: Path, stem: str) -> Path | None:
    for folder in (root, root / "MNIST" / "raw", root / "raw"):
        for name in (stem, stem + ".gz"):
            if (folder / name).exists():
                return folder / name
    return None


def mnist(root: str | os.PathLike, split: str = "test", flatten: bool = True,
          download: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from IDX files in ``root`` (raw or gzipped, torchvision's ``MNIST/raw`` layout too).

    Returns ``x`` scaled to [0, 1] (``(N, 784)`` or ``(N, 1, 28, 28)``) and labels ``(N,)``.
    With ``download=True`` and files missing, torchvision downloads them (needs internet).

    Raises
    ------
    FileNotFoundError
        The files are not in ``root``.
    ValueError
        A damaged file (see :func:`read_idx`), images that are not ``(N, 28, 28)``,
        labels that are not ``(N,)`` digits 0-9, or image and label counts that differ.
    """
    if split not in _MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    img_stem, lbl_stem = _MNIST_FILES[split]
    img, lbl = _find(root, img_stem), _find(root, lbl_stem)
    if (img is None or lbl is None) and download:
        import torchvision

        torchvision.datasets.MNIST(str(root), train=(split == "train"), download=True)
        img, lbl = _find(root, img_stem), _find(root, lbl_stem)
    if img is None or lbl is None:
        raise FileNotFoundError(
            f"MNIST {split} files ({img_stem}[.gz], {lbl_stem}[.gz]) not found in {root} "
            "(also looked in MNIST/raw); pass download=True when online")
    images, labels = read_idx(img, ndim=3), read_idx(lbl, ndim=1)
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{img}: expected MNIST images of 28x28 pixels, got shape {images.shape}")
    if len(labels) != len(images):
        raise ValueError(f"MNIST {split} files disagree: {len(images)} images in {img.name} but "
                         f"{len(labels)} labels in {lbl.name}; expected one label per image")
    if labels.size and int(labels.max()) > 9:
        raise ValueError(f"{lbl}: expected digit labels 0-9, got labels up to {int(labels.max())}")
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    x = x.reshape(len(x), -1) if flatten else x.reshape(len(x), 1, 28, 28)
    return x, y


def mnist_split(root: str | os.PathLike, num_train: int = 5000, num_test: int = 5000,
                flatten: bool = True) -> DataSplit:
    """The small-data MNIST split used by our benchmarks: the first ``num_train`` digits of
    the MNIST test file for training and the next ``num_test`` for testing."""
    x, y = mnist(root, "test", flatten=flatten)
    if num_train + num_test > len(x):
        raise ValueError(f"asked for {num_train}+{num_test} digits but the file holds {len(x)}")
    return DataSplit(x[:num_train], y[:num_train], x[num_train:num_train + num_test],
                     y[num_train:num_train + num_test])


def toy_regression(num_points: int = 64, seed: int = 0, noise: float = 0.02,
                   x_range: tuple[float, float] = (0.0, 0.5)) -> tuple[torch.Tensor, torch.Tensor]:
    """Blundell et al. (2015, fig. 5): ``y = x + 0.3 sin(2π(x+ε)) + 0.3 sin(4π(x+ε)) + ε``.

    ``ε ~ N(0, noise²)``; ``x ~ U(x_range)``.  Returns ``x`` and ``y`` of shape ``(n, 1)``.
    """
    g = torch.Generator().manual_seed(seed)
    lo, hi = x_range
    x = lo + (hi - lo) * torch.rand(num_points, 1, generator=g)
    eps = noise * torch.randn(num_points, 1, generator=g)
    y = x + 0.3 * torch.sin(2 * math.pi * (x + eps)) + 0.3 * torch.sin(4 * math.pi * (x + eps)) + eps
    return x, y
