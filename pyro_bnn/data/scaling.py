"""Inputs that look like unscaled 8-bit pixels, where they enter the library.

Image data sets store pixels as bytes 0-255; ``x.float()`` keeps that range, and training
fails without an error (on Fashion-MNIST test accuracy 0.139 on ``x · 255`` against 0.745 on
``x`` in [0, 1]; the figures are in :mod:`pyro_bnn.model.input_scale`).  Such inputs are warned
about wherever they enter (``pb.fit``, ``pb.evaluate``, ``pb.predict``, ``pb.to_arviz``, the
Laplace curvature: :class:`pyro_bnn.data.batches.BatchCheck`), and a ``pb.BNN`` warns itself when a
Pyro user's own loop (``SVI``, ``Predictive``) hands it such inputs.  The check and the warning
live in the model layer, :mod:`pyro_bnn.model.input_scale`, so that the model can use them; this
module is their home in the data layer (``from pyro_bnn.data.scaling import ...`` keeps working).
The loaders of :mod:`pyro_bnn.data.datasets` and torchvision's ``ToTensor`` scale by 1/255.
"""

from __future__ import annotations

from ..model.input_scale import (
    ROWS_LOOKED_AT,
    UnscaledPixelsWarning,
    looks_like_unscaled_pixels,
    warn_unscaled_pixels,
)

__all__ = ["UnscaledPixelsWarning", "warn_unscaled_pixels", "looks_like_unscaled_pixels", "ROWS_LOOKED_AT"]
