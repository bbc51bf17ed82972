"""The model layer: the network (:class:`BNN`, the :class:`BayesianNetwork` protocol), priors,
likelihoods, weight-normalised layers, where a model lives (:func:`module_device`), the check
for unscaled 0-255 pixel inputs (:mod:`.input_scale`), and the readers of a model's optional
members (:func:`model_likelihood`, :func:`network_of`, ...).

May import: :mod:`pyro_bnn.arguments` (nothing else of the package).
"""

from . import batchnorm, devices, input_scale, likelihoods, modes, priors, weight_norm
from .batch_scaling import UnscaledBatchWarning
from .batchnorm import BatchNormTrainModeWarning
from .bnn import (
    BAYESIAN_LAYERS,
    BNN,
    BayesianNetwork,
    augmentation_of,
    default_stochastic,
    fan_in_of,
    initial_values_of,
    is_bnn,
    model_likelihood,
    network_function_of,
    network_of,
    normal_prior_params,
    num_augmentations,
    site_module,
    site_prior_modules,
    weight_norm_of,
)
from .devices import module_device
from .input_scale import UnscaledPixelsWarning

__all__ = ["BNN", "BayesianNetwork", "is_bnn", "site_module", "BAYESIAN_LAYERS", "default_stochastic",
           "fan_in_of", "augmentation_of", "initial_values_of", "model_likelihood", "network_function_of",
           "network_of", "normal_prior_params", "num_augmentations", "site_prior_modules",
           "weight_norm_of", "module_device", "BatchNormTrainModeWarning", "UnscaledBatchWarning", "UnscaledPixelsWarning", "batchnorm", "devices", "input_scale", "likelihoods", "modes", "priors", "weight_norm"]
