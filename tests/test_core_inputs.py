"""Bad input gets clear errors; NaN losses stop fit without losing the trained state; checkpoints."""

import math
import warnings

import pytest
import torch
from helpers import mlp
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training.guide_setup import setup_guide


def _model():
    torch.manual_seed(0)
    return pb.BNN(mlp(8, 6, 3))


def test_labels_out_of_range():
    model = _model()
    x, y = torch.randn(20, 8), torch.randint(0, 3, (20,))
    y[4] = 7
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\].*\[0, 7\]"):
        pb.fit(model, pb.guides.MeanField(model), (x, y), epochs=1, progress=False)
    guide = pb.guides.MeanField(model)
    with pytest.raises(ValueError, match="no parameters yet"):
        pb.predict(model, guide, x, num_samples=2)
    pb.fit(model, guide, (x[:3], y[:3]), epochs=1, progress=False)
    with pytest.raises(ValueError, match="labels must lie"):
        pb.evaluate(model, guide, x, y, num_samples=2)


def test_a_categorical_net_with_one_output_names_the_fix():
    torch.manual_seed(0)
    model = pb.BNN(mlp(8, 6, 1), "categorical")
    x, y = torch.randn(20, 8), torch.randint(0, 2, (20,))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 0\].*one output per class.*'bernoulli'"):
        pb.fit(model, pb.guides.MeanField(model), (x, y), epochs=1, progress=False)


def test_float_labels_for_categorical():
    model = _model()
    with pytest.raises(TypeError, match="integer class labels"):
        pb.fit(model, pb.guides.MeanField(model), (torch.randn(5, 8), torch.rand(5)), epochs=1, progress=False)


def test_wrong_input_width():
    model = _model()
    # the message names the user's shape (10, 5), not that of the two-row output-shape probe
    with pytest.raises(ValueError, match=r"input has 5 features \(shape \(10, 5\)\).*expects 8"):
        pb.fit(model, pb.guides.MeanField(model), (torch.randn(10, 5), torch.randint(0, 3, (10,))),
               epochs=1, progress=False)
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (torch.randn(10, 8), torch.randint(0, 3, (10,))), epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"input has 7 features \(shape \(12, 7\)\)"):
        pb.evaluate(model, guide, torch.randn(12, 7), torch.randint(0, 3, (12,)), num_samples=2)


def test_wrong_conv_input():
    model = pb.BNN(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)))
    with pytest.raises(ValueError, match=r"shape \(N, 1, H, W\)"):
        pb.fit(model, pb.guides.MeanField(model), (torch.randn(4, 64), torch.randint(0, 3, (4,))),
               epochs=1, progress=False)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_data(bad):
    model = _model()
    x = torch.randn(10, 8)
    x[3, 2] = bad
    with pytest.raises(ValueError, match="x contains 1 NaN/inf"):
        pb.fit(model, pb.guides.MeanField(model), (x, torch.randint(0, 3, (10,))), epochs=1, progress=False)
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x[4:], torch.randint(0, 3, (6,))), epochs=1, progress=False)
    with pytest.raises(ValueError, match="NaN/inf"):
        pb.predict(model, guide, x, num_samples=1)


def test_regression_targets_shape():
    model = pb.BNN(nn.Linear(3, 1), likelihood="gaussian", noise=0.1)
    with pytest.raises(ValueError, match=r"shape \(N, 1\)"):
        pb.fit(model, pb.guides.MeanField(model), (torch.randn(6, 3), torch.randn(6)), epochs=1, progress=False)


def test_no_random_parameters():
    with pytest.raises(ValueError, match="no parameter selected as random"):
        pb.BNN(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match="lacks"):
        pb.BNN(nn.Linear(2, 2), stochastic=["net.3.weight"])


def _shared_layer_net():
    shared = nn.Linear(4, 4)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), shared, nn.ReLU(), shared, nn.ReLU(), nn.Linear(4, 2))


def _tied_weights_net():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(),
                        nn.Linear(4, 2))
    net[4].weight = net[2].weight
    return net


@pytest.mark.parametrize("make_net", [_shared_layer_net, _tied_weights_net], ids=["layer-used-twice", "tied"])
def test_shared_parameters_are_refused_and_the_remedy_trains(make_net):
    # A shared tensor as PyroSample sites became two independent weights (tied: the tie silently
    # lost) or one site Pyro names "net.4" while the guides looked for "net.2" (KeyError '2').
    with pytest.raises(ValueError, match=r"net\.2\.weight, net\.4\.weight.*tied weights.*copy\.deepcopy"):
        pb.BNN(make_net())
    # The remedy the message names: the shared tensor deterministic, the rest random.
    model = pb.BNN(make_net(), stochastic=lambda name, module, param: not name.startswith(("2.", "4.")))
    assert model.site_names == ["net.0.weight", "net.0.bias", "net.6.weight", "net.6.bias"]
    x, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
    before = model.net[2].weight.detach().clone()
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=2, progress=False)
    assert model.net[2].weight is model.net[4].weight  # still one tensor, trained as a point estimate
    assert not torch.equal(model.net[2].weight.detach(), before)
    assert pb.predict(model, guide, x, num_samples=2).shape == (2, 32, 2)


