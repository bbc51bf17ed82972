"""``fit(..., checkpoint=path, resume=True)``: continue an interrupted fit exactly.

A checkpoint written by :func:`pyro_bnn.fit` holds, besides model, guide and optimiser states,
the epoch and the history, a ``"resume"`` entry with everything else the remaining epochs
depend on: the learning-rate schedule, every random stream (torch CPU/CUDA, Python, NumPy, a
loader's own generator, so the data order too), the guide's fit state
(:meth:`pyro_bnn.contract.guide.BNNGuide.fit_state`, e.g. Laplace's evidence optimiser and best
state), the convergence record, the divergence guard's counters, the fit's settings and a fingerprint of what was fitted
(:func:`fit_fingerprint`: prior, architecture, guide options, likelihood, data), which a resume
must match.
Everything is captured at the end of an epoch, after the guide's hook, exactly where an
uninterrupted fit continues, so on CPU the resumed fit is bit-identical to it.

These functions work on the record of one fit call (``pyro_bnn.training.loop._Run``).
"""

from __future__ import annotations

import copy
import hashlib
import os

import torch

from ..contract.guide import guide_contract
from ..data.batches import dataset_size
from ..model.bnn import site_prior_modules
from .checkpoint import (
    CHECKSUM_KEY,
    load_states,
    loader_rng_state,
    read_checkpoint,
    rng_state,
    set_loader_rng_state,
    set_rng_state,
)

__all__ = ["CHECKPOINT_FORMAT", "checkpoint_entries", "resume_fit", "check_same_settings", "StateOf",
           "fit_fingerprint", "check_same_fingerprint", "check_fit_checkpoint"]

#: ``checkpoint["format"]`` of the files ``fit`` writes (3: with digest and fingerprint)
CHECKPOINT_FORMAT = "pyro_bnn.fit/3"

#: the entries of ``checkpoint["resume"]`` that resume_fit reads
_RESUME_KEYS = ("scheduler", "rng", "loader_rng", "guide_fit_state", "convergence", "best_loss",
                "steps_taken", "settings", "fingerprint")


def checkpoint_entries(run, epoch: int) -> dict:
    """The checkpoint entries besides model, guide and optimiser, captured at the end of
    ``epoch`` (the schedule's state is added when the guard confirms the state)."""
    resume = {"scheduler": None, "rng": rng_state(), "loader_rng": loader_rng_state(run.loader),
              "guide_fit_state": copy.deepcopy(run.contract.fit_state()),
              "convergence": copy.deepcopy(run.monitor.state_dict()), "best_loss": run.guard.best_loss,
              "steps_taken": run.guard.steps_taken, "settings": run.settings,
              "fingerprint": run.fingerprint}
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
    state = read_checkpoint(run.checkpoint, map_location=run.device)  # verifies the digest
    check_fit_checkpoint(state, run.checkpoint)
    extra = state["resume"]
    check_same_fingerprint(extra["fingerprint"], run.fingerprint, run.checkpoint)
    check_same_settings(extra["settings"], run.settings, run.checkpoint)
    if state["epoch"] > run.settings["epochs"]:
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
    return state["epoch"]


