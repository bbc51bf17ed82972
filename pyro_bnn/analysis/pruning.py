"""Weight pruning from posterior uncertainty (Blundell et al. 2015, §5.1; the talk repo).

Each random weight gets an importance score from its marginal posterior ``N(μ, σ²)``;
the lowest-scoring weights are masked to zero.  Masks act on the *model* (a forward
pre-hook multiplies the sampled weights by a 0/1 mask), so they work with every guide and
are reversible (:func:`unprune_`).

Scores (higher = more important = kept longer)
----------------------------------------------
``"snr"``
    Signal-to-noise ratio ``|μ| / σ`` (Blundell).
``"zero_prob"``
    Negative log posterior *density* at zero, ``−log q(0) = ½(μ/σ)² + log(√(2π) σ)``
    (the talk repo's rule keeps a weight only if ``log q(0) ≤ threshold``).
``"magnitude"``
    ``|μ|`` (classic magnitude pruning; what both rules reduce to for point estimates).

Why the literal zero-probability rule keeps wide weights
--------------------------------------------------------
``log q(0)`` is a density, not a probability: it carries the term ``−log σ``.  Weight
*i* is pruned before weight *j* by ``"zero_prob"`` iff

    ½ SNR_i² + log σ_i  <  ½ SNR_j² + log σ_j,

whereas ``"snr"`` compares ``SNR_i < SNR_j`` only.  The two rankings agree when the
spread of ``log σ`` across weights is small against the spread of ``½ SNR²`` (e.g. early in
training, when every σ is still near ``init_scale``, or with a KL term too weak to move σ —
the situation in which the talk repo's plots were made).  With a proper KL, weights the
data do not constrain relax to the prior (σ ≈ 1) while data-bound weights keep σ ≈ 10⁻²:
``log σ`` then spans ≈ 4.6 nats, so *every* narrow weight with SNR below
``sqrt(2 · 4.6) ≈ 3`` is pruned before *any* wide weight.  Wide weights are the ones the
data say are irrelevant, yet they are kept; narrow weights with SNR 1–3 carry the
function, yet they go first — accuracy collapses early (measured: see
``docs/results/uncertainty.md``).  Any scale-free version of "how plausible is zero under
q" — the density ratio ``q(0)/q(μ) = exp(−½ SNR²)``, the mass ``P(|w| < kσ)``, the sign
flip probability ``Φ(−SNR)`` — is a monotone function of the SNR, so the rule that
"behaves" *is* SNR pruning.  ``"zero_prob"`` is kept literal (for reproducing the talk
repo) and documented as such.

Guides without a per-weight σ
-----------------------------
Scores use :func:`pyro_bnn.posterior.draws.site_moments`: exact ``(μ, σ)`` from
``guide.loc_and_scale`` (MeanField, symmetrised) or ``AutoNormal`` quantiles; otherwise
the marginal mean and std of ``num_samples`` joint guide draws (hypernetwork, Laplace,
low-rank: the std then includes the correlations' marginal effect).  Point-estimate
guides (``AutoDelta``: every σ = 0) use σ := 1, so both SNR and zero-probability reduce
to magnitude pruning.
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from pyro.nn import PyroModule
from torch import nn

from ..arguments import check_choice, check_int, check_names
from ..contract.guide import guide_contract
from ..data.prediction_data import prediction_data
from ..model.bnn import is_bnn, network_of, site_module
from ..model.weight_masks import attach_masking, detach_masking, masking_of
from ..posterior import metrics
from ..posterior.draws import draw_latents, probs_from_latents, site_moments
from .tool_support import seeded, to_model_device

__all__ = ["scores", "prune_", "unprune_", "PruningHandle", "pruning_curve", "export_pruned",
           "posterior_mean"]

KINDS = ("snr", "zero_prob", "magnitude")
_TINY = 1e-30


def _check_kind(kind):
    check_choice("kind", kind, KINDS)


def _check_fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1] (a bool, a string or NaN is an error)."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or _is_scalar_tensor(value)):
        raise TypeError(f"{name} must be a number in [0, 1], got {value!r} ({type(value).__name__})")
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return v


def _check_threshold(value) -> float:
    """``value`` as a float (±inf allowed: prune every / no weight; NaN is an error)."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or _is_scalar_tensor(value)):
        raise TypeError(f"threshold must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if math.isnan(v):
        raise ValueError("threshold must be a number, got nan (every comparison with NaN is False)")
    return v


def _is_scalar_tensor(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point())


def _site_filter(sites, available: list[str]):
    """A predicate ``site -> bool`` from ``sites=`` (``None``, a callable, one site name or a
    collection of them); names that are not sites are an error naming the closest site."""
    if sites is None or callable(sites):
        return sites
    names = check_names(sites, expected="sites must be None, a site name, a collection of site names or a "
                                        "callable site -> bool", element="sites must be site names (str)")
    unknown = [n for n in names if n not in available]
    if unknown:
        hints = []
        for name in unknown:
            close = ([f"net.{name}"] if f"net.{name}" in available
                     else difflib.get_close_matches(name, available, n=1, cutoff=0.5))
            hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        raise ValueError(f"sites= names no site of the model: {', '.join(hints)}; the sites are {available}")
    return set(names)


def score_from_moments(mean: torch.Tensor, std: torch.Tensor, *, kind: str = "snr") -> torch.Tensor:
    """Importance of each weight from its marginal ``N(μ, σ²)`` (higher = keep).

    ``snr``: ``|μ|/σ``; ``zero_prob``: ``½(μ/σ)² + log(√(2π)σ)`` (= ``−log q(0)``);
    ``magnitude``: ``|μ|``.  Same shape as ``mean``.
    """
    _check_kind(kind)
    if kind == "magnitude":
        return mean.abs()
    std = std.clamp_min(_TINY)
    if kind == "snr":
        return mean.abs() / std
    return 0.5 * (mean / std) ** 2 + torch.log(math.sqrt(2 * math.pi) * std)


def scores(guide, *, kind: str = "snr", model=None, x: torch.Tensor | None = None,
           num_samples: int = 200, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Pruning scores of every random weight, ``{site: tensor of the site's shape}``.

    Parameters
    ----------
    guide : guide
        A trained guide.
    kind : {"snr", "zero_prob", "magnitude"}
        See the module docstring; higher = more important.
    model : pyro_bnn.BNN, optional
        Needed unless the guide's contract declares ``normal_per_site`` (its ``loc_and_scale``
        and ``site_names()`` give the moments).
    x : Tensor, optional
        An input batch, for guides that are sampled (default: a dummy row for MLPs).
    num_samples : int
        Guide draws for sample-based moments.
    seed : int, optional
        Seeds those draws without touching the caller's random streams (``None``: use them).

    Examples
    --------
    >>> s = pb.analysis.pruning.scores(guide, kind="snr", model=model)    # doctest: +SKIP
    """
    _check_kind(kind)
    num_samples = check_int("num_samples", num_samples, 1)
    if model is None:
        if not guide_contract(guide).normal_per_site:
            raise TypeError(f"scores() needs model= for a {type(guide).__name__} guide "
                            "(it has no loc_and_scale/site_names)")

        class _Names:  # minimal stand-in: site_moments only reads site_names
            site_names = guide.site_names()
        model = _Names()
    if x is not None and is_bnn(model):
        x = to_model_device(model, guide, x)
    with seeded(seed):
        mean, std, _ = site_moments(model, guide, x, num_samples=num_samples)
    if all(float(s.abs().max()) == 0.0 for s in std.values()):
        std = {k: torch.ones_like(v) for k, v in std.items()}  # point estimates: magnitude
    return {k: score_from_moments(mean[k], std[k], kind=kind) for k in mean}


@dataclass
class PruningHandle:
    """Masks installed on a model by :func:`prune_`; ``remove()`` undoes them.

    Attributes
    ----------
    masks : dict[str, Tensor]
        0/1 float masks per site (1 = kept).
    num_pruned, num_total : int
        Masked weights and weights considered.
    """

    masks: dict[str, torch.Tensor]
    num_pruned: int
    num_total: int
    _hooks: list = field(default_factory=list, repr=False)
    _model: object = field(default=None, repr=False)

    @property
    def fraction(self) -> float:
        return self.num_pruned / max(1, self.num_total)

    def remove(self) -> None:
        """Remove the masks (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._model is not None:
            detach_masking(self._model, self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _site_module(model, site: str):
    module, attr = site_module(model, site)
    if not isinstance(module, PyroModule) or attr not in module.__dict__.get("_pyro_samples", {}):
        raise ValueError(f"site {site!r} is not a PyroSample attribute of a module of the model; "
                         "pruning masks need PyroSample weights (pyro_bnn.BNN or PyroModule)")
    return module, attr


def _mask_hook(attr, mask):
    def hook(module, inputs):
        value = getattr(module, attr)  # draws or reads the cached sample
        module._pyro_context.set(module._pyro_get_fullname(attr), value * mask.to(value))
    return hook


def prune_(model, guide, *, fraction: float | None = None, threshold: float | None = None,
           kind: str = "snr", sites=None, x: torch.Tensor | None = None,
           num_samples: int = 200, score: dict | None = None, seed: int | None = None) -> PruningHandle:
    """Mask the least important weights of ``model`` in place (reversible).

    One global ranking over all selected weights (not per layer).  With ``fraction=f``
    exactly ``⌊f·P⌋`` of the ``P`` selected weights are masked (ties broken by position);
    with ``threshold=t`` every weight whose score is ``< t`` is masked (for
    ``kind="zero_prob"`` that is ``log q(0) > −t``).  Masked weights are multiplied by 0
    after being drawn, so predictions, ``pb.evaluate`` and further training all see the
    pruned network.  A previous pruning of the same model is removed first.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model; its sites must be ``PyroSample`` module attributes.
    guide : guide
        Trained guide the scores come from.
    fraction, threshold : float
        Exactly one of them.
    kind : {"snr", "zero_prob", "magnitude"}
    sites : iterable of str or callable, optional
        Sites considered (default all random sites, weights and biases);
        a callable ``site -> bool`` filters, e.g. ``lambda s: s.endswith("weight")``.
    x, num_samples, seed
        For guides scored from samples (see :func:`scores`).
    score : dict, optional
        Precomputed :func:`scores` (skips recomputing them).

    Returns
    -------
    PruningHandle
        Masks and counts; ``handle.remove()`` or :func:`unprune_` restores the model.
    """
    if (fraction is None) == (threshold is None):
        raise ValueError(f"pass exactly one of fraction= or threshold=, got fraction={fraction!r}, "
                         f"threshold={threshold!r}")
    fraction = None if fraction is None else _check_fraction("fraction", fraction)
    threshold = None if threshold is None else _check_threshold(threshold)
    _check_kind(kind)
    num_samples = check_int("num_samples", num_samples, 1)
    if score is not None and not isinstance(score, Mapping):
        raise TypeError(f"score must be a dict {{site: tensor}} from pruning.scores, got {type(score).__name__}")
    if score is None and is_bnn(model):
        _site_filter(sites, list(model.site_names))  # a misspelled site fails before the (slow) scores
    unprune_(model)
    score = score if score is not None else scores(guide, kind=kind, model=model, x=x,
                                                   num_samples=num_samples, seed=seed)
    selected = _site_filter(sites, list(score))
    names = [s for s in score if _selected(s, selected)]
    if not names:
        raise ValueError(f"no site selected for pruning; sites are {list(score)}")
    # float64: a float32 copy rounds float64 scores across a threshold (and merges distinct ones into ties)
    flat = torch.cat([score[s].reshape(-1).double().cpu() for s in names])
    total = flat.numel()
    if fraction is not None:
        k = int(math.floor(fraction * total + 1e-9))
        drop = torch.zeros(total, dtype=torch.bool)
        drop[torch.argsort(flat, stable=True)[:k]] = True
    else:
        drop = flat < threshold
    masks, hooks, start = {}, [], 0
    for s in names:
        n = score[s].numel()
        mask = (~drop[start:start + n]).reshape(score[s].shape).float()
        start += n
        module, attr = _site_module(model, s)
        masks[s] = mask
        hooks.append(module.register_forward_pre_hook(_mask_hook(attr, mask)))
    handle = PruningHandle(masks, int(drop.sum()), total, hooks, model)
    attach_masking(model, handle)
    return handle


def _selected(site, selected):
    if selected is None:
        return True
    if callable(selected):
        return bool(selected(site))
    return site in selected


def unprune_(model) -> bool:
    """Remove the masks :func:`prune_` installed on ``model``; True if there were any."""
    handle = masking_of(model)
    if handle is None:
        return False
    handle.remove()
    return True


def posterior_mean(model, guide, x: torch.Tensor | None = None, *, num_samples: int = 200,
                   seed: int | None = None) -> dict[str, torch.Tensor]:
    """Posterior mean of every site (exact for MeanField/AutoNormal, else from ``num_samples``
    draws, seeded by ``seed`` without touching the caller's random streams)."""
    num_samples = check_int("num_samples", num_samples, 1)
    if x is not None:
        x = to_model_device(model, guide, x)
    with seeded(seed):
        return site_moments(model, guide, x, num_samples=num_samples)[0]


def export_pruned(model, guide, x: torch.Tensor | None = None, *, num_samples: int = 200,
                  seed: int | None = None) -> nn.Module:
    """The network as a plain ``torch.nn.Module`` with posterior-mean weights, pruned ones at 0.

    The current masks of :func:`prune_` (if any) are applied; the result has no Pyro
    machinery (its layers are ``nn.Linear``/``nn.Conv2d`` again) and can be saved, traced
    or quantised like any network.  For guides without exact moments the posterior mean is
    estimated from ``num_samples`` draws (seeded by ``seed``, see :func:`posterior_mean`).

    Returns
    -------
    torch.nn.Module
        ``net(x)`` gives the logits (or regression output) of the pruned mean network.
    """
    if not is_bnn(model) or network_of(model) is None:
        raise TypeError(f"export_pruned needs a pyro_bnn.BNN, got {type(model).__name__}")
    mean = posterior_mean(model, guide, x, num_samples=num_samples, seed=seed)
    handle = masking_of(model)
    masks = handle.masks if handle is not None else {}
    net = copy.deepcopy(model.net)
    hook_ids = {h.id for h in handle._hooks} if handle is not None else set()
    for path, m in list(net.named_modules()):
        for hid in hook_ids:  # the copied mask hooks: the masks are baked in below
            m._forward_pre_hooks.pop(hid, None)
        if not isinstance(m, PyroModule):
            continue
        samples = m.__dict__.pop("_pyro_samples", {})
        m.__dict__.pop("_pyro_params", None)
        m.__class__ = next(b for b in type(m).__mro__[1:] if not issubclass(b, PyroModule))
        for attr in samples:
            site = f"net.{path}.{attr}" if path else f"net.{attr}"
            if site not in mean:
                raise ValueError(f"no posterior mean for site {site!r}; sites: {list(mean)}")
            value = mean[site] * masks[site].to(mean[site]) if site in masks else mean[site]
            m.register_parameter(attr, nn.Parameter(value.detach().clone()))
    for m in net.modules():
        for key in ("_pyro_name", "_pyro_context"):
            m.__dict__.pop(key, None)
    return net


PRUNING_PREDICTIVES = ("sample", "mean")


@torch.no_grad()
def pruning_curve(model, guide, x, y: torch.Tensor | None = None, *, fractions=(0.0, 0.5, 0.9, 0.95),
                  kind: str = "snr", num_samples: int = 32, predictive: str = "sample",
                  sites=None, seed: int | None = 0, batch_size: int = 1024) -> dict[str, list]:
    """Test accuracy and NLL as a growing fraction of weights is pruned.

    Parameters
    ----------
    x : Tensor, shape (N, ...), or DataLoader
        Test inputs (moved to the model's device), or a ``DataLoader`` of the test set yielding
        ``(x, y)`` batches, read once and each batch checked as :func:`pyro_bnn.evaluate` reads
        one (:func:`pyro_bnn.data.prediction_data.read_loader`): the curve is that of its
        examples as tensors, bit for bit at the same ``seed``.  A shuffled loader gives the same
        curve up to rounding (accuracy and NLL are means over the examples).
    y : Tensor, shape (N,), optional
        Labels of tensor ``x``; not with a loader (its batches hold them).
    fractions : sequence of float
        Fractions pruned (each in [0, 1]).
    kind : {"snr", "zero_prob", "magnitude"}
        The score that ranks the weights (see the module docstring).
    num_samples : int
        Posterior draws of the ``"sample"`` predictive.
    predictive : {"sample", "mean"}
        ``"sample"``: Monte Carlo predictive of the masked BNN with ``num_samples``
        draws — the *same* draws at every fraction; ``"mean"``: the exported
        posterior-mean network (:func:`export_pruned`).  A guide's own predictive is not
        offered here: the curve scores every fraction on the same posterior draws.  Laplace's
        ``"glm"`` does see the masks (``prune_`` then :func:`pyro_bnn.predict` /
        :func:`pyro_bnn.evaluate` give the GLM of the pruned network, ``Σ_f = (J M) P⁻¹ (J M)ᵀ``,
        see :mod:`pyro_bnn.guides.laplace.predictive`); for a GLM curve, call those per fraction.
    seed : int or None
        Seeds the draws (scores of sample-based guides and the predictive) without
        touching the caller's random streams; ``None`` uses and advances them.

    Returns
    -------
    dict
        ``fraction``, ``accuracy``, ``nll``, ``num_pruned`` lists (one entry per fraction)
        and ``kind``.

    Raises
    ------
    TypeError, ValueError
        ``x`` neither a tensor nor a ``DataLoader`` (naming what was received), tensor ``x``
        without ``y``, ``y`` with a loader, a loader's batch without labels, an empty loader,
        inputs or labels the model cannot take; bad options.
    """
    if predictive not in PRUNING_PREDICTIVES:
        raise ValueError(f"pruning_curve: predictive must be one of {PRUNING_PREDICTIVES} (the curve masks one "
                         "set of posterior draws at every fraction; for Laplace's GLM predictive of a pruned "
                         f"model call prune_ and pb.evaluate per fraction), got {predictive!r}")
    _check_kind(kind)
    num_samples = check_int("num_samples", num_samples, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    fractions = _check_fractions(fractions)
    if predictive == "mean" and is_bnn(model) and model.likelihood.name != "categorical":
        raise ValueError("pruning_curve(predictive='mean') scores class probabilities, the softmax of the "
                         f"exported network's outputs: expected a categorical model, got a "
                         f"{model.likelihood.name!r} likelihood")
    x, y = prediction_data(model, x, y, where="pb.analysis.pruning.pruning_curve", targets=True)
    x, y = to_model_device(model, guide, x, y)
    previous = masking_of(model)
    previous_masks = None if previous is None else previous.masks
    out = {"kind": kind, "fraction": [], "accuracy": [], "nll": [], "num_pruned": []}
    with seeded(seed):
        score = scores(guide, kind=kind, model=model, x=x[:1])
        latents = draw_latents(model, guide, x, num_samples=num_samples) if predictive == "sample" else None
        try:
            for f in fractions:
                handle = prune_(model, guide, fraction=f, sites=sites, score=score)
                if predictive == "sample":
                    probs = probs_from_latents(model, latents, x, batch_size=batch_size).mean(0)
                else:
                    net = export_pruned(model, guide, x[:1])
                    probs = torch.softmax(net(x), -1)
                y_ = y.to(probs.device)
                out["fraction"].append(float(f))
                out["accuracy"].append(metrics.accuracy(probs, y_))
                out["nll"].append(metrics.negative_log_likelihood(probs, y_))
                out["num_pruned"].append(handle.num_pruned)
        finally:
            unprune_(model)
            if previous_masks is not None:  # restore the user's own pruning
                _reinstall(model, previous_masks, previous)
    return out


def _check_fractions(fractions) -> list[float]:
    """``fractions=`` of :func:`pruning_curve` as a list of floats in [0, 1]."""
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Iterable):
        raise TypeError("fractions must be a sequence of numbers in [0, 1] (e.g. [0.0, 0.5, 0.9]), "
                        f"got {fractions!r} ({type(fractions).__name__})")
    return [_check_fraction("each of fractions", f) for f in fractions]


def _reinstall(model, masks, old):
    hooks = []
    for s, mask in masks.items():
        module, attr = _site_module(model, s)
        hooks.append(module.register_forward_pre_hook(_mask_hook(attr, mask)))
    handle = PruningHandle(masks, old.num_pruned, old.num_total, hooks, model)
    attach_masking(model, handle)
