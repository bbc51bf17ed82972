"""pyro_bnn: Bayesian neural networks in Pyro — swap guides, compare, analyse in ArviZ."""

from . import (
    analysis,
    datasets,
    guides,
    invariance,
    likelihoods,
    metrics,
    priors,
    reporting,
)
from .arviz import to_arviz
from .convergence import ConvergenceWarning
from .length_check import LengthCheck, check_convergence
from .model import BNN
from .prediction import evaluate, predict, predictive_samples
from .reporting import compare
from .training import FitResult, fit, load_checkpoint, save_checkpoint

__version__ = "0.1.0"

__all__ = ["BNN", "fit", "FitResult", "ConvergenceWarning", "check_convergence", "LengthCheck", "predict",
           "predictive_samples", "evaluate", "save_checkpoint", "load_checkpoint", "priors", "guides",
           "likelihoods", "metrics", "datasets", "to_arviz", "compare", "analysis", "reporting", "invariance"]
