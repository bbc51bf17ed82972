"""pb.check_convergence: fit twice as long and compare (the reliable convergence check)."""

import statistics
import warnings

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training.convergence_check import estimate_objective, objective_draws


@pytest.fixture(scope="module")
def regression():
    torch.manual_seed(0)
    x = torch.randn(100, 5)
    return x, x @ torch.randn(5, 1) + 0.3 * torch.randn(100, 1)


def _make_meanfield():
    model = pb.BNN(nn.Linear(5, 1), likelihood="gaussian", noise=0.3)
    return model, pb.guides.MeanField(model)


def test_estimate_objective_weights_minibatches_into_one_unbiased_estimate(regression):
    """Minibatches of 7 (uneven: 14 of 7 and one of 2) and one full batch estimate the same
    ELBO: the means agree within 4 combined standard errors (400 draws each).  Summing the
    batch losses instead of weighting them by B/N would count the KL 15 times (off by
    hundreds of nats here)."""
    model, guide = _make_meanfield()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, regression, epochs=50, batch_size=100, seed=0, progress=False)
    torch.manual_seed(1)
    full, full_se = estimate_objective(model, guide, regression, num_samples=400, eval_batch_size=100)
    batched, batched_se = estimate_objective(model, guide, regression, num_samples=400, eval_batch_size=7)
    assert full_se > 0 and batched_se > 0
    assert abs(full - batched) < 4 * (full_se ** 2 + batched_se ** 2) ** 0.5
    # the reference: the guide's own objective on the whole data, averaged
    objective = pb.guides.guide_contract(guide).make_objective(1)
    from pyro_bnn.contract.local_params import local_params
    with torch.no_grad(), local_params(model, guide):
        ref = -sum(float(objective(model, guide, *regression, num_data=100)) for _ in range(2000)) / 2000
    assert abs(full - ref) < 4 * full_se + 0.05


def test_objective_draws_are_the_passes_estimate_objective_averages(regression):
    """``objective_draws`` gives the independent per-pass estimates (distinct for a stochastic
    guide) whose mean and standard error ``estimate_objective`` reports: at the same seed, the
    same numbers to the last bit.  One draw is allowed; a standard error needs two."""
    model, guide = _make_meanfield()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, regression, epochs=5, batch_size=100, seed=0, progress=False)
    torch.manual_seed(3)
    draws = objective_draws(model, guide, regression, num_samples=6, eval_batch_size=30)
    torch.manual_seed(3)
    mean, se = estimate_objective(model, guide, regression, num_samples=6, eval_batch_size=30)
    assert len(draws) == 6 and len(set(draws)) == 6
    assert mean == statistics.fmean(draws)
    assert se == statistics.stdev(draws) / 6 ** 0.5
    assert len(objective_draws(model, guide, regression, num_samples=1)) == 1
    with pytest.raises(ValueError, match="num_samples"):
        estimate_objective(model, guide, regression, num_samples=1)


def test_estimate_objective_leaves_out_the_laplace_prior_normaliser():
    """Laplace's MAP objective is deterministic: batched and full estimates are equal and
    equal −(loss − loss_constant) of the objective on all the data."""
    d = pb.datasets.digits()
    x, y = d.train[0][:200], d.train[1][:200]
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10)))
    guide = pb.guides.Laplace(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=3, batch_size=50, seed=0, progress=False)
    full, se = estimate_objective(model, guide, (x, y), num_samples=2, eval_batch_size=200)
    batched, _ = estimate_objective(model, guide, (x, y), num_samples=2, eval_batch_size=33)
    assert se == 0.0
    assert batched == pytest.approx(full, rel=1e-5)
    from pyro_bnn.contract.local_params import local_params
    with torch.no_grad(), local_params(model, guide):
        loss, extras = pb.guides.guide_contract(guide).make_objective(1)(model, guide, x, y, num_data=200)
    assert float(extras["loss_constant"]) > 0.5 * float(loss)  # most of the loss: it must be left out
    assert full == pytest.approx(-(float(loss) - float(extras["loss_constant"])), rel=1e-5)
    # num_data: the objective scaled to a larger data set (as fit's num_data=)
    scaled, _ = estimate_objective(model, guide, (x, y), num_samples=2, eval_batch_size=33, num_data=400)
    with torch.no_grad(), local_params(model, guide):
        loss, extras = pb.guides.guide_contract(guide).make_objective(1)(model, guide, x, y, num_data=400)
    assert scaled == pytest.approx(-(float(loss) - float(extras["loss_constant"])), rel=1e-5)
    assert scaled < full - 10


