"""Learning invariances: MAP training interleaved with evidence steps on ``δ`` and ``η`` (LILA).

One loop, three methods (so they can be compared on equal terms):

* ``"lila"`` — ``η`` by gradient ascent on the Laplace-KFAC evidence
  (:mod:`~pyro_bnn.invariance.evidence`), every ``every`` epochs after ``burnin``;
  ``P⁻¹`` once per step, then the trace ``tr(P⁻¹ ∂H_b/∂η)`` and the batch log-likelihood
  are backpropagated batch by batch: memory of one minibatch.
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
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..data import split_batch
from ..likelihoods import log_likelihood
from .evidence import _seeded, accumulate_factors, batch_surrogate, eigen_factors, log_evidence
from .kfac import kfac_layers

__all__ = ["METHODS", "InvarianceResult", "learn_invariance", "evidence_step", "map_predict",
           "learnable_augmentation", "guide_eta_optimizer", "guide_eta_step"]

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
        ``"log_evidence"`` (per datum, after each evidence step) with ``"evidence_epoch"``,
        ``"epoch_seconds"``, ``"hyper_seconds"`` (wall time of each evidence step).
    seconds : float
    """

    values: dict
    prior_precision: torch.Tensor
    history: dict = field(default_factory=dict)
    seconds: float = 0.0


@contextmanager
def _eta_grad(aug, on: bool):
    """Let ``η`` receive gradients inside the block only."""
    if aug is None:
        yield
        return
    old = aug.eta.requires_grad
    aug.eta.requires_grad_(on)
    try:
        yield
    finally:
        aug.eta.requires_grad_(old)


def _batches(x, y, batch_size, generator=None):
    idx = torch.randperm(len(x), generator=generator) if generator is not None else torch.arange(len(x))
    idx = idx.to(x.device)
    for i in range(0, len(x), batch_size):
        j = idx[i:i + batch_size]
        yield x[j], y[j]


def evidence_step(model, values: dict, batches, log_delta: torch.Tensor, *,
                  delta_optimizer=None, delta_steps: int = 0, eta_optimizer=None,
                  seed: int = 0, rank: int = 0, world_size: int = 1, reduce_fn=None) -> float:
    """One hyperparameter step: refit KFAC, update ``log δ`` (closed form) and ``η`` (batched).

    Parameters
    ----------
    model : pyro_bnn.BNN
        With an augmentation whose ``η`` ``eta_optimizer`` updates (``None``: δ only).
    values : dict
        MAP weights.
    batches : sequence of (x, y)
        The training data in minibatches, iterated twice in the same order (never one
        big graph: memory of one batch).
    log_delta : Tensor, shape (L,)
        Log prior precisions per layer; updated in place by ``delta_optimizer``
        (``delta_steps`` Adam steps on the closed-form evidence) when one is given.
    eta_optimizer : torch.optim.Optimizer, optional
        Over the augmentation's ``η``; takes one step up the evidence gradient.
    seed : int
        Base seed of the augmentation draws: batch ``i`` (its index among *all* the data's
        batches) is drawn with seed ``seed + i``; both passes replay the same draws.
    rank, world_size, reduce_fn : int, int, callable, optional
        Data-parallel evidence step (``fit(distributed=True)``): ``batches`` are the whole
        data's batches (same on every rank) and this rank takes batches ``i ≡ rank (mod
        world_size)``, with the same seeds as one process; ``reduce_fn`` (e.g.
        :func:`pyro_bnn.distributed.all_reduce_sums`) sums the Kronecker factors, ``N``,
        the log-likelihood and the ``η`` gradient over ranks, so every rank takes the
        single-process step (up to summation order).

    Returns
    -------
    float
        Log evidence per datum at the start of the ``η`` step (after the ``δ`` steps).
    """
    indexed = [(i, xb, yb) for i, (xb, yb) in enumerate(batches)]
    if not indexed:
        raise ValueError("no batches given")
    mine = [(i, xb, yb) for i, xb, yb in indexed if i % world_size == rank]
    batches = [(xb, yb) for _, xb, yb in mine]
    seeds = [seed + i for i, _, _ in mine]
    n = sum(len(xb) for xb, _ in batches)
    vals = {k: v.detach().requires_grad_() for k, v in values.items()}
    aug = model._modules.get("augmentation")
    with _eta_grad(aug, False):
        if batches:
            factors = accumulate_factors(model, vals, batches, seeds=seeds)
        else:       # more ranks than batches: contribute zeros of the right shapes
            factors = accumulate_factors(model, vals, [indexed[0][1:]], seeds=[seed])
            for fac in factors:
                fac.A, fac.G = fac.A * 0, fac.G * 0
    if reduce_fn is not None:
        sums = {"n": torch.tensor(float(n), dtype=torch.float64)}
        for j, fac in enumerate(factors):
            sums[f"A{j}"], sums[f"G{j}"] = fac.A.detach(), fac.G.detach()
        sums = reduce_fn(sums)
        n = int(round(float(sums["n"])))
        for j, fac in enumerate(factors):
            fac.A, fac.G = sums[f"A{j}"], sums[f"G{j}"]
    eig = eigen_factors(factors, n)
    sq = []
    for fac in factors:
        s = vals[fac.weight].detach().pow(2).sum()
        sq.append(s + (vals[fac.bias].detach().pow(2).sum() if fac.bias is not None else 0.0))
    for _ in range(delta_steps if delta_optimizer is not None else 0):
        delta_optimizer.zero_grad()
        d = log_delta.exp()
        obj = 0.0
        for fac, e, dl, s in zip(factors, eig, d, sq):
            obj = obj - 0.5 * (dl * s + torch.log(e.eigenvalues() + dl).sum()
                               - fac.num_params * torch.log(dl))
        (-obj / n).backward()
        delta_optimizer.step()
    delta = log_delta.detach().exp()
    ll_total = torch.zeros((), dtype=factors[0].A.dtype, device=factors[0].A.device)
    learn_eta = eta_optimizer is not None and aug is not None
    if learn_eta:
        eta_optimizer.zero_grad()
    with _eta_grad(aug, learn_eta):
        for (xb, yb), sd in zip(batches, seeds):
            with _seeded(sd, xb.device):
                if learn_eta:
                    sur, ll = batch_surrogate(model, vals, xb, yb, factors, eig, delta)
                    (-sur / n).backward()
                else:
                    with torch.no_grad():
                        f = model.run_with(vals, xb)
                        ll = log_likelihood(model.likelihood, f, yb).sum()
            ll_total = ll_total + ll
    if reduce_fn is not None:
        sums = {"ll": ll_total.detach()}
        if learn_eta:
            sums["eta"] = aug.eta.grad if aug.eta.grad is not None else torch.zeros_like(aug.eta)
        sums = reduce_fn(sums)
        ll_total = sums["ll"]
        if learn_eta:
            aug.eta.grad = sums["eta"].clone()
    if learn_eta:
        eta_optimizer.step()
    ev = log_evidence(torch.as_tensor(ll_total), vals, factors, eig, delta)
    return float(ev) / n


