"""BatchNorm networks under sampled weights.

1. Plain ``Predictive`` on a ``pb.BNN`` whose BatchNorm layers are in train mode (``pb.fit``
   leaves a new network in train mode) normalises each prediction with its own batch and
   overwrites the running statistics: warned (``BatchNormTrainModeWarning``); so is a user's own
   ``PyroModule`` with BatchNorm, through the pyro_bnn guide that ``Predictive`` runs.
2. ``pb.predict(..., bn_data=x_train)`` re-estimates every BatchNorm layer's statistics under
   each weight draw (SWAG's practice): checked against the statistics computed by hand, for a
   tensor and a loader, with every buffer, momentum and mode restored afterwards.
"""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from helpers import HandWritten, mlp
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.symmetrized import symmetrized_elbo
from pyro_bnn.model.bnn import site_module
from pyro_bnn.posterior import sample_latents
from pyro_bnn.training.convergence_check import estimate_objective


def bn_mlp(hidden=32):
    return nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))


@pytest.fixture(scope="module")
def fitted(request):
    d = pb.datasets.digits()
    torch.manual_seed(0)
    model = pb.BNN(bn_mlp(), "categorical")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (d.x_train, d.y_train), epochs=30, seed=0, progress=False)
    return model, guide, d


def buffers(model):
    return {k: v.clone() for k, v in model.named_buffers()}


def test_predictive_in_train_mode_is_warned(fitted):
    model, guide, d = fitted
    assert model.training  # pb.fit leaves modes as they were
    before = buffers(model)
    with pytest.warns(pb.BatchNormTrainModeWarning, match=r"train mode \(net.1\).*model.eval\(\)"):
        Predictive(model, guide=guide, num_samples=2)(d.x_test[:20])
    moved = max((before[k].float() - v.float()).abs().max().item() for k, v in buffers(model).items())
    assert moved > 0  # what the warning is about: the running statistics were overwritten
    for k, v in before.items():  # put them back for the other tests
        dict(model.named_buffers())[k].copy_(v)
    model.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Predictive(model, guide=guide, num_samples=2)(d.x_test[:20])
    finally:
        model.train()
    for k, v in before.items():
        torch.testing.assert_close(dict(model.named_buffers())[k], v, rtol=0, atol=0)


def test_no_warning_without_batchnorm_or_with_observations(fitted):
    _, _, d = fitted
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Predictive(model, guide=guide, num_samples=2)(d.x_test[:20])  # MC dropout: train mode is wanted
        bn_model = pb.BNN(bn_mlp(), "categorical")
        bn_model(d.x_train[:20], d.y_train[:20])  # training call: batch statistics are right


