"""``fit``: one stochastic-variational-inference loop for every guide and device.

The loop is plain PyTorch around a Pyro objective: parameters live in the model and
guide modules (Pyro's ``module_local_params`` mode), so their ``state_dict``s round-trip,
any ``torch.optim`` optimiser can be used, and the loss module can be wrapped in DDP.

``fit`` is set-up (:func:`_prepare`, :func:`_prepare_optimisation`, and
:func:`pyro_bnn.training.resume.resume_fit`), one function per epoch (:func:`_train_epoch`) and the
epoch's bookkeeping (:func:`_end_epoch`: history, hooks, the divergence guard's state check;
:func:`_confirm_state`: the checkpoint), then the convergence diagnosis.  ``docs/training.md`` describes the guarantees (divergence guard, exact resume,
safe checkpoints, convergence warning).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pyro
import torch
from pyro import poutine

from ..arguments import reject_unknown_keywords
from ..contract.guide import GuideStateWarning, guide_contract
from ..contract.local_params import global_param_tensors, local_params
from ..contract.param_store import publish_after_fit, sync_param_store
from ..contract.pyro_objective import call_model
from ..curvature.marglik import MarglikOptions
from ..data.batches import dataset_size, make_loader, split_batch, validate_data
from ..model.batch_scaling import end_batch_watches
from ..model.devices import module_device
from ..model.modes import buffers_kept
from . import distributed as _dist
from .checkpoint import CheckpointLock, save_checkpoint
from .compiled import CompiledLoss
from .constant_predictor import constant_predictor_log_likelihood
from .convergence import ConvergenceDiagnosis, ConvergenceMonitor, ConvergenceWarning, watched_hyperparameters
from .cuda_graph import CudaGraphStep, check_cuda_graph_device, check_cuda_graph_fit
from .devices import flush_denormals
from .divergence import DivergenceGuard, is_invalid_parameter_error
from .divergence import can_defer_checks as defer_step_checks
from .fit_arguments import check_fit_arguments, refuse_overwrite, resolve_batching
from .guide_setup import setup_guide
from .local_latents import refuse_local_latents
from .lr_schedule import make_lr_scheduler
from .optimizer import build_optimizer, optimizer_factory, trained_parameters, warn_weight_decay
from .resume import StateOf, checkpoint_entries, fit_fingerprint, resume_fit

__all__ = ["fit", "FitResult", "FitContext", "ConvergenceWarning"]

@dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes
    ----------
    history : dict[str, list[float]]
        Per-epoch ``loss`` (mean minibatch estimate of the full-data negative ELBO),
        ``elbo`` (its negative, unless the objective reports an ``elbo`` extra itself, as
        the symmetrised guide does, MeanField during KL annealing and Hypernet with ``alpha < 1``
        or ``prob_clip``, whose losses are not the negative ELBO), ``epoch_seconds``, and any
        extras the objective reports.
        An extra ``loss_constant`` (the part of the loss that does not depend on the trained
        parameters, as the Laplace MAP objective's prior normaliser) is left out of the
        objective the convergence diagnosis judges.
        A resumed fit's history includes the epochs before the interruption.
    seconds : float
        Wall time of this call.
    convergence : pyro_bnn.training.convergence.ConvergenceDiagnosis
        Whether the fit converged, why not, and the measured quantities
        (:mod:`pyro_bnn.training.convergence`); ``fit`` warns with :class:`ConvergenceWarning` if not.
    resumed_from : int
        The epoch a ``resume=True`` fit continued from (0: it started fresh).
    lr : float or None
        The learning rate of the default optimiser: ``fit``'s ``lr``, else the guide's
        :meth:`~pyro_bnn.contract.BNNGuide.learning_rate` for this data size.
    compiled : bool
        Whether ``compile=True`` ran the fit's last step compiled (``False`` without it, or
        after a fallback to eager execution).
    """

    history: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    convergence: ConvergenceDiagnosis | None = None
    resumed_from: int = 0
    lr: float | None = None
    compiled: bool = False
    #: training steps that ran as a replayed CUDA graph (``cuda_graph=True``; 0 without it)
    graph_steps: int = 0

    @property
    def final_loss(self) -> float:
        return self.history["loss"][-1] if self.history.get("loss") else math.nan


