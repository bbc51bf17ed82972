"""Issue 15's bad-input cases: print what pyro_bnn does with each one.

Each line is the case, then ``OK: <result>`` or the exception and the first line of its
message.  The script uses the public API only, so it runs on any commit and gives both the
"before" and the "after" column of ``docs/results/input_checks.md``:

    python benchmarks/input_cases.py
"""

from __future__ import annotations

import gzip
import math
import re
import struct
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import pyro_bnn as pb

CASES = []


def case(name):
    def register(fn):
        CASES.append((name, fn))
        return fn
    return register


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


DIGITS = pb.datasets.digits()
X, Y = DIGITS.x_train, DIGITS.y_train


def fit(data, **kw):
    model = pb.BNN(mlp())
    guide = pb.guides.MeanField(model, init_scale=0.1)
    pb.fit(model, guide, data, progress=False, **{"epochs": 1, **kw})
    return model, guide


def loader(x, y, **kw):
    return DataLoader(TensorDataset(x, y), batch_size=64, **kw)


@case("labels -100 (every 2nd) through a DataLoader")
def _():
    y = Y.clone()
    y[::2] = -100
    model, guide = fit(loader(X, y, shuffle=True), epochs=30, lr=5e-2, seed=0)
    return f"trained; test accuracy {pb.evaluate(model, guide, *DIGITS.test, num_samples=20)['accuracy']:.3f}"


@case("label 10 (10 classes) through a DataLoader")
def _():
    y = Y.clone()
    y[700] = 10
    fit(loader(X, y))


@case("NaN x in batch 11 of a DataLoader")
def _():
    x = X.clone()
    x[700, 3] = math.nan
    fit(loader(x, Y))


case("int64 x through a DataLoader")(lambda: fit(loader((X * 16).long(), Y)))
case("float64 x through a DataLoader")(lambda: fit(loader(X.double(), Y)))
case("float labels through a DataLoader")(lambda: fit(loader(X, Y.float())))
case("empty tensors")(lambda: fit((X[:0], Y[:0])))
case("empty DataLoader")(lambda: fit(loader(X[:0], Y[:0])))
case("DataLoader, drop_last, 10 examples < batch")(lambda: fit(loader(X[:10], Y[:10], drop_last=True)))
case("int64 x tensor")(lambda: fit(((X * 16).long(), Y)))
case("uint8 x tensor")(lambda: fit(((X * 16).to(torch.uint8), Y)))
case("float64 x tensor, float32 model")(lambda: fit((X.double(), Y)))
case("int32 labels")(lambda: fit((X, Y.int())))


class _PreBatched(Dataset):
    """Whole batches as items; the 6th has one target too few."""

    def __len__(self):
        return 21

    def __getitem__(self, k):
        return X[k * 64:(k + 1) * 64], Y[k * 64:(k + 1) * 64 - (k == 5)]


case("x/y lengths differ in batch 6 of a loader")(
    lambda: fit(DataLoader(_PreBatched(), batch_size=None), num_data=len(X)))


@case("predict on empty x")
def _():
    model, guide = fit((X[:100], Y[:100]))
    return tuple(pb.predict(model, guide, X[:0], num_samples=2).shape)


@case("evaluate on empty x")
def _():
    model, guide = fit((X[:100], Y[:100]))
    return pb.evaluate(model, guide, X[:0], Y[:0], num_samples=2)


case("IIDNormal(inf)")(lambda: pb.priors.IIDNormal(math.inf))


@case("fit with an IIDNormal(inf) prior")
def _():
    model = pb.BNN(mlp(), prior=pb.priors.IIDNormal(math.inf))
    pb.fit(model, pb.guides.MeanField(model), (X, Y), epochs=1, progress=False)
    return "trained"


case("IIDNormal(nan)")(lambda: pb.priors.IIDNormal(math.nan))
case("IIDNormal(1, loc=inf)")(lambda: pb.priors.IIDNormal(1.0, loc=math.inf))
case("IIDNormal('1')")(lambda: pb.priors.IIDNormal("1"))
case("FanInNormal(inf)")(lambda: pb.priors.FanInNormal(math.inf))
case("ScaleMixture(sigma1=inf)")(lambda: pb.priors.ScaleMixture(0.5, math.inf, 1e-3))
case("prior dict {'*': ..., 'net.0.wieght': ...}")(lambda: pb.BNN(mlp(), prior={
    "*": pb.priors.IIDNormal(1.0), "net.0.wieght": pb.priors.IIDNormal(0.1)}) and "built")
case("prior dict {'*': ..., '0.weight': ...}")(lambda: pb.BNN(mlp(), prior={
    "*": pb.priors.IIDNormal(1.0), "0.weight": pb.priors.IIDNormal(0.1)}) and "built")


def _idx(path, arr, truncate=0, gz=False):
    header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    with (gzip.open if gz else open)(path, "wb") as fh:
        fh.write(data[:len(data) - truncate])


def _mnist(images, labels, truncate=0):
    root = Path(tempfile.mkdtemp())
    _idx(root / "t10k-images-idx3-ubyte", images, truncate)
    _idx(root / "t10k-labels-idx1-ubyte", labels)
    x, y = pb.datasets.mnist(root, "test")
    return f"x {tuple(x.shape)}, y {tuple(y.shape)}"


RNG = np.random.default_rng(0)
IMAGES, LABELS = RNG.integers(0, 256, (100, 28, 28)), RNG.integers(0, 10, 100)
case("MNIST: 90 labels for 100 images")(lambda: _mnist(IMAGES, LABELS[:90]))
case("MNIST: image header (100, 784)")(lambda: _mnist(IMAGES.reshape(100, 784), LABELS))
case("MNIST: 32x32 images")(lambda: _mnist(RNG.integers(0, 256, (100, 32, 32)), LABELS))
case("MNIST: image and label files swapped")(lambda: _mnist(LABELS, IMAGES))
case("MNIST: image file 100 bytes short")(lambda: _mnist(IMAGES, LABELS, truncate=100))
case("MNIST: labels up to 14")(lambda: _mnist(IMAGES, LABELS + 5))


@case("MNIST: image file of 3 bytes")
def _():
    root = Path(tempfile.mkdtemp())
    (root / "t10k-images-idx3-ubyte").write_bytes(b"\0\0\x08")
    _idx(root / "t10k-labels-idx1-ubyte", LABELS)
    return pb.datasets.mnist(root, "test")


@case("MNIST: truncated .gz stream")
def _():
    root = Path(tempfile.mkdtemp())
    path = root / "t10k-images-idx3-ubyte.gz"
    _idx(path, IMAGES, gz=True)
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    _idx(root / "t10k-labels-idx1-ubyte", LABELS)
    return pb.datasets.mnist(root, "test")


def main():
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name, fn in CASES:
        try:
            out = f"OK: {fn()}"
        except Exception as exc:  # noqa: BLE001 - we report whatever happens
            first = re.sub(r"\S*/(t10k-)", r"\1", (str(exc).splitlines() or [""])[0])  # no temp paths
            out = f"{type(exc).__name__}: {first[:220]}"
        print(f"{name:<46} -> {out}", flush=True)


if __name__ == "__main__":
    main()