def check_fit_checkpoint(state: dict, path: str) -> None:
    """Raise ``ValueError`` unless ``state`` has every entry a resume reads, of the right kind
    (a crafted or damaged file gets this message, not a ``KeyError`` part-way)."""
    extra = state.get("resume")
    if extra is None:
        raise ValueError(f"checkpoint {path!r} holds no resume information (it was written by "
                         "save_checkpoint or an older pyro_bnn); it can be loaded with load_checkpoint, "
                         "but fit cannot continue it exactly")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path!r} has format {state.get('format')!r}, this pyro_bnn resumes "
                         f"{CHECKPOINT_FORMAT!r} (which records the prior, architecture, guide and data "
                         "it was written for, and a digest); load it with load_checkpoint, or start afresh")
    problems = [f"missing {key!r}" for key in ("optimizer", "epoch", "history", CHECKSUM_KEY)
                if key not in state]
    if not isinstance(extra, dict):
        problems.append(f"'resume' is a {type(extra).__name__}, expected a dict")
    else:
        problems += [f"missing 'resume'[{key!r}]" for key in _RESUME_KEYS if key not in extra]
    epoch = state.get("epoch", 0)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        problems.append(f"'epoch' must be an int >= 0, got {epoch!r}")
    history = state.get("history", {})
    if not (isinstance(history, dict) and all(isinstance(v, list) for v in history.values())):
        problems.append("'history' must be a dict of lists")
    elif isinstance(epoch, int) and len(history.get("loss", [])) != epoch:
        problems.append(f"'history' has {len(history.get('loss', []))} epochs of loss, 'epoch' is {epoch}")
    if isinstance(extra, dict):
        settings, fingerprint = extra.get("settings", {}), extra.get("fingerprint", {})
        if not isinstance(settings, dict) or not {"epochs", "lr_schedule"} <= set(settings):
            problems.append("'resume'['settings'] must be a dict with the fit's settings")
        if not isinstance(fingerprint, dict):
            problems.append("'resume'['fingerprint'] must be a dict")
    if problems:
        raise ValueError(f"checkpoint {path!r} is not a complete pyro_bnn fit checkpoint: "
                         f"{'; '.join(problems)}; it cannot be resumed")


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


# ----------------------------------------------------------------- fingerprint
#: guide attributes that change during a fit (state, not configuration)
_GUIDE_STATE_ATTRIBUTES = frozenset({"training", "kl_weight"})
#: data tensors are hashed from at most this many evenly spaced elements each
_HASHED_ELEMENTS = 1 << 16


def fit_fingerprint(model, guide, data) -> dict:
    """What a fit is fitting, as plain strings: the record a resume must match.

    Keys: ``"prior"`` (per site of a :class:`pyro_bnn.BNN`: the prior's class and exact
    hyperparameters), ``"architecture"`` (the module tree of everything but the priors: layers,
    activation modules, likelihood), ``"parameters"`` (names and shapes), ``"guide"`` (class
    and the scalar options it holds: ``init_scale``, ``scale_parameterization``, flow
    settings, Laplace structure, ... or what its ``fit_fingerprint()`` method returns) and
    ``"data"`` (size, shapes, dtypes and a SHA-256 of up to 65,536 evenly spaced elements of
    each tensor; for a ``Dataset`` or ``DataLoader`` only its type and size).  Activations
    called as functions inside ``forward`` are not visible to it.
    """
    return {"prior": _prior_record(model), "architecture": _architecture(model),
            "parameters": _parameter_shapes(model), "guide": _guide_record(guide),
            "data": _data_record(data)}


def _exact(value: torch.Tensor) -> str:
    value = value.detach().cpu()
    if value.numel() <= 8:
        items = [str(v) for v in value.reshape(-1).numpy()] if value.dtype != torch.bfloat16 else \
            [repr(float(v)) for v in value.reshape(-1)]
        return items[0] if value.dim() == 0 else f"[{', '.join(items)}]"
    return f"tensor{tuple(value.shape)} sha256 {_tensor_hash(value)[:16]}"


def _prior_record(model) -> dict:
    record = {}
    for site, prior in site_prior_modules(model).items():
        values = [f"{n}={_exact(v)}" for n, v in list(prior.named_buffers()) + list(prior.named_parameters())]
        record[site] = f"{type(prior).__name__}({', '.join(values)})"
    return record


def _architecture(model) -> str:
    if not isinstance(model, torch.nn.Module):
        return type(model).__qualname__
    parts = [f"{type(model).__qualname__}({model.extra_repr()})"]
    parts += [f"({name}): {child!r}" for name, child in model.named_children() if name != "priors"]
    return "\n".join(parts)


def _parameter_shapes(model) -> list:
    if not isinstance(model, torch.nn.Module):
        return []
    return [f"{name} {tuple(v.shape)}" for name, v in model.state_dict().items()
            if not name.startswith("priors.")]