def _hand_recalibrated(model, latents, x_bn, x):
    """The draw's network with BatchNorm normalised by the mean and unbiased variance of its
    pre-activations on ``x_bn`` (one batch), by hand."""
    w1, b1 = latents["net.0.weight"], latents["net.0.bias"]
    w2, b2 = latents["net.3.weight"], latents["net.3.bias"]
    bn = model.net[1]
    h_bn = x_bn @ w1.T + b1
    mean, var = h_bn.mean(0), h_bn.var(0, unbiased=True)
    h = (x @ w1.T + b1 - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
    return torch.softmax(h.relu() @ w2.T + b2, -1)


def test_bn_data_recalibrates_each_draw_and_restores_everything(fitted):
    model, guide, d = fitted
    x_bn, x = d.x_train[:500], d.x_test[:50]
    before, momentum = buffers(model), model.net[1].momentum
    torch.manual_seed(3)
    probs = pb.predict(model, guide, x, num_samples=3, bn_data=x_bn, batch_size=1000)
    torch.manual_seed(3)
    with local_params(model, guide), torch.no_grad():
        ref = []
        for _ in range(3):
            latents = sample_latents(model, guide, x[:1])
            ref.append(_hand_recalibrated(model, latents, x_bn, x))
    torch.testing.assert_close(probs, torch.stack(ref), rtol=1e-4, atol=1e-5)
    assert model.net[1].momentum == momentum and model.training and model.net[1].training
    for k, v in before.items():
        torch.testing.assert_close(dict(model.named_buffers())[k], v, rtol=0, atol=0)
    # the running statistics of training give other predictions (what bn_data corrects)
    torch.manual_seed(3)
    plain = pb.predict(model, guide, x, num_samples=3)
    assert (plain - probs).abs().max() > 1e-2
    # a loader over (x, y) batches is the same as the tensor cut into the same batches
    loader = DataLoader(TensorDataset(x_bn, d.y_train[:500]), batch_size=100)
    torch.manual_seed(3)
    from_loader = pb.predict(model, guide, x, num_samples=3, bn_data=loader)
    torch.manual_seed(3)
    from_tensor = pb.predict(model, guide, x, num_samples=3, bn_data=x_bn, batch_size=100)
    torch.testing.assert_close(from_loader, from_tensor, rtol=0, atol=0)
    scores = pb.evaluate(model, guide, x, d.y_test[:50], num_samples=3, bn_data=x_bn)
    assert 0 <= scores["nll"] < 5
    # ArviZ: each draw's pointwise log-likelihood is that of its recalibrated network
    tree = pb.to_arviz(model, guide, x, d.y_test[:50], num_samples=3, bn_data=x_bn, seed=5,
                       posterior_predictive=False)
    loglik = torch.as_tensor(tree["log_likelihood"]["obs"].values[0])
    post = tree["posterior"]
    for s in range(3):
        latents = {name: torch.as_tensor(post[name].values[0, s]) for name in model.site_names}
        ref = _hand_recalibrated(model, latents, x_bn, x)
        torch.testing.assert_close(loglik[s], ref.log()[torch.arange(50), d.y_test[:50]].double(),
                                   rtol=1e-4, atol=1e-4)
    for k, v in before.items():
        torch.testing.assert_close(dict(model.named_buffers())[k], v, rtol=0, atol=0)


def test_bn_data_improves_the_fit_on_digits(fitted):
    """Fixed seeds; measured NLL 0.166 → 0.119 on a 100-epoch fit (docs/pyro.md, the benchmark):
    here 30 epochs, required: lower NLL and ECE on all 449 test digits."""
    model, guide, d = fitted
    torch.manual_seed(1)
    plain = pb.evaluate(model, guide, d.x_test, d.y_test, num_samples=30)
    torch.manual_seed(1)
    recal = pb.evaluate(model, guide, d.x_test, d.y_test, num_samples=30, bn_data=d.x_train)
    assert recal["nll"] < plain["nll"] and recal["ece"] < plain["ece"]


def test_bn_data_mistakes_are_named(fitted):
    model, guide, d = fitted
    with pytest.raises(ValueError, match="no BatchNorm layer"):
        plain = pb.BNN(mlp(), "categorical")
        pb.predict(plain, pb.guides.MeanField(plain), d.x_test[:5], num_samples=2, bn_data=d.x_train)
    with pytest.raises(TypeError, match="tensor of inputs or an iterable"):
        pb.predict(model, guide, d.x_test[:5], num_samples=2, bn_data=3.0)
    with pytest.raises(ValueError, match="at least 2 inputs"):
        pb.predict(model, guide, d.x_test[:5], num_samples=2, bn_data=d.x_train[:1])
    with pytest.raises(TypeError, match="needs a pb.BNN"):
        hand = HandWritten()
        pb.predict(hand, pyro_autonormal(hand), d.x_test[:5], num_samples=2, bn_data=d.x_train)
    laplace_model = pb.BNN(bn_mlp(), "categorical")
    laplace = pb.guides.Laplace(laplace_model)
    with pytest.raises(ValueError, match="linearises the network at its MAP"):
        pb.predict(laplace_model, laplace, d.x_test[:5], num_samples=2, predictive="glm", bn_data=d.x_train)
    with pytest.raises(ValueError, match="per weight draw of a pb.BNN under predictive='sample'"):
        pb.to_arviz(laplace_model, laplace, d.x_test[:5], d.y_test[:5], num_samples=2, predictive="glm",
                    bn_data=d.x_train)


def pyro_autonormal(model):
    from pyro.infer.autoguide import AutoNormal

    return AutoNormal(model)


def test_tensor_batches_never_end_in_one_row():
    from pyro_bnn.posterior.batchnorm import bn_input_batches

    assert [len(b) for b in bn_input_batches(torch.zeros(2049, 3), 1024)] == [1024, 1025]
    assert [len(b) for b in bn_input_batches(torch.zeros(2050, 3), 1024)] == [1024, 1024, 2]
    assert [len(b) for b in bn_input_batches(torch.zeros(5, 3), 1024)] == [5]


@pytest.mark.parametrize("layers, warned", [
    ([nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 10)], ["net.0"]),
    ([nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.MaxPool2d(2), nn.Dropout(0.1), nn.BatchNorm2d(4),
      nn.ReLU(), nn.Flatten(), nn.Linear(36, 10)], ["net.1"]),
    ([nn.Linear(64, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 10)], []),   # the bias breaks the invariance
    ([nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)], []),
], ids=["direct", "through-pool-dropout", "relu-between", "no-batchnorm"])
def test_weight_norm_feeding_batchnorm_is_warned(layers, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pb.BNN(nn.Sequential(*layers), "categorical", weight_norm=True)
    messages = [str(w.message) for w in caught if "feed BatchNorm" in str(w.message)]
    if warned:
        assert len(messages) == 1 and f"({', '.join(warned)})" in messages[0] and "bn_data" in messages[0]
    else:
        assert messages == []


def test_weight_norm_scales_feeding_batchnorm_do_not_change_the_likelihood():
    """The warning's premise, exactly: in training (train mode: batch statistics) scaling the
    scales g of a layer that feeds BatchNorm (through a max-pool) by a positive factor leaves the
    log-likelihood unchanged, while scaling the last layer's changes it; with a ReLU (after the
    bias) between, it changes too, which is why that arrangement is not warned about."""
    d = pb.datasets.digits()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = pb.BNN(nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.MaxPool2d(2),
                                     nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 10)),
                       "categorical", weight_norm=True)
        relu_first = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 10)),
                            "categorical", weight_norm=True)
    x, y = d.x_train[:200], d.y_train[:200]

    def log_lik(net, scaled_site, factor):
        torch.manual_seed(1)
        values = {s: torch.rand(site_module(net, s)[0].weight_g.shape) + 0.5 for s in net.site_names}
        v = {s: t * factor if s == scaled_site else t for s, t in values.items()}
        with torch.no_grad():
            logits = net.run_with(v, x)
        return float(torch.distributions.Categorical(logits=logits).log_prob(y).sum())

    base = log_lik(model, None, 1.0)
    assert log_lik(model, "net.1.weight_g", 3.0) == pytest.approx(base, rel=1e-3)  # BatchNorm eps
    assert log_lik(model, "net.1.weight_g", 0.5) == pytest.approx(base, rel=1e-3)  # BatchNorm eps
    assert abs(log_lik(model, "net.6.weight_g", 3.0) - base) > 1.0
    assert abs(log_lik(relu_first, "net.0.weight_g", 3.0) - log_lik(relu_first, None, 1.0)) > 1.0


