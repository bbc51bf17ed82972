"""Checkpoints lose nothing and absorb no mistake (issue 23).

* writes never follow a link planted next to the checkpoint, and two writers never collide;
* two fits on one checkpoint path: the second stops at its start, the first is untouched;
* a fresh fit does not replace an existing checkpoint unless told to;
* a resume onto another prior, architecture, guide option or data is refused, naming it;
* a flipped bit or a crafted file is a clear error, not a different result or a KeyError;
* fit's options are checked (bools, lr with optimizer=, schedules, ints, num_data, marglik).
"""

import math
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch
from helpers import mlp
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training.checkpoint import CheckpointInUseError, CheckpointLock, content_digest, write_atomic
from pyro_bnn.training.resume import fit_fingerprint

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_convergence_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        yield


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    return torch.randn(64, 8), torch.randint(0, 3, (64,))


def _build(act=nn.ReLU, prior=None, **guide_kw):
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(8, 6), act(), nn.Linear(6, 3)), "categorical", prior=prior)
    return model, pb.guides.MeanField(model, **guide_kw)


_FIT = dict(epochs=2, batch_size=32, lr=1e-2, seed=0, progress=False)


def _run_python(code: str, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + str(ROOT / "tests"), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


# ---------------------------------------------------------------- links and temporary files
def test_a_link_at_the_old_temporary_name_is_never_followed(tmp_path, data):
    """The old writer opened ``.<name>.tmp`` for writing, following a link planted there and
    truncating its target; the new one never opens an existing name."""
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"the user's data")
    path = tmp_path / "c.pt"
    link = tmp_path / ".c.pt.tmp"
    link.symlink_to(victim)
    model, guide = _build()
    pb.fit(model, guide, data, checkpoint=path, **_FIT)
    pb.save_checkpoint(path, model, guide)
    assert victim.read_bytes() == b"the user's data"
    assert link.is_symlink() and os.readlink(link) == str(victim)  # left alone, not removed
    assert pb.load_checkpoint(path, model, guide)["model"].keys() == model.state_dict().keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.pt.tmp", "c.pt", "precious.txt"]


def test_the_unique_temporary_name_cannot_be_planted(tmp_path, data, monkeypatch):
    """Even a link planted at exactly the name the writer draws is not followed: the file is
    created with O_EXCL, so the writer draws another name (tempfile.mkstemp)."""
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"the user's data")
    path = tmp_path / "c.pt"
    planted = tmp_path / ".c.pt.guessed.tmp"
    planted.symlink_to(victim)
    drawn = []

    def names():
        for name in ("guessed", "fresh"):
            drawn.append(name)
            yield name

    monkeypatch.setattr(tempfile, "_get_candidate_names", names)
    model, guide = _build()
    pb.save_checkpoint(path, model, guide)
    assert drawn == ["guessed", "fresh"]  # the planted name was drawn, and skipped
    assert victim.read_bytes() == b"the user's data" and planted.is_symlink()
    assert torch.load(path, weights_only=True)["model"].keys() == model.state_dict().keys()
    assert not (tmp_path / ".c.pt.fresh.tmp").exists()  # renamed into place


def test_a_link_at_the_lock_path_is_refused(tmp_path, data):
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"the user's data")
    (tmp_path / "c.pt.lock").symlink_to(victim)
    model, guide = _build()
    with pytest.raises(ValueError, match="lock file .* is a symbolic link"):
        pb.fit(model, guide, data, checkpoint=tmp_path / "c.pt", **_FIT)
    assert victim.read_bytes() == b"the user's data" and not (tmp_path / "c.pt").exists()


def test_the_checkpoint_keeps_the_umask_permissions(tmp_path, data):
    model, guide = _build()
    old = os.umask(0o027)
    try:
        pb.save_checkpoint(tmp_path / "c.pt", model, guide)
    finally:
        os.umask(old)
    assert (tmp_path / "c.pt").stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------- two fits, one path
def test_a_second_fit_on_a_held_path_stops_at_its_start(tmp_path, data):
    path = tmp_path / "c.pt"
    model, guide = _build()
    with CheckpointLock(path):
        with pytest.raises(CheckpointInUseError, match=rf"in use by another fit \(pid {os.getpid()}\)"):
            pb.fit(model, guide, data, checkpoint=path, **_FIT)
        assert not list(guide.parameters()) and not path.exists()  # nothing set up, nothing written
    assert list(tmp_path.iterdir()) == []  # the lock file goes with the lock
    pb.fit(model, guide, data, checkpoint=path, **_FIT)  # released: the path is free again
    assert list(tmp_path.iterdir()) == [path]