def _guide_record(guide) -> dict:
    record = {"class": f"{type(guide).__module__}.{type(guide).__qualname__}"}
    own = guide_contract(guide).fit_fingerprint()
    if own is not None:
        record.update({str(k): repr(v) for k, v in own.items()})
        return record
    for name, value in sorted(vars(guide).items()):
        if name in _GUIDE_STATE_ATTRIBUTES or name.startswith(("_pyro", "__")) or value is None:
            continue
        if _is_scalar(value) or (isinstance(value, (list, tuple)) and value and all(map(_is_scalar, value))):
            record[name.lstrip("_")] = repr(value)
    return record


def _is_scalar(value) -> bool:
    return isinstance(value, (bool, int, float, str))


def _tensor_hash(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1)
    if flat.numel() > _HASHED_ELEMENTS:
        # integer arithmetic: a float32 linspace rounds the last index past the end for tensors
        # of more than ~16M elements (47,040,000 for Fashion-MNIST's training images)
        steps = torch.arange(_HASHED_ELEMENTS, device=flat.device, dtype=torch.int64)
        index = steps * (flat.numel() - 1) // (_HASHED_ELEMENTS - 1)
        flat = flat[index]
    flat = flat.cpu().contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()


def _data_record(data) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    if isinstance(data, TensorDataset):
        tensors = data.tensors
    elif isinstance(data, torch.Tensor):
        tensors = (data,)
    elif isinstance(data, (tuple, list)) and all(isinstance(t, torch.Tensor) or t is None for t in data):
        tensors = tuple(t for t in data if t is not None)
    else:
        dataset = data.dataset if isinstance(data, DataLoader) else data
        try:  # the examples an epoch covers (a sampler over part of the data: its own)
            size = dataset_size(data) if isinstance(data, DataLoader) else len(dataset)
        except TypeError:
            size = None
        return {"kind": type(dataset).__qualname__, "size": repr(size)}
    record = {"kind": "tensors", "size": repr(len(tensors[0]) if tensors and tensors[0].dim() else None)}
    for i, t in enumerate(tensors):
        record[f"tensor {i}"] = f"{t.dtype} {tuple(t.shape)} sha256 {_tensor_hash(t)[:16]}"
    return record


def check_same_fingerprint(saved: dict, now: dict, path: str) -> None:
    """Raise ``ValueError`` naming every way this fit differs from the one that wrote the
    checkpoint (prior per site, architecture, parameters, guide options, data)."""
    diffs = []
    for key in ("prior", "architecture", "parameters", "guide", "data"):
        there, here = saved.get(key), now.get(key)
        if there == here:
            continue
        if isinstance(there, dict) and isinstance(here, dict):
            shared = [k for k in there if k in here and there[k] != here[k]]
            if key == "guide" and there.get("class") == here.get("class"):
                diffs += [f"guide option {k} {there[k]} there, {here[k]} now" for k in shared]
                continue
            if key == "prior" and set(there) == set(here):
                diffs += [f"prior {there[k]} on {k} there, {here[k]} now" for k in shared]
                continue
            changed = shared + [k for k in there.keys() ^ here.keys()]
            diffs += [f"{key} {k}: {there.get(k, '<absent>')} there, {here.get(k, '<absent>')} now"
                      for k in changed]
        elif isinstance(there, list) and isinstance(here, list):
            gone = [p for p in there if p not in here][:3]
            new = [p for p in here if p not in there][:3]
            diffs.append(f"parameters {gone} there, {new} now")
        else:
            diffs.append(f"{key}: {_first_difference(str(there), str(here))}")
    if diffs:
        raise ValueError(f"checkpoint {path!r} was written for another fit: " + "; ".join(diffs)
                         + ". resume=True continues the same fit only; start a new fit (another "
                         "checkpoint path, or overwrite=True) for this one")


def _first_difference(there: str, here: str) -> str:
    """The first differing line of two multi-line records, as 'A there, B now'."""
    a, b = there.splitlines(), here.splitlines()
    for i in range(max(len(a), len(b))):
        x = a[i].strip() if i < len(a) else "<end>"
        y = b[i].strip() if i < len(b) else "<end>"
        if x != y:
            return f"{x} there, {y} now"
    return f"{there[:200]} there, {here[:200]} now"