def learn_invariance(model, data, *, method: str = "lila", epochs: int = 100, batch_size: int = 128,
                     lr: float = 1e-3, hyper_lr: float = 0.05, burnin: int = 10, every: int = 1,
                     eta_steps: int = 1, delta_steps: int = 20, delta_lr: float = 0.1,
                     prior_precision: float = 1.0, augerino_weight: float = 0.01,
                     augerino_lr: float = 0.005, marglik_batch_size: int | None = None,
                     device=None, seed: int | None = 0, callback=None) -> InvarianceResult:
    """Train a MAP network and its invariance (``η``) and prior precisions (``δ``).

    Parameters
    ----------
    model : pyro_bnn.BNN
        Usually with ``augmentation=AffineAugmentation(...)``; its Linear/Conv2d weights
        are the parameters (start: the network's weights).
    data : (x, y) tensors
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
    device : torch.device, optional
    seed : int, optional
        Seeds shuffling, initial draws and augmentation draws.
    callback : callable, optional
        ``callback(epoch, result)`` after each epoch (e.g. logging); may return True to stop.

    Returns
    -------
    InvarianceResult

    Raises
    ------
    ValueError
        Unknown method, or ``"lila"``/``"augerino"`` without a learnable augmentation.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    x, y = data
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"data must be (x, y) tensors, got {type(x).__name__}, {type(y).__name__}")
    aug = model._modules.get("augmentation")
    if method != "none" and (aug is None or not getattr(aug, "learnable", True)):
        raise ValueError(f"method {method!r} needs a model with a learnable augmentation "
                         "(pb.BNN(net, lik, augmentation=AffineAugmentation(...)))")
    device = torch.device(device) if device is not None else x.device
    model.to(device)
    x, y = x.to(device), y.to(device)
    n = len(x)
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    if seed is not None:
        torch.manual_seed(seed)
    layers = kfac_layers(model)
    values = {k: torch.nn.Parameter(v.to(device).clone()) for k, v in model.initial_values().items()}
    log_delta = torch.full((len(layers),), math.log(prior_precision), device=device,
                           requires_grad=True)
    opt = torch.optim.Adam(values.values(), lr=lr)
    delta_opt = torch.optim.Adam([log_delta], lr=delta_lr)
    eta_opt = None
    if method == "lila":
        eta_opt = torch.optim.Adam([aug.eta], lr=hyper_lr)
    elif method == "augerino":
        eta_opt = torch.optim.Adam([aug.eta], lr=augerino_lr)
    hist: dict[str, list] = {"loss": [], "extent": [], "log_evidence": [], "evidence_epoch": [],
                             "epoch_seconds": [], "hyper_seconds": []}
    result = InvarianceResult(values, log_delta.detach().exp(), hist)
    t_start = time.perf_counter()
    mb = marglik_batch_size or batch_size
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        total = 0.0
        delta = log_delta.detach().exp()
        with _eta_grad(aug, method == "augerino"):
            for xb, yb in _batches(x, y, batch_size, gen):
                f = model.run_with(values, xb)
                nll = -log_likelihood(model.likelihood, f, yb).mean()
                reg = sum(0.5 * d * (values[fac_w].pow(2).sum() + (values[fac_b].pow(2).sum()
                                                                   if fac_b else 0.0))
                          for d, (_, _, fac_w, fac_b) in zip(delta, layers)) / n
                loss = nll + reg
                if method == "augerino":
                    loss = loss - augerino_weight * (aug.coefficients().pow(2).sum() + 1e-12).sqrt()
                    eta_opt.zero_grad()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if method == "augerino":
                    eta_opt.step()
                total += float(loss.detach()) * len(xb)
        hist["loss"].append(total / n)
        hist["epoch_seconds"].append(time.perf_counter() - t0)
        if epoch > burnin and (epoch - burnin) % every == 0:
            for _ in range(eta_steps):
                th = time.perf_counter()
                ev = evidence_step(model, values, _batches(x, y, mb), log_delta,
                                   delta_optimizer=delta_opt, delta_steps=delta_steps,
                                   eta_optimizer=eta_opt if method == "lila" else None,
                                   seed=int(torch.randint(0, 2**31 - 1, (1,),
                                                                          generator=gen)))
                hist["hyper_seconds"].append(time.perf_counter() - th)
                hist["log_evidence"].append(ev)
                hist["evidence_epoch"].append(epoch)
        hist["extent"].append(aug.extent.tolist() if aug is not None else [])
        result.prior_precision = log_delta.detach().exp()
        result.seconds = time.perf_counter() - t_start
        if callback is not None and callback(epoch, result):
            break
    result.values = {k: v.detach() for k, v in values.items()}
    return result


@torch.no_grad()
def map_predict(model, values: dict, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Predictive probabilities (or means) of the MAP network ``f̂(x; θ*)``, shape ``(N, C)``."""
    out = []
    for i in range(0, len(x), batch_size):
        f = model.run_with(values, x[i:i + batch_size])
        out.append(torch.softmax(f, -1) if model.likelihood.name == "categorical"
                   else torch.sigmoid(f) if model.likelihood.name == "bernoulli" else f)
    return torch.cat(out)


