"""Training a ``pb.BNN`` on minibatches under plain ``SVI`` without ``num_data=`` is warned about.

Without ``num_data`` each step's ELBO treats its batch as the whole data set, the prior outweighs
the data and the fit stays near the prior, silently (``pyro_bnn/model/batch_scaling.py``).
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.guide import BNNGuide
from pyro_bnn.contract.pyro_objective import PyroObjective
from pyro_bnn.model.batch_scaling import WATCHED_CALLS, UnscaledBatchWatch, observations_unscaled


def _setup(loss: str):
    torch.manual_seed(0)
    pyro.clear_param_store()
    model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "categorical")
    guide = pb.guides.MeanField(model)
    objective = {"guide": guide.make_objective(), "trace_elbo": Trace_ELBO(),
                 "particles": Trace_ELBO(num_particles=4)}[loss]
    return model, guide, SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=objective)


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(96, 4, generator=gen), torch.randint(0, 3, (96,), generator=gen)


@pytest.mark.parametrize("loss", ["guide", "trace_elbo", "particles"])
def test_changing_batches_without_num_data_warn_once(loss, data):
    x, y = data
    model, guide, svi = _setup(loss)
    with pytest.warns(UserWarning, match=r"changing batches of 16 inputs without num_data=") as record:
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])
    assert sum("without num_data" in str(w.message) for w in record) == 1


@pytest.mark.parametrize("loss", ["guide", "trace_elbo"])
def test_no_warning_when_scaled_full_batch_or_predicting(loss, data):
    x, y = data
    model, guide, svi = _setup(loss)
    for i in range(0, 96, 16):  # minibatches told the data set's size (warnings are errors here)
        svi.step(x[i:i + 16], y[i:i + 16], num_data=len(x))
    model, guide, svi = _setup(loss)
    for _ in range(WATCHED_CALLS + 2):  # the whole data set, a new tensor (as .to(device)) each step
        svi.step(x.clone(), y.clone())
    model, guide, svi = _setup(loss)
    for _ in range(WATCHED_CALLS + 2):  # the whole data set shuffled (a full-batch DataLoader)
        order = torch.randperm(len(x))
        svi.step(x[order], y[order])
    for i in range(0, 96, 16):  # predictions on changing batches run without gradients
        Predictive(model, guide=guide, num_samples=2)(x[i:i + 16])
        svi.evaluate_loss(x[i:i + 16], y[i:i + 16])


def test_watch_looks_at_the_first_calls_only():
    watch = UnscaledBatchWatch()
    y = torch.zeros(4)
    same = torch.ones(4, 2)
    for _ in range(WATCHED_CALLS):
        watch.see(same, y, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):  # changes after the watched calls go unseen (no cost after them)
            watch.see(torch.full((4, 2), float(i)), y, None)
    assert not watch.warned
    watch = UnscaledBatchWatch()
    with pytest.warns(UserWarning, match="without num_data"):
        for i in range(3):
            watch.see(torch.full((4, 2), float(i)), y, None)
    assert watch.warned


# ---------------------------------------------------------------- hand-written models
class _HandWritten(PyroModule):
    """A Pyro user's own BNN; its data plate is subsampled (scaled) only when told N."""

    def __init__(self, num_data=None, batchnorm=False):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](4, 8)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([8, 4]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([8]).to_event(1))
        self.norm = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
        self.fc2 = PyroModule[nn.Linear](8, 3)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 8]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        self.num_data = num_data

    def forward(self, x, y=None):
        logits = self.fc2(torch.relu(self.norm(self.fc1(x))))
        with pyro.plate("data", self.num_data or len(x), subsample_size=len(x)):
            return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


_GUIDES = {"meanfield": pb.guides.MeanField, "symmetrized": pb.guides.Symmetrized,
           "hypernet": lambda m: pb.guides.Hypernet(m, full=True), "laplace": pb.guides.Laplace}


def _hand_written_svi(guide_name, loss, num_data=None, batchnorm=False):
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = _HandWritten(num_data, batchnorm)
    guide = _GUIDES[guide_name](model)
    objective = Trace_ELBO() if loss == "trace_elbo" else guide.make_objective()
    return model, guide, SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=objective)


@pytest.mark.parametrize("loss", ["guide", "trace_elbo"])
@pytest.mark.parametrize("guide_name", sorted(_GUIDES))
def test_hand_written_model_on_unscaled_batches_warns_once(guide_name, loss, data):
    x, y = data
    model, guide, svi = _hand_written_svi(guide_name, loss)
    with pytest.warns(UserWarning, match=r"model of this \w+ guide is being trained on changing batches of 16") \
            as record:
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])
    assert sum("without num_data" in str(w.message) for w in record) == 1
    assert "subsample_size=len(x)" in str(record[0].message)  # the hand-written model's remedy


@pytest.mark.parametrize("loss", ["guide", "trace_elbo"])
@pytest.mark.parametrize("guide_name", ["meanfield", "laplace"])
def test_hand_written_model_that_scales_itself_or_is_scaled_is_not_warned_about(guide_name, loss, data):
    x, y = data
    model, guide, svi = _hand_written_svi(guide_name, loss, num_data=len(x))  # its plate subsamples
    for i in range(0, 96, 16):  # (warnings are errors here)
        svi.step(x[i:i + 16], y[i:i + 16])
    if guide_name == "laplace":
        guide.fit_curvature((x, y))
    for i in range(0, 48, 16):  # predictions on changing batches
        Predictive(model, guide=guide, num_samples=2)(x[i:i + 16])
    if loss == "guide":  # the guide's objective scales the data term when told N
        model, guide, svi = _hand_written_svi(guide_name, loss)
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16], num_data=len(x))
    model, guide, svi = _hand_written_svi(guide_name, loss)
    for _ in range(4):  # the whole data set each step
        order = torch.randperm(len(x))
        svi.step(x[order], y[order])


