"""The prior precision of weight-norm scales, learned from the Laplace evidence (issue 26).

In a weight-norm BNN (``pb.BNN(net, weight_norm=True)``) a :class:`~pyro_bnn.guides.Hypernet`
puts its flow over the scales ``g`` only; the directions ``v`` and the biases ``b`` are point
estimates.  With the prior ``g_j ~ N(0, 1/λ_l)`` on the rows of layer ``l`` the model's log
density carries ``−½ λ_l g_j² = −½ λ_l ‖w_j‖²``, the L2 penalty of a MAP net: ``λ_l`` decides
how far the maximum-likelihood directions may memorise.  The Hypernet's own ELBO cannot choose
it (it does not see the directions' complexity and prefers the weak prior;
``docs/results/fmnist_guides.md``), so it is taken from the evidence of a model that
integrates every weight: the KFAC Laplace-GGN evidence (:mod:`pyro_bnn.curvature.marglik`) of
the guide's *mean network* ``w_j = E_q[g_j] v_j/‖v_j‖`` with biases ``b``, under the Gaussian
prior ``N(0, I/δ_l)`` on every weight and bias of layer ``l`` — the layer-wise prior of
``pb.guides.Laplace(..., prior_structure="layerwise")``::

    log p(D | δ) ≈ log p(D | w) − ½ Σ_l [log det(s H_l + δ_l I) − n_l log δ_l + δ_l ‖w̃_l‖²]

(``H_l`` the KFAC GGN of layer ``l``, ``w̃_l = [W_l, b_l]`` with ``n_l`` entries, ``s = 1/σ²``
for a Gaussian likelihood, else 1), maximised over ``log δ`` by Adam
(:func:`~pyro_bnn.curvature.marglik.maximize_evidence`).  Each ``δ_l`` then becomes the
precision of the scales' prior of layer ``l``, ``g_j ~ N(0, 1/δ_l)``: the mean network's rows
get the penalty ``½ δ_l ‖w_j‖²`` of the Laplace model.  (The two priors share that penalty,
not their densities: the weight-norm model has no Jacobian ``‖w_j‖^(fan_in − 1)`` of the polar
coordinates, its rows are not Gaussian a priori.)

Why the mean: ``w`` is linear in ``g`` at fixed ``v``, so ``E_q[g]·v/‖v‖`` is exactly the
mean weight under ``q``, the network around which the guide's predictive spreads.  It is
estimated from ``num_samples`` draws of the flow with their own seeded generator: a
deterministic function of the guide's parameters (a resumed fit repeats it) that leaves the
caller's random streams as they were.  (The flow's image of the base mode, ``h(0)``, is not
the mean, nor in general a mode, of a non-volume-preserving flow.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from ..arguments import check_int
from ..curvature import Layer, accumulate_curvature, find_layers, likelihood_kind, network_output
from ..curvature import marglik as ml
from ..data.batches import TensorBatches, checked_source, make_loader, split_batch
from ..model.bnn import is_bnn, normal_prior_params, site_module, site_prior_modules, weight_norm_of
from ..model.devices import module_device
from ..model.modes import evaluation_mode
from ..model.weight_norm import is_weight_norm_layer, weight_norm_weight
from .prior_scale import own_normal_priors_

__all__ = ["EvidenceUpdate", "ScalePriorSchedule", "PRIOR_STRUCTURES", "MEAN_DRAWS", "MEAN_SEED", "CURVATURE_BATCH_SIZE",
           "check_evidence_model", "flow_mean", "scale_layers", "mean_network_values",
           "evidence_prior_precisions", "update_scale_priors_", "scale_prior_precisions",
           "set_scale_prior_precisions_", "curvature_batches"]

#: Draws of the flow that estimate ``E_q[g]`` (standard error ``σ_g/√1000``, 3 % of q's spread)
MEAN_DRAWS = 1000
#: Seed of the generator of those draws (their own generator: no global random stream is used)
MEAN_SEED = 20_261_203
#: ``Hypernet(prior_structure=)``: one δ for all weight-norm layers (its default), or one per layer
PRIOR_STRUCTURES = ("scalar", "layerwise")
#: Inputs per forward pass of the curvature pass over the training data
CURVATURE_BATCH_SIZE = 1024
#: Draws per pass of the flow in :func:`flow_mean` (its activations grow with the draws)
_MEAN_CHUNK = 256


class EvidenceUpdate(NamedTuple):
    """Result of one evidence update of the scales' prior.

    Attributes
    ----------
    prior_precision : dict
        ``{scale site: δ_l}``, the new precision of each weight-norm layer's ``g`` prior.
    log_evidence : float
        The KFAC Laplace log evidence of the mean network at those δ (a total over the data,
        in nats).
    """

    prior_precision: dict[str, float]
    log_evidence: float


def check_evidence_model(model, sites: Iterable[str]) -> None:
    """Raise unless ``model`` can take evidence-learned scale priors: a weight-norm
    :class:`pyro_bnn.BNN` whose random sites ``sites`` are all ``weight_g`` of weight-norm
    Linear/Conv2d layers, each with a zero-mean i.i.d. Normal prior.

    Raises
    ------
    ValueError
        What was expected and what the model has.
    """
    if not is_bnn(model) or weight_norm_of(model) is not True:
        raise ValueError("the scales' prior precision by the Laplace evidence needs a weight-norm "
                         "pb.BNN(net, weight_norm=True) (only the scales g random); got "
                         f"{type(model).__name__}" + ("" if not is_bnn(model) else " with weight_norm=False"))
    for site in sites:
        module, leaf = site_module(model, site)
        if leaf == "weight_v" and is_weight_norm_layer(module):
            raise ValueError("the scales' prior precision by the Laplace evidence is for point-estimated "
                             f"directions; this model's directions are random (site {site!r}: "
                             "pb.BNN(..., random_directions=True))")
        if leaf != "weight_g" or not is_weight_norm_layer(module):
            raise ValueError(f"the scales' prior precision by the Laplace evidence applies to the scales g "
                             f"of weight-norm layers only; site {site!r} is not one")
        params = normal_prior_params(model, site)
        if params is None or params[0].numel() != 1 or params[1].numel() != 1:
            raise ValueError(f"the scales' prior precision by the Laplace evidence needs an i.i.d. Normal "
                             f"prior N(0, 1/λ) on every scale site; site {site!r} has "
                             f"{site_prior_modules(model)[site]!r}")
        if float(params[0]) != 0.0:
            raise ValueError(f"the Laplace evidence is that of a zero-mean Gaussian prior; site {site!r} has "
                             f"prior mean {float(params[0]):g}, expected 0")


def scale_layers(model, sites: Iterable[str]) -> list[tuple[str, Layer]]:
    """``(scale site, curvature layer)`` per weight-norm layer, in the order of ``sites``.

    Each :class:`~pyro_bnn.curvature.Layer` groups the layer's weight ``W = g v/‖v‖`` and its
    bias under the names ``"<path>.weight"`` and ``"<path>.bias"`` (the sites a plain
    ``pb.BNN`` of the same network has), so that
    :func:`~pyro_bnn.curvature.accumulate_curvature` hooks the module and
    :meth:`~pyro_bnn.curvature.Layer.flatten` reads :func:`mean_network_values`.
    """
    pairs = []
    for site in sites:
        module, _ = site_module(model, site)
        path = site.rpartition(".")[0]
        shapes = {f"{path}.weight": module.weight_v.shape}
        if module.bias is not None:
            shapes[f"{path}.bias"] = module.bias.shape
        (layer,) = find_layers(model, shapes)
        pairs.append((site, layer))
    return pairs


def mean_network_values(pairs: list[tuple[str, Layer]], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"<path>.weight": g v/‖v‖, "<path>.bias": b}`` of each layer of ``pairs``
    (:func:`scale_layers`) at the scales ``scales`` (``{scale site: (out,)}``), detached."""
    values = {}
    for site, layer in pairs:
        module = layer.module
        values[layer.weight] = weight_norm_weight(scales[site].detach(), module.weight_v.detach())
        if layer.bias is not None:
            values[layer.bias] = module.bias.detach()
    return values


