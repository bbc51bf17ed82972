"""Posterior draws shared by the uncertainty tools (pruning, OOD, FGSM, active learning).

Draws and evaluations run in eval mode (:func:`pyro_bnn.posterior.prediction.evaluation_mode`, through
``sample_latents`` and ``params_under``).  Only public guide behaviour is used: joint draws come from
:func:`pyro_bnn.posterior.prediction.sample_latents`, so every guide (mean-field, Laplace, hypernet,
symmetrised, Pyro's autoguides) works.  Draws are kept as a list of ``{site: value}``
dicts so that several evaluations can reuse the *same* weights (common random numbers):
accuracy-vs-ε or accuracy-vs-angle curves then differ only through the inputs.
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoNormal

from ..arguments import check_int
from ..contract.guide import guide_contract
from ..contract.local_params import local_params
from ..model.bnn import example_input, is_bnn
from .prediction import params_under, sample_latents

__all__ = ["draw_latents", "probs_from_latents", "site_moments"]


def draw_latents(model, guide, x: torch.Tensor, *, num_samples: int) -> list[dict[str, torch.Tensor]]:
    """``num_samples`` joint posterior draws ``[{site: value}, ...]`` (detached)."""
    num_samples = check_int("num_samples", num_samples, 1)
    with local_params(model, guide), torch.no_grad():
        return [{k: v.detach() for k, v in sample_latents(model, guide, x[:1], check_plates=i == 0).items()}
                for i in range(num_samples)]


def probs_from_latents(model, latents: list[dict], x: torch.Tensor, *, batch_size: int = 1024,
                       grad: bool = False, obs_site: str = "obs") -> torch.Tensor:
    """Class probabilities ``(S, N, C)`` of the network under each draw in ``latents``.

    With ``grad=True`` the computation is differentiable with respect to ``x`` (used by
    FGSM); otherwise it runs under ``torch.no_grad``.
    """
    out = []
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx, local_params(model):
        for values in latents:
            kind, params = params_under(model, values, x, batch_size, obs_site)
            if kind != "categorical":
                raise ValueError(f"expected a categorical likelihood (class probabilities), "
                                 f"got a {kind!r} model")
            out.append(params["probs"])
    return torch.stack(out)


def site_moments(model, guide, x: torch.Tensor | None = None, *, num_samples: int = 200
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """Marginal posterior mean and standard deviation of every latent site.

    Sources, in order of preference:

    1. ``guide.loc_and_scale(site)`` of a guide whose contract declares ``normal_per_site``
       (MeanField and guides built on it): exact μ, σ;
    2. Pyro's ``AutoNormal`` whose sites are all real-valued: exact, from its public
       ``quantiles`` (σ = q(Φ(1)) − q(½)); for a constrained site (a ``LogNormal`` noise scale)
       those are the median and a quantile gap of a transformed Normal, not its mean and std
       (1.0 for a mean of 1.38), so such a guide takes the draws below;
    3. otherwise the empirical mean and (biased) std of ``num_samples`` joint draws from
       the guide (hypernetwork, Laplace, low-rank, ``AutoDelta``...).  The Monte Carlo
       relative error of σ is about ``1/sqrt(2 num_samples)`` (5% at 200 draws).

    Returns
    -------
    mean, std : dict[str, Tensor]
        Site-shaped tensors.
    source : str
        ``"loc_and_scale"``, ``"quantiles"`` or ``"samples"``.
    """
    names = list(model.site_names) if is_bnn(model) else None
    if guide_contract(guide).normal_per_site and names is not None:
        mean, std = {}, {}
        with torch.no_grad():
            for name in names:
                loc, scale = guide.loc_and_scale(name)
                mean[name], std[name] = loc.detach().clone(), scale.detach().clone()
        return mean, std, "loc_and_scale"
    if isinstance(guide, AutoNormal) and _real_sites_only(guide):
        z = 0.5 * (1.0 + math.erf(1.0 / math.sqrt(2.0)))  # Φ(1)
        with torch.no_grad(), local_params(guide):
            q = guide.quantiles([0.5, z])
        mean = {k: v[0].detach().clone() for k, v in q.items()}
        std = {k: (v[1] - v[0]).detach().clone() for k, v in q.items()}
        return mean, std, "quantiles"
    if x is None:
        x = example_input(model)
    draws = draw_latents(model, guide, x, num_samples=num_samples)
    mean, std = {}, {}
    for name in draws[0]:
        stack = torch.stack([d[name] for d in draws])
        mean[name] = stack.mean(0)
        std[name] = stack.std(0, unbiased=False)
    return mean, std, "samples"


def _real_sites_only(guide) -> bool:
    """Whether every latent site of a set-up autoguide is real-valued (its Normal is not pushed
    through a constraining transform)."""
    trace = guide.prototype_trace
    if trace is None:
        return False
    for _, site in trace.iter_stochastic_nodes():
        support = site["fn"].support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        if support is not constraints.real:
            return False
    return True
