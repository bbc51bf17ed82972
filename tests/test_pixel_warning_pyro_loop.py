"""A ``pb.BNN`` warns itself about unscaled 0-255 pixels given by a Pyro user's own loop.

``pb.fit`` and the other entry points check their inputs (``tests/test_real_scale_habits.py``);
a user who trains with ``pyro.infer.SVI`` and predicts with ``pyro.infer.Predictive`` reaches
only the model, which now looks at its inputs once (its first training call, its first
prediction call: ``pyro_bnn/model/input_scale.py``), and stays silent when a caller has warned.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pyro
import pytest
import torch
import torch.nn as nn
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro_bnn as pb
import pyro_bnn.model.input_scale as input_scale
from pyro_bnn.model.input_scale import InputScaleWatch, end_input_watch

MESSAGE = r"^x given to pb\.BNN holds whole numbers from 0 to 255 \(its first \d+ examples\).*Divide by 255"


@pytest.fixture
def pixels():
    """Synthetic 8×8 images of whole numbers 0-255 (what ``x.float()`` of bytes gives) and labels."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (128, 64), generator=gen).float()
    return x, torch.randint(0, 10, (128,), generator=gen)


def _model():
    return pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)), "categorical")


def _pixel_warnings(rec):
    return [w for w in rec if issubclass(w.category, pb.UnscaledPixelsWarning)]


def _svi_steps(model, guide, x, y, *, loss=None, steps=5, batch=32):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=loss if loss is not None else Trace_ELBO())
    for i in range(steps):
        rows = slice(i * batch % len(x), i * batch % len(x) + batch)
        svi.step(x[rows], y[rows], num_data=len(x))


@pytest.mark.parametrize("objective", ["Trace_ELBO", "guide"])
def test_own_svi_loop_on_raw_pixels_warns_once_at_the_users_line(objective, pixels):
    """Trace_ELBO runs model.forward; the guide's own objective skips it (fast path), so it looks
    itself once the guide is set up (here on a dummy row of zeros, as ``load_state_dict`` does)."""
    x, y = pixels
    pyro.clear_param_store()
    model = _model()
    guide = pb.guides.MeanField(model)
    guide(torch.zeros(1, 64))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _svi_steps(model, guide, x, y, loss=guide.make_objective() if objective == "guide" else None)
    found = _pixel_warnings(rec)
    assert len(found) == 1, [str(w.message) for w in found]
    assert found[0].category is pb.UnscaledPixelsWarning
    assert Path(found[0].filename).name == Path(__file__).name      # the user's line, not Pyro's or ours
    assert re.match(MESSAGE, str(found[0].message))
    assert model.input_watch.warned


@pytest.mark.parametrize("parallel", [False, True])
def test_predictive_on_raw_pixels_warns(parallel, pixels):
    x, y = pixels
    pyro.clear_param_store()
    model = _model()
    guide = pb.guides.MeanField(model)
    _svi_steps(model, guide, x / 255, y, steps=2)        # trained on scaled inputs: silent
    predictive = Predictive(model, guide=guide, num_samples=3, parallel=parallel)
    with pytest.warns(pb.UnscaledPixelsWarning, match=MESSAGE) as rec:
        predictive(x)                                     # ... then given 0-255 test inputs
        predictive(x)
    assert len(_pixel_warnings(rec)) == 1
    assert Path(_pixel_warnings(rec)[0].filename).name == Path(__file__).name


@pytest.mark.parametrize("scale", [lambda x: x / 255, lambda x: torch.round(x / 16)])  # [0, 1]; raw digits 0-15
def test_scaled_inputs_are_not_warned(scale, pixels):
    x, y = pixels
    x = scale(x)
    pyro.clear_param_store()
    model = _model()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        _svi_steps(model, guide, x, y, steps=3)
        Predictive(model, guide=guide, num_samples=2)(x)
    assert not model.input_watch.warned
    assert model.input_watch.looking == [False, False]   # looked at once each, then done


