"""pb.fit loses nothing and absorbs no mistake: divergence guard, exact resume after SIGKILL,
safe and all-or-nothing checkpoints, strict arguments (issue 15)."""

import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import mlp
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_convergence_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        yield


@pytest.fixture(scope="module")
def data():
    d = pb.datasets.digits()
    return d.x_train[:256], d.y_train[:256]


def _finite(*modules):
    return all(bool(torch.isfinite(v).all()) for m in modules for v in m.state_dict().values()
               if v.is_floating_point())


def _meanfield(seed=0, hidden=16, **kw):
    torch.manual_seed(seed)
    model = pb.BNN(mlp(64, hidden, 10))
    return model, pb.guides.MeanField(model, **kw)


def _same(a, b) -> bool:
    """Exact equality of nested lists of floats, NaN equal to NaN."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b or (a != a and b != b)


def _states(*modules):
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]


def _equal(states, modules):
    return all(torch.equal(a[k], v) for a, m in zip(states, modules) for k, v in m.state_dict().items())


class _NaNGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss with non-finite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


def _objective_with(guide, bad_call, transform):
    """The guide's objective, with ``transform`` applied to the loss of call ``bad_call``."""
    inner = guide.make_objective()
    calls = {"n": 0}

    def objective(model, guide, x, y, num_data=None):
        calls["n"] += 1
        loss = inner(model, guide, x, y, num_data)
        return transform(loss) if calls["n"] == bad_call else loss

    return objective


# ---------------------------------------------------------------- divergence guard
def test_hypernet_lr100_stops_finite(tmp_path, data):
    """Issue 15 repro: finite loss, infinite gradients; nothing non-finite is kept or written."""
    x, y = data
    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 32, 10), weight_norm=True)
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=32)
    path = tmp_path / "c.pt"
    with pytest.warns(RuntimeWarning, match="the training loss exploded"), \
            pytest.raises(FloatingPointError, match=r"in epoch \d+ \(step \d+\).*restored to"):
        pb.fit(model, guide, (x, y), epochs=15, batch_size=len(x), lr=100, lr_schedule="constant", seed=0,
               checkpoint=path, progress=False)
    assert _finite(model, guide)
    if path.exists():
        state = torch.load(path, weights_only=True)
        assert all(bool(torch.isfinite(v).all()) for s in (state["model"], state["guide"]) for v in s.values()
                   if v.is_floating_point())


def test_meanfield_lr100_restores_a_state_whose_loss_is_finite(data):
    """Issue 15: ρ = 93 is finite but σ = exp(ρ) overflows; the state restored must evaluate."""
    x, y = data
    model, guide = _meanfield()
    with pytest.raises(FloatingPointError, match="restored to the start of the fit"):
        pb.fit(model, guide, (x, y), epochs=15, batch_size=len(x), lr=100, lr_schedule="constant", seed=0,
               progress=False)
    from pyro_bnn.contract.local_params import local_params

    with local_params(model, guide):
        loss = guide.make_objective()(model, guide, x, y, len(x))
    assert math.isfinite(loss.item())


def test_autonormal_lr10_is_restored_not_left_nan(data):
    """Pyro's own guide: previously Pyro's ValueError with NaN parameters left behind."""
    x, y = data
    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 32, 10))
    guide = AutoNormal(model)
    # the loss explodes (4.9e3 to 4.5e6 in epoch 2) before it becomes NaN: warned, then restored
    with pytest.warns(UserWarning, match="Encountered NaN"), \
            pytest.warns(RuntimeWarning, match="exploded in epoch 2"), \
            pytest.raises(FloatingPointError, match="restored to"):
        pb.fit(model, guide, (x, y), epochs=15, batch_size=len(x), lr=10, lr_schedule="constant", seed=0,
               progress=False)
    assert _finite(model, guide)


@pytest.mark.parametrize("where", ["epoch", "fit"])
def test_nan_gradient_at_last_step_is_caught(tmp_path, data, where):
    """A NaN gradient with a finite loss at the last step of an epoch (then the checkpoint keeps
    the previous epoch) or of the whole fit (previously returned normally with NaN parameters)."""
    x, y = data
    steps = 4  # 256 / 64
    epochs = 3
    bad_epoch = 2 if where == "epoch" else 3
    model, guide = _meanfield()
    path = tmp_path / "c.pt"
    objective = _objective_with(guide, bad_epoch * steps, _NaNGradient.apply)
    with pytest.raises(FloatingPointError, match=rf"gradient norm became nan.*epoch {bad_epoch} \(step {steps}\)"
                                                 rf".*end of epoch {bad_epoch - 1}"):
        pb.fit(model, guide, (x, y), epochs=epochs, lr=1e-2, seed=0, objective=objective, checkpoint=path,
               progress=False)
    assert _finite(model, guide)
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == bad_epoch - 1


