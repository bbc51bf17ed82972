"""pyro_bnn: Bayesian neural networks in Pyro — swap guides, compare, analyse in ArviZ.

The package is layered, lowest first (``docs/DEVELOPING.md``; ``tests/test_layering.py``
checks it): ``model`` → ``contract`` → ``data`` → ``curvature`` → ``training`` →
``invariance`` → ``posterior`` → ``guides`` → ``analysis`` → ``reporting``; a module imports
only from its own layer and those below.
"""

from . import analysis, guides, invariance, reporting
from ._version import __version__
from .curvature.marglik import MarglikOptions
from .data import datasets
from .model import (
    BNN,
    BatchNormTrainModeWarning,
    UnscaledBatchWarning,
    UnscaledPixelsWarning,
    likelihoods,
    priors,
)
from .posterior import evaluate, metrics, predict, predictive_samples, to_arviz
from .reporting import compare
from .training import (
    CompileFallbackWarning,
    ConvergenceWarning,
    CudaGraphFallbackWarning,
    FitResult,
    LengthCheck,
    check_convergence,
    fit,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["__version__", "BNN", "fit", "FitResult", "ConvergenceWarning", "CompileFallbackWarning",
           "CudaGraphFallbackWarning", "BatchNormTrainModeWarning", "UnscaledBatchWarning", "UnscaledPixelsWarning",
           "check_convergence", "LengthCheck",
           "MarglikOptions", "predict",
           "predictive_samples", "evaluate", "save_checkpoint", "load_checkpoint", "priors", "guides",
           "likelihoods", "metrics", "datasets", "to_arviz", "compare", "analysis", "reporting", "invariance"]
