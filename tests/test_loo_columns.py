"""ELPD-LOO of pb.compare on a sample of the training observations (``loo_observations``).

Reference: the same columns computed on every observation; a sampled estimate must agree with
it within its own stated standard error, and the sample must be the same for every guide.
"""

import math
import warnings

import numpy as np
import pytest
from torch import nn

import pyro_bnn as pb
from pyro_bnn.reporting import cli
from pyro_bnn.reporting.loo_columns import DEFAULT_LOO_OBSERVATIONS, loo_columns, loo_sample


def _model():
    return pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)), "categorical")


@pytest.fixture(scope="module")
def datatree():
    d = pb.datasets.digits()
    model = _model()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (d.x_train, d.y_train), epochs=30, progress=False, seed=0)
    return pb.to_arviz(model, guide, d.x_train, d.y_train, num_samples=40)


def test_sample_indices_are_sorted_distinct_seeded_and_none_for_all():
    index = loo_sample(1000, 100, seed=3)
    assert len(index) == 100 and len(np.unique(index)) == 100 and (np.diff(index) > 0).all()
    assert index.min() >= 0 and index.max() < 1000
    assert np.array_equal(index, loo_sample(1000, 100, seed=3))
    assert not np.array_equal(index, loo_sample(1000, 100, seed=4))
    assert loo_sample(1000, None, seed=0) is None and loo_sample(1000, 1000, seed=0) is None
    assert loo_sample(1000, 5000, seed=0) is None


def test_all_observations_is_the_full_computation(datatree):
    n = datatree["log_likelihood"].sizes["obs_id"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = loo_columns(datatree)
        psis = pb.posterior.arviz.psis_loo(datatree)[0]
        ref = pb.posterior.arviz.loo_approximate(datatree)
    assert full["loo_observations"] == n
    assert (full["elpd_loo"], full["elpd_loo_se"]) == (float(ref.elpd), float(ref.se))
    assert math.isfinite(full["elpd_loo"]) and full["elpd_loo_psis"] == pytest.approx(psis, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_estimate_agrees_with_the_full_one_within_its_se(datatree, seed):
    n = datatree["log_likelihood"].sizes["obs_id"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = loo_columns(datatree)
        part = loo_columns(datatree, loo_sample(n, 400, seed))
    assert part["loo_observations"] == 400
    # the sampled SE adds the sampling error: larger than the full data's
    assert part["elpd_loo_se"] > full["elpd_loo_se"]
    sampling = math.sqrt(part["elpd_loo_se"] ** 2 - full["elpd_loo_se"] ** 2)
    # tolerance: 3 sampling standard errors (seeds fixed; the estimate is unbiased)
    assert abs(part["elpd_loo"] - full["elpd_loo"]) < 3 * sampling
    assert abs(part["elpd_loo_psis"] - full["elpd_loo_psis"]) < 3 * sampling * 1.5
    # the estimate is of the whole set's sum (scaled by N / m), not of the sample's
    sample_sum = full["elpd_loo"] * 400 / n
    assert abs(part["elpd_loo"] - full["elpd_loo"]) < abs(part["elpd_loo"] - sample_sum)


def test_compare_scores_every_guide_on_the_same_sample():
    d = pb.datasets.digits()
    split = pb.datasets.DataSplit(d.x_train[:300], d.y_train[:300], d.x_test[:50], d.y_test[:50])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = pb.compare(_model, ["meanfield", "symmetrized"], split, epochs=2, num_samples=4,
                           loo_samples=30, loo_observations=120, progress=False)
        full = pb.compare(_model, ["meanfield"], split, epochs=2, num_samples=4,
                          loo_samples=30, loo_observations=None, progress=False)
    assert list(table["loo_observations"]) == [120, 120]
    assert full.loc["meanfield", "loo_observations"] == 300
    # the same seed trains the same MeanField: only the scored observations differ
    assert table.loc["meanfield", "elbo"] == pytest.approx(full.loc["meanfield", "elbo"], rel=1e-6)
    assert table.loc["meanfield", "elpd_loo"] != full.loc["meanfield", "elpd_loo"]


@pytest.mark.parametrize("value, error, message", [
    (0, ValueError, "loo_observations must be an int >= 1, got 0"),
    (2.5, TypeError, "loo_observations must be an int >= 1, got 2.5"),
    (True, TypeError, "loo_observations must be an int >= 1, got True"),
])
def test_compare_refuses_a_bad_loo_observations(value, error, message):
    d = pb.datasets.digits()
    split = pb.datasets.DataSplit(d.x_train[:50], d.y_train[:50], d.x_test[:20], d.y_test[:20])
    with pytest.raises(error, match=message):
        pb.compare(_model, ["meanfield"], split, epochs=1, loo_observations=value, progress=False)


def test_cli_passes_loo_observations_on():
    args = cli.build_parser().parse_args(["--loo-observations", "500"])
    assert args.loo_observations == 500
    assert cli.build_parser().parse_args([]).loo_observations == DEFAULT_LOO_OBSERVATIONS
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--loo-observations", "0"])


def test_sample_of_every_observation_reproduces_arviz(datatree):
    # the sampled estimator at m = N: no sampling error, ArviZ's elpd and se exactly
    n = datatree["log_likelihood"].sizes["obs_id"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = loo_columns(datatree)
        every = loo_columns(datatree, np.arange(n))
    assert every["elpd_loo"] == pytest.approx(full["elpd_loo"], rel=1e-12)
    assert every["elpd_loo_se"] == pytest.approx(full["elpd_loo_se"], rel=1e-9)
    assert every["elpd_loo_psis"] == pytest.approx(full["elpd_loo_psis"], rel=1e-12)
