"""Training: :func:`fit` (:mod:`.loop`) and what it relies on — the divergence guard, the
convergence diagnosis (:mod:`.convergence`) and its length check (:mod:`.convergence_check`),
the compiled step (:mod:`.compiled`), the CUDA graph step (:mod:`.cuda_graph`), checkpoints and resume, denormal flushing, seeding, learning-rate schedules, and data
parallelism (:mod:`.distributed`).

May import: :mod:`pyro_bnn.model`, :mod:`pyro_bnn.contract`, :mod:`pyro_bnn.data`,
:mod:`pyro_bnn.curvature` (the ``marglik=`` options), :mod:`pyro_bnn.arguments`.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .compiled import CompileFallbackWarning
from .convergence import ConvergenceWarning
from .convergence_check import LengthCheck, check_convergence
from .cuda_graph import CudaGraphFallbackWarning
from .guide_setup import setup_guide
from .loop import FitContext, FitResult, fit

__all__ = ["fit", "FitResult", "FitContext", "save_checkpoint", "load_checkpoint", "setup_guide",
           "ConvergenceWarning", "CompileFallbackWarning", "CudaGraphFallbackWarning", "LengthCheck",
           "check_convergence"]