def test_check_convergence_flags_a_short_fit_and_passes_a_long_one(regression):
    """30 epochs at lr 1e-2: the 60-epoch fit ends 40 % higher (the converged ELBO is about
    −51; these are about −1,400 and −1,000) — not enough, with a ConvergenceWarning.  300
    epochs at the default lr: 600 epochs change the ELBO by well under 2 %."""
    with pytest.warns(pb.ConvergenceWarning, match="30 epochs are not enough"):
        short = pb.check_convergence(_make_meanfield, regression, epochs=30, lr=1e-2, batch_size=100)
    assert not short.converged and short.epochs == (30, 60)
    assert short.relative_gain > 0.2 and short.objective[1] > short.objective[0]
    assert [len(f.history["loss"]) for f in short.fits] == [30, 60]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.ConvergenceWarning)
        long = pb.check_convergence(_make_meanfield, regression, epochs=300, batch_size=100, num_samples=128)
    assert long.converged and abs(long.relative_gain) < 0.02, long.message()
    assert long.objective[1] > -60 and "300 epochs are enough" in long.message()
    # the longer fit's model and guide are returned, trained, and usable
    assert len(long.fits[1].history["loss"]) == 600
    mean = pb.predict(long.model, long.guide, regression[0], num_samples=50)
    assert torch.mean((mean.mean(0) - regression[1]) ** 2) < 0.2


def test_check_convergence_does_not_call_a_noisy_comparison_enough(regression):
    """300 vs 600 epochs is enough (above, with 128 passes); with 4 passes the two standard
    errors of the relative gain exceed the 2 % tolerance, so the check cannot tell and says so."""
    with pytest.warns(pb.ConvergenceWarning, match="too noisy to tell"):
        noisy = pb.check_convergence(_make_meanfield, regression, epochs=300, batch_size=100, num_samples=4)
    assert not noisy.converged and 2 * noisy.relative_gain_se > noisy.tolerance


def test_check_convergence_uses_the_same_initialisation_for_both_lengths(regression):
    """Both make() calls start from the same seed: the two fits start equal; the caller's
    random stream is not advanced."""
    starts = []

    def make():
        model, guide = _make_meanfield()
        starts.append(model.net.weight.detach().clone())
        return model, guide

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    pb.check_convergence(make, regression, epochs=20, batch_size=100, warn=False, seed=3)
    torch.testing.assert_close(starts[0], starts[1])
    torch.testing.assert_close(torch.rand(3), expected)  # the caller's stream is left as it was


def test_check_convergence_rejects_bad_arguments(regression):
    with pytest.raises(TypeError, match="callable"):
        pb.check_convergence(_make_meanfield(), regression, epochs=10)
    with pytest.raises(TypeError, match="cannot share it"):
        pb.check_convergence(_make_meanfield, regression, epochs=10, checkpoint="x.pt")
    with pytest.raises(ValueError, match="factor"):
        pb.check_convergence(_make_meanfield, regression, epochs=10, factor=1)
    pair = _make_meanfield()
    with pytest.raises(ValueError, match="fresh"):
        pb.check_convergence(lambda: pair, regression, epochs=2, batch_size=100)
    with pytest.raises(TypeError, match=r"\(model, guide\) tuple"):
        pb.check_convergence(lambda: pair[0], regression, epochs=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_check_convergence_on_cuda(regression):
    """Both fits, the parameter-move record of the diagnosis and the objective estimate run on
    the GPU, and the verdict matches the CPU's for a clearly converged length."""
    check = pb.check_convergence(_make_meanfield, regression, epochs=300, batch_size=100, device="cuda",
                                 num_samples=128)
    assert check.converged, check.message()
    assert next(check.guide.parameters()).device.type == "cuda"
    assert check.fits[1].convergence.measures["param_limited_share"] == 0.0
    assert check.objective[1] > -60
