"""Invariance learning (LILA): learnable augmentation distributions ``p(T | η)`` whose extents
are chosen by the Laplace marginal likelihood (Immer, van der Ouderaa et al. 2022).

* :mod:`~pyro_bnn.invariance.augmentation` — ``AffineAugmentation`` (six 2D generators) and
  ``Affine1dAugmentation`` (sequences); ``pb.BNN(net, lik, augmentation=aug)`` averages the
  network over ``S`` transformed copies.
* :mod:`~pyro_bnn.invariance.kfac` — augmentation-averaged KFAC factors.
* :mod:`~pyro_bnn.invariance.evidence` — Laplace-KFAC evidence and its batched η-gradient.
* :mod:`~pyro_bnn.invariance.learning` — ``learn_invariance(model, data, method=...)``:
  LILA, Augerino and no-invariance in one loop.
* :mod:`~pyro_bnn.invariance.datasets` — rotated/translated/scaled digits and MNIST.
"""

from .augmentation import (
                           GENERATORS,
                           GENERATORS_1D,
                           Affine1dAugmentation,
                           AffineAugmentation,
                           affine_generators,
                           affine_matrices,
                           apply_affine,
                           infer_image_shape,
)
from .datasets import transform_images, transformed_digits, transformed_mnist
from .evidence import batch_surrogate, eigen_factors, log_evidence
from .kfac import LayerFactors, invariant_kfac_factors
from .learning import METHODS, InvarianceResult, evidence_step, learn_invariance, map_predict

__all__ = ["AffineAugmentation", "Affine1dAugmentation", "GENERATORS", "GENERATORS_1D",
           "affine_generators", "affine_matrices", "apply_affine", "infer_image_shape",
           "learn_invariance", "evidence_step", "map_predict", "InvarianceResult", "METHODS",
           "invariant_kfac_factors", "LayerFactors", "batch_surrogate", "eigen_factors",
           "log_evidence", "transform_images", "transformed_digits", "transformed_mnist"]
