"""``fit(..., checkpoint=path, resume=True)``: continue an interrupted fit exactly.

A checkpoint written by :func:`pyro_bnn.fit` holds, besides model, guide and optimiser states,
the epoch and the history, a ``"resume"`` entry with everything else the remaining epochs
depend on: the learning-rate schedule, every random stream (torch CPU/CUDA, Python, NumPy, a
loader's own generator, so the data order too), the guide's fit state
(:meth:`pyro_bnn.guides.base.BNNGuide.fit_state`, e.g. Laplace's evidence optimiser and best
state), the convergence record, the divergence guard's counters and the fit's settings.
Everything is captured at the end of an epoch, after the guide's hook, exactly where an
uninterrupted fit continues, so on CPU the resumed fit is bit-identical to it.

These functions work on the record of one fit call (``pyro_bnn.training._Run``).
"""

from __future__ import annotations

import copy
import os

from .checkpoint import (
    load_states,
    loader_rng_state,
    read_checkpoint,
    rng_state,
    set_loader_rng_state,
    set_rng_state,
)

__all__ = ["CHECKPOINT_FORMAT", "checkpoint_entries", "resume_fit", "check_same_settings", "StateOf"]

#: ``checkpoint["format"]`` of the files ``fit`` writes
CHECKPOINT_FORMAT = "pyro_bnn.fit/2"


def checkpoint_entries(run, epoch: int) -> dict:
    """The checkpoint entries besides model, guide and optimiser, captured at the end of
    ``epoch`` (the schedule's state is added when the guard confirms the state)."""
    resume = {"scheduler": None, "rng": rng_state(), "loader_rng": loader_rng_state(run.loader),
              "guide_fit_state": copy.deepcopy(run.contract.fit_state()),
              "convergence": copy.deepcopy(run.monitor.state_dict()), "best_loss": run.guard.best_loss,
              "steps_taken": run.guard.steps_taken, "settings": run.settings}
    return {"epoch": epoch, "history": {k: list(v) for k, v in run.history.items()},
            "format": CHECKPOINT_FORMAT, "resume": resume}


class StateOf:
    """A saved ``state_dict`` in the shape :func:`save_checkpoint` takes (an object with one)."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


class _FitStateTarget:
    """The guide's fit state as a ``state_dict`` target for :func:`load_states`."""

    def __init__(self, contract):
        self.contract = contract

    def state_dict(self):
        return self.contract.fit_state()

    def load_state_dict(self, state):
        self.contract.load_fit_state(state)


def resume_fit(run) -> int:
    """Load the checkpoint into the prepared fit; return its epoch (0 if there is no file)."""
    if not os.path.exists(run.checkpoint):
        return 0
    state = read_checkpoint(run.checkpoint, map_location=run.device)
    extra = state.get("resume")
    if extra is None:
        raise ValueError(f"checkpoint {run.checkpoint!r} holds no resume information (it was written by "
                         "save_checkpoint or an older pyro_bnn); it can be loaded with load_checkpoint, "
                         "but fit cannot continue it exactly")
    check_same_settings(extra["settings"], run.settings, run.checkpoint)
    if int(state["epoch"]) > run.settings["epochs"]:
        raise ValueError(f"checkpoint {run.checkpoint!r} is at epoch {state['epoch']}, beyond this fit's "
                         f"epochs={run.settings['epochs']}")
    load_states([("model", run.model, state["model"]), ("guide", run.guide, state["guide"]),
                 ("optimizer", run.optimizer, state["optimizer"]),
                 ("learning-rate schedule", run.scheduler, extra["scheduler"]),
                 ("guide fit state", _FitStateTarget(run.contract), extra["guide_fit_state"]),
                 ("convergence record", run.monitor, extra["convergence"])])
    run.guard.best_loss, run.guard.steps_taken = extra["best_loss"], extra["steps_taken"]
    run.history.clear()
    run.history.update(state["history"])
    set_loader_rng_state(run.loader, extra["loader_rng"])
    set_rng_state(extra["rng"])
    return int(state["epoch"])


def check_same_settings(saved: dict, now: dict, path: str) -> None:
    """Raise ``ValueError`` naming every setting of the resumed fit that differs from the
    interrupted one's (``epochs`` may differ under a constant schedule: training longer)."""
    changed = [k for k in saved if k != "epochs" and saved[k] != now.get(k)]
    if saved["epochs"] != now["epochs"] and now["lr_schedule"] != "constant":
        changed.insert(0, "epochs")
    if changed:
        diffs = ", ".join(f"{k}={saved[k]!r} there, {now.get(k)!r} now" for k in changed)
        raise ValueError(f"checkpoint {path!r} was written by a fit with other settings ({diffs}); resume "
                         "needs the same settings (epochs may grow only under a constant lr_schedule), or "
                         "start a new fit without resume=True")
