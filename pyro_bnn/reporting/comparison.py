"""``compare``: train several guides on one architecture and data split, tabulate the results.

Every guide is trained from the same initial network (the same seed), evaluated on the same
test set and converted to an ArviZ ``DataTree`` on the training data, where PSIS-LOO is
meaningful.  The table has one row per guide:

* predictive metrics on the test set, from each guide's own predictive (``predictive``
  column: Monte Carlo model average of ``num_samples`` draws, or the Laplace guide's
  linearised GLM): ``accuracy, nll, ece, brier`` (classification) or ``rmse, nll,
  coverage_95`` (regression);
* ``converged``: the convergence diagnosis of the row's :func:`pyro_bnn.fit`
  (``FitResult.convergence``, :mod:`pyro_bnn.training.convergence`): ``"yes"``, or ``"no: "`` and the
  short reasons (``still improving``, ``got worse``, ``σ limited by the lr``, ``constant lr,
  not confirmed flat``, ``cannot judge (E epochs)``); a failed guide reads ``"no: failed"``.
  The diagnosis is a necessary condition only: a cosine fit that is too short can pass
  (``docs/training.md``), so check a figure against a run twice as long;
* ``configuration``: the guide's settings (its ``extra_repr()``, e.g. the Laplace guide's
  structure, subset and how δ was chosen, or for Gaussian guides the initial scale and
  estimator) and the training settings (epochs, Adam learning rate and schedule, batch size,
  gradient clipping, weight-norm model);
* ``elbo``: Monte Carlo ``mean_s [log p(θ_s, D) − log q(θ_s)]`` over the training data
  (a point-mass guide, ``AutoDelta``, has ``log q = 0``: its value is the log joint; a
  Laplace row with the GLM predictive gives the linearised model's, with the guide's δ in
  the prior and ``log q = 0`` for point-estimate sites such as a last-layer Laplace's body,
  so it is not comparable with other rows);
* ``bound``, ``bound_se`` and ``bound_kind``: the bound the guide maximises, on the training
  data (:func:`training_bound`), and its Monte Carlo standard error: ``elbo`` (MeanField,
  Hypernet, ...), ``symmetrized_elbo`` (Symmetrized: its ``L^G``, not its base ``q``'s ELBO) or
  ``log_evidence`` (Laplace; no standard error); compare rows of the same ``bound_kind`` only;
* ``log_evidence``: the guide's own estimate where it has one (Laplace), else NaN;
* ``elpd_loo`` (``az.loo_approximate_posterior``, the importance-sampling correction for
  draws from an approximate posterior) with its standard error and the share of Pareto
  ``k̂`` above ArviZ's threshold, and ``elpd_loo_psis`` (``az.loo``, which treats the draws as
  exact posterior draws) with its standard error (``elpd_loo_psis_se``) and its share of
  ``k̂`` above the threshold (``pareto_k_bad_psis``); both NaN when the draws are identical
  (point estimates).  Where a ``pareto_k_bad`` column is not small its estimate is not reliable
  (ArviZ warns on one such observation; the report says so,
  :func:`~pyro_bnn.reporting.loo_columns.loo_reliability_note`).  The draws are those of the row's predictive
  (:func:`pyro_bnn.to_arviz` with the same ``predictive``), so a Laplace row's ELPD is that of
  its GLM predictive.  Above
  ``loo_observations`` training points (default 10,000) both are estimated from a random
  sample of that many observations, the same for every guide, by the difference estimator
  (every observation's log predictive density, corrected by the sample's Pareto-smoothed
  leave-one-out values; ``loo_observations`` column; the sampling error is in ``elpd_loo_se``;
  :mod:`pyro_bnn.reporting.loo_columns`);
* ``train_seconds``, ``predict_seconds`` (the test-set predictive), ``num_params``
  (the guide's trained parameters; buffers such as curvature factors are not counted).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..contract.guide import guide_contract
from ..data.batches import check_data
from ..data.datasets import DataSplit
from ..model.bnn import random_directions_of, weight_norm_of
from ..posterior import metrics
from ..posterior.arviz import default_predictive, to_arviz
from ..posterior.prediction import (
    PredictiveSamples,
    bernoulli_as_classes,
    binary_labels,
    predict,
    predictive_likelihood,
    predictive_name,
    predictive_samples,
    targets_like,
)
from ..training.loop import FitResult, fit
from ..training.seeding import seeded
from .compare_arguments import as_split, check_device, check_options, per_guide, resolve_guides
from .loo_columns import DEFAULT_LOO_OBSERVATIONS, loo_columns, loo_sample
from .worker_bars import WorkerBars
from .workers import check_workers, run_jobs

__all__ = ["compare", "Comparison", "ComparisonInterrupted", "GuideRun", "class_probabilities", "count_variational_parameters",
           "convergence_label", "describe_configuration", "training_bound", "BOUND_KINDS"]


@dataclass
class GuideRun:
    """Everything :func:`compare` produced for one guide.

    ``probs`` are the test-set predictive samples (``(S, N, C)`` probabilities, Bernoulli's as
    two classes ``(S, N·D, 2)``, or ``(S, N, D)`` means for regression); ``error`` holds the
    traceback if the guide failed.
    """

    name: str
    model: Any = None
    guide: Any = None
    fit: FitResult | None = None
    metrics: dict = field(default_factory=dict)
    probs: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    datatree: Any = None
    error: str | None = None
    predict_method: str = "sample"

    def predictive(self, x: torch.Tensor, num_samples: int = 100) -> PredictiveSamples:
        """Predictive of this run's model and guide at ``x``, with the run's method."""
        if self.predict_method == "sample":
            return predictive_samples(self.model, self.guide, x, num_samples=num_samples)
        return _method_predictive(self.model, self.guide, x, num_samples, self.predict_method)


@dataclass
class Comparison:
    """Result of :func:`compare` with ``details=True``: the table and each guide's run."""

    table: pd.DataFrame
    runs: dict[str, GuideRun]
    data: DataSplit | None = None

    @property
    def datatrees(self) -> dict[str, Any]:
        """``{guide: DataTree}`` for the guides that ran (input for ``az.compare``)."""
        return {k: r.datatree for k, r in self.runs.items() if r.datatree is not None}


