"""The model layer: the network (:class:`BNN`, the :class:`BayesianNetwork` protocol), priors,
likelihoods and weight-normalised layers.

May import: :mod:`pyro_bnn.arguments` (nothing else of the package).
"""

from . import likelihoods, priors, weight_norm
from .bnn import (
    BAYESIAN_LAYERS,
    BNN,
    BayesianNetwork,
    default_stochastic,
    fan_in_of,
    is_bnn,
    normal_prior_params,
    site_module,
)

__all__ = ["BNN", "BayesianNetwork", "is_bnn", "normal_prior_params", "site_module", "BAYESIAN_LAYERS", "default_stochastic",
           "fan_in_of", "likelihoods", "priors", "weight_norm"]