def test_the_lock_is_released_when_the_fit_fails(tmp_path, data):
    path = tmp_path / "c.pt"
    model, guide = _build()

    def failing(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pb.fit(model, guide, data, checkpoint=path, objective=failing, **_FIT)
    with CheckpointLock(path):  # free again
        pass


_HOLDER = """
    import os, pathlib, time, warnings
    import torch
    torch.set_num_threads(1)
    import pyro_bnn as pb
    from torch import nn
    warnings.simplefilter("ignore")
    folder = pathlib.Path({folder!r})
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = pb.BNN(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)), "categorical")
    guide = pb.guides.MeanField(model)
    inner = guide.make_objective()
    def objective(*args, **kw):
        if not (folder / "started").exists():
            (folder / "started").write_text(str(os.getpid()))
            deadline = time.time() + 120
            while not (folder / "release").exists() and time.time() < deadline:
                time.sleep(0.05)
        return inner(*args, **kw)
    pb.fit(model, guide, (x, y), epochs=3, batch_size=32, lr=1e-2, progress=False,
           checkpoint=str(folder / "c.pt"), objective=objective)
    print("done", torch.load(folder / "c.pt", weights_only=True)["epoch"])
"""


@pytest.mark.slow
def test_two_processes_fitting_to_one_path(tmp_path, data):
    """Process A is training (held in its first step); a fit in this process on the same path
    raises CheckpointInUseError naming A's pid before it starts; A then ends normally."""
    holder = _run_python(_HOLDER.format(folder=str(tmp_path)))
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert holder.poll() is None and time.time() < deadline, holder.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        model, guide = _build()
        with pytest.raises(CheckpointInUseError, match=rf"in use by another fit \(pid {holder.pid}\)"):
            pb.fit(model, guide, data, checkpoint=tmp_path / "c.pt", overwrite=True, **_FIT)
        assert not list(guide.parameters())
    finally:
        (tmp_path / "release").write_text("go")
        out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0, err.decode()[-2000:]
    assert out.decode().split() == ["done", "3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "release", "started"]


_SAVER = """
    import torch, pyro_bnn as pb
    from torch import nn
    torch.set_num_threads(1)
    model = pb.BNN(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)), "categorical")
    guide = pb.guides.MeanField(model)
    for i in range(40):
        pb.save_checkpoint({path!r}, model, guide, step={tag!r} + str(i))
"""


@pytest.mark.slow
def test_two_processes_saving_to_one_path_never_crash(tmp_path):
    """With the old fixed temporary name one writer renamed the other's file away
    (FileNotFoundError in 5 of 5 tries); with unique names both finish, the file is whole."""
    path = str(tmp_path / "c.pt")
    procs = [_run_python(_SAVER.format(path=path, tag=tag)) for tag in ("a", "b")]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-2000:]
    state = pb.training.checkpoint.read_checkpoint(path)  # digest verified
    assert state["step"] in ("a39", "b39")
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]


# ---------------------------------------------------------------- no silent overwrite
def test_an_existing_checkpoint_is_not_overwritten_unasked(tmp_path, data):
    path = tmp_path / "c.pt"
    model, guide = _build()
    pb.fit(model, guide, data, checkpoint=path, **dict(_FIT, epochs=3))
    before = path.read_bytes()
    model2, guide2 = _build()
    with pytest.raises(FileExistsError, match=r"already exists.*resume=True.*overwrite=True"):
        pb.fit(model2, guide2, data, checkpoint=path, **_FIT)
    assert path.read_bytes() == before and not list(guide2.parameters())
    with pytest.raises(ValueError, match="pass one"):
        pb.fit(model2, guide2, data, checkpoint=path, resume=True, overwrite=True, **_FIT)
    with pytest.raises(ValueError, match="overwrite=True needs checkpoint"):
        pb.fit(model2, guide2, data, overwrite=True, **_FIT)
    assert path.read_bytes() == before
    pb.fit(model2, guide2, data, checkpoint=path, overwrite=True, **dict(_FIT, epochs=1))
    assert torch.load(path, weights_only=True)["epoch"] == 1