class ComparisonInterrupted(KeyboardInterrupt):
    """Ctrl-C (``KeyboardInterrupt``) during :func:`compare`, carrying what had finished.

    Attributes
    ----------
    comparison : Comparison
        The guides that finished before the interrupt (possibly none), with their table.
    interrupted : str or None
        The guide that was running (``None``: the interrupt came between two guides).
    """

    def __init__(self, comparison: Comparison, interrupted: str | None):
        super().__init__("interrupted between guides" if interrupted is None
                         else f"interrupted during guide {interrupted!r}")
        self.comparison = comparison
        self.interrupted = interrupted


def caused_by_interrupt(exc: BaseException | None) -> bool:
    """Whether ``exc`` was raised because of a KeyboardInterrupt (anywhere in its cause chain).

    Ctrl-C that lands inside a C extension's import (matplotlib's backend, say) surfaces as
    ``ImportError("initialization failed")`` caused by the KeyboardInterrupt: still an interrupt.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def count_variational_parameters(guide) -> int:
    """Number of trained values of ``q``: the guide contract's ``num_variational_parameters()``
    (default: the guide's ``nn.Parameter`` count; buffers such as MADE masks or Laplace's
    curvature factors are not counted)."""
    return int(guide_contract(guide).num_variational_parameters())


def _takes_argument(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _log_evidence(guide) -> float:
    """The guide's ``log p(D)`` estimate (the contract's ``log_evidence()``), NaN if it has none."""
    value = guide_contract(guide).log_evidence()
    return math.nan if value is None else float(value)


#: short labels of :class:`~pyro_bnn.training.convergence.ConvergenceDiagnosis` reasons, by their start
def convergence_label(diagnosis) -> str:
    """The ``converged`` column: ``"yes"`` or ``"no: <short reasons>"``.

    Parameters
    ----------
    diagnosis : pyro_bnn.training.convergence.ConvergenceDiagnosis or None
        ``FitResult.convergence``; ``None`` (no diagnosis was made) reads ``"no: not diagnosed"``.

    Returns
    -------
    str
    """
    return "no: not diagnosed" if diagnosis is None else diagnosis.label()


def describe_configuration(model, guide, *, epochs: int, lr: float | None, batch_size: int,
                           fit_options: Mapping | None = None) -> str:
    """The ``configuration`` column: the guide's settings and how it was trained.

    Parameters
    ----------
    model, guide
        The trained model and guide.
    epochs, lr, batch_size
        How the fit ran; ``lr`` is the rate it used (``FitResult.lr``: the guide's
        ``learning_rate(N)`` when ``fit`` was given none; ``None``: shown as "default lr").
    fit_options : dict, optional
        Further ``fit`` options (``lr_schedule``, ``clip_norm``, ...).

    Returns
    -------
    str
        E.g. ``"init_scale=0.01, local reparameterisation on; 300 epochs, Adam lr 0.05 cosine,
        batch 64"``.
    """
    fit_options = dict(fit_options or {})
    schedule = fit_options.get("lr_schedule", "cosine")
    schedule = schedule if isinstance(schedule, str) else "custom schedule"
    optimizer = "custom optimiser" if fit_options.get("optimizer") is not None else "Adam"
    training = (f"{epochs} epoch{'' if epochs == 1 else 's'}, {optimizer} {'default lr' if lr is None else f'lr {lr:g}'} {schedule}, "
                f"batch {batch_size}")
    if fit_options.get("clip_norm") is not None:
        training += f", clip_norm {fit_options['clip_norm']:g}"
    if fit_options.get("num_particles", 1) != 1:
        training += f", {fit_options['num_particles']} particles"
    model_part = ("" if not weight_norm_of(model) else
                  "weight-norm model, random directions" if random_directions_of(model) else "weight-norm model")
    return "; ".join(p for p in (guide_contract(guide).settings_description(), model_part, training) if p)


def class_probabilities(samples: PredictiveSamples) -> torch.Tensor:
    """Class probabilities ``(S, N, C)`` of a classification predictive: a Bernoulli's success
    probabilities ``(S, N, D)`` as two classes ``(S, N·D, 2)`` (read as one class, their
    "entropy" was ``−p log p`` and their confidence ``p`` even below ½)."""
    return bernoulli_as_classes(samples.probs) if samples.kind == "bernoulli" else samples.probs


def _method_predictive(model, guide, x, num_samples, method) -> PredictiveSamples:
    """A guide's own predictive (``pb.predict(predictive=...)``) as :class:`PredictiveSamples`."""
    values = predict(model, guide, x, num_samples=num_samples, predictive=method)
    if values.dim() == 2:
        values = values.unsqueeze(0)
    kind, noise = predictive_likelihood(model, guide)
    if kind == "gaussian":
        return PredictiveSamples("gaussian", loc=values, scale=noise.detach().expand_as(values))
    return PredictiveSamples("bernoulli" if kind == "bernoulli" else "categorical", probs=values)


