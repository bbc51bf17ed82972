"""``to_arviz``: posterior draws of any guide as an ArviZ 1.x ``DataTree``.

Groups (``S`` draws from the guide, one chain, ``N`` observations):

``posterior``
    Parameter draws, dims ``(chain, draw, *site dims)``, in the model's precision (float64
    draws stay float64; others are stored as float32).  Linear/Conv weights of a
    :class:`~pyro_bnn.BNN` get named dims (``net.0.out``, ``net.0.in``, ``net.0.k0`` ...),
    biases share their layer's ``out`` dim; other sites get ``<site>_dim_<i>``.
``log_likelihood``
    Pointwise ``log p(y_n | x_n, θ_s)`` of the observed site ``obs``, dims
    ``(chain, draw, obs_id)`` — what ``az.loo`` / ``az.compare`` read.
``posterior_predictive``
    ``y_n ~ p(y | x_n, θ_s)``, one replicate per draw.
``observed_data``
    The targets ``y``.
``sample_stats``
    ``lp`` = ``log p(θ_s, y) = log p(θ_s) + Σ_n log p(y_n | x_n, θ_s)`` (ArviZ's name for the
    unnormalised log posterior; computed on the data passed in), ``log_prior`` and
    ``log_q`` = ``log q(θ_s)`` (:mod:`pyro_bnn.posterior.guide_density`).

ArviZ has no fixed group for the densities of an approximate posterior: its
``loo_approximate_posterior(data, log_p, log_q)`` takes them as arguments.  We store them in
``sample_stats`` and :func:`loo_approximate` passes them::

    az.loo_approximate_posterior(dt, log_p=dt["sample_stats"]["lp"],
                                 log_q=dt["sample_stats"]["log_q"])

LOO estimates the predictive density of each observation *left out of the data the
posterior was fitted to*, so call ``to_arviz`` with the training data for ``az.loo`` /
``loo_approximate_posterior``; on held-out data the ``log_likelihood`` group gives the
test log predictive density instead.

Linearised (GLM) draws of a Laplace guide (``predictive="glm"``, its default)
    The groups describe the predictive the Laplace guide is evaluated with
    (``pb.predict(..., predictive="glm")``), so its ELPD is comparable with other guides'.
    Each draw is a joint weight draw ``θ_s ~ q = N(θ*, P⁻¹)`` pushed through the
    *linearised* network ``f_lin(x; θ_s) = f(x; θ*) + J(x)(θ_s − θ*)`` (the generalised
    linear model whose Laplace posterior the GGN Laplace is, Immer et al. 2021): for each
    ``n`` the values ``f_lin(x_n; θ_s)`` are draws of the GLM's function-space Gaussian
    ``N(f*(x_n), Σ_f(x_n))``, and ``log_likelihood`` holds ``log p(y_n | f_lin(x_n; θ_s))``.
    ``posterior`` holds ``θ_s``; ``log_q = log N(θ_s | θ*, P⁻¹)`` over the Laplace sites;
    ``log_prior`` is the Gaussian prior the Laplace was built with — the guide's δ (as
    tuned by the evidence or a grid search) — plus the fixed prior of point-estimate sites;
    ``lp`` = ``log_prior`` + Σ_n ``log_likelihood``, the linearised model's log joint.  So
    ``loo_approximate_posterior`` importance-corrects ``q`` towards the exact posterior *of
    the linearised model* (with the guide's prior), a well-defined target; its Pareto
    ``k̂`` says how far ``q`` is from it.  It is not a statement about the nonlinear
    network's posterior (``predictive="sample"`` draws weights through the network itself,
    with the model's own prior in ``lp``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from pyro import poutine
from torch import nn
from torch.utils.data import DataLoader

from ..arguments import check_int
from ..contract.guide import guide_contract
from ..contract.local_params import local_params
from ..curvature import pointwise_log_likelihood, sample_observations
from ..data.prediction_data import prediction_data
from ..model.bnn import is_bnn, network_of
from ..model.devices import module_device
from ..model.likelihoods import log_likelihood
from ..model.modes import evaluation_mode
from ..training.seeding import seeded
from .batchnorm import batchnorm_recalibration
from .guide_density import sample_with_log_density
from .prediction import (
    check_inputs_first,
    default_predictive,
    predictive_name,
    resolve_predictive,
    whole_batch_plates,
)

__all__ = ["to_arviz", "loo_approximate", "psis_loo", "psis_loo_pointwise", "PsisPointwise", "pareto_k_threshold", "num_draws", "MIN_PSIS_DRAWS",
           "correction_ess", "site_dims", "default_predictive"]

OBS_DIM = "obs_id"


def site_dims(model, site: str, shape: Sequence[int]) -> list[str]:
    """Readable dim names for a parameter site (``net.0.weight`` -> ``[net.0.out, net.0.in]``)."""
    generic = [f"{site}_dim_{i}" for i in range(len(shape))]
    net = network_of(model)
    if net is None or not site.startswith("net."):
        return generic
    path, _, pname = site[4:].rpartition(".")
    try:
        module = net.get_submodule(path) if path else net
    except AttributeError:
        return generic
    layer = f"net.{path}" if path else "net"
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if pname == "weight" and len(shape) >= 2:
            return [f"{layer}.out", f"{layer}.in"] + [f"{layer}.k{i}" for i in range(len(shape) - 2)]
        if pname in ("bias", "weight_g") and len(shape) == 1:
            return [f"{layer}.out"]
    return generic


def _pointwise_bnn(model, values, x, y, batch_size, device, want_pp):
    loglik, pp = [], []
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size].to(device)
        yb = y[start:start + batch_size].to(device)
        f = model.run_with(values, xb)
        loglik.append(log_likelihood(model.likelihood, f, yb))
        if want_pp:
            pp.append(model.likelihood.distribution(f).sample())
    return torch.cat(loglik), (torch.cat(pp) if want_pp else None)


def _log_prior_bnn(model, values):
    return sum(model.site_prior(name).log_prob(values[name]).sum() for name in model.site_names)


def _pointwise_trace(model, values, x, y, batch_size, device, want_pp, obs_site):
    """Hand-written Pyro models: read ``obs_site``'s distribution from a conditioned trace."""
    loglik, pp, log_prior = [], [], None
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size].to(device)
        yb = y[start:start + batch_size].to(device)
        tr = poutine.trace(whole_batch_plates()(poutine.condition(model, data=values))).get_trace(xb, yb)
        if obs_site not in tr.nodes:
            raise ValueError(f"model has no observed site {obs_site!r}; sites: {list(tr.nodes)}")
        node = _unmasked_observation(tr, obs_site)
        d = node["fn"]
        lp = d.log_prob(node["value"])
        check_inputs_first(obs_site, lp.shape, len(xb))
        loglik.append(lp.reshape(len(xb), -1).sum(-1))
        if want_pp:
            pp.append(d.sample())
        if log_prior is None:
            log_prior = sum(n["fn"].log_prob(n["value"]).sum() for name, n in tr.nodes.items()
                            if n["type"] == "sample" and name in values)
    return torch.cat(loglik), (torch.cat(pp) if want_pp else None), log_prior


