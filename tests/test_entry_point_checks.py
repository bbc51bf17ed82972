"""One data check at every entry point that takes data (issue 23).

``pb.evaluate``, ``pb.predict``, ``pb.to_arviz``, ``pb.compare``'s test split, the Laplace
curvature / evidence / grid search / GLM predictive and ``learn_invariance`` check their
data with :func:`pyro_bnn.data.batches.check_data`, the check ``pb.fit`` runs: bad labels and
targets get a ``TypeError``/``ValueError`` naming the entry point, what was expected and
what was received, instead of a crash inside torch or a silently wrong number.
"""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_bnn as pb
from pyro_bnn.invariance import learn_invariance

N, D, C = 40, 8, 10


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)


def _classifier():
    torch.manual_seed(0)
    return pb.BNN(nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, C)), "categorical")


@pytest.fixture(scope="module")
def laplace():
    x, y = _data()
    model = _classifier()
    guide = pb.guides.Laplace(model)
    guide.fit_curvature((x, y))
    return model, guide, x, y


@pytest.fixture(scope="module")
def meanfield():
    x, y = _data()
    model = _classifier()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=1, progress=False)
    return model, guide, x, y


def _bad_labels(kind, y):
    y = y.clone()
    if kind == "ignore_index":
        y[3] = -100
    elif kind == "label_C":
        y[3] = C
    elif kind == "float":
        return y.float()
    elif kind == "column":
        return y[:, None]
    return y


BAD_LABELS = [
    ("ignore_index", ValueError, r"labels must lie in \[0, 9\].*got labels in \[-100, 9\].*ignore_index"),
    ("label_C", ValueError, r"labels must lie in \[0, 9\] for a network with 10 outputs; got labels in \[0, 10\]"),
    ("float", TypeError, r"expects integer class labels, got dtype torch.float32"),
    ("column", ValueError, r"labels must have shape \(N,\), got \(40, 1\)"),
]


# ------------------------------------------------------------------ Laplace entry points
def _laplace_entry(name, laplace):
    model, guide, x, _ = laplace
    if name == "fit_curvature":
        return "Laplace.fit_curvature", lambda y: pb.guides.Laplace(_classifier()).fit_curvature((x, y))
    if name == "fit_curvature_loader":
        return ("batch 1 of the DataLoader given to Laplace.fit_curvature",
                lambda y: pb.guides.Laplace(_classifier()).fit_curvature(DataLoader(TensorDataset(x, y), batch_size=50)))
    if name == "optimize_prior_precision":
        return "Laplace.fit_curvature", lambda y: pb.guides.Laplace(_classifier()).optimize_prior_precision(
            (x, y), steps=2)
    if name == "gridsearch":
        return "the validation data of Laplace.validation_nll", lambda y: guide.optimize_prior_precision(
            method="gridsearch", val=(x, y), grid=[0.5, 2.0])
    if name == "evaluate_glm":
        return "pb.evaluate", lambda y: pb.evaluate(model, guide, x, y, predictive="glm")
    if name == "to_arviz_glm":
        return "pb.to_arviz", lambda y: pb.to_arviz(model, guide, x, y, num_samples=2)
    raise AssertionError(name)


LAPLACE_ENTRIES = ["fit_curvature", "fit_curvature_loader", "optimize_prior_precision", "gridsearch",
                   "evaluate_glm", "to_arviz_glm"]


@pytest.mark.parametrize("entry", LAPLACE_ENTRIES)
@pytest.mark.parametrize("kind, error, pattern", BAD_LABELS)
def test_laplace_entry_points_refuse_bad_labels(laplace, entry, kind, error, pattern):
    where, call = _laplace_entry(entry, laplace)
    _, guide, _, y = laplace
    delta = guide.prior_precision.clone()
    with pytest.raises(error, match=rf"y in {where}: .*" + pattern):
        call(_bad_labels(kind, y))
    assert torch.equal(guide.prior_precision, delta)        # the grid search stored nothing


