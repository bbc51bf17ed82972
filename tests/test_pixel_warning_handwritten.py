"""A pyro_bnn guide warns about unscaled 0-255 pixels given to a hand-written model.

A ``pb.BNN`` looks at its own inputs (``tests/test_pixel_warning_pyro_loop.py``).  A user's own
``PyroModule`` cannot, but our guides (``BNNGuide``: MeanField, Symmetrized, Hypernet, Laplace)
receive the model's arguments at every ``svi.step`` and ``Predictive`` call, and look at ``x``
in their first call with targets and their first without (``BNNGuide.watch_inputs``,
``pyro_bnn/model/input_scale.py``).  ``pb.fit`` / ``pb.predict`` warn through their own data
check and mark the model, so the guide stays silent there: one warning per fit.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.nn import PyroModule, PyroSample

import pyro_bnn as pb
import pyro_bnn.model.input_scale as input_scale
from pyro_bnn.model.input_scale import end_input_watch, inputs_warned

GUIDE_MESSAGE = (r"^x given to the model of this {} guide holds whole numbers from 0 to 255 "
                 r"\(its first \d+ examples\).*Divide by 255")


class Net(PyroModule):
    """A user's own model: ``forward(x, y=None)``, PyroSample weights, a data plate."""

    def __init__(self):
        super().__init__()
        self.layer = PyroModule[nn.Linear](64, 10)
        self.layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 64]).to_event(2))
        self.layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([10]).to_event(1))

    def forward(self, x, y=None):
        logits = self.layer(x)
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


@pytest.fixture
def pixels():
    """Synthetic 8×8 images of whole numbers 0-255 (what ``x.float()`` of bytes gives) and labels."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (128, 64), generator=gen).float()
    return x, torch.randint(0, 10, (128,), generator=gen)


def _guide(kind, model):
    if kind == "Hypernet":   # a flow over every latent site of a hand-written model
        return pb.guides.Hypernet(model, full=True)
    return {"MeanField": pb.guides.MeanField, "Symmetrized": pb.guides.Symmetrized,
            "Laplace": pb.guides.Laplace}[kind](model)


def _pixel_warnings(rec):
    return [w for w in rec if issubclass(w.category, pb.UnscaledPixelsWarning)]


def _fresh_meanfield():
    """A new hand-written model and its MeanField guide, on an empty param store."""
    pyro.clear_param_store()
    model = Net()
    return model, pb.guides.MeanField(model)


def _svi_steps(model, guide, x, y, steps=3):
    """A user's own loop, full batch (nothing to scale)."""
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)


@pytest.mark.parametrize("kind", ["MeanField", "Symmetrized", "Laplace", "Hypernet"])
def test_own_svi_loop_on_raw_pixels_warns_once_at_the_users_line(kind, pixels):
    x, y = pixels
    pyro.clear_param_store()
    model = Net()
    guide = _guide(kind, model)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _svi_steps(model, guide, x, y)
        Predictive(model, guide=guide, num_samples=2)(x)   # once per guide: not again
    found = _pixel_warnings(rec)
    assert len(found) == 1, [str(w.message) for w in found]
    assert found[0].category is pb.UnscaledPixelsWarning
    assert Path(found[0].filename).name == Path(__file__).name      # the user's line, not Pyro's or ours
    assert re.match(GUIDE_MESSAGE.format(kind), str(found[0].message)), str(found[0].message)
    assert guide.input_watch.warned


