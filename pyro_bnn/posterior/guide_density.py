"""Per-draw log-density ``log q(θ)`` of any Pyro guide.

The approximate-posterior correction of PSIS-LOO (``az.loo_approximate_posterior``) and
Monte Carlo ELBO estimates need, for each joint draw ``θ_s ~ q``, the value ``log q(θ_s)``.
Three ways to get it, in order of preference:

1. **The guide's own hook** ``guide.log_density(values) -> Tensor`` (0-d): guides whose Pyro
   trace does not carry the density (a Laplace guide that samples ``θ* + L ε`` through
   ``Delta`` sites, a hypernetwork whose weights are a deterministic function of noise)
   implement it; see :mod:`pyro_bnn.contract.guide`.
2. **The trace of the draw itself** (:func:`sample_with_log_density`): the sum of
   ``log_prob`` over every sample site of the guide's trace, auxiliary sites included.
   For Pyro's ``AutoNormal`` (and :class:`~pyro_bnn.guides.MeanField`) that is
   ``log N(u | μ, σ²) + log|∂u/∂θ|``; for ``AutoDelta`` it is 0 (a point mass).
3. **Evaluating at given values** (:func:`guide_log_density`): closed form for the
   ``AutoNormal`` family and ``AutoDelta``; otherwise the guide is replayed conditioned on
   the values, which is exact when the guide has no auxiliary (non-model) latent sites.
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.transforms import biject_to
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoDelta, AutoNormal
from pyro.poutine.util import site_is_subsample

from ..contract.guide import guide_contract
from ..contract.local_params import local_params
from ..contract.pyro_objective import call_model
from ..model.modes import evaluation_mode

__all__ = ["sample_with_log_density", "guide_log_density", "guide_args", "latent_values",
           "check_global_latents"]


def guide_args(model, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """Arguments with which a guide of ``model`` is called for inputs ``x``."""
    args, kwargs, _ = call_model(model, x, y, len(x))
    return args, kwargs


def _is_latent(node) -> bool:
    return (node["type"] == "sample" and not node["is_observed"] and not site_is_subsample(node)
            and not node["infer"].get("is_auxiliary", False))


def latent_values(trace) -> dict[str, torch.Tensor]:
    """``{site: value}`` of the latent model sites in a guide trace.

    Left out: observed sites, auxiliary sites and the index sites that subsampling plates
    record (``pyro.plate("data", N, subsample_size=M)`` samples ``M`` indices as a site named
    ``"data"``): conditioning a model on the guide's indices would pin its plate to the
    guide's subsample size.
    """
    return {name: node["value"] for name, node in trace.nodes.items() if _is_latent(node)}


def check_global_latents(trace) -> None:
    """Raise ``ValueError`` if a latent site of ``trace`` lies in a subsampled plate.

    Such a site is *local*: the guide holds one value per training point (Pyro broadcasts a
    site sampled inside ``pyro.plate("data", N, subsample_size=M)`` over the plate, which is
    also what happens to a ``PyroSample`` attribute first read inside the plate), so it has
    no value for new inputs and a predictive for them is undefined.
    """
    local = {}
    for name, node in trace.nodes.items():
        if _is_latent(node):
            for frame in node["cond_indep_stack"]:
                if frame.vectorized and frame.full_size not in (None, frame.size):
                    local[name] = frame
    if local:
        name, frame = next(iter(local.items()))
        raise ValueError(
            f"latent sites {sorted(local)} are sampled inside the subsampled plate {frame.name!r} "
            f"(size {frame.full_size}, {frame.size} per batch), so the guide holds one value per "
            "training point: they are local latent variables with no value for new inputs, and "
            "prediction needs global ones. If they are meant to be global weights, sample them "
            "outside the plate: read PyroSample attributes before `with pyro.plate(...)` (e.g. "
            "`w, b = self.w, self.b` above it; inside the plate Pyro broadcasts them over the data) "
            "and train again")


def sample_with_log_density(model, guide, x: torch.Tensor, y: torch.Tensor | None = None
                            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One joint draw ``θ ~ q`` and its log-density ``log q(θ)``.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model the guide approximates (only used to choose the guide's arguments).
    guide : Pyro guide
        A trained guide.
    x, y : Tensor
        A (small) batch of inputs/targets to call the guide with; global weights do not
        depend on it.

    Returns
    -------
    values : dict[str, Tensor]
        ``{site: value}`` for every latent model site.
    log_q : Tensor, shape ()
        ``log q(θ)``: the guide's ``log_density(values)`` hook if it has one, else the
        summed ``log_prob`` of the draw's own trace (auxiliary sites included).
    """
    args, kwargs = guide_args(model, x, y)
    with local_params(model, guide), evaluation_mode(model, guide):
        trace = poutine.trace(poutine.block(guide, hide_types=["param"])).get_trace(*args, **kwargs)
        check_global_latents(trace)
        values = latent_values(trace)
        log_q = guide_contract(guide).log_density(values)
        if log_q is None:
            log_q = trace.log_prob_sum()
    return values, torch.as_tensor(log_q).reshape(())


