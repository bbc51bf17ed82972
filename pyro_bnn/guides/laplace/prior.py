"""Prior precision δ of the Laplace guide: its structures and how it is tuned.

Structures (``Laplace(..., prior_structure=)``), all for the Gaussian prior
``N(0, diag(δ)⁻¹)`` over the sites the Laplace covers.  The Laplace guide *replaces* the
model's prior by this Gaussian (its MAP objective, its posterior precision and its evidence
all use δ), so δ starts from the model's own prior: each covered site's Normal ``1/σ²``.

``"auto"`` (default)
    The smallest structure that holds the model's prior exactly, resolved when the guide is
    set up: ``"scalar"`` if every covered weight has the same prior precision (e.g.
    ``pb.priors.IIDNormal``), else ``"layerwise"`` if it is constant per layer, else
    ``"sitewise"`` if constant per site (Pyro's tutorial regression: weights ``N(0, 1)``,
    bias ``N(0, 10²)``), else ``"diagonal"`` (``"sitewise"`` with a warning under
    ``structure="kron"``).
``"scalar"``
    One δ.
``"layerwise"``
    One δ per Linear/Conv2d layer (weight and bias together).
``"sitewise"``
    One δ per sample site, i.e. per parameter tensor: a weight and its bias get their own
    δ (laplace-torch's "layerwise").  With ``structure="kron"`` and ``kron_bias="joint"`` the
    ``[W, b]`` block is whitened by the per-column δ, exactly (no cross term dropped).
``"diagonal"``
    One δ per weight (``structure="diag"`` or ``"full"``).

Tuning (:meth:`PriorPrecision.optimize_prior_precision`):

``method="marglik"``
    Adam on ``log δ`` maximising the Laplace evidence (MacKay 1992; Immer et al. 2021).
    Any structure; learns a Gaussian likelihood's noise too when it is learnable.
``method="gridsearch"``
    The candidate (a scalar, given to every entry of δ) with the lowest negative log
    predictive density of the GLM predictive on validation data ``val=(x, y)``, as
    laplace-torch's ``optimize_prior_precision(method="gridsearch")``.  The validation
    points must not be part of the data the MAP and the curvature were fitted to.

A structure chosen by the user that cannot hold the model's prior (one δ for sites with
different prior precisions; a non-Normal or non-zero-mean prior) raises a
:class:`PriorMismatchWarning` at set-up that names the sites, unless ``prior_precision=``
was given (then δ is the user's choice).
"""

from __future__ import annotations

import math
import warnings

import torch

from ...arguments import check_int, check_positive
from ...contract.local_params import unwrap_model
from ...curvature import glm_log_predictive, jacobian_factors
from ...curvature import marglik as ml
from ...curvature.glm import batch_covariances
from ...data.batches import check_data
from ...model.batchnorm import layers_feeding_normalization, short_list
from ...model.bnn import model_likelihood
from ...model.likelihoods import Gaussian

__all__ = ["PriorPrecision", "PriorMismatchWarning", "PRIOR_STRUCTURES", "DEFAULT_GRID", "POSTHOC_STEPS",
           "POSTHOC_LR", "resolve_prior_structure", "EVIDENCE_KINDS",
           "check_linearized_evidence", "warn_evidence_under_normalization"]

PRIOR_STRUCTURES = ("auto", "scalar", "layerwise", "sitewise", "diagonal")
#: ``Laplace(..., evidence=)``: at θ* as the mode, or the linearised model's at its own mode.
EVIDENCE_KINDS = ("map", "linearized")


class PriorMismatchWarning(UserWarning):
    """The Laplace guide's Gaussian prior ``N(0, diag(δ)⁻¹)`` is not the model's prior."""