@pytest.mark.parametrize("subset, marglik, warned", [
    ("all", True, True), ("last_layer", True, False), ("all", False, False), ("all", "by hand", True),
], ids=["all-marglik", "last-layer-marglik", "all-fixed-prior", "all-optimize-by-hand"])
def test_laplace_evidence_on_normalised_layers_is_warned(subset, marglik, warned):
    """The evidence of a layer that feeds BatchNorm is not a mode's volume (Antorán et al. 2022;
    measured on the Fashion-MNIST BatchNorm CNN): warned when the evidence tunes that layer's
    prior (online, or by ``optimize_prior_precision`` after the fit), not for a last-layer
    Laplace nor for a fixed prior."""
    d = pb.datasets.digits()
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron", subset=subset)
    options = pb.MarglikOptions(every=2, burnin=0, steps=5) if marglik is True else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pb.fit(model, guide, (d.x_train[:300], d.y_train[:300]), epochs=2, progress=False, marglik=options)
        if marglik == "by hand":
            guide.optimize_prior_precision(steps=5)
    messages = [str(w.message) for w in caught if "feed a normalisation layer" in str(w.message)]
    if warned:
        assert len(messages) == 1 and "(net.0)" in messages[0]
    else:
        assert messages == []


def test_layers_feeding_normalization_finds_every_kind():
    from pyro_bnn.model.batchnorm import layers_feeding_normalization

    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                        nn.Sequential(nn.Linear(36, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(),
                                      nn.BatchNorm1d(8), nn.Linear(8, 2)))
    assert [path for path, _ in layers_feeding_normalization(net)] == ["0", "4.0"]