def _run_one(name, guide_fn, model_fn, split, *, epochs, batch_size, lr, num_samples, loo_samples,
             loo_index, device, seed, progress, guide_kw, fit_kw, predict_method) -> GuideRun:
    run = GuideRun(name)
    model = model_fn(name) if _takes_argument(model_fn) else model_fn()
    if device is not None:
        model.to(device)
    run.model = model
    check_data(model, split.x_test, split.y_test, where="pb.compare's test split")
    run.guide = guide = guide_fn(model, **guide_kw)
    run.fit = fit(model, guide, split.train, epochs=epochs, batch_size=batch_size, lr=lr,
                  device=device, seed=seed, progress=progress, **fit_kw)
    run.predict_method = predict_method = predict_method or default_predictive(guide)
    t0 = time.perf_counter()
    out = run.predictive(split.x_test, num_samples)
    run.metrics["predict_seconds"] = time.perf_counter() - t0
    run.metrics["predictive"] = predictive_name(predict_method, num_samples)   # e.g. "glm-mc(100)"
    run.metrics["converged"] = convergence_label(run.fit.convergence)
    run.metrics["configuration"] = describe_configuration(model, guide, epochs=epochs, lr=run.fit.lr,
                                                          batch_size=batch_size, fit_options=fit_kw)
    y_test = split.y_test.to(out.probs.device if out.probs is not None else out.loc.device)
    if out.kind == "categorical":
        scores = metrics.classification_metrics(out.probs, y_test)
        run.probs = out.probs.cpu()
    elif out.kind == "gaussian":
        scores = metrics.regression_metrics(out.loc, out.scale, targets_like(y_test, out.loc.shape[1:]))
        run.probs, run.scale = out.loc.cpu(), out.scale.cpu()
    else:
        probs = class_probabilities(out)  # the report's reliability and entropy read two classes
        scores = metrics.classification_metrics(probs, binary_labels(y_test))
        run.probs = probs.cpu()
    run.metrics.update(scores)
    run.metrics["train_seconds"] = run.fit.seconds
    run.metrics["num_params"] = count_variational_parameters(guide)
    run.metrics["log_evidence"] = _log_evidence(guide)
    elbo_se = math.nan
    if loo_samples:
        dt = to_arviz(model, guide, split.x_train, split.y_train, num_samples=loo_samples,
                      predictive=predict_method if predict_method in ("sample", "glm") else None)
        stats = dt["sample_stats"]
        per_draw = np.asarray(stats["lp"] - stats["log_q"], dtype=np.float64).ravel()
        run.metrics["elbo"] = float(per_draw.mean())
        if per_draw.size > 1:
            elbo_se = float(per_draw.std(ddof=1) / math.sqrt(per_draw.size))
        run.metrics.update(loo_columns(dt, loo_index))
        dt.attrs["guide_name"] = name
        run.datatree = dt
    run.metrics.update(training_bound(model, guide, split, elbo=run.metrics.get("elbo", math.nan),
                                      elbo_se=elbo_se,
                                      log_evidence=run.metrics["log_evidence"],
                                      num_samples=min(max(loo_samples, 1), 32)))
    return run


