"""The learning rate ``pb.fit`` uses when it is given none: the guide's ``learning_rate(N)``.

MeanField's falls as ``1/√N`` above ``REFERENCE_NUM_DATA`` training points (measured on
Fashion-MNIST 60k, ``docs/results/fmnist_meanfield.md``), halves for a net with a random
convolution that feeds no normalisation layer (``docs/results/fashion_mnist.md``, the LeNet
collapse) and is at most 0.025 for a net without random convolutions (an MLP;
``docs/training.md``); every other guide keeps its
``default_lr`` whatever the size; Pyro's own guides get ``fit``'s 1e-3.
"""

import math
import warnings

import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.meanfield import REFERENCE_NUM_DATA
from pyro_bnn.reporting.comparison import describe_configuration


def _problem(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()
    model = pb.BNN(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)), "categorical")
    return model, x, y


def _fit(lr, num_data, seed=0):
    model, x, y = _problem()
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        res = pb.fit(model, guide, (x, y), epochs=2, batch_size=16, lr=lr, num_data=num_data, seed=seed,
                     progress=False)
    return res, torch.cat([p.detach().flatten() for p in guide.parameters()])


def test_meanfield_rate_is_the_default_up_to_the_reference_size_then_falls_as_one_over_root_n():
    # a net whose random convolutions all feed BatchNorm keeps the full rate up to 10,000 points
    guide = pb.guides.MeanField(pb.BNN(_conv_net(norm=True), "categorical"))
    for n in (1, 1348, 5000, REFERENCE_NUM_DATA):
        assert guide.learning_rate(n) == guide.default_lr == 0.05
    assert guide.learning_rate(60_000) == pytest.approx(0.05 / math.sqrt(6), rel=1e-12)  # 0.0204
    assert guide.learning_rate(4 * REFERENCE_NUM_DATA) == pytest.approx(0.025, rel=1e-12)
    with pytest.raises((TypeError, ValueError), match="num_data"):
        guide.learning_rate(0)


def test_mlp_rate_is_at_most_the_dense_ceiling():
    # an MLP (no random convolution): 0.025 up to 40,000 points, where the 1/sqrt(N) rule meets
    # it, then the rule (docs/training.md: 0.05 ended up to 13 % lower on MLPs of 1,348-10,000 points)
    guide = pb.guides.MeanField(_problem()[0])
    assert guide.random_convolutions() == []
    for n in (1, 1348, 5000, REFERENCE_NUM_DATA, 4 * REFERENCE_NUM_DATA):
        assert guide.learning_rate(n) == pytest.approx(guide.dense_lr_ceiling, rel=1e-12)
    assert guide.dense_lr_ceiling == 0.025
    assert guide.learning_rate(60_000) == pytest.approx(0.05 / math.sqrt(6), rel=1e-12)  # 0.0204
    # a frozen convolution in front of random dense layers is an MLP to the rule
    frozen = pb.guides.MeanField(pb.BNN(_conv_net(norm=False, frozen=True), "categorical"))
    assert frozen.random_convolutions() == [] and frozen.learning_rate(1348) == 0.025
    # the ceiling is a class attribute: None switches it off
    class Uncapped(pb.guides.MeanField):
        dense_lr_ceiling = None
    assert Uncapped(_problem()[0]).learning_rate(1348) == 0.05


def test_symmetrized_takes_half_meanfields_mlp_rate():
    # docs/results/fashion_mnist.md (thirty-seventh session): on the Fashion-MNIST MLP, 10,000
    # images, 0.0125 beat 0.025 (whose 320-epoch fit ended below its 160) and 0.05
    sym = pb.guides.Symmetrized(_problem()[0])
    assert sym.dense_lr_factor == 0.5
    for n in (1, 1348, REFERENCE_NUM_DATA, 4 * REFERENCE_NUM_DATA):
        assert sym.learning_rate(n) == pytest.approx(0.0125, rel=1e-12)
    assert sym.learning_rate(60_000) == pytest.approx(0.5 * 0.05 / math.sqrt(6), rel=1e-12)  # 0.0102
    # not on convolutional nets: BatchNorm'd convolutions keep MeanField's full rate
    assert pb.guides.Symmetrized(pb.BNN(_conv_net(norm=True), "categorical")).learning_rate(10) == 0.05


def test_fit_trains_at_the_resolved_rate_and_reports_it():
    # lr=None at N = 160,000 (num_data scales the likelihood) is bit-identical to lr=0.0125 given
    # explicitly, and differs from the small-data rate 0.025 (the control)
    res_default, theta_default = _fit(None, 16 * REFERENCE_NUM_DATA)
    res_explicit, theta_explicit = _fit(0.0125, 16 * REFERENCE_NUM_DATA)
    _, theta_small_rate = _fit(0.025, 16 * REFERENCE_NUM_DATA)
    assert res_default.lr == 0.0125 and res_explicit.lr == 0.0125
    assert torch.equal(theta_default, theta_explicit)
    assert not torch.allclose(theta_default, theta_small_rate)
    # at the data's own size (64 points) this MLP trains at the dense ceiling
    assert _fit(None, None)[0].lr == 0.025


