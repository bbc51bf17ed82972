"""Weight-norm directions as a gauge: ``normalize_directions_`` and ``Hypernet(directions=...)`` (issue 26)."""

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.hypernet_flows import HypernetFlow
from pyro_bnn.guides.hypernet_objective import HypernetELBO
from pyro_bnn.model.weight_norm import direction_radius, normalize_directions_, to_weight_norm
from pyro_bnn.training import setup_guide


def _rows(v):
    return v.detach().flatten(1).norm(dim=1)


def test_normalize_directions_changes_no_function_and_sets_radius():
    torch.manual_seed(0)
    net = to_weight_norm(nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 36, 5)))
    x = torch.randn(4, 1, 8, 8)
    before = net(x).detach()
    assert normalize_directions_(net) == 2
    assert torch.allclose(net(x), before, atol=1e-5)
    assert torch.allclose(_rows(net[0].weight_v), torch.full((3,), 3.0))        # √(1·3·3)
    assert torch.allclose(_rows(net[3].weight_v), torch.full((5,), 108 ** 0.5))  # √(3·36)
    assert direction_radius(net[3].weight_v) == pytest.approx(108 ** 0.5)


def _model_and_data():
    torch.manual_seed(0)
    x = torch.randn(200, 20)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3))
    return pb.BNN(net, "categorical", weight_norm=True), x, y


def test_free_directions_drift_longer_and_sphere_keeps_the_radius():
    """The drift the gauge fix removes: with ``directions="free"`` Adam lengthens every v row
    (its gradient is orthogonal to v), so the same step turns it less and less; ``"sphere"``
    holds each row at √fan_in (up to the last step's own length, lr·√fan_in ≪ √fan_in)."""
    norms = {}
    for directions in ("free", "sphere"):
        model, x, y = _model_and_data()
        start = _rows(model.net[0].weight_v).mean()
        guide = pb.guides.Hypernet(model, num_flows=1, hidden=8, directions=directions)
        with pytest.warns(pb.ConvergenceWarning):  # 5 epochs: too short to judge, as intended
            pb.fit(model, guide, (x, y), epochs=5, batch_size=20, lr=1e-2, lr_schedule="constant",
                   progress=False, seed=0)
        norms[directions] = _rows(model.net[0].weight_v)
    assert norms["free"].mean() > 1.15 * start  # 0.56 → 0.68 in 50 steps (√(‖v‖² + Σ‖step‖²))
    radius = 20 ** 0.5
    assert torch.allclose(norms["sphere"], torch.full((16,), radius), rtol=1e-2)


def test_sphere_objective_has_the_same_value_and_gradient_direction():
    model, x, y = _model_and_data()
    guide = pb.guides.Hypernet(model, num_flows=1, hidden=8)
    setup_guide(model, guide, x[:10], y[:10], 200)
    with local_params(model, guide):
        torch.manual_seed(1)
        free, _ = HypernetELBO(directions="free")(model, guide, x[:10], y[:10], num_data=200)
        torch.manual_seed(1)
        sphere, _ = HypernetELBO(directions="sphere")(model, guide, x[:10], y[:10], num_data=200)
    assert torch.allclose(free, sphere, rtol=1e-5)
    assert torch.allclose(_rows(model.net[0].weight_v), torch.full((16,), 20 ** 0.5))


def test_directions_option_is_checked():
    model, _, _ = _model_and_data()
    with pytest.raises(ValueError, match="directions"):
        pb.guides.Hypernet(model, directions="unit")
    with pytest.raises(ValueError, match="directions"):
        HypernetELBO(directions="sphere ")


# ------------------------------------------------- random directions (pb.BNN(random_directions=True))
def _random_directions_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 30), nn.ReLU(), nn.Linear(30, 10))
    return net, pb.BNN(net, "categorical", weight_norm=True, random_directions=True, **kwargs)