def evidence_prior_precisions(model, scales: dict[str, torch.Tensor], data, initial: dict[str, float], *,
                              steps: int = 100, lr: float = 0.1, structure: str = "layerwise",
                              device=None) -> EvidenceUpdate:
    """The prior precisions ``δ`` that maximise the KFAC Laplace evidence of the weight-norm
    network at the scales ``scales`` (module docstring): one per layer, or one for all layers.

    Parameters
    ----------
    model : pyro_bnn.BNN
        Weight-norm (:func:`check_evidence_model`); its directions and biases are read as they are.
    scales : dict
        ``{scale site: (out,) tensor}``, e.g. ``E_q[g]``.
    data : iterable of (x, y)
        Batches over the training data (one pass; the sums do not depend on their order).
    initial : dict
        ``{scale site: δ}`` where the Adam steps start (e.g. the current prior precisions).
    steps, lr : int, float
        Adam steps on ``log δ`` and their learning rate.
    structure : {"layerwise", "scalar"}
        One δ per layer (``Laplace(prior_structure="layerwise")``) or one δ shared by every layer
        (``"scalar"``; it starts at the geometric mean of ``initial``).
    device : torch.device, optional
        Where the batches are moved.

    Returns
    -------
    EvidenceUpdate
        The new ``{scale site: δ}`` and the log evidence there.
    """
    pairs = scale_layers(model, list(scales))
    layers = [layer for _, layer in pairs]
    # the weights must require grad: the hooks pull the output gradients back through them
    values = {site: g.detach().requires_grad_() for site, g in scales.items()}
    batches = iter(data)
    first = next(batches, None)
    if first is None:
        raise ValueError("no data: the curvature pass got no batch")
    x0 = split_batch(first)[0]
    x0 = x0 if device is None else x0.to(device)
    kind, noise = likelihood_kind(model, values, x0[:2])
    noise = None if noise is None else noise.detach()
    fit = accumulate_curvature(layers, _chain(first, batches), lambda x: network_output(model, values, x), kind,
                               "kron", device=device, where="the data of the scales' evidence update", model=model)
    log_lik = ml.log_likelihood_from_stats(fit.loglik_stats, noise)
    scale = 1.0 if noise is None else noise ** -2
    weights = mean_network_values(pairs, scales)
    theta = [layer.flatten(weights).reshape(-1) for layer in layers]
    ref = theta[0]
    log_delta = torch.tensor([float(initial[site]) for site, _ in pairs], dtype=ref.dtype, device=ref.device).log()
    if structure == "scalar":
        log_delta = log_delta.mean()
    log_delta.requires_grad_()

    def evidence():
        delta = log_delta.exp()
        per_layer = [delta] * len(layers) if delta.dim() == 0 else list(delta.unbind())
        return ml.log_evidence(log_lik, fit.blocks, theta, per_layer, scale)

    value = ml.maximize_evidence(evidence, [log_delta], steps, lr)
    deltas = log_delta.detach().exp().expand(len(layers)).tolist()
    return EvidenceUpdate({site: d for (site, _), d in zip(pairs, deltas)}, value)


