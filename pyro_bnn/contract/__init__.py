"""The guide contract and Pyro interop: :class:`BNNGuide` (what every guide offers, with
defaults), the objectives, Pyro's parameter store and module-local parameters.

May import: :mod:`pyro_bnn.model`, :mod:`pyro_bnn.arguments`; no guide implementation.
"""

from .guide import (
    GUIDE_REGISTRY,
    BNNGuide,
    GuideStateWarning,
    guide_contract,
    init_to_network,
    register_guide,
    registered_guides,
)
from .objective import GuideObjective
from .pyro_objective import PyroObjective, call_model

__all__ = ["BNNGuide", "GuideStateWarning", "guide_contract", "init_to_network", "register_guide", "registered_guides",
           "GUIDE_REGISTRY", "GuideObjective", "PyroObjective", "call_model"]