def _unmasked_observation(trace, obs_site: str) -> dict:
    """The trace node holding ``obs_site``'s observation; ``ValueError`` if any entry of it is
    masked out (Pyro's ``obs_mask``, ``poutine.mask``, ``Distribution.mask``): the pointwise
    log-likelihood would count a masked entry as 0, and LOO / WAIC would score placeholders."""
    node = trace.nodes[obs_site]
    split = f"{obs_site}_observed"
    if node["infer"].get("_deterministic") and split in trace.nodes:  # obs_mask: observed part
        node = trace.nodes[split]
    masks = [node["mask"], getattr(node["fn"], "_mask", None)]
    if any(m is False or (torch.is_tensor(m) and not bool(m.all())) for m in masks):
        raise ValueError(
            f"the observed site {obs_site!r} has masked-out entries (obs_mask, poutine.mask or "
            "Distribution.mask): pb.to_arviz would give them log-likelihood 0 and LOO/WAIC would "
            "score them; pass the observed examples only (x[mask], y[mask])")
    return node


#: Default cap on the posterior group: 2.5e8 values = 1 GB in float32 (2 GB for a float64 model).
MAX_POSTERIOR_VALUES = 250_000_000


def _posterior_array(value: torch.Tensor) -> np.ndarray:
    """A draw for the ``posterior`` group in the model's precision: float64 stays float64,
    everything else is stored as float32 (half precision upcast, as before)."""
    value = value.detach()
    return (value if value.dtype == torch.float64 else value.float()).cpu().numpy()