def test_curvature_functions_refuse_ignore_index_below_the_guide(laplace):
    """The low-level functions check too: cross_entropy would drop −100 from the evidence."""
    from pyro_bnn.curvature import glm_log_predictive, pointwise_log_likelihood
    f = torch.randn(N, C)
    _, _, _, y = laplace
    bad = _bad_labels("ignore_index", y)
    with pytest.raises(ValueError, match=r"\[-100, 9\]"):
        pointwise_log_likelihood("categorical", f, bad)
    with pytest.raises(ValueError, match=r"\[-100, 9\]"):
        glm_log_predictive(f, torch.zeros(N, C, C), bad, "categorical")
    with pytest.raises(TypeError, match="integer class labels"):
        pointwise_log_likelihood("categorical", f, y.float())
    with pytest.raises(ValueError, match=r"bernoulli targets must be 0 or 1.*got 0.7"):
        pointwise_log_likelihood("bernoulli", f[:, :1], torch.tensor([0.7] + [1.0] * (N - 1))[:, None])


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_int32_and_uint8_labels_are_accepted_and_equal_int64(laplace, meanfield, dtype):
    model, guide, x, y = laplace
    small = y.to(dtype)
    a = pb.guides.Laplace(_classifier()).fit_curvature((x, y))
    b = pb.guides.Laplace(_classifier()).fit_curvature((x, small))
    assert float(a.log_evidence()) == float(b.log_evidence())
    c = pb.guides.Laplace(_classifier()).fit_curvature(DataLoader(TensorDataset(x, small), batch_size=16))
    torch.testing.assert_close(c.log_evidence(), a.log_evidence(), rtol=1e-6, atol=1e-4)
    assert (pb.evaluate(model, guide, x, small, predictive="glm_probit")
            == pb.evaluate(model, guide, x, y, predictive="glm_probit"))
    torch.manual_seed(5)
    mc_small = pb.evaluate(model, guide, x, small, predictive="glm")
    torch.manual_seed(5)
    assert mc_small == pb.evaluate(model, guide, x, y, predictive="glm")
    assert torch.equal(guide.validation_nll(x, small, [1.0, 3.0]), guide.validation_nll(x, y, [1.0, 3.0]))
    mm, mg, *_ = meanfield
    torch.manual_seed(3)
    ref = pb.evaluate(mm, mg, x, y, num_samples=4)
    torch.manual_seed(3)
    assert pb.evaluate(mm, mg, x, small, num_samples=4) == ref
    for m, g in ((model, guide), (mm, mg)):
        ll = pb.to_arviz(m, g, x, y, num_samples=3, seed=1)["log_likelihood"]["obs"].values
        ll_small = pb.to_arviz(m, g, x, small, num_samples=3, seed=1)["log_likelihood"]["obs"].values
        assert (ll == ll_small).all()


# ------------------------------------------------------------------ evaluate / to_arviz
@pytest.mark.parametrize("kind, error, pattern", BAD_LABELS)
@pytest.mark.parametrize("entry", ["pb.evaluate", "pb.to_arviz"])
def test_sampled_entry_points_refuse_bad_labels(meanfield, entry, kind, error, pattern):
    model, guide, x, y = meanfield
    call = (lambda yy: pb.evaluate(model, guide, x, yy, num_samples=2)) if entry == "pb.evaluate" else \
        (lambda yy: pb.to_arviz(model, guide, x, yy, num_samples=2))
    with pytest.raises(error, match=rf"y in {entry}: .*" + pattern):
        call(_bad_labels(kind, y))


@pytest.fixture(scope="module")
def regression():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, D, generator=g), torch.randn(N, 2, generator=g)
    torch.manual_seed(0)
    model = pb.BNN(nn.Linear(D, 2), "gaussian", noise=0.5)
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=1, progress=False)
    torch.manual_seed(0)
    lap_model = pb.BNN(nn.Linear(D, 2), "gaussian", noise=0.5)
    lap = pb.guides.Laplace(lap_model).fit_curvature((x, y))
    return (model, guide), (lap_model, lap), x, y


def _regression_calls(regression):
    (m, g), (lm, lg), x, _ = regression
    return {"pb.evaluate": lambda yy: pb.evaluate(m, g, x, yy, num_samples=2),
            "pb.to_arviz": lambda yy: pb.to_arviz(m, g, x, yy, num_samples=2),
            "pb.evaluate glm": lambda yy: pb.evaluate(lm, lg, x, yy, predictive="glm"),
            "Laplace.fit_curvature": lambda yy: pb.guides.Laplace(lm).fit_curvature((x, yy))}