# ---------------------------------------------------------------- resume onto another fit
def _resume_variant(variant, data):
    x, y = data
    if variant == "prior":
        return (*_build(prior=pb.priors.IIDNormal(0.1)), data)
    if variant == "activation":
        return (*_build(act=nn.Tanh), data)
    if variant == "scale_parameterization":
        return (*_build(scale_parameterization="softplus"), data)
    if variant == "init_scale":
        return (*_build(init_scale=0.1), data)
    if variant == "x":
        x = x.clone()
        x[0, 0] += 1.0  # one value (element 0 is among the hashed ones)
        return (*_build(), (x, y))
    if variant == "y":
        return (*_build(), (x, y.flip(0)))
    raise AssertionError(variant)


@pytest.mark.parametrize("variant, message", [
    ("prior", r"prior IIDNormal\(loc=0.0, scale=1.0\) on net.0.weight there, "
              r"IIDNormal\(loc=0.0, scale=0.1\) now"),
    ("activation", r"architecture: \(1\): PyroReLU\(\) there, \(1\): PyroTanh\(\) now"),
    ("scale_parameterization", r"guide option scale_parameterization 'exp' there, 'softplus' now"),
    ("init_scale", r"guide option init_scale 0.01 there, 0.1 now"),
    ("x", r"data tensor 0: torch.float32 \(64, 8\) sha256 \w+ there, torch.float32 \(64, 8\) sha256 \w+ now"),
    ("y", r"data tensor 1: torch.int64 \(64,\)"),
])
def test_resume_onto_another_fit_is_refused(tmp_path, data, variant, message):
    path = tmp_path / "c.pt"
    model, guide = _build()
    pb.fit(model, guide, data, checkpoint=path, **_FIT)
    before = path.read_bytes()
    model2, guide2, data2 = _resume_variant(variant, data)
    with pytest.raises(ValueError, match=message):
        pb.fit(model2, guide2, data2, checkpoint=path, resume=True, **_FIT)
    assert path.read_bytes() == before
    model3, guide3 = _build()  # the same fit resumes (nothing left to do at epoch 2)
    assert pb.fit(model3, guide3, data, checkpoint=path, resume=True, **_FIT).resumed_from == 2


def test_resume_does_not_restore_the_checkpoints_prior(tmp_path, data):
    """The prior is in the model's state_dict: before, a resume loaded the checkpoint's prior
    over the one the code asks for.  Now that is the refused case above; an equal prior
    resumes and stays equal."""
    path = tmp_path / "c.pt"
    model, guide = _build(prior=pb.priors.IIDNormal(0.5))
    pb.fit(model, guide, data, checkpoint=path, **_FIT)
    model2, guide2 = _build(prior=pb.priors.IIDNormal(0.5))
    pb.fit(model2, guide2, data, checkpoint=path, resume=True, **_FIT)
    assert float(model2.priors["net__0__weight"].scale) == 0.5


def _guides():
    torch.manual_seed(0)
    model = pb.BNN(mlp(8, 6, 3))
    return model, {"meanfield": pb.guides.MeanField(model, kl_annealing=5),
                   "laplace": pb.guides.Laplace(model, structure="kron"),
                   "autonormal": AutoNormal(model),
                   "hypernet": pb.guides.Hypernet(model, num_flows=1, hidden=8, full=True)}


@pytest.mark.parametrize("name", ["meanfield", "laplace", "autonormal", "hypernet"])
def test_the_fingerprint_is_what_was_fitted_not_its_state(data, name):
    """A fit does not change its own fingerprint (else a resume in the same process, onto the
    same objects, would be refused), and it records the guide's options."""
    model, guides = _guides()
    guide = guides[name]
    kw = {"marglik": pb.MarglikOptions(every=1, burnin=0, steps=2)} if name == "laplace" else {}
    pb.fit(model, guide, data, epochs=1, batch_size=32, progress=False, **kw)
    before = fit_fingerprint(model, guide, data)
    pb.fit(model, guide, data, epochs=2, batch_size=32, progress=False, **kw)
    assert fit_fingerprint(model, guide, data) == before
    assert before["guide"]["class"].endswith(type(guide).__name__)
    expected = {"meanfield": {"kl_annealing": "5", "scale_parameterization": "'exp'", "init_scale": "0.01"},
                "laplace": {"structure": "'kron'"}, "autonormal": {}, "hypernet": {"num_flows": "1", "hidden": "8"}}
    assert expected[name].items() <= before["guide"].items()