def _chain(first, rest):
    yield first
    yield from rest


def scale_prior_precisions(model, sites: Iterable[str]) -> dict[str, float]:
    """``{site: 1/s²}`` of the Normal priors ``N(0, s²)`` on ``sites``."""
    return {site: float(normal_prior_params(model, site)[1]) ** -2 for site in sites}


@torch.no_grad()
def set_scale_prior_precisions_(model, precisions: dict[str, float]) -> None:
    """Set each site's prior to ``N(0, 1/δ)`` (in place; each site gets its own
    :class:`~pyro_bnn.model.priors.IIDNormal` first, :func:`~pyro_bnn.guides.prior_scale.own_normal_priors_`)."""
    own_normal_priors_(model)
    modules = site_prior_modules(model)
    for site, delta in precisions.items():
        scale = modules[site].scale
        scale.copy_(torch.as_tensor(float(delta), dtype=torch.float64).rsqrt().to(scale))


def curvature_batches(data, model, *, batch_size: int = CURVATURE_BATCH_SIZE, where: str):
    """One unshuffled pass over ``data``: tensors (``(x, y)``, a ``TensorDataset``) or fit's
    in-memory batches are re-batched by ``batch_size``; a ``DataLoader`` is read as it is."""
    if isinstance(data, TensorBatches):
        return TensorBatches(data.x, data.y, batch_size, shuffle=False)
    data = checked_source(model, data, where=where)
    return make_loader(data, batch_size, shuffle=False)