@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
@pytest.mark.parametrize("guide_kind", ["MeanField", "AutoNormal"])
def test_fit_on_raw_pixels_warns_once(guide_kind, pixels):
    """pb.fit warns (its BatchCheck) and tells the model, whose own look (forward runs every
    step under Pyro's AutoNormal) then stays silent, in the fit and after it."""
    x, y = pixels
    pyro.clear_param_store()
    model = _model()
    guide = pb.guides.MeanField(model) if guide_kind == "MeanField" else AutoNormal(model)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pb.fit(model, guide, (x, y), epochs=2, batch_size=32, progress=False)
        Predictive(model, guide=guide, num_samples=2)(x)
    found = _pixel_warnings(rec)
    assert [str(w.message)[:16] for w in found] == ["x holds whole nu"], [str(w.message) for w in found]
    assert model.input_watch.warned and model.input_watch.looking == [False, False]


@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
def test_fit_of_a_hand_written_model_still_warns(pixels):
    """A PyroModule that is not a pb.BNN holds no watch: pb.fit's own check warns, once."""
    x, y = pixels

    class Net(PyroModule):
        def __init__(self):
            super().__init__()
            self.layer = PyroModule[nn.Linear](64, 10)
            self.layer.weight = PyroSample(pyro.distributions.Normal(0.0, 1.0).expand([10, 64]).to_event(2))

        def forward(self, x, y=None, num_data=None):
            logits = self.layer(x)
            with pyro.plate("data", num_data or len(x), subsample_size=len(x)):
                pyro.sample("obs", pyro.distributions.Categorical(logits=logits), obs=y)
            return logits

    pyro.clear_param_store()
    model = Net()
    end_input_watch(model)                                 # no watch: the model is marked (for its guides), no error
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pb.fit(model, pb.guides.MeanField(model), (x, y), epochs=1, batch_size=64, progress=False)
    assert [str(w.message)[:16] for w in _pixel_warnings(rec)] == ["x holds whole nu"]


def test_the_look_runs_once_per_kind_of_call_not_per_step(pixels, monkeypatch):
    x, y = pixels
    calls = []
    real = input_scale.looks_like_unscaled_pixels
    monkeypatch.setattr(input_scale, "looks_like_unscaled_pixels", lambda t: calls.append(len(t)) or real(t))
    pyro.clear_param_store()
    model = _model()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        for _ in range(50):
            model(x / 255, y, num_data=len(x))
        _svi_steps(model, guide, x / 255, y, steps=5)
        _svi_steps(model, guide, x / 255, y, steps=5, loss=guide.make_objective())
        assert len(calls) == 1                             # the first training call only
        for _ in range(20):
            model(x / 255)
        Predictive(model, guide=guide, num_samples=3)(x / 255)
    assert len(calls) == 2                                 # and the first prediction call
    model(x, y)                                            # later raw pixels are not looked at: a flag test
    assert len(calls) == 2


def test_a_dummy_input_of_zeros_does_not_use_up_the_look(pixels):
    """Guides set up without data run the model on one row of zeros (pb.model.bnn.example_input)."""
    x, _ = pixels
    model = _model()
    model(torch.zeros(1, 64))
    assert model.input_watch.looking == [True, True]
    with pytest.warns(pb.UnscaledPixelsWarning, match=MESSAGE):
        model(x)
    assert model.input_watch.looking == [False, False]


def test_the_watch_and_the_public_names():
    watch = InputScaleWatch("x given to this")
    watch.see(torch.full((3, 64), 0.5), prediction=True)
    assert watch.looking == [True, False] and not watch.warned
    with pytest.warns(pb.UnscaledPixelsWarning, match=r"^x given to this holds whole numbers from 0 to 200"):
        watch.see(torch.cat([torch.zeros(2, 64), torch.full((1, 64), 200.0)]), prediction=False)
    assert watch.warned and watch.looking == [False, False]
    model = _model()
    end_input_watch(model)
    assert model.input_watch.warned and model.input_watch.looking == [False, False]
    from pyro_bnn.model import UnscaledPixelsWarning
    assert pb.UnscaledPixelsWarning is UnscaledPixelsWarning is input_scale.UnscaledPixelsWarning  # one home
    assert not hasattr(pb.data, "UnscaledPixelsWarning")