def test_gradient_whose_square_overflows_is_caught(data):
    """A finite loss (about 1e33) whose gradients exceed √(float32 max): Adam's second moment
    would overflow to inf, so the step is refused."""
    x, y = data
    model, guide = _meanfield()
    objective = _objective_with(guide, 6, lambda loss: loss * 1e30)
    with pytest.raises(FloatingPointError, match=r"gradient norm.*epoch 2 \(step 2\).*end of epoch 1"):
        pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, seed=0, objective=objective, progress=False)
    assert _finite(model, guide)


def test_non_finite_parameter_from_an_epoch_hook(tmp_path, data):
    """A hook that writes NaN (as a failed evidence step could) is caught before the state is
    kept or checkpointed; the restored state is the previous epoch's."""
    x, y = data

    class BadHook(pb.guides.MeanField):
        def on_epoch_end(self, ctx):
            if ctx.epoch == 2:
                with torch.no_grad():
                    self.loc_and_raw_scale("net.0.weight")[0][0, 0] = math.nan

    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 16, 10))
    guide = BadHook(model)
    path = tmp_path / "c.pt"
    with pytest.raises(FloatingPointError, match=r"guide locs.net.0.weight_unconstrained.*epoch 2;.*end of "
                                                 r"epoch 1"):
        pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, seed=0, checkpoint=path, progress=False)
    assert _finite(model, guide)
    assert torch.load(path, weights_only=True)["epoch"] == 1


#: epoch losses of a Symmetrized fit of the Fashion-MNIST CNN that diverged to chance accuracy
#: (2026-12-03; the same curve as tests/test_convergence.py's), first 6 epochs
_DIVERGED_CNN_EPOCHS = [98181.8, 134512.6, 161470.0, 476190.5, 8881235.9, 228294.3]


def test_explosion_warning_fires_on_a_real_divergence_and_not_on_a_slow_start():
    from pyro_bnn.training.divergence import DivergenceGuard
    param = torch.zeros(1, requires_grad=True)

    def watch(losses):
        guard = DivergenceGuard(None, None, None, None, [param])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for epoch, loss in enumerate(losses, 1):
                guard.watch_loss(epoch, loss)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    warned = watch(_DIVERGED_CNN_EPOCHS)
    assert len(warned) == 1 and "exploded in epoch 5" in warned[0]
    # a loss that rises by up to ten times its best (a KL warm-up, a bumpy start) is not an explosion
    assert watch([1.0e5, 4.0e4, 3.0e4, 3.2e4, 2.9e5, 3.0e4]) == []
    assert watch([-5.0, -2.0, 40.0]) == []   # near zero the scale is at least 1


def test_exploding_finite_loss_warns(data):
    x, y = data
    model, guide = _meanfield()
    inner = guide.make_objective()
    calls = {"n": 0}

    def objective(model, guide, x, y, num_data=None):
        calls["n"] += 1
        loss = inner(model, guide, x, y, num_data)
        return loss * 1e12 if calls["n"] > 8 else loss  # epochs 3 and 4

    with pytest.warns(RuntimeWarning, match="exploded in epoch 3"):
        pb.fit(model, guide, (x, y), epochs=4, lr=1e-2, seed=0, objective=objective, progress=False)


def test_non_finite_initial_state_is_a_clear_error(data):
    x, y = data
    model, guide = _meanfield(init_scale=math.inf)
    with pytest.raises(ValueError, match="non-finite values before training.*scales"):
        pb.fit(model, guide, (x, y), epochs=1, progress=False)


# ---------------------------------------------------------------- exact resume
_CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_training_reliability import build_resumable
    model, guide, data, kwargs = build_resumable({kind!r})
    inner = guide.make_objective()
    calls = {{"n": 0}}
    def killing_objective(*args, **kw):
        calls["n"] += 1
        if calls["n"] == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(*args, **kw)
    guide.make_objective = lambda num_particles=1: killing_objective
    import pyro_bnn as pb
    pb.fit(model, guide, data, checkpoint={path!r}, **kwargs)