#: What the ``bound`` column holds, by the objective the guide maximises.
BOUND_KINDS = ("elbo", "symmetrized_elbo", "log_evidence")


def training_bound(model, guide, split, *, elbo: float, log_evidence: float, elbo_se: float = math.nan,
                   num_samples: int = 32) -> dict:
    """The bound each guide maximises, on the whole training set: ``{"bound", "bound_kind",
    "bound_se"}``, the last the Monte Carlo standard error of ``bound`` (NaN for the log
    evidence, which is not a Monte Carlo estimate).

    * a guide whose contract names its own bound (``training_bound``; :class:`~pyro_bnn.guides.Symmetrized`:
      its symmetrised ELBO ``L^G``, ``num_samples`` draws; the ``elbo`` column keeps the ELBO of its
      base ``q``, which it does not maximise);
    * a guide with a log-evidence estimate (Laplace): that estimate;
    * every other guide: the ELBO (``elbo``, NaN when ``loo_samples=0`` skipped it).

    Parameters
    ----------
    model, guide
        The trained model and guide.
    split : DataSplit
        The data; ``split.train`` is used.
    elbo, log_evidence : float
        The row's ``elbo`` and ``log_evidence`` columns.
    elbo_se : float
        The standard error of ``elbo`` (``sd / √S`` over its draws).
    num_samples : int
        Weight draws for the symmetrised ELBO.

    Returns
    -------
    dict
    """
    own = guide_contract(guide).training_bound(model, split.train, num_samples=num_samples)
    if own is not None:
        if len(own) != 3:
            raise TypeError(f"{type(guide).__name__}.training_bound must return (value, kind, standard_error) "
                            f"or None, got {own!r}")
        value, kind, se = own
        return {"bound": float(value), "bound_kind": kind, "bound_se": float(se)}
    if not math.isnan(log_evidence):
        return {"bound": float(log_evidence), "bound_kind": "log_evidence", "bound_se": math.nan}
    return {"bound": float(elbo), "bound_kind": "elbo", "bound_se": float(elbo_se)}


