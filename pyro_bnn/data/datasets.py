"""Data sets: digits (offline default), MNIST and Fashion-MNIST from IDX files, Blundell's toy
regression.

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

from ..arguments import check_int

__all__ = ["DataSplit", "digits", "mnist", "read_idx", "mnist_split", "fashion_mnist",
           "fashion_mnist_split", "FashionMNISTSplit", "FASHION_MNIST_CLASSES", "toy_regression",
           "identify_split"]


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


#: What tells MNIST and Fashion-MNIST apart (their files have the same names, format and
#: sizes, so a ``root=`` that points at the other data set loaded it in silence): the class
#: counts of each published split and its first ten labels.
_SIGNATURES = {
    ("MNIST", "train"): ((5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
                         (5, 0, 4, 1, 9, 2, 1, 3, 1, 4)),
    ("MNIST", "test"): ((980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
                        (7, 2, 1, 0, 4, 1, 4, 9, 5, 9)),
    ("Fashion-MNIST", "train"): ((6000,) * 10, (9, 0, 0, 3, 0, 2, 7, 2, 5, 5)),
    ("Fashion-MNIST", "test"): ((1000,) * 10, (9, 2, 1, 1, 6, 1, 4, 6, 5, 7)),
}
_LOADERS = {"MNIST": "mnist", "Fashion-MNIST": "fashion_mnist"}


def identify_split(labels: np.ndarray) -> tuple[str, str] | None:
    """``(data set, split)`` of a published MNIST or Fashion-MNIST split whose labels these
    are (its class counts and first ten labels, :data:`_SIGNATURES`), else ``None``.

    Parameters
    ----------
    labels : numpy.ndarray, shape (N,)
        Integer labels 0-9, in file order.
    """
    if labels.size < 10:
        return None
    counts = tuple(np.bincount(labels, minlength=10).tolist())
    first = tuple(labels[:10].tolist())
    for key, (ref_counts, ref_first) in _SIGNATURES.items():
        if counts == ref_counts and first == ref_first:
            return key
    return None


def _refuse_other_data_set(labels: np.ndarray, lbl: Path, wanted: str) -> None:
    """``ValueError`` when the files read for ``wanted`` are the other data set's published
    split (a ``root=`` pointing at the wrong folder; the files have the same names)."""
    found = identify_split(labels)
    if found is None or found[0] == wanted:
        return
    other, split = found
    counts, _ = _SIGNATURES[found]
    per_class = f"{min(counts):,}" if min(counts) == max(counts) else f"{min(counts):,}-{max(counts):,}"
    raise ValueError(
        f"{lbl}: expected {wanted} labels, got those of the {other} {split} set ({len(labels):,} labels, "
        f"{per_class} per class, starting {', '.join(map(str, labels[:5].tolist()))}): "
        f"root={str(lbl.parent)!r} holds {other}, whose files have the same names; pass the folder of "
        f"{wanted}, or load these with pb.datasets.{_LOADERS[other]}()")


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
        labels that are not ``(N,)`` digits 0-9, image and label counts that differ, or the
        files of a Fashion-MNIST split (same names; :func:`identify_split`).
    """
    if split not in _MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}" + _did_you_mean(split, _MNIST_FILES))
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
    _refuse_other_data_set(labels, lbl, "MNIST")
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    x = x.reshape(len(x), -1) if flatten else x.reshape(len(x), 1, 28, 28)
    return x, y


def mnist_split(root: str | os.PathLike, num_train: int = 5000, num_test: int = 5000,
                flatten: bool = True) -> DataSplit:
    """The small-data MNIST split used by our benchmarks: the first ``num_train`` digits of
    the MNIST test file for training and the next ``num_test`` for testing (ints >= 1: a
    negative count sliced from the end, ``-5`` gave 9,995 training digits and no test set)."""
    num_train, num_test = check_int("num_train", num_train, 1), check_int("num_test", num_test, 1)
    x, y = mnist(root, "test", flatten=flatten)
    if num_train + num_test > len(x):
        raise ValueError(f"asked for {num_train}+{num_test} digits but the file holds {len(x)}")
    return DataSplit(x[:num_train], y[:num_train], x[num_train:num_train + num_test],
                     y[num_train:num_train + num_test])


