"""``seed=`` of pb.predict / pb.evaluate / pb.predictive_samples: reproducible draws that leave
the caller's random streams as they were (as ``pb.to_arviz(seed=)``)."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_bnn as pb


@pytest.fixture(scope="module")
def fitted():
    torch.manual_seed(0)
    x = torch.randn(60, 4)
    y = (x[:, 0] > 0).long()
    model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "categorical")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=3, progress=False, seed=0)
    laplace_model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "categorical")
    laplace = pb.guides.Laplace(laplace_model, subset="last_layer")
    pb.fit(laplace_model, laplace, (x, y), epochs=3, progress=False, seed=0)
    return x, y, (model, guide), (laplace_model, laplace)


@pytest.mark.parametrize("which", ["meanfield", "laplace"])
def test_predict_with_a_seed_repeats_its_draws_and_leaves_the_callers_stream(fitted, which):
    x, _, mf, lap = fitted
    model, guide = mf if which == "meanfield" else lap
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = pb.predict(model, guide, x, num_samples=5, seed=7)
    after = torch.rand(3)
    b = pb.predict(model, guide, x, num_samples=5, seed=7)
    c = pb.predict(model, guide, x, num_samples=5, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(after, expected_next)   # the caller's stream did not move


def test_evaluate_and_predictive_samples_take_a_seed(fitted):
    x, y, (model, guide), _ = fitted
    first = pb.evaluate(model, guide, x, y, num_samples=4, seed=3)
    assert first == pb.evaluate(model, guide, x, y, num_samples=4, seed=3)
    assert first["nll"] != pb.evaluate(model, guide, x, y, num_samples=4, seed=4)["nll"]
    s1 = pb.predictive_samples(model, guide, x, num_samples=4, seed=3)
    s2 = pb.predictive_samples(model, guide, x, num_samples=4, seed=3)
    assert torch.equal(s1.probs, s2.probs)
    # pb.predict's draws at a seed are predictive_samples' at that seed
    assert torch.equal(pb.predict(model, guide, x, num_samples=4, seed=3), s1.probs)


def test_a_loader_and_its_tensors_give_the_same_draws_at_one_seed(fitted):
    x, y, (model, guide), _ = fitted
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    assert torch.equal(pb.predict(model, guide, loader, num_samples=4, seed=11),
                       pb.predict(model, guide, x, num_samples=4, seed=11))
    assert pb.evaluate(model, guide, loader, num_samples=4, seed=11) == \
        pb.evaluate(model, guide, x, y, num_samples=4, seed=11)


def test_seed_is_keyword_only(fitted):
    x, _, (model, guide), _ = fitted
    with pytest.raises(TypeError):
        pb.predict(model, guide, x, 4, 1024, None, 7)  # the options are keyword-only