""")


def build_resumable(kind):
    """Model, guide, data and fit arguments of the resume test (also run in the child)."""
    d = pb.datasets.digits()
    data = (d.x_train[:200], d.y_train[:200])  # 4 steps per epoch of 50
    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 12, 10))
    kwargs = dict(epochs=6, batch_size=50, seed=0, progress=False)
    if kind == "meanfield":
        guide = pb.guides.MeanField(model, init_scale=0.05, kl_annealing=3)
        kwargs.update(lr=1e-2, lr_schedule="cosine")
    else:
        guide = pb.guides.Laplace(model, structure="kron")
        kwargs.update(lr=1e-2, marglik=pb.MarglikOptions(every=1, burnin=1, steps=5, lr=0.1))
    return model, guide, data, kwargs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["meanfield", "laplace"])
def test_resume_after_sigkill_is_bit_identical(tmp_path, kind):
    """A fit killed (SIGKILL) in epoch 4 and resumed from its checkpoint ends bit-identical to
    the uninterrupted fit: parameters, buffers, history (MeanField with cosine schedule and KL
    annealing; Laplace with online marginal likelihood)."""
    path = tmp_path / "run.pt"
    code = _CHILD.format(tests=str(ROOT / "tests"), kind=kind, kill_at=3 * 4 + 3, path=str(path))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert torch.load(path, weights_only=True)["epoch"] == 3  # written at step 1 of epoch 4

    model, guide, data, kwargs = build_resumable(kind)
    reference = pb.fit(model, guide, data, **kwargs)

    model2, guide2, data2, kwargs2 = build_resumable(kind)
    torch.manual_seed(123)  # the resumed process's own random state does not matter
    resumed = pb.fit(model2, guide2, data2, checkpoint=path, resume=True, **kwargs2)
    assert resumed.resumed_from == 3
    for a, b in ((model, model2), (guide, guide2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    for key, values in reference.history.items():
        if key != "epoch_seconds":
            assert _same(resumed.history[key], values), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]  # no temporary or lock file left


def test_resume_restores_a_loaders_own_generator(tmp_path, data):
    """A DataLoader shuffling with its own torch.Generator: its state is in the checkpoint, so
    the resumed fit sees the same data order (in-process interruption by KeyboardInterrupt)."""
    x, y = data

    def build():
        model, guide = _meanfield()
        gen = torch.Generator().manual_seed(5)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True,
                                             generator=gen)
        return model, guide, loader

    kwargs = dict(epochs=5, lr=1e-2, seed=0, progress=False)
    model, guide, loader = build()
    pb.fit(model, guide, loader, **kwargs)
    path = tmp_path / "r.pt"
    model2, guide2, loader2 = build()
    inner, calls = guide2.make_objective(), {"n": 0}

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3 * 4 + 2:  # epoch 4, step 2: the checkpoint holds epoch 3
            raise KeyboardInterrupt
        return inner(*args, **kw)

    guide2.make_objective = lambda num_particles=1: interrupted
    with pytest.raises(KeyboardInterrupt):
        pb.fit(model2, guide2, loader2, checkpoint=path, **kwargs)
    model3, guide3, loader3 = build()
    result = pb.fit(model3, guide3, loader3, checkpoint=path, resume=True, **kwargs)
    assert result.resumed_from == 3 and _equal(_states(model, guide), (model3, guide3))


def test_resume_settings_and_fresh_start(tmp_path, data):
    x, y = data
    path = tmp_path / "r.pt"
    model, guide = _meanfield()
    r = pb.fit(model, guide, (x, y), epochs=2, lr=1e-2, lr_schedule="constant", checkpoint=path, resume=True,
               progress=False)
    assert r.resumed_from == 0 and torch.load(path, weights_only=True)["epoch"] == 2  # no file: fresh
    r = pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, lr_schedule="constant", checkpoint=path, resume=True,
               progress=False)
    assert r.resumed_from == 2 and len(r.history["loss"]) == 3  # constant schedule: epochs may grow
    with pytest.raises(ValueError, match=r"other settings \(batch_size=64 there, 32 now"):
        pb.fit(model, guide, (x, y), epochs=3, batch_size=32, lr=1e-2, lr_schedule="constant", checkpoint=path,
               resume=True, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(epochs=3 there, 4 now"):
        pb.fit(model, guide, (x, y), epochs=4, lr=1e-2, lr_schedule="cosine", checkpoint=path, resume=True,
               progress=False)
    with pytest.raises(ValueError, match="resume=True needs checkpoint"):
        pb.fit(model, guide, (x, y), epochs=3, resume=True, progress=False)
    with pytest.raises(NotImplementedError, match="resume=True is not supported with distributed"):
        pb.fit(model, guide, (x, y), epochs=3, checkpoint=path, resume=True, distributed=True, progress=False)
    pb.save_checkpoint(tmp_path / "plain.pt", model, guide)
    with pytest.raises(ValueError, match="no resume information"):
        pb.fit(model, guide, (x, y), epochs=3, checkpoint=tmp_path / "plain.pt", resume=True, progress=False)


# ---------------------------------------------------------------- checkpoints
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_checkpoint_with_reduce_payload_is_not_executed(tmp_path, data):
    x, y = data
    model, guide = _meanfield()
    pb.fit(model, guide, (x, y), epochs=1, progress=False)
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "guide": guide.state_dict(), "x": _Payload(marker)}, evil)
    before = _states(model, guide)
    with pytest.raises(ValueError, match="refuses to unpickle"):
        pb.load_checkpoint(evil, model, guide)
    with pytest.raises(ValueError, match="refuses to unpickle"):
        pb.fit(model, guide, (x, y), epochs=2, checkpoint=evil, resume=True, progress=False)
    assert not marker.exists() and _equal(before, (model, guide))


def test_every_checkpoint_fit_writes_loads_weights_only(tmp_path, data):
    x, y = data
    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 12, 10))
    guides = {"meanfield": pb.guides.MeanField(model), "autonormal": AutoNormal(model),
              "laplace": pb.guides.Laplace(model)}
    for name, guide in guides.items():
        path = tmp_path / f"{name}.pt"
        kw = {"marglik": pb.MarglikOptions(every=1, burnin=0, steps=2)} if name == "laplace" else {}
        pb.fit(model, guide, (x, y), epochs=2, lr=1e-2, checkpoint=path, progress=False, **kw)
        state = torch.load(path, weights_only=True)
        assert state["epoch"] == 2 and "rng" in state["resume"], name


def test_failed_load_leaves_model_and_guide_untouched(tmp_path, data):
    x, y = data
    model, guide = _meanfield(hidden=16)
    pb.fit(model, guide, (x, y), epochs=1, progress=False)
    other_model, other_guide = _meanfield(seed=1, hidden=16)
    pb.fit(other_model, other_guide, (x, y), epochs=1, progress=False)
    path = tmp_path / "c.pt"
    state = {"model": other_model.state_dict(), "guide": dict(other_guide.state_dict())}
    state["guide"]["scales.net.2.bias_unconstrained"] = torch.zeros(3)  # the last entry does not fit
    torch.save(state, path)
    before = _states(model, guide)
    with pytest.raises(ValueError, match=r"scales.net.2.bias_unconstrained.*shape \(3,\).*nothing was loaded"):
        pb.load_checkpoint(path, model, guide)
    assert _equal(before, (model, guide))


def test_corrupt_checkpoints_and_missing_example_x(tmp_path, data):
    x, y = data
    model, guide = _meanfield()
    path = tmp_path / "c.pt"
    pb.fit(model, guide, (x, y), epochs=1, checkpoint=path, progress=False)
    raw = path.read_bytes()
    for name, content in (("truncated", raw[: len(raw) // 2]), ("empty", b""), ("garbage", b"not a checkpoint")):
        bad = tmp_path / f"{name}.pt"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="truncated, corrupt"):
            pb.load_checkpoint(bad, model, guide)
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a pyro_bnn checkpoint"):
        pb.load_checkpoint(tmp_path / "foreign.pt", model, guide)
    with pytest.raises(FileNotFoundError):
        pb.load_checkpoint(tmp_path / "missing.pt", model, guide)
    fresh_model, fresh_guide = _meanfield()
    with pytest.raises(ValueError, match="example_x"):
        pb.load_checkpoint(path, fresh_model, fresh_guide)
    pb.load_checkpoint(path, fresh_model, fresh_guide, example_x=x[:2], example_y=y[:2])
    assert _equal(_states(model, guide), (fresh_model, fresh_guide))


def test_interrupted_save_leaves_no_temporary_file(tmp_path, data, monkeypatch):
    """A save that fails part-way (here: torch.save raising) removes its temporary file and
    leaves the previous checkpoint as it was; a rejected entry writes nothing."""
    x, y = data
    model, guide = _meanfield()
    path = tmp_path / "c.pt"
    pb.fit(model, guide, (x, y), epochs=2, checkpoint=path, progress=False)
    assert list(tmp_path.iterdir()) == [path]
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"checkpoint\['note'\] is a object"):
        pb.save_checkpoint(path, model, guide, note=object())

    def failing_save(obj, fh):
        fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(pb.training.checkpoint.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        pb.save_checkpoint(path, model, guide)
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == before


# ---------------------------------------------------------------- strict arguments
@pytest.mark.parametrize("kwargs, error, match", [
    ({"epoch": 3}, TypeError, r"unexpected keyword argument 'epoch'; did you mean 'epochs'\?"),
    ({"learning_rate": 0.1}, TypeError, r"unexpected keyword argument 'learning_rate'"),
    ({"clip_norm": 0}, ValueError, r"clip_norm must be a finite number > 0, got 0"),
    ({"clip_norm": -1}, ValueError, r"clip_norm must be a finite number > 0, got -1"),
    ({"num_particles": 0}, ValueError, r"num_particles must be an int >= 1, got 0"),
    ({"num_particles": 1.5}, TypeError, r"num_particles must be an int >= 1, got 1.5 \(float\)"),
    ({"num_data": 0}, ValueError, r"num_data must be an int >= 1, got 0"),
    ({"batch_size": 0}, ValueError, r"batch_size must be an int >= 1, got 0"),
    ({"lr": 0.0}, ValueError, r"lr must be a finite number > 0, got 0.0"),
    ({"lr": math.nan}, ValueError, r"lr must be a finite number > 0, got nan"),
    ({"lr": "0.1"}, TypeError, r"lr must be a number > 0 or None, got '0.1' \(str\)"),
    ({"epochs": -1}, ValueError, r"epochs must be an int >= 0, got -1"),
    ({"epochs": 2.0}, TypeError, r"epochs must be an int >= 0, got 2.0 \(float\)"),
    ({"lr_schedule": "linear"}, ValueError, r"lr_schedule must be 'constant', 'cosine' or a callable"),
    ({"resume": "yes", "checkpoint": "x.pt"}, TypeError, r"resume must be True or False"),
])
def test_fit_rejects_bad_arguments(kwargs, error, match):
    model, guide = _meanfield()
    with pytest.raises(error, match=match):
        pb.fit(model, guide, (torch.randn(8, 64), torch.randint(0, 10, (8,))), progress=False, **kwargs)
    assert not list(guide.parameters())  # rejected before anything was set up


def test_epochs_zero_trains_nothing(data):
    x, y = data
    model, guide = _meanfield()
    pb.fit(model, guide, (x, y), epochs=1, progress=False)
    before = _states(model, guide)
    result = pb.fit(model, guide, (x, y), epochs=0, progress=False)
    assert result.history["loss"] == [] and _equal(before, (model, guide))
    assert not result.convergence.converged and "cannot judge" in result.convergence.reasons[0]


def test_one_checkpoint_write_per_epoch(tmp_path, data, monkeypatch):
    """Each epoch's checkpoint is written once (at the next epoch's first step, the last one
    after the final loss check): as many saves as epochs."""
    x, y = data
    calls = []
    real = pb.training.save_checkpoint
    monkeypatch.setattr(pb.training.loop, "save_checkpoint", lambda *a, **k: (calls.append(k["epoch"]), real(*a, **k)))
    model, guide = _meanfield()
    pb.fit(model, guide, (x, y), epochs=3, checkpoint=tmp_path / "c.pt", progress=False)
    assert calls == [1, 2, 3]


def test_fit_flushes_denormals_during_training_and_restores_the_mode(data):
    """pb.fit trains with CPU denormals flushed to zero (weights that decay into the denormal
    range otherwise slow every step several-fold: benchmarks/bench_denormal.py) and leaves the
    caller's mode as it was, whichever it was."""
    from pyro_bnn.guides.meanfield import MeanFieldELBO
    from pyro_bnn.training.devices import flushing_denormals

    x, y = data
    seen = []
    inner = MeanFieldELBO()

    def objective(model, guide, xb, yb, num_data):
        seen.append(flushing_denormals())
        return inner(model, guide, xb, yb, num_data)

    for before in (False, True):
        torch.set_flush_denormal(before)
        try:
            model = pb.BNN(nn.Sequential(nn.Linear(x.shape[1], 8), nn.ReLU(), nn.Linear(8, 10)), "categorical")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pb.ConvergenceWarning)
                pb.fit(model, pb.guides.MeanField(model), (x, y), epochs=1, progress=False, objective=objective)
            assert flushing_denormals() is before
        finally:
            torch.set_flush_denormal(False)
    assert seen and all(seen)
