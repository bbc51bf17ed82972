"""The Laplace guide under Pyro handlers around its model (``pyro.condition``,
``poutine.block``, ``poutine.scale``).

The curvature, the evidence and the GLM predictive run the *unwrapped* network with every
latent held fixed (:mod:`pyro_bnn.curvature.network`).  So what the handlers do to the model
is read once, when the guide is set up, and applied there:

* a latent the model is conditioned on (``pyro.condition(model, data={"sigma": v})``) is
  held at its value ``v``;
* a latent that ``poutine.block`` hides from the guide is held at the median of the guide
  that owns it in an :class:`~pyro.infer.autoguide.AutoGuideList` (AutoDelta: its point
  estimate; AutoNormal: its median, a plug-in value); without such a guide the model draws it
  from its prior on every run, which a Laplace approximation cannot hold: a clear error;
* a log-density scale ``s`` (``poutine.scale(model, s)`` scales every site, Pyro's
  semantics) makes the guide the Laplace approximation of ``p(y, θ)^s``: the prior precision,
  the curvature and the log-likelihood are scaled by ``s`` and the evidence is
  ``log ∫ p(y, θ)^s dθ``.
"""

from __future__ import annotations

import pyro
import torch
from pyro.poutine.util import site_is_subsample

from ...contract.local_params import unwrap_model
from ...model.modes import evaluation_mode

__all__ = ["read_handlers", "held_values"]


def read_handlers(guide, sites: dict, args, kwargs):
    """``(conditioned values, hidden sites, prior scale, likelihood scale)`` of ``guide``'s model.

    Traces the model as given and the network under the handlers with the set-up call's
    arguments (no gradients, the caller's random streams kept, the sample sites hidden from
    outer handlers).  A latent of the network outside ``sites`` (the guide's own) is
    *conditioned* when the model as given observes it, *hidden* when it does not appear.

    Raises
    ------
    ValueError
        A hidden latent and no ``AutoGuideList`` around the guide (nobody owns it); latent
        sites with different scales, or a scale that is not a scalar.
    """
    given = guide._wrapped[0]
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None

    def per_datum(site):
        return x is not None and any(f.vectorized and f.size == len(x) for f in site["cond_indep_stack"])

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    # sample sites hidden from outer handlers (a guide trace); param sites still reach the
    # global-param bridge of local_params; eval mode: BatchNorm statistics left as they are
    hide = pyro.poutine.block(hide_types=["sample", "observe"])
    with torch.no_grad(), hide, torch.random.fork_rng(devices=devices), evaluation_mode(unwrap_model(given)):
        wrapped = pyro.poutine.trace(given).get_trace(*args, **kwargs)
        base = wrapped if guide.base_model is given else \
            pyro.poutine.trace(guide.base_model).get_trace(*args, **kwargs)
    conditioned, hidden = {}, []
    for name, site in base.nodes.items():
        if (site["type"] != "sample" or site["is_observed"] or site_is_subsample(site) or name in sites
                or name == guide.obs_site or per_datum(site)):
            continue
        node = wrapped.nodes.get(name)
        if node is None or node["type"] != "sample":
            hidden.append(name)
        elif node["is_observed"]:
            conditioned[name] = node["value"].detach()
    if hidden and guide.master is None:
        raise ValueError(
            f"the Laplace guide's model is handler-wrapped and hides the latent site(s) {hidden} from it "
            "(poutine.block), and no other guide owns them: the model then draws them from their prior "
            "on every run. Laplace computes its curvature, evidence and GLM predictive with every "
            "other latent held fixed, so they would be redrawn from its prior there. Either let another "
            "guide own them in an AutoGuideList (e.g. AutoDelta(poutine.block(model, expose=[...])); "
            "Laplace then holds them at that guide's median), give them a value with pyro.condition, "
            "or do not hide them: sites outside subset= are point estimates of the Laplace guide")
    prior, likelihood = _scales(wrapped, sites, set(conditioned), guide.obs_site, per_datum)
    return conditioned, hidden, prior, likelihood


def _scalar(value, name) -> float:
    value = torch.as_tensor(value)
    if value.numel() != 1:
        raise ValueError(f"Laplace supports a scalar log-density scale (poutine.scale(model, s)); "
                         f"site {name!r} has a scale of shape {tuple(value.shape)}")
    return float(value)


def _scales(wrapped, sites: dict, conditioned: set, obs_site, per_datum) -> tuple[float, float]:
    """``(prior scale, likelihood scale)`` from a trace of the model as given: the scale of
    the guide's latent sites (one for all) and of the observation without the subsampling
    factor of its plates (the prior scale when the observation cannot be told)."""
    latent = {name: _scalar(wrapped.nodes[name]["scale"], name) for name in sites if name in wrapped.nodes}
    if len(set(latent.values())) > 1:
        raise ValueError(f"Laplace needs one log-density scale for all its latent sites (poutine.scale "
                         f"around the whole model), got {latent}")
    prior = next(iter(latent.values()), 1.0)
    names = [obs_site] if obs_site in wrapped.nodes else \
        [name for name, node in wrapped.nodes.items()
         if node["type"] == "sample" and not site_is_subsample(node) and name not in sites
         and name not in conditioned and (node["is_observed"] or per_datum(node))]
    if len(names) != 1:     # hidden or not single: the curvature names the problem
        return prior, prior
    node = wrapped.nodes[names[0]]
    subsampling = 1.0
    for frame in node["cond_indep_stack"]:
        if frame.vectorized and frame.full_size is not None and frame.size:
            subsampling *= frame.full_size / frame.size
    return prior, _scalar(node["scale"], names[0]) / subsampling


def held_values(guide) -> dict[str, torch.Tensor]:
    """The latents outside ``guide`` that its network runs with: the values the model is
    conditioned on, and for the sites ``poutine.block`` hides from it the medians of the other
    guides of its ``AutoGuideList``, on the guide's device.  Call outside ``local_params``
    (another guide's parameters are read as that guide keeps them).

    Raises
    ------
    ValueError
        No other guide of the list gives a median for a hidden site (the list is not set up
        yet, or no part owns it).
    """
    held = dict(guide._conditioned_values)
    if guide._hidden_sites:
        master = guide.master() if guide.master is not None else None
        medians = {}
        for part in (master if master is not None else []):
            if part is guide:
                continue
            try:
                medians.update(part.median())
            except (AttributeError, NotImplementedError, TypeError):
                continue        # not set up yet, or a guide without a median
        missing = [name for name in guide._hidden_sites if name not in medians]
        if missing:
            raise ValueError(
                f"the Laplace guide holds the site(s) {missing}, hidden from it by poutine.block, at "
                "the median of the AutoGuideList guide that owns them, but no other guide of its "
                "AutoGuideList gives a median for them (is the list set up, e.g. by one SVI step, and "
                "does a part such as AutoDelta/AutoNormal(poutine.block(model, expose=[...])) own them?)")
        held.update({name: medians[name] for name in guide._hidden_sites})
    like = next(iter(guide.theta.values()))
    return {k: torch.as_tensor(v).detach().to(like.device) for k, v in held.items()}