def test_random_directions_model_sites_priors_radius_and_function():
    net, model = _random_directions_model(weight_norm_precision=4.0)
    assert sorted(model.site_names) == ["net.0.weight_g", "net.0.weight_v", "net.2.weight_g", "net.2.weight_v"]
    for layer, fan_in in (("net.0", 64), ("net.2", 30)):
        loc, scale = model.site_normal_prior(f"{layer}.weight_v")
        assert float(loc) == 0.0 and float(scale) == 1.0        # isotropic: uniform direction
        assert float(model.site_normal_prior(f"{layer}.weight_g")[1]) == 0.5   # λ = 4 on the scales
        v = model.initial_values()[f"{layer}.weight_v"]
        torch.testing.assert_close(_rows(v), torch.full((v.shape[0],), fan_in ** 0.5))
    x = torch.randn(7, 64)
    torch.testing.assert_close(model.run_with(model.initial_values(), x), net(x), rtol=1e-5, atol=1e-5)
    # a prior dict for the scales; its '*' entry does not reach the directions
    _, other = _random_directions_model(prior={"net.0.weight_g": pb.priors.IIDNormal(2.0), "*": pb.priors.IIDNormal(3.0)})
    scales = {s: float(other.site_normal_prior(s)[1]) for s in other.site_names}
    assert scales == {"net.0.weight_g": 2.0, "net.0.weight_v": 1.0, "net.2.weight_g": 3.0, "net.2.weight_v": 1.0}
    from pyro_bnn.model.bnn import random_directions_of
    from pyro_bnn.reporting.comparison import describe_configuration

    assert random_directions_of(model) and not random_directions_of(pb.BNN(net, "categorical", weight_norm=True))
    guide = pb.guides.Hypernet(model, num_flows=0)
    assert "weight-norm model, random directions" in describe_configuration(model, guide, epochs=1, lr=None,
                                                                            batch_size=8)
    with pytest.raises(ValueError, match="need weight_norm=True"):
        pb.BNN(net, "categorical", random_directions=True)
    with pytest.raises(ValueError, match="do not pass stochastic="):
        pb.BNN(net, "categorical", weight_norm=True, random_directions=True, stochastic=["0.weight_g"])
    with pytest.raises(TypeError, match="random_directions"):
        pb.BNN(net, "categorical", weight_norm=True, random_directions="yes")


def test_hypernet_puts_its_flow_on_the_scales_and_a_gaussian_on_random_directions(digits_small):
    x, y, _, _ = digits_small
    _, model = _random_directions_model()
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=16)
    setup_guide(model, guide, x[:8], y[:8], len(x))
    layout = {name: (start, size) for name, start, size, _, _ in guide._latent_layout()}
    scales = torch.cat([torch.arange(start, start + size) for name, (start, size) in layout.items()
                        if name.endswith("weight_g")])
    assert torch.equal(guide.flow.flow_index, scales)
    # the blocks are over the 40 scales; every other coordinate has the affine layer alone
    assert sum(p.numel() for p in guide.flow.blocks.parameters()) == sum(
        p.numel() for p in HypernetFlow(40, num_flows=2, hidden=16).blocks.parameters())
    assert guide.latent_dim == 30 * 64 + 30 + 10 * 30 + 10
    with pytest.raises(ValueError, match="directions are random"):
        pb.guides.Hypernet(_random_directions_model()[1], directions="sphere")(x[:8], y[:8])
    with pytest.raises(ValueError, match="directions are random"):
        guide.update_prior_precision_((x, y))
    with pytest.raises(ValueError, match="use layout='stable'"):
        pb.guides.Hypernet(_random_directions_model()[1], layout="paper")(x[:8], y[:8])


def test_random_directions_train_under_plain_svi_and_predict_through_predictive(digits_small, tmp_path):
    """Plain SVI + Trace_ELBO trains the guide (loss falls, test accuracy well above chance),
    ``Predictive`` and ``pb.predict`` agree, and the param store restores it exactly."""
    import pyro
    from pyro.infer import SVI, Predictive, Trace_ELBO

    x, y, xt, yt = digits_small
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    _, model = _random_directions_model()
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=16)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(150)]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10]), (losses[:3], losses[-3:])
    scores = pb.evaluate(model, guide, xt, yt, num_samples=32)
    assert scores["accuracy"] > 0.6, scores
    pyro.set_rng_seed(1)
    logits = Predictive(model, guide=guide, num_samples=64, return_sites=["_RETURN"])(xt)["_RETURN"]
    draws = pb.predict(model, guide, xt, num_samples=64)
    # two independent 64-draw means: their difference has sd √2·se per probability
    se = (draws.std(0) / 64 ** 0.5).sum(-1).mean()
    assert (logits.softmax(-1).mean(0) - draws.mean(0)).abs().sum(-1).mean() <= 4 * 2 ** 0.5 * se
    path = str(tmp_path / "store.pt")
    pyro.get_param_store().save(path)
    pyro.clear_param_store()
    pyro.get_param_store().load(path)
    _, model2 = _random_directions_model(seed=5)
    guide2 = pb.guides.Hypernet(model2, num_flows=2, hidden=16)
    guide2(x[:4], y[:4])
    for key, value in guide.state_dict().items():
        torch.testing.assert_close(guide2.state_dict()[key], value, msg=key)
