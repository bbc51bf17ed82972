"""Training objectives: Pyro ELBOs made minibatch-correct for any model.

:class:`PyroObjective` wraps a Pyro ELBO (``Trace_ELBO``, ``TraceMeanField_ELBO``, ...)
so that

* a :class:`~pyro_bnn.BNN` receives ``num_data`` and scales its own ``"data"`` plate;
* a hand-written model whose observed sites are not subsampled gets them scaled by
  ``N / M`` by :class:`scale_observations` (sites that a user's plate already scales are
  left alone), so minibatch ELBOs estimate the full-data ELBO for every model.
"""

from __future__ import annotations

import inspect

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import scale_and_mask
from pyro.infer import TraceMeanField_ELBO
from pyro.poutine.condition_messenger import ConditionMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.util import site_is_subsample

from ..model.batch_scaling import end_batch_watches, subsampled_frames

__all__ = ["scale_observations", "PyroObjective", "TraceMeanFieldJacobian_ELBO", "accepts_num_data", "call_model", "model_arguments",
           "observed_sites"]


class scale_observations(Messenger):
    """Multiply the log-density of observed sites by ``factor`` (``N / M``) unless already scaled.

    A plate with ``subsample_size`` sets ``msg["scale"]`` before this (outer) handler sees the
    site, so models that subsample themselves are not scaled twice; a site that the model
    scales by ``N / M`` itself (``poutine.scale``) is left alone too.  Any other scale is a
    weight on the full-data term and is multiplied by ``N / M`` where that is clear: a scale of
    at most 1 (a tempered likelihood, ``poutine.scale(scale=0.5)``, weights per point), or the
    scale of every latent site too (a ``poutine.scale`` of the whole model).  Leaving such a
    scale alone weighted a tempered data term by 0.5 instead of 0.5 N / M, and the posterior
    fell towards the prior in silence.  A scale above 1 on the observations only (not ``N /
    M``) is refused: whether it already counts the minibatch cannot be told.  A latent fixed by
    a ``pyro.condition`` around the model is observed but not data: it is left unscaled (its
    density is in the joint once).

    With ``num_data`` (``N``) and ``batch_size`` (``M``), a subsampled plate of the batch's
    size must declare ``N`` points: ``pyro.plate("data", 1000, subsample_size=M)`` trained on
    200 points scaled each batch by 1000 / M, five times too much, in silence.
    """

    def __init__(self, factor: float, num_data: int | None = None, batch_size: int | None = None):
        super().__init__()
        self.factor = float(factor)
        self.num_data, self.batch_size = num_data, batch_size
        self._latent_scales: set = set()

    def __enter__(self):
        self._latent_scales = set()
        return super().__enter__()

    def _process_message(self, msg):
        if msg["type"] != "sample" or site_is_subsample(msg):
            return
        if not msg["is_observed"]:
            scale = msg["scale"]   # (a number, but for a tensor scale of a whole-model poutine.scale)
            self._latent_scales.add(scale if isinstance(scale, (int, float)) else
                                    float(scale) if scale.numel() == 1 else None)
            return
        subsampled = subsampled_frames(msg)
        if subsampled:  # a subsampled plate scales it
            self._check_declared_size(msg["name"], subsampled)
            return
        if self.factor == 1.0 or self._conditioned(msg):
            return
        scale = msg["scale"]
        if isinstance(scale, (int, float)) and scale == 1.0:
            msg["scale"] = self.factor
            return
        values = torch.as_tensor(scale, dtype=torch.float64)
        if bool(torch.allclose(values, torch.full_like(values, self.factor), rtol=1e-6, atol=0.0)):
            return  # the model's own N / M
        whole_model = values.numel() == 1 and self._latent_scales == {float(values)}
        if bool((values <= 1.0).all()) or whole_model:
            msg["scale"] = scale * self.factor
            return
        shown = f"{float(values.min()):.4g}" + ("" if values.numel() == 1 else f"..{float(values.max()):.4g}")
        raise ValueError(
            f"the observed site {msg['name']!r} is scaled by {shown} inside the model, and num_data says "
            f"this batch is 1/{self.factor:.4g} of the data (N/M = {self.factor:.4g}): whether that scale "
            "already counts the minibatch cannot be told. Declare the data plate with its subsample "
            "size, pyro.plate('data', N, subsample_size=len(x)), so that Pyro scales the batch (a "
            "poutine.scale inside it then weights the likelihood), or scale by exactly N/M yourself")

    @staticmethod
    def _conditioned(msg) -> bool:
        """Whether a ``pyro.condition`` handler running the model fixes this site: a latent given
        a value (``sigma`` conditioned to 0.1), whose density is in the joint once, whatever the
        batch; not data."""
        return any(isinstance(handler, ConditionMessenger) and handler.data is not None
                   and msg["name"] in handler.data for handler in _PYRO_STACK)

    def _check_declared_size(self, name, frames) -> None:
        if self.num_data is None or self.batch_size is None:
            return
        for frame in frames:
            if frame.size == self.batch_size and frame.full_size != self.num_data:
                raise ValueError(
                    f"the observed site {name!r} lies in the subsampled plate {frame.name!r}, declared "
                    f"with {frame.full_size} points, but the data has {self.num_data} (num_data): Pyro "
                    f"would scale each batch of {frame.size} by {frame.full_size}/{frame.size} instead of "
                    f"{self.num_data}/{frame.size}. Declare pyro.plate({frame.name!r}, N, subsample_size="
                    "len(x)) with N the number of training points (or pass num_data=N for the data "
                    "it stands for)")


