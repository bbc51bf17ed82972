"""Posterior predictive: Monte Carlo over guide samples, batched over inputs.

Works for :class:`~pyro_bnn.BNN` models (the network output is computed directly under
the guide's sampled weights) and for hand-written ``PyroModule`` models (the distribution
of the observed site, ``"obs"`` by default, is read from a replayed trace).
"""

from __future__ import annotations

from typing import NamedTuple

import pyro.distributions as dist
import torch
from pyro import poutine

from . import metrics
from ._local_params import local_params
from .data import BatchCheck, check_inputs
from .devices import module_device
from .guides.base import guide_contract
from .likelihoods import Bernoulli, Categorical, Gaussian
from .model import is_bnn
from .objectives import call_model

__all__ = ["PredictiveSamples", "predictive_samples", "predict", "evaluate", "sample_latents"]


class PredictiveSamples(NamedTuple):
    """Per-sample predictive parameters.

    ``kind`` is ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``; ``probs`` is
    ``(S, N, C)`` (classification), ``loc``/``scale`` are ``(S, N, D)`` (regression).
    """

    kind: str
    probs: torch.Tensor | None = None
    loc: torch.Tensor | None = None
    scale: torch.Tensor | None = None


def sample_latents(model, guide, x, y=None) -> dict[str, torch.Tensor]:
    """One joint draw of all latent sites from the guide, ``{site: value}``."""
    problem = guide_contract(guide).prediction_problem()
    if problem is not None:
        raise ValueError(problem)
    args, kwargs, _ = call_model(model, x, y, len(x))
    tr = poutine.trace(poutine.block(guide, hide_types=["param"])).get_trace(*args, **kwargs)
    return {name: node["value"] for name, node in tr.nodes.items()
            if node["type"] == "sample" and not node["is_observed"]
            and not node["infer"].get("is_auxiliary", False)}


def _unwrap(d):
    while isinstance(d, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)) or (
        hasattr(d, "base_dist") and not isinstance(d, (dist.Normal, dist.Categorical, dist.Bernoulli))
    ):
        d = d.base_dist
    return d


def _params_from_distribution(d) -> tuple[str, dict]:
    d = _unwrap(d)
    if isinstance(d, dist.Categorical):
        return "categorical", {"probs": d.probs}
    if isinstance(d, dist.Bernoulli):
        return "bernoulli", {"probs": d.probs}
    if isinstance(d, dist.Normal):
        return "gaussian", {"loc": d.loc, "scale": d.scale.expand_as(d.loc)}
    raise TypeError(
        "predict supports observation sites with Categorical, Bernoulli or Normal "
        f"distributions; got {type(d).__name__}")


def _params_from_bnn(model, f) -> tuple[str, dict]:
    lik = model.likelihood
    if isinstance(lik, Categorical):
        return "categorical", {"probs": torch.softmax(f, -1)}
    if isinstance(lik, Bernoulli):
        return "bernoulli", {"probs": torch.sigmoid(f)}
    if isinstance(lik, Gaussian):
        return "gaussian", {"loc": f, "scale": lik.noise.expand_as(f)}
    return _params_from_distribution(lik.distribution(f))