@torch.no_grad()
def flow_mean(flow, num_samples: int = MEAN_DRAWS, seed: int = MEAN_SEED) -> torch.Tensor:
    """``(1/S) Σ_s h(ε_s)``: the Monte-Carlo mean of a
    :class:`~pyro_bnn.guides.hypernet_flows.HypernetFlow`'s packed draws, ``(D,)``, from
    ``S = num_samples`` base draws of a ``torch.Generator`` seeded by ``seed`` (the global random
    streams are not used)."""
    num_samples = check_int("num_samples", num_samples, 1)
    loc = flow.affine.loc
    generator = torch.Generator(device=loc.device).manual_seed(int(seed))
    total, done = torch.zeros_like(loc), 0
    while done < num_samples:
        size = min(_MEAN_CHUNK, num_samples - done)
        eps = torch.randn(size, flow.dim, generator=generator, dtype=loc.dtype, device=loc.device)
        total += flow.rsample_with_log_prob(eps=eps)[0].sum(0)
        done += size
    return total / num_samples


def update_scale_priors_(model, scales: dict[str, torch.Tensor], batches, *, steps: int, lr: float,
                         structure: str = "layerwise") -> EvidenceUpdate:
    """One update: :func:`evidence_prior_precisions` from the current prior precisions (in eval
    mode, the global random streams kept: a ``DataLoader``'s shuffling draws from them), then
    :func:`set_scale_prior_precisions_`."""
    device = module_device(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), evaluation_mode(model):
        update = evidence_prior_precisions(model, scales, batches, scale_prior_precisions(model, list(scales)),
                                           steps=steps, lr=lr, structure=structure, device=device)
    set_scale_prior_precisions_(model, update.prior_precision)
    return update


class ScalePriorSchedule:
    """The evidence schedule of one :func:`pyro_bnn.fit` of a Hypernet with ``marglik=``.

    Made by the guide's ``on_fit_start`` (which checks the model and gives each scale site its
    own prior module, before a resumed fit loads the learned ones from its checkpoint) and
    dropped at ``on_fit_end``.  Before epoch ``e`` it runs the update due after epoch ``e − 1``
    (:func:`~pyro_bnn.curvature.marglik.marglik_due`) through the guide's
    ``update_prior_precision_`` and records ``history["scale_prior_precision"]`` (δ per layer
    in force during epoch ``e``) and ``history["mean_network_log_evidence"]`` (that update's
    log evidence, NaN where none).  Its only state is the learned δ, which lives in the
    model's prior buffers: nothing else to checkpoint.

    Parameters
    ----------
    guide : pyro_bnn.guides.Hypernet
    options : pyro_bnn.MarglikOptions
    ctx : FitContext
    """

    def __init__(self, guide, options: ml.MarglikOptions, ctx):
        if ctx.distributed is not None:
            raise NotImplementedError("the scales' prior by the Laplace evidence (Hypernet with marglik=) "
                                      "is not supported with distributed= yet")
        self.guide, self.options = guide, options
        own_normal_priors_(guide.evidence_model())

    def before_epoch(self, ctx) -> None:
        guide, options = self.guide, self.options
        value = math.nan
        if ml.marglik_due(ctx.epoch - 1, options):
            value = guide.update_prior_precision_(ctx.loader, steps=options.steps, lr=options.lr).log_evidence
        precisions = scale_prior_precisions(guide.evidence_model(), guide.site_names())
        ctx.history.setdefault("scale_prior_precision", []).append(list(precisions.values()))
        ctx.history.setdefault("mean_network_log_evidence", []).append(value)