# ---------------------------------------------------------------- corruption, crafted files
def _written(tmp_path, data):
    path = tmp_path / "c.pt"
    model, guide = _build()
    pb.fit(model, guide, data, checkpoint=path, **_FIT)
    return path, model, guide


def test_a_flipped_bit_in_a_tensor_is_detected(tmp_path, data):
    path, model, guide = _written(tmp_path, data)
    raw = bytearray(path.read_bytes())
    weights = model.state_dict()  # MeanField keeps the network's weights as the means
    loc = guide.state_dict()[next(k for k in guide.state_dict() if "loc" in k)]
    at = raw.find(loc.numpy().tobytes())
    assert at > 0, sorted(weights)
    raw[at + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    model2, guide2 = _build()
    with pytest.raises(ValueError, match="is corrupt: its content does not match the SHA-256 digest"):
        pb.load_checkpoint(path, model2, guide2, example_x=data[0][:2])
    with pytest.raises(ValueError, match="is corrupt"):
        pb.fit(model2, guide2, data, checkpoint=path, resume=True, **_FIT)


@pytest.mark.slow
def test_no_flipped_bit_gives_another_content(tmp_path, data):
    """200 bytes spread over the file flipped in turn: each read either fails with a clear
    ValueError or returns exactly the content that was written (a byte torch ignores)."""
    path, _, _ = _written(tmp_path, data)
    raw = path.read_bytes()
    original = content_digest({k: v for k, v in torch.load(path, weights_only=True).items() if k != "checksum"})
    bad = tmp_path / "bad.pt"
    failed = same = 0
    for at in range(0, len(raw), max(len(raw) // 200, 1)):
        flipped = bytearray(raw)
        flipped[at] ^= 0x04
        bad.write_bytes(bytes(flipped))
        try:
            state = pb.training.checkpoint.read_checkpoint(bad)
        except ValueError as exc:
            assert str(bad) in str(exc)
            failed += 1
            continue
        assert content_digest({k: v for k, v in state.items() if k != "checksum"}) == original, at
        same += 1
    assert failed > 0.5 * (failed + same), (failed, same)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("history"), r"missing 'history'"),
    (lambda s: s.pop("optimizer"), r"missing 'optimizer'"),
    (lambda s: s["resume"].pop("rng"), r"missing 'resume'\['rng'\]"),
    (lambda s: s["resume"].pop("fingerprint"), r"missing 'resume'\['fingerprint'\]"),
    (lambda s: s.update(epoch=-1), r"'epoch' must be an int >= 0, got -1"),
    (lambda s: s.update(epoch=1.5), r"'epoch' must be an int >= 0, got 1.5"),
    (lambda s: s.update(epoch=5), r"'history' has 2 epochs of loss, 'epoch' is 5"),
    (lambda s: s.update(format="pyro_bnn.fit/2"), r"has format 'pyro_bnn.fit/2'"),
])
def test_a_crafted_checkpoint_is_a_clear_error(tmp_path, data, edit, message):
    """A file with a valid digest but missing or impossible entries: ValueError naming them."""
    path, _, _ = _written(tmp_path, data)
    state = torch.load(path, weights_only=True)
    state.pop("checksum")
    edit(state)
    write_atomic(path, state)
    model, guide = _build()
    with pytest.raises(ValueError, match=message):
        pb.fit(model, guide, data, checkpoint=path, resume=True, **dict(_FIT, epochs=6))


def test_a_checksum_key_is_reserved(tmp_path, data):
    model, guide = _build()
    with pytest.raises(ValueError, match="'checksum' is reserved"):
        pb.save_checkpoint(tmp_path / "c.pt", model, guide, checksum="mine")


# ---------------------------------------------------------------- fit's options
def _half_negative(fraction):
    return 1.0 - 2.0 * fraction


