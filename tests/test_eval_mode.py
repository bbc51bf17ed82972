"""Issue 24: prediction runs in eval mode and leaves the model and guide as they were.

In train mode a BatchNorm layer normalises with the statistics of the batch it sees (an
input's prediction then depends on the other inputs of its batch) and updates its running
statistics with the data; Dropout drops units.  Every predictive entry point must run the
model and guide in eval mode and restore each module's own ``training`` flag.
"""

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.posterior.prediction import evaluation_mode, sample_latents


@pytest.fixture(scope="module")
def images():
    return pb.datasets.digits(image=True)


def _bn_cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 64, 10))


def _dropout_cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Dropout(0.5),
                         nn.Flatten(), nn.Linear(4 * 64, 10))


def _train(net_fn, guide_name, images):
    """A model trained briefly (400 images) with pb.fit + MeanField or plain SVI + AutoNormal."""
    torch.manual_seed(0)
    x, y = images.x_train[:400], images.y_train[:400]
    model = pb.BNN(net_fn())
    if guide_name == "MeanField":
        guide = pb.guides.MeanField(model)
        with pytest.warns(pb.ConvergenceWarning):
            pb.fit(model, guide, (x, y), epochs=3, batch_size=64, progress=False, seed=0)
    else:
        pyro.clear_param_store()
        guide = AutoNormal(model, init_scale=0.01)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
        for start in range(0, 400, 50):
            svi.step(x[start:start + 50], y[start:start + 50], num_data=400)
    return model, guide


def _state(*modules):
    """Every module's training flag and a copy of every buffer."""
    flags = [m.training for mod in modules for m in mod.modules()]
    buffers = {f"{i}.{k}": v.clone() for i, mod in enumerate(modules) for k, v in mod.named_buffers()}
    return flags, buffers


def _assert_unchanged(before, after):
    assert before[0] == after[0], "training flags changed"
    assert before[1].keys() == after[1].keys()
    for k in before[1]:
        assert torch.equal(before[1][k], after[1][k]), f"buffer {k} changed"


@pytest.mark.parametrize("guide_name", ["MeanField", "AutoNormal"])
@pytest.mark.parametrize("left_in", ["train", "eval"])
def test_batchnorm_prediction_does_not_depend_on_the_batch_nor_change_the_model(images, guide_name, left_in):
    model, guide = _train(_bn_cnn, guide_name, images)
    model.train(left_in == "train")
    bn = model.net[1]
    assert any(k.endswith("running_mean") for k, _ in model.named_buffers())
    # control: in train mode the network's output for 5 inputs depends on their batch,
    # so the comparison below can fail
    values = {k: v.detach() for k, v in sample_latents(model, guide, images.x_test[:1]).items()}
    with torch.no_grad():
        model.train()
        alone = model.run_with(values, images.x_test[:5])
        batch = model.run_with(values, images.x_test[:100])[:5]
    assert (alone - batch).abs().max() > 1e-3
    model.train(left_in == "train")
    bn.running_mean.copy_(torch.linspace(-1, 1, 4))     # known statistics, not the defaults
    before = _state(model, guide)

    torch.manual_seed(1)
    five = pb.predict(model, guide, images.x_test[:5], num_samples=4)
    torch.manual_seed(1)
    hundred = pb.predict(model, guide, images.x_test[:100], num_samples=4, batch_size=100)
    assert five.shape == (4, 5, 10)
    torch.testing.assert_close(five, hundred[:, :5], rtol=0, atol=1e-6)
    _assert_unchanged(before, _state(model, guide))

    scores = pb.evaluate(model, guide, *images.test, num_samples=4)
    assert scores["predictive"] == "sample(4)" and 0.0 <= scores["accuracy"] <= 1.0
    _assert_unchanged(before, _state(model, guide))
    assert int(bn.num_batches_tracked) == int(before[1]["0.net.1.num_batches_tracked"])
    pb.predictive_samples(model, guide, images.x_test[:10], num_samples=2)
    pb.to_arviz(model, guide, images.x_test[:20], images.y_test[:20], num_samples=3)
    _assert_unchanged(before, _state(model, guide))


def test_dropout_is_off_at_prediction(images):
    """With the same draws the predictions of 5 inputs alone and in a batch of 100 agree,
    and two predictions with the same seed are identical (train-mode dropout would make
    them differ)."""
    model, guide = _train(_dropout_cnn, "MeanField", images)
    assert model.training
    torch.manual_seed(3)
    five = pb.predict(model, guide, images.x_test[:5], num_samples=4)
    torch.manual_seed(3)
    hundred = pb.predict(model, guide, images.x_test[:100], num_samples=4)
    torch.testing.assert_close(five, hundred[:, :5], rtol=0, atol=1e-6)
    assert model.training and all(m.training for m in model.modules())
    # control: in train mode the same weights give different outputs (units dropped)
    values = sample_latents(model, guide, images.x_test[:1])
    with torch.no_grad():
        assert not torch.equal(model.run_with(values, images.x_test[:5]),
                               model.run_with(values, images.x_test[:5]))


def test_laplace_glm_on_a_batchnorm_cnn_is_batch_independent(images):
    """Last-layer Laplace of a BatchNorm CNN: the probit GLM (deterministic) of 5 inputs alone
    equals theirs in a batch of 100; the model's flags and buffers are unchanged."""
    torch.manual_seed(0)
    model = pb.BNN(_bn_cnn())
    guide = pb.guides.Laplace(model, subset="last_layer")
    with pytest.warns(pb.ConvergenceWarning):
        pb.fit(model, guide, (images.x_train[:400], images.y_train[:400]), epochs=3, batch_size=64,
               progress=False, seed=0)
    before = _state(model, guide)
    five = pb.predict(model, guide, images.x_test[:5], predictive="glm_probit")
    hundred = pb.predict(model, guide, images.x_test[:100], predictive="glm_probit")
    torch.testing.assert_close(five, hundred[:, :5], rtol=0, atol=1e-6)
    pb.evaluate(model, guide, *images.test, num_samples=8)         # default: Monte-Carlo GLM
    _assert_unchanged(before, _state(model, guide))


