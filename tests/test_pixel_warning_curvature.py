"""The curvature passes warn about unscaled 0-255 pixels once per model.

``accumulate_curvature`` checks each batch against the likelihood (``BatchCheck`` without the
model); its first batch was looked at for pixels although the caller had just checked the same
data: ``pb.fit`` / ``Laplace.fit_curvature`` / ``optimize_prior_precision`` warned twice,
``Hypernet.update_prior_precision_`` twice, ``learn_invariance(method="lila")`` three times (once
per curvature pass), ``fit_curvature`` on a ``Dataset`` three times (its two passes and the
model's own watch).  The pass now looks only if
nobody has warned about the model's inputs (``inputs_warned``, which reads a ``pb.BNN``'s own
watch too) and marks the model when it warns, as the model's and the guides' watches do.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import pyro_bnn as pb
from pyro_bnn.data.batches import BatchCheck
from pyro_bnn.invariance.learning import learn_invariance
from pyro_bnn.model.input_scale import inputs_warned


@pytest.fixture(scope="module")
def pixels():
    d = pb.datasets.digits()
    return torch.round(d.x_train[:200] * 255), d.y_train[:200]


def _model(**options):
    torch.manual_seed(0)
    return pb.BNN(nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10)), "categorical", **options)


class _Examples(Dataset):
    """A map-style data set of (image, int label) examples: read through a DataLoader."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _count(call) -> int:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        call()
    return sum(w.category is pb.UnscaledPixelsWarning for w in rec)


def test_laplace_warns_once_per_call(pixels):
    x, y = pixels
    model = _model()
    guide = pb.guides.Laplace(model)
    assert _count(lambda: pb.fit(model, guide, (x, y), epochs=1, progress=False, seed=0)) == 1
    for data in ((x, y), DataLoader(TensorDataset(x, y), batch_size=64)):   # checked as they enter: each call
        assert _count(lambda d=data: guide.fit_curvature(d)) == 1, type(data).__name__
    assert _count(lambda: guide.optimize_prior_precision((x, y), steps=2)) == 1
    assert _count(lambda: pb.evaluate(model, guide, x[:50], y[:50])) == 1


def test_laplace_on_a_dataset_warns_once_per_model(pixels):
    """A ``Dataset``'s batches are checked by the curvature passes themselves (fit_curvature reads
    it twice; the model's own watch sees it once more): one warning for the model, not three."""
    x, y = pixels
    guide = pb.guides.Laplace(_model())
    assert _count(lambda: guide.fit_curvature(_Examples(x, y))) == 1
    assert _count(lambda: guide.fit_curvature(_Examples(x, y))) == 0


def test_a_fit_on_a_loader_warns_once(pixels):
    x, y = pixels
    model = _model()
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    assert _count(lambda: pb.fit(model, pb.guides.Laplace(model), loader, epochs=1, progress=False, seed=0)) == 1


def test_the_other_curvature_passes_warn_once(pixels):
    x, y = pixels
    model = _model(weight_norm=True)
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=16)
    assert _count(lambda: pb.fit(model, guide, (x, y), epochs=1, batch_size=50, progress=False, seed=0)) == 1
    assert _count(lambda: guide.update_prior_precision_((x, y), steps=2)) == 1
    lila = _model(augmentation=pb.invariance.AffineAugmentation(num_samples=2))
    assert _count(lambda: learn_invariance(lila, (x, y), method="lila", epochs=2, batch_size=50, burnin=0,
                                           seed=0)) == 1


def test_a_check_for_a_model_looks_once_per_model_and_an_entry_points_check_every_call(pixels):
    """``BatchCheck(inputs_of=model)`` (the curvature pass) looks unless the model was warned
    about, and marks it; ``BatchCheck(model)`` (an entry point: pb.evaluate, pb.fit) warns at
    every call, as documented."""
    x, _ = pixels
    for model in (_model(), nn.Linear(64, 10)):        # a pb.BNN (its watch) and a hand-written module (a mark)
        assert not inputs_warned(model)
        assert _count(lambda m=model: BatchCheck(inputs_of=m)(x)) == 1
        assert inputs_warned(model)
        assert _count(lambda m=model: BatchCheck(inputs_of=m)(x)) == 0
        assert _count(lambda m=model: BatchCheck(m)(x)) == 1
    assert _count(lambda: BatchCheck()(x)) == 1           # no model: every check looks
    scaled = _model()
    assert _count(lambda: BatchCheck(inputs_of=scaled)(x / 255)) == 0 and not inputs_warned(scaled)
