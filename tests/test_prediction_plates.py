"""Issue 23: hand-written models with a subsampled data plate predict on any number of inputs.

``pyro.plate("data", N, subsample_size=len(x))`` with ``N`` the training-set size: trained
in batches of 50, the model must be evaluated on 7, 200 or 300 (> N) points with every guide.
A site sampled *inside* that plate is local (one value per training point): prediction for
new inputs is undefined and must say so, not fail with Pyro's subsample-size error.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro_bnn as pb


class _Linear(PyroModule):
    """y = w x + b + N(0, 0.1²), global w and b read before the subsampled plate."""

    def __init__(self, num_data, local=False):
        super().__init__()
        self.num_data, self.local = num_data, local
        self.w = PyroSample(dist.Normal(0.0, 1.0))
        self.b = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None):
        if not self.local:
            w, b = self.w, self.b
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            if self.local:              # read inside the plate: Pyro makes them per-point
                w, b = self.w, self.b
            mean = w * x[:, 0] + b
            pyro.sample("obs", dist.Normal(mean, 0.1), obs=y)
        return mean


def _data(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=g)
    return x, 2.0 * x[:, 0] + 0.5 + 0.1 * torch.randn(n, generator=g)


def _guide(name, model):
    return pb.guides.MeanField(model) if name == "MeanField" else AutoNormal(model, init_scale=0.01)


@pytest.mark.parametrize("name", ["MeanField", "AutoNormal"])
@pytest.mark.slow
def test_subsampled_plate_model_predicts_any_number_of_inputs(name):
    x, y = _data()
    model = _Linear(200)
    guide = _guide(name, model)
    pb.fit(model, guide, (x, y), epochs=30, batch_size=50, lr=0.05, progress=False, seed=0)
    scores = pb.evaluate(model, guide, x, y, num_samples=32)
    assert scores["rmse"] <= 0.2, scores
    assert scores["predictive"] == "sample(32)"
    assert pb.predict(model, guide, x[:7], num_samples=5).shape == (5, 7)
    assert pb.predict(model, guide, x, num_samples=5).shape == (5, 200)
    # more inputs than the plate's N (Pyro's own plate refuses subsample_size > N)
    x_new, y_new = _data(300, seed=1)
    assert pb.predict(model, guide, x_new, num_samples=3, batch_size=128).shape == (3, 300)
    assert pb.evaluate(model, guide, x_new, y_new, num_samples=32)["rmse"] <= 0.2
    # the same draws give the same means for a point alone and in the batch
    torch.manual_seed(2)
    alone = pb.predict(model, guide, x[:7], num_samples=4)
    torch.manual_seed(2)
    together = pb.predict(model, guide, x, num_samples=4)
    torch.testing.assert_close(alone, together[:, :7])
    dt = pb.to_arviz(model, guide, x, y, num_samples=8, seed=0)
    assert dt["log_likelihood"]["obs"].shape == (1, 8, 200)


def test_guide_with_a_subsampling_plate_but_global_latents():
    """A hand-written guide that opens the data plate itself: its index site is not a latent,
    so the model's plate is not pinned to the guide's subsample (which has len(x[:1]))."""
    x, y = _data()
    model = _Linear(200)

    def guide(x, y=None):
        loc = pyro.param("loc", torch.tensor([2.0, 0.5]))
        pyro.sample("w", dist.Normal(loc[0], 0.01))
        pyro.sample("b", dist.Normal(loc[1], 0.01))
        with pyro.plate("data", 200, subsample_size=len(x)):
            pass

    pyro.clear_param_store()
    scores = pb.evaluate(model, guide, x, y, num_samples=8)
    assert scores["rmse"] <= 0.2


@pytest.mark.parametrize("name", ["MeanField", "AutoNormal"])
def test_latents_sampled_inside_the_subsampled_plate_are_a_clear_error(name):
    x, y = _data()
    model = _Linear(200, local=True)
    guide = _guide(name, model)
    with pytest.raises(ValueError, match=r"latent site\(s\) \['w', 'b'\] have one value per example"):
        pb.fit(model, guide, (x, y), epochs=2, batch_size=50, progress=False, seed=0)  # minibatches
    with pytest.warns(pb.ConvergenceWarning):   # one fixed batch keeps them paired: trains
        pb.fit(model, guide, (x, y), epochs=2, batch_size=len(x), shuffle=False, progress=False, seed=0)
    with pytest.raises(ValueError, match="local latent"):
        pb.predict(model, guide, x[:7], num_samples=2)
    with pytest.raises((ValueError, RuntimeError)):  # other inputs than the training set's 200
        pb.to_arviz(model, guide, x[:50], y[:50], num_samples=2)
