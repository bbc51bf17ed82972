"""FGSM: identity at ε = 0, the analytic gradient sign of a linear softmax model, the L∞
budget, and accuracy non-increasing in ε (fixed seed) for every guide."""

import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoDelta
from torch import nn
from uncertainty_helpers import GUIDE_NAMES, digits, trained

import pyro_bnn as pb
from pyro_bnn.analysis.adversarial import fgsm, fgsm_curve
from pyro_bnn.guides import init_to_network
from pyro_bnn.training.guide_setup import setup_guide


def _linear_model():
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    model = pb.BNN(net, "categorical")
    guide = AutoDelta(model, init_loc_fn=init_to_network(model))   # a point mass at net's weights
    setup_guide(model, guide, torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    return net, model, guide


def test_fgsm_linear_softmax_matches_closed_form():
    """For logits W x + b, ∇_x(−log p_y) = Wᵀ(p − e_y)."""
    net, model, guide = _linear_model()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        p = torch.softmax(net(x), -1)
    grad = (p - nn.functional.one_hot(y, 3).float()) @ net.weight.detach()
    expected = x + 0.1 * grad.sign()
    torch.testing.assert_close(fgsm(model, guide, x, y, epsilon=0.1), expected)
    torch.testing.assert_close(fgsm(model, guide, x, y, epsilon=0.1, num_samples=3), expected)
    # clamping to the valid input range
    clamped = fgsm(model, guide, x, y, epsilon=0.1, clamp=(-0.5, 0.5))
    torch.testing.assert_close(clamped, expected.clamp(-0.5, 0.5))


def test_fgsm_errors():
    _, model, guide = _linear_model()
    with pytest.raises(ValueError, match="non-negative"):
        fgsm(model, guide, torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), epsilon=-0.1)


@pytest.mark.parametrize("name", GUIDE_NAMES)
def test_fgsm_every_guide(name):
    model, guide = trained(name)
    d = digits()
    x, y = d.x_test[:150], d.y_test[:150]
    assert torch.equal(fgsm(model, guide, x, y, epsilon=0.0), x)                      # step 0: identity
    pyro.set_rng_seed(0)
    x_adv = fgsm(model, guide, x, y, epsilon=0.1, num_samples=2, clamp=(0.0, 1.0))
    assert float((x_adv - x).abs().max()) <= 0.1 + 1e-6
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    curve = fgsm_curve(model, guide, x, y, epsilons=[0.0, 0.05, 0.1, 0.2, 0.3], num_samples=1,
                       eval_num_samples=8, clamp=(0.0, 1.0), seed=0)
    acc = curve["accuracy"]
    assert all(a >= b for a, b in zip(acc, acc[1:])), acc               # non-increasing (seed 0)
    assert acc[-1] < 0.75 * acc[0], acc                                 # and the attack bites
