"""``fit(compile=True)``: the objective's forward pass under ``torch.compile``, with a clean
fallback to eager execution.

The compiled loss computes the same objective; the backward pass and the optimiser step are
unchanged.  Compilation is lazy (the first minibatch, and again when a shape changes, such as
the last partial batch).  If ``torch.compile`` is unavailable, or a compiled call fails while
the same call succeeds eagerly, the fit continues eagerly from that step and says so once with
:class:`CompileFallbackWarning`: before the eager retry the random-number states are put back,
so a fit that falls back at its first step is bit-identical to ``compile=False``.  An error
that the eager call raises too (a shape mismatch in the user's model, a parameter out of its
support) is raised as the eager call raises it.

Measured on the 2-core CPU (``docs/results/speed.md``): the compiled forward is *slower* than
eager for the library's guides (graph breaks at Pyro's tracing and at the guides' scalar
reads; the step is dominated by small kernels that Inductor's CPU code does not beat), so the
default is ``False``.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["CompileFallbackWarning", "CompiledLoss"]


class CompileFallbackWarning(UserWarning):
    """``fit(compile=True)`` could not compile (or run compiled) the objective and trains eagerly."""


class CompiledLoss:
    """``loss_module(x, y)`` through ``torch.compile``, eager on failure.

    Parameters
    ----------
    module : torch.nn.Module
        The loss module, ``forward(x, y) -> loss`` (or ``(loss, extras)``).
    devices : list of int
        CUDA device indices whose random-number states the module's draws use (the CPU's is
        always saved and restored).

    Attributes
    ----------
    compiled : bool
        Whether calls currently run compiled (``False`` from the first fallback on).
    fallback_reason : str or None
        Why the fit fell back to eager execution.
    """

    def __init__(self, module: torch.nn.Module, devices=()):
        self.module = module
        self.devices = list(devices)
        self.fallback_reason = None
        try:
            self._compiled = torch.compile(module, options={"fallback_random": True})
        except Exception as exc:  # noqa: BLE001 -- torch.compile unsupported here: any reason
            self._fall_back(f"torch.compile is unavailable here ({type(exc).__name__}: {exc})")

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, x, y):
        if self._compiled is None:
            return self.module(x, y)
        states = self._rng_states()
        try:
            return self._compiled(x, y)
        except Exception as exc:  # noqa: BLE001 -- judged by the eager retry below
            self._set_rng_states(states)
            out = self.module(x, y)  # an error the eager call raises too is the user's: it propagates
            self._fall_back(f"the compiled objective failed ({type(exc).__name__}: {_first_line(exc)})")
            return out

    def _fall_back(self, reason: str) -> None:
        self._compiled = None
        self.fallback_reason = reason
        warnings.warn(f"fit(compile=True): {reason}; training continues eagerly (the same objective)",
                      CompileFallbackWarning, stacklevel=4)

    def _rng_states(self):
        return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices]

    def _set_rng_states(self, states) -> None:
        cpu, cuda = states
        torch.set_rng_state(cpu)
        for d, s in zip(self.devices, cuda):
            torch.cuda.set_rng_state(s, d)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"
