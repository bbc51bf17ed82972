"""pyro_bnn: Bayesian neural networks in Pyro — swap guides, compare, analyse in ArviZ."""

from . import (
    _moved,
    analysis,
    datasets,
    guides,
    invariance,
    likelihoods,
    metrics,
    priors,
    reporting,
)
from .analysis import active, adversarial, corruption, ood, pruning
from .arviz import to_arviz
from .convergence import ConvergenceWarning
from .guides import symmetry
from .guides.symmetrized import symmetrized_elbo
from .length_check import LengthCheck, check_convergence
from .model import BNN
from .prediction import evaluate, predict, predictive_samples
from .reporting import compare
from .training import FitResult, fit, load_checkpoint, save_checkpoint

_moved.install()

__version__ = "0.1.0"

__all__ = ["BNN", "fit", "FitResult", "ConvergenceWarning", "check_convergence", "LengthCheck", "predict", "predictive_samples", "evaluate",
           "save_checkpoint", "load_checkpoint", "priors", "guides", "likelihoods",
           "metrics", "datasets"] + ["symmetry", "symmetrized_elbo"] + ["to_arviz", "compare"] + [
    "analysis", "reporting", "pruning", "ood", "adversarial", "active", "corruption"] + ["invariance"]