@dataclass
class FitContext:
    """State handed to a guide's ``on_fit_start`` / ``on_epoch_start`` / ``on_epoch_end`` /
    ``on_fit_end`` hooks."""

    model: Any
    guide: Any
    loader: Any
    num_data: int
    device: torch.device
    epochs: int
    epoch: int = 0
    history: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    optimizer: Any = None
    #: :class:`pyro_bnn.training.distributed.DistributedState` under ``fit(distributed=...)``, else None
    distributed: Any = None


class _LossModule(torch.nn.Module):
    """Model + guide + objective as one module: ``forward(x, y) -> loss`` (DDP-wrappable)."""

    def __init__(self, model, guide, objective, num_data):
        super().__init__()
        self.model = model
        self.guide = guide
        self.objective = objective
        self.num_data = num_data

    def forward(self, x, y):
        return self.objective(self.model, self.guide, x, y, num_data=self.num_data)


def _validate_data(model, data, device):
    # tensors are checked here in full; the returned check is for a loader's batches
    # (make_loader(..., check=...)), see pyro_bnn.data.batches.validate_data
    return validate_data(model, data, device)


@dataclass
class _Run:
    """Everything one :func:`fit` call works with."""

    model: Any
    guide: Any
    contract: Any
    ctx: FitContext
    loader: Any
    device: torch.device
    dstate: Any
    objective: Any
    settings: dict
    checkpoint: str | None
    history: dict
    example: tuple  # the first batch (x, y) on the device, for DDP's set-up
    own_objective: bool  # the guide's objective (not a user's): fit may evaluate it outside steps
    params: list = field(default_factory=list)
    optimizer: Any = None
    scheduler: Any = None
    loss_module: Any = None
    guard: DivergenceGuard | None = None
    monitor: ConvergenceMonitor | None = None
    #: the replayed step of ``fit(cuda_graph=True)``, else None
    graph: CudaGraphStep | None = None
    #: the checkpoint entries of the state waiting for its loss evaluation (DivergenceGuard.remember)
    pending_checkpoint: dict | None = None
    #: what is being fitted (pyro_bnn.training.resume.fit_fingerprint), recorded in every checkpoint
    fingerprint: dict = field(default_factory=dict)