def _select_sites(values: dict, var_names, num_samples: int) -> list[str]:
    if var_names is None:
        total = num_samples * sum(v.numel() for v in values.values())
        if total > MAX_POSTERIOR_VALUES:
            sizes = {k: int(v.numel()) for k, v in values.items()}
            raise ValueError(
                f"storing all {len(values)} sites for {num_samples} draws needs {total:,} values "
                f"(> {MAX_POSTERIOR_VALUES:,}, 1 GB in float32); pass var_names= with the sites to keep "
                f"(sizes: {sizes}) — the log-likelihood and densities still use every site")
        return list(values)
    names = list(var_names)
    unknown = sorted(set(names) - set(values))
    if unknown:
        raise ValueError(f"var_names {unknown} are not latent sites; sites: {sorted(values)}")
    return names


@torch.no_grad()
def to_arviz(model, guide, x: torch.Tensor | DataLoader, y: torch.Tensor | None = None, *, num_samples: int = 200,
             var_names: Sequence[str] | None = None, batch_size: int = 1024,
             predictive: str | None = None, posterior_predictive: bool = True, obs_site: str = "obs",
             seed: int | None = None, device=None, bn_data=None):
    """Posterior draws, pointwise log-likelihood and densities as an ArviZ ``DataTree``.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model (on CPU or CUDA).
    guide : Pyro guide
        A trained guide: ``pb.guides.*``, Pyro autoguides, any guide with latent sites.
    x : Tensor, shape (N, ...), or DataLoader
        Inputs.  Use the training data for LOO (see the module docstring).  Or a ``DataLoader``
        yielding ``(x, y)`` batches (tuples or lists): read once, each batch checked as tensors
        are, and its examples used as tensors in the loader's order (``obs_id``), the same draws
        for every batch (same seed, same groups; :mod:`pyro_bnn.data.prediction_data`).
    y : Tensor, shape (N,) or (N, D), optional
        Targets of tensor ``x``; not with a loader (its batches hold them).
    num_samples : int
        Number of joint draws ``S`` from the guide.
    var_names : sequence of str, optional
        Parameter sites to store in ``posterior`` (default: all, unless that exceeds
        ``MAX_POSTERIOR_VALUES`` = 2.5e8 floats, which raises).  Pass a few sites for large
        networks: the group holds ``S × (size of the selected sites)`` floats (float64 for
        float64 draws, else float32).
        The log-likelihood and densities always use all sites.
    batch_size : int
        Inputs per forward pass; memory is bounded by one batch per draw.
    predictive : {"sample", "glm"}, optional
        ``"sample"``: draws of the guide through the network.  ``"glm"`` (Laplace guides):
        linearised draws, see the module docstring; the same Monte-Carlo GLM predictive as
        ``pb.evaluate(predictive="glm")`` (``"glm_probit"`` has no draws and is refused).
        Default: the guide's own predictive, as for :func:`pyro_bnn.evaluate`
        (``guide.default_predictive``: ``"glm"`` for :class:`~pyro_bnn.guides.Laplace`,
        else ``"sample"``).  ``attrs["method"]`` holds it, ``attrs["predictive"]`` names it
        (``"glm-mc(200)"``).
        The model and guide run in eval mode (see :mod:`pyro_bnn.posterior.prediction`).
    posterior_predictive : bool
        Also sample one replicate ``y`` per draw.
    obs_site : str
        Observed site of a hand-written Pyro model (a :class:`~pyro_bnn.BNN` uses ``obs``).
    seed : int, optional
        Seeds the draws (all random streams forked: the caller's streams are left as they were).
    device : optional
        Where to evaluate; default where the model's parameters are.
    bn_data : Tensor or iterable of batches, optional
        ``predictive="sample"`` on a :class:`~pyro_bnn.BNN` with BatchNorm layers: re-estimate
        their statistics under each draw from these inputs, as :func:`pyro_bnn.predict` does
        (:mod:`pyro_bnn.posterior.batchnorm`).

    Returns
    -------
    xarray.DataTree
        Groups ``posterior``, ``log_likelihood``, ``posterior_predictive``,
        ``observed_data``, ``sample_stats`` (``lp``, ``log_prior``, ``log_q``).

    Raises
    ------
    ValueError
        Bad ``num_samples``/``batch_size``, mismatched ``x``/``y``, unknown ``var_names`` or
        ``predictive``, or ``predictive="glm"`` for a guide without a linearised predictive;
        ``y`` with a loader, a batch without targets, an empty loader.
    TypeError
        ``x`` neither a tensor nor a ``DataLoader``, tensor ``x`` without ``y``, a batch of
        another structure.

    Examples
    --------
    >>> dt = pb.to_arviz(model, guide, x_train, y_train, num_samples=200)   # doctest: +SKIP
    >>> az.loo(dt); pb.posterior.arviz.loo_approximate(dt)                           # doctest: +SKIP
    """
    with seeded(seed):
        return _to_arviz(model, guide, x, y, num_samples, var_names, batch_size, predictive,
                         posterior_predictive, obs_site, device, bn_data)