def observed_sites(trace, *conditioned):
    """The data sites of a trace of ``poutine.condition(model, data=values)``: ``(name, site)``
    of each observed sample site, in trace order, whose name is in none of ``conditioned``
    (``condition()`` marks the latent sites it fixes as observed too; pass their values, and
    those of any ``pyro.condition`` around the model)."""
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and site["is_observed"] and not any(name in c for c in conditioned):
            yield name, site


def accepts_num_data(model) -> bool:
    """Whether ``model.forward`` takes a ``num_data`` keyword (as :class:`BNN` does)."""
    fwd = getattr(model, "forward", model)
    try:
        return "num_data" in inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False


def call_model(model, x, y, num_data):
    """Args/kwargs and observation scale with which ``model`` sees one minibatch."""
    if num_data is not None and accepts_num_data(model):
        return (x, y), {"num_data": num_data}, 1.0
    factor = 1.0 if num_data is None else num_data / len(x)
    return (x, y), {}, factor


class TraceMeanFieldJacobian_ELBO(TraceMeanField_ELBO):
    """Pyro's ``TraceMeanField_ELBO`` with the log-density of ``Delta`` guide sites kept.

    A guide that draws a constrained latent as ``u ~ N(μ, σ²)`` (an auxiliary site) and
    ``θ = T(u)`` as ``Delta(T(u), log_density=−log|T'(u)|)`` (``AutoNormal``,
    :class:`~pyro_bnn.guides.MeanField`) has ``log q(θ) = log N(u) + log_density``.
    ``TraceMeanField_ELBO`` takes ``KL(Delta ‖ p) = −log p(θ)`` (Pyro's registered KL), which
    drops ``log_density``: for ``σ ~ LogNormal`` its loss was ``E[log σ]`` too high (63.73 for
    Trace_ELBO's 63.10 on 30 points) and its optimum biased (E[log σ] 0.581 for the exact
    posterior's 0.615).  Here ``log_density`` is added back, value and gradient, for every
    latent site whose guide distribution is a ``Delta`` (also inside ``Independent``).

    Pyro's class also weighs each latent's analytic KL by the *guide* site's scale and mask
    only.  A latent that the model masks or scales on its own side (Pyro's ``obs_mask`` splits an
    observation into a masked ``<name>_observed`` site and a latent ``<name>_unobserved`` whose
    model density is masked by ``~obs_mask``; a ``poutine.scale`` around the model only) had its
    KL counted in full, so the loss and its gradient depended on guide values that are not in the
    model (under plain SVI on ``y = 2 x`` with 30 % of 200 targets masked, 2,000 steps at lr
    0.02: the slope's sd 0.0059 for the exact 0.0085); a model-only ``poutine.scale(model,
    0.1)`` tempered the likelihood but not the prior (``Trace_ELBO`` tempers the whole joint).
    Such sites are scored here by their sampled terms as ``Trace_ELBO`` scores them, ``log p`` with the model's
    scale and mask minus ``log q`` with the guide's scale, except that the entries a model masks
    out are not in its joint density, so their guide density is left out as well
    (``Trace_ELBO`` keeps it, and the guide's scales of those entries then grow without bound).
    """

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        weighed = [name for name, site in model_trace.nodes.items()
                   if site["type"] == "sample" and not site["is_observed"]
                   and _model_weighs_otherwise(site, guide_trace.nodes[name])]
        sampled = 0.0
        if weighed:
            # shallow copies; the traces are "flat" (no edges), so removing nodes spares the originals
            model_trace, guide_trace = model_trace.copy(), guide_trace.copy()
            for name in weighed:
                site = model_trace.nodes[name]
                sampled = sampled + site["log_prob_sum"] - _guide_log_density(guide_trace, name, site)
                model_trace.remove_node(name)
        loss, surrogate = super()._differentiable_loss_particle(model_trace, guide_trace)
        if not isinstance(sampled, float):
            loss, surrogate = loss - float(sampled.detach()), surrogate - sampled
        correction = 0.0
        for name, model_site in model_trace.nodes.items():
            if model_site["type"] != "sample" or model_site["is_observed"]:
                continue
            site = guide_trace.nodes[name]
            base = site["fn"]
            while isinstance(base, dist.Independent):
                base = base.base_dist
            if isinstance(base, dist.Delta):
                log_density = site["fn"].log_prob(site["value"])
                correction = correction + scale_and_mask(log_density, site["scale"], site["mask"]).sum()
        if isinstance(correction, float):
            return loss, surrogate
        return loss + float(correction.detach()), surrogate + correction


