"""Masked observations and per-example (local) latents in hand-written models.

* Pyro's ``obs_mask`` splits an observation into ``obs_observed`` and a latent
  ``obs_unobserved`` whose model density carries the mask ``~obs_mask``.  Pyro's
  ``TraceMeanField_ELBO`` weighs a latent's KL by the guide's mask only, so the loss depended
  on the guide's values at observed entries (not in the model); the objective now scores such
  sites by their sampled terms under the model's mask (checked: those values move neither loss
  nor gradient), and the fit reaches the closed-form posterior of Bayesian linear regression
  on the observed entries.
* ``pb.fit`` shuffles and batches examples, which pairs a local latent's per-position guide
  values with other examples: refused before the first step, naming the site, unless the fit
  has one fixed batch.  A plate of latents that is not the data plate is not refused.
* A latent fixed by ``pyro.condition`` is observed but not data: a minibatch's ``N / M`` is not
  applied to it (a ``pyro.factor`` likelihood is data and is) (it was: the posterior sd of log s was 0.21 on batches of 20 for 0.42 on the
  full batch; exact 0.50).
* ``pb.to_arviz`` refuses a masked observation (its pointwise log-likelihood was 0 for every
  entry), and reads an all-observed ``obs_mask`` from its observed part.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

import pyro_bnn as pb

NOISE = 0.1


class MaskedRegression(PyroModule):
    """``y = w x + ε`` whose targets are observed where ``self.mask`` is True (Pyro's obs_mask)."""

    def __init__(self, mask=None):
        super().__init__()
        self.w = PyroSample(dist.Normal(0.0, 1.0))
        self.mask = mask

    def forward(self, x, y=None):
        mean = self.w * x[:, 0]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, NOISE), obs=y,
                               obs_mask=None if y is None else self.mask)


def _masked_data(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=g)
    y = 2.0 * x[:, 0] + NOISE * torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    return x, torch.where(mask, y, torch.zeros(n)), mask  # placeholders 0 where masked


def _quiet_fit(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        return pb.fit(*args, progress=False, **kwargs)


def test_masked_targets_give_the_closed_form_posterior_of_the_observed_ones():
    x, y, mask = _masked_data()
    xo, yo = x[mask, 0], y[mask]
    precision = 1.0 + (xo @ xo) / NOISE**2
    mean, sd = float((xo @ yo) / NOISE**2 / precision), float(precision ** -0.5)
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = MaskedRegression(mask)
    guide = pb.guides.MeanField(model)
    _quiet_fit(model, guide, (x, y), epochs=1500, batch_size=len(x), shuffle=False, lr=0.02, seed=0)
    loc, scale = guide.locs.w.item(), guide.scales.w.item()
    assert abs(loc - mean) < 3 * sd, (loc, mean, sd)
    assert abs(scale / sd - 1) < 0.15, (scale, sd)


def test_the_objective_ignores_the_guide_at_observed_entries_of_an_obs_mask_latent():
    """The guide's values of ``obs_unobserved`` where the target is observed are not in the
    model's density: they move neither the loss nor its gradient."""
    x, y, mask = _masked_data(n=40)
    pyro.clear_param_store()
    model = MaskedRegression(mask)
    guide = pb.guides.MeanField(model)
    _quiet_fit(model, guide, (x, y), epochs=1, batch_size=len(x), shuffle=False, seed=0)
    objective = guide.make_objective()

    def loss():
        torch.manual_seed(1)
        return objective.differentiable_loss(model, guide, x, y)

    before = loss()
    with torch.no_grad():
        guide.locs.obs_unobserved_unconstrained[mask] += 5.0
    assert torch.allclose(loss(), before)
    for p in guide.parameters():
        p.grad = None
    loss().backward()
    assert guide.locs.obs_unobserved_unconstrained.grad[mask].abs().max() == 0
    assert guide.locs.obs_unobserved_unconstrained.grad[~mask].abs().min() > 0


class LocalOffset(PyroModule):
    """A per-example offset ``z_i`` sampled inside the data plate: a local latent."""

    def __init__(self):
        super().__init__()
        self.w = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None):
        w = self.w
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            return pyro.sample("obs", dist.Normal(w * x[:, 0] + z, NOISE), obs=y)


class GroupEffects(PyroModule):
    """Eight group effects in a plate of their own (global latents), then the data plate."""

    def __init__(self):
        super().__init__()
        self.w = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None):
        with pyro.plate("groups", 8):
            effects = pyro.sample("effects", dist.Normal(0.0, 1.0))
        mean = self.w * x[:, 0] + effects[x[:, 1].long()]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, NOISE), obs=y)