def params_under(model, latents: dict, x, batch_size: int = 1024, obs_site: str = "obs",
                 device=None) -> tuple[str, dict]:
    """Predictive parameters of every input in ``x`` under one joint draw ``latents``.

    Batched over inputs.  For a :class:`~pyro_bnn.BNN` the network runs directly with the
    drawn weights; for a hand-written model the observed site's distribution is read from a
    conditioned trace.  Differentiable if called with gradients enabled.

    Returns
    -------
    kind : str
        ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``.
    params : dict
        ``probs`` ``(N, C)`` or ``loc``/``scale`` ``(N, D)``.
    """
    fast = is_bnn(model)
    kind, chunks = None, []
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size]
        xb = xb if device is None else xb.to(device)
        if fast:
            kind, params = _params_from_bnn(model, model.run_with(latents, xb))
        else:
            tr = poutine.trace(poutine.condition(model, data=latents)).get_trace(xb, None)
            if obs_site not in tr.nodes:
                raise ValueError(f"model has no observed site {obs_site!r}; sites: {list(tr.nodes)}")
            kind, params = _params_from_distribution(tr.nodes[obs_site]["fn"])
        chunks.append(params)
    return kind, {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


@torch.no_grad()
def predictive_samples(model, guide, x, num_samples: int = 64, batch_size: int = 1024,
                       obs_site: str = "obs", device=None) -> PredictiveSamples:
    """Predictive parameters under ``num_samples`` joint draws from ``guide``.

    Each draw's weights are used for every input batch, so memory is bounded by one batch
    of inputs times ``num_samples`` outputs.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    check = BatchCheck(model)
    check_inputs(x, "x", check.dtype, allow_integer=check.integer_inputs)
    device = device or module_device(model, guide, default=x.device)
    with local_params(model, guide):
        per_sample = []
        for _ in range(num_samples):
            latents = sample_latents(model, guide, x[:1].to(device))
            kind, params = params_under(model, latents, x, batch_size, obs_site, device)
            per_sample.append(params)
    stacked = {k: torch.stack([p[k] for p in per_sample]) for k in per_sample[0]}
    return PredictiveSamples(kind, **stacked)


def predict(model, guide, x, num_samples: int = 64, batch_size: int = 1024, method: str = "sample",
            **kwargs) -> torch.Tensor:
    """Monte Carlo predictive: class probabilities ``(S, N, C)`` or regression means ``(S, N, D)``.

    Parameters
    ----------
    model, guide
        A trained model and guide.
    x : Tensor, shape (N, ...)
        Inputs.
    num_samples : int
        Posterior draws S.
    batch_size : int
        Inputs per forward pass (bounds memory).
    method : str
        ``"sample"`` (Monte Carlo from the guide); other methods are delegated to
        ``guide.predict`` (e.g. Laplace's ``"glm"``).

    Returns
    -------
    Tensor
        ``(S, N, C)`` probabilities (for ``"bernoulli"``, ``(S, N, D)`` success
        probabilities) or ``(S, N, D)`` predictive means for regression.
    """
    if method != "sample":
        return guide_contract(guide).predict(model, x, method=method, num_samples=num_samples,
                                             batch_size=batch_size, **kwargs)
    out = predictive_samples(model, guide, x, num_samples, batch_size, **kwargs)
    return out.probs if out.probs is not None else out.loc


def evaluate(model, guide, x, y, num_samples: int = 64, batch_size: int = 1024, method: str = "sample",
             num_bins: int = 15, **kwargs) -> dict:
    """Test metrics of the posterior predictive.

    Classification: ``accuracy``, ``nll``, ``ece`` (``num_bins`` equal-width bins),
    ``brier``.  Regression: ``rmse``, ``nll`` (Gaussian mixture), ``coverage_95``.
    """
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if len(y) != len(x):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    if method != "sample":
        out = predict(model, guide, x, num_samples, batch_size, method=method, **kwargs)
        kind, noise = _predictive_likelihood(model, guide)
        if kind == "gaussian":  # draws of the (linearised) function, (S, N, D)
            out = out if out.dim() == 3 else out.unsqueeze(0)
            return metrics.regression_metrics(out.cpu(), noise.detach().cpu(),
                                              y.reshape(out.shape[1:]).to(out.dtype).cpu())
        if out.dim() == 2:
            out = out.unsqueeze(0)
        if kind == "bernoulli":  # success probabilities (S, N, 1) -> two classes, as below
            p1 = out.reshape(out.shape[0], -1)
            out, y = torch.stack([1 - p1, p1], -1), y.reshape(-1).long()
        return metrics.classification_metrics(out.cpu(), y.cpu(), num_bins)
    out = predictive_samples(model, guide, x, num_samples, batch_size, **kwargs)
    y = y.to(out.probs.device if out.probs is not None else out.loc.device)
    if out.kind == "categorical":
        _check_labels(y, out.probs.shape[-1])
        return metrics.classification_metrics(out.probs, y, num_bins)
    if out.kind == "bernoulli":
        p1 = out.probs.reshape(out.probs.shape[0], -1)
        probs = torch.stack([1 - p1, p1], -1)
        return metrics.classification_metrics(probs, y.reshape(-1).long(), num_bins)
    return metrics.regression_metrics(out.loc, out.scale, y.reshape(out.loc.shape[1:]).to(out.loc.dtype))


def _check_labels(y, num_classes):
    if y.is_floating_point():
        raise TypeError(f"class labels must be integers, got dtype {y.dtype}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes - 1}], got [{int(y.min())}, {int(y.max())}]")


def _predictive_likelihood(model, guide) -> tuple[str | None, torch.Tensor | None]:
    """``(kind, Gaussian σ)`` of a guide's non-Monte-Carlo predictive: from the model's
    likelihood, else (hand-written models) from the guide (``BNNGuide.likelihood_kind``)."""
    lik = getattr(model, "likelihood", None)
    if isinstance(lik, Gaussian):
        return "gaussian", lik.noise
    if lik is not None:
        return lik.name, None
    return guide_contract(guide).likelihood_kind() or (None, None)
