"""Training in float64 (issue 23): ``pb.BNN(net.to(torch.float64))`` with every guide.

``fit`` tells a user with float64 data to build the network in float64 before ``pb.BNN``;
that used to crash for every guide (the priors' buffers stayed float32, so sampled weights
were float32), and the hypernetwork's flow was float32 in any case.  Each case here trains
a tiny network for two epochs on float64 data and checks that the loss is finite, that
every floating parameter and buffer of the guide and the model is float64 and that the
predictions are float64.
"""

import math
import warnings

import numpy as np
import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training.convergence import ConvergenceWarning

F64 = torch.float64


def _data(likelihood, n=24, d=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=F64)
    if likelihood == "categorical":
        return x, (x[:, 0] > 0).long()
    return x, (2 * x[:, :1] + 0.1 * torch.randn(n, 1, generator=g, dtype=F64))


def _net(likelihood, d=3, hidden=5):
    out = 2 if likelihood == "categorical" else 1
    return nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, out)).to(F64)


def _registered(name, **options):
    return lambda model: pb.guides.registered_guides()[name](model, **options)


GUIDES = {
    "meanfield": lambda m: pb.guides.MeanField(m),
    "meanfield_lrt": lambda m: pb.guides.MeanField(m, local_reparameterization=True),
    "meanfield_no_lrt": lambda m: pb.guides.MeanField(m, local_reparameterization=False),
    "meanfield_softplus": lambda m: pb.guides.MeanField(m, scale_parameterization="softplus"),
    "symmetrized": lambda m: pb.guides.Symmetrized(m),
    "laplace_last_layer": _registered("laplace"),
    "laplace_all_layers": _registered("laplace_all"),
    "autonormal": lambda m: AutoNormal(m),
    "hypernet_full": lambda m: pb.guides.Hypernet(m, full=True, num_flows=2, hidden=8),
}


def _floating_tensors(module):
    return {name: t for name, t in list(module.named_parameters()) + list(module.named_buffers())
            if t.is_floating_point()}