@pytest.mark.parametrize("kwargs, error, match", [
    ({"lr": 0.1, "optimizer": lambda p: torch.optim.SGD(p, lr=0.01)}, ValueError, r"fit cannot pass lr"),
    ({"lr_schedule": lambda f: -1.0}, ValueError, r"lr_schedule returned -1.0 at fraction 0 "),
    ({"lr_schedule": _half_negative}, ValueError, r"returned -0.03125 at fraction 0.5156"),
    ({"lr_schedule": lambda f: math.nan}, ValueError, r"returned nan"),
    ({"lr_schedule": lambda f: "1"}, TypeError, r"lr_schedule must return a number, got '1'"),
    ({"shuffle": "no"}, TypeError, r"shuffle must be True or False, got 'no' \(str\)"),
    ({"progress": 1}, TypeError, r"progress must be True, False or a callable progress\(epoch, epochs, "
                                  r"loss\), got 1 \(int\)"),
    ({"overwrite": "yes", "checkpoint": "x.pt"}, TypeError, r"overwrite must be True or False"),
    ({"epochs": 2.5}, TypeError, r"epochs must be an int >= 0, got 2.5 \(float\)"),
    ({"batch_size": 32.0}, TypeError, r"batch_size must be an int >= 1, got 32.0 \(float\)"),
    ({"num_particles": 2.5}, TypeError, r"num_particles must be an int >= 1, got 2.5"),
    ({"marglik": {"burnin": 1}}, TypeError, r"marglik must be a pyro_bnn.MarglikOptions or None, got dict"),
    ({"checkpoint": 123}, TypeError, r"checkpoint must be a path"),
    ({"num_data": 10}, ValueError, r"num_data=10 is smaller than one minibatch \(32 examples\)"),
])
def test_fit_options_are_checked_before_anything_is_set_up(data, kwargs, error, match):
    model, guide = _build()
    with pytest.raises(error, match=match):
        pb.fit(model, guide, data, **{**_FIT, **kwargs})
    assert not list(guide.parameters())


def test_a_schedule_going_negative_during_training_is_stopped(data):
    """A schedule that passes the 64 checked fractions but is negative elsewhere: the first
    negative factor during training is an error, before a step uphill is taken."""
    def sneaky(fraction):
        return 1.0 if (fraction * 64).is_integer() else -1.0

    model, guide = _build()
    with pytest.raises(ValueError, match=r"returned -1.0 at fraction 0.1667 "):
        pb.fit(model, guide, data, **dict(_FIT, batch_size=24, lr_schedule=sneaky))  # 6 steps


def test_numpy_bools_and_ints_are_accepted(data):
    model, guide = _build()
    result = pb.fit(model, guide, data, **dict(_FIT, shuffle=np.bool_(False), epochs=np.int64(1),
                                                 batch_size=np.int32(32)))
    assert len(result.history["loss"]) == 1
    every = pb.MarglikOptions(every=np.int64(2)).every
    assert every == 2 and type(every) is int


def test_a_flipped_bit_in_the_digests_name_is_detected(tmp_path, data):
    """Without this, one flipped bit in the key "checksum" would skip the verification."""
    path, model, guide = _written(tmp_path, data)
    raw = path.read_bytes()
    at = raw.find(b"checksum")
    assert at > 0
    path.write_bytes(raw[:at] + b"chdcksum" + raw[at + 8:])
    with pytest.raises(ValueError, match="has an entry 'chdcksum' where its digest 'checksum' belongs"):
        pb.load_checkpoint(path, model, guide)


def test_a_fit_checkpoint_without_its_digest_is_not_resumed(tmp_path, data):
    path, _, _ = _written(tmp_path, data)
    state = torch.load(path, weights_only=True)
    state.pop("checksum")
    torch.save(state, path)
    model, guide = _build()
    with pytest.raises(ValueError, match=r"not a complete pyro_bnn fit checkpoint: missing 'checksum'"):
        pb.fit(model, guide, data, checkpoint=path, resume=True, **_FIT)


def test_the_data_hash_of_a_large_tensor_stays_in_range():
    """More elements than float32 counts exactly (Fashion-MNIST: 60,000 x 784 = 47,040,000):
    the evenly spaced indices must end at the last element, not one past it."""
    from pyro_bnn.training.resume import _tensor_hash

    big = torch.zeros(60_000 * 784, dtype=torch.uint8)
    first = _tensor_hash(big)
    big[-1] = 1                                   # the last element is among the hashed ones
    assert _tensor_hash(big) != first