def compare(model_fn: Callable, guides=None, data=None, *, epochs: int | Mapping[str, int] = 20,
            batch_size: int = 64, lr: float | Mapping[str, float] | None = None, num_samples: int = 100,
            loo_samples: int = 200, loo_observations: int | None = DEFAULT_LOO_OBSERVATIONS,
            device=None, seed: int = 0, progress: bool = True,
            guide_options: Mapping[str, dict] | None = None,
            fit_options: Mapping[str, dict] | None = None,
            predictive: str | Mapping[str, str] | None = None, errors: str = "record",
            details: bool = False, workers: int = 1) -> pd.DataFrame | Comparison:
    """Train each guide on a fresh model from ``model_fn`` and tabulate test metrics, ELBO,
    ELPD-LOO and timings.

    Parameters
    ----------
    model_fn : callable
        ``model_fn()`` or ``model_fn(guide_name)`` -> a new model (e.g. a :class:`~pyro_bnn.BNN`).
        It is called after seeding, so every guide starts from the same network.
    guides : dict, list of str or None
        ``{name: guide_fn or registered name}`` (``guide_fn(model, **options) -> guide``; Pyro
        autoguide classes work), a list of registered names, or ``None`` for every guide
        in :func:`pyro_bnn.guides.registered_guides`.
    data : DataSplit or ((x_train, y_train), (x_test, y_test))
        Training and test data.
    epochs, lr : int/float or dict
        Training length and Adam learning rate, one value or ``{guide: value}`` (missing
        guides: ``20`` epochs; ``lr=None`` or a missing guide: the guide's ``default_lr`` as
        :func:`pyro_bnn.fit` resolves it, with ``fit``'s default cosine decay).  Whether each
        fit converged is in the ``converged`` column: 20 epochs are too few to judge, so pass
        a length that converges for your data (digits 64-100-10: 300, see
        ``docs/results/compare.md``).
    batch_size : int
        Minibatch size of :func:`pyro_bnn.fit`.
    num_samples : int
        Posterior draws for the test-set predictive.
    loo_samples : int
        Draws in each guide's ``DataTree`` (training data) for ELBO and ELPD-LOO; 0 skips it.
    loo_observations : int or None
        The ELPD-LOO columns score at most this many training observations (default 10,000), a
        random sample (seeded by ``seed``, the same for every guide) that corrects every
        observation's log predictive density (the difference estimator), its sampling error in
        ``elpd_loo_se`` (:mod:`pyro_bnn.reporting.loo_columns`); ``None``:
        all of them (on 60,000 images 64–68 s per guide).  The ``DataTree`` keeps every
        observation.
    device : str or torch.device, optional
        Where to train and predict.
    seed : int
        Seed before building each model and training.
    progress : bool
        Progress bars and one status line per guide (on stderr).
    guide_options, fit_options : dict, optional
        ``{guide: {option: value}}`` passed to the guide factory / :func:`pyro_bnn.fit`
        (e.g. ``{"laplace": {"marglik": pb.MarglikOptions(...)}}`` or ``{"hypernet": {"clip_norm": 10}}``).
    predictive : str, dict or None
        ``None`` (default): each guide's own predictive (``guide.default_predictive``:
        ``"glm"`` for the Laplace guides, else ``"sample"``); or ``"sample"`` (Monte Carlo
        over guide draws, every guide) or a guide's named predictive, one value or
        ``{guide: predictive}`` (missing guides: their own).  Recorded in the ``predictive``
        column; the ``DataTree`` holds draws of the same predictive.
    errors : {"record", "raise"}
        On a failing guide, record the error in its row (and warn) or re-raise.
    details : bool
        Return a :class:`Comparison` (table, each guide's model, guide, predictions and
        ``DataTree``) instead of the table alone.
    workers : int
        Guides trained at once, each in a process of its own forked from this one, each with
        one torch thread (:mod:`pyro_bnn.reporting.workers`; CPU only, Linux or macOS).  The
        figures are those of ``workers=1`` (every guide is seeded the same way; exactly so when
        ``workers=1`` also runs one torch thread, as ``pyro-bnn`` does by default — another thread
        count may change the last bits of a sum); with ``progress`` each running worker's fit has
        a bar of its own (drawn by this process, a line each) and a line says when a guide
        starts and ends.  The returned guides carry their trained values; what a
        worker puts in Pyro's global param store (Pyro's autoguides in its default mode) stays in
        the worker, so keep a guide by ``state_dict`` / ``torch.save``, not through the caller's
        param store.  Guides start in the order given, so put the longest first.  Default 1: one guide after
        the other, in this process.

    Returns
    -------
    pandas.DataFrame or Comparison
        One row per guide, indexed by name.

    Raises
    ------
    TypeError, ValueError
        Before any training: an option of the wrong type or range (``epochs=2.5``,
        ``batch_size=True``, ``seed=2**32``, ``device="gpu"``, ``"cuda"`` without a GPU), or a
        ``{guide: value}`` option naming a guide that is not compared (the message names the
        closest one: ``epochs={"meanfeild": 10}`` -> did you mean 'meanfield'?), or ``workers > 1``
        on an accelerator.
    ComparisonInterrupted
        Ctrl-C (a ``KeyboardInterrupt``); its ``comparison`` holds the guides that finished.

    Examples
    --------
    >>> split = pb.datasets.digits()                                           # doctest: +SKIP
    >>> table = pb.compare(lambda: pb.BNN(mlp()), ["meanfield", "laplace"], split)  # doctest: +SKIP
    """
    if errors not in ("record", "raise"):
        raise ValueError(f"errors must be 'record' or 'raise', got {errors!r}")
    if not callable(model_fn):
        raise TypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
    if data is None:
        raise ValueError("data is required: a DataSplit or ((x_train, y_train), (x_test, y_test))")
    split = as_split(data)
    factories = resolve_guides(guides)
    check_options(list(factories), epochs=epochs, lr=lr, batch_size=batch_size, num_samples=num_samples,
                   loo_samples=loo_samples, loo_observations=loo_observations, seed=seed,
                   progress=progress, details=details,
                   guide_options=guide_options, fit_options=fit_options, predictive=predictive)
    if device is not None:
        device = check_device(device)
    workers = check_workers(workers, device)
    loo_index = loo_sample(len(split.x_train), loo_observations, seed)

    epochs_of = {name: per_guide(epochs, name, 20) for name in factories}
    bars = WorkerBars() if progress and workers > 1 else None   # one process: fit draws its own

    def job(name, guide_fn):
        def run(report=None) -> GuideRun:
            shown = progress if report is None else (   # a worker sends its epochs to the caller's bars
                (lambda epoch, epochs, loss: report((epoch, epochs, loss))) if progress else False)
            with seeded(seed):   # every guide from the same seed; the caller's streams untouched
                return _run_one(
                    name, guide_fn, model_fn, split, epochs=epochs_of[name],
                    batch_size=batch_size, lr=per_guide(lr, name, None),
                    num_samples=num_samples,
                    loo_samples=loo_samples, loo_index=loo_index, device=device, seed=seed,
                    progress=shown,
                    guide_kw=dict(per_guide(guide_options, name, {}) or {}),
                    fit_kw=dict(per_guide(fit_options, name, {}) or {}),
                    predict_method=per_guide(predictive, name, None))
        return run

    jobs = [(name, job(name, guide_fn)) for name, guide_fn in factories.items()]
    runs: dict[str, GuideRun] = {}
    running: list[str] = []   # started and not finished
    count = len(jobs)

    def say(line: str) -> None:
        if bars is None:
            _progress_line(line)
        else:
            bars.write(line)

    def start(i: int, name: str, where: str) -> None:
        if progress:   # first: a Ctrl-C during the line is one between two guides
            say(f"[{i}/{count}] {name}{where}")
        running.append(name)
        if bars is not None:
            bars.start(i, name, epochs_of[name])

    def done(i: int, name: str, run: GuideRun | None, exc: BaseException | None, seconds: float) -> None:
        if bars is not None:
            bars.finish(i)
        if exc is not None:
            if caused_by_interrupt(exc):
                raise KeyboardInterrupt from exc
            if errors == "raise":
                raise exc
            warnings.warn(f"guide {name!r} failed: {type(exc).__name__}: {exc}", RuntimeWarning,
                          stacklevel=3)
            run = GuideRun(name, error="".join(traceback.format_exception_only(exc)).strip(),
                           metrics={"converged": "no: failed"})
        runs[name] = run
        running.remove(name)
        if progress:
            state = "failed" if run.error is not None else "done"
            say(f"[{i}/{count}] {name} {state} ({seconds:.1f} s)")

    try:  # a Ctrl-C anywhere, between two guides too, keeps the guides that finished
        if workers == 1:
            for i, (name, run) in enumerate(jobs, 1):
                start(i, name, "")
                t0 = time.perf_counter()
                try:
                    result, exc = run(), None
                except KeyboardInterrupt:
                    raise
                except Exception as caught:
                    result, exc = None, caught
                done(i, name, result, exc, time.perf_counter() - t0)
        else:
            run_jobs(jobs, workers, on_start=lambda i, name: start(i, name, " (worker process)"),
                     on_done=lambda i, out: done(i, out.name, out.value, out.error, out.seconds),
                     on_message=None if bars is None else lambda i, epoch: bars.update(i, *epoch),
                     output=contextlib.nullcontext if bars is None else bars.cleared)
        runs = {name: runs[name] for name in factories}   # the caller's order, not completion order
        table = _table(runs)
    except KeyboardInterrupt as exc:
        runs = {name: runs[name] for name in factories if name in runs}
        raise ComparisonInterrupted(Comparison(_table(runs), runs, split),
                                    ", ".join(running) or None) from exc.__cause__
    finally:
        if bars is not None:
            bars.close()
    return Comparison(table, runs, split) if details else table


def _progress_line(text: str) -> None:
    """Write one line to stderr in a single call, newline included: a Ctrl-C cannot split it, so
    the interrupt's own message starts a line of its own."""
    print(text + "\n", end="", file=sys.stderr, flush=True)


_ORDER = ["converged", "accuracy", "rmse", "nll", "ece", "brier", "coverage_95", "bound", "bound_se", "bound_kind", "elbo", "log_evidence", "elpd_loo",
          "elpd_loo_se", "pareto_k_bad", "elpd_loo_psis", "elpd_loo_psis_se", "pareto_k_bad_psis", "loo_observations", "train_seconds", "predict_seconds", "num_params",
          "predictive", "configuration"]


def _table(runs: Mapping[str, GuideRun]) -> pd.DataFrame:
    rows = {name: {**r.metrics, "error": r.error} for name, r in runs.items()}
    if not rows:
        return pd.DataFrame(index=pd.Index([], name="guide"))
    df = pd.DataFrame.from_dict(rows, orient="index")
    cols = [c for c in _ORDER if c in df.columns] + [c for c in df.columns if c not in _ORDER]
    df = df[cols]
    if df["error"].isna().all():
        df = df.drop(columns="error")
    df.index.name = "guide"
    return df
