"""Curvature of the log-likelihood for Laplace approximations: GGN as KFAC, diagonal or full.

* :mod:`~.structures` — matrix types (``KronBlock``, ``DiagBlock``, ``DenseBlock``) with
  ``logdet``, sampling, covariance and functional variance for ``P = s·H + diag(δ)``;
  :mod:`~.unitwise` — ``UnitBlock``, per-channel blocks of BatchNorm's affine parameters;
* :mod:`~.layers` — Linear/Conv2d layers (and BatchNorm's affine parameters) as parameter
  groups, hooks capturing Jacobian factors;
* :mod:`~.kfac`, :mod:`~.ggn` — per-batch KFAC factors, diagonal and full GGN;
* :mod:`~.fit` — accumulation over a loader (with an optional ``reduce_fn`` all-reduce);
* :mod:`~.glm` — streamed linearised predictive (``Σ_f``, ``J Δθ``, log predictive densities);
  :mod:`~.masks` — its covariance for a pruned network (0/1 weight masks on the Jacobians);
* :mod:`~.network` — how a model is run with given weights, likelihood Hessian factors;
* :mod:`~.marglik` — the Laplace-GGN log evidence and its hyperparameter optimisation.

May import: :mod:`pyro_bnn.model`, :mod:`pyro_bnn.data`, :mod:`pyro_bnn.arguments`.
"""

from .fit import STRUCTURES, CurvatureFit, accumulate_curvature
from .ggn import diag_ggn_sums, full_ggn_sum, per_example_gradients
from .glm import (
    JacobianFactors,
    batch_covariance,
    functional_covariance,
    glm_log_predictive,
    glm_predictive,
    jacobian_factors,
    linearized_offsets,
    pointwise_log_likelihood,
    probit_probs,
    sample_observations,
)
from .kfac import batch_kfac_factors, kfac_blocks, kfac_sums_from_factors
from .layers import Layer, capture_factors, find_layers
from .masks import layer_masks
from .network import hessian_columns, identity_columns, likelihood_kind, network_output
from .structures import DenseBlock, DiagBlock, KronBlock, SplitBiasKronBlock
from .unitwise import UnitBlock

__all__ = ["STRUCTURES", "CurvatureFit", "accumulate_curvature", "diag_ggn_sums", "full_ggn_sum",
           "per_example_gradients", "functional_covariance", "glm_predictive", "probit_probs",
           "JacobianFactors", "jacobian_factors", "batch_covariance", "linearized_offsets",
           "glm_log_predictive", "pointwise_log_likelihood", "sample_observations",
           "batch_kfac_factors", "kfac_blocks", "kfac_sums_from_factors", "Layer",
           "capture_factors", "find_layers", "layer_masks", "hessian_columns", "identity_columns",
           "likelihood_kind", "network_output", "DenseBlock", "DiagBlock", "KronBlock",
           "SplitBiasKronBlock", "UnitBlock"]
