"""Comparing guides and reporting on them: :func:`compare` (``pb.compare``), the main job's
report folder (:mod:`.report`) and its command line ``pyro-bnn`` (:mod:`.cli`)."""

from .comparison import Comparison, GuideRun, compare

__all__ = ["Comparison", "GuideRun", "compare"]
