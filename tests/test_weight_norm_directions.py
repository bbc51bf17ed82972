"""Weight-norm directions as a gauge: ``normalize_directions_`` and ``Hypernet(directions=...)`` (issue 26)."""

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
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
