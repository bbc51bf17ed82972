"""Priors, likelihood options, data sets and metric functions against hand-worked values."""

import gzip
import math
import struct
from pathlib import Path

import pyro.distributions as dist
import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn import metrics


def test_iid_and_fan_in_priors():
    p = pb.priors.IIDNormal(0.5)((3, 4))
    assert p.event_shape == (3, 4)
    w = torch.randn(3, 4)
    torch.testing.assert_close(p.log_prob(w), dist.Normal(0, 0.5).log_prob(w).sum())
    q = pb.priors.FanInNormal(gain=2.0)((5, 16), fan_in=16)
    torch.testing.assert_close(q.log_prob(w.new_zeros(5, 16)),
                               dist.Normal(0, 2.0 / 4.0).log_prob(torch.zeros(5, 16)).sum())


def test_scale_mixture_density_and_moments():
    prior = pb.priors.ScaleMixture(0.25, 1.0, math.exp(-6))
    d = prior((1000, 50))
    w = torch.linspace(-3, 3, 7)
    ref = torch.log(0.25 * dist.Normal(0, 1.0).log_prob(w).exp()
                    + 0.75 * dist.Normal(0, math.exp(-6)).log_prob(w).exp())
    torch.testing.assert_close(prior((7,)).log_prob(w), ref.sum())
    s = d.sample()
    # variance pi*s1^2 + (1-pi)*s2^2 = 0.25 (+tiny); 50k draws -> std error ~0.003
    assert abs(float(s.var()) - 0.25) < 0.02


def test_prior_forms_dict_and_callable():
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model = pb.BNN(net, prior={"net.0.weight": pb.priors.IIDNormal(0.1), "*": pb.priors.IIDNormal(2.0)})
    assert float(model.site_prior("net.0.weight").base_dist.scale.max()) == pytest.approx(0.1)
    assert float(model.site_prior("net.2.bias").base_dist.scale.max()) == pytest.approx(2.0)
    model = pb.BNN(net, prior=lambda name, p: pb.priors.FanInNormal() if "weight" in name else pb.priors.IIDNormal(3.0))
    assert float(model.site_prior("net.0.weight").base_dist.scale.max()) == pytest.approx(0.5)
    assert float(model.site_prior("net.0.bias").base_dist.scale.max()) == pytest.approx(3.0)
    with pytest.raises(KeyError, match="no entry"):
        pb.BNN(net, prior={"net.0.weight": pb.priors.IIDNormal(0.1)})


def test_site_names_follow_named_parameters_and_selection():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 3))
    model = pb.BNN(net)
    assert model.site_names == ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"]
    # BatchNorm stays deterministic (a trainable point estimate)
    assert {n for n, _ in model.named_parameters()} == {"net.1.weight", "net.1.bias"}
    only = pb.BNN(net, stochastic=["net.3.weight"])
    assert only.site_names == ["net.3.weight"]


def test_learned_and_fixed_noise():
    fixed = pb.BNN(nn.Linear(2, 1), likelihood="gaussian", noise=0.1)
    assert float(fixed.likelihood.noise) == pytest.approx(0.1) and not fixed.likelihood.learned
    learned = pb.BNN(nn.Linear(2, 1), likelihood="gaussian", noise="learned")
    assert learned.likelihood.learned
    x = torch.randn(200, 2)
    y = x @ torch.tensor([[1.0], [-1.0]]) + 0.3 * torch.randn(200, 1)
    pb.fit(learned, pb.guides.MeanField(learned), (x, y), epochs=150, batch_size=50, lr=2e-2, progress=False)
    assert 0.2 < float(learned.likelihood.noise.detach()) < 0.45


def test_bernoulli_likelihood_end_to_end():
    x = torch.randn(200, 2)
    y = (x[:, :1] > 0).float()
    model = pb.BNN(nn.Linear(2, 1), likelihood="bernoulli")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=30, batch_size=50, lr=5e-2, progress=False)
    assert pb.evaluate(model, guide, x, y, num_samples=8)["accuracy"] > 0.9


def test_regression_metrics_and_coverage():
    torch.manual_seed(0)
    model = pb.BNN(nn.Linear(1, 1), likelihood="gaussian", noise=0.2)
    guide = pb.guides.MeanField(model)
    x = torch.rand(400, 1)
    y = 2 * x + 0.2 * torch.randn(400, 1)
    pb.fit(model, guide, (x, y), epochs=60, batch_size=100, lr=3e-2, progress=False)
    scores = pb.evaluate(model, guide, x, y, num_samples=32)
    assert scores["rmse"] < 0.25
    assert 0.9 < scores["coverage_95"] <= 1.0