@pytest.mark.parametrize("model_class, site, batching", [
    (LocalOffset, "z", dict(batch_size=16)),
    (LocalOffset, "z", dict(batch_size=16, shuffle=False)),
    (LocalOffset, "z", dict(batch_size=64)),
    (MaskedRegression, "obs_unobserved", dict(batch_size=64)),  # its mask is the whole set's
])
def test_a_local_latent_under_changing_batches_is_refused(model_class, site, batching):
    x, y, mask = _masked_data(n=64)
    pyro.clear_param_store()
    model = model_class(mask) if model_class is MaskedRegression else model_class()
    guide = pb.guides.MeanField(model)
    with pytest.raises(ValueError, match=rf"\['{site}'\] have one value per example") as info:
        _quiet_fit(model, guide, (x, y), epochs=1, **batching)
    assert ("obs_mask" in str(info.value)) == (site == "obs_unobserved")


def test_one_fixed_batch_keeps_local_latents_paired():
    x, y, _ = _masked_data(n=32)
    pyro.clear_param_store()
    model = LocalOffset()
    guide = pb.guides.MeanField(model)
    result = _quiet_fit(model, guide, (x, y), epochs=2, batch_size=len(x), shuffle=False)
    assert len(result.history["loss"]) == 2


def test_a_plate_of_global_latents_the_size_of_the_batch_is_not_refused():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(64, 1, generator=g), torch.randint(0, 8, (64, 1), generator=g).float()], 1)
    y = 1.5 * x[:, 0] + torch.linspace(-1, 1, 8)[x[:, 1].long()] + NOISE * torch.randn(64, generator=g)
    pyro.clear_param_store()
    model = GroupEffects()
    guide = pb.guides.MeanField(model)
    result = _quiet_fit(model, guide, (x, y), epochs=2, batch_size=8)  # batches of the groups' size
    assert all(math.isfinite(v) for v in result.history["loss"])


def test_to_arviz_refuses_masked_observations_and_reads_an_all_observed_mask():
    x, y, mask = _masked_data(n=50)
    pyro.clear_param_store()
    model = MaskedRegression(None)
    guide = pb.guides.MeanField(model)
    _quiet_fit(model, guide, (x[mask], y[mask]), epochs=5, batch_size=len(x))
    model.mask = mask
    with pytest.raises(ValueError, match="masked-out entries"):
        pb.to_arviz(model, guide, x, y, num_samples=4, seed=0)
    xo, yo = x[mask], y[mask]
    model.mask = torch.ones(len(xo), dtype=torch.bool)
    idata = pb.to_arviz(model, guide, xo, yo, num_samples=4, seed=0)
    w = torch.as_tensor(idata["posterior"]["w"].values).reshape(-1, 1).float()
    expected = dist.Normal(w * xo[:, 0], NOISE).log_prob(yo).numpy()
    got = idata["log_likelihood"]["obs"].values.reshape(expected.shape)
    assert abs(got - expected).max() < 1e-3 and abs(expected).min() > 0


def _hierarchical(x, y=None):
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, s))
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(w * x[:, 0] + b, NOISE), obs=y)


def test_a_latent_fixed_by_condition_is_not_scaled_to_the_data_set():
    """``pyro.condition(model, {"b": 3})`` makes ``b`` observed, but its density is in the joint
    once: a minibatch's ``N / M`` applies to the data site only (it was applied to both, which
    weighs ``p(b | s)`` ten times on batches of 20 out of 200 and bends the posterior of ``s``)."""
    from pyro_bnn.contract.pyro_objective import scale_observations

    x, y, _ = _masked_data(n=200)
    model = pyro.condition(_hierarchical, data={"b": torch.tensor(3.0)})
    trace = pyro.poutine.trace(scale_observations(10.0, 200, 20)(model)).get_trace(x[:20], y[:20])
    assert trace.nodes["b"]["is_observed"] and trace.nodes["b"]["scale"] == 1.0
    assert trace.nodes["obs"]["scale"] == 10.0
    vector = pyro.poutine.trace(scale_observations(10.0, 200, 20)(  # no plate: the batch's dimension
        lambda x, y: pyro.sample("obs", dist.Normal(x[:, 0], 1.0).to_event(1), obs=y))).get_trace(x[:20], y[:20])
    assert vector.nodes["obs"]["scale"] == 10.0

    def factor_model(x, y):  # a custom likelihood as one pyro.factor: data, scaled
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.factor("loglik", dist.Normal(w * x[:, 0], NOISE).log_prob(y).sum())
    for fixed in (factor_model, pyro.condition(factor_model, data={"w": torch.tensor(0.5)})):
        trace = pyro.poutine.trace(scale_observations(10.0, 200, 20)(fixed)).get_trace(x[:20], y[:20])
        assert trace.nodes["loglik"]["scale"] == 10.0 and trace.nodes["w"]["scale"] == 1.0


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_loader_of_one_batch_in_order_keeps_local_latents(shuffle):
    from torch.utils.data import DataLoader, TensorDataset

    x, y, _ = _masked_data(n=32)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=shuffle)
    pyro.clear_param_store()
    model = LocalOffset()
    guide = pb.guides.MeanField(model)
    if shuffle:
        with pytest.raises(ValueError, match="one value per example"):
            _quiet_fit(model, guide, loader, epochs=1)
    else:
        assert len(_quiet_fit(model, guide, loader, epochs=1).history["loss"]) == 1
