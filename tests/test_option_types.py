"""Option types of ``pb.BNN``, the Gaussian noise and ``pruning.prune_`` (issue 23).

``BNN(weight_norm="False")`` used to turn weight norm *on* (a non-empty string is truthy),
``noise=np.float32(0.1)`` and ``noise=torch.tensor(0.1)`` were refused, and
``prune_(sites=["net.0.wieght"])`` pruned nothing of what was meant without a word.  Each
option now takes the types it documents and refuses the rest with a message that says
what was expected and what was received (naming the closest valid choice for strings).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis import pruning
from pyro_bnn.training.convergence import ConvergenceWarning


def _net(out=3):
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out))


# ------------------------------------------------------------------ BNN booleans
@pytest.mark.parametrize("value", ["False", "True", 0, 1, None, 1.0])
def test_weight_norm_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"weight_norm must be True or False, got {value!r}"):
        pb.BNN(_net(), weight_norm=value)


def test_weight_norm_bools_accepted():
    assert pb.BNN(_net(), weight_norm=False).site_names == ["net.0.weight", "net.0.bias",
                                                             "net.2.weight", "net.2.bias"]
    for value in (True, np.bool_(True)):
        model = pb.BNN(_net(), weight_norm=value)
        assert model.weight_norm is True and model.site_names == ["net.0.weight_g", "net.2.weight_g"]


# ------------------------------------------------------------------ likelihood names
@pytest.mark.parametrize("name, close", [("Gaussian", "gaussian"), ("categorial", "categorical"),
                                         ("bernouli", "bernoulli"), ("CATEGORICAL", "categorical")])
def test_likelihood_name_typo_names_the_closest(name, close):
    with pytest.raises(ValueError, match=rf"likelihood must be one of .*got {name!r}; did you mean {close!r}\?"):
        pb.BNN(_net(), name)


@pytest.mark.parametrize("value", [nn.CrossEntropyLoss(), None, 3])
def test_likelihood_of_another_type(value):
    with pytest.raises(TypeError, match=r"likelihood must be one of .* or a pyro_bnn.model.likelihoods.Likelihood, got"):
        pb.BNN(_net(), value)


def test_likelihood_aliases_still_accepted():
    for name in ("normal", "regression", "gaussian"):
        assert pb.BNN(_net(1), name, noise=0.5).likelihood.name == "gaussian"


def test_a_gaussian_without_noise_warns_that_its_sigma_is_fixed_at_one():
    """σ = 1 whatever the targets' scale is a silent modelling choice: named, pointing at the
    caller; an explicit noise= (1.0 included) or a Likelihood instance is not warned of."""
    with pytest.warns(UserWarning, match=r"likelihood='gaussian' without noise=: the observation noise is "
                                         r"fixed at σ = 1") as record:
        model = pb.BNN(_net(1), "gaussian")
    assert float(model.likelihood.noise) == 1.0
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.BNN(_net(1), "gaussian", noise=1.0)
        pb.BNN(_net(1), "gaussian", noise="learned")
        pb.BNN(_net(1), pb.model.likelihoods.Gaussian())


# ------------------------------------------------------------------ noise
@pytest.mark.parametrize("noise", [0.1, np.float32(0.1), np.float64(0.1), torch.tensor(0.1),
                                   torch.tensor(0.1, dtype=torch.float64), np.array(0.1)],
                         ids=["float", "np.float32", "np.float64", "tensor", "tensor64", "np.array0d"])
def test_noise_real_scalars_accepted(noise):
    model = pb.BNN(_net(1), "gaussian", noise=noise)
    assert float(model.likelihood.noise) == pytest.approx(float(noise), rel=1e-6)
    assert not model.likelihood.learned


def test_noise_int_accepted_exactly():
    assert float(pb.BNN(_net(1), "gaussian", noise=2).likelihood.noise) == pytest.approx(2.0, rel=1e-7)


@pytest.mark.parametrize("noise, error, pattern", [
    (0, ValueError, r"noise must be > 0, got 0.0"),
    (-0.1, ValueError, r"noise must be > 0, got -0.1"),
    (math.nan, ValueError, r"noise must be a finite number, got nan"),
    (math.inf, ValueError, r"noise must be a finite number, got inf"),
    (torch.ones(2), TypeError, r"noise must be a real number .*shape \(2,\)"),
    (True, TypeError, r"noise must be a real number, got bool True"),
    (np.bool_(True), TypeError, r"noise must be a real number, got bool"),
    (torch.tensor(True), TypeError, r"noise must be a real number, got a Tensor of dtype torch.bool"),
    (1 + 0j, TypeError, r"noise must be a real number, got complex"),
    ("0.1", ValueError, r"noise must be one of \['learned'\], got '0.1' \(or a positive number"),
    ("learnt", ValueError, r"got 'learnt'; did you mean 'learned'\?"),
    ([0.1], TypeError, r"noise must be a real number, got list"),
])
def test_noise_refused(noise, error, pattern):
    with pytest.raises(error, match=pattern):
        pb.BNN(_net(1), "gaussian", noise=noise)


def test_noise_learned_and_init_noise():
    lik = pb.likelihoods.Gaussian("learned", init_noise=np.float32(0.5))
    assert lik.learned and float(lik.noise.detach()) == pytest.approx(0.5, rel=1e-6)
    with pytest.raises(ValueError, match="init_noise must be > 0"):
        pb.likelihoods.Gaussian("learned", init_noise=0.0)


def test_noise_with_a_likelihood_it_does_not_apply_to():
    with pytest.raises(ValueError, match="noise= applies to the gaussian likelihood, not 'categorical'"):
        pb.BNN(_net(), "categorical", noise=0.1)
    # next to a Gaussian instance noise= was silently ignored
    with pytest.raises(ValueError, match=r"noise= is ignored next to a likelihood instance \(Gaussian\)"):
        pb.BNN(_net(1), pb.likelihoods.Gaussian(0.3), noise=0.1)


# ------------------------------------------------------------------ prior arguments
def test_prior_hyperparameters_numpy_scalars():
    assert float(pb.priors.IIDNormal(np.float32(0.5)).scale) == 0.5
    assert float(pb.priors.IIDNormal(1.0, loc=np.int64(2)).loc) == 2.0
    assert float(pb.priors.ScaleMixture(np.float32(0.25), np.float64(1.0), 0.1).pi) == 0.25
    assert float(pb.priors.FanInNormal(np.array(2.0)).gain) == 2.0


@pytest.mark.parametrize("make, error, pattern", [
    (lambda: pb.priors.IIDNormal(True), TypeError, "IIDNormal scale must be a real number, got bool"),
    (lambda: pb.priors.IIDNormal(np.bool_(True)), TypeError, "IIDNormal scale must be a real number, got bool"),
    (lambda: pb.priors.IIDNormal(torch.tensor(1 + 1j)), TypeError, "IIDNormal scale must be a real number, got a Tensor of dtype"),
    (lambda: pb.priors.IIDNormal(np.ones(2)), TypeError, r"one-element tensor\), got a ndarray of shape \(2,\)"),
    (lambda: pb.priors.IIDNormal(None), TypeError, "IIDNormal scale must be a real number, got NoneType"),
    (lambda: pb.priors.FanInNormal("2"), TypeError, "FanInNormal gain must be a real number, got str"),
])
def test_prior_hyperparameters_refused(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


@pytest.mark.parametrize("prior, pattern", [
    ("normal", r"prior must be a pyro_bnn.model.priors.Prior.*a dict of them .*got str"),
    ({"*": 1.0}, r"prior for 'net.0.weight' must be a pyro_bnn.model.priors.Prior, got float"),
])
def test_prior_of_another_type(prior, pattern):
    with pytest.raises(TypeError, match=pattern):
        pb.BNN(_net(), prior=prior)


@pytest.mark.parametrize("value, scale", [(np.float32(4.0), 0.5), (torch.tensor(4.0), 0.5), (1, 1.0)])
def test_weight_norm_precision_scalars(value, scale):
    model = pb.BNN(_net(), weight_norm=True, weight_norm_precision=value)
    assert float(model.priors["net__0__weight_g"].scale) == pytest.approx(scale)


@pytest.mark.parametrize("value, error", [("4", TypeError), (True, TypeError), (0, ValueError),
                                          (-1.0, ValueError), (math.nan, ValueError)])
def test_weight_norm_precision_refused(value, error):
    with pytest.raises(error, match="weight_norm_precision must be"):
        pb.BNN(_net(), weight_norm=True, weight_norm_precision=value)


# ------------------------------------------------------------------ stochastic= paths
def test_stochastic_one_string_is_one_path():
    # a string used to be iterated character by character
    assert pb.BNN(_net(), stochastic="net.0.weight").site_names == ["net.0.weight"]
    assert pb.BNN(_net(), stochastic=["2.bias"]).site_names == ["net.2.bias"]


def test_stochastic_typo_names_the_closest_parameter():
    with pytest.raises(ValueError, match=r"'0.wieght' \(did you mean 'net.0.weight'\?\)"):
        pb.BNN(_net(), stochastic=["net.0.wieght"])


@pytest.mark.parametrize("value, pattern", [([0], r"parameter paths must be strings .*got 0 \(int\)"),
                                            (5, r"stochastic must be None, a predicate .*got int")])
def test_stochastic_of_another_type(value, pattern):
    with pytest.raises(TypeError, match=pattern):
        pb.BNN(_net(), stochastic=value)


# ------------------------------------------------------------------ pruning options
@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = pb.BNN(_net())
    guide = pb.guides.MeanField(model)
    x = torch.randn(16, 4)
    y = (x[:, 0] > 0).long()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=1, batch_size=8, progress=False)
    return model, guide, x, y


@pytest.mark.parametrize("sites, hint", [(["net.0.wieght"], "net.0.weight"), (["0.weight"], "net.0.weight"),
                                         (["net.2.bais", "net.0.weight"], "net.2.bias")])
def test_prune_site_typo_names_the_closest_site(trained, sites, hint):
    model, guide, _, _ = trained
    with pytest.raises(ValueError, match=rf"sites= names no site of the model: .*did you mean {hint!r}\?"):
        pruning.prune_(model, guide, fraction=0.5, sites=sites)
    assert pruning.unprune_(model) is False  # nothing was installed


def test_prune_one_site_name_and_list(trained):
    model, guide, _, _ = trained
    handle = pruning.prune_(model, guide, fraction=0.5, sites="net.0.weight")
    assert list(handle.masks) == ["net.0.weight"] and handle.num_total == 24 and handle.num_pruned == 12
    handle = pruning.prune_(model, guide, fraction=0.5, sites=["net.0.weight", "net.2.bias"])
    assert sorted(handle.masks) == ["net.0.weight", "net.2.bias"] and handle.num_total == 27
    handle.remove()


def test_prune_site_typo_with_precomputed_scores(trained):
    model, guide, _, _ = trained
    score = pruning.scores(guide, kind="snr", model=model)
    with pytest.raises(ValueError, match=r"did you mean 'net.2.weight'\?"):
        pruning.prune_(model, guide, fraction=0.5, sites=["net.2.weigth"], score=score)


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"fraction": True}, TypeError, r"fraction must be a number in \[0, 1\], got True"),
    ({"fraction": "0.5"}, TypeError, r"fraction must be a number in \[0, 1\], got '0.5'"),
    ({"fraction": 1.5}, ValueError, r"fraction must be in \[0, 1\], got 1.5"),
    ({"fraction": math.nan}, ValueError, r"fraction must be in \[0, 1\], got nan"),
    ({"threshold": math.nan}, ValueError, r"threshold must be a number, got nan"),
    ({"threshold": "1"}, TypeError, r"threshold must be a number, got '1'"),
    ({"fraction": 0.5, "num_samples": 2.5}, TypeError, r"num_samples must be an int >= 1, got 2.5"),
    ({"fraction": 0.5, "num_samples": 0}, ValueError, r"num_samples must be an int >= 1, got 0"),
    ({"fraction": 0.5, "kind": "SNR"}, ValueError, r"kind must be one of .*did you mean 'snr'\?"),
    ({"fraction": 0.5, "sites": [3]}, TypeError, r"sites must be site names \(str\), got 3"),
    ({"fraction": 0.5, "sites": 3}, TypeError, r"sites must be None, a site name"),
    ({"fraction": 0.5, "score": [1.0]}, TypeError, r"score must be a dict"),
])
def test_prune_options_refused(trained, kwargs, error, pattern):
    model, guide, _, _ = trained
    with pytest.raises(error, match=pattern):
        pruning.prune_(model, guide, **kwargs)


def test_prune_numeric_scalars_accepted(trained):
    model, guide, _, _ = trained
    total = sum(v.numel() for v in model.initial_values().values())
    for fraction in (np.float32(0.5), torch.tensor(0.5), 0.5):
        assert pruning.prune_(model, guide, fraction=fraction).num_pruned == total // 2
    assert pruning.prune_(model, guide, threshold=math.inf).num_pruned == total
    assert pruning.prune_(model, guide, threshold=-math.inf).num_pruned == 0
    pruning.unprune_(model)


@pytest.mark.parametrize("call", ["scores", "posterior_mean", "export_pruned"])
def test_num_samples_float_refused_everywhere(trained, call):
    model, guide, _, _ = trained
    run = {"scores": lambda: pruning.scores(guide, kind="snr", model=model, num_samples=2.5),
           "posterior_mean": lambda: pruning.posterior_mean(model, guide, num_samples=2.5),
           "export_pruned": lambda: pruning.export_pruned(model, guide, num_samples=2.5)}[call]
    with pytest.raises(TypeError, match=r"num_samples must be an int >= 1, got 2.5"):
        run()


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"fractions": 0.5}, TypeError, r"fractions must be a sequence of numbers in \[0, 1\]"),
    ({"fractions": [0.0, 2.0]}, ValueError, r"each of fractions must be in \[0, 1\], got 2.0"),
    ({"num_samples": 2.5}, TypeError, r"num_samples must be an int >= 1, got 2.5"),
    ({"batch_size": 0}, ValueError, r"batch_size must be an int >= 1, got 0"),
    ({"sites": ["net.0.wieght"]}, ValueError, r"did you mean 'net.0.weight'\?"),
])
def test_pruning_curve_options_refused(trained, kwargs, error, pattern):
    model, guide, x, y = trained
    with pytest.raises(error, match=pattern):
        pruning.pruning_curve(model, guide, x, y, **{"fractions": [0.0, 0.5], "num_samples": 2, **kwargs})
    assert pruning.unprune_(model) is False


# ------------------------------------------------------------------ Hypernet options
@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"full": "False"}, TypeError, r"full must be True or False, got 'False'"),
    ({"flow": "IAF"}, ValueError, r"flow must be one of .*did you mean 'iaf'\?"),
    ({"layout": "stabel"}, ValueError, r"layout must be one of .*did you mean 'stable'\?"),
    ({"num_flows": 2.5}, TypeError, r"num_flows must be an int >= 0, got 2.5"),
    ({"num_flows": True}, TypeError, r"num_flows must be an int >= 0, got True"),
    ({"hidden": 8.0}, TypeError, r"hidden must be an int >= 1, got 8.0"),
    ({"init_scale": "0.1"}, TypeError, r"init_scale must be a number > 0"),
    ({"init_gain": math.nan}, ValueError, r"init_gain must be a finite number, got nan"),
    ({"prob_clip": 0.001}, TypeError, r"prob_clip must be a pair of numbers"),
    ({"alpha": "0.5"}, TypeError, r"alpha must be a number >= 0"),
    ({"alpha": math.nan}, ValueError, r"alpha must be a finite number >= 0, got nan"),
])
def test_hypernet_options_refused(kwargs, error, pattern):
    model = pb.BNN(_net(), weight_norm=True)
    with pytest.raises(error, match=pattern):
        pb.guides.Hypernet(model, **kwargs)


def test_hypernet_full_false_string_no_longer_means_full():
    # full="False" used to be bool("False") = True: a flow over every weight of a plain BNN
    with pytest.raises(TypeError, match="full must be True or False"):
        pb.guides.Hypernet(pb.BNN(_net()), full="False")
    assert pb.guides.Hypernet(pb.BNN(_net()), full=np.bool_(True), num_flows=1, hidden=4).full is True
