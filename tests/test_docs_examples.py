"""The docs' Python examples and the example scripts run as written (shrunk, like test_readme).

(a) Every ```python block of the docs below runs, in order, in one namespace per file, with
fewer epochs, steps and draws.  A block that continues a discussion of the reader's own network
(a BatchNorm CNN, a validation split) gets that context from ``CONTEXT`` below, and a few
``after`` lines that use what the block built; every file ends with assertions on its results.
(b) Every script in ``examples/`` runs in a subprocess with its quickest arguments, its outputs in
``tmp_path``, and must exit 0 and print (or write) what it promises.
"""

import gzip
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"

# Blocks per file: a block added or removed must be looked at here (and in CONTEXT).
BLOCKS = {"pyro.md": 7, "training.md": 2, "DEVELOPING.md": 1, "distributed.md": 1}

_BN_NET = """
x_img, x_img_test = x.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
                    nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 10))
"""

#: (file, a line the block contains) -> (code run before it, code run after it): the reader's part.
CONTEXT = {
    ("pyro.md", "stochastic=random"): (
        _BN_NET,
        "guide(x_img[:64], y[:64])\n"
        "assert {'net.1.weight', 'net.1.bias'} <= set(guide.median())   # γ, β are random sites\n",
    ),
    ("pyro.md", 'subset="unnormalized"'): (
        "",
        "pb.fit(model, guide, (x_img[:256], y[:256]), epochs=1, lr=1e-2, progress=False)\n",
    ),
    ("pyro.md", 'method="gridsearch"'): (
        "guide.optimize_prior_precision()\n"
        "x_val, y_val = x_img[256:512], y[256:512]\n",
        "assert torch.isfinite(guide.prior_precision).all()\n",
    ),
}


def _shrink(code: str) -> str:
    code = re.sub(r"epochs=\d+", "epochs=1", code)
    code = re.sub(r"num_samples=\d+\)", "num_samples=4)", code)
    code = re.sub(r"range\(\d+\)", "range(2)", code)
    return code


def _blocks(name: str) -> list[str]:
    text = (DOCS / name).read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"^ *```python\n(.*?)^ *```", text, flags=re.S | re.M)]
    assert len(blocks) == BLOCKS[name], f"docs/{name} has {len(blocks)} python blocks, the test expects {BLOCKS[name]}"
    return [_shrink(b) for b in blocks]


def _run_blocks(name: str, namespace: dict) -> None:
    blocks = _blocks(name)
    for doc, needle in CONTEXT:
        if doc == name:
            assert sum(needle in b for b in blocks) == 1, f"no single block of docs/{name} contains {needle!r}"
    for code in blocks:
        before, after = next((c for (doc, needle), c in CONTEXT.items() if doc == name and needle in code),
                             ("", ""))
        for part in (before, code, after):
            exec(compile(part, str(DOCS / name), "exec"), namespace)  # noqa: S102 - our own docs


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_pyro_md(in_tmp):
    ns: dict = {}
    _run_blocks("pyro.md", ns)
    assert ns["draws"]["obs"].shape == (4, 449)
    assert isinstance(ns["loss"], pyro.infer.ELBO)
    # the fresh guide set up after loading the store holds the saved values
    saved = torch.load(in_tmp / "params.pt", weights_only=False)["params"]
    restored = ns["guide"].median()
    assert restored
    for site, value in restored.items():
        torch.testing.assert_close(value, saved[f"MeanField.locs.{site}"])


@pytest.mark.slow
def test_training_md(in_tmp):
    ns: dict = {}
    _run_blocks("training.md", ns)
    assert (in_tmp / "run.pt").is_file()
    check = ns["check"]
    assert check.model is not None and isinstance(check.message(), str)


@pytest.mark.slow
def test_developing_md(in_tmp):
    ns: dict = {}
    _run_blocks("DEVELOPING.md", ns)
    (norm,) = ns["result"].history["weight_norm"]   # the guide's on_fit_end hook ran
    assert norm > 0


def _env() -> dict:
    return {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_distributed_md(tmp_path):
    """The block is a torchrun script: run it so, with two Gloo processes."""
    (code,) = _blocks("distributed.md")
    script = tmp_path / "train.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[:6000]
    assert proc.stdout.count("'accuracy'") == 1, proc.stdout          # printed by rank 0 only
    assert (tmp_path / "run" / "ckpt.pt").is_file()


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def tiny_mnist(tmp_path) -> Path:
    """200 MNIST-format test images (random pixels; labels 0-9 in turn) in IDX files."""
    root = tmp_path / "mnist"
    root.mkdir()
    rng = np.random.default_rng(0)
    _write_idx(root / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (200, 28, 28)))
    _write_idx(root / "t10k-labels-idx1-ubyte.gz", np.arange(200) % 10)
    return root