#: Fashion-MNIST's ten classes, in label order (Xiao, Rasul & Vollgraf, 2017).
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")

#: Where Debian's ``dataset-fashion-mnist`` package installs the four IDX files.
FASHION_MNIST_DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_ENV = "PYRO_BNN_FASHION_MNIST"
_FASHION_MNIST_SIZES = {"train": 60000, "test": 10000}


def _did_you_mean(value, choices) -> str:
    import difflib

    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _fashion_mnist_root(root) -> Path:
    """The folder holding the Fashion-MNIST files: ``root``, else ``$PYRO_BNN_FASHION_MNIST``,
    else the Debian package's folder (asked of ``dpkg -L`` if not in the usual place)."""
    if root is not None:
        path = Path(root)
        if not path.is_dir():
            raise FileNotFoundError(f"Fashion-MNIST root={str(root)!r} is not a folder; expected the "
                                    "folder holding train-images-idx3-ubyte[.gz] and the other IDX files")
        return path
    env = os.environ.get(FASHION_MNIST_ENV)
    if env:
        path = Path(env)
        if not path.is_dir():
            raise FileNotFoundError(f"${FASHION_MNIST_ENV}={env!r} is not a folder; expected the "
                                    "folder holding the Fashion-MNIST IDX files")
        return path
    if FASHION_MNIST_DEBIAN_ROOT.is_dir():
        return FASHION_MNIST_DEBIAN_ROOT
    found = _dpkg_fashion_mnist_folder()
    if found is not None:
        return found
    raise FileNotFoundError(
        f"Fashion-MNIST not found: no root= given, ${FASHION_MNIST_ENV} is not set and {FASHION_MNIST_DEBIAN_ROOT} does not exist. "
        f"Install the Debian package (apt-get install dataset-fashion-mnist), set ${FASHION_MNIST_ENV}, or pass "
        "root= the folder holding train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
        "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz")


