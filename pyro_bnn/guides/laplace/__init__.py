"""The Laplace guide (:class:`Laplace`) and its parts.

* :mod:`.guide` — the guide: MAP by SVI, GGN curvature (KFAC / diag / full, all layers or
  the last layer), the evidence, the GLM predictive;
* :mod:`.objective` — the MAP objective with the guide's own prior precision δ (a Pyro ELBO);
* :mod:`.prior` — δ structures (scalar, per layer, per site) and their optimisation by the
  evidence or a validation grid search;
* :mod:`.online` — the online-evidence schedule inside :func:`pyro_bnn.fit` (``marglik=``);
* :mod:`.posterior` — the posterior's draws and its Pyro distribution;
* :mod:`.sites` — which sites it covers and their priors;
* :mod:`.state` — the fitted curvature state.
"""

from .guide import Laplace, StaleCurvatureWarning
from .objective import LaplaceMAPObjective
from .posterior import LinearizedSamples
from .prior import PriorMismatchWarning

__all__ = ["Laplace", "LaplaceMAPObjective", "LinearizedSamples", "PriorMismatchWarning", "StaleCurvatureWarning"]
