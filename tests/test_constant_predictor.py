"""Check (e) of the convergence diagnosis: a classifier no better than its class frequencies.

A fit whose every posterior scale went to its prior (measured: MeanField on a LeNet, 10,000
Fashion-MNIST images, lr 0.05: test accuracy 0.10) is as flat as a converged fit, and checks
(a)–(d) called it converged.  Its objective is then at or below the log-likelihood of predicting
the training class frequencies for every input, which check (e) compares it with.
"""

from __future__ import annotations

import math
import warnings

import pyro
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_bnn as pb
from pyro_bnn.training.constant_predictor import constant_predictor_log_likelihood
from pyro_bnn.training.convergence import diagnose


def test_categorical_value_is_the_frequencies_log_likelihood():
    model = pb.BNN(nn.Linear(2, 3))
    y = torch.tensor([0, 0, 0, 2])   # class 1 absent: contributes nothing
    x = torch.zeros(4, 2)
    expected = 3 * math.log(0.75) + math.log(0.25)
    assert constant_predictor_log_likelihood(model, (x, y), 4) == pytest.approx(expected, rel=1e-12)
    # the objective counts num_data points (minibatch scaling): the value scales with it
    assert constant_predictor_log_likelihood(model, (x, y), 40) == pytest.approx(10 * expected, rel=1e-12)
    assert constant_predictor_log_likelihood(model, TensorDataset(x, y), 4) == pytest.approx(expected, rel=1e-12)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True)
    assert constant_predictor_log_likelihood(model, loader, 4) == pytest.approx(expected, rel=1e-12)


def test_bernoulli_value_per_output():
    model = pb.BNN(nn.Linear(2, 2), likelihood="bernoulli")
    y = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    expected = (3 * math.log(0.75) + math.log(0.25)) * 2   # each column: 3 of one value, 1 of the other
    assert constant_predictor_log_likelihood(model, (torch.zeros(4, 2), y), 4) == pytest.approx(expected, rel=1e-12)


def test_not_judged_where_it_does_not_apply():
    x, y = torch.zeros(4, 2), torch.tensor([0, 1, 0, 1])
    regression = pb.BNN(nn.Linear(2, 1), likelihood="gaussian", noise=0.1)
    assert constant_predictor_log_likelihood(regression, (x, torch.zeros(4, 1)), 4) is None
    classifier = pb.BNN(nn.Linear(2, 2))
    assert constant_predictor_log_likelihood(classifier, (x, None), 4) is None   # no targets
    assert constant_predictor_log_likelihood(classifier, DataLoader(list(zip(x, y))), 4) is None   # not one tensor
    # a loader over part of its dataset (a train/validation split) has other class frequencies
    part = DataLoader(TensorDataset(x, y), batch_size=2, sampler=torch.utils.data.SubsetRandomSampler([0, 1]))
    assert constant_predictor_log_likelihood(classifier, part, 2) is None

    def hand_written(x, y=None):
        return None
    assert constant_predictor_log_likelihood(hand_written, (x, y), 4) is None


def test_diagnose_flags_a_flat_fit_below_the_baseline():
    flat = [-25_000.0 + 5.0 * math.sin(i) for i in range(80)]   # level: checks (a) and (d) pass
    assert diagnose(flat, lr_decayed=True).converged
    diag = diagnose(flat, lr_decayed=True, baseline=-23_026.0)
    assert not diag.converged
    assert diag.short_reasons() == ["no better than the class frequencies"]
    assert "no better than ignoring the inputs" in diag.message()
    assert diag.measures["objective_baseline"] == -23_026.0
    # a fit far above the frequencies passes
    assert diagnose([v + 17_000.0 for v in flat], lr_decayed=True, baseline=-23_026.0).converged


def _fit(labels, seed):
    data = pb.datasets.digits()
    torch.manual_seed(seed)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = pb.fit(model, guide, (data.x_train, labels(data.y_train)), epochs=30, seed=seed, progress=False)
    return result.convergence, [w for w in caught if issubclass(w.category, pb.ConvergenceWarning)]


def test_fit_warns_when_the_labels_carry_nothing_the_inputs_predict():
    """Labels shuffled against the inputs: the best the posterior can do is the frequencies,
    and the ELBO stays below them (seeds 0-2: −3,355 … −3,384 against −3,102)."""
    pyro.clear_param_store()
    diag, caught = _fit(lambda y: y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))], 0)
    assert diag.measures["objective_baseline"] == pytest.approx(
        constant_predictor_log_likelihood(pb.BNN(nn.Linear(64, 10)), pb.datasets.digits().train, 1348))
    assert "no better than the class frequencies" in diag.short_reasons()
    assert any("no better than ignoring the inputs" in str(w.message) for w in caught)


def test_fit_on_real_labels_is_far_above_the_frequencies():
    pyro.clear_param_store()
    diag, _ = _fit(lambda y: y, 0)
    assert diag.measures["objective_end"] > diag.measures["objective_baseline"] + 1_000   # −1,104 vs −3,102
    assert "no better than the class frequencies" not in diag.short_reasons()


@pytest.mark.parametrize("make_guide", [
    lambda model: pb.guides.Laplace(model, subset="last_layer"),
    lambda model: pyro.infer.autoguide.AutoDelta(model),
])
def test_map_objectives_are_not_compared_with_the_frequencies(make_guide):
    """A MAP objective (log-likelihood less a prior penalty that is no Occam factor) can sit far
    below the frequencies' log-likelihood for a net that fits well: the main job's last-layer
    Laplace on digits, −6,258 against −3,102 at test accuracy 0.989, was flagged before check (e)
    was restricted to objectives that bound the evidence."""
    pyro.clear_param_store()
    data = pb.datasets.digits()
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))
    guide = make_guide(model)
    assert not pb.contract.guide.guide_contract(guide).bounds_evidence
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pb.fit(model, guide, data.train, epochs=20, lr=1e-2, seed=0, progress=False)
    assert result.convergence.measures["objective_baseline"] is None
    assert "no better than the class frequencies" not in result.convergence.short_reasons()


def test_a_users_own_objective_is_not_compared_with_the_frequencies():
    pyro.clear_param_store()
    data = pb.datasets.digits()
    model = pb.BNN(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))
    guide = pb.guides.MeanField(model)
    objective = pb.contract.PyroObjective(pyro.infer.Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pb.fit(model, guide, data.train, epochs=20, seed=0, progress=False, objective=objective)
    assert result.convergence.measures["objective_baseline"] is None