@pytest.mark.parametrize("kind", ["MeanField", "Laplace", "Hypernet"])
def test_the_guides_own_objective_under_svi_warns_once(kind, pixels):
    """``SVI(..., loss=guide.make_objective())`` reaches the guide through GuideObjective (the
    Laplace guide's MAP objective does not call the guide as Pyro does)."""
    x, y = pixels
    pyro.clear_param_store()
    model = Net()
    guide = _guide(kind, model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            svi.step(x, y)
    found = _pixel_warnings(rec)
    assert len(found) == 1 and Path(found[0].filename).name == Path(__file__).name, [str(w.message) for w in found]


def test_predictive_with_our_guide_on_raw_pixels_warns(pixels):
    x, y = pixels
    model, guide = _fresh_meanfield()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        _svi_steps(model, guide, x / 255, y)                 # trained on scaled inputs: silent
    predictive = Predictive(model, guide=guide, num_samples=3)
    with pytest.warns(pb.UnscaledPixelsWarning, match=GUIDE_MESSAGE.format("MeanField")) as rec:
        predictive(x)                                        # ... then given 0-255 test inputs
        predictive(x)
    assert len(_pixel_warnings(rec)) == 1
    assert Path(_pixel_warnings(rec)[0].filename).name == Path(__file__).name


@pytest.mark.parametrize("scale", [lambda x: x / 255, lambda x: torch.round(x / 16)])  # [0, 1]; raw digits 0-15
def test_scaled_inputs_are_not_warned(scale, pixels):
    x, y = pixels
    x = scale(x)
    model, guide = _fresh_meanfield()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        _svi_steps(model, guide, x, y)
        Predictive(model, guide=guide, num_samples=2)(x)
    assert not guide.input_watch.warned
    assert guide.input_watch.looking == [False, False]       # looked at once each, then done


def test_the_look_runs_once_per_kind_of_call_not_per_step(pixels, monkeypatch):
    x, y = pixels
    calls = []
    real = input_scale.looks_like_unscaled_pixels
    monkeypatch.setattr(input_scale, "looks_like_unscaled_pixels", lambda t: calls.append(len(t)) or real(t))
    model, guide = _fresh_meanfield()
    _svi_steps(model, guide, x / 255, y, steps=10)
    assert calls == [len(x)]                                 # the first training call only
    Predictive(model, guide=guide, num_samples=5)(x / 255)
    assert calls == [len(x), len(x)]                         # and the first prediction call
    _svi_steps(model, guide, x, y, steps=2)                  # later raw pixels: a flag test, no look
    assert len(calls) == 2


@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
def test_fit_and_predict_of_a_hand_written_model_warn_once(pixels):
    """pb.fit's data check warns and marks the model (end_input_watch), so the guide, called
    by fit and by the user's Predictive afterwards, stays silent."""
    x, y = pixels
    model, guide = _fresh_meanfield()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pb.fit(model, guide, (x, y), epochs=2, batch_size=32, progress=False)
        Predictive(model, guide=guide, num_samples=2)(x)
    found = _pixel_warnings(rec)
    assert [str(w.message)[:16] for w in found] == ["x holds whole nu"], [str(w.message) for w in found]
    assert inputs_warned(model)
    assert guide.input_watch.looking == [False, False] and not guide.input_watch.warned


@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
def test_predict_on_raw_pixels_after_a_scaled_fit_warns_once(pixels):
    """pb.predict calls the guide without targets (a prediction look): its own check has warned."""
    x, y = pixels
    model, guide = _fresh_meanfield()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        pb.fit(model, guide, (x / 255, y), epochs=1, batch_size=64, progress=False)
    assert guide.input_watch.looking == [False, True]        # the fit's set-up call was looked at
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pb.predict(model, guide, x, num_samples=2)
        Predictive(model, guide=guide, num_samples=2)(x)
    found = _pixel_warnings(rec)
    assert [str(w.message)[:28] for w in found] == ["x in pb.predict holds whole "], [str(w.message) for w in found]
    assert guide.input_watch.looking == [False, False] and not guide.input_watch.warned


def test_a_bnn_under_our_guide_in_an_svi_loop_warns_once(pixels):
    """A pb.BNN watches itself; its guide's watch ends at its first call."""
    x, y = pixels
    pyro.clear_param_store()
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=Trace_ELBO())
        for _ in range(3):
            svi.step(x, y, num_data=len(x))
        Predictive(model, guide=guide, num_samples=2)(x)
    found = _pixel_warnings(rec)
    assert [str(w.message)[:22] for w in found] == ["x given to pb.BNN hold"], [str(w.message) for w in found]
    assert model.input_watch.warned
    assert guide.input_watch.looking == [False, False] and not guide.input_watch.warned


def test_a_model_of_other_arguments_is_not_watched_and_nothing_raises(pixels):
    """The watch reads the model's arguments as (x, y, num_data); others end it, silently."""
    x, y = pixels

    class Four(Net):
        def forward(self, a, b, c, d):
            return super().forward(a, d)

    pyro.clear_param_store()
    model = Four()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        guide(x, None, None, y)
    assert guide.input_watch.looking == [False, False] and not guide.input_watch.warned


def test_end_input_watch_marks_a_hand_written_model():
    model = Net()
    assert not inputs_warned(model) and not inputs_warned(None) and not inputs_warned(lambda x: x)
    end_input_watch(model)
    assert inputs_warned(model)
    assert "_pyro_bnn_inputs_warned" not in model.state_dict()
    end_input_watch(None)                                    # nothing to mark: no error
    end_input_watch((1, 2))
