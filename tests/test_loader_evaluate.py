"""``pb.evaluate``, ``pb.predict`` and ``pb.to_arviz`` on a ``DataLoader`` of the test set.

The loader is read once, each batch checked as tensors are, and its examples scored as the
same tensors would be: the same joint draws for every batch, so the same seed gives the same
numbers (bit-equal) for MeanField (``predictive="sample"``) and Laplace (``"glm"``); see
:mod:`pyro_bnn.data.prediction_data`.
"""

import warnings
from pathlib import Path

import pyro
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import pyro_bnn as pb


class _Images(Dataset):
    """Examples as torchvision's image data sets give them after ``ToTensor``: a ``(1, 8, 8)``
    float image and a Python ``int`` label."""

    def __init__(self, x, y):
        self.x, self.y = x.reshape(-1, 1, 8, 8), y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))


@pytest.fixture(scope="module")
def digits():
    d = pb.datasets.digits()
    return d.x_train[:300], d.y_train[:300], d.x_test[:150].reshape(-1, 1, 8, 8), d.y_test[:150]


@pytest.fixture(scope="module")
def meanfield(digits):
    x, y, _, _ = digits
    model = pb.BNN(_net(), "categorical")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=3, progress=False, seed=0)
    return model, guide


@pytest.fixture(scope="module")
def laplace(digits):
    """A MAP network (trained by plain torch: faster here than pb.fit's evidence updates) and
    its Laplace posterior over every layer."""
    x, y, _, _ = digits
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-2)
    for _ in range(100):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    model = pb.BNN(net, "categorical")
    return model, pb.guides.Laplace(model).fit_curvature((x, y))


def _seeded(fn, seed=3):
    pyro.set_rng_seed(seed)
    out = fn()
    return out, torch.get_rng_state()


@pytest.mark.parametrize("guide_name, predictive", [("meanfield", "sample"), ("laplace", "glm"),
                                                    ("laplace", "glm_probit")])
def test_a_loader_gives_the_tensors_results(request, digits, guide_name, predictive):
    """Same seed, same numbers, bit for bit: the loader's batches (37, not the predictive's
    batch_size of 64) see the same joint draws, and reading the loader (which draws its base
    seed from torch's global stream) does not shift them."""
    model, guide = request.getfixturevalue(guide_name)
    _, _, xt, yt = digits
    loader = DataLoader(_Images(xt, yt), batch_size=37)
    options = dict(num_samples=8, batch_size=64, predictive=predictive)
    ref, state = _seeded(lambda: pb.evaluate(model, guide, xt, yt, **options))
    got, state_loader = _seeded(lambda: pb.evaluate(model, guide, loader, **options))
    assert got == ref
    assert torch.equal(state_loader, state)          # the caller's stream ends where it did with tensors
    probs, _ = _seeded(lambda: pb.predict(model, guide, xt, **options))
    for batches in (loader, DataLoader(TensorDataset(xt), batch_size=37),      # (x,) batches
                    DataLoader(xt, batch_size=37)):                              # bare x batches
        got_probs, _ = _seeded(lambda b=batches: pb.predict(model, guide, b, **options))
        assert torch.equal(got_probs, probs)
    assert ref["accuracy"] > 0.5                     # a trained model, not a constant one


def test_to_arviz_on_a_loader_gives_the_tensors_groups(meanfield, digits):
    model, guide = meanfield
    _, _, xt, yt = digits
    ref = pb.to_arviz(model, guide, xt[:60], yt[:60], num_samples=4, seed=1, posterior_predictive=False)
    got = pb.to_arviz(model, guide, DataLoader(_Images(xt[:60], yt[:60]), batch_size=25), num_samples=4,
                      seed=1, posterior_predictive=False)
    for group in ("log_likelihood", "observed_data", "sample_stats"):
        for name in ref[group].data_vars:
            assert (got[group][name].values == ref[group][name].values).all(), (group, name)


