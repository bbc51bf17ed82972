"""The divergence guard of :func:`pyro_bnn.fit`: no non-finite state is kept, written or returned.

Three checks, from cheap to thorough:

* every step, the loss and the gradient norms (one fused reduction over the gradients, or
  the norm ``clip_grad_norm_`` computes anyway), read together with the loss value the loop
  reads anyway, *before* the optimiser step, so a non-finite gradient never reaches the
  parameters.  With ``deferred=True`` (CUDA with a fused Adam: :func:`can_defer_checks`) the
  same test runs on the device and reaches the optimiser as its ``found_inf`` flag, which
  makes the fused step skip the update there, so no step waits for the device; the flags
  are read once, at the epoch's end (and the first step of each epoch, whose loss confirms
  the previous epoch's state, is still read at once);
* every epoch end, after the guide's ``on_epoch_end`` hook (which may change parameters, as
  Laplace's evidence steps do), every floating tensor of the model and the guide (and of the
  optimiser state, unless it is Adam's, finite whenever the checked gradients are), before
  the state is remembered as good or written to a checkpoint;
* Pyro's own validation error for a distribution parameter with invalid values (a guide
  driven out of its support, e.g. ``AutoNormal`` at a huge learning rate) after training
  has started.

On any of them the guard restores the state last verified finite (model, guide, optimiser,
learning-rate schedule) and raises ``FloatingPointError`` naming the epoch and step and the
epoch restored.  A loss that explodes while staying finite gets a ``RuntimeWarning``.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch

from . import distributed as _dist

__all__ = ["DivergenceGuard", "EXPLOSION_FACTOR", "can_defer_checks", "is_invalid_parameter_error"]

_ADAM_LIKE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)

#: a finite epoch loss more than this many times the magnitude of the best one (at least 1)
#: above it warns.  10: a Symmetrized fit of the Fashion-MNIST CNN that diverged to chance
#: accuracy rose 90-fold over its best epoch (98k to 8.9M in epoch 5) and was never warned of
#: under the earlier 10⁶ (tests/test_training_reliability.py holds that curve).
EXPLOSION_FACTOR = 10.0

_ADVICE = ("Try a smaller lr, clip_norm=..., a smaller init_scale or standardised inputs.")


def can_defer_checks(optimizer, device: torch.device, distributed=None) -> bool:
    """Whether the step checks can stay on the device: a CUDA fit, one process, and an
    optimiser whose every group steps in torch's fused kernel, which skips its update on the
    device when its ``found_inf`` flag is set (the flag ``torch.amp.GradScaler`` uses)."""
    return (device.type == "cuda" and distributed is None
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups))


def is_invalid_parameter_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's distribution-argument validation error (``found invalid
    values``), which Pyro raises when a guide's parameters have left their support."""
    return isinstance(exc, ValueError) and "found invalid values" in str(exc)