def _constant(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return bool(torch.allclose(flat, flat[0].expand_as(flat), rtol=1e-6, atol=0.0))


def resolve_prior_structure(layers, prior_prec: dict, structure: str) -> str:
    """The smallest δ structure that holds the per-weight prior precisions ``prior_prec``
    (``{site: tensor}``) exactly: ``"scalar"``, ``"layerwise"``, ``"sitewise"`` or
    ``"diagonal"`` (``"sitewise"`` for ``structure="kron"``, which has no per-weight δ)."""
    sites = [s for layer in layers for s in layer.sites]
    if _constant(torch.cat([prior_prec[s].reshape(-1) for s in sites])):
        return "scalar"
    if all(_constant(torch.cat([prior_prec[s].reshape(-1) for s in layer.sites])) for layer in layers):
        return "layerwise"
    if all(_constant(prior_prec[s]) for s in sites) or structure == "kron":
        return "sitewise"
    return "diagonal"


def _describe(t: torch.Tensor) -> str:
    flat = t.reshape(-1)
    if _constant(flat):
        return f"{float(flat[0]):.4g}"
    return f"{float(flat.min()):.4g}–{float(flat.max()):.4g}"

#: laplace-torch's default grid: 100 values of δ from 1e-4 to 1e4, evenly spaced in log δ.
DEFAULT_GRID = (-4.0, 4.0, 100)
#: ``Laplace(..., tune_prior_precision="marglik")``: Adam steps on log δ at the end of ``fit``.
POSTHOC_STEPS, POSTHOC_LR = 300, 0.1


class PriorPrecision:
    """Mixin of :class:`~pyro_bnn.guides.Laplace`: δ's structure, the evidence-based and the
    validation-based tuning.  The host provides ``layers``, ``prior_structure``,
    ``log_prior_precision``, ``posterior``, ``fit_curvature``, ``log_evidence``,
    ``base_model``, ``_linearization`` and ``_kind_and_scale``."""

    # ------------------------------------------------------------- structure
    @property
    def prior_precision(self) -> torch.Tensor:
        """δ: shape ``()``, ``(num_layers,)``, ``(num_sites,)`` or ``(num_params,)``."""
        return self.log_prior_precision.exp()

    @property
    def prior_precision_groups(self) -> list[tuple[str, ...]] | None:
        """The sites each entry of δ covers (``None`` for ``"diagonal"``: one per weight)."""
        if self.prior_structure == "scalar":
            return [tuple(s for layer in self.layers for s in layer.sites)]
        if self.prior_structure == "layerwise":
            return [tuple(layer.sites) for layer in self.layers]
        if self.prior_structure == "sitewise":
            return [(s,) for layer in self.layers for s in layer.sites]
        return None

    def _check_prior_is_represented(self, prior_prec: dict, problems: dict, requested: str,
                                    given) -> None:
        """Warn (:class:`PriorMismatchWarning`) when the guide's Gaussian prior is not the
        model's: a non-Normal / non-zero-mean prior (``problems``: ``{site: text}``), or δ
        of the ``requested`` structure that cannot equal the model's ``1/σ²`` per weight."""
        import warnings

        covered = [s for layer in self.layers for s in layer.sites]
        bad = {s: problems[s] for s in covered if s in problems}
        if bad:
            listed = "; ".join(f"{s!r}: {text}" for s, text in bad.items())
            warnings.warn(
                f"the Laplace guide replaces the model's prior by a Gaussian N(0, 1/δ), which cannot "
                f"represent the prior of {listed}; the MAP, the posterior and the evidence are those of "
                "the Gaussian prior (δ = 1 there unless prior_precision= is given)",
                PriorMismatchWarning, stacklevel=4)
        if given is not None or requested == "auto":
            return
        deltas = [d.detach() for d in self.layer_prior_precisions()]
        mismatch = []
        for layer, d in zip(self.layers, deltas):
            model = layer.flatten({s: prior_prec[s] for s in layer.sites}).reshape(-1)
            ours = d.expand(layer.numel) if d.dim() == 0 else d
            if not torch.allclose(ours.to(model.dtype), model, rtol=1e-5, atol=0.0):
                mismatch += [s for s in layer.sites if s not in bad]
        if mismatch:
            per_site = ", ".join(f"{s!r}: {_describe(prior_prec[s])}" for s in covered)
            fitting = resolve_prior_structure(self.layers, prior_prec, self.structure)
            warnings.warn(
                f"prior_structure={requested!r} cannot represent the model's prior: its Normal "
                f"precisions 1/σ² are {per_site}; the guide's Gaussian prior uses δ = "
                f"{_describe(self.prior_precision.detach())} instead (the mean per group), which "
                "changes the MAP, the posterior and the evidence. Use prior_structure='auto' (the "
                f"default; {fitting!r} here) or pass prior_precision= to choose δ deliberately",
                PriorMismatchWarning, stacklevel=4)

    def _prior_precision_shape(self) -> tuple[int, ...]:
        return {"scalar": (), "layerwise": (len(self.layers),),
                "sitewise": (sum(len(layer.sites) for layer in self.layers),),
                "diagonal": (sum(layer.numel for layer in self.layers),)}[self.prior_structure]

    def _initial_log_prior_precision(self, prior_prec: dict, given=None) -> torch.Tensor:
        """``log δ`` from ``given`` (scalar or the structure's shape) or from the model's
        Normal prior precisions ``prior_prec`` (``{site: tensor}``), averaged per group."""
        per_layer = [torch.cat([prior_prec[s].reshape(-1) for s in layer.sites]) for layer in self.layers]
        ref = per_layer[0]
        shape = self._prior_precision_shape()
        if given is not None:
            v = torch.as_tensor(given, dtype=ref.dtype, device=ref.device)
            if v.dim() == 0:
                v = v.expand(shape)
            if v.shape != shape:
                raise ValueError(f"prior_precision for prior_structure={self.prior_structure!r} must be "
                                 f"scalar or of shape {shape}, got {tuple(v.shape)}")
            return v.log().clone()
        if self.prior_structure == "scalar":
            return torch.cat(per_layer).mean().log()
        if self.prior_structure == "layerwise":
            return torch.stack([p.mean() for p in per_layer]).log()
        if self.prior_structure == "sitewise":
            return torch.stack([prior_prec[s].mean() for layer in self.layers for s in layer.sites]).log()
        # per weight, in each layer's W̃ order
        return torch.cat([layer.flatten({s: prior_prec[s] for s in layer.sites}).reshape(-1)
                          for layer in self.layers]).log()

    def layer_prior_precisions(self, prior_precision: torch.Tensor | None = None) -> list[torch.Tensor]:
        """δ per layer: 0-d tensors, or ``(numel,)`` vectors in the layer's ``W̃`` order
        (per-weight δ, or a weight's and a bias's δ spread over their entries)."""
        d = self.prior_precision if prior_precision is None else prior_precision
        if d.dim() == 0:
            return [d] * len(self.layers)
        if self.prior_structure == "layerwise":
            return list(d.unbind())
        if self.prior_structure == "sitewise":
            out, parts = [], iter(d.unbind())
            for layer in self.layers:
                per_site = {s: next(parts) for s in layer.sites}
                if len(per_site) == 1:
                    out.append(next(iter(per_site.values())))
                else:
                    shapes = {layer.weight: (layer.out_features, layer.in_dim - 1), layer.bias: (layer.out_features,)}
                    out.append(layer.flatten({s: v.expand(shapes[s]) for s, v in per_site.items()}).reshape(-1))
            return out
        return list(d.split([layer.numel for layer in self.layers]))

    def _candidate(self, value) -> torch.Tensor:
        """A grid value as a δ of this guide's structure: a scalar is given to every entry."""
        v = torch.as_tensor(value, dtype=self.log_prior_precision.dtype, device=self.log_prior_precision.device)
        shape = self._prior_precision_shape()
        if v.dim() == 0:
            return v.expand(shape)
        if v.shape != shape:
            raise ValueError(f"a candidate prior precision must be a scalar or of shape {shape}, got {tuple(v.shape)}")
        return v

    # ---------------------------------------------------------------- tuning
    def optimize_prior_precision(self, data=None, *, steps: int = 100, lr: float = 0.1,
                                 learn_noise: bool | None = None, method: str = "marglik",
                                 val=None, grid=None, link_approx: str = "mc",
                                 num_samples: int = 100, batch_size: int | None = None) -> float:
        """Tune δ by the evidence (``method="marglik"``) or on validation data (``"gridsearch"``).

        Parameters
        ----------
        data : (x, y), Dataset or DataLoader, optional
            Training data: the curvature is (re)fitted on it first.  Needed when no
            curvature is fitted yet.
        steps, lr : int, float
            ``"marglik"``: Adam steps on ``log δ`` and their learning rate.
        learn_noise : bool, optional
            ``"marglik"``: also learn a Gaussian likelihood's ``log σ`` (default: when it
            is learnable).
        method : {"marglik", "gridsearch"}
        val : (x_val, y_val) tensors
            ``"gridsearch"``: validation data, not used to fit the MAP or the curvature
            (e.g. a split taken from the training set).
        grid : sequence of float or Tensor, optional
            ``"gridsearch"``: candidate δ (each a scalar given to every entry of δ, or a
            tensor of δ's shape); default 100 values from 1e-4 to 1e4 (log-spaced).
        link_approx : {"mc", "probit"}
            ``"gridsearch"``: the GLM predictive scored; default ``"mc"``, the Monte-Carlo
            GLM predictive that ``pb.evaluate``, ``pb.predict`` and ``guide.predict`` use by
            default (``"probit"``: the ``predictive="glm_probit"``).
        num_samples : int
            ``"gridsearch"`` with ``link_approx="mc"``: function draws per point (common
            random numbers across candidates; the same draws as ``guide.predict`` under
            ``torch.manual_seed(0)`` when the inputs fit in one batch).
        batch_size : int, optional
            Inputs per Jacobian pass (default ``curvature_batch_size``).

        Returns
        -------
        float
            ``"marglik"``: the final log evidence; ``"gridsearch"``: the chosen δ's mean
            validation negative log predictive density.  The grid's losses are kept in
            ``guide.gridsearch_losses`` (``(grid, losses)`` tensors).

        Raises
        ------
        ValueError
            Unknown ``method``; ``"gridsearch"`` without ``val``; no curvature and no data.
        """
        if method not in ("marglik", "gridsearch"):
            raise ValueError(f"method must be 'marglik' or 'gridsearch', got {method!r}")
        steps, lr = check_int("steps", steps, 1), check_positive("lr", lr)
        if data is not None:
            self.fit_curvature(data)
        else:
            self._require_posterior()
        if method == "marglik":
            if val is not None:
                raise ValueError("val= is used by method='gridsearch' only; method='marglik' "
                                 "maximises the evidence of the training data")
            return self.evidence_steps(steps, lr, learn_noise)
        if val is None:
            raise ValueError("method='gridsearch' needs validation data val=(x_val, y_val)")
        x_val, y_val = _as_pair(val)
        if grid is None:
            lo, hi, n = DEFAULT_GRID
            grid = torch.logspace(lo, hi, n, dtype=torch.float64)
        candidates = [self._candidate(v) for v in (grid if not isinstance(grid, torch.Tensor) or grid.dim() > 0
                                                   else grid.reshape(1))]
        if not candidates:
            raise ValueError("grid must hold at least one candidate prior precision")
        if any(not bool((c > 0).all()) for c in candidates):
            raise ValueError("grid values must be > 0")
        losses = self.validation_nll(x_val, y_val, candidates, link_approx=link_approx,
                                     num_samples=num_samples, batch_size=batch_size)
        finite = torch.where(torch.isfinite(losses), losses, torch.full_like(losses, math.inf))
        best = int(torch.argmin(finite))
        if not math.isfinite(float(finite[best])):
            raise ValueError("the validation loss is not finite for any candidate prior precision")
        with torch.no_grad():
            self.log_prior_precision.copy_(candidates[best].log())
        self.gridsearch_losses = (torch.stack(candidates).cpu(), losses.cpu())
        return float(losses[best])

    @torch.no_grad()
    def validation_nll(self, x: torch.Tensor, y: torch.Tensor, prior_precisions=None, *,
                       link_approx: str = "mc", num_samples: int = 100,
                       batch_size: int | None = None, seed: int = 0) -> torch.Tensor:
        """Mean negative log predictive density of the GLM predictive on ``(x, y)``, per δ.

        ``−(1/N) Σ_n log p(y_n | x_n, D)`` with the predictive of
        :func:`~pyro_bnn.curvature.glm_log_predictive` (probit or Monte Carlo for
        classification, the closed-form Gaussian for regression).  The Jacobian factors
        of ``x`` are computed once, and per batch the δ-independent part of ``Σ_f`` (the
        factors or the pruned model's masked Jacobians in the curvature's eigenbasis) once for
        all candidates (:func:`~pyro_bnn.curvature.glm.batch_covariances`).

        Parameters
        ----------
        x, y : Tensor
        prior_precisions : sequence, optional
            Candidate δ (scalars or tensors of δ's shape); default: the current δ.
        link_approx, num_samples, batch_size
            As in :meth:`optimize_prior_precision`.
        seed : int
            Seed of the function draws for ``link_approx="mc"`` (the same for every δ).

        Returns
        -------
        Tensor, shape (K,)
            One value per candidate.
        """
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(f"x and y must be torch.Tensors, got {type(x).__name__} and {type(y).__name__}")
        if len(x) != len(y):
            raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
        x, y = check_data(self.base_model, x, y, where="the validation data of Laplace.validation_nll")
        self._require_posterior()
        cands = [self.prior_precision] if prior_precisions is None else [self._candidate(d) for d in prior_precisions]
        kind, noise, scale = self._kind_and_scale()
        layers, blocks = self.layers, self.posterior.blocks
        with self._linearization() as (run, device):
            factors = list(jacobian_factors(layers, run, x.to(device), batch_size or self.curvature_batch_size,
                                            self._num_augmentations(), dense=self.structure == "full"))
        y = y.to(device)
        masks = self._layer_masks()   # a pruned model's GLM (prune_): the masks' Jacobians
        deltas = [self._block_inputs(d)[1] for d in cands]
        # one generator per candidate, each drawing batch by batch as if it ran alone
        gens = [torch.Generator(device=device).manual_seed(seed) for _ in cands]
        totals, start = [0.0] * len(cands), 0
        for fac in factors:
            m = len(fac.f)
            covs = batch_covariances(layers, blocks, deltas, scale, fac, masks)   # δ-independent work once
            for k, (cov, gen) in enumerate(zip(covs, gens)):
                lp = glm_log_predictive(fac.f, cov, y[start:start + m], kind, link_approx, num_samples,
                                        noise, gen)
                totals[k] = totals[k] + float(lp.double().sum())
            start += m
        return torch.tensor([-total / len(x) for total in totals], dtype=torch.float64)

    def evidence_hyperparameters(self, learn_noise=None):
        """Fresh leaves ``(log δ, log σ or None)`` at the current values, for evidence steps."""
        log_pp = self.log_prior_precision.detach().clone().requires_grad_()
        lik = model_likelihood(self.base_model)
        if learn_noise is None:
            learn_noise = isinstance(lik, Gaussian) and lik.learned
        if learn_noise and not isinstance(lik, Gaussian):
            raise ValueError(f"learn_noise needs a Gaussian likelihood, got {type(lik).__name__}")
        log_noise = lik.log_noise.detach().clone().requires_grad_() if learn_noise else None
        return log_pp, log_noise

    def evidence_steps(self, steps, lr, learn_noise=None, params=None, optimizer=None) -> float:
        """``steps`` Adam steps on the evidence over ``params`` (default: fresh
        :meth:`evidence_hyperparameters`); the result is written into δ (and σ); returns the
        last log evidence.  Warns when the evidence tunes layers that feed a normalisation layer
        (:func:`warn_evidence_under_normalization`)."""
        warn_evidence_under_normalization(self)
        log_pp, log_noise = params or self.evidence_hyperparameters(learn_noise)

        def evidence():
            return self.log_evidence(log_pp.exp(), None if log_noise is None else log_noise.exp())

        leaves = [log_pp] + ([log_noise] if log_noise is not None else [])
        value = ml.maximize_evidence(evidence, leaves, steps, lr, optimizer)
        with torch.no_grad():
            self.log_prior_precision.copy_(log_pp)
            if log_noise is not None:
                self.base_model.likelihood.log_noise.copy_(log_noise)
        return value


def check_linearized_evidence(evidence: str, kind: str | None, structure: str) -> None:
    """``ValueError`` for ``evidence="linearized"`` outside what it is exact for: a Gaussian
    likelihood and the full GGN (``structure="full"``).  ``kind=None`` (the likelihood not
    known yet, at construction) checks the structure only.

    The linearised model's log-likelihood is taken to second order at θ* with the curvature
    ``H``: exact for a Gaussian likelihood and the exact GGN, where the Newton step's fit is
    bounded (``gᵀH⁻¹g`` is the projection of the residuals onto the Jacobian's span).
    Measured outside it (docs/results/laplace.md, "The linearised model's evidence"): for a
    classifier the fit term reached +7,527 nats (Fashion-MNIST BatchNorm CNN, 10,000 images),
    above the 0 no categorical log-likelihood can exceed; with KFAC on a regression MLP
    (diabetes, 10 MAP epochs) the evidence grew without bound in 1 of 5 seeds (3e20 as σ → 0)."""
    if evidence != "linearized":
        return
    if kind is not None and kind != "gaussian":
        raise ValueError(
            f"evidence='linearized' needs a Gaussian likelihood, got a {kind} one: its second-order model of "
            "the linearised log-likelihood is exact only for a Gaussian, and for a classifier it overstates "
            "the fit of the Newton step (measured: a log-likelihood term of +7,527 nats, impossible for a "
            "categorical model). Use evidence='map'")
    if structure != "full":
        raise ValueError(
            f"evidence='linearized' needs structure='full' (the exact GGN), got {structure!r}: with an "
            "approximate curvature the Newton step's fit is not bounded by the data and the evidence can grow "
            "without limit (measured with KFAC: 3e20 as the noise went to 0). Use structure='full' on a small "
            "network, or evidence='map'")


def warn_evidence_under_normalization(guide) -> None:
    """Warn when the evidence will tune the prior of layers that feed a normalisation layer.

    BatchNorm (and LayerNorm, GroupNorm) divide the scale of the layer before them out in
    training, so the likelihood does not depend on that layer's weight norm: under a Gaussian
    prior its MAP shrinks until BatchNorm's eps takes over, and the Laplace evidence is not the
    volume of a posterior mode (Antorán et al. 2022, "Adapting the linearised Laplace model
    evidence for modern deep learning").  Measured on the Fashion-MNIST BatchNorm CNN
    (docs/results/fashion_mnist.md, nineteenth and twentieth sessions): the posterior of the
    layer before the last BatchNorm is the prior in 98 % of its KFAC directions, wide against
    its small weights, and carries 80 % of the GLM predictive's variance; the all-layer online
    marglik is underconfident (test NLL 0.514 against the MAP net's 0.385), training those
    layers with a fixed decay makes it worse (0.753), and with the same online schedule a
    last-layer Laplace beats the MAP net at convergence (120 epochs: 0.334, ECE 0.032); a Laplace
    over BatchNorm's affine parameters and the layers that feed no BatchNorm
    (``subset="unnormalized"``, twenty-first session) does at 60 epochs (0.318, ECE 0.011) but is
    not converged there, and at 120 epochs its ECE (0.065) is above the MAP net's.
    """
    network = unwrap_model(guide.base_model)
    if guide.normalization_feeding is not None:       # read from the guide's set-up run of the model
        feeding = {id(network.get_submodule(path)) for path in guide.normalization_feeding}
    else:
        feeding = {id(layer) for _, layer in layers_feeding_normalization(network, whole_layer=True)}
    names = [layer.path for layer in guide.layers if id(layer.module) in feeding]
    if names:
        warnings.warn(
            f"the Laplace evidence tunes the prior of layers that feed a normalisation layer ({short_list(names)}): "
            "normalisation divides their scale out in training, so their MAP under a Gaussian prior shrinks "
            "without a proper optimum and the Laplace evidence is not the volume of a mode (Antorán et al. "
            "2022); their posterior stays the prior, wide against their small weights, and dominates the GLM "
            "predictive's variance (Fashion-MNIST BatchNorm CNN, online marglik, 60 epochs: test NLL 0.514 "
            "against the MAP net's 0.385; on the last layer alone: 0.334 at 120 epochs, converged; on "
            "BatchNorm's γ, β and the last layer: 0.318 at 60 epochs, not converged). Prefer "
            "subset='last_layer' on normalised networks, or subset='unnormalized' with the normalisation "
            "layers' affine parameters made random (pb.BNN(net, stochastic=...); docs/pyro.md), or keep "
            "the prior precision fixed",
            UserWarning, stacklevel=3)


def _as_pair(val):
    if isinstance(val, (tuple, list)) and len(val) == 2 and all(isinstance(t, torch.Tensor) for t in val):
        return val
    raise TypeError(f"val must be a pair of tensors (x_val, y_val), got {type(val).__name__}")