@pytest.mark.parametrize("entry", ["pb.evaluate", "pb.to_arviz", "pb.evaluate glm", "Laplace.fit_curvature"])
def test_regression_targets_nan_and_wrong_width_are_refused(regression, entry):
    call = _regression_calls(regression)[entry]
    y = regression[3]
    where = entry.split()[0]
    nan = y.clone()
    nan[5, 1] = math.nan
    with pytest.raises(ValueError, match=rf"y in {where} contains 1 NaN/inf values; expected finite numbers"):
        call(nan)
    for width in (1, 3):
        with pytest.raises(ValueError, match=rf"y in {where}: targets must have shape \(N, 2\) like the "
                                             rf"network output, got \(40, {width}\)"):
            call(torch.randn(N, width))
    with pytest.raises(TypeError, match=rf"y in {where}: gaussian likelihood expects floating-point targets"):
        call(y.long())


def test_one_output_targets_of_shape_n_equal_n_by_1():
    """(N,) targets of a one-output Gaussian were broadcast against (N, 1) by to_arviz: an
    (N, N) log-likelihood summed into a wrong total.  Now they equal the (N, 1) results."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, D, generator=g)
    y = x[:, :1] * 2
    torch.manual_seed(0)
    model = pb.BNN(nn.Linear(D, 1), "gaussian", noise=0.5)
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=1, progress=False)
    a = pb.to_arviz(model, guide, x, y, num_samples=3, seed=0)["log_likelihood"]["obs"].values
    b = pb.to_arviz(model, guide, x, y[:, 0], num_samples=3, seed=0)["log_likelihood"]["obs"].values
    assert a.shape == b.shape == (1, 3, N) and (a == b).all()


def test_bernoulli_targets_must_be_exactly_0_or_1():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g)
    y = (torch.rand(N, 1, generator=g) > 0.5).float()
    torch.manual_seed(0)
    model = pb.BNN(nn.Linear(D, 1), "bernoulli")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=1, progress=False)
    lap = pb.guides.Laplace(model).fit_curvature((x, y))
    soft = y.clone()
    soft[4] = 0.7           # was scored as label 0 by pb.evaluate (y.long())
    pattern = r"bernoulli targets must be 0 or 1.*got 0.7 at flat index 4; expected exactly 0 or 1"
    with pytest.raises(ValueError, match=r"y in pb.evaluate: " + pattern):
        pb.evaluate(model, guide, x, soft, num_samples=2)
    with pytest.raises(ValueError, match=r"y in pb.to_arviz: " + pattern):
        pb.to_arviz(model, guide, x, soft, num_samples=2)
    with pytest.raises(ValueError, match=r"y in pb.evaluate: " + pattern):
        pb.evaluate(model, lap, x, soft, predictive="glm")
    with pytest.raises(ValueError, match=r"y in Laplace.fit_curvature: " + pattern):
        pb.guides.Laplace(model).fit_curvature((x, soft))
    torch.manual_seed(4)
    ref = pb.evaluate(model, guide, x, y, num_samples=3)
    torch.manual_seed(4)
    assert pb.evaluate(model, guide, x, y[:, 0], num_samples=3) == ref     # (N,) for one output


def test_inputs_are_checked_by_predict_and_the_glm_evaluate(laplace):
    model, guide, x, y = laplace
    bad = x.clone()
    bad[0, 0] = math.nan                # the GLM evaluate returned nll = nan
    with pytest.raises(ValueError, match="x in pb.evaluate contains 1 NaN/inf"):
        pb.evaluate(model, guide, bad, y, predictive="glm")
    with pytest.raises(ValueError, match="x in pb.predict contains 1 NaN/inf"):
        pb.predict(model, guide, bad, predictive="glm")
    with pytest.raises(ValueError, match=r"x and y in pb.evaluate must have the same length, got 40 inputs and 80"):
        pb.evaluate(model, guide, x, torch.cat([y, y]), predictive="glm")


def test_compare_checks_the_test_split_before_training():
    x, y = _data()
    bad = _bad_labels("ignore_index", y)
    with pytest.raises(ValueError, match=r"y in pb.compare's test split: labels must lie in \[0, 9\].*-100"):
        pb.compare(_classifier, ["laplace"], ((x, y), (x, bad)), epochs=1, errors="raise", progress=False)


def test_metrics_refuse_labels_they_would_misread():
    probs = torch.full((2, 4, 3), 1 / 3)
    ok = pb.metrics.classification_metrics(probs, torch.tensor([0, 1, 2, 0]))
    assert pb.metrics.classification_metrics(probs, torch.tensor([0, 1, 2, 0], dtype=torch.int32)) == ok
    with pytest.raises(TypeError, match="expected integer class labels, got dtype torch.float32"):
        pb.metrics.classification_metrics(probs, torch.tensor([0.0, 1.0, 2.0, 0.7]))
    with pytest.raises(ValueError, match=r"expected labels in \[0, 2\], got labels in \[-1, 2\]"):
        pb.metrics.classification_metrics(probs, torch.tensor([0, 1, 2, -1]))
    with pytest.raises(ValueError, match=r"expected labels of shape \(4,\), got \(4, 1\)"):
        pb.metrics.classification_metrics(probs, torch.tensor([[0], [1], [2], [0]]))
    with pytest.raises(ValueError, match="targets contain 1 NaN/inf"):
        pb.metrics.regression_metrics(torch.zeros(2, 3), torch.ones(()), torch.tensor([0.0, math.nan, 1.0]))


# ------------------------------------------------------------------ post-hoc evidence
def test_posthoc_prior_learning_never_stores_nan(laplace):
    _, _, x, y = laplace
    guide = pb.guides.Laplace(_classifier()).fit_curvature((x, y))
    start = guide.prior_precision.clone()
    with pytest.warns(RuntimeWarning, match=r"evidence step \d+ of 50: .*restored.*smaller lr=1000"):
        value = guide.optimize_prior_precision(steps=50, lr=1e3)
    assert torch.isfinite(guide.prior_precision).all() and (guide.prior_precision > 0).all()
    assert math.isfinite(value) and value == float(guide.log_evidence())
    # before, δ became NaN; a sane run from the same start moves it and improves the evidence
    sane = pb.guides.Laplace(_classifier()).fit_curvature((x, y))
    assert torch.equal(sane.prior_precision, start)
    assert sane.optimize_prior_precision(steps=50, lr=0.1) >= float(sane.log_evidence(start)) - 1e-3


@pytest.mark.parametrize("steps, lr, error, pattern", [
    (0, 0.1, ValueError, r"steps must be an int >= 1, got 0"),
    (2.5, 0.1, TypeError, r"steps must be an int >= 1, got 2.5 \(float\)"),
    (10, 0.0, ValueError, r"lr must be a finite number > 0, got 0.0"),
    (10, math.nan, ValueError, r"lr must be a finite number > 0, got nan"),
    (10, math.inf, ValueError, r"lr must be a finite number > 0, got inf"),
])
def test_posthoc_steps_and_lr_are_checked(laplace, steps, lr, error, pattern):
    guide = laplace[1]
    with pytest.raises(error, match=pattern):
        guide.optimize_prior_precision(steps=steps, lr=lr)


@pytest.mark.parametrize("delta", [0.0, -1.0, math.nan, math.inf])
def test_log_evidence_refuses_nonpositive_or_nonfinite_prior_precision(laplace, delta):
    guide = laplace[1]
    with pytest.raises(ValueError, match=r"prior precision δ must be finite and > 0, got "):
        guide.log_evidence(torch.tensor(delta))
    assert math.isfinite(float(guide.log_evidence(torch.tensor(1.0))))


# ------------------------------------------------------------------ learn_invariance
def _invariance(data, **kw):
    options = dict(method="none", epochs=2, batch_size=16, seed=0)
    options.update(kw)
    return learn_invariance(_classifier(), data, **options)


def test_learn_invariance_refuses_bad_data():
    x, y = _data()
    bad = x.clone()
    bad[2, 3] = math.nan                  # trained to NaN weights silently
    with pytest.raises(ValueError, match="x in learn_invariance contains 1 NaN/inf values"):
        _invariance((bad, y))
    with pytest.raises(ValueError, match=r"x and y must have the same length, got 40 and 80"):
        _invariance((x, torch.cat([y, y])))  # was accepted: 80 labels for 40 inputs
    with pytest.raises(ValueError, match=r"y in learn_invariance: labels must lie in \[0, 9\]"):
        _invariance((x, _bad_labels("ignore_index", y)))
    with pytest.raises(ValueError, match="needs targets"):
        _invariance(x)
    with pytest.raises(TypeError, match=r"y in batch 1 of the DataLoader given to learn_invariance: .*integer"):
        _invariance(DataLoader(TensorDataset(x, y.float().clamp(max=9) + 0.5), batch_size=16))


@pytest.mark.parametrize("option, value, error, pattern", [
    ("every", 0, ValueError, r"every must be an int >= 1, got 0"),      # failed after the burn-in
    ("burnin", -1, ValueError, r"burnin must be an int >= 0, got -1"),
    ("epochs", 2.5, TypeError, r"epochs must be an int >= 1, got 2.5 \(float\)"),
    ("batch_size", 0, ValueError, r"batch_size must be an int >= 1, got 0"),
    ("lr", math.nan, ValueError, r"lr must be a finite number > 0, got nan"),
    ("delta_lr", -0.1, ValueError, r"delta_lr must be a finite number > 0, got -0.1"),
    ("eta_steps", True, TypeError, r"eta_steps must be an int >= 1, got True"),
])
def test_learn_invariance_checks_its_arguments(option, value, error, pattern):
    with pytest.raises(error, match=pattern):
        _invariance(_data(), **{option: value})


def test_learn_invariance_accepts_a_dataloader_and_a_tensordataset():
    x, y = _data()
    ref = _invariance((x, y), burnin=0)
    same = _invariance(TensorDataset(x, y), burnin=0)
    assert all(torch.equal(ref.values[k], same.values[k]) for k in ref.values)
    assert ref.history["log_evidence"] == same.history["log_evidence"]
    # one full batch: the same steps as the tensors (up to summation order within the batch)
    full = _invariance((x, y), batch_size=N, burnin=0)
    loaded = _invariance(DataLoader(TensorDataset(x, y.int()), batch_size=N), batch_size=N, burnin=0)
    for k in full.values:
        torch.testing.assert_close(loaded.values[k], full.values[k], rtol=1e-4, atol=1e-5)
    assert len(loaded.history["log_evidence"]) == 2
    torch.testing.assert_close(torch.tensor(loaded.history["log_evidence"]),
                               torch.tensor(full.history["log_evidence"]), rtol=1e-4, atol=1e-3)


class _NaNAfter(nn.Module):
    """Identity until its ``limit``-th call, then NaN: a divergence on cue."""

    def __init__(self, limit):
        super().__init__()
        self.calls, self.limit = 0, limit

    def forward(self, h):
        self.calls += 1
        return h * math.nan if self.calls > self.limit else h


def test_learn_invariance_divergence_restores_the_last_finite_state():
    x, y = _data()
    torch.manual_seed(0)
    # one call by the data check, 3 steps per epoch: NaN in the 2nd step of epoch 4
    trap = _NaNAfter(limit=1 + 3 * 3 + 1)
    model = pb.BNN(nn.Sequential(nn.Linear(D, 6), trap, nn.Tanh(), nn.Linear(6, C)), "categorical")
    seen = {}

    def keep(epoch, result):
        seen[epoch] = {k: v.detach().clone() for k, v in result.values.items()}

    with pytest.raises(FloatingPointError, match=r"the loss became nan in epoch 4 \(step 2\).*end of epoch 3"):
        learn_invariance(model, (x, y), method="none", epochs=6, batch_size=16, burnin=100, callback=keep)
    with pytest.raises(FloatingPointError) as info:
        next(m for m in model.modules() if isinstance(m, _NaNAfter)).calls = 0   # (the BNN's copy)
        learn_invariance(model, (x, y), method="none", epochs=6, batch_size=16, burnin=100)
    result = info.value.result
    assert all(torch.isfinite(v).all() for v in result.values.values())
    assert all(torch.equal(result.values[k], seen[3][k]) for k in result.values)
    assert len(result.history["loss"]) == 3 and all(math.isfinite(v) for v in result.history["loss"])