def guide_log_density(guide, values: dict[str, torch.Tensor], model=None,
                      x: torch.Tensor | None = None) -> torch.Tensor:
    """``log q(θ)`` of ``guide`` at given latent ``values``.

    Parameters
    ----------
    guide : Pyro guide
        A trained guide.
    values : dict[str, Tensor]
        ``{site: value}`` for every latent site of the guide.
    model, x : optional
        Needed only for guides without a closed form here (they are replayed with
        ``guide(x, None)``).

    Returns
    -------
    Tensor, shape ()

    Raises
    ------
    TypeError
        The guide has auxiliary latent sites and no ``log_density`` hook, so its density
        at arbitrary values is unknown.
    """
    own = guide_contract(guide).log_density(values)
    if own is not None:
        return torch.as_tensor(own).reshape(())
    if isinstance(guide, AutoDelta):
        return torch.zeros(())
    if isinstance(guide, AutoNormal) and guide.prototype_trace is not None:
        return _autonormal_log_density(guide, values)
    if x is None:
        raise TypeError(f"{type(guide).__name__} has no closed-form density here; pass model= and x= "
                        "so it can be replayed, or give the guide a log_density(values) method")
    args, kwargs = guide_args(model, x)
    with local_params(*(m for m in (model, guide) if m is not None)), evaluation_mode(model, guide):
        trace = poutine.trace(poutine.condition(poutine.block(guide, hide_types=["param"]), data=values)
                              ).get_trace(*args, **kwargs)
    aux = [n for n, s in trace.nodes.items() if s["type"] == "sample" and s["infer"].get("is_auxiliary")]
    if aux:
        raise TypeError(
            f"{type(guide).__name__} samples auxiliary sites {aux}; its density at given values "
            "needs a guide.log_density(values) method (see pyro_bnn.contract.guide)")
    return trace.log_prob_sum().reshape(())


def _autonormal_log_density(guide, values) -> torch.Tensor:
    """``Σ_sites log N(u | μ, σ²) + log|∂u/∂θ|`` with ``u = T⁻¹(θ)`` (AutoNormal's family)."""
    total = torch.zeros(())
    with local_params(guide):
        for name, site in guide.prototype_trace.iter_stochastic_nodes():
            if name not in values:
                raise ValueError(f"values lack site {name!r}; got {sorted(values)}")
            value = values[name]
            transform = biject_to(site["fn"].support)
            u = transform.inv(value)
            loc, scale = guide._get_loc_and_scale(name)
            event_dim = guide._event_dims[name]
            lp = dist.Normal(loc, scale).to_event(event_dim).log_prob(u)
            ladj = transform.inv.log_abs_det_jacobian(value, u)
            ladj = sum_rightmost(ladj, ladj.dim() - value.dim() + site["fn"].event_dim)
            total = total.to(lp.device) + lp.sum() + ladj.sum()
    return total
