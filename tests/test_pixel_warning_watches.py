"""The watches over unscaled 0-255 pixels given by a Pyro user's own loop.

``pb.fit`` and the other entry points check their inputs (``tests/test_real_scale_habits.py``);
a user who trains with ``pyro.infer.SVI`` and predicts with ``pyro.infer.Predictive`` reaches
only the model and the guide.  A ``pb.BNN`` looks at its own inputs (its first training call,
its first prediction call: ``pyro_bnn/model/input_scale.py``).  A user's own ``PyroModule``
cannot, but our guides (``BNNGuide``: MeanField, Symmetrized, Hypernet, Laplace) receive the
model's arguments at every ``svi.step`` and ``Predictive`` call and look at ``x`` in their first
call with targets and their first without (``BNNGuide.watch_inputs``).  Both stay silent when a
caller (``pb.fit``, ``pb.predict``) has warned: one warning per fit.

The tests shared by the two kinds of model are parametrised over ``KINDS``: ``"bnn"`` (the
model's own watch) and ``"handwritten"`` (the guide's watch of :class:`Net`).
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
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro_bnn as pb
import pyro_bnn.model.input_scale as input_scale
from pyro_bnn.model.input_scale import InputScaleWatch, end_input_watch, inputs_warned

MESSAGE = r"^x given to pb\.BNN holds whole numbers from 0 to 255 \(its first \d+ examples\).*Divide by 255"
GUIDE_MESSAGE = (r"^x given to the model of this {} guide holds whole numbers from 0 to 255 "
                 r"\(its first \d+ examples\).*Divide by 255")
KINDS = ["bnn", "handwritten"]


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


def _bnn():
    return pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)), "categorical")


def _guide(name, model):
    if name == "Hypernet":   # a flow over every latent site of a hand-written model
        return pb.guides.Hypernet(model, full=True)
    return {"MeanField": pb.guides.MeanField, "Symmetrized": pb.guides.Symmetrized,
            "Laplace": pb.guides.Laplace}[name](model)


def _fresh(kind, guide="MeanField"):
    """A new model of ``kind`` and its guide, on an empty param store."""
    pyro.clear_param_store()
    model = _bnn() if kind == "bnn" else Net()
    return model, _guide(guide, model)


def _watch(kind, model, guide) -> InputScaleWatch:
    """The watch that looks at this kind of model's inputs: the model's own, or its guide's."""
    return model.input_watch if kind == "bnn" else guide.input_watch


def _message(kind, guide="MeanField"):
    return MESSAGE if kind == "bnn" else GUIDE_MESSAGE.format(guide)


def _pixel_warnings(rec):
    return [w for w in rec if issubclass(w.category, pb.UnscaledPixelsWarning)]


def _svi_steps(model, guide, x, y, *, loss=None, steps=3, batch=None):
    """A user's own loop: minibatches of ``batch`` with ``num_data`` (a pb.BNN), or full batch."""
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=loss if loss is not None else Trace_ELBO())
    for i in range(steps):
        if batch is None:
            svi.step(x, y)
        else:
            rows = slice(i * batch % len(x), i * batch % len(x) + batch)
            svi.step(x[rows], y[rows], num_data=len(x))


def _steps(kind, model, guide, x, y, **kw):
    return _svi_steps(model, guide, x, y, batch=32 if kind == "bnn" else None, **kw)


@pytest.mark.parametrize("kind, guide_name, objective", [
    ("bnn", "MeanField", "Trace_ELBO"), ("bnn", "MeanField", "guide"),
    *[("handwritten", g, "Trace_ELBO") for g in ("MeanField", "Symmetrized", "Laplace", "Hypernet")],
    *[("handwritten", g, "guide") for g in ("MeanField", "Laplace", "Hypernet")]])
def test_own_svi_loop_on_raw_pixels_warns_once_at_the_users_line(kind, guide_name, objective, pixels):
    """Trace_ELBO runs model.forward; the guide's own objective skips it for a pb.BNN (fast path),
    whose guide then looks itself once set up (here on a dummy row of zeros, as
    ``load_state_dict`` does), and reaches a hand-written model's guide through GuideObjective
    (the Laplace guide's MAP objective does not call the guide as Pyro does).  A Predictive
    afterwards does not warn again (once per model / guide)."""
    x, y = pixels
    model, guide = _fresh(kind, guide_name)
    if kind == "bnn":
        guide(torch.zeros(1, 64))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _steps(kind, model, guide, x, y, loss=guide.make_objective() if objective == "guide" else None)
        if objective == "Trace_ELBO":
            Predictive(model, guide=guide, num_samples=2)(x)
    found = _pixel_warnings(rec)
    assert len(found) == 1, [str(w.message) for w in found]
    assert found[0].category is pb.UnscaledPixelsWarning
    assert Path(found[0].filename).name == Path(__file__).name      # the user's line, not Pyro's or ours
    assert re.match(_message(kind, guide_name), str(found[0].message)), str(found[0].message)
    assert _watch(kind, model, guide).warned