class DivergenceGuard:
    """Checks a fit's loss, gradients and state; restores the last state verified finite.

    Parameters
    ----------
    model, guide : torch.nn.Module or callable
        What is trained (non-modules hold no state and are skipped).
    optimizer : torch.optim.Optimizer
    scheduler : torch.optim.lr_scheduler.LRScheduler
    params : list of Tensor
        The parameters the optimiser updates (their gradients are checked).
    clip_norm : float, optional
        Clip the total gradient norm to this value (the norm is then the clipping's own).
    checkpoint : path, optional
        Named in messages: the checkpoint holds the epoch restored.
    deferred : bool
        Check the steps on the device and read the result once per epoch (:meth:`check`,
        :meth:`end_epoch`); needs an optimiser for which :func:`can_defer_checks` holds.
    """

    def __init__(self, model, guide, optimizer, scheduler, params, clip_norm=None, checkpoint=None,
                 deferred: bool = False):
        self.modules = {name: m for name, m in (("model", model), ("guide", guide))
                        if isinstance(m, torch.nn.Module)}
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grads_of = [p for p in params]
        # one fused norm kernel over all gradients when they share a device and dtype
        self._fused_norms = hasattr(torch, "_foreach_norm") and len({(p.device, p.dtype) for p in params}) == 1
        # a gradient entry above √(largest float) overflows when squared (Adam's second moment)
        self._max_norm = min((torch.finfo(p.dtype).max for p in params if p.is_floating_point()),
                             default=math.inf) ** 0.5
        self.clip_norm = clip_norm
        self.checkpoint = checkpoint
        self.good_epoch = 0
        self._good = None
        self._pending = None
        self.steps_taken = 0
        self.best_loss = math.inf
        self._warned_explosion = False
        self.deferred = deferred
        self._total = 0.0        # this epoch's loss sum (Python float: the steps read at once)
        self._flags = None       # the deferred steps' flags and loss sum, on the device
        self._active = False     # whether this epoch's deferred checks have started

    # ------------------------------------------------------------ state
    def _snapshot(self) -> tuple:
        modules = {name: {k: v.detach().clone() for k, v in m.state_dict().items()}
                   for name, m in self.modules.items()}
        return modules, copy.deepcopy(self.optimizer.state_dict()), copy.deepcopy(self.scheduler.state_dict())

    def start(self, epoch: int = 0) -> None:
        """Keep the starting state (checked by :meth:`check_initial`) as the fallback."""
        self._good, self.good_epoch, self._pending = self._snapshot(), epoch, None

    def remember(self, epoch: int, copy_state: bool = True) -> None:
        """Keep a copy of the state at the end of ``epoch`` (after :meth:`check_state`) as the
        candidate: it becomes the state verified finite when the loss and gradients evaluated
        at it are finite too (:meth:`confirm`).  Finite parameters alone do not make a usable
        state: ``σ = exp(ρ)`` overflows for a finite ``ρ`` of 89 in float32.

        ``copy_state=False`` (the last epoch of a fit without checkpoint, which nothing can
        restore to later) records only the epoch: no copy is made."""
        self._pending = (self._snapshot() if copy_state else None, epoch)

    @property
    def pending(self) -> bool:
        """Whether a candidate state waits for its loss evaluation."""
        return self._pending is not None

    def confirm(self) -> tuple[dict, dict, dict]:
        """The candidate passed its loss evaluation: it is now the state verified finite.
        Returns its ``(module states, optimiser state, schedule state)`` (for the checkpoint)."""
        good, epoch = self._pending
        self._pending = None
        if good is not None:
            self._good, self.good_epoch = good, epoch
        return good

    def restore(self) -> None:
        """Put the state last verified finite back (model, guide, optimiser, schedule)."""
        self._pending, self._active = None, False
        self.clear_device_flags()
        if self._good is None:
            return
        modules, opt_state, sched_state = self._good
        for name, state in modules.items():
            self.modules[name].load_state_dict(state)
        self.optimizer.load_state_dict(copy.deepcopy(opt_state))
        self.scheduler.load_state_dict(copy.deepcopy(sched_state))

    def fail(self, what: str, epoch: int, step: int | None = None, cause: BaseException | None = None):
        """Restore the last good state and raise ``FloatingPointError`` describing ``what``."""
        self.restore()
        where = f"epoch {epoch} (step {step})" if step is not None else f"epoch {epoch}"
        restored = ("the start of the fit" if self.good_epoch == 0 and self._good is not None
                    else f"the end of epoch {self.good_epoch}")
        note = (f"; the checkpoint {str(self.checkpoint)!r} holds that state"
                if self.checkpoint is not None and self.good_epoch > 0 else "")
        raise FloatingPointError(
            f"{what} in {where}; model, guide and optimiser were restored to {restored}, the last "
            f"state verified finite{note}. {_ADVICE}") from cause

    # ------------------------------------------------------------ checks
    def gradient_norms(self) -> torch.Tensor:
        """After ``backward``: per-tensor gradient norms, shape ``(k,)`` (one fused kernel), or
        the total norm that clipping computes anyway (with ``clip_norm``), shape ``(1,)``."""
        if self.clip_norm is not None:
            return torch.nn.utils.clip_grad_norm_(self.grads_of, self.clip_norm).reshape(1)
        grads = [p.grad for p in self.grads_of if p.grad is not None]
        if not grads:
            return torch.zeros(0)
        if self._fused_norms:
            return torch.stack(torch._foreach_norm(grads))
        return _total_norm(grads).reshape(1)

    def check_step(self, loss: torch.Tensor, epoch: int, step: int, distributed=None) -> float:
        """Check one step's loss and gradients before the optimiser step; return the loss.

        The loss and the gradient norms are read in one device synchronisation.  Under
        ``distributed`` the loss is the mean over ranks (the gradients are already
        all-reduced, so every rank decides alike).
        """
        norms = self.gradient_norms()
        loss = loss.detach()
        if distributed is not None:
            loss = _dist.all_reduce_mean_(loss.clone())
        if norms.dtype != loss.dtype or norms.device != loss.device:
            norms = norms.to(device=loss.device, dtype=loss.dtype)
        value, *norm_values = torch.cat((loss.reshape(1), norms)).tolist()
        self._judge_step(value, norm_values, epoch, step)
        return value

    def _judge_step(self, value: float, norm_values: list[float], epoch: int, step: int) -> None:
        """Fail (restore and raise) if a step's loss or gradient norms are non-finite, or a norm's
        square would overflow (without clipping)."""
        if not math.isfinite(value):
            self.fail(f"the loss became {value}", epoch, step)
        if not all(math.isfinite(v) for v in norm_values):
            norm = math.sqrt(sum(v * v for v in norm_values))
            self.fail(f"the gradient norm became {norm} while the loss was finite ({value:.6g})", epoch, step)
        if self.clip_norm is None and max(norm_values, default=0.0) > self._max_norm:
            self.fail(f"a gradient norm became {max(norm_values):.4g}, so large that its square overflows "
                      f"(> {self._max_norm:.3g}), while the loss was finite ({value:.6g})", epoch, step)

    # ------------------------------------------------------------ one epoch's steps
    def begin_epoch(self) -> None:
        self._total, self._active = 0.0, False

    def check(self, loss: torch.Tensor, epoch: int, step: int, distributed=None) -> None:
        """Check one step before the optimiser step and add its loss to the epoch's sum: at
        once (:meth:`check_step`), or on the device when the guard is ``deferred`` and no
        state waits for its confirmation (the first step of an epoch is read at once)."""
        if not self.deferred or self.pending or distributed is not None:
            self._total += self.check_step(loss, epoch, step, distributed)
            return
        self.activate_device_flags(step, loss.device)
        self.record_on_device(loss)

    def activate_device_flags(self, step: int, device: torch.device) -> None:
        """Start this epoch's deferred checks at ``step`` (no-op once started): the flags are
        reset in place, so the tensors stay the same for the whole fit (a captured CUDA graph
        (:mod:`pyro_bnn.training.cuda_graph`) writes them by address)."""
        if self._active:
            return
        flags = self._flags
        if flags is None or flags["found"].device != device:
            names = ("found", "count", "step", "loss", "norm", "sum")
            flags = self._flags = {name: torch.zeros((), dtype=torch.float64, device=device) for name in names}
            flags["found"] = flags["found"].float()
        for name in ("found", "step", "loss", "norm"):
            flags[name].zero_()
        flags["sum"].fill_(self._total)      # Python numbers: filled without a copy to the device
        flags["count"].fill_(step - 1)
        self._active = True

    def record_on_device(self, loss: torch.Tensor) -> None:
        """A deferred step's check, in place on the flags of :meth:`activate_device_flags`
        (no synchronisation, no Python number that changes from step to step): the step count,
        the first failing step's loss and largest gradient norm, the failure flag, the loss sum.
        The flag reaches the fused optimiser step as its ``found_inf``."""
        flags = self._flags
        loss = loss.detach().reshape(())
        norms = self.gradient_norms().to(device=loss.device, dtype=loss.dtype)
        if norms.numel() == 0:
            norms = loss.new_zeros(1)
        norm = norms.max()     # NaN propagates; a non-finite norm is non-finite here too
        bad = ~torch.isfinite(loss) | ~torch.isfinite(norm)
        if self.clip_norm is None:
            bad = bad | (norm > self._max_norm)
        flags["count"].add_(1)
        first = bad & (flags["found"] == 0)   # the first failing step's figures, for the message
        for key, value in (("step", flags["count"]), ("loss", loss), ("norm", norm)):   # written in place
            torch.where(first, value.to(torch.float64), flags[key], out=flags[key])
        torch.maximum(flags["found"], bad.to(flags["found"].dtype), out=flags["found"])
        flags["sum"].add_(loss.to(torch.float64))
        # the fused step skips its update on the device while the flag is set (GradScaler's protocol)
        self.optimizer.grad_scale, self.optimizer.found_inf = None, flags["found"]

    def end_epoch(self, epoch: int) -> float:
        """Read the deferred steps' flags (one synchronisation) and return the epoch's loss
        sum; a failed step restores the last good state and raises, as :meth:`check_step` does."""
        active, self._active = self._active, False
        self.clear_device_flags()
        if not active:
            return self._total
        flags = self._flags
        found, step, value, total, norm = torch.stack(
            [flags[k].to(torch.float64) for k in ("found", "step", "loss", "sum", "norm")]).tolist()
        if found:
            self._judge_step(value, [norm], epoch, int(step))
        return total

    def clear_device_flags(self) -> None:
        """Take the ``found_inf`` flag off the optimiser (it must not outlive the fit)."""
        for name in ("found_inf", "grad_scale"):
            if name in vars(self.optimizer):
                delattr(self.optimizer, name)

    def check_final(self, loss: torch.Tensor, epoch: int, distributed=None) -> None:
        """The loss evaluated at the state after the last epoch (which no further step
        evaluates): it must be finite for that state to count as verified."""
        loss = loss.detach().reshape(())
        if distributed is not None:
            loss = _dist.all_reduce_mean_(loss.clone())
        value = loss.item()
        if not math.isfinite(value):
            self.fail(f"the loss at the state reached by the last step became {value}", epoch)

    def after_step(self) -> None:
        self.steps_taken += 1

    def _non_finite(self) -> list[str]:
        """Names of the non-finite floating tensors of model, guide and optimiser state.

        One sum per tensor and one synchronisation: a finite sum implies finite entries; only
        if a sum is not finite (a non-finite entry, or an overflow) is each tensor checked."""
        named = [(f"{name} {key}", t) for name, module in self.modules.items()
                 for key, t in module.state_dict().items()]
        if not isinstance(self.optimizer, _ADAM_LIKE):
            # Adam's moments are averages of the gradients and their squares, finite whenever the
            # checked gradient norms are finite and below √(largest float) (check_step)
            named += [(f"optimiser state {key} of parameter {i}", t)
                      for i, state in enumerate(self.optimizer.state.values()) for key, t in state.items()]
        named = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if not named:
            return []
        device = named[0][1].device
        sums = torch.stack([t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).to(device)
                            for _, t in named])
        if bool(torch.isfinite(sums).all()):
            return []
        return [n for n, t in named if not bool(torch.isfinite(t).all())]

    def check_initial(self, epoch: int = 0) -> None:
        """Before the first step: the starting state must be finite (it is what a failure
        restores).  Raises ``ValueError`` naming the non-finite entries."""
        bad = self._non_finite()
        if bad:
            shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            when = "before training" if epoch == 0 else f"in the state resumed from epoch {epoch}"
            raise ValueError(f"non-finite values {when}: {shown}; expected finite initial parameters "
                             "(check init_scale, the network's weights and the prior)")

    def check_state(self, epoch: int) -> None:
        """At an epoch's end: every floating tensor of model, guide and optimiser is finite."""
        bad = self._non_finite()
        if bad:
            shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            self.fail(f"non-finite values appeared in {shown} (found at the end of the epoch, "
                      "after the guide's epoch hook)", epoch)

    def invalid_parameter(self, exc: ValueError, epoch: int, step: int):
        """Pyro rejected a distribution parameter: restore and raise if training had moved
        the parameters (at the very first step it is a model error, re-raised as it is)."""
        if self.steps_taken == 0:
            raise exc
        self.fail(f"a distribution parameter left its support ({_first_line(exc)})", epoch, step, exc)

    def watch_loss(self, epoch: int, mean_loss: float) -> None:
        """Warn once if the epoch loss exploded (finite, but far above its best value)."""
        if mean_loss - self.best_loss > EXPLOSION_FACTOR * max(abs(self.best_loss), 1.0) \
                and not self._warned_explosion:
            self._warned_explosion = True
            warnings.warn(
                f"the training loss exploded in epoch {epoch}: {mean_loss:.4g}, against a best epoch "
                f"loss of {self.best_loss:.4g}; the fit is diverging without (yet) producing NaN. "
                f"{_ADVICE}", RuntimeWarning, stacklevel=5)
        self.best_loss = min(self.best_loss, mean_loss)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """‖(g_1, …, g_k)‖₂ with fused per-tensor norms (``torch.nn.utils.get_total_norm``, torch ≥ 2.6)."""
    total = getattr(torch.nn.utils, "get_total_norm", None)
    if total is not None:
        return total(grads)
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads]))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
