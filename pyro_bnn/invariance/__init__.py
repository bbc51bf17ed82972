"""Invariance learning (LILA): learnable augmentation distributions ``p(T | η)`` whose extents
are chosen by the Laplace marginal likelihood (Immer, van der Ouderaa et al. 2022).

* :mod:`~pyro_bnn.invariance.augmentation` — ``AffineAugmentation`` (six 2D generators) and
  ``Affine1dAugmentation`` (sequences); ``pb.BNN(net, lik, augmentation=aug)`` averages the
  network over ``S`` transformed copies.
* :mod:`~pyro_bnn.invariance.datasets` — rotated/translated/scaled digits and MNIST.
"""

from .augmentation import (GENERATORS, GENERATORS_1D, Affine1dAugmentation, AffineAugmentation,
                           affine_generators, affine_matrices, apply_affine, infer_image_shape)

__all__ = ["AffineAugmentation", "Affine1dAugmentation", "GENERATORS", "GENERATORS_1D",
           "affine_generators", "affine_matrices", "apply_affine", "infer_image_shape"]