@pytest.mark.parametrize("kind, parallel", [("bnn", False), ("bnn", True), ("handwritten", False)])
def test_predictive_on_raw_pixels_warns(kind, parallel, pixels):
    x, y = pixels
    model, guide = _fresh(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        _steps(kind, model, guide, x / 255, y, steps=2)       # trained on scaled inputs: silent
    predictive = Predictive(model, guide=guide, num_samples=3, parallel=parallel)
    with pytest.warns(pb.UnscaledPixelsWarning, match=_message(kind)) as rec:
        predictive(x)                                         # ... then given 0-255 test inputs
        predictive(x)
    assert len(_pixel_warnings(rec)) == 1
    assert Path(_pixel_warnings(rec)[0].filename).name == Path(__file__).name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [lambda x: x / 255, lambda x: torch.round(x / 16)])  # [0, 1]; raw digits 0-15
def test_scaled_inputs_are_not_warned(kind, scale, pixels):
    x, y = pixels
    x = scale(x)
    model, guide = _fresh(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        _steps(kind, model, guide, x, y)
        Predictive(model, guide=guide, num_samples=2)(x)
    watch = _watch(kind, model, guide)
    assert not watch.warned
    assert watch.looking == [False, False]                    # looked at once each, then done


@pytest.mark.parametrize("kind", KINDS)
def test_the_look_runs_once_per_kind_of_call_not_per_step(kind, pixels, monkeypatch):
    """A pb.BNN: 50 direct training calls, SVI under Trace_ELBO and under the guide's objective;
    a hand-written model: SVI steps.  One look for all training calls, one for all predictions,
    none for later raw pixels (a flag test)."""
    x, y = pixels
    calls = []
    real = input_scale.looks_like_unscaled_pixels
    monkeypatch.setattr(input_scale, "looks_like_unscaled_pixels", lambda t: calls.append(len(t)) or real(t))
    model, guide = _fresh(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.UnscaledPixelsWarning)
        if kind == "bnn":
            for _ in range(50):
                model(x / 255, y, num_data=len(x))
            _steps(kind, model, guide, x / 255, y, steps=5)
            _steps(kind, model, guide, x / 255, y, steps=5, loss=guide.make_objective())
        else:
            _steps(kind, model, guide, x / 255, y, steps=10)
        assert calls == [len(x)]                              # the first training call only
        if kind == "bnn":
            for _ in range(20):
                model(x / 255)
        Predictive(model, guide=guide, num_samples=3)(x / 255)
    assert calls == [len(x), len(x)]                          # and the first prediction call
    if kind == "bnn":
        model(x, y)                                           # later raw pixels are not looked at
    else:
        _steps(kind, model, guide, x, y, steps=2)
    assert len(calls) == 2


@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
@pytest.mark.parametrize("kind, guide_kind", [("bnn", "MeanField"), ("bnn", "AutoNormal"),
                                              ("handwritten", "MeanField")])
def test_fit_and_predictive_on_raw_pixels_warn_once(kind, guide_kind, pixels):
    """pb.fit warns (its BatchCheck) and tells the model (end_input_watch), whose watch (a pb.BNN's
    forward runs every step under Pyro's AutoNormal) or its guide's then stays silent, in the fit
    and in the user's Predictive after it."""
    x, y = pixels
    model, guide = _fresh(kind)
    if guide_kind == "AutoNormal":
        guide = AutoNormal(model)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pb.fit(model, guide, (x, y), epochs=2, batch_size=32, progress=False)
        Predictive(model, guide=guide, num_samples=2)(x)
    found = _pixel_warnings(rec)
    assert [str(w.message)[:16] for w in found] == ["x holds whole nu"], [str(w.message) for w in found]
    watch = _watch(kind, model, guide)
    assert inputs_warned(model) and watch.looking == [False, False]
    assert watch.warned == (kind == "bnn")                    # a guide's watch ended without warning


# ------------------------------------------------------------------------- pb.fit's own check
@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
def test_fit_of_a_hand_written_model_still_warns(pixels):
    """A PyroModule that is not a pb.BNN holds no watch: a mark does not silence pb.fit's own
    check, which warns once."""
    x, y = pixels

    class Scaled(PyroModule):
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
    model = Scaled()
    end_input_watch(model)                                 # no watch: the model is marked (for its guides), no error
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pb.fit(model, pb.guides.MeanField(model), (x, y), epochs=1, batch_size=64, progress=False)
    assert [str(w.message)[:16] for w in _pixel_warnings(rec)] == ["x holds whole nu"]


# ------------------------------------------------------------------------- a pb.BNN's own watch
def test_a_dummy_input_of_zeros_does_not_use_up_the_look(pixels):
    """Guides set up without data run the model on one row of zeros (pb.model.bnn.example_input)."""
    x, _ = pixels
    model = _bnn()
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
    model = _bnn()
    end_input_watch(model)
    assert model.input_watch.warned and model.input_watch.looking == [False, False]
    from pyro_bnn.model import UnscaledPixelsWarning
    assert pb.UnscaledPixelsWarning is UnscaledPixelsWarning is input_scale.UnscaledPixelsWarning  # one home
    assert not hasattr(pb.data, "UnscaledPixelsWarning")


# ------------------------------------------------------------ a guide's watch of a hand-written model
@pytest.mark.filterwarnings("ignore::pyro_bnn.ConvergenceWarning")
def test_predict_on_raw_pixels_after_a_scaled_fit_warns_once(pixels):
    """pb.predict calls the guide without targets (a prediction look): its own check has warned."""
    x, y = pixels
    model, guide = _fresh("handwritten")
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
    model, guide = _fresh("bnn")
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