def test_other_guides_keep_their_default_rate_and_pyro_guides_get_fits_own():
    model = _problem()[0]
    for guide in (pb.guides.Laplace(model), pb.guides.Hypernet(pb.BNN(nn.Linear(3, 2), "categorical",
                                                                       weight_norm=True), num_flows=1)):
        assert guide.learning_rate(10 ** 6) == guide.learning_rate(10) == guide.default_lr
    model, x, y = _problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        res = pb.fit(model, AutoNormal(model), (x, y), epochs=1, progress=False)
    assert res.lr == 1e-3


def test_configuration_column_shows_the_rate_the_fit_used():
    model, x, y = _problem()
    guide = pb.guides.MeanField(model)
    res, _ = _fit(None, 16 * REFERENCE_NUM_DATA)
    text = describe_configuration(model, guide, epochs=2, lr=res.lr, batch_size=16)
    assert "Adam lr 0.0125 cosine" in text
    assert "default lr" in describe_configuration(model, guide, epochs=2, lr=None, batch_size=16)


def _conv_net(norm: bool, frozen: bool = False) -> nn.Module:
    layers = [nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()] if norm else [nn.Conv2d(1, 4, 3), nn.ReLU()]
    net = nn.Sequential(*layers, nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 9, 3))
    if frozen:
        net[0].requires_grad_(False)
    return net


def test_meanfield_rate_halves_for_a_convolution_that_feeds_no_normalisation():
    # the LeNet collapse (docs/results/fashion_mnist.md): half the rate for such nets, at every size
    plain = pb.guides.MeanField(pb.BNN(_conv_net(norm=False), "categorical"))
    assert plain.convolutions_without_normalization() == ["net.0"]
    assert plain.learning_rate(1348) == pytest.approx(0.025, rel=1e-12)
    assert plain.learning_rate(60_000) == pytest.approx(0.5 * 0.05 / math.sqrt(6), rel=1e-12)
    # Symmetrized: the same rule with a quarter (its long LeNet fits ended lower at the half rate)
    sym = pb.guides.Symmetrized(pb.BNN(_conv_net(norm=False), "categorical"))
    assert sym.learning_rate(10) == 0.0125
    assert sym.learning_rate(60_000) == pytest.approx(0.25 * 0.05 / math.sqrt(6), rel=1e-12)  # 0.0051
    assert pb.guides.Symmetrized(pb.BNN(_conv_net(norm=True), "categorical")).learning_rate(10) == 0.05
    # BatchNorm after the convolution: the full rate
    guide = pb.guides.MeanField(pb.BNN(_conv_net(norm=True), "categorical"))
    assert guide.convolutions_without_normalization() == [] and guide.random_convolutions() == ["net.0"]
    assert guide.learning_rate(1348) == 0.05


def test_rate_rule_reads_a_hand_written_pyro_module_and_fit_uses_it():
    import pyro
    import pyro.distributions as dist
    from pyro.nn import PyroModule, PyroSample

    class Net(PyroModule):
        # norm "sequential": Conv -> BatchNorm inside an nn.Sequential (read exactly); "forward":
        # the BatchNorm only in this forward, which torch.fx cannot trace (pyro.sample), so the
        # link is not seen and the convolution counts as unnormalised (the cautious reading)
        def __init__(self, norm):
            super().__init__()
            layers = [PyroModule[nn.Conv2d](1, 2, 3)] + ([nn.BatchNorm2d(2)] if norm == "sequential" else [])
            self.features = PyroModule[nn.Sequential](*layers)
            self.features[0].weight = PyroSample(dist.Normal(0., 1.).expand([2, 1, 3, 3]).to_event(4))
            self.norm = nn.BatchNorm2d(2) if norm == "forward" else nn.Identity()
            self.out = PyroModule[nn.Linear](2 * 36, 2)
            self.out.weight = PyroSample(dist.Normal(0., 1.).expand([2, 72]).to_event(2))

        def forward(self, x, y=None):
            logits = self.out(torch.relu(self.norm(self.features(x))).flatten(1))
            with pyro.plate("data", x.shape[0]):
                return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    torch.manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 2, (32,))
    for norm, rate in ((None, 0.025), ("sequential", 0.05), ("forward", 0.025)):
        pyro.clear_param_store()
        model = Net(norm)
        guide = pb.guides.MeanField(model)
        assert guide.learning_rate(100) == rate      # before set-up: every convolution counts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = pb.fit(model, guide, (x, y), epochs=1, batch_size=16, progress=False)
        assert res.lr == rate
        assert guide.convolutions_without_normalization() == ([] if norm == "sequential" else ["features.0"])