def fit(model, guide, data, *, epochs: int = 10, batch_size: int | None = None, lr: float | None = None,
        optimizer=None, lr_schedule="cosine", num_particles: int = 1, device=None,
        progress: bool | Callable[[int, int, float], None] = True,
        shuffle: bool | None = None, seed: int | None = None, clip_norm: float | None = None,
        num_data: int | None = None, objective=None, checkpoint: str | os.PathLike | None = None,
        resume: bool = False, overwrite: bool = False, marglik: MarglikOptions | None = None,
        distributed: bool | _dist.DistributedOptions = False, compile: bool = False,
        cuda_graph: bool = False, **unknown) -> FitResult:
    """Train ``model`` and ``guide`` by stochastic variational inference.

    Module modes are left as they were (a new network is in train mode, so BatchNorm
    running statistics are those of training); ``pb.predict``/``pb.evaluate``/``pb.to_arviz``
    run in eval mode themselves and restore every flag (:mod:`pyro_bnn.posterior.prediction`).

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The Pyro model.
    guide : Pyro guide
        Any guide: ``pb.guides.*`` or Pyro's autoguides.
    data : (x, y) tensors, Dataset or DataLoader
        Training data.  Tensors are moved to ``device`` once and batched by slicing.
    epochs, batch_size : int, int
        Passes over the data (>= 0) and minibatch size (>= 1; default 64, a ``DataLoader``'s own).
    lr : float, optional
        Adam learning rate (> 0; default: the guide's ``learning_rate(N)`` for the ``N``
        training points — MeanField's depends on ``N`` —, else 1e-3).  For the
        default optimiser only: with ``optimizer=`` set the rate in the factory (``lr`` and
        ``optimizer`` together are an error, since fit could not pass ``lr`` on).
    optimizer : callable or pyro.optim.PyroOptim, optional
        ``optimizer(params) -> torch.optim.Optimizer`` (a class such as ``torch.optim.SGD``
        uses its own default rate), or a Pyro optimiser with fixed arguments
        (``pyro.optim.ClippedAdam({"lr": 1e-2})``); default Adam(lr).
    lr_schedule : {"cosine", "constant"} or callable
        Learning-rate factor over the fit, applied per optimiser step: ``"cosine"`` (default)
        decays it as ``½(1 + cos(π t/T))`` from 1 to 0 over the ``T`` steps of the fit, so the
        iterates settle instead of moving at the noise level of a constant rate; a callable
        maps the fraction of steps done, ``t/T`` in [0, 1), to a factor, a finite number >= 0
        (it is called at 64 fractions before training to check that, and every factor it
        returns during training is checked: a negative one would train uphill).  Continuing a fit
        in several calls restarts the schedule each time: use ``resume=True`` instead.
    num_particles : int
        Monte Carlo samples per ELBO estimate (>= 1).
    device : str or torch.device, optional
        Where to train (``"cpu"``, ``"cuda"``); default: where the model is.
    progress : bool or callable
        ``True``: a progress bar (epoch, loss) on stderr; ``False``: none; a callable is called
        as ``progress(epoch, epochs, loss)`` after every epoch instead (``epoch`` counts from 1,
        ``loss`` is the epoch's mean training loss), e.g. to feed a bar or log of your own
        (``pb.compare(workers=2)`` sends it from each worker to the caller's bars).
    shuffle : bool, optional
        Reshuffle tensors / a ``Dataset`` every epoch (default True); a ``DataLoader`` keeps its sampler.
    seed : int, optional
        Seeds Pyro's and torch's global RNGs (``pyro.set_rng_seed``).
    clip_norm : float, optional
        Clip the total gradient norm to this value (> 0).
    num_data : int, optional
        Data set size N for minibatch scaling (>= 1, and at least one minibatch); default the
        number of examples ``data`` draws from (:func:`pyro_bnn.data.batches.dataset_size`: a
        ``DataLoader``'s ``SubsetRandomSampler`` counts its indices; a sampler whose examples
        cannot be known, e.g. a ``WeightedRandomSampler`` of another length, needs ``num_data``).
    objective : callable, optional
        ``objective(model, guide, x, y, num_data) -> loss``; default the guide's own
        (``guide.make_objective``) or Pyro's ``Trace_ELBO``.
    checkpoint : path, optional
        After each epoch whose state is verified finite, write model, guide, optimiser,
        schedule, history, random-number states, the guide's fit state and a fingerprint of the
        fit there (atomically through a unique temporary file, with a SHA-256 digest; loads
        with ``torch.load(weights_only=True)``).  The fit holds a lock on the path
        (``<path>.lock``) from start to end: a second fit on the same path raises
        :class:`pyro_bnn.training.checkpoint.CheckpointInUseError` before it starts.  An existing file
        at the path is refused unless ``resume=True`` or ``overwrite=True``.
    resume : bool
        Continue the fit whose ``checkpoint`` is at that path (start fresh if there is no
        file yet): on CPU the result is bit-identical to a fit that was never interrupted.
        The call must repeat the interrupted one's settings (``epochs`` may grow under a
        constant schedule) and fit the same model (prior, architecture), guide (class and
        options) and data (:func:`pyro_bnn.training.resume.fit_fingerprint`): a difference is a
        ``ValueError`` naming it.  Not supported with ``distributed``.
    overwrite : bool
        Start afresh even though a file exists at ``checkpoint``; it is replaced (atomically)
        at the first epoch's write.
    marglik : pyro_bnn.MarglikOptions, optional
        Online marginal-likelihood schedule for guides that support it (Laplace: its prior
        precision; Hypernet on a weight-norm model: its scales' prior precision per layer, by
        the Laplace evidence of its mean network), e.g.
        ``marglik=pb.MarglikOptions(every=5, burnin=10, steps=50)``; ``None``: none.
    distributed : bool or pyro_bnn.training.distributed.DistributedOptions
        Data-parallel training under ``torchrun`` (see ``docs/distributed.md``): each rank
        reads ``batch_size / world_size`` examples of every global minibatch of size
        ``batch_size``, the loss module is wrapped in ``DistributedDataParallel``, all ranks
        share the seed (so the guide noise), and only rank 0 shows progress and writes
        checkpoints.  The result equals one process training with the same ``batch_size``.
    compile : bool
        Run the objective's forward pass under ``torch.compile`` (:mod:`pyro_bnn.training.compiled`):
        the same objective, its floating-point sums possibly reordered (losses agree to ~1e-6
        relative, not bit for bit).  Where compilation is unavailable or fails, the fit trains
        eagerly and warns :class:`pyro_bnn.training.compiled.CompileFallbackWarning`.  Default
        ``False``: on the CPU the compiled step was measured slower than eager for every guide
        (``docs/results/speed.md``).  Not supported with ``distributed``.
    cuda_graph : bool
        Capture the training step (objective, backward, the divergence check and the fused Adam
        step) in a CUDA graph and replay it (:mod:`pyro_bnn.training.cuda_graph`): one launch per
        step instead of hundreds.  Needs a CUDA fit with the default (or another fused)
        optimiser; the graph is captured afresh each epoch, after the guide's epoch hooks; a
        user's ``objective=`` is then called once per capture, not per step.  A step that
        cannot be captured trains eagerly with a
        :class:`pyro_bnn.CudaGraphFallbackWarning` (Pyro's autoguides under ``Trace_ELBO``
        always do: the ELBO reads each site into Python).  ``FitResult.graph_steps`` counts
        the replayed steps.  Default ``False`` (``docs/training.md``).
        Not supported with ``compile`` or ``distributed``.

    Returns
    -------
    FitResult
        Per-epoch history, timings and the convergence diagnosis.

    Raises
    ------
    TypeError, ValueError
        An unknown keyword (the message names the closest valid one) or an invalid value.
    FloatingPointError
        The loss, the gradient norm, or at an epoch's end any parameter or optimiser state
        became NaN/inf (or Pyro found a distribution parameter out of its support).  Model,
        guide, optimiser and schedule are restored to the last state verified finite, the
        error names the epoch and step and the epoch restored; no non-finite checkpoint is
        ever written.

    Warns
    -----
    ConvergenceWarning
        The end-of-fit checks (:mod:`pyro_bnn.training.convergence`) could not confirm convergence.
    RuntimeWarning
        The epoch loss exploded (rose more than ten times the magnitude of its best epoch's
        above it) without becoming NaN.
    """
    reject_unknown_keywords("fit", unknown, _FIT_KEYWORDS)
    batch_size, shuffle = resolve_batching(data, batch_size, shuffle, distributed)  # a loader's own, or 64, True
    optimizer = optimizer_factory(optimizer)  # a pyro.optim optimiser -> its torch factory
    lr = check_fit_arguments(epochs=epochs, batch_size=batch_size, lr=lr, optimizer=optimizer,
                             lr_schedule=lr_schedule, num_particles=num_particles, seed=seed,
                             clip_norm=clip_norm, num_data=num_data, objective=objective,
                             checkpoint=checkpoint, resume=resume, overwrite=overwrite,
                             distributed=distributed, shuffle=shuffle, progress=progress, marglik=marglik,
                             compile=compile, cuda_graph=cuda_graph)
    with contextlib.ExitStack() as held:
        if checkpoint is not None and not distributed:
            held.enter_context(CheckpointLock(checkpoint))  # up front: no second fit on this path
        refuse_overwrite(checkpoint, resume, overwrite)
        t_start = time.perf_counter()
        run = _prepare(model, guide, data, batch_size=batch_size, device=device, shuffle=shuffle, seed=seed,
                       num_data=num_data, objective=objective, num_particles=num_particles, marglik=marglik,
                       distributed=distributed, epochs=epochs, checkpoint=checkpoint)
        if checkpoint is not None and run.dstate is not None and run.dstate.is_main:
            held.enter_context(CheckpointLock(checkpoint))  # distributed: rank 0 writes
        return _fit_prepared(run, data, t_start, epochs=epochs, batch_size=batch_size, lr=lr,
                             optimizer=optimizer, lr_schedule=lr_schedule, num_particles=num_particles,
                             shuffle=shuffle, seed=seed, clip_norm=clip_norm, marglik=marglik,
                             objective=objective, resume=resume, progress=progress, compile=compile,
                             cuda_graph=cuda_graph)