def test_layers_the_default_leaves_deterministic_are_named():
    tokens = nn.Sequential(nn.Embedding(20, 4), nn.Flatten(), nn.Linear(12, 3))
    with pytest.warns(UserWarning, match=r"Embedding 'net\.0' keeps point-estimate weights.*stochastic="):
        pb.BNN(tokens)
    decoder = nn.Sequential(nn.ConvTranspose2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 7 * 7, 3))
    with pytest.warns(UserWarning, match=r"ConvTranspose2d 'net\.0' keeps"):
        pb.BNN(decoder)
    with pytest.warns(UserWarning, match=r"weight_norm=True .* nn\.Conv2d layers only; Conv1d 'net\.0' keeps"):
        pb.BNN(nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(56, 3)), weight_norm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = pb.BNN(decoder, stochastic=lambda name, module, param: True)  # explicit: random, silent
        assert model.site_names == ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"]
        pb.BNN(tokens, stochastic=["net.2.weight", "net.2.bias"])  # explicit: deterministic, silent
        # normalisation layers' 1-D affine parameters and weight-norm directions are not named
        pb.BNN(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.LayerNorm(4), nn.Linear(4, 2)))
        pb.BNN(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(16, 2)), weight_norm=True)


@pytest.mark.parametrize("weight_norm", [False, True], ids=["plain", "weight-norm"])
def test_frozen_layers_stay_deterministic_and_fixed(weight_norm):
    """A frozen feature extractor (requires_grad=False) was made random by the default selection,
    so the guide learned a posterior over weights the user had fixed."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    net[0].requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen layers are the user's choice: no warning
        model = pb.BNN(net, weight_norm=weight_norm)
    assert model.site_names == (["net.2.weight_g"] if weight_norm else ["net.2.weight", "net.2.bias"])
    guide = pb.guides.Hypernet(model, num_flows=1, hidden=4) if weight_norm else pb.guides.MeanField(model)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    pb.fit(model, guide, (x, y), epochs=2, progress=False)
    assert torch.equal(model.net[0].weight.detach(), frozen) and not model.net[0].weight.requires_grad
    with pytest.raises(ValueError, match="not frozen"):
        pb.BNN(nn.Sequential(nn.Linear(6, 3).requires_grad_(False)), weight_norm=weight_norm)


def test_bad_likelihood_and_prior():
    with pytest.raises(ValueError, match="likelihood must be"):
        pb.BNN(nn.Linear(2, 2), likelihood="poisson")
    with pytest.raises(TypeError, match="prior must be"):
        pb.BNN(nn.Linear(2, 2), prior=3.0)
    with pytest.raises(ValueError, match="noise must be"):
        pb.BNN(nn.Linear(2, 1), likelihood="gaussian", noise=-1.0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        pb.BNN("not a net")


def test_nan_loss_stops_with_epoch_and_restores_state():
    model = pb.BNN(nn.Linear(3, 1), likelihood="gaussian", noise=1e-3)
    guide = pb.guides.MeanField(model)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    pb.fit(model, guide, (x, y), epochs=1, batch_size=8, progress=False)
    before = {k: v.clone() for k, v in guide.state_dict().items()}

    calls = {"n": 0}

    def objective(model, guide, x, y, num_data=None):  # turns NaN in the 3rd step of epoch 1
        calls["n"] += 1
        loss = guide.make_objective()(model, guide, x, y, num_data)
        return loss * math.nan if calls["n"] == 3 else loss

    with pytest.raises(FloatingPointError, match=r"epoch 1 \(step 3\)"):
        pb.fit(model, guide, (x, y), epochs=2, batch_size=8, progress=False, objective=objective)
    for k, v in guide.state_dict().items():
        assert torch.isfinite(v).all()
        torch.testing.assert_close(v, before[k])


def test_checkpoint_written_atomically_and_loads(tmp_path, digits_small):
    x, y, xt, _ = digits_small
    model = pb.BNN(mlp())
    guide = pb.guides.MeanField(model)
    path = tmp_path / "ckpt" / "run.pt"
    pb.fit(model, guide, (x, y), epochs=2, progress=False, checkpoint=path)
    assert path.exists() and not list(path.parent.glob(".tmp-*"))
    model2 = pb.BNN(mlp())
    guide2 = pb.guides.MeanField(model2)
    state = pb.load_checkpoint(path, model2, guide2, example_x=x[:2], example_y=y[:2])
    assert state["epoch"] == 2 and len(state["history"]["loss"]) == 2
    torch.manual_seed(1)
    a = pb.predict(model, guide, xt, num_samples=2)
    torch.manual_seed(1)
    b = pb.predict(model2, guide2, xt, num_samples=2)
    torch.testing.assert_close(a, b)


def test_dataset_and_dataloader_inputs(digits_small):
    x, y, _, _ = digits_small
    model = pb.BNN(mlp())
    guide = pb.guides.MeanField(model)
    ds = torch.utils.data.TensorDataset(x, y)
    r1 = pb.fit(model, guide, ds, epochs=1, progress=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=50, shuffle=True)
    r2 = pb.fit(model, guide, loader, epochs=1, progress=False)
    assert math.isfinite(r1.final_loss) and math.isfinite(r2.final_loss)
    with pytest.raises(TypeError, match="data must be"):
        pb.fit(model, guide, [1, 2, 3], epochs=1, progress=False)
    with pytest.raises(TypeError, match=r"got tuple of \(ndarray, ndarray\); convert arrays with torch\.as_tensor"):
        pb.fit(model, guide, (x.numpy(), y.numpy()), epochs=1, progress=False)
    examples = [(x[i], y[i]) for i in range(40)]
    with pytest.raises(TypeError, match=r"list of \(tuple, tuple, tuple, \.\.\. 40 items\); a list of \(x, y\) "
                                        r"examples is a dataset: pass a DataLoader"):
        pb.fit(model, guide, examples, epochs=1, progress=False)
    r3 = pb.fit(model, guide, torch.utils.data.DataLoader(examples, batch_size=20), epochs=1, progress=False)
    assert math.isfinite(r3.final_loss)


def test_pretrained_weights_are_the_initial_means():
    torch.manual_seed(0)
    net = mlp(8, 6, 3)
    model = pb.BNN(net)
    guide = pb.guides.MeanField(model, init_scale=1e-3)
    setup_guide(model, guide, torch.randn(2, 8), torch.randint(0, 3, (2,)))
    from pyro_bnn.contract.local_params import local_params

    with local_params(model, guide):
        for name, p in net.named_parameters():
            torch.testing.assert_close(guide.loc_and_scale(f"net.{name}")[0].detach(), p.detach())
            torch.testing.assert_close(guide.loc_and_scale(f"net.{name}")[1].detach(),
                                       torch.full_like(p, 1e-3))
    # the user's network is left untouched (still a plain module with parameters)
    assert type(net) is nn.Sequential and len(list(net.parameters())) == 4


def test_lr_schedule_cosine_decays_to_zero_and_rejects_unknown():
    from pyro_bnn.training.lr_schedule import make_lr_scheduler

    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = make_lr_scheduler(opt, "cosine", total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # 0.5 * ½(1 + cos(π t/4)) for t = 0..3
    expected = [0.5 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)]
    assert seen == pytest.approx(expected)
    with pytest.raises(ValueError, match="lr_schedule"):
        make_lr_scheduler(opt, "linear", 4)


@pytest.mark.parametrize("likelihood, last, path", [
    ("categorical", nn.Softmax(-1), "net.3"),
    ("categorical", nn.Sequential(nn.Linear(3, 3), nn.Sigmoid()), "net.3.1"),
    ("bernoulli", nn.Sigmoid(), "net.3"),
    ("bernoulli", nn.Softmax(-1), "net.3"),
])
def test_a_squashing_last_layer_under_a_classification_likelihood_is_refused(likelihood, last, path):
    """The likelihoods take logits: a final softmax/sigmoid squashes them into (0, 1), and the
    network trains without error but cannot be confident."""
    net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3), last)
    with pytest.raises(ValueError, match=rf"ends in {type(last[-1] if isinstance(last, nn.Sequential) else last).__name__} "
                                         rf"\({path}\).*{likelihood} likelihood takes logits"):
        pb.BNN(net, likelihood)


def test_log_softmax_and_bounded_regression_outputs_are_accepted():
    net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3), nn.LogSoftmax(-1))
    assert pb.BNN(net, "categorical").site_names[-1] == "net.2.bias"
    net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 1), nn.Sigmoid())  # y in (0, 1)
    assert pb.BNN(net, "gaussian", noise=0.1).site_names[-1] == "net.2.bias"