def test_classification_metrics_hand_worked():
    probs = torch.tensor([[[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]]])
    y = torch.tensor([0, 1, 1, 0])
    m = metrics.classification_metrics(probs, y, num_bins=10)
    assert m["accuracy"] == pytest.approx(0.75)  # argmax of a tie picks class 0
    assert m["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.5)) / 4)
    assert m["brier"] == pytest.approx((0.02 + 0.08 + 0.72 + 0.5) / 4)
    # bins: 0.9 (correct), 0.8 (correct), 0.6 (wrong), 0.5 (correct): |1-.9|+|1-.8|+|0-.6|+|1-.5|
    assert m["ece"] == pytest.approx((0.1 + 0.2 + 0.6 + 0.5) / 4)


def test_uncertainty_scores_known_values():
    # two samples that disagree completely: p̄ uniform
    probs = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    assert float(metrics.predictive_entropy(probs)) == pytest.approx(math.log(2))
    assert float(metrics.mutual_information(probs)) == pytest.approx(math.log(2))
    assert float(metrics.variation_ratio(probs)) == pytest.approx(0.5)
    assert float(metrics.predicted_class_std(probs)) == pytest.approx(0.5)
    same = torch.tensor([[[0.5, 0.5]], [[0.5, 0.5]]])
    assert float(metrics.mutual_information(same)) == pytest.approx(0.0, abs=1e-7)
    assert float(metrics.expected_entropy(same)) == pytest.approx(math.log(2))


def test_digits_split_is_fixed_and_scaled():
    a, b = pb.datasets.digits(), pb.datasets.digits()
    assert len(a.x_train) == 1348 and len(a.x_test) == 449
    assert torch.equal(a.y_test, b.y_test) and float(a.x_train.max()) == 1.0
    assert pb.datasets.digits(image=True).x_train.shape[1:] == (1, 8, 8)


def _write_idx(path: Path, arr, gz: bool):
    header = struct.pack(">HBB", 0, 8, arr.dim()) + struct.pack(">" + "I" * arr.dim(), *arr.shape)
    data = header + arr.to(torch.uint8).numpy().tobytes()
    with (gzip.open if gz else open)(path, "wb") as fh:
        fh.write(data)


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_reader(tmp_path, gz):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    imgs = torch.randint(0, 256, (7, 28, 28))
    labels = torch.randint(0, 10, (7,))
    suffix = ".gz" if gz else ""
    _write_idx(raw / f"t10k-images-idx3-ubyte{suffix}", imgs, gz)
    _write_idx(raw / f"t10k-labels-idx1-ubyte{suffix}", labels, gz)
    x, y = pb.datasets.mnist(tmp_path, "test")
    assert x.shape == (7, 784) and torch.equal(y, labels)
    torch.testing.assert_close(x, imgs.reshape(7, -1).float() / 255)
    with pytest.raises(FileNotFoundError, match="not found"):
        pb.datasets.mnist(tmp_path, "train")


def test_real_mnist_if_present():
    root = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
    if not root.exists():
        pytest.skip("shared MNIST not present")
    split = pb.datasets.mnist_split(root)
    assert split.x_train.shape == (5000, 784) and split.x_test.shape == (5000, 784)
    assert set(split.y_train.unique().tolist()) == set(range(10))


def test_toy_regression_curve():
    x, y = pb.datasets.toy_regression(100, seed=1)
    assert x.shape == (100, 1) and y.shape == (100, 1)
    assert float(x.min()) >= 0 and float(x.max()) <= 0.5


def test_evaluate_linearised_regression_uses_regression_metrics():
    torch.manual_seed(0)
    x = torch.rand(200, 1)
    y = 2 * x + 0.1 * torch.randn(200, 1)
    model = pb.BNN(nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)),
                   likelihood="gaussian", noise=0.1)
    guide = pb.guides.Laplace(model)
    pb.fit(model, guide, (x, y), epochs=60, batch_size=50, lr=1e-2, progress=False)
    scores = pb.evaluate(model, guide, x, y, predictive="glm", num_samples=50)
    assert set(scores) == {"rmse", "nll", "coverage_95", "predictive"} and scores["predictive"] == "glm-mc(50)"
    assert scores["rmse"] < 0.15 and 0.85 < scores["coverage_95"] <= 1.0