def test_a_shuffled_loader_gives_the_same_metrics_and_predict_follows_its_order(meanfield, digits):
    model, guide = meanfield
    _, _, xt, yt = digits
    ref, _ = _seeded(lambda: pb.evaluate(model, guide, xt, yt, num_samples=8))
    shuffled = DataLoader(TensorDataset(xt, yt), batch_size=32, shuffle=True,
                          generator=torch.Generator().manual_seed(5))
    got, _ = _seeded(lambda: pb.evaluate(model, guide, shuffled, num_samples=8))
    assert got.pop("predictive") == ref.pop("predictive")
    assert got == pytest.approx(ref, abs=1e-6)       # the same scores, summed in another order
    shuffled.generator.manual_seed(5)
    probs, _ = _seeded(lambda: pb.predict(model, guide, shuffled, num_samples=8))
    shuffled.generator.manual_seed(5)                # the same pass again: the order predict saw
    order = torch.cat([xb for xb, _ in shuffled])
    assert not torch.equal(order, xt)
    expected, _ = _seeded(lambda: pb.predict(model, guide, order, num_samples=8))
    assert torch.equal(probs, expected)


def test_regression_targets_of_one_output_from_a_loader():
    """Gaussian targets (N,) of a one-output network become (N, 1), batch by batch, as tensors do."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(90, 3, generator=g)
    y = x.sum(1) + 0.1 * torch.randn(90, generator=g)
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), "gaussian", noise=0.1)
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y[:, None]), epochs=2, progress=False, seed=0)
    ref, _ = _seeded(lambda: pb.evaluate(model, guide, x, y, num_samples=4))
    got, _ = _seeded(lambda: pb.evaluate(model, guide, DataLoader(TensorDataset(x, y), batch_size=40), num_samples=4))
    assert got == ref and set(ref) >= {"rmse", "nll", "coverage_95"}


def _rows(xt, yt, n=10):
    return xt[:n].reshape(n, -1), yt[:n]


def test_loader_structure_errors_name_what_was_expected(meanfield, digits):
    model, guide = meanfield
    _, _, xt, yt = digits
    x, y = _rows(xt, yt, 20)
    with pytest.raises(ValueError, match=r"batch 1 of the DataLoader given to pb.evaluate holds no targets "
                                         r"\(a Tensor of shape \(8, 64\)\).*expected \(x, y\) batches"):
        pb.evaluate(model, guide, DataLoader(x, batch_size=8))
    with pytest.raises(ValueError, match=r"holds no targets \(a list of 1 \(Tensor\)\)"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(x), batch_size=8))
    with pytest.raises(ValueError, match=r"pb.evaluate got a DataLoader and y= \(Tensor\); the loader's batches "
                                         r"hold the targets"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(x, y), batch_size=8), y)
    with pytest.raises(TypeError, match=r"batch 1 of the DataLoader given to pb.evaluate is a list of 3 "
                                        r"\(Tensor, Tensor, Tensor\); expected \(x, y\) batches"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(x, y, y), batch_size=8))
    with pytest.raises(TypeError, match=r"batch 1 of the DataLoader given to pb.predict is a dict with keys "
                                        r"\['image', 'label'\]; expected batches x, \(x,\) or \(x, y\).*collate_fn"):
        pb.predict(model, guide, DataLoader([{"image": r, "label": 0} for r in x], batch_size=8))
    with pytest.raises(ValueError, match=r"the DataLoader given to pb.predict is empty: it yielded no batch "
                                         r"\(0 examples, batch_size=8"):
        pb.predict(model, guide, DataLoader(TensorDataset(x[:0]), batch_size=8))
    with pytest.raises(ValueError, match=r"the DataLoader given to pb.evaluate is empty.*drop_last=True"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(x, y), batch_size=32, drop_last=True))
    with pytest.raises(TypeError, match=r"x in pb.evaluate must be a torch.Tensor or a DataLoader of \(x, y\) "
                                        r"batches, got _Images \(a Dataset: pass DataLoader\(dataset"):
        pb.evaluate(model, guide, _Images(x, y))
    with pytest.raises(TypeError, match=r"x in pb.predict must be a torch.Tensor or a DataLoader of x or "
                                        r"\(x, y\) batches, got list"):
        pb.predict(model, guide, list(x))
    with pytest.raises(TypeError, match=r"pb.evaluate scores predictions against targets: pass y"):
        pb.evaluate(model, guide, x)
    with pytest.raises(TypeError, match=r"pb.to_arviz scores predictions against targets: pass y"):
        pb.to_arviz(model, guide, x)


class _Ragged(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return (torch.zeros(64) if i < 10 else torch.zeros(1, 8, 8)), 0


def test_batches_must_share_their_layout(meanfield):
    model, guide = meanfield
    with pytest.raises(ValueError, match=r"x in batch 2 of the DataLoader given to pb.evaluate has shape "
                                         r"\(10, 1, 8, 8\), dtype torch.float32 on cpu, but batch 1 had \(10, 64\)"):
        pb.evaluate(model, guide, DataLoader(_Ragged(), batch_size=10), num_samples=2)


def test_the_tensor_checks_apply_to_every_batch(meanfield, digits):
    model, guide = meanfield
    _, _, xt, yt = digits
    x, y = _rows(xt, yt, 30)
    bad = x.clone()
    bad[25, 3] = float("nan")
    with pytest.raises(ValueError, match=r"x in batch 3 of the DataLoader given to pb.evaluate contains 1 NaN/inf"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(bad, y), batch_size=10), num_samples=2)
    with pytest.raises(TypeError, match=r"x in batch 1 of the DataLoader given to pb.predict has dtype "
                                        r"torch.float64 but the model's weights are torch.float32"):
        pb.predict(model, guide, DataLoader(x.double(), batch_size=10), num_samples=2)
    labels = y.clone()
    labels[15] = 10
    with pytest.raises(ValueError, match=r"y in batch 2 of the DataLoader given to pb.evaluate: labels must "
                                         r"lie in \[0, 9\]"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(x, labels), batch_size=10), num_samples=2)
    with pytest.raises(TypeError, match=r"y in batch 1 of the DataLoader given to pb.to_arviz: .*y.long\(\)"):
        pb.to_arviz(model, guide, DataLoader(TensorDataset(x, labels.float()), batch_size=10), num_samples=2)
    with pytest.raises(ValueError, match=r"must hold 64 values for Flatten -> Linear\(64, ...\), got input of shape \(10, 63\)"):
        pb.evaluate(model, guide, DataLoader(TensorDataset(x[:, :63], y), batch_size=10), num_samples=2)
    # int32 labels are read as int64, as with tensors
    ref, _ = _seeded(lambda: pb.evaluate(model, guide, x, y, num_samples=2))
    got, _ = _seeded(lambda: pb.evaluate(model, guide, DataLoader(TensorDataset(x, y.int()), batch_size=7),
                                         num_samples=2))
    assert got == ref


def test_unscaled_pixels_in_a_loader_are_warned_once_at_the_callers_line(meanfield, digits):
    model, guide = meanfield
    _, _, xt, yt = digits
    loader = DataLoader(TensorDataset(torch.round(xt * 255), yt), batch_size=50)
    for call, where in [(lambda: pb.evaluate(model, guide, loader, num_samples=2), "pb.evaluate"),
                        (lambda: pb.predict(model, guide, loader, num_samples=2), "pb.predict"),
                        (lambda: pb.evaluate(model, guide, loader, num_samples=2, predictive="sample"),
                         "pb.evaluate")]:
        with pytest.warns(pb.UnscaledPixelsWarning,
                          match=rf"^x in batch 1 of the DataLoader given to {where} holds whole numbers") as rec:
            call()
        pixels = [w for w in rec if w.category is pb.UnscaledPixelsWarning]
        assert len(pixels) == 1 and Path(pixels[0].filename).name == Path(__file__).name


def test_the_glm_evaluate_of_a_loader_warns_once(laplace, digits):
    """evaluate's GLM path used to check its inputs twice (as pb.evaluate, then as pb.predict)."""
    model, guide = laplace
    _, _, xt, yt = digits
    pixels = torch.round(xt * 255)
    for call in (lambda: pb.evaluate(model, guide, DataLoader(TensorDataset(pixels, yt), batch_size=50)),
                 lambda: pb.evaluate(model, guide, pixels, yt)):
        with pytest.warns(pb.UnscaledPixelsWarning) as rec:
            call()
        assert sum(w.category is pb.UnscaledPixelsWarning for w in rec) == 1