@pytest.mark.parametrize("bound", ["estimate_objective", "symmetrized_elbo"])
def test_bounds_leave_batchnorm_statistics_alone(fitted, bound):
    """``estimate_objective`` and ``symmetrized_elbo`` run the model in train mode (the training
    objective); they moved BatchNorm's running statistics, so a later prediction changed (fails
    on the old code)."""
    model, guide, d = fitted
    before = buffers(model)
    torch.manual_seed(1)
    probs = pb.predict(model, guide, d.x_test, num_samples=5)
    if bound == "estimate_objective":
        estimate_objective(model, guide, (d.x_train, d.y_train), num_samples=2)
    else:
        symmetrized_elbo(model, guide, (d.x_train, d.y_train), num_samples=2)
    for k, v in before.items():
        torch.testing.assert_close(dict(model.named_buffers())[k], v, rtol=0, atol=0)
    torch.manual_seed(1)
    torch.testing.assert_close(pb.predict(model, guide, d.x_test, num_samples=5), probs, rtol=0, atol=0)


def test_invariance_map_predict_runs_in_eval_mode():
    """``map_predict`` (LILA's MAP predictive) ran the model in its current mode: in train mode
    BatchNorm normalised by the batch and overwrote its running statistics (fails on the old code)."""
    from pyro_bnn.invariance.learning import map_predict

    d = pb.datasets.digits()
    torch.manual_seed(0)
    model = pb.BNN(bn_mlp(), "categorical")
    with torch.no_grad():
        model.net[1].running_mean.normal_()
        model.net[1].running_var.uniform_(0.5, 2.0)
    values, before = model.initial_values(), buffers(model)
    probs = map_predict(model, values, d.x_test[:50])
    for k, v in before.items():
        torch.testing.assert_close(dict(model.named_buffers())[k], v, rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        expected = torch.softmax(model.run_with(values, d.x_test[:50]), -1)
    torch.testing.assert_close(probs, expected)


class HandWrittenBN(PyroModule):
    """A user's own PyroModule: Linear → BatchNorm → ReLU → Linear, the observation in a plate."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn = PyroModule[nn.Linear](64, 16), nn.BatchNorm1d(16)
        self.fc2 = PyroModule[nn.Linear](16, 10)
        for mod in (self.fc1, self.fc2):
            for name, p in list(mod.named_parameters()):
                setattr(mod, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))

    def forward(self, x, y=None):
        logits = self.fc2(torch.relu(self.bn(self.fc1(x))))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


@pytest.mark.parametrize("guide_name", ["meanfield", "laplace"])
def test_predictive_on_a_users_pyro_module_in_train_mode_is_warned(guide_name):
    """pb.BNN warns from its own forward; a user's PyroModule is warned by the pyro_bnn guide that
    Predictive runs (poutine.get_mask() is False there), and never during SVI training."""
    d = pb.datasets.digits()
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = HandWrittenBN()
    guide = (pb.guides.MeanField(model) if guide_name == "meanfield"
             else pb.guides.Laplace(model, "kron", subset="last_layer"))
    x, y = d.x_train[:64], d.y_train[:64]
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # training in train mode: batch statistics are right
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
        for _ in range(3):
            svi.step(x, y)
    if guide_name == "laplace":
        guide.fit_curvature((x, y))
    before = buffers(model)
    with pytest.warns(pb.BatchNormTrainModeWarning, match=r"Predictive runs the model .*train mode \(bn\).*model\.eval\(\)"):
        Predictive(model, guide=guide, num_samples=2)(d.x_test[:20])
    assert not torch.equal(before["bn.running_mean"], model.bn.running_mean)  # what it warns about
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Predictive(model, guide=guide, num_samples=2)(d.x_test[:20])


def test_running_statistics_of_random_affine_are_warned_and_cost_much():
    """With BatchNorm's γ, β random sites, the running statistics fit the single draws far worse
    (measured on digits at 100 epochs: NLL 0.391 with them, 0.144 per draw; docs/pyro.md): a
    sampling predictive without ``bn_data=`` is warned; with it, or with γ, β point estimates, not."""
    d = pb.datasets.digits()
    torch.manual_seed(0)
    random_affine = lambda name, module, param: isinstance(module, (nn.Linear, nn.BatchNorm1d))  # noqa: E731
    model = pb.BNN(bn_mlp(), "categorical", stochastic=random_affine)
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (d.x_train, d.y_train), epochs=30, seed=0, progress=False)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match=r"random γ, β \(net.1\).*bn_data="):
        plain = pb.evaluate(model, guide, d.x_test, d.y_test, num_samples=30)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recal = pb.evaluate(model, guide, d.x_test, d.y_test, num_samples=30, bn_data=d.x_train)
    assert recal["nll"] < 0.8 * plain["nll"] and recal["ece"] < plain["ece"]
    # Pyro's Predictive in eval mode normalises with the running statistics too: warned
    model.eval()
    with warnings.catch_warnings(record=True) as record:  # once, not once per draw (Pyro's
        warnings.simplefilter("always")                    # Predictive calls the guide per draw)
        Predictive(model, guide=guide, num_samples=5)(d.x_test[:5])
        Predictive(model, guide=guide, num_samples=5)(d.x_test[:5])
        model.train()
        Predictive(model, guide=guide, num_samples=5)(d.x_test[:5])
    messages = [str(w.message) for w in record]
    assert sum(m.startswith("pyro.infer.Predictive: BatchNorm layers with random γ, β (net.1)")
               for m in messages) == 1, messages
    assert sum("in train mode" in m for m in messages) == 1, messages
    model.train()


def test_running_statistics_of_point_affine_are_not_warned(fitted):
    model, guide, d = fitted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.predict(model, guide, d.x_test, num_samples=3)


def test_the_fits_final_check_leaves_running_statistics_as_the_last_step_did(tmp_path):
    """``fit`` evaluates the loss once more at the last step's state (its divergence check), in
    train mode: that pass must not move BatchNorm's running statistics.  The model returned, its
    checkpoint and a resume with no epoch left all hold the last training step's statistics."""
    d = pb.datasets.digits()
    path = tmp_path / "bn.pt"

    def run(resume):
        pyro.clear_param_store()
        torch.manual_seed(0)
        model = pb.BNN(bn_mlp(), "categorical")
        guide = pb.guides.MeanField(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            pb.fit(model, guide, (d.x_train, d.y_train), epochs=2, seed=0, progress=False,
                   checkpoint=path, resume=resume)
        return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k}

    fitted_buffers = run(resume=False)
    saved = pb.training.checkpoint.read_checkpoint(path)["model"]
    resumed_buffers = run(resume=True)  # nothing left to train: only the final check runs
    steps = -(-len(d.x_train) // 64) * 2
    for name, value in fitted_buffers.items():
        assert torch.equal(saved[name], value), name
        assert torch.equal(resumed_buffers[name], value), name
    assert int(fitted_buffers["net.1.num_batches_tracked"]) == steps