#: script -> (arguments, a regex its stdout must match, files it must write under out/ as glob patterns).
EXAMPLE_RUNS = {
    "laplace_digits": (["--epochs", "2", "--hidden", "20"],
                       r"GLM, MC \(64\)\s+acc 0\.\d+.*\n.*GLM \(probit\)\s+acc 0\.\d+.*\n.*weights \(64\)\s+acc 0\.\d+", []),
    "bimodal_toy": (["--steps", "20", "--mf-steps", "20", "--hidden", "8"],
                    r"seed 0 hypernet.*ELBO -?\d+\.\d+ .*\| meanfield ELBO -?\d", []),
    "symmetric_toy": (["--epochs", "1", "--seeds", "1", "--alphas", "0.05", "--eval-samples", "10"],
                      r"\| 0\.05 \| -?\d+\.\d+ \| -?\d+\.\d+ \|", []),
    "toy_regression_hypernet": (["--epochs", "3", "--plot", "{out}/band.png"],
                                r"std on \[0\.8, 1\.0\]: \d+\.\d+\s+ratio \d", ["band.png"]),
    "active_learning_digits": (["--rounds", "1", "--seeds", "1", "--epochs", "5", "--acquisitions", "bald",
                                "--out", "{out}"], r"bald\s+final accuracy mean 0\.\d+",
                               ["active_digits_*.json", "active_digits_*.png"]),
    "corruption_digits": (["--quick", "--guides", "laplace", "--angles", "0,90", "--out", "{out}"],
                          r"laplace \(GLM\)\s+acc 0\.\d+ entropy 0°=\d.*\nlaplace \(sampled\)\s+acc 0\.\d",
                          ["corruption_digits_quick.json", "corruption_rotation_quick.png"]),
    "ood_digits": (["--quick", "--guides", "MAP,meanfield", "--out", "{out}"],
                   r"seed 0 meanfield: MI AUROC 0\.\d+ vs MAP max-prob AUROC 0\.\d+", ["ood_digits_quick.json"]),
    "invariance_rotated_digits": (["--quick", "--methods", "lila", "--out", "{out}"], r"(?m)^lila\s+\d+\.\d+%",
                                  ["results.json", "eta.png"]),
    "pruning_mnist": (["--data-dir", "{mnist}", "--num-train", "100", "--num-test", "100", "--epochs", "2",
                       "--hidden", "32", "--fractions", "0,0.9", "--out", "{out}", "--tag", "t"],
                      r"test\s+snr\s+\d+\.\d+", ["pruning_mnist_t.json", "pruning_mnist_t.png"]),
}


def test_every_example_is_run():
    assert {p.stem for p in EXAMPLES.glob("*.py")} == set(EXAMPLE_RUNS) | {"distributed_digits"}


def _run_example(name: str, args: list[str], cwd: Path, launcher: list[str] | None = None):
    cmd = [sys.executable, *(launcher or []), str(EXAMPLES / f"{name}.py"), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_example_runs(name, tmp_path, tiny_mnist):
    args, pattern, files = EXAMPLE_RUNS[name]
    out = tmp_path / "out"
    out.mkdir()
    args = [a.format(out=out, mnist=tiny_mnist) for a in args]
    stdout = _run_example(name, args, cwd=tmp_path)
    assert re.search(pattern, stdout), stdout[-3000:]
    for pattern in files:
        matches = sorted(out.glob(pattern))
        assert len(matches) == 1, f"{name} wrote {[m.name for m in out.iterdir()]}, expected one {pattern}"
        path = matches[0]
        assert path.stat().st_size > 0, f"{name} wrote an empty {path.name}"
        if path.suffix == ".json":
            json.loads(path.read_text())


@pytest.mark.slow
def test_distributed_example(tmp_path):
    """Two Gloo processes under torchrun: rank 0 alone prints and writes the checkpoint."""
    ckpt = tmp_path / "ckpt.pt"
    stdout = _run_example("distributed_digits", ["--epochs", "1", "--device", "cpu", "--checkpoint", str(ckpt)],
                          cwd=tmp_path, launcher=["-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node=2"])
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("processes=")]
    assert line.startswith("processes=2 epochs=1")
    assert re.search(r"test .*accuracy=0\.\d+", stdout), stdout
    assert ckpt.is_file()
