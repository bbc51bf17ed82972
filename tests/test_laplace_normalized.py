"""``Laplace(..., normalized_decay="prior")``: layers that feed a normalisation layer are trained
with their initial prior precision while the evidence tunes the δ of their posterior; every other
layer (and every layer of a network without normalisation) is trained with the evidence's δ."""

import math
import warnings

import pytest
import torch
from torch import nn

import pyro_bnn as pb

pytestmark = pytest.mark.filterwarnings("ignore")


def _bn_model():
    torch.manual_seed(0)
    return pb.BNN(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)), "categorical")


def _data(n=40):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _set_up(model, **options):
    guide = pb.guides.Laplace(model, "kron", prior_structure="layerwise", prior_precision=2.0, **options)
    x, y = _data()
    guide.fit_curvature((x, y))
    with torch.no_grad():
        guide.log_prior_precision.copy_(torch.log(torch.tensor([50.0, 7.0])))   # "the evidence moved δ"
    return guide, x, y


def _expected_loss(model, guide, x, y, deltas):
    values = guide.map_values()
    with torch.no_grad():
        loglik = torch.distributions.Categorical(logits=model.run_with(values, x)).log_prob(y).sum()
    total = loglik
    for layer, d in zip(guide.layers, deltas):
        w = layer.flatten(values).reshape(-1)
        total = total + 0.5 * layer.numel * (math.log(d) - math.log(2 * math.pi)) - 0.5 * d * float(w @ w)
    return -float(total)


@pytest.mark.parametrize("decay, expected", [("prior", [2.0, 7.0]), ("evidence", [50.0, 7.0])])
def test_the_map_objective_uses_the_initial_prior_of_normalised_layers_only(decay, expected):
    """The MAP loss (what pb.fit and plain SVI minimise) against the log joint written out by
    hand with the expected δ per layer: net.0 feeds BatchNorm, net.3 does not."""
    model = _bn_model()
    guide, x, y = _set_up(model, normalized_decay=decay)
    assert guide.normalized_layers == frozenset({0})
    assert [float(d) for d in guide.training_prior_precisions()] == pytest.approx(expected)
    model.eval()                                          # one deterministic pass for both sides
    loss, _ = guide.make_objective()(model, guide, x, y, len(x))
    assert float(loss) == pytest.approx(_expected_loss(model, guide, x, y, expected), rel=1e-5)


def test_a_network_without_normalisation_is_unchanged():
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), "categorical")
    guide, _, _ = _set_up(model, normalized_decay="prior")
    assert guide.normalized_layers == frozenset()
    assert [float(d) for d in guide.training_prior_precisions()] == pytest.approx([50.0, 7.0])


def test_online_marglik_keeps_the_normalised_layers_decay_and_tunes_their_posterior():
    """Under pb.fit(marglik=) the evidence changes every δ (the posterior's), while the
    normalised layer's training δ stays the initial one."""
    d = pb.datasets.digits()
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron", prior_structure="layerwise", prior_precision=1.0,
                              normalized_decay="prior")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (d.x_train[:300], d.y_train[:300]), epochs=4, progress=False,
               marglik=pb.MarglikOptions(every=2, steps=20))
    tuned = guide.prior_precision.tolist()
    assert all(abs(t - 1.0) > 1e-3 for t in tuned)
    assert [float(v) for v in guide.training_prior_precisions()] == pytest.approx([1.0, tuned[1]])


def test_unknown_normalized_decay_is_an_error():
    with pytest.raises(ValueError, match="normalized_decay must be one of"):
        pb.guides.Laplace(_bn_model(), normalized_decay="fixed")
