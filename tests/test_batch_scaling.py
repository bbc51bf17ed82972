"""Training a ``pb.BNN`` on minibatches under plain ``SVI`` without ``num_data=`` is warned about.

Without ``num_data`` each step's ELBO treats its batch as the whole data set, the prior outweighs
the data and the fit stays near the prior, silently (``pyro_bnn/model/batch_scaling.py``).
"""

from __future__ import annotations

import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn

import pyro_bnn as pb
from pyro_bnn.model.batch_scaling import WATCHED_CALLS, UnscaledBatchWatch


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
        watch.see("m", same, y, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):  # changes after the watched calls go unseen (no cost after them)
            watch.see("m", torch.full((4, 2), float(i)), y, None)
    assert not watch.warned
    watch = UnscaledBatchWatch()
    with pytest.warns(UserWarning, match="without num_data"):
        for i in range(3):
            watch.see("m", torch.full((4, 2), float(i)), y, None)
    assert watch.warned
