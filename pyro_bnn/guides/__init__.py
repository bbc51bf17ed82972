"""Guides (variational families and the Laplace approximation) — swap them on one model.

See :mod:`pyro_bnn.contract.guide` for the small contract a new guide implements.
"""

from ..contract.guide import (
           GUIDE_REGISTRY,
           BNNGuide,
           guide_contract,
           init_to_network,
           register_guide,
           registered_guides,
)
from .hypernet import Hypernet
from .hypernet_objective import HypernetELBO
from .laplace import Laplace
from .meanfield import MeanField, MeanFieldELBO
from .symmetrized import Symmetrized, SymmetrizedELBO

__all__ = ["BNNGuide", "guide_contract", "Laplace", "Hypernet", "HypernetELBO", "MeanField", "MeanFieldELBO", "Symmetrized", "SymmetrizedELBO", "init_to_network", "register_guide",
           "registered_guides", "GUIDE_REGISTRY"]