def _fit_and_check(model, guide, data, epochs=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        result = pb.fit(model, guide, data, epochs=epochs, batch_size=12, progress=False)
    losses = result.history["loss"]
    assert len(losses) == epochs and all(math.isfinite(v) for v in losses), losses
    tensors = {**{f"guide.{k}": v for k, v in _floating_tensors(guide).items()},
               **{f"model.{k}": v for k, v in _floating_tensors(model).items()}}
    assert any(k.startswith("guide.") for k in tensors), "the guide has no floating tensors to check"
    not64 = {k: v.dtype for k, v in tensors.items() if v.dtype != F64}
    assert not not64, f"tensors not in float64: {not64}"
    x = data[0]
    probs = pb.predict(model, guide, x, num_samples=3)
    assert probs.dtype == F64 and torch.isfinite(probs).all()
    return probs


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("name", sorted(GUIDES))
def test_every_guide_trains_in_float64(name, likelihood):
    model = pb.BNN(_net(likelihood), likelihood, **({"noise": 0.1} if likelihood == "gaussian" else {}))
    _fit_and_check(model, GUIDES[name](model), _data(likelihood))


@pytest.mark.parametrize("flow, num_flows", [("iaf", 0), ("iaf", 2), ("realnvp", 2)])
def test_weight_norm_hypernet_trains_in_float64(flow, num_flows):
    model = pb.BNN(_net("categorical"), weight_norm=True)
    guide = pb.guides.Hypernet(model, flow=flow, num_flows=num_flows, hidden=8)
    _fit_and_check(model, guide, _data("categorical"))
    assert guide.flow.affine.loc.dtype == F64


@pytest.mark.parametrize("prior", [pb.priors.FanInNormal(1.0), pb.priors.ScaleMixture(0.5, 1.0, 0.1)],
                         ids=["fan_in", "scale_mixture"])
def test_other_priors_in_float64(prior):
    model = pb.BNN(_net("categorical"), prior=prior)
    _fit_and_check(model, pb.guides.MeanField(model), _data("categorical"))
    draw = model.site_prior("net.0.weight").sample()
    assert draw.dtype == F64


def test_learned_noise_in_float64():
    model = pb.BNN(_net("gaussian"), "gaussian", noise="learned")
    assert model.likelihood.log_noise.dtype == F64
    _fit_and_check(model, pb.guides.MeanField(model), _data("gaussian"))


def test_priors_and_noise_follow_the_network_dtype_at_construction():
    model = pb.BNN(_net("gaussian"), "gaussian", noise=0.1)
    dtypes = {t.dtype for t in list(model.priors.buffers()) + list(model.likelihood.buffers())}
    assert dtypes == {F64}
    assert model.site_prior("net.0.weight").sample().dtype == F64
    # the float64 noise is the float64 value of 0.1, not float32's 0.10000000149
    assert float(model.likelihood.noise) == pytest.approx(0.1, rel=1e-15)


def test_user_prior_and_likelihood_objects_are_not_converted_in_place():
    prior, lik = pb.priors.IIDNormal(0.5), pb.likelihoods.Gaussian(0.2)
    model64 = pb.BNN(_net("gaussian"), lik, prior=prior)
    assert prior.scale.dtype == torch.float32 and lik.log_noise.dtype == torch.float32
    assert model64.priors["net__0__weight"].scale.dtype == F64
    # one shared prior stays one shared (converted) module
    assert model64.priors["net__0__weight"] is model64.priors["net__2__bias"]
    # the same objects in a float32 model are used as they are (no copy)
    model32 = pb.BNN(_net("gaussian").float(), lik, prior=prior)
    assert model32.priors["net__0__weight"] is prior and model32.likelihood is lik


def test_to_float64_after_construction():
    model = pb.BNN(_net("categorical").float()).to(F64)
    assert {t.dtype for t in model.priors.buffers()} == {F64}
    _fit_and_check(model, pb.guides.MeanField(model), _data("categorical"))


def test_back_to_float32_with_to():
    model = pb.BNN(_net("gaussian"), "gaussian", noise=0.1).to(torch.float32)
    dtypes = {t.dtype for t in list(model.priors.buffers()) + list(model.likelihood.buffers())}
    assert dtypes == {torch.float32}
    assert model.site_prior("net.0.weight").sample().dtype == torch.float32


def test_float32_data_for_a_float64_model_is_refused_with_a_hint():
    model = pb.BNN(_net("categorical"))
    x, y = _data("categorical")
    with pytest.raises(TypeError, match=r"x has dtype torch.float32 but the model's weights are "
                                        r"torch.float64.*x.to\(torch.float64\)"):
        pb.fit(model, pb.guides.MeanField(model), (x.float(), y), epochs=1, progress=False)


def test_float32_inputs_to_predict_evaluate_and_the_model_of_a_float64_model():
    """Float32 inputs for a float64 model are refused with the conversion to make, in
    ``pb.predict``/``pb.evaluate`` (data.py's check) and when the model is called directly
    (``BNN.check_input``; before, a float64 model drew float32 weights from its float32
    priors and silently computed in float32)."""
    model = pb.BNN(_net("categorical"))
    guide = pb.guides.MeanField(model)
    x, y = _data("categorical")
    _fit_and_check(model, guide, (x, y), epochs=1)
    hint = r"x( in pb\.\w+)? has dtype torch.float32 but the model's weights are torch.float64.*x.to\(torch.float64\)"
    with pytest.raises(TypeError, match=hint):
        pb.predict(model, guide, x.float(), num_samples=2)
    with pytest.raises(TypeError, match=hint):
        pb.evaluate(model, guide, x.float(), y, num_samples=2)
    with pytest.raises(TypeError, match=hint + r", or convert the model with model.to\(torch.float32\)"):
        model(x.float())


def test_numpy_float64_hyperparameters():
    model = pb.BNN(_net("gaussian"), "gaussian", noise=np.float64(0.1),
                   prior=pb.priors.IIDNormal(np.float32(0.5)))
    assert model.priors["net__0__weight"].scale.dtype == F64
    assert float(model.priors["net__0__weight"].scale) == pytest.approx(0.5)
    pyro.clear_param_store()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_priors_and_noise_follow_the_network_device_at_construction():
    model = pb.BNN(_net("gaussian").cuda(), "gaussian", noise=0.1)
    tensors = list(model.priors.buffers()) + list(model.likelihood.buffers())
    assert {t.device.type for t in tensors} == {"cuda"} and {t.dtype for t in tensors} == {F64}
    x, y = (t.cuda() for t in _data("gaussian"))
    _fit_and_check(model, pb.guides.MeanField(model), (x, y))


def test_exact_hyperparameters_survive_dtype_conversion_unless_changed():
    prior = pb.priors.IIDNormal(0.1)
    assert float(prior.double().scale) == 0.1  # exactly float64's 0.1
    tuned = pb.priors.IIDNormal(0.1)
    with torch.no_grad():
        tuned.scale.fill_(0.2)  # changed since construction (a tuned or loaded value)
    assert float(tuned.double().scale) == float(torch.tensor(0.2))  # converted as it is
    lik = pb.likelihoods.Gaussian(0.3).double()
    assert float(lik.log_noise) == math.log(0.3)
    assert lik.float().log_noise.dtype == torch.float32