def _cuda_devices(model) -> list:
    """The CUDA devices of ``model``'s parameters and buffers (for ``torch.random.fork_rng``)."""
    if not isinstance(model, torch.nn.Module):
        return []
    tensors = list(model.parameters()) + list(model.buffers())
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _fit_prepared(run: _Run, data, t_start: float, *, epochs, batch_size, lr, optimizer, lr_schedule,
                  num_particles, shuffle, seed, clip_norm, marglik, objective, resume, progress,
                  compile, cuda_graph=False) -> FitResult:
    """The fit after :func:`_prepare`: optimisation set-up, resume, the epochs, the diagnosis."""
    model, guide = run.model, run.guide
    # before a resume loads anything; the random streams are kept as they were: describing
    # a PyroModule layer reads its PyroSample attributes, which draws from the prior
    with torch.random.fork_rng(devices=_cuda_devices(model)), poutine.block():
        run.fingerprint = fit_fingerprint(model, guide, data)
    lr = lr if lr is not None else run.contract.learning_rate(run.ctx.num_data) or 1e-3
    run.settings = dict(epochs=epochs, batch_size=batch_size, lr=lr, num_particles=num_particles,
                        shuffle=bool(shuffle), seed=seed, clip_norm=clip_norm, num_data=run.ctx.num_data,
                        marglik=None if marglik is None else asdict(marglik),
                        model=type(model).__name__, guide=type(guide).__name__,
                        lr_schedule=lr_schedule if isinstance(lr_schedule, str) else "callable",
                        optimizer="default" if optimizer is None else "callable",
                        objective="default" if objective is None else "callable")
    if cuda_graph:   # before the guide's fit-start hook changes anything
        check_cuda_graph_device(run.device)
    with local_params(model, guide), flush_denormals():
        end_batch_watches(guide)  # fit scales every batch by num_data itself: nothing to watch
        run.contract.on_fit_start(run.ctx)
        _prepare_optimisation(run, optimizer, lr, lr_schedule, clip_norm, epochs, compile, cuda_graph)
        start = resume_fit(run) if resume else 0
        run.guard.check_initial(start)
        run.guard.start(start)
        run.ctx.epoch = start
        shown = progress if (run.dstate is None or run.dstate.is_main) else False
        bar = _progress(epochs, start, not callable(shown) and bool(shown))
        try:
            for epoch in range(start + 1, epochs + 1):
                _end_epoch(run, epoch, *_train_epoch(run, epoch))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{run.history['loss'][-1]:.4g}")
                elif callable(shown):
                    shown(epoch, epochs, run.history["loss"][-1])
            _verify_final_state(run)
        except BaseException:   # Ctrl-C, a divergence, a failing step: no fit-only setting outlives it
            run.contract.on_fit_abort(run.ctx)   # (MeanField: the annealed KL weight; Laplace: MAP mode)
            raise
        finally:
            if bar is not None:
                bar.close()
        run.contract.on_fit_end(run.ctx)
    publish_after_fit(model, guide)  # Predictive / SVI / the param store see the trained values
    judged_against_baseline = run.own_objective and run.contract.bounds_evidence   # check (e): an ELBO only
    diagnosis = run.monitor.diagnose(_judged_objective(run.history), baseline=constant_predictor_log_likelihood(
        model, data, run.ctx.num_data) if judged_against_baseline else None)
    if not diagnosis.converged and epochs > 0 and (run.dstate is None or run.dstate.is_main):
        warnings.warn(diagnosis.message(), ConvergenceWarning, stacklevel=3)
    return FitResult(history=run.history, seconds=time.perf_counter() - t_start, convergence=diagnosis,
                     resumed_from=start, lr=lr, compiled=isinstance(run.loss_module, CompiledLoss)
                     and run.loss_module.compiled, graph_steps=0 if run.graph is None else run.graph.replays)