# ----------------------------------------------------------- Laplace-guide integration
def learnable_augmentation(model):
    """The model's augmentation if invariance learning may train it, else ``None``."""
    modules = getattr(model, "_modules", {})
    aug = modules.get("augmentation") if isinstance(modules, dict) else None
    if aug is None or not getattr(aug, "learnable", False) or not hasattr(aug, "eta"):
        return None
    return aug


def guide_eta_optimizer(model, lr: float):
    """Adam over ``η`` for the online schedule of a Laplace guide (``None``: nothing to learn)."""
    aug = learnable_augmentation(model)
    return None if aug is None else torch.optim.Adam([aug.eta], lr=float(lr))


def guide_eta_step(guide, model, batches, optimizer, seed: int = 0, distributed=None) -> float:
    """One evidence-gradient step on ``η`` at a Laplace guide's MAP and prior precisions.

    Called by :class:`pyro_bnn.guides.Laplace` in ``fit(..., marglik=...)`` when the model
    has a learnable augmentation (after its ``δ`` steps).  ``batches``: unshuffled
    ``(x, y)`` minibatches of the *whole* training data.  ``distributed``: a
    :class:`pyro_bnn.distributed.DistributedState` (``fit(distributed=True)``'s
    ``ctx.distributed``) to split the batches across ranks and all-reduce the sums
    (:func:`evidence_step`); ``None``: one process.  Returns the log evidence per datum.
    """
    values = guide.map_values()
    device = next(iter(values.values())).device
    site_delta = {}
    for layer, d in zip(guide.layers, guide.layer_prior_precisions()):
        if d.dim() != 0:
            raise ValueError("learning an augmentation with a Laplace guide needs a scalar or "
                             f"layer-wise prior precision, got one of shape {tuple(d.shape)}")
        for s in layer.sites:
            site_delta[s] = d.detach()
    deltas = torch.stack([site_delta[w] for _, _, w, _ in kfac_layers(model)])
    rank, world = (0, 1) if distributed is None else (distributed.rank, distributed.world_size)
    data = [(xb.to(device), yb.to(device)) if i % world == rank or i == 0 else (xb, yb)
            for i, (xb, yb) in enumerate(split_batch(b) for b in batches)]
    return evidence_step(model, values, data, deltas.log(), eta_optimizer=optimizer, seed=seed,
                         rank=rank, world_size=world,
                         reduce_fn=None if distributed is None else distributed.reduce_sums)