def _guide_log_density(guide_trace, name: str, model_site: dict) -> torch.Tensor:
    """``log q`` of the guide's draw at ``name`` (and of its auxiliary ``<name>_unconstrained``
    site, if any) with the guide site's scale, masked by the model site's mask and the guide
    site's (as ``Trace_ELBO`` weighs it, but for the entries the model leaves out); both nodes
    are removed from ``guide_trace``."""
    total = 0.0
    for key in (name, f"{name}_unconstrained"):
        site = guide_trace.nodes.get(key)
        if site is None or (key != name and not site["infer"].get("is_auxiliary")):
            continue
        mask = model_site["mask"]
        if site["mask"] is not None:
            mask = site["mask"] if mask is None else mask & site["mask"]
        log_q = site["fn"].log_prob(site["value"])
        total = total + scale_and_mask(log_q, site["scale"], mask).sum()
        guide_trace.remove_node(key)
    return total


def _model_weighs_otherwise(model_site: dict, guide_site: dict) -> bool:
    """Whether the model weighs a latent site by another mask or scale than its guide site
    (then ``TraceMeanField_ELBO``'s KL, weighted by the guide's, is wrong for it)."""
    mask = model_site["mask"]
    if mask is not None and mask is not True and mask is not guide_site["mask"]:
        return True
    mine, theirs = model_site["scale"], guide_site["scale"]
    if torch.is_tensor(mine) or torch.is_tensor(theirs):
        return mine is not theirs
    return mine != theirs


class PyroObjective:
    """Loss ``objective(model, guide, x, y, num_data)`` from a Pyro ELBO.

    Parameters
    ----------
    elbo : pyro.infer.ELBO
        Any Pyro ELBO; its ``differentiable_loss`` is used.
    """

    #: why ``fit(cuda_graph=True)`` cannot capture it (:mod:`pyro_bnn.training.cuda_graph`)
    cuda_graph_unsafe = ("a Pyro ELBO reads every site's log-density into Python (torch_item) at each "
                         "step; pyro_bnn's own guides (MeanField, Hypernet, Symmetrized, Laplace) capture")

    def __init__(self, elbo: pyro.infer.ELBO):
        self.elbo = elbo

    def __call__(self, model, guide, x, y, num_data=None):
        if num_data is not None:  # the batches are scaled here: the guide need not watch them
            end_batch_watches(guide)
        args, kwargs, factor = call_model(model, x, y, num_data)
        scaled = model if num_data is None else scale_observations(factor, num_data, len(x))(model)
        return self.elbo.differentiable_loss(scaled, guide, *args, **kwargs)


def model_arguments(model, args: tuple, kwargs: dict):
    """``(x, y, num_data)`` from the arguments Pyro passes to a model, ``model(x, y, ...)``.

    Accepts ``model(x)``, ``model(x, y)``, ``model(x, y, num_data)`` and the keywords ``x``,
    ``y``, ``num_data`` (the :class:`~pyro_bnn.BNN` signature).

    Raises
    ------
    TypeError
        No input ``x`` or other keywords than these.
    """
    kwargs = dict(kwargs)
    names = ("x", "y", "num_data")
    if len(args) > len(names):
        raise TypeError(f"expected model arguments (x, y=None, num_data=None), got {len(args)} positional ones")
    values = dict(zip(names, args))
    for key in list(kwargs):
        if key not in names:
            raise TypeError(f"unexpected model keyword {key!r}; pyro_bnn objectives pass x, y and num_data")
        if key in values:
            raise TypeError(f"model argument {key!r} given both by position and by keyword")
        values[key] = kwargs.pop(key)
    if values.get("x") is None:
        raise TypeError("the model needs an input x: call svi.step(x, y) (and num_data=N for minibatches)")
    return values["x"], values.get("y"), values.get("num_data")