def _dpkg_fashion_mnist_folder() -> Path | None:
    """The folder of ``train-images-idx3-ubyte.gz`` as ``dpkg -L dataset-fashion-mnist`` lists
    it, or None (no dpkg, package not installed)."""
    import shutil
    import subprocess

    if shutil.which("dpkg") is None:
        return None
    try:
        out = subprocess.run(["dpkg", "-L", "dataset-fashion-mnist"], capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().endswith("train-images-idx3-ubyte.gz"):
            return Path(line.strip()).parent
    return None


def fashion_mnist(root: str | os.PathLike | None = None, split: str = "train",
                  flatten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST (Xiao et al., 2017) from its IDX files: 60,000 training and 10,000 test
    28×28 grey-scale images of ten kinds of clothing (:data:`FASHION_MNIST_CLASSES`).

    The same normalisation as :func:`mnist`: pixels ``x = byte / 255`` as float32 in [0, 1]
    (no mean/std standardisation), labels int64 in 0-9.

    Parameters
    ----------
    root : path, optional
        Folder with ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (torchvision's
        ``FashionMNIST/raw`` and ``raw/`` sub-folders are looked in too).  Default: the
        environment variable ``PYRO_BNN_FASHION_MNIST``, else where Debian's
        ``dataset-fashion-mnist`` package installs them (``/usr/share/datasets/fashion-mnist``,
        or the folder ``dpkg -L dataset-fashion-mnist`` names).
    split : {"train", "test"}
        The 60,000 training or the 10,000 test images.
    flatten : bool
        ``(N, 784)`` vectors (default) or ``(N, 1, 28, 28)`` images.

    Returns
    -------
    x : Tensor
        float32 ``(N, 784)`` or ``(N, 1, 28, 28)``, values in [0, 1].
    y : Tensor
        int64 ``(N,)`` labels 0-9.

    Raises
    ------
    FileNotFoundError
        No folder, or the split's files are not in it (the message names the Debian package
        and ``root=``).
    ValueError
        A wrong ``split``; a damaged, truncated or non-IDX file (see :func:`read_idx`);
        images that are not 28×28; labels outside 0-9; image and label counts that differ;
        the files of an MNIST split (same names; :func:`identify_split`).
    """
    if split not in _MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}"
                         + _did_you_mean(split, _MNIST_FILES))
    folder = _fashion_mnist_root(root)
    img_stem, lbl_stem = _MNIST_FILES[split]
    img, lbl = _find_fashion(folder, img_stem), _find_fashion(folder, lbl_stem)
    if img is None or lbl is None:
        missing = ", ".join(s + "[.gz]" for s, f in ((img_stem, img), (lbl_stem, lbl)) if f is None)
        raise FileNotFoundError(
            f"Fashion-MNIST {split} file(s) {missing} not found in {folder} (also looked in "
            "FashionMNIST/raw and raw/); install the Debian package (apt-get install "
            "dataset-fashion-mnist) or pass root= the folder that holds them")
    images, labels = read_idx(img, ndim=3), read_idx(lbl, ndim=1)
    _check_fashion(images, labels, img, lbl, split)
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    x = x.reshape(len(x), -1) if flatten else x.reshape(len(x), 1, 28, 28)
    return x, y


def _find_fashion(root: Path, stem: str) -> Path | None:
    for folder in (root, root / "FashionMNIST" / "raw", root / "raw"):
        for name in (stem + ".gz", stem):
            if (folder / name).is_file():
                return folder / name
    return None


def _check_fashion(images, labels, img: Path, lbl: Path, split: str) -> None:
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{img}: expected Fashion-MNIST images of 28x28 pixels, got shape "
                         f"{images.shape}")
    if len(labels) != len(images):
        raise ValueError(f"Fashion-MNIST {split} files disagree: {len(images)} images in {img.name} "
                         f"but {len(labels)} labels in {lbl.name}; expected one label per image")
    if labels.size and int(labels.max()) > 9:
        raise ValueError(f"{lbl}: expected class labels 0-9, got labels up to {int(labels.max())}")
    _refuse_other_data_set(labels, lbl, "Fashion-MNIST")
    expected = _FASHION_MNIST_SIZES[split]
    if FASHION_MNIST_DEBIAN_ROOT in img.parents and len(images) != expected:
        raise ValueError(f"{img}: the installed Fashion-MNIST {split} set should hold {expected} "
                         f"images, got {len(images)}; reinstall dataset-fashion-mnist")


class FashionMNISTSplit(NamedTuple):
    """Train / validation / test tensors of :func:`fashion_mnist_split`."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_valid: torch.Tensor
    y_valid: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def train(self):
        return self.x_train, self.y_train

    @property
    def valid(self):
        return self.x_valid, self.y_valid

    @property
    def test(self):
        return self.x_test, self.y_test


def fashion_mnist_split(root: str | os.PathLike | None = None, *, num_validation: int = 5000,
                        seed: int = 0, flatten: bool = True) -> FashionMNISTSplit:
    """Fashion-MNIST as train / validation / test: a seeded random ``num_validation`` of the
    60,000 training images held out for validation (default 55,000 / 5,000), the 10,000
    test images untouched.  Same files and normalisation as :func:`fashion_mnist`.

    ``num_validation=0`` gives all training images and empty validation tensors.
    """
    if isinstance(num_validation, bool) or not isinstance(num_validation, int):
        raise TypeError(f"num_validation must be an int, got {type(num_validation).__name__}")
    x, y = fashion_mnist(root, "train", flatten=flatten)
    if not 0 <= num_validation < len(x):
        raise ValueError(f"num_validation must be in [0, {len(x)}) for {len(x)} training images, "
                         f"got {num_validation}")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    va, tr = perm[:num_validation], perm[num_validation:]
    xt, yt = fashion_mnist(root, "test", flatten=flatten)
    return FashionMNISTSplit(x[tr], y[tr], x[va], y[va], xt, yt)


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
