"""pb.datasets.fashion_mnist / fashion_mnist_split on tiny synthetic IDX files (no real data
needed), plus one check of the installed Debian files when they are there."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import pyro_bnn as pb
from pyro_bnn import datasets

DEBIAN = Path("/usr/share/datasets/fashion-mnist")


def _idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write(folder: Path, stem: str, array: np.ndarray, *, raw: bytes | None = None) -> Path:
    path = folder / (stem + ".gz")
    with gzip.open(path, "wb") as fh:
        fh.write(_idx_bytes(array) if raw is None else raw)
    return path


def _images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


@pytest.fixture
def fake_root(tmp_path):
    """12 training and 4 test images with known pixels and labels."""
    train_x, test_x = _images(12, 0), _images(4, 1)
    train_x[0, 0, 0], train_x[0, 0, 1] = 0, 255  # the range ends
    train_y, test_y = np.arange(12, dtype=np.uint8) % 10, np.array([9, 0, 3, 3], dtype=np.uint8)
    _write(tmp_path, "train-images-idx3-ubyte", train_x)
    _write(tmp_path, "train-labels-idx1-ubyte", train_y)
    _write(tmp_path, "t10k-images-idx3-ubyte", test_x)
    _write(tmp_path, "t10k-labels-idx1-ubyte", test_y)
    return tmp_path, (train_x, train_y, test_x, test_y)


@pytest.fixture
def no_default_location(monkeypatch, tmp_path):
    """No environment variable, no Debian folder, no dpkg answer."""
    monkeypatch.delenv(datasets.FASHION_MNIST_ENV, raising=False)
    monkeypatch.setattr(datasets, "FASHION_MNIST_DEBIAN_ROOT", tmp_path / "not-installed")
    monkeypatch.setattr(datasets, "_dpkg_fashion_mnist_folder", lambda: None)


def test_values_shapes_and_labels_match_the_files(fake_root):
    root, (train_x, train_y, test_x, test_y) = fake_root
    x, y = pb.datasets.fashion_mnist(root, "train")
    assert x.shape == (12, 784) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == train_y.tolist()
    # exactly byte / 255, row-major flattening, as mnist()
    np.testing.assert_array_equal(x.numpy(), train_x.reshape(12, 784).astype(np.float32) / 255.0)
    assert float(x[0, 0]) == 0.0 and float(x[0, 1]) == 1.0
    xi, yi = pb.datasets.fashion_mnist(root, "test", flatten=False)
    assert xi.shape == (4, 1, 28, 28) and yi.tolist() == [9, 0, 3, 3]
    np.testing.assert_array_equal(xi[2, 0].numpy(), test_x[2].astype(np.float32) / 255.0)


def test_matches_mnist_normalisation(fake_root):
    root, _ = fake_root
    fx, fy = pb.datasets.fashion_mnist(root, "test")
    mx, my = pb.datasets.mnist(root, "test")  # same file layout, same reader
    assert torch.equal(fx, mx) and torch.equal(fy, my)


def test_environment_variable_is_used(fake_root, monkeypatch):
    root, (_, train_y, _, _) = fake_root
    monkeypatch.setenv(datasets.FASHION_MNIST_ENV, str(root))
    _, y = pb.datasets.fashion_mnist(split="train")
    assert y.tolist() == train_y.tolist()


def test_split_is_disjoint_seeded_and_keeps_test(fake_root):
    root, (_, train_y, _, test_y) = fake_root
    s = pb.datasets.fashion_mnist_split(root, num_validation=3, seed=5)
    assert len(s.x_train) == 9 and len(s.x_valid) == 3 and len(s.x_test) == 4
    x_all, _ = pb.datasets.fashion_mnist(root, "train")
    rows = {tuple(r.tolist()) for r in torch.cat([s.x_train, s.x_valid])}
    assert rows == {tuple(r.tolist()) for r in x_all}  # a partition of the training images
    assert sorted(torch.cat([s.y_train, s.y_valid]).tolist()) == sorted(train_y.tolist())
    assert s.y_test.tolist() == test_y.tolist()
    again = pb.datasets.fashion_mnist_split(root, num_validation=3, seed=5)
    other = pb.datasets.fashion_mnist_split(root, num_validation=3, seed=6)
    assert torch.equal(s.x_valid, again.x_valid) and not torch.equal(s.x_valid, other.x_valid)
    assert s.train[0] is s.x_train and s.valid[1] is s.y_valid


@pytest.mark.parametrize("bad, error", [(12, ValueError), (-1, ValueError), (2.5, TypeError),
                                        (True, TypeError)])
def test_split_rejects_bad_validation_sizes(fake_root, bad, error):
    with pytest.raises(error, match="num_validation"):
        pb.datasets.fashion_mnist_split(fake_root[0], num_validation=bad)


def test_wrong_split_name_suggests_the_right_one(fake_root):
    with pytest.raises(ValueError, match=r"'train' or 'test', got 'trian'; did you mean 'train'\?"):
        pb.datasets.fashion_mnist(fake_root[0], "trian")


def test_missing_installation_names_the_package_and_root(no_default_location):
    with pytest.raises(FileNotFoundError, match=r"apt-get install dataset-fashion-mnist.*root="):
        pb.datasets.fashion_mnist()


def test_root_that_is_not_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        pb.datasets.fashion_mnist(tmp_path / "nope")


def test_missing_files_are_named(tmp_path):
    _write(tmp_path, "train-images-idx3-ubyte", _images(2, 0))
    with pytest.raises(FileNotFoundError, match=r"train-labels-idx1-ubyte\[\.gz\].*dataset-fashion-mnist"):
        pb.datasets.fashion_mnist(tmp_path, "train")


def test_bad_magic_number(fake_root):
    root, _ = fake_root
    raw = struct.pack(">HBB", 0, 0x0D, 3) + struct.pack(">III", 1, 28, 28) + bytes(4 * 784)  # float IDX
    _write(root, "t10k-images-idx3-ubyte", None, raw=raw)
    with pytest.raises(ValueError, match="not an unsigned-byte IDX file"):
        pb.datasets.fashion_mnist(root, "test")


def test_truncated_file(fake_root):
    root, (_, _, test_x, _) = fake_root
    _write(root, "t10k-images-idx3-ubyte", None, raw=_idx_bytes(test_x)[:-100])
    with pytest.raises(ValueError, match="truncated"):
        pb.datasets.fashion_mnist(root, "test")


def test_truncated_gzip_stream(fake_root):
    root, (_, _, test_x, _) = fake_root
    path = root / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match="damaged or truncated gzip"):
        pb.datasets.fashion_mnist(root, "test")


def test_labels_out_of_range_and_count_mismatch(fake_root):
    root, _ = fake_root
    _write(root, "t10k-labels-idx1-ubyte", np.array([0, 1, 2, 10], dtype=np.uint8))
    with pytest.raises(ValueError, match="labels 0-9, got labels up to 10"):
        pb.datasets.fashion_mnist(root, "test")
    _write(root, "t10k-labels-idx1-ubyte", np.array([0, 1, 2], dtype=np.uint8))
    with pytest.raises(ValueError, match="4 images .* but 3 labels"):
        pb.datasets.fashion_mnist(root, "test")


def test_wrong_image_size(fake_root):
    root, _ = fake_root
    _write(root, "t10k-images-idx3-ubyte", np.zeros((4, 8, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="28x28 pixels, got shape"):
        pb.datasets.fashion_mnist(root, "test")


@pytest.mark.skipif(not (DEBIAN / "t10k-labels-idx1-ubyte.gz").exists(),
                    reason="dataset-fashion-mnist is not installed")
def test_installed_debian_files(monkeypatch):
    monkeypatch.delenv(datasets.FASHION_MNIST_ENV, raising=False)
    x, y = pb.datasets.fashion_mnist(split="test")
    assert x.shape == (10000, 784) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.bincount(y).tolist() == [1000] * 10  # the test set is balanced