def _judged_objective(history: dict) -> list[float]:
    """``−loss`` per epoch without the objective's parameter-independent part (the
    ``loss_constant`` extra, e.g. a Gaussian prior's normaliser), which would otherwise make
    the diagnosis's relative tolerance blind to the rest."""
    constants = history.get("loss_constant") or [0.0] * len(history["loss"])
    return [-(v - c) for v, c in zip(history["loss"], constants)]


def _prepare(model, guide, data, *, batch_size, device, shuffle, seed, num_data, objective, num_particles,
             marglik, distributed, epochs, checkpoint) -> _Run:
    """Seeds, device, data checks and loader, the guide's set-up, objective and context."""
    if not distributed:
        _dist.warn_if_undistributed_launch()
    dstate = None
    if distributed:
        dstate = _dist.start(distributed, device, seed)  # joins the group, seeds all ranks alike
        device = dstate.device
    elif seed is not None:
        pyro.set_rng_seed(seed)
    device = torch.device(device) if device is not None else module_device(model)
    if isinstance(model, torch.nn.Module):
        model.to(device)
    check = _validate_data(model, data, device)
    if dstate is not None:
        loader = _dist.shard_loader(data, batch_size, dstate, shuffle=shuffle, device=device)
    else:
        loader = make_loader(data, batch_size=batch_size, shuffle=shuffle, device=device, check=check)
    n = int(num_data) if num_data is not None else dataset_size(loader)
    x0, y0 = split_batch(next(iter(loader)))
    if num_data is not None and n < len(x0):
        raise ValueError(f"num_data={n} is smaller than one minibatch ({len(x0)} examples): num_data is "
                         "the size N of the whole training set, to which each minibatch's "
                         "log-likelihood is scaled; pass N (at least the number of training examples) or "
                         "leave num_data=None")
    x0 = x0.to(device)
    y0 = None if y0 is None else y0.to(device)
    refuse_local_latents(model, guide, x0, y0, loader)  # per-example latents would meet other examples
    setup_guide(model, guide, x0, y0, n)
    sync_param_store(model, guide)  # a loaded Pyro param store is picked up (pyro_bnn.contract.param_store)
    if isinstance(guide, torch.nn.Module):
        guide.to(device)
    contract = guide_contract(guide)
    objective_given = objective
    objective = objective or contract.make_objective(num_particles)
    if marglik is not None and not contract.supports_marglik:
        raise TypeError(f"marglik= needs a guide that learns hyperparameters (e.g. Laplace); "
                        f"got {type(guide).__name__}")
    history: dict[str, list] = {"loss": [], "elbo": [], "epoch_seconds": []}
    ctx = FitContext(model, guide, loader, n, device, epochs, options={"marglik": marglik}, distributed=dstate,
                     history=history)
    return _Run(model, guide, contract, ctx, loader, device, dstate, objective, {},
                None if checkpoint is None else os.fspath(checkpoint), history, (x0, y0), objective_given is None)


