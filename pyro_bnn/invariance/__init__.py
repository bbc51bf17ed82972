"""Invariance learning (LILA): learnable augmentation distributions ``p(T | η)`` whose extents
are chosen by the Laplace marginal likelihood (Immer, van der Ouderaa et al. 2022).

* :mod:`~pyro_bnn.invariance.augmentation` — ``AffineAugmentation`` (six 2D generators) and
  ``Affine1dAugmentation`` (sequences); ``pb.BNN(net, lik, augmentation=aug)`` averages the
  network over ``S`` transformed copies.
* :mod:`~pyro_bnn.invariance.evidence` — Laplace-KFAC evidence of the invariant model
  and its batched η-gradient, on :mod:`pyro_bnn.curvature` (KFAC with
  ``num_augmentations``) and :func:`pyro_bnn.curvature.marglik.log_evidence` (a total over the data).
* :mod:`~pyro_bnn.invariance.step` — ``evidence_step``: one δ/η hyperparameter step.
* :mod:`~pyro_bnn.invariance.guide_step` — η learning inside ``pb.fit(..., marglik=)``
  with a Laplace guide, reusing the guide's curvature.
* :mod:`~pyro_bnn.invariance.learning` — ``learn_invariance(model, data, method=...)``:
  LILA, Augerino and no-invariance in one loop.
* :mod:`~pyro_bnn.invariance.datasets` — rotated/translated/scaled digits, MNIST and
  Fashion-MNIST.

May import: :mod:`pyro_bnn.model`, :mod:`pyro_bnn.contract`, :mod:`pyro_bnn.data`,
:mod:`pyro_bnn.curvature`, :mod:`pyro_bnn.training`, :mod:`pyro_bnn.arguments`.
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
from .datasets import transform_images, transformed_digits, transformed_fashion_mnist, transformed_mnist
from .evidence import eta_surrogate, invariant_curvature
from .learning import METHODS, InvarianceResult, learn_invariance, map_predict
from .step import evidence_step

__all__ = ["AffineAugmentation", "Affine1dAugmentation", "GENERATORS", "GENERATORS_1D",
           "affine_generators", "affine_matrices", "apply_affine", "infer_image_shape",
           "learn_invariance", "evidence_step", "map_predict", "InvarianceResult", "METHODS",
           "transform_images", "transformed_digits", "transformed_mnist", "transformed_fashion_mnist",
           "invariant_curvature", "eta_surrogate"]
