"""Empirical-Bayes prior scales for a mean-field guide: the ELBO-optimal ``N(m, s²)`` per site.

For ``q(w) = Π_i N(μ_i, σ_i²)`` over the ``n`` weights of one site and the prior ``N(m, s²)``
on each of them, the only term of the ELBO that depends on ``s`` is ::

    −KL(q‖p) = −Σ_i [log s − log σ_i + (σ_i² + (μ_i − m)²) / (2 s²) − 1/2],

which is maximised at ::

    s² = (1/n) Σ_i [(μ_i − m)² + σ_i²].

Setting each site's ``s`` to it raises the ELBO at fixed ``q`` by exactly
``KL(q‖p_old) − KL(q‖p_new) ≥ 0``; alternating it with gradient steps on ``q`` is coordinate
ascent on the ELBO in ``(q, s)`` — type-II maximum likelihood of the prior scales under the
variational bound (MacKay's evidence update, with ``q`` in place of the Laplace posterior).
The bound it reports is then the ELBO of the model with the learned scales.
"""

from __future__ import annotations

import torch

from ..model.bnn import is_bnn, normal_prior_params, site_prior_modules
from ..model.priors import IIDNormal

__all__ = ["optimal_normal_scale", "update_prior_scales_", "own_normal_priors_"]


def optimal_normal_scale(loc: torch.Tensor, scale: torch.Tensor, prior_loc: torch.Tensor | float = 0.0
                         ) -> torch.Tensor:
    """The prior scale ``s`` that maximises the ELBO of one site at a fixed mean-field ``q``.

    ``s = sqrt(mean((μ − m)² + σ²))`` over the site's elements (module docstring).

    Parameters
    ----------
    loc, scale : Tensor
        ``μ`` and ``σ`` of ``q``, one shape (any).
    prior_loc : Tensor or float
        The prior mean ``m`` (kept fixed), broadcastable to ``loc``.

    Returns
    -------
    Tensor
        0-d, the optimal scale.

    Examples
    --------
    >>> optimal_normal_scale(torch.tensor([3.0, 0.0]), torch.tensor([1.0, 1.0]))
    tensor(2.4495)
    """
    if loc.shape != scale.shape:
        raise ValueError(f"loc and scale must have one shape, got {tuple(loc.shape)} and {tuple(scale.shape)}")
    return ((loc - prior_loc) ** 2 + scale ** 2).mean().sqrt()


def own_normal_priors_(model) -> None:
    """Give every site of ``model`` its own :class:`~pyro_bnn.model.priors.IIDNormal` with the
    loc and scale it has now (no value changes), so that each can be learned on its own.

    A site that already owns an ``IIDNormal`` keeps it.

    Raises
    ------
    ValueError
        ``model`` is not a :class:`pyro_bnn.BNN`, or a site's prior is not an i.i.d. Normal
        with one loc and one scale (e.g. ``ScaleMixture``).
    """
    if not is_bnn(model) or not hasattr(model, "set_prior_"):
        raise ValueError(f"learned prior scales need a pyro_bnn.BNN model, got {type(model).__name__}")
    modules = site_prior_modules(model)
    users: dict[int, int] = {}
    for prior in modules.values():
        users[id(prior)] = users.get(id(prior), 0) + 1
    for site, prior in modules.items():
        params = normal_prior_params(model, site)
        if params is None or params[0].numel() != 1 or params[1].numel() != 1:
            raise ValueError(
                f"learned prior scales need an i.i.d. Normal prior with one loc and one scale on every site "
                f"(IIDNormal or FanInNormal); site {site!r} has {prior!r}")
        if isinstance(prior, IIDNormal) and users[id(prior)] == 1:
            continue
        loc, scale = params
        model.set_prior_(site, IIDNormal(scale=float(scale), loc=float(loc)))


@torch.no_grad()
def update_prior_scales_(model, guide) -> dict[str, float]:
    """Set every site's prior scale to :func:`optimal_normal_scale` of the guide's ``q`` (in
    place; the prior means stay).

    Parameters
    ----------
    model : pyro_bnn.BNN
        Its sites' priors must be i.i.d. Normal (see :func:`own_normal_priors_`, called first).
    guide : MeanField
        Set up (after one ``guide(x, y)`` or a ``pb.fit``); read through ``loc_and_scale``.

    Returns
    -------
    dict
        ``{site: new scale}``.
    """
    problem = guide.prediction_problem()  # None once the guide's sites and parameters exist
    if problem is not None:
        raise RuntimeError(f"update_prior_scales_ needs the guide set up first (call guide(x, y) once "
                           f"or pyro_bnn.fit, so its sites are known): {problem}")
    own_normal_priors_(model)
    modules = site_prior_modules(model)
    new = {}
    for site in model.site_names:
        loc, scale = guide.loc_and_scale(site)
        prior = modules[site]
        s = optimal_normal_scale(loc.detach(), scale.detach(), prior.loc)
        prior.scale.copy_(s.to(prior.scale))
        new[site] = float(s)
    return new