def _prepare_optimisation(run: _Run, optimizer, lr, lr_schedule, clip_norm, epochs,
                          compile: bool = False, cuda_graph: bool = False) -> None:
    """Optimiser, schedule, loss module (compiled if asked), divergence guard, convergence
    monitor (after the guide's ``on_fit_start``, which may freeze parameters) and the CUDA
    graph step (if asked)."""
    run.params = trained_parameters(run.model, run.guide)
    extra = _global_params(run)  # the global pyro.param values (pyro_bnn.contract.local_params)
    run.params += [tensor for tensor, _ in extra]
    model_params = [tensor for tensor, source in extra if source == "model"]  # e.g. its noise sigma
    run.optimizer = build_optimizer(optimizer, run.params, lr, run.contract.learning_rate_factors())
    warn_weight_decay(run.optimizer)
    run.ctx.optimizer = run.optimizer
    run.scheduler = make_lr_scheduler(run.optimizer, lr_schedule, epochs * _num_batches(run.loader))
    run.loss_module = _LossModule(run.model, run.guide, run.objective, run.ctx.num_data)
    if run.dstate is not None:
        run.loss_module = run.dstate.wrap(run.loss_module, *run.example)
    elif compile:
        run.loss_module = CompiledLoss(run.loss_module, _cuda_devices(run.model))
    run.guard = DivergenceGuard(run.model, run.guide, run.optimizer, run.scheduler, run.params,
                                clip_norm=clip_norm, checkpoint=run.checkpoint,
                                deferred=defer_step_checks(run.optimizer, run.device, run.dstate))
    run.monitor = ConvergenceMonitor(run.optimizer, run.contract.scale_parameters(),
                                     watched_hyperparameters(run.model, model_params))
    if cuda_graph:
        check_cuda_graph_fit(run.device, run.guard.deferred, run.optimizer)
        run.graph = CudaGraphStep(run.loss_module, run.optimizer, run.guard, run.device, run.objective)


