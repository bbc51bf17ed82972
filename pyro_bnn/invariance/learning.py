"""Learning invariances: MAP training interleaved with evidence steps on ``δ`` and ``η`` (LILA).

One loop, three methods (so they can be compared on equal terms):

* ``"lila"`` — ``η`` by gradient ascent on the Laplace-KFAC evidence
  (:mod:`~pyro_bnn.invariance.evidence`, :func:`~pyro_bnn.invariance.step.evidence_step`),
  every ``every`` epochs after ``burnin``; ``P⁻¹`` once per step, then the trace
  ``tr(P⁻¹ ∂H_b/∂η)`` and the batch log-likelihood are backpropagated batch by batch:
  memory of one minibatch.
* ``"augerino"`` — ``η`` trained with ``θ`` on the MAP objective plus Augerino's width
  reward: minimise ``mean_n −log p(y_n | f̂_n) − λ ‖η‖`` (Benton et al. 2020, λ = 0.01),
  no evidence.  Augerino's paper rewards ``‖η‖²``, whose gradient vanishes at the
  identity start ``η = 0`` (η then never leaves 0); the unsquared norm pushes with
  constant strength λ, so the baseline actually learns a width.
* ``"none"`` — ``η`` never moves (use ``AffineAugmentation(num_samples=1)`` at ``η = 0``,
  or no augmentation, for the non-invariant baseline).

In every method the prior precisions ``δ_l`` (one per layer) are learned by the evidence
(Immer et al. 2021, online marginal likelihood), so only the treatment of ``η`` differs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..arguments import check_int, check_positive
from ..data.batches import (
    BatchCheck,
    CheckedBatches,
    TensorBatches,
    as_tensors,
    check_data,
    dataset_size,
    split_batch,
)
from ..model.likelihoods import inverse_link, kind_and_noise, log_likelihood
from ..model.modes import evaluation_mode
from ..training.divergence import DivergenceGuard
from ..training.lr_schedule import lr_factor_function, make_lr_scheduler
from ..training.seeding import seeded
from .evidence import invariant_layers
from .guide_step import guide_eta_optimizer, guide_eta_step, learnable_augmentation
from .step import eta_grad, evidence_step

__all__ = ["METHODS", "InvarianceResult", "learn_invariance", "evidence_step", "map_predict",
           "learnable_augmentation", "guide_eta_optimizer", "guide_eta_step"]
# evidence_step and the guide functions live in .step and .guide_step; re-exported here,
# where they were first defined.

METHODS = ("lila", "augerino", "none")


@dataclass
class InvarianceResult:
    """What :func:`learn_invariance` returns.

    Attributes
    ----------
    values : dict[str, Tensor]
        MAP weights ``{site: tensor}`` (run the model with them via :func:`map_predict`).
    prior_precision : Tensor, shape (L,)
        Learned ``δ_l`` per Linear/Conv2d layer.
    history : dict[str, list]
        ``"loss"`` (MAP loss per datum, per epoch), ``"extent"`` (6 extents after each epoch),
        ``"log_evidence"`` (the Laplace-KFAC log evidence, a **total** over the training
        data as in ``pb.fit``'s history, after each evidence step) with ``"evidence_epoch"``,
        ``"epoch_seconds"``, ``"hyper_seconds"`` (wall time of each evidence step).
    seconds : float
    """

    values: dict
    prior_precision: torch.Tensor
    history: dict = field(default_factory=dict)
    seconds: float = 0.0


WHERE = "learn_invariance"


class _Source:
    """The training data of :func:`learn_invariance`, checked as ``pb.fit`` checks its data
    (:func:`pyro_bnn.data.batches.check_data`): tensors in full up front, a ``DataLoader`` (or a
    ``Dataset``, batched here) batch by batch as it is read."""

    def __init__(self, model, data, batch_size, eval_batch_size, device, generator, num_data=None):
        self.device = device
        if isinstance(data, DataLoader) or (isinstance(data, Dataset) and not isinstance(data, TensorDataset)):
            loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=batch_size, shuffle=True,
                                                                          generator=generator)
            self.train = self.evidence = CheckedBatches(loader, BatchCheck(model, device), where=WHERE,
                                                        convert_labels=True)
            # a sampler over part of the data: its examples
            self.num_data = num_data if num_data is not None else dataset_size(loader)
            return
        try:
            x, y = as_tensors(data)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"data of {WHERE}: {exc}; expected (x, y) tensors, a TensorDataset, "
                            "a Dataset or a DataLoader") from None
        if y is None:
            raise ValueError(f"data of {WHERE} needs targets: expected (x, y), got x alone")
        x, y = check_data(model, x.to(device), y.to(device), where=WHERE, device=device)
        self.train = TensorBatches(x, y, batch_size, generator=generator)   # reshuffled per pass
        self.evidence = TensorBatches(x, y, eval_batch_size, shuffle=False)
        self.num_data = num_data if num_data is not None else len(x)

    def batches(self, which):
        """``(x, y)`` on the device, from ``self.train`` or ``self.evidence``."""
        for batch in getattr(self, which):
            x, y = split_batch(batch)
            yield x.to(self.device), y.to(self.device)


class _Weights(torch.nn.Module):
    """The MAP weights and ``log δ`` as module state, for the divergence guard's snapshots."""

    def __init__(self, values: dict, log_delta: torch.Tensor):
        super().__init__()
        self.weights = torch.nn.ParameterList(values.values())
        self.register_buffer("log_delta", log_delta)


def _check_arguments(epochs, batch_size, lr, hyper_lr, burnin, every, eta_steps, delta_steps, delta_lr,
                     prior_precision, augerino_weight, augerino_lr, marglik_batch_size):
    """Clear errors (names, expected, received) before any work."""
    for name, value, minimum in (("epochs", epochs, 1), ("batch_size", batch_size, 1), ("burnin", burnin, 0),
                                 ("every", every, 1), ("eta_steps", eta_steps, 1),
                                 ("delta_steps", delta_steps, 0)):
        check_int(name, value, minimum)
    check_int("marglik_batch_size", marglik_batch_size, 1, optional=True)
    for name, value in (("lr", lr), ("hyper_lr", hyper_lr), ("delta_lr", delta_lr),
                        ("prior_precision", prior_precision), ("augerino_lr", augerino_lr)):
        check_positive(name, value)
    if isinstance(augerino_weight, bool) or not isinstance(augerino_weight, (int, float)) \
            or not (math.isfinite(augerino_weight) and augerino_weight >= 0):
        raise ValueError(f"augerino_weight must be a finite number >= 0, got {augerino_weight!r}")


def learn_invariance(model, data, *, method: str = "lila", epochs: int = 100, batch_size: int = 128,
                     lr: float = 1e-3, hyper_lr: float = 0.05, burnin: int = 10, every: int = 1,
                     eta_steps: int = 1, delta_steps: int = 20, delta_lr: float = 0.1,
                     prior_precision: float = 1.0, augerino_weight: float = 0.01,
                     augerino_lr: float = 0.005, marglik_batch_size: int | None = None,
                     lr_schedule="constant", device=None, seed: int | None = 0,
                     callback=None, num_data: int | None = None) -> InvarianceResult:
    """Train a MAP network and its invariance (``η``) and prior precisions (``δ``).

    Parameters
    ----------
    model : pyro_bnn.BNN
        Usually with ``augmentation=AffineAugmentation(...)``; its Linear/Conv2d weights
        are the parameters (start: the network's weights).
    data : (x, y) tensors, TensorDataset, Dataset or DataLoader
        Checked as ``pb.fit`` checks its data (:func:`pyro_bnn.data.batches.check_data`): finite
        inputs of the model's dtype, as many targets as inputs, valid for the likelihood.
        A ``DataLoader`` is used as it is (its batches are checked as they are read, and
        read again for each evidence step); tensors are batched here (``batch_size``).
    method : {"lila", "augerino", "none"}
        How ``η`` is learned (module docstring).
    epochs, batch_size, lr : MAP training (Adam).
    hyper_lr : float
        Adam learning rate of ``η`` in evidence steps (LILA: 0.05).
    burnin, every, eta_steps : int
        Evidence steps start after ``burnin`` epochs, then every ``every`` epochs, each
        with ``eta_steps`` ``η`` updates (one KFAC refit each).
    delta_steps, delta_lr : int, float
        Adam steps on ``log δ`` per evidence step (closed form, no data pass).
    prior_precision : float
        Initial ``δ``.
    augerino_weight, augerino_lr : float
        Augerino's ``λ`` and the Adam learning rate of ``η`` (method ``"augerino"``).
    marglik_batch_size : int, optional
        Batch size of evidence passes (memory bound); default ``batch_size``.
    lr_schedule : {"constant", "cosine"} or callable
        Factor on the MAP's ``lr`` over the fit, per step, as in :func:`pyro_bnn.fit`
        (``"cosine"``: from 1 to 0, so θ settles and the evidence at the end is that of a
        converged MAP; at a constant lr the iterates, and the evidence, keep moving at the
        noise level).  ``η`` and ``δ`` keep their own constant rates.
    device : torch.device, optional
    seed : int, optional
        Seeds shuffling, initial draws and augmentation draws.
    callback : callable, optional
        ``callback(epoch, result)`` after each epoch (e.g. logging); may return True to stop.
    num_data : int, optional
        The number of training examples N the likelihood and evidence are scaled to; default
        read from ``data`` as :func:`pyro_bnn.fit` reads it (a ``DataLoader``'s sampler over part
        of a data set counts its examples; a sampler whose examples cannot be known asks for it).

    Returns
    -------
    InvarianceResult

    Raises
    ------
    TypeError, ValueError
        Unknown method; ``"lila"``/``"augerino"`` without a learnable augmentation; bad data
        or arguments (``epochs``, ``batch_size``, ``eta_steps``, ``every`` ints >= 1,
        ``burnin``, ``delta_steps`` ints >= 0, learning rates and ``prior_precision``
        finite > 0), before any work.
    FloatingPointError
        The loss, a gradient, the weights, δ, η or the evidence became non-finite: the
        state last verified finite (the end of an epoch whose state gave a finite loss, or
        the start) is restored and returned as the exception's ``result`` attribute (an
        :class:`InvarianceResult`) — no NaN weight is kept.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_arguments(epochs, batch_size, lr, hyper_lr, burnin, every, eta_steps, delta_steps, delta_lr,
                     prior_precision, augerino_weight, augerino_lr, marglik_batch_size)
    check_int("num_data", num_data, minimum=1, optional=True)
    lr_factor_function(lr_schedule)  # a clear error for an unknown schedule, before any work
    if method != "none" and learnable_augmentation(model) is None:
        raise ValueError(f"method {method!r} needs a model with a learnable augmentation "
                         "(pb.BNN(net, lik, augmentation=AffineAugmentation(...)))")
    device = torch.device(device) if device is not None else _data_device(data)
    model.to(device)
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    source = _Source(model, data, batch_size, marglik_batch_size or batch_size, device, gen, num_data)
    with seeded(seed):   # the caller's random streams are left as they were
        return _train(model, source, method, epochs, lr, hyper_lr, burnin, every, eta_steps, delta_steps,
                      delta_lr, prior_precision, augerino_weight, augerino_lr, lr_schedule, device, gen,
                      callback)


def _data_device(data) -> torch.device:
    """Where the data's tensors are (CPU for a Dataset or DataLoader)."""
    try:
        x, _ = as_tensors(data)
    except (TypeError, ValueError):
        return torch.device("cpu")
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _train(model, source, method, epochs, lr, hyper_lr, burnin, every, eta_steps, delta_steps, delta_lr,
           prior_precision, augerino_weight, augerino_lr, lr_schedule, device, gen, callback):
    """The training loop of :func:`learn_invariance` (arguments and data checked)."""
    aug = model._modules.get("augmentation")
    n = source.num_data
    values = {k: torch.nn.Parameter(v.to(device).clone()) for k, v in model.initial_values().items()}
    layers = invariant_layers(model, values)
    log_delta = torch.full((len(layers),), math.log(prior_precision), device=device,
                           requires_grad=True)
    opt = torch.optim.Adam(values.values(), lr=lr)
    scheduler = make_lr_scheduler(opt, lr_schedule, epochs * len(source.train))
    delta_opt = torch.optim.Adam([log_delta], lr=delta_lr)
    eta_opt = None
    if method == "lila":
        eta_opt = torch.optim.Adam([aug.eta], lr=hyper_lr)
    elif method == "augerino":
        eta_opt = torch.optim.Adam([aug.eta], lr=augerino_lr)
    hist: dict[str, list] = {"loss": [], "extent": [], "log_evidence": [], "evidence_epoch": [],
                             "epoch_seconds": [], "hyper_seconds": []}
    result = InvarianceResult(values, log_delta.detach().exp(), hist)
    state = _Weights(values, log_delta)
    guarded = list(values.values()) + ([aug.eta] if method == "augerino" else [])
    guard = DivergenceGuard(model, state, opt, scheduler, guarded)
    guard.check_initial()
    guard.start()
    t_start = time.perf_counter()
    epoch = 0
    try:
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            total = 0.0
            delta = log_delta.detach().exp()
            with eta_grad(aug, method == "augerino"):
                for step, (xb, yb) in enumerate(source.batches("train"), 1):
                    f = model.run_with(values, xb)
                    nll = -log_likelihood(model.likelihood, f, yb).mean()
                    reg = sum(0.5 * d * sum(values[s].pow(2).sum() for s in layer.sites)
                              for d, layer in zip(delta, layers)) / n
                    loss = nll + reg
                    if method == "augerino":
                        loss = loss - augerino_weight * (aug.coefficients().pow(2).sum() + 1e-12).sqrt()
                        eta_opt.zero_grad()
                    opt.zero_grad()
                    loss.backward()
                    value = guard.check_step(loss, epoch, step)   # before the step: no NaN is kept
                    if guard.pending:
                        guard.confirm()   # the state of the last epoch's end gave a finite loss
                    opt.step()
                    scheduler.step()
                    if method == "augerino":
                        eta_opt.step()
                    guard.after_step()
                    total += value * len(xb)
            hist["loss"].append(total / n)
            hist["epoch_seconds"].append(time.perf_counter() - t0)
            if epoch > burnin and (epoch - burnin) % every == 0:
                for _ in range(eta_steps):
                    th = time.perf_counter()
                    ev = evidence_step(model, values, list(source.batches("evidence")), log_delta,
                                       delta_optimizer=delta_opt, delta_steps=delta_steps,
                                       eta_optimizer=eta_opt if method == "lila" else None,
                                       seed=int(torch.randint(0, 2**31 - 1, (1,),
                                                              generator=gen)))
                    if not math.isfinite(ev):
                        guard.fail(f"the log evidence became {ev}", epoch)
                    hist["hyper_seconds"].append(time.perf_counter() - th)
                    hist["log_evidence"].append(ev)
                    hist["evidence_epoch"].append(epoch)
            guard.check_state(epoch)
            guard.remember(epoch)
            hist["extent"].append(aug.extent.tolist() if aug is not None else [])
            result.prior_precision = log_delta.detach().exp()
            result.seconds = time.perf_counter() - t_start
            if callback is not None and callback(epoch, result):
                break
    except FloatingPointError as exc:
        # the guard restored the last state verified finite: hand it back with the error
        result.values = {k: v.detach() for k, v in values.items()}
        result.prior_precision = log_delta.detach().exp()
        exc.result = result
        raise
    result.values = {k: v.detach() for k, v in values.items()}
    return result


@torch.no_grad()
def map_predict(model, values: dict, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Predictive probabilities (or means) of the MAP network ``f̂(x; θ*)``, shape ``(N, C)``,
    in eval mode (BatchNorm: its running statistics, used and left as they are)."""
    out = []
    with evaluation_mode(model):
        for i in range(0, len(x), batch_size):
            f = model.run_with(values, x[i:i + batch_size])
            out.append(inverse_link(kind_and_noise(model.likelihood)[0], f))
    return torch.cat(out)
