"""The one place that knows how to run a model with given weights and read its likelihood.

* :class:`pyro_bnn.BNN`: the weights go into the ``PyroModule`` sample cache
  (:meth:`pyro_bnn.BNN.run_with`) and ``f = model.function(x)``.
* A hand-written ``PyroModule`` model: it is traced conditioned on the weights and ``f``
  is read from the observed site's distribution (``logits`` of a Categorical/Bernoulli,
  ``loc`` of a Normal, whose fixed ``scale`` becomes the noise).
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample

from ..model.bnn import is_bnn
from ..model.likelihoods import distribution_kind, kind_and_noise

__all__ = ["network_output", "likelihood_kind", "hessian_columns", "nll_residual", "log_likelihood_terms"]


def _obs_distribution(model, values, x, obs_site=None):
    """The observation's distribution under ``values``: the site ``obs_site``, or the single
    sample site of the model that is not a latent in ``values`` (its observed site, whatever
    its name)."""
    tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x, None)
    samples = [name for name, node in tr.nodes.items()
               if node["type"] == "sample" and name not in values and not site_is_subsample(node)
               and not node["infer"].get("is_auxiliary", False)]
    if obs_site is None:
        if len(samples) != 1:
            raise ValueError(f"expected the model to have one observed site (a sample site that is not a "
                             f"latent weight), got {len(samples)}: {samples}; name it with "
                             "Laplace(..., obs_site=...)")
        obs_site = samples[0]
    if obs_site not in tr.nodes or tr.nodes[obs_site]["type"] != "sample":
        raise ValueError(f"model has no observed site {obs_site!r}; its sample sites that are not latent "
                         f"weights: {samples}")
    d = tr.nodes[obs_site]["fn"]
    while isinstance(d, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        d = d.base_dist
    return d


def network_output(model, values: dict, x: torch.Tensor, obs_site: str | None = None) -> torch.Tensor:
    """Network output ``f`` (logits or regression mean), shape ``(M, C)``, under ``values``
    (a hand-written model's 1-D Normal/Bernoulli observation of shape ``(M,)`` gives ``(M, 1)``;
    its observed site is ``obs_site`` or, by default, its single non-latent sample site)."""
    if is_bnn(model):
        return model.run_with(values, x)
    d = _obs_distribution(model, values, x, obs_site)
    if isinstance(d, dist.Categorical):
        return d.logits
    if isinstance(d, (dist.Bernoulli, dist.Normal)):
        f = d.logits if isinstance(d, dist.Bernoulli) else d.loc
        return f.unsqueeze(-1) if f.dim() == 1 else f      # 1-D obs (N,): one output, (N, 1)
    raise TypeError(f"Laplace supports Categorical, Bernoulli or Normal observations, got {type(d).__name__}")


def likelihood_kind(model, values: dict, x: torch.Tensor,
                    obs_site: str | None = None) -> tuple[str, torch.Tensor | None]:
    """``("categorical" | "bernoulli" | "gaussian", σ or None)``; ``σ`` keeps its graph."""
    if is_bnn(model):
        kind, noise = kind_and_noise(model.likelihood)
        if kind is None:
            raise TypeError("Laplace supports categorical, bernoulli and gaussian likelihoods, "
                            f"got {model.likelihood.name!r}")
        return kind, noise
    with torch.no_grad():
        d = _obs_distribution(model, values, x, obs_site)
    kind = distribution_kind(d)
    if kind in ("categorical", "bernoulli"):
        return kind, None
    if kind == "gaussian":
        scale = d.scale.detach()
        if scale.numel() > 1 and not torch.allclose(scale, scale.flatten()[0]):
            raise ValueError("Laplace needs one observation noise σ for all outputs of a hand-written model")
        return "gaussian", scale.flatten()[0]
    raise TypeError(f"Laplace supports Categorical, Bernoulli or Normal observations, got {type(d).__name__}")


def hessian_columns(kind: str, f: torch.Tensor) -> torch.Tensor:
    """``L`` with ``Λ = −∇²_f log p(y|f) = L Lᵀ``, shape ``(M, C, C)`` (exact, C columns).

    Categorical: ``Λ = diag(p) − ppᵀ = (diag(√p) − p√pᵀ)(diag(√p) − √p pᵀ)``.
    Bernoulli: ``diag(√(p(1−p)))``.  Gaussian: ``I`` (the ``1/σ²`` is applied as a scale
    outside, so the noise can be learned without refitting).
    """
    f2 = f.reshape(len(f), -1)
    if kind == "categorical":
        p = torch.softmax(f2, -1)
        s = p.sqrt()
        return torch.diag_embed(s) - p.unsqueeze(-1) * s.unsqueeze(-2)
    if kind == "bernoulli":
        p = torch.sigmoid(f2)
        return torch.diag_embed((p * (1 - p)).sqrt())
    if kind == "gaussian":
        return torch.eye(f2.shape[-1], dtype=f.dtype, device=f.device).expand(len(f2), -1, -1)
    raise ValueError(f"unknown likelihood kind {kind!r}")


def nll_residual(kind: str, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``r = ∂(−log p(y|f))/∂f``, shape ``(M, C)``, so that ``Σ_n J_nᵀ r_n`` is the gradient of
    the negative log-likelihood: ``softmax(f) − onehot(y)`` (categorical), ``sigmoid(f) − y``
    (Bernoulli), ``f − y`` (Gaussian, with ``Λ = I`` as :func:`hessian_columns`: times
    ``1/σ²`` outside).  ``y`` as :func:`~pyro_bnn.data.batches.as_targets` gives it."""
    f2 = f.reshape(len(f), -1)
    if kind == "categorical":
        return torch.softmax(f2, -1) - torch.nn.functional.one_hot(y.reshape(-1), f2.shape[-1]).to(f2.dtype)
    if kind == "bernoulli":
        return torch.sigmoid(f2) - y.reshape(f2.shape).to(f2.dtype)
    if kind == "gaussian":
        return f2 - y.reshape(f2.shape).to(f2.dtype)
    raise ValueError(f"unknown likelihood kind {kind!r}")


def identity_columns(f: torch.Tensor) -> torch.Tensor:
    """``I`` of shape ``(M, C, C)``: pulls back every output (the full Jacobian)."""
    f2 = f.reshape(len(f), -1)
    return torch.eye(f2.shape[-1], dtype=f.dtype, device=f.device).expand(len(f2), -1, -1)


def log_likelihood_terms(kind: str, f: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sufficient statistics of ``Σ_n log p(y_n|f_n)``: ``{"loglik"}`` or, Gaussian,
    ``{"sse", "count"}`` so that ``log p = −sse/(2σ²) − count·log(σ√(2π))`` stays a
    function of σ."""
    if kind == "categorical":
        return {"loglik": -torch.nn.functional.cross_entropy(f, y, reduction="sum")}
    if kind == "bernoulli":
        return {"loglik": -torch.nn.functional.binary_cross_entropy_with_logits(
            f, y.reshape(f.shape).to(f.dtype), reduction="sum")}
    r = f - y.reshape(f.shape).to(f.dtype)
    return {"sse": (r ** 2).sum(), "count": torch.tensor(float(r.numel()), dtype=f.dtype, device=f.device)}