def _global_params(run: _Run) -> list:
    """``(tensor, "guide" | "model")`` for the global ``pyro.param`` tensors of model and guide
    not among ``run.params``."""
    args, kwargs, _ = call_model(run.model, *run.example, run.ctx.num_data)
    known = {id(p) for p in run.params}
    with warnings.catch_warnings():   # a look-up run, not a prediction: its draw is discarded
        warnings.simplefilter("ignore", GuideStateWarning)
        extra = [(t, source) for t, source in global_param_tensors(run.model, run.guide, args, kwargs,
                                                                    with_sources=True) if id(t) not in known]
    if extra and run.checkpoint is not None:
        raise NotImplementedError(
            "fit(checkpoint=...) saves model and guide state_dicts, which do not hold the model's global "
            f"pyro.param values ({len(extra)} tensors); a resumed fit would lose them. Train without "
            "checkpoint=, or make them module parameters (PyroParam attributes)")
    return extra


def _train_epoch(run: _Run, epoch: int) -> tuple[float, dict, int, float]:
    """The minibatch steps of one epoch; returns (loss sum, extras sums, steps, start time)."""
    run.ctx.epoch = epoch
    if run.dstate is not None:
        _dist.set_epoch(run.loader, epoch)
    run.contract.on_epoch_start(run.ctx)
    if run.graph is not None:
        run.graph.begin_epoch()   # captured afresh: the epoch hooks may have changed Python settings
    t0 = time.perf_counter()
    guard = run.guard
    steps, extras_sum = 0, {}
    guard.begin_epoch()
    try:
        for step, batch in enumerate(run.loader, 1):
            _train_step(run, epoch, step, batch, extras_sum)
            steps += 1
        total = guard.end_epoch(epoch)   # deferred step checks are read here (one synchronisation)
    finally:
        guard.clear_device_flags()
    return total, {k: float(v) for k, v in extras_sum.items()}, steps, t0


def _train_step(run: _Run, epoch: int, step: int, batch, extras_sum: dict) -> None:
    """One minibatch: loss, backward, the guard's check, the optimiser and schedule steps
    (replayed from a CUDA graph with ``cuda_graph=True``); the objective's extras are added to
    ``extras_sum``."""
    xb, yb = split_batch(batch)
    xb = xb.to(run.device, non_blocking=True)
    yb = None if yb is None else yb.to(run.device, non_blocking=True)
    graph = run.graph
    if graph is None:
        extras = _eager_step(run, epoch, step, xb, yb)
    else:
        extras = graph.step(xb, yb, step) if graph.accepts(xb, yb) else None
        if extras is None:   # warm-up, a step read at once, a partial batch, or a failed capture
            with graph.warming_up():
                extras = _eager_step(run, epoch, step, xb, yb)
    run.scheduler.step()
    run.guard.after_step()
    run.monitor.after_step()
    # extras are summed on the device in float64 (the same sum as of Python floats), so
    # reading them costs no synchronisation per step
    for k, v in extras.items():
        v = v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else float(v)
        extras_sum[k] = extras_sum.get(k, 0.0) + v


