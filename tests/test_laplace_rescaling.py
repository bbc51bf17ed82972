"""The Laplace evidence under a ReLU net's rescaling symmetry (a reference property).

Scaling hidden layer l's output by ``c_l > 0`` — its weights by ``c_l / c_{l-1}``, its bias by
``c_l`` — leaves a ReLU net's function unchanged.  If every prior precision is transformed with the
tensor it covers (``δ → δ / f²`` for a tensor scaled by ``f``), the Gaussian log prior and the
log-determinant of the GGN-plus-prior change by the same constant, so the log evidence is
unchanged.  KFAC is covariant under this rescaling (its input factor scales with the layer's
input, its output factor with the inverse of its output), so with one δ per weight and per bias
tensor and the bias in its own Kronecker block the KFAC evidence is invariant too — exactly, up to
rounding.  With a layer's weight and bias sharing one δ (``kron_bias="joint"``) it is not: the
two tensors scale differently.  ``docs/results/fashion_mnist.md`` (seventh session) uses this to
show that the online-marglik δ drift does not change the evidence.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pyro_bnn as pb

SCALES = (2.5, 0.3)   # c_1, c_2 of the two hidden layers


def _guide(structure, prior_structure, kron_bias, data):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 10)).double()
    model = pb.BNN(net, "categorical").double()
    guide = pb.guides.Laplace(model, structure, prior_structure=prior_structure, prior_precision=0.5,
                              kron_bias=kron_bias)
    pb.fit(model, guide, data, epochs=5, batch_size=64, lr=1e-2, progress=False, seed=0)
    return guide


def _factors():
    """``{site: f}`` for ``net.{0,2,4}.{weight,bias}`` under hidden scales ``SCALES``."""
    c = (1.0, *SCALES, 1.0)
    out = {}
    for i, layer in enumerate((0, 2, 4)):
        out[f"net.{layer}.weight"] = c[i + 1] / c[i]
        out[f"net.{layer}.bias"] = c[i + 1]
    return out


def _rescaled_evidence(guide, data, delta_of=None):
    """The evidence after the rescale, with each δ divided by its tensor's factor squared
    (``delta_of`` overrides the transformed δ)."""
    factors = _factors()
    with torch.no_grad():
        for name, value in guide.map_values().items():
            value.mul_(factors[name])
    guide.fit_curvature(data)
    groups = guide.prior_precision_groups
    delta = guide.prior_precision.detach().clone()
    if delta_of is None:   # one δ per group (layer or tensor), scaled as the group's first tensor
        delta = torch.stack([d / factors[sites[0]] ** 2 for d, sites in zip(delta, groups)])
    else:
        delta = delta_of(delta)
    return float(guide.log_evidence(delta))


@pytest.fixture
def digits_data():
    d = pb.datasets.digits()
    return d.x_train[:400].double(), d.y_train[:400]


def test_a_rescaled_relu_net_computes_the_same_function(digits_data):
    x, _ = digits_data
    guide = _guide("kron", "sitewise", "separate", digits_data)
    values = {k: v.detach().clone() for k, v in guide.map_values().items()}
    factors = _factors()

    def forward(vals):
        f = x
        for i, layer in enumerate((0, 2, 4)):
            f = torch.nn.functional.linear(f, vals[f"net.{layer}.weight"], vals[f"net.{layer}.bias"])
            f = torch.relu(f) if i < 2 else f
        return f

    scaled = {k: v * factors[k] for k, v in values.items()}
    torch.testing.assert_close(forward(scaled), forward(values), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structure", ["kron", "full"])
def test_evidence_is_invariant_with_delta_per_tensor(structure, digits_data):
    guide = _guide(structure, "sitewise", "separate", digits_data)
    guide.fit_curvature(digits_data)
    before = float(guide.log_evidence())
    after = _rescaled_evidence(guide, digits_data)
    assert after == pytest.approx(before, rel=1e-9, abs=1e-8)


def test_evidence_changes_when_delta_is_not_transformed(digits_data):
    """The check can fail: the same rescale with δ left as it was moves the evidence."""
    guide = _guide("kron", "sitewise", "separate", digits_data)
    guide.fit_curvature(digits_data)
    before = float(guide.log_evidence())
    after = _rescaled_evidence(guide, digits_data, delta_of=lambda d: d)
    assert abs(after - before) > 1.0


def test_joint_bias_blocks_break_the_invariance_only_through_the_biases(digits_data):
    """One δ per layer (weight and bias together): transformed with the weights, the evidence
    moves, by less than with δ left untransformed."""
    guide = _guide("kron", "layerwise", "joint", digits_data)
    guide.fit_curvature(digits_data)
    before = float(guide.log_evidence())
    state = {k: v.detach().clone() for k, v in guide.map_values().items()}
    moved = abs(_rescaled_evidence(guide, digits_data) - before)
    with torch.no_grad():
        for name, value in guide.map_values().items():
            value.copy_(state[name])
    untransformed = abs(_rescaled_evidence(guide, digits_data, delta_of=lambda d: d) - before)
    assert 1e-6 < moved < untransformed
    assert math.isfinite(untransformed)
