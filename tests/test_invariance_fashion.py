"""pb.invariance.transformed_fashion_mnist on tiny synthetic IDX files (no real data needed)."""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import pyro_bnn as pb
from pyro_bnn.invariance import transform_images, transformed_fashion_mnist


def _write(folder: Path, stem: str, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(folder / (stem + ".gz"), "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def _dot_images(n: int, seed: int) -> np.ndarray:
    """One bright 3×3 square per image, off the centre at radius ≈ 8 pixels."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 28, 28), dtype=np.uint8)
    for i in range(n):
        a = rng.uniform(0, 2 * math.pi)
        r, c = int(round(13.5 - 8 * math.sin(a))), int(round(13.5 + 8 * math.cos(a)))
        out[i, r - 1:r + 2, c - 1:c + 2] = 255
    return out


@pytest.fixture
def root(tmp_path):
    """12 training and 5 test images (one off-centre dot each), labels 0-9."""
    _write(tmp_path, "train-images-idx3-ubyte", _dot_images(12, 0))
    _write(tmp_path, "train-labels-idx1-ubyte", np.arange(12) % 10)
    _write(tmp_path, "t10k-images-idx3-ubyte", _dot_images(5, 1))
    _write(tmp_path, "t10k-labels-idx1-ubyte", (np.arange(5) + 3) % 10)
    return tmp_path


def _centroid_polar(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Radius and angle (pixels, radians) of each image's intensity centroid about the centre."""
    img = x.reshape(len(x), 28, 28)
    grid = torch.arange(28.0) - 13.5
    mass = img.sum((1, 2))
    row = (img.sum(2) * grid).sum(1) / mass
    col = (img.sum(1) * grid).sum(1) / mass
    return torch.hypot(row, col), torch.atan2(-row, col)


def test_none_is_the_plain_images_and_subset_is_seeded(root):
    x, y = pb.datasets.fashion_mnist(root, "train")
    xt, yt = pb.datasets.fashion_mnist(root, "test")
    d = transformed_fashion_mnist(root, "none", num_train=7, num_test=3, seed=4)
    idx = torch.randperm(12, generator=torch.Generator().manual_seed(4))[:7]
    assert torch.equal(d.x_train, x[idx]) and torch.equal(d.y_train, y[idx])
    assert torch.equal(d.x_test, xt[:3]) and torch.equal(d.y_test, yt[:3])
    full = transformed_fashion_mnist(root, "none")
    assert torch.equal(full.x_train, x) and torch.equal(full.x_test, xt)
    # the subset depends on the seed only, not on the transform
    rot = transformed_fashion_mnist(root, "rotate", math.pi, num_train=7, num_test=3, seed=4)
    assert torch.equal(rot.y_train, d.y_train)


def test_rotation_moves_each_dot_on_its_circle_by_its_own_angle(root):
    plain = transformed_fashion_mnist(root, "none")
    rot = transformed_fashion_mnist(root, "rotate", math.pi, seed=0)
    assert rot.x_train.shape == (12, 784) and rot.x_test.shape == (5, 784)
    r0, a0 = _centroid_polar(plain.x_train)
    r1, a1 = _centroid_polar(rot.x_train)
    torch.testing.assert_close(r1, r0, atol=0.3, rtol=0)   # a rotation about the centre keeps the radius
    turn = torch.remainder(a1 - a0 + math.pi, 2 * math.pi) - math.pi
    assert turn.abs().max() <= math.pi and turn.std() > 0.5   # one angle per image, spread over ±π
    # the same angles as transform_images with the documented seeds (train: seed + 1, test: seed + 2)
    torch.testing.assert_close(rot.x_train, transform_images(plain.x_train, "rotate", math.pi, seed=1))
    torch.testing.assert_close(rot.x_test, transform_images(plain.x_test, "rotate", math.pi, seed=2))
    assert not torch.allclose(transform_images(plain.x_test, "rotate", math.pi, seed=1), rot.x_test)


def test_images_layout_and_reproducible(root):
    a = transformed_fashion_mnist(root, "rotate", math.pi, flatten=False)
    b = transformed_fashion_mnist(root, "rotate", math.pi)
    assert a.x_train.shape == (12, 1, 28, 28) and a.x_train.dtype == torch.float32
    assert torch.equal(a.x_train.flatten(1), b.x_train) and a.y_train.dtype == torch.int64


@pytest.mark.parametrize("kwargs", [{"num_train": 0}, {"num_train": 13}, {"num_test": 6},
                                    {"num_train": 2.5}, {"num_test": True}])
def test_bad_sizes_are_clear_errors(root, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be an int in"):
        transformed_fashion_mnist(root, **kwargs)


def test_missing_files_name_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        transformed_fashion_mnist(tmp_path)