def _eager_step(run: _Run, epoch: int, step: int, xb, yb) -> dict:
    """Loss, backward, the guard's check and the optimiser step; returns the extras."""
    opt, guard = run.optimizer, run.guard
    try:
        out = run.loss_module(xb, yb)
        loss, extras = out if isinstance(out, tuple) else (out, {})
        opt.zero_grad(set_to_none=True)
        loss.backward()
    except ValueError as exc:
        if not is_invalid_parameter_error(exc):
            raise
        guard.invalid_parameter(exc, epoch, step)
    guard.check(loss, epoch, step, run.dstate)  # before the step: nothing non-finite lands
    if guard.pending:  # the loss at the last epoch's final state was finite: keep it, write it
        _confirm_state(run)
    opt.step()
    return extras


def _end_epoch(run: _Run, epoch: int, total: float, extras_sum: dict, steps: int, t0: float) -> None:
    """Record the epoch, run the guide's hook, check that the state is finite and keep it as
    the candidate that the next loss evaluation confirms (and then checkpoints)."""
    if run.dstate is not None:
        extras_sum = run.dstate.mean_of(extras_sum)
    history = run.history
    mean_loss = total / max(steps, 1)
    history["loss"].append(mean_loss)
    if "elbo" not in extras_sum:  # an objective may report the plain ELBO itself
        history["elbo"].append(-mean_loss)
    for k, v in extras_sum.items():
        history.setdefault(k, []).append(v / max(steps, 1))
    run.contract.on_epoch_end(run.ctx)
    if run.dstate is not None:
        run.dstate.sync_rng_()  # the hook may have drawn per-shard random numbers
    history["epoch_seconds"].append(time.perf_counter() - t0)
    run.guard.check_state(epoch)  # after the hook, before the state is kept anywhere
    run.guard.watch_loss(epoch, mean_loss)
    writes = run.checkpoint is not None and (run.dstate is None or run.dstate.is_main)
    run.guard.remember(epoch, copy_state=writes or epoch < run.ctx.epochs)
    if writes:
        run.pending_checkpoint = checkpoint_entries(run, epoch)


def _confirm_state(run: _Run) -> None:
    """The candidate state passed its loss evaluation: keep it and write its checkpoint."""
    confirmed = run.guard.confirm()
    extra, run.pending_checkpoint = run.pending_checkpoint, None
    if extra is not None:
        modules, opt_state, sched_state = confirmed
        extra["resume"]["scheduler"] = sched_state
        save_checkpoint(run.checkpoint, StateOf(modules.get("model", {})), StateOf(modules.get("guide", {})),
                        StateOf(opt_state), **extra)


def _verify_final_state(run: _Run) -> None:
    """Evaluate the loss once at the state the last step reached (no later step does), on the
    first batch, without drawing from the caller's random streams or changing any buffer (a
    BatchNorm's running statistics stay those of the last step); keep and write it if finite.

    Only the guide's own objective is evaluated so; a user's ``objective=`` is called for
    training steps only (it may count or log its calls), and the final state of such a fit is
    verified by its finite parameters alone."""
    if not run.guard.pending:
        return
    if not run.own_objective:
        _confirm_state(run)
        return
    loss_module = getattr(run.loss_module, "module", run.loss_module)  # not through DDP: no backward
    devices = [run.device] if run.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), buffers_kept(run.model, run.guide):
        try:
            out = loss_module(*run.example)
        except ValueError as exc:
            if not is_invalid_parameter_error(exc):
                raise
            run.guard.invalid_parameter(exc, run.ctx.epoch, None)
    run.guard.check_final(out[0] if isinstance(out, tuple) else out, run.ctx.epoch, run.dstate)
    _confirm_state(run)


#: the keyword arguments of fit, for the "did you mean" of an unknown one
_FIT_KEYWORDS = tuple(name for name, p in inspect.signature(fit).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _num_batches(loader) -> int:
    try:
        return len(loader)
    except TypeError:  # an iterable without a length: count one pass
        return sum(1 for _ in loader)


def _progress(total, initial, enabled):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="fit", unit="epoch", leave=False)