def test_pb_fit_of_a_hand_written_model_is_not_warned_about(data):
    x, y = data
    pyro.clear_param_store()
    model = _HandWritten()
    guide = pb.guides.Symmetrized(model)  # its objective is fused; MeanField's too
    pb.fit(model, guide, (x, y), epochs=2, batch_size=16, progress=False)
    model = _HandWritten()
    guide = pb.guides.Laplace(model)
    pb.fit(model, guide, (x, y), epochs=2, batch_size=16, progress=False)
    for guide_name in ("meanfield", "hypernet"):  # Pyro's ELBO under pb.fit (scale_observations)
        model, guide, _ = _hand_written_svi(guide_name, "guide")
        pb.fit(model, guide, (x, y), epochs=2, batch_size=16, progress=False,
               objective=PyroObjective(Trace_ELBO()))


def test_checking_the_model_changes_nothing_the_user_sees(data):
    """The one run of the model that confirms the warning leaves the running statistics and the
    random stream as they were."""
    x, y = data
    model, guide, svi = _hand_written_svi("meanfield", "trace_elbo", batchnorm=True)
    for i in range(0, 32, 16):
        svi.step(x[i:i + 16], y[i:i + 16])
    stats = [b.clone() for b in model.norm.buffers()]
    state = torch.get_rng_state()
    assert observations_unscaled(model, model, (x[32:48], y[32:48]), {}) is True
    assert all(torch.equal(a, b) for a, b in zip(stats, model.norm.buffers()))
    assert torch.equal(state, torch.get_rng_state())
    assert observations_unscaled(model, model, (x[32:48],), {}) is None  # nothing observed: a prediction
    scaled = _HandWritten(num_data=len(x))
    assert observations_unscaled(scaled, scaled, (x[:16], y[:16]), {}) is False
    assert observations_unscaled(pyro.poutine.scale(model, scale=6.0), model, (x[:16], y[:16]), {}) is False


def test_hand_written_function_model_is_watched_too(data):
    x, y = data

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4, 3]).to_event(2))
        with pyro.plate("data", len(x)):
            return pyro.sample("obs", dist.Categorical(logits=x @ w), obs=y)

    pyro.clear_param_store()
    svi = SVI(model, pb.guides.MeanField(model), pyro.optim.Adam({"lr": 1e-2}), loss=Trace_ELBO())
    with pytest.warns(UserWarning, match="changing batches of 16 inputs"):
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])


def test_watch_in_a_guide_list_under_pb_fit_and_the_default_objective(data):
    """pb.fit ends the watch of a pyro_bnn guide inside an AutoGuideList; the contract's default
    objective (Pyro's ELBO, for a guide written from docs/DEVELOPING.md) scales when told N."""
    x, y = data
    pyro.clear_param_store()
    model = _HandWritten()
    guide = AutoGuideList(model)
    guide.append(pb.guides.MeanField(pyro.poutine.block(model, hide=["fc2.weight", "fc2.bias"])))
    guide.append(AutoNormal(pyro.poutine.block(model, expose=["fc2.weight", "fc2.bias"])))
    pb.fit(model, guide, (x, y), epochs=2, batch_size=16, progress=False)  # (warnings are errors)

    class MyGuide(BNNGuide, AutoNormal):
        pass

    pyro.clear_param_store()
    model = _HandWritten()
    guide = MyGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    for i in range(0, 96, 16):
        svi.step(x[i:i + 16], y[i:i + 16], num_data=len(x))
    pyro.clear_param_store()
    model = _HandWritten()
    guide = MyGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    with pytest.warns(pb.UnscaledBatchWarning, match="model of this MyGuide guide"):
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])


def test_draws_by_hand_do_not_end_the_watch(data):
    """Guide calls with gradients but without observations (weights drawn by hand) are no
    training steps: the watch still warns about the unscaled training that follows."""
    x, y = data
    model, guide, svi = _hand_written_svi("meanfield", "trace_elbo")
    for i in range(0, 64, 16):
        guide(x[i:i + 16])
    assert guide.batch_watch.active
    with pytest.warns(pb.UnscaledBatchWarning):
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])


def test_scaling_the_guide_cannot_see_is_filtered_by_category(data):
    """A poutine.scale around the model given to SVI only is invisible to the guide: the warning
    names the filter, and filtering its category silences it."""
    x, y = data
    model, guide, _ = _hand_written_svi("meanfield", "trace_elbo")
    svi = SVI(pyro.poutine.scale(model, scale=len(x) / 16), guide, pyro.optim.Adam({"lr": 1e-2}),
              loss=Trace_ELBO())
    with pytest.warns(pb.UnscaledBatchWarning, match=r"filterwarnings\('ignore', category=pb.UnscaledBatchWarning\)"):
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])
    model, guide, _ = _hand_written_svi("meanfield", "trace_elbo")
    svi = SVI(pyro.poutine.scale(model, scale=len(x) / 16), guide, pyro.optim.Adam({"lr": 1e-2}),
              loss=Trace_ELBO())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=pb.UnscaledBatchWarning)
        for i in range(0, 96, 16):
            svi.step(x[i:i + 16], y[i:i + 16])