def test_evaluation_mode_restores_each_flag_even_on_error():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.1))
    net.train()
    net[2].eval()                       # a mixed state that net.train(flag) could not restore
    with pytest.raises(RuntimeError, match="boom"):
        with evaluation_mode(net, None, lambda x: x):
            assert not any(m.training for m in net.modules())
            raise RuntimeError("boom")
    assert [m.training for m in net.modules()] == [True, True, True, False]


# ---- one predictive per guide (issue 24): pb.evaluate and pb.to_arviz agree

@pytest.fixture(scope="module")
def laplace_digits():
    torch.manual_seed(0)
    split = pb.datasets.digits()
    model = pb.BNN(nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10)))
    guide = pb.guides.Laplace(model, subset="last_layer")
    with pytest.warns(pb.ConvergenceWarning):
        pb.fit(model, guide, (split.x_train[:500], split.y_train[:500]), epochs=10, batch_size=100,
               lr=1e-2, progress=False, seed=0)
    return model, guide, split


def test_evaluate_and_to_arviz_use_the_same_glm_predictive(laplace_digits):
    """Default predictive of a Laplace guide: Monte-Carlo GLM in both, named; their test NLLs
    (log of the mean probability over S draws of the same Gaussian) agree within MC error,
    while the probit link is a different, named predictive."""
    model, guide, split = laplace_digits
    x, y = split.x_test[:200], split.y_test[:200]
    S = 2000
    torch.manual_seed(0)
    scores = pb.evaluate(model, guide, x, y, num_samples=S)
    assert scores["predictive"] == f"glm-mc({S})"
    dt = pb.to_arviz(model, guide, x, y, num_samples=S, seed=0)
    assert dt.attrs["method"] == "glm" and dt.attrs["predictive"] == f"glm-mc({S})"
    ll = torch.as_tensor(dt["log_likelihood"]["obs"].values[0])          # (S, N)
    arviz_nll = float(-(torch.logsumexp(ll, 0) - torch.log(torch.tensor(float(S)))).mean())
    assert abs(scores["nll"] - arviz_nll) < 5e-3, (scores["nll"], arviz_nll)
    probit = pb.evaluate(model, guide, x, y, predictive="glm_probit")
    assert probit["predictive"] == "glm-probit"
    explicit = pb.evaluate(model, guide, x, y, num_samples=S, predictive="glm", link_approx="probit")
    assert explicit["predictive"] == "glm-probit" and explicit["nll"] == probit["nll"]
    with pytest.raises(ValueError, match="glm_probit.*not draws"):
        pb.to_arviz(model, guide, x, y, num_samples=4, predictive="glm_probit")
    assert pb.predict(model, guide, x[:3], num_samples=5).shape == (5, 3, 10)   # MC by default
    assert pb.predict(model, guide, x[:3], predictive="glm_probit").shape == (1, 3, 10)


@pytest.mark.parametrize("call", ["predict", "evaluate", "to_arviz", "predictive_samples"])
def test_prediction_options_are_checked(laplace_digits, call):
    model, guide, split = laplace_digits
    x, y = split.x_test[:10], split.y_test[:10]
    fn = {"predict": lambda **kw: pb.predict(model, guide, x, **kw),
          "evaluate": lambda **kw: pb.evaluate(model, guide, x, y, **kw),
          "to_arviz": lambda **kw: pb.to_arviz(model, guide, x, y, **kw),
          "predictive_samples": lambda **kw: pb.predictive_samples(model, guide, x, **kw)}[call]
    with pytest.raises(TypeError, match=r"num_samples must be an int >= 1, got 2.5 \(float\)"):
        fn(num_samples=2.5)
    with pytest.raises(ValueError, match="num_samples must be an int >= 1, got 0"):
        fn(num_samples=0)
    with pytest.raises(TypeError, match="batch_size must be an int >= 1, got True"):
        fn(num_samples=2, batch_size=True)
    if call != "predictive_samples":
        with pytest.raises(ValueError, match="did you mean 'sample'"):
            fn(num_samples=2, predictive="smaple")
        with pytest.raises(ValueError, match="did you mean 'glm_probit'"):
            fn(num_samples=2, predictive="glm_probt")


def test_mc_glm_draws_survive_a_numerically_indefinite_covariance():
    """Σ_f of float32 Jacobians can be slightly indefinite (Cholesky fails: seen on a
    3-epoch hand-written model once the Monte-Carlo GLM became the default); the draws then
    use the PSD square root of Σ_f: finite, with the right covariance."""
    from pyro_bnn.curvature.glm import glm_predictive

    cov = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]]) - 1e-4 * torch.eye(2)      # eigenvalues 2, -1e-4
    f = torch.zeros(1, 2)
    draws = glm_predictive(f, cov, "gaussian", num_samples=20000,
                           generator=torch.Generator().manual_seed(0))      # (S, 1, 2) draws of f
    assert torch.isfinite(draws).all()
    emp = torch.cov(draws[:, 0].T)
    torch.testing.assert_close(emp, torch.ones(2, 2), rtol=0, atol=0.05)