def _to_arviz(model, guide, x, y, num_samples, var_names, batch_size, predictive, posterior_predictive,
              obs_site, device, bn_data):
    num_samples = check_int("num_samples", num_samples, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    x, y = prediction_data(model, x, y, where="pb.to_arviz", targets=True)
    device = torch.device(device) if device is not None else module_device(model, guide, default=x.device)
    predictive = resolve_predictive(guide, predictive)
    if predictive == "glm_probit":
        raise ValueError("predictive='glm_probit' is a closed-form approximation of the link, not draws, "
                         "so it has no per-draw log-likelihood for ArviZ; use predictive='glm' (Monte "
                         "Carlo over the same Gaussian, pb.evaluate's default for a Laplace guide)")
    if predictive not in ("sample", "glm"):
        raise ValueError(f"predictive must be 'sample' or 'glm', got {predictive!r}")
    if bn_data is not None and predictive != "sample":
        raise ValueError(f"bn_data= re-estimates BatchNorm statistics per weight draw of a pb.BNN under "
                         f"predictive='sample'; predictive={predictive!r} linearises the network at its MAP, "
                         "whose running statistics are the ones to use")
    with evaluation_mode(model, guide):
        if predictive == "glm":
            data = _glm_groups(guide, x, y, num_samples, var_names, batch_size, device,
                               posterior_predictive)
        else:
            with batchnorm_recalibration(model, bn_data, batch_size, device) as recalibrate:
                data = _sample_groups(model, guide, x, y, num_samples, var_names, batch_size, device,
                                      posterior_predictive, obs_site, recalibrate)
    return _datatree(model, guide, data, y, num_samples, predictive)


def _sample_groups(model, guide, x, y, num_samples, var_names, batch_size, device,
                   posterior_predictive, obs_site, recalibrate=None) -> dict:
    """Groups of joint guide draws through the network (``predictive="sample"``);
    ``recalibrate(values)`` (``bn_data=``) re-estimates BatchNorm statistics per draw."""
    bnn = is_bnn(model)

    draws: dict[str, list[np.ndarray]] = {}
    loglik, pp, lp, log_prior, log_q = [], [], [], [], []
    with local_params(model, guide):
        for s in range(int(num_samples)):
            values, lq = sample_with_log_density(model, guide, x[:1].to(device), y[:1].to(device))
            if s == 0:
                names = _select_sites(values, var_names, int(num_samples))
            if recalibrate is not None:
                recalibrate(values)
            if bnn:
                ll, yrep = _pointwise_bnn(model, values, x, y, batch_size, device, posterior_predictive)
                lprior = _log_prior_bnn(model, values)
            else:
                ll, yrep, lprior = _pointwise_trace(model, values, x, y, batch_size, device,
                                                    posterior_predictive, obs_site)
            for name in names:
                draws.setdefault(name, []).append(_posterior_array(values[name]))
            loglik.append(ll.double().cpu().numpy())
            if yrep is not None:
                pp.append(yrep.cpu().numpy())
            lprior = torch.as_tensor(lprior).double().cpu()
            log_prior.append(float(lprior))
            lp.append(float(lprior + ll.double().sum().cpu()))
            log_q.append(float(lq.double().cpu()))

    def chain(arrs):
        return np.stack(arrs)[None]

    data = {
        "posterior": {name: chain(v) for name, v in draws.items()},
        "log_likelihood": {"obs": chain(loglik)},
        "sample_stats": {"lp": chain(lp), "log_prior": chain(log_prior), "log_q": chain(log_q)},
    }
    if pp:
        data["posterior_predictive"] = {"obs": chain(pp)}
    return data


def _glm_groups(guide, x, y, num_samples, var_names, batch_size, device, want_pp) -> dict:
    """Groups of linearised draws (module docstring): posterior, log_likelihood,
    posterior_predictive, sample_stats as ``(1, S, ...)`` arrays."""
    if not guide_contract(guide).linearized:
        raise ValueError(f"predictive='glm' needs a guide with a linearised predictive (pb.guides.Laplace), "
                         f"got {type(guide).__name__}")
    names = _select_sites(guide.map_values(), var_names, num_samples)
    kind, noise = guide.likelihood_kind()
    draws = guide.linearized_samples(x, num_samples=num_samples, batch_size=batch_size, sites=names)
    yd = y.to(device)
    loglik = pointwise_log_likelihood(kind, draws.f, yd, noise).double()      # (S, N)
    lp = draws.log_prior.double() + loglik.sum(-1)
    data = {
        "posterior": {k: _posterior_array(v)[None] for k, v in draws.values.items()},
        "log_likelihood": {"obs": loglik.cpu().numpy()[None]},
        "sample_stats": {"lp": lp.cpu().numpy()[None], "log_prior": draws.log_prior.double().cpu().numpy()[None],
                         "log_q": draws.log_q.double().cpu().numpy()[None]},
    }
    if want_pp:
        rep = sample_observations(kind, draws.f, noise)
        if kind != "categorical":
            rep = rep.reshape(num_samples, *y.shape)
        data["posterior_predictive"] = {"obs": rep.cpu().numpy()[None]}
    return data


def _datatree(model, guide, data: dict, y: torch.Tensor, num_samples: int, predictive: str):
    from arviz_base import from_dict

    y_np = y.detach().cpu().numpy()
    extra = [f"obs_dim_{i}" for i in range(1, y_np.ndim)]
    dims = {name: site_dims(model, name, v.shape[2:]) for name, v in data["posterior"].items()}
    dims["obs"] = [OBS_DIM, *extra]
    data["observed_data"] = {"obs": y_np}
    dt = from_dict(data, dims=dims, attrs=None)
    # log_likelihood is per observation: extra target dims are already summed over
    ll_da = dt["log_likelihood"]["obs"]
    if ll_da.dims[-1] != OBS_DIM:  # pragma: no cover - from_dict keeps our order
        raise RuntimeError(f"unexpected log_likelihood dims {ll_da.dims}")
    dt.attrs.update({
        "guide": type(guide).__name__,
        "num_samples": int(num_samples),
        "method": predictive,
        "predictive": predictive_name(predictive, num_samples),
        "log_p": "sample_stats/lp  (log prior + sum of log_likelihood/obs)" if predictive == "sample" else
                 "sample_stats/lp  (linearised model: Laplace prior with the guide's delta + sum of "
                 "log_likelihood/obs of f_lin)",
        "log_q": "sample_stats/log_q (log density of the guide at each draw)",
    })
    return dt


def loo_approximate(dt, *, pointwise: bool | None = None, **kwargs):
    """``az.loo_approximate_posterior`` with ``log_p``/``log_q`` read from ``sample_stats``.

    The correction reweights each draw by ``w_s ∝ p(θ_s, y) / q(θ_s)``.  Both densities sum
    over every weight and ``log p`` over every observation, so ``log p − log q`` spans
    thousands of nats for a network fitted to a large data set (3,300 for a 784-200-200-10
    MeanField MLP on 10,000 Fashion-MNIST images, more on 60,000) and the weights put all
    their mass on one draw (effective sample size ``(Σ w)² / Σ w² ≈ 1``).  ArviZ then
    reports every observation's Pareto ``k̂`` as very bad, but beyond a span of about
    10,000 nats its tail fits fail and it returns ``k̂ = NaN`` for all of them, *no warning*
    and ``warning=False``, with an ELPD that is the log-likelihood of the one draw.  Here an
    undefined ``k̂`` counts as very bad (``+inf``), the result's ``warning`` is set, and a
    ``UserWarning`` names the effective sample size and suggests :func:`psis_loo`.

    Parameters
    ----------
    dt : xarray.DataTree
        Output of :func:`to_arviz`.
    pointwise : bool, optional
        Keep ``elpd_i`` and ``pareto_k`` in the result (default: ArviZ's
        ``rcParams["stats.ic_pointwise"]``).  The ``k̂`` values are always computed, to be checked.
    **kwargs
        Passed on (``var_name``, ``log_jacobian``).

    Returns
    -------
    arviz_stats.ELPDDataLOO

    Raises
    ------
    ValueError
        Fewer than :data:`MIN_PSIS_DRAWS` draws.

    Warns
    -----
    UserWarning
        ArviZ could not fit the Pareto tail of some observations' weights (``k̂`` undefined).
    """
    import arviz_stats
    from arviz_base import rcParams

    _check_psis_draws(dt, "loo_approximate")
    stats = dt["sample_stats"]
    keep = rcParams["stats.ic_pointwise"] if pointwise is None else bool(pointwise)
    res = arviz_stats.loo_approximate_posterior(dt, log_p=stats["lp"], log_q=stats["log_q"],
                                                pointwise=True, **kwargs)
    undefined = int(np.isnan(res.pareto_k.values).sum())
    if undefined:
        res.pareto_k = res.pareto_k.fillna(np.inf)
        res.warning = True
        ess, span = correction_ess(stats["lp"].values, stats["log_q"].values)
        warnings.warn(
            f"loo_approximate: the Pareto k of {undefined:,} of {res.n_data_points:,} observations could not "
            f"be fitted (ArviZ returns NaN and no warning for them; counted as very bad, k = inf): the "
            f"correction weights p(theta, y) / q(theta) span {span:,.0f} nats over the {res.n_samples} draws, "
            f"an effective sample size of {ess:.2f}, so this ELPD ({res.elpd:,.1f}) rests on about one draw. "
            "The guide is too far from the posterior for importance sampling; use psis_loo(dt) (az.loo, no "
            "correction) and read its Pareto k", UserWarning, stacklevel=2)
    if not keep:
        res.elpd_i = res.pareto_k = None
    return res


def correction_ess(log_p, log_q) -> tuple[float, float]:
    """Effective sample size ``(Σ w)² / Σ w²`` of importance weights ``w_s ∝ exp(log_p − log_q)``,
    and the span ``max − min`` of ``log_p − log_q`` in nats (arrays of any shape, one entry per draw)."""
    r = (np.asarray(log_p, dtype=np.float64) - np.asarray(log_q, dtype=np.float64)).ravel()
    w = np.exp(r - r.max())
    return float(w.sum() ** 2 / (w ** 2).sum()), float(r.max() - r.min())


#: The fewest tail draws PSIS fits (arviz-stats raises "All tail values are the same" when they tie).
MIN_PSIS_TAIL = 5

#: The fewest draws with which arviz-stats' PSIS fits a Pareto tail.  Below 226 draws its tail
#: is ``floor(S / 5)`` draws, and its generalised-Pareto fit gives up (``k̂ = NaN``, the weights
#: left unsmoothed) whenever the tail's first quartile is its minimum, as it always is for 5 tail
#: draws: with 25–29 draws every ``k̂`` is NaN, without a warning (measured on digits).
MIN_PSIS_DRAWS = 30


def num_draws(dt) -> int:
    """Chains × draws of a ``DataTree``'s ``log_likelihood`` group (0 without one)."""
    try:
        sizes = dt["log_likelihood"].sizes
    except KeyError:
        return 0
    return int(sizes.get("chain", 1) * sizes.get("draw", 0))


def _check_psis_draws(dt, what: str) -> None:
    """Refuse fewer than :data:`MIN_PSIS_DRAWS` draws, naming the fix."""
    draws = num_draws(dt)
    if draws < MIN_PSIS_DRAWS:
        raise ValueError(
            f"{what} needs at least {MIN_PSIS_DRAWS} draws to fit its Pareto tails (floor(S/5) >= 6 "
            f"draws), got {draws}: with fewer, arviz-stats leaves every observation's k-hat NaN and "
            f"its weights unsmoothed, without a warning; pass num_samples >= {MIN_PSIS_DRAWS} to to_arviz")


def psis_loo(dt) -> tuple[float, float, int]:
    """PSIS-LOO (``arviz_stats.loo``) that also scores observations whose likelihood has no tail.

    A confidently predicted observation can have ``log p(y_n | θ_s) = 0`` exactly for many
    draws (the log-softmax saturates in float32): its importance weights ``1/p`` then tie in
    the tail, Pareto smoothing cannot be fitted ("All tail values are the same") and
    ``arviz_stats.loo`` refuses the whole data set.  Here an observation whose
    :data:`MIN_PSIS_TAIL` smallest log-likelihood draws are equal is scored by plain
    importance sampling, ``elpd_n = −log mean_s exp(−log p(y_n | θ_s))`` (its weights are bounded
    by the tied tail, so smoothing would change little; for draws that are all equal it is exact),
    and the others by ``arviz_stats.loo``.

    Parameters
    ----------
    dt : xarray.DataTree
        Output of :func:`to_arviz` (``log_likelihood/obs`` over ``chain, draw, obs_id``).

    Returns
    -------
    elpd : float
        ``Σ_n elpd_n``.
    se : float
        ``sqrt(N · var(elpd_n))`` (variance with ``N − 1``), as ArviZ computes it.
    num_plain : int
        Observations scored by plain importance sampling.

    Raises
    ------
    ValueError
        Fewer than :data:`MIN_PSIS_DRAWS` draws.
    """
    pointwise, num_plain, _, _ = psis_loo_pointwise(dt)
    return float(pointwise.sum()), math.sqrt(len(pointwise) * pointwise.var(ddof=1)), num_plain


class PsisPointwise(NamedTuple):
    """What :func:`psis_loo_pointwise` returns."""

    #: ``elpd_n`` in the order of ``obs_id``, shape ``(N,)``.
    elpd: np.ndarray
    #: How many observations were scored by plain importance sampling.
    num_plain: int
    #: Each observation's Pareto ``k̂`` (NaN where scored by plain importance sampling: its
    #: weights are bounded by a tied tail, so no tail is fitted).
    pareto_k: np.ndarray
    #: ArviZ's threshold for ``S`` draws, ``min(1 − 1/log10 S, 0.7)``: above it, the
    #: observation's estimate is unreliable.
    good_k: float


def pareto_k_threshold(num_samples: int) -> float:
    """ArviZ's ``good_k`` for ``num_samples`` draws: ``min(1 − 1/log10 S, 0.7)`` (0.7 for one draw)."""
    return min(1 - 1 / math.log10(num_samples), 0.7) if num_samples > 1 else 0.7


def psis_loo_pointwise(dt) -> PsisPointwise:
    """The per-observation ELPDs of :func:`psis_loo` (same rules), how many of them were scored
    by plain importance sampling, and their Pareto ``k̂`` diagnostics.

    Parameters
    ----------
    dt : xarray.DataTree
        As for :func:`psis_loo`.

    Returns
    -------
    PsisPointwise
        ``(elpd, num_plain, pareto_k, good_k)``.

    Raises
    ------
    ValueError
        Fewer than :data:`MIN_PSIS_DRAWS` draws.
    """
    import arviz_stats

    _check_psis_draws(dt, "psis_loo")
    ll = dt["log_likelihood"]["obs"].transpose(..., OBS_DIM).values
    ll = ll.reshape(-1, ll.shape[-1]).astype(np.float64)
    lowest = np.sort(ll, axis=0)[:MIN_PSIS_TAIL]
    plain = (lowest.max(0) - lowest.min(0)) < np.finfo(float).tiny
    pointwise = np.empty(ll.shape[1])
    pareto_k = np.full(ll.shape[1], np.nan)
    if not plain.all():
        keep = np.flatnonzero(~plain)
        part = dt if keep.size == ll.shape[1] else dt.isel({OBS_DIM: keep}, missing_dims="ignore")
        res = arviz_stats.loo(part, pointwise=True)
        pointwise[keep] = np.asarray(res.elpd_i, dtype=np.float64).reshape(-1)
        pareto_k[keep] = np.asarray(res.pareto_k, dtype=np.float64).reshape(-1)
    if plain.any():
        neg = -ll[:, plain]
        top = neg.max(0)
        pointwise[plain] = -(top + np.log(np.exp(neg - top).mean(0)))
    return PsisPointwise(pointwise, int(plain.sum()), pareto_k, pareto_k_threshold(ll.shape[0]))
