"""ELPD-LOO of pb.compare on a sample of the training observations (``loo_observations``).

References: the same columns computed on every observation (a sample of every observation
must reproduce them exactly); the difference estimator's unbiasedness and its stated sampling
error against the closed-form variance of simple random sampling without replacement, over many
seeded samples of synthetic values; and the sample must be the same for every guide.
"""

import math
import warnings

import numpy as np
import pytest
from torch import nn

import pyro_bnn as pb
from pyro_bnn.reporting import cli
from pyro_bnn.reporting.loo_columns import (
    DEFAULT_LOO_OBSERVATIONS,
    difference_estimate,
    loo_columns,
    loo_reliability_note,
    loo_sample,
)


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
    return pb.to_arviz(model, guide, d.x_train, d.y_train, num_samples=40, seed=0)


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert full["elpd_loo_psis_se"] == pytest.approx(pb.posterior.arviz.psis_loo(datatree)[1], rel=1e-12)


def test_difference_estimate_of_every_point_is_exact():
    rng = np.random.default_rng(0)
    exact, approx = rng.normal(size=50), rng.normal(size=50)
    total, spread, sampling = difference_estimate(exact, approx, np.arange(50))
    assert total == pytest.approx(exact.sum(), rel=1e-12)
    assert spread == pytest.approx(math.sqrt(50 * exact.var(ddof=1)), rel=1e-9)
    assert sampling == 0.0


def test_difference_estimate_with_a_perfect_or_shifted_approximation_has_no_sampling_error():
    rng = np.random.default_rng(1)
    exact = rng.normal(size=400)
    index = loo_sample(400, 40, seed=2)
    for approx in (exact, exact + 3.0):  # a constant offset is corrected exactly too
        total, spread, sampling = difference_estimate(exact[index], approx, index)
        assert total == pytest.approx(exact.sum(), abs=1e-9)
        assert sampling == pytest.approx(0.0, abs=1e-9)
    # the spread is estimated from the approximations and the sample's corrections
    assert spread == pytest.approx(math.sqrt(400 * exact.var(ddof=1)), rel=1e-9)


def test_difference_estimate_is_unbiased_with_the_stated_sampling_error():
    # synthetic values: N = 2,000 points, approximations off by noise of sd 0.3 plus a skew
    rng = np.random.default_rng(3)
    n, m, reps = 2000, 100, 4000
    exact = rng.normal(-0.5, 1.0, size=n)
    approx = exact + rng.normal(0.0, 0.3, size=n) + 0.2 * (exact < -1.5)
    d = exact - approx
    stated = n * d.std(ddof=1) / math.sqrt(m) * math.sqrt(1 - m / n)  # closed form, population sd
    totals, samplings = [], []
    for r in range(reps):
        index = loo_sample(n, m, seed=r)
        total, _, sampling = difference_estimate(exact[index], approx, index)
        totals.append(total)
        samplings.append(sampling)
    totals = np.array(totals)
    # unbiased: the mean of 4,000 estimates within 4 of its standard errors of the truth
    assert abs(totals.mean() - exact.sum()) < 4 * stated / math.sqrt(reps)
    # the spread of the estimates is the closed form's (4,000 draws: ~1 % sd; tolerance 5 %)
    assert totals.std() == pytest.approx(stated, rel=0.05)
    # and each estimate's stated sampling error is right on average
    assert np.mean(samplings) == pytest.approx(stated, rel=0.05)
    # far tighter than scaling the sample's own values (N · mean_sample e_n)
    assert stated < 0.5 * n * exact.std(ddof=1) / math.sqrt(m) * math.sqrt(1 - m / n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_columns_agree_with_the_full_ones(datatree, seed):
    n = datatree["log_likelihood"].sizes["obs_id"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = loo_columns(datatree)
        part = loo_columns(datatree, loo_sample(n, 400, seed))
        elpd_i = pb.posterior.arviz.loo_approximate(datatree, pointwise=True).elpd_i.values
        psis_i = pb.posterior.arviz.psis_loo_pointwise(datatree)[0]
    assert part["loo_observations"] == 400
    # tolerance: 3 standard errors of the simple estimator N · mean_sample(elpd_n), which the
    # difference estimator must beat by far on elpd_loo (its approximation, the log predictive
    # density under the correction's weights, is close to it) and stay within on elpd_loo_psis
    simple = n * elpd_i.std(ddof=1) / math.sqrt(400) * math.sqrt(1 - 400 / n)
    simple_psis = n * psis_i.std(ddof=1) / math.sqrt(400) * math.sqrt(1 - 400 / n)
    assert abs(part["elpd_loo"] - full["elpd_loo"]) < 0.1 * simple
    assert abs(part["elpd_loo_psis"] - full["elpd_loo_psis"]) < 3 * simple_psis
    # the estimate is of the whole set's sum, not of the sample's
    assert abs(part["elpd_loo"] - full["elpd_loo"]) < abs(part["elpd_loo"] - full["elpd_loo"] * 400 / n)
    # the SE: the whole set's spread (estimated) with the small sampling error
    assert part["elpd_loo_se"] == pytest.approx(full["elpd_loo_se"], rel=0.1)
    # elpd_loo_psis' SE adds a sampling error that is not small: above the full data's, and
    # at most the full spread and the simple estimator's sampling error together
    assert full["elpd_loo_psis_se"] < part["elpd_loo_psis_se"] < 1.1 * math.hypot(full["elpd_loo_psis_se"],
                                                                                    simple_psis)


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
    assert every["elpd_loo_psis_se"] == pytest.approx(full["elpd_loo_psis_se"], rel=1e-9)


def test_psis_column_reports_arviz_k_hat_share(datatree):
    """``pareto_k_bad_psis`` is the share of az.loo's own k-hat above its own threshold, on every
    observation or on the sample; a share the report must not hide (the digits MeanField's
    elpd_loo_psis is dominated by observations with k-hat > 0.7)."""
    import arviz_stats

    n = datatree["log_likelihood"].sizes["obs_id"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = arviz_stats.loo(datatree, pointwise=True)
        full = loo_columns(datatree)
        index = loo_sample(n, 400, 0)
        part = loo_columns(datatree, index)
    k = np.asarray(ref.pareto_k)
    assert full["pareto_k_bad_psis"] == pytest.approx(float((k > ref.good_k).mean()), rel=1e-12)
    assert part["pareto_k_bad_psis"] == pytest.approx(float((k[index] > ref.good_k).mean()), rel=1e-12)
    assert 0 < full["pareto_k_bad_psis"] <= 1   # this short fit has bad k-hats: the premise of the note


def test_reliability_note_names_the_rows_and_shares_or_nothing():
    import pandas as pd

    table = pd.DataFrame({"elpd_loo": [-1.0, -2.0, -3.0], "pareto_k_bad": [1.0, 0.0, math.nan],
                          "elpd_loo_psis": [-1.0, -2.0, -3.0], "pareto_k_bad_psis": [0.0, 0.25, math.nan]},
                         index=pd.Index(["a", "b", "c"], name="guide"))
    note = loo_reliability_note(table)
    assert "elpd_loo (pareto_k_bad: a 100%)" in note
    assert "elpd_loo_psis (pareto_k_bad_psis: b 25%)" in note
    assert "c " not in note.split(":", 1)[1]    # NaN (not computed) is not called unreliable
    table[["pareto_k_bad", "pareto_k_bad_psis"]] = 0.0
    assert loo_reliability_note(table) is None
    assert loo_reliability_note(table.drop(columns=["pareto_k_bad", "pareto_k_bad_psis"])) is None
