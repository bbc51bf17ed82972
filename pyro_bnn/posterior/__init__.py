"""The posterior of any guide, read through the contract: prediction (:func:`predict`,
:func:`evaluate`), metrics, ArviZ export, joint draws and a draw's guide density.

May import: :mod:`pyro_bnn.model`, :mod:`pyro_bnn.contract`, :mod:`pyro_bnn.data`,
:mod:`pyro_bnn.curvature`, :mod:`pyro_bnn.training` (devices, seeding), :mod:`pyro_bnn.arguments`;
no guide implementation.
"""

from . import metrics
from .arviz import to_arviz
from .prediction import PredictiveSamples, evaluate, predict, predictive_samples, sample_latents

__all__ = ["predict", "evaluate", "predictive_samples", "PredictiveSamples", "sample_latents", "to_arviz",
           "metrics"]
