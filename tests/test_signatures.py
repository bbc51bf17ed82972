"""One signature style (issue 25): the data positionally, every option keyword-only, one
name per concept.  Walks the public functions of ``pb``, ``pb.metrics``, ``pyro_bnn.posterior``
and ``pb.analysis`` so a new tool cannot drift."""

import inspect
import warnings

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis import active, adversarial, corruption, ood, pruning, uncertainty_plots
from pyro_bnn.posterior import draws

#: The positional (data) parameters each public function keeps; everything after is keyword-only.
DATA = {
    pb.predict: ("model", "guide", "x"),
    pb.evaluate: ("model", "guide", "x", "y"),
    pb.predictive_samples: ("model", "guide", "x"),
    pb.to_arviz: ("model", "guide", "x", "y"),
    pb.fit: ("model", "guide", "data"),
    pb.check_convergence: ("make", "data"),
    draws.draw_latents: ("model", "guide", "x"),
    draws.probs_from_latents: ("model", "latents", "x"),
    draws.site_moments: ("model", "guide", "x"),
    pb.metrics.calibration_bins: ("mean_probs", "y"),
    pb.metrics.expected_calibration_error: ("mean_probs", "y"),
    pb.metrics.classification_metrics: ("probs", "y"),
    pb.metrics.interval_coverage: ("loc", "scale", "y"),
    active.run: ("model_fn", "guide_fn", "pool", "test"),
    active.acquisition_scores: ("probs",),
    active.balanced_initial: ("y",),
    adversarial.fgsm: ("model", "guide", "x", "y"),
    adversarial.fgsm_from_latents: ("model", "latents", "x", "y"),
    adversarial.fgsm_curve: ("model", "guide", "x", "y"),
    corruption.rotate: ("x", "angle"),                 # a transform: called as transform(x, level)
    corruption.gaussian_noise: ("x", "std"),
    corruption.corruption_curve: ("model", "guide", "x", "y"),
    corruption.rotation_curve: ("model", "guide", "x", "y"),
    corruption.noise_curve: ("model", "guide", "x", "y"),
    ood.evaluate: ("model", "guide", "in_x", "out_x"),
    pruning.score_from_moments: ("mean", "std"),
    pruning.scores: ("guide",),
    pruning.prune_: ("model", "guide"),
    pruning.posterior_mean: ("model", "guide", "x"),
    pruning.export_pruned: ("model", "guide", "x"),
    pruning.pruning_curve: ("model", "guide", "x", "y"),
    uncertainty_plots.plot_pruning_curves: ("curves",),
    uncertainty_plots.plot_fgsm_curve: ("curves",),
    uncertainty_plots.plot_active_curves: ("results",),
    uncertainty_plots.plot_corruption_curves: ("curves",),
    uncertainty_plots.plot_ood_scores: ("results",),
    pb.guides.Laplace.predict: ("self", "model", "x"),
    pb.guides.Laplace.optimize_prior_precision: ("self", "data"),
    pb.guides.Laplace.functional_covariance: ("self", "x"),
    pb.guides.Laplace.linearized_samples: ("self", "x"),
    pb.contract.BNNGuide.predict: ("self", "model", "x"),
}

#: Old names of a concept that has one name now (``method`` only for an algorithm).
RETIRED = {"draws", "n_samples", "num_draws", "eval_samples", "batch", "predict_method", "method"}
#: Where ``method`` still names an algorithm, not a predictive.
ALGORITHMS = {"optimize_prior_precision", "learn_invariance"}


def _positional(fn):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)


@pytest.mark.parametrize("fn", list(DATA), ids=lambda f: f.__qualname__)
def test_options_are_keyword_only(fn):
    assert _positional(fn) == DATA[fn]


def _public_functions():
    modules = [pb, pb.metrics, draws, active, adversarial, corruption, ood, pruning, uncertainty_plots,
               pb.posterior.prediction, pb.posterior.arviz, pb.invariance.learning]
    seen = {}
    for module in modules:
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                seen[f"{obj.__module__}.{obj.__qualname__}"] = obj
    for cls in (pb.guides.Laplace, pb.contract.BNNGuide):
        for name, obj in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                seen[f"{cls.__name__}.{name}"] = obj
    return seen


def test_one_name_per_concept():
    functions = _public_functions()
    assert len(functions) > 60       # the walk reaches the library (not an empty list that passes)
    drift = {}
    for qualname, fn in functions.items():
        names = set(inspect.signature(fn).parameters) & RETIRED
        if fn.__name__ in ALGORITHMS:
            names.discard("method")
        if names:
            drift[qualname] = sorted(names)
    assert drift == {}


def test_the_drift_check_can_fail():
    def tool(model, guide, x, *, method="sample", eval_samples=4):
        pass
    assert set(inspect.signature(tool).parameters) & RETIRED == {"method", "eval_samples"}


def _trained(guide_cls):
    torch.manual_seed(0)
    x, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
    model = pb.BNN(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "categorical")
    guide = guide_cls(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=2, batch_size=32, progress=False, seed=0)
    return model, guide, x, y


@pytest.mark.parametrize("guide_cls", [pb.guides.MeanField, pb.guides.Laplace], ids=["meanfield", "laplace"])
def test_old_keywords_are_type_errors_not_ignored(guide_cls):
    """``method=`` (now ``predictive=``) must fail, never be dropped: for the Laplace guide's
    GLM predictive a dropped ``method="glm_probit"`` would silently give Monte Carlo instead."""
    model, guide, x, y = _trained(guide_cls)
    for call in (lambda **kw: pb.predict(model, guide, x, num_samples=2, **kw),
                 lambda **kw: pb.evaluate(model, guide, x, y, num_samples=2, **kw),
                 lambda **kw: ood.evaluate(model, guide, x[:8], x[8:], num_samples=2, **kw)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'method'"):
            call(method="glm_probit")
    with pytest.raises(TypeError, match="positional"):
        pb.predict(model, guide, x, 2)
    with pytest.raises(TypeError, match="eval_samples"):
        adversarial.fgsm_curve(model, guide, x, y, eval_samples=2)
