"""Laplace guide: MAP by SVI, then ``q(θ) = N(θ*, P⁻¹)`` with GGN curvature (Kron/diag/full).

``P = s·H_GGN + diag(δ)`` (``s = 1/σ²`` for a Gaussian likelihood).  During
:func:`pyro_bnn.fit` the guide is a Delta guide at ``θ`` and its objective is the negative
log joint ``−(N/M) Σ log p(y|f(x; θ)) − log N(θ | 0, δ⁻¹)``; at the end of ``fit`` (or on
``fit_curvature``) the curvature is computed at ``θ*`` and from then on the guide samples
all sites jointly from ``N(θ*, P⁻¹)``.  The prior precision δ (scalar, per layer or per
weight) is the guide's hyperparameter, initialised from the model's Normal prior (1/σ²)
and learned by the Laplace evidence (:mod:`pyro_bnn.curvature.marglik`), post hoc or online.
Math: METHODS.md §4.
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger
from torch import nn

from ...contract.guide import BNNGuide, init_to_network, register_guide
from ...contract.local_params import local_params, unwrap_model
from ...contract.pyro_objective import call_model
from ...curvature import (
    STRUCTURES,
    accumulate_curvature,
    find_layers,
    likelihood_kind,
    network_output,
)
from ...curvature import marglik as ml
from ...data.batches import checked_source, split_batch
from ...model.bnn import is_bnn, model_likelihood, num_augmentations
from ...model.dataflow import recording_normalization_feeding
from ...model.likelihoods import Gaussian
from ...model.modes import evaluation_mode
from ..draw_quantiles import (
    QUANTILE_DRAWS,
    QUANTILE_SEED,
    check_quantiles,
    gaussian_quantiles,
    quantile_draws,
    seeded_generator,
)
from .handlers import held_values, read_handlers
from .objective import LaplaceMAPObjective, gaussian_log_normalizer
from .online import OnlineEvidence, _batches, deterministic_curvature, warn_if_examples_left_out
from .posterior import LaplacePosterior, LinearizedSamples
from .predictive import LinearizedPredictive
from .prior import (
    EVIDENCE_KINDS,
    POSTHOC_LR,
    POSTHOC_STEPS,
    PRIOR_STRUCTURES,
    PriorPrecision,
    check_linearized_evidence,
    resolve_prior_structure,
)
from .sites import (
    NAMED_SUBSETS,
    concat_deltas,
    is_layer_parameter,
    normal_precision,
    point_estimate_transforms,
    refuse_dense_beyond_memory,
    select_sites,
    unwrap_handlers,
)
from .state import CurvatureState, StaleCurvatureWarning

__all__ = ["Laplace", "LinearizedSamples", "StaleCurvatureWarning"]


def _invalidate_after_load(module, keys) -> None:
    """``load_state_dict`` post-hook: the cached curvature no longer matches the state."""
    module._invalidate()


def _key(site: str) -> str:
    return site.replace(".", "__")


class Laplace(PriorPrecision, LinearizedPredictive, BNNGuide, AutoGuide):
    """Laplace approximation of a BNN posterior with GGN curvature.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model; the MAP starts from its network's current weights.
    structure : {"kron", "diag", "full"}
        Curvature: KFAC per layer, diagonal GGN, or full GGN (small nets).
    prior_precision : float or Tensor, optional
        Initial δ; default from the model's Normal prior (``1/σ²`` of each covered site),
        else 1 (with a :class:`~pyro_bnn.guides.laplace.PriorMismatchWarning`).
    prior_structure : {"auto", "scalar", "layerwise", "sitewise", "diagonal"}
        ``"auto"`` (default): the smallest structure that holds the model's Normal prior
        exactly (one δ if all covered sites share it, else per layer, per site or per
        weight), so the guide's Gaussian prior *is* the model's prior and a linear-Gaussian
        model's Laplace is exact.  Or one δ, one per layer, one per sample site (weight and
        bias tensors apart) or one per weight (not with ``"kron"``); a chosen structure that
        cannot hold the model's prior warns (``PriorMismatchWarning``).  Evidence tuning
        (``tune_prior_precision=``, ``optimize_prior_precision``) starts from it; see
        :mod:`pyro_bnn.guides.laplace.prior`.
    curvature_batch_size : int
        Batch size for curvature and the GLM predictive when given tensors.
    kron_bias : {"joint", "separate"}
        KFAC: one Kronecker block per layer for ``[W, b]`` (default, METHODS §4), or the
        bias as its own block without weight-bias cross terms (laplace-torch's convention).
    subset : {"all", "last_layer", "unnormalized"} or iterable of str
        Which sample sites get the Gaussian ``N(θ*, P⁻¹)``: all (default), the sites of
        the last Linear/Conv2d layer that runs (``"last_layer"``, the default of
        laplace-torch / "Laplace Redux"), every site whose scale no normalisation layer
        divides out (``"unnormalized"``: the normalisation layers' affine parameters γ, β —
        random when the model makes them so, ``pb.BNN(net, stochastic=...)`` — and the
        layers that do not feed a BatchNorm/LayerNorm/GroupNorm; the scale-invariant weights
        before a normalisation layer become point estimates; see docs/pyro.md), or the
        named sites.  The other sites are point
        estimates: trained in the MAP phase with their model prior (a fixed Normal
        precision, not learned by the evidence), then held at θ* by draws, the evidence
        and the GLM predictive.  The evidence is then ``log p(D|θ*) + log p(θ*_S) −
        ½ log det(P_S/2π)`` over the subset ``S`` (as laplace-torch's ``LLLaplace``).
        Like every guide it starts at the model's network weights; to take θ* from
        another fitted guide pass ``init_loc_fn=lambda site: other.median()[site["name"]]``.
        *Constrained latent sites* (a hand-written model's noise ``sigma ~ HalfNormal``, a
        hierarchical scale) cannot be covered: the Gaussian needs real-valued weight sites
        of Linear/Conv2d layers, and a constrained site in the subset raises a
        ``ValueError`` naming it at set-up.  Outside the subset such a site is a point
        estimate: stored unconstrained (``biject_to(support)``), trained in the MAP phase
        to the mode of its own prior times the likelihood in its support (no Jacobian, as
        Pyro's ``AutoDelta``), then held fixed; a noise site then gives the curvature its
        observation noise.  Discrete latent sites are rejected.
    obs_site : str, optional
        A hand-written model's observed site, read for the curvature and the GLM predictive
        (default: its one sample site that is not a latent weight, whatever its name; an error
        asks for ``obs_site=`` when there are several).  Not used for a ``pb.BNN``.
    tune_prior_precision : {None, "marglik"}
        ``"marglik"``: at the end of :func:`pyro_bnn.fit`, after the curvature is fitted,
        maximise the evidence w.r.t. δ (``POSTHOC_STEPS`` = 300 Adam steps, lr 0.1; after
        any online schedule).  The registry's ``"laplace"`` and ``"laplace_all"`` use it.
    evidence : {"map", "linearized"}
        Which log evidence :meth:`log_evidence` (and so every evidence tuning of δ) uses.
        ``"map"`` (default): the Laplace-GGN evidence at θ* taken as the posterior mode
        (MacKay 1992, Immer et al. 2021).  ``"linearized"`` (a Gaussian likelihood and
        ``structure="full"``): the evidence of the model linearised at θ*, at that linear
        model's own mode under the current δ and σ (Antorán et al. 2022;
        :func:`pyro_bnn.curvature.marglik.linearized_evidence_terms`), exact for any θ*
        (early-stopped training, δ changed after training; diabetes MLP stopped after 10
        epochs: lower test NLL in 5/5 seeds, ``benchmarks/linearized_evidence.py``).  The
        curvature pass then also sums the gradient of the log-likelihood (one more backward
        pass per batch); the predictive is the same (centred at θ*).  Classifiers and
        approximate curvatures are refused: there the Newton step's quadratic overstates the
        fit, without bound (``check_linearized_evidence``).

    Notes
    -----
    *Which configuration to use* (measured in ``docs/results/laplace.md``, "Issue 16
    targets": MNIST 5k, MLP 784-400-400-10, converged MAPs, 5 seeds).  For the predictive
    uncertainty of a trained classifier prefer ``Laplace(model, "kron", subset="last_layer")``
    + ``optimize_prior_precision(method="gridsearch", val=(x_val, y_val))`` (a validation split
    of the training data) + ``predictive="glm"``: it beat the MAP network on test NLL and ECE in
    5/5 seeds (0.178 / 0.010 vs 0.211 / 0.024).  With δ by the evidence (the default
    ``method="marglik"``, and the registry's ``"laplace"``) the last-layer GLM was
    underconfident and worse than the MAP in 5/5 seeds (0.251 / 0.101); all-layer KFAC at the
    evidence's δ, scalar or per layer, was far worse (NLL 0.62–0.63).  On digits no Laplace
    GLM beat the MAP's NLL (that MAP is itself underconfident).  Online marglik and
    invariance learning (LILA) are formulated with all-layer Laplace.  A pretrained torch
    network can also be wrapped as ``pb.BNN(net, stochastic=["net.4.weight",
    "net.4.bias"])`` (only the last layer random, same Laplace), but then ``fit`` trains the
    other parameters without a prior.

    Examples
    --------
    >>> guide = pb.guides.Laplace(model, structure="kron")            # doctest: +SKIP
    >>> pb.fit(model, guide, (x, y), epochs=20)                        # doctest: +SKIP
    >>> guide.optimize_prior_precision()                               # doctest: +SKIP
    >>> probs = pb.predict(model, guide, x_test, predictive="glm")     # doctest: +SKIP
    >>> ll = pb.guides.Laplace(pb.BNN(trained_net), "kron", subset="last_layer")  # doctest: +SKIP
    >>> ll.fit_curvature((x, y)); ll.optimize_prior_precision()        # doctest: +SKIP
    """

    supports_marglik = True
    bounds_evidence = False  # its training objective is the MAP objective
    linearized = True
    #: the predictive ``pb.compare`` and ``pb.to_arviz`` use by default (linearised, GLM)
    default_predictive = "glm"

    def __init__(self, model, structure: str = "kron", *, prior_precision=None,
                 prior_structure: str = "auto", init_loc_fn=None,
                 curvature_batch_size: int = 256, kron_bias: str = "joint", subset="all",
                 tune_prior_precision: str | None = None, obs_site: str | None = None,
                 evidence: str = "map", create_plates=None):
        if structure not in STRUCTURES:
            raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
        if prior_structure not in PRIOR_STRUCTURES:
            raise ValueError(f"prior_structure must be one of {PRIOR_STRUCTURES}, got {prior_structure!r}")
        if structure == "kron" and prior_structure == "diagonal":
            raise ValueError("structure='kron' supports prior_structure 'scalar', 'layerwise' or "
                             "'sitewise', got 'diagonal' (use structure='diag' or 'full')")
        if kron_bias not in ("joint", "separate"):
            raise ValueError(f"kron_bias must be 'joint' or 'separate', got {kron_bias!r}")
        if evidence not in EVIDENCE_KINDS:
            raise ValueError(f"evidence must be one of {EVIDENCE_KINDS}, got {evidence!r}")
        check_linearized_evidence(evidence, None, structure)
        if tune_prior_precision not in (None, "marglik"):
            raise ValueError(f"tune_prior_precision must be None or 'marglik', got {tune_prior_precision!r}")
        if isinstance(subset, str):
            if subset not in NAMED_SUBSETS:
                raise ValueError(f"subset must be one of {NAMED_SUBSETS} or a list of site names, got {subset!r}")
        else:
            subset = list(subset)
            if not subset or not all(isinstance(s, str) for s in subset):
                raise ValueError(f"subset must be one of {NAMED_SUBSETS} or a non-empty list of site names, "
                                 f"got {subset!r}")
        if prior_precision is not None and not bool((torch.as_tensor(prior_precision) > 0).all()):
            raise ValueError(f"prior_precision must be > 0, got {prior_precision!r}")
        self.init_loc_fn = init_loc_fn or init_to_network(model)
        super().__init__(InitMessenger(self.init_loc_fn)(model), create_plates=create_plates)
        self._wrapped = (model,)                      # a tuple: not a submodule
        self._base_model = (unwrap_handlers(model),)   # a tuple: not registered as a submodule
        self.structure = structure
        self.prior_structure = prior_structure          # "auto" is resolved at set-up
        self._requested_prior_structure = prior_structure
        self.curvature_batch_size = int(curvature_batch_size)
        self.kron_bias = kron_bias
        self.subset = subset
        self.tune_prior_precision = tune_prior_precision
        self.evidence = evidence
        if obs_site is not None and not isinstance(obs_site, str):
            raise TypeError(f"obs_site must be a site name (str) or None, got {type(obs_site).__name__}")
        self.obs_site = obs_site
        self._init_prior_precision = prior_precision
        self._posterior_cache = None     # CurvatureFit once the curvature is fitted
        self.register_load_state_dict_post_hook(_invalidate_after_load)  # a module-level function: picklable
        self._map_mode = False
        self.online: OnlineEvidence | None = None   # during a fit with marglik=
        # what the handlers around the model do (handlers.read_handlers, at set-up)
        self._conditioned_values, self._hidden_sites = {}, []
        #: paths of the layers that fed a normalisation layer in the set-up run (None: not read)
        self.normalization_feeding: tuple[str, ...] | None = None
        self._prior_scale = self._likelihood_scale = 1.0

    def extra_repr(self) -> str:
        """The configuration, as ``pb.compare`` tables and ``print(guide)`` show it."""
        subset = self.subset if isinstance(self.subset, str) else f"{len(self.subset)} sites"
        parts = [f"structure={self.structure}", f"subset={subset}", f"prior={self.prior_structure}"]
        if self.structure == "kron" and self.kron_bias != "joint":
            parts.append(f"kron_bias={self.kron_bias}")
        if self.tune_prior_precision:
            parts.append(f"δ by {self.tune_prior_precision}")
        if self.evidence != "map":
            parts.append(f"evidence={self.evidence}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ setup
    @property
    def base_model(self):
        return self._base_model[0]

    def _setup_prototype(self, *args, **kwargs):
        network = unwrap_model(self.base_model)
        if isinstance(network, nn.Module):
            # the set-up run of the model also tells which layers feed a normalisation layer,
            # including those a PyroModule's own forward wires by hand (torch.fx cannot read it)
            with recording_normalization_feeding(network, whole_layer=True) as record:
                super()._setup_prototype(*args, **kwargs)
            found = record.layers()
            self.normalization_feeding = None if found is None else tuple(path for path, _ in found)
        else:
            super()._setup_prototype(*args, **kwargs)
            self.normalization_feeding = None
        self._set_up_by_this_call = True      # read (once) by forward: a set-up call, not a draw
        self.theta = nn.ParameterDict()
        self.site_shapes: dict[str, torch.Size] = {}
        self._drop_unobserved_observations(args)
        sites = dict(self.prototype_trace.iter_stochastic_nodes())
        # what pyro.condition / poutine.block / poutine.scale around the model do (handlers.py)
        (self._conditioned_values, self._hidden_sites, self._prior_scale,
         self._likelihood_scale) = read_handlers(self, sites, args, kwargs)
        for name, site in sites.items():
            if any(f.full_size not in (None, f.size) for f in site["cond_indep_stack"]):
                raise ValueError(f"Laplace does not support subsampled latent sites; {name!r} is subsampled")
            self.site_shapes[name] = site["value"].shape
        self.laplace_sites = select_sites(self.subset, list(self.site_shapes), network, self.normalization_feeding)
        self.fixed_sites = [s for s in self.site_shapes if s not in self.laplace_sites]
        # point estimates are stored unconstrained: value = transform(theta)
        self._point_transforms = point_estimate_transforms(sites, self.laplace_sites)
        prior_prec, prior_problems = {}, {}
        for name, site in sites.items():
            value = site["value"].detach()
            unconstrained = self._point_transforms[name].inv(value) if name in self._point_transforms else value
            self.theta[_key(name)] = nn.Parameter(unconstrained.detach().clone())
            prior_prec[name], problem = normal_precision(site["fn"], value)
            if problem is not None:
                prior_problems[name] = problem
        self._fixed_priors = {name: sites[name]["fn"] for name in self.fixed_sites}
        try:
            self.layers = find_layers(unwrap_model(self.base_model),  # the module under any handlers
                                      {s: self.site_shapes[s] for s in self.laplace_sites})
        except ValueError as exc:
            if not isinstance(self.base_model, nn.Module):
                raise
            raise ValueError(f"{exc}. Leave such sites out of subset= (e.g. subset='last_layer' or a list "
                             "of the layer sites): the other sites are point estimates") from exc
        if self._requested_prior_structure == "auto":
            self.prior_structure = resolve_prior_structure(self.layers, prior_prec, self.structure)
        self.register_buffer("log_prior_precision",
                             self._initial_log_prior_precision(prior_prec, self._init_prior_precision))
        self._check_prior_is_represented(prior_prec, prior_problems, self._requested_prior_structure,
                                         self._init_prior_precision)
        like = next(iter(self.theta.values()))
        if self.structure == "full":
            refuse_dense_beyond_memory(sum(math.prod(self.site_shapes[s]) for s in self.laplace_sites), like)
        self.curvature_state = CurvatureState(self.layers, self.structure, self.kron_bias == "separate",
                                              self.evidence == "linearized",
                                              torch.empty((), dtype=like.dtype, device=like.device))

    def _drop_unobserved_observations(self, args):
        """A guide set up without targets (``Predictive(model, guide=guide)(x)``) sees the
        observed site sampled: the per-datum sites (in a plate of ``len(x)``) are the
        observation, not latents; ``obs_site=`` names it, else it must be the only one."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        per_datum = [name for name, site in self.prototype_trace.iter_stochastic_nodes()
                     if name == self.obs_site or (x is not None and not is_layer_parameter(self.base_model, name)
                                                  and any(f.vectorized and f.size == len(x)
                                                          for f in site["cond_indep_stack"]))]
        if not per_datum:
            return
        if self.obs_site is None and len(per_datum) > 1:
            raise ValueError(f"expected one observed site in the data plate, got {per_datum}: name the "
                             "observed one with Laplace(..., obs_site=...) (other per-datum latents are "
                             "not supported by the Laplace guide)")
        self.prototype_trace.remove_node(self.obs_site or per_datum[0])

    # ------------------------------------------------------- fitted curvature
    @property
    def posterior(self):
        """The fitted curvature (:class:`~pyro_bnn.curvature.CurvatureFit`) or ``None``.

        Stored in buffers (``curvature_state``), so it survives ``state_dict`` round
        trips and ``.to(device)``; the eigendecompositions are rebuilt on demand.
        """
        if self._posterior_cache is None and "curvature_state" in self._modules:
            self._posterior_cache = self.curvature_state.load()
        return self._posterior_cache

    @posterior.setter
    def posterior(self, fit):
        if "curvature_state" in self._modules:   # first: a fit it refuses is not kept either
            self.curvature_state.store(fit, getattr(self, "_fixed_noise", None))
        self._posterior_cache = fit
        self._mark_fitted_here()

    def _invalidate(self):
        self._posterior_cache = None
        self._mark_fitted_here()

    def _mark_fitted_here(self):
        """Remember θ* of the curvature (a loaded or just fitted one), to tell when it is stale."""
        theta = getattr(self, "theta", None)
        self._theta_at_curvature = None if theta is None else {k: v.detach().clone() for k, v in theta.items()}
        self._stale_warned = False

    def curvature_is_stale(self) -> bool:
        """Whether θ moved (more SVI, other data) since the curvature was fitted at θ*."""
        snap = getattr(self, "_theta_at_curvature", None)
        if snap is None or getattr(self, "theta", None) is None:
            return False
        return any(not torch.equal(snap[k].to(v.device), v.detach()) for k, v in self.theta.items())

    def _warn_if_stale(self, always: bool = False):
        # once per stale curvature under SVI (grad on); at every prediction call (no grad)
        if self.curvature_is_stale() and (always or not (self._stale_warned and torch.is_grad_enabled())):
            self._stale_warned = True
            warnings.warn("the Laplace guide's θ changed since its curvature was fitted (more SVI steps or "
                          "other data): its covariance P⁻¹ is stale, from the old θ*. Call "
                          "guide.fit_curvature((x, y)) again before predicting", StaleCurvatureWarning,
                          stacklevel=3)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._posterior_cache = None
        return out

    def _ensure_setup(self, x, y=None, num_data=None):
        if self.prototype_trace is None:
            args, kwargs, _ = call_model(self.base_model, x, y, num_data or len(x))
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", StaleCurvatureWarning)   # a set-up call, not a draw
                pyro.poutine.block(self)(*args, **kwargs)

    # ------------------------------------------------------------------ values
    def map_values(self) -> dict[str, torch.Tensor]:
        """θ* (the current MAP), ``{site: tensor}``, each in its site's support (a constrained
        point-estimate site is stored unconstrained and mapped through its support here)."""
        transforms = self._point_transforms
        return {name: transforms[name](self.theta[_key(name)]) if name in transforms else self.theta[_key(name)]
                for name in self.site_shapes}

    def fixed_log_prior(self, values: dict) -> torch.Tensor | float:
        """``Σ_s log p(θ_s)`` over the point-estimate sites (outside ``subset``) under their
        model prior; 0 when the Laplace covers every site.

        The prior is :meth:`pyro_bnn.BNN.site_prior` for a ``pb.BNN``, else the site's
        distribution recorded when the guide was set up (its parameters as they were then).
        A constrained site's density is taken in its constrained space (no Jacobian), so its
        point estimate is the MAP of ``p(θ_s)`` itself, as Pyro's ``AutoDelta`` does.
        """
        total = 0.0
        bnn = is_bnn(self.base_model)
        for name in self.fixed_sites:
            prior = self.base_model.site_prior(name) if bnn else self._fixed_priors[name]
            total = total + prior.log_prob(values[name]).sum()
        return total

    def _block_inputs(self, prior_precision=None):
        """θ* and the prior precisions per block (``s·δ`` under a log-density scale ``s``)."""
        deltas = self.layer_prior_precisions(prior_precision)
        if self._prior_scale != 1.0:
            deltas = [self._prior_scale * d for d in deltas]
        theta = [layer.flatten(self.map_values()).reshape(-1).detach() for layer in self.layers]
        if self.structure == "full":
            return [torch.cat(theta)], [concat_deltas(self.layers, deltas)]
        return theta, deltas

    def _block_gradients(self):
        """The curvature pass's log-likelihood gradients per block (``evidence="linearized"``)."""
        grads = self.posterior.gradients
        if grads is None:
            raise ValueError("evidence='linearized' needs the log-likelihood gradient of the curvature pass, "
                             "which this curvature does not hold: call guide.fit_curvature(data) again")
        flat = [g.reshape(-1) for g in grads]
        return [torch.cat(flat)] if self.structure == "full" else flat

    def _kind_and_scale(self, noise=None):
        """``(kind, σ or None, s)``: the curvature's factor ``s`` (``1/σ²`` for a Gaussian
        likelihood) times the likelihood's log-density scale (``poutine.scale``)."""
        kind = self.posterior.kind
        if kind != "gaussian":
            return kind, None, self._likelihood_scale
        if noise is None:
            noise = self._noise()
        return kind, noise, self._likelihood_scale * noise ** -2

    def _noise(self):
        lik = model_likelihood(self.base_model)
        if isinstance(lik, Gaussian):
            return lik.noise.detach()
        return self.curvature_state.noise

    # ------------------------------------------------------------- pyro guide
    def forward(self, *args, **kwargs):
        """Delta at θ (MAP phase); after ``fit_curvature`` one joint draw of N(θ*, P⁻¹)."""
        setting_up = self.prototype_trace is None
        if setting_up:
            self._setup_prototype(*args, **kwargs)
        # set up here or by BNNGuide.__call__ just before: a set-up call, not a draw
        setting_up = self.__dict__.pop("_set_up_by_this_call", False) or setting_up
        plates = self._create_plates(*args, **kwargs)
        if self.posterior is not None and not self._map_mode:
            self._warn_if_stale()
            values = self._joint_draw()
        else:
            if not (self._map_mode or setting_up or torch.is_grad_enabled()):
                # Predictive (no grad) of a guide without curvature: say so, not a silent point mass
                warnings.warn("the Laplace guide's curvature is not fitted: its draws are a point mass at θ "
                              "(the MAP). Call guide.fit_curvature((x, y)) after training with SVI "
                              "(pb.fit does this at its end)", StaleCurvatureWarning, stacklevel=2)
            values = self.map_values()
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                result[name] = pyro.sample(name, dist.Delta(values[name], event_dim=site["fn"].event_dim))
        return result

    def _joint_draw(self):
        """One draw ``θ* + P^{-1/2} ε`` for all sites, through an auxiliary sample site
        ``_laplace_latent`` that carries the Gaussian ``N(θ*, P⁻¹)`` (so ``poutine.replay`` and
        trace log densities give ``log q``).  The draw is reparameterised in θ: SVI after
        ``fit_curvature`` moves θ (and then marks the curvature stale)."""
        theta_star = self.map_values()
        posterior = LaplacePosterior(self, theta_star)
        flat = pyro.sample("_laplace_latent", posterior, infer={"is_auxiliary": True})
        values = {name: theta_star[name] for name in self.fixed_sites}
        values.update(posterior.unpack(flat))
        return values

    def log_density(self, values: dict) -> torch.Tensor:
        """``log N(θ | θ*, P⁻¹)`` (0-d) of a joint draw ``{site: tensor}`` over the Laplace
        sites (the point-estimate sites are held at θ*)."""
        self._require_posterior()
        theta_star = {k: v.detach() for k, v in self.map_values().items()}
        posterior = LaplacePosterior(self, theta_star)
        flat = torch.cat([layer.flatten(values).reshape(-1) for layer in self.layers])
        return posterior.log_prob(flat)

    @torch.no_grad()
    def _draw_offsets(self, num: int, generator: torch.Generator | None = None):
        """``num`` draws of ``θ − θ*`` per Laplace layer (``(num, out, in')``, ``W̃`` layout)
        from ``N(0, P⁻¹)``, and ``log N(θ | θ*, P⁻¹)`` of each, shape ``(num,)``."""
        theta, deltas = self._block_inputs()
        _, _, scale = self._kind_and_scale()
        log_q, draws = 0.0, []
        for block, th, d in zip(self.posterior.blocks, theta, deltas):
            eps = torch.randn(num, block.numel, dtype=th.dtype, device=th.device, generator=generator)
            draws.append(block.sample(eps, d, scale))
            log_q = log_q - 0.5 * (eps ** 2).sum(-1) + 0.5 * block.logdet(d, scale) \
                - 0.5 * block.numel * math.log(2 * math.pi)
        flat = torch.cat(draws, -1)
        parts = flat.split([layer.numel for layer in self.layers], -1)
        return [p.reshape(num, *layer.shape) for layer, p in zip(self.layers, parts)], log_q

    # ---- pb.fit hooks: MAP phase, then the curvature (and online evidence with marglik=)
    def on_fit_start(self, ctx):
        self._map_mode = True
        options = ml.check_marglik_options(ctx.options.get("marglik"))
        self.online = OnlineEvidence(self, options) if options else None

    def on_epoch_end(self, ctx):
        if self.online is not None:
            self.online.after_epoch(ctx)

    def on_fit_abort(self, ctx):
        """A fit stopped by an exception: the guide leaves MAP mode (its draws are no longer a
        silent point mass) and the fit's online-evidence state is dropped.  A curvature from an
        earlier fit is now stale and its draws warn so; without one, Predictive warns that the
        curvature is not fitted."""
        self._map_mode = False
        self.online = None

    def on_fit_end(self, ctx):
        self._map_mode = False
        if self.online is not None:
            self.online.finish(ctx)
            self.online = None
        deterministic_curvature(self, ctx)
        if self.tune_prior_precision == "marglik":
            ctx.history["posthoc_log_evidence"] = [self.evidence_steps(POSTHOC_STEPS, POSTHOC_LR)]

    def fit_state(self) -> dict:
        """The online-evidence state for ``fit(..., resume=True)`` (empty without ``marglik=``)."""
        return {} if self.online is None else self.online.state_dict()

    def load_fit_state(self, state: dict) -> None:
        if bool(state) != (self.online is not None):
            has = "holds" if state else "holds no"
            wants = "has" if self.online is not None else "has no"
            raise ValueError(f"the checkpoint {has} online-evidence state, but this fit {wants} marglik=")
        if state:
            self.online.load_state_dict(state)

    def prediction_problem(self) -> str | None:
        """Not ready before the curvature is fitted: until then the guide is a point mass at θ."""
        problem = super().prediction_problem()
        if problem is None and self.posterior is None:
            return ("the Laplace guide's curvature is not fitted yet (until then it is a point mass "
                    "at the MAP): call guide.fit_curvature((x, y)) after training it with SVI; pb.fit "
                    "does this at its end")
        return problem

    def median(self, *args, **kwargs):
        """θ*, ``{site: tensor}``: the median of the Gaussian posterior (and of the point estimates)."""
        return {k: v.detach() for k, v in self.map_values().items()}

    def quantiles(self, quantiles, *args, num_samples: int = QUANTILE_DRAWS, seed: int = QUANTILE_SEED,
                  **kwargs) -> dict[str, torch.Tensor]:
        """Per-coordinate quantiles of ``N(θ*, P⁻¹)``, ``{site: (len(quantiles), *shape)}``
        (Pyro's ``AutoContinuous.quantiles`` signature; the model's ``*args`` are not needed).

        ``θ* + σ̂ Φ⁻¹(q)`` with each weight's marginal σ̂ estimated from ``num_samples`` joint
        draws of a generator seeded by ``seed`` (the KFAC blocks' marginal variances are not
        formed in closed form): reproducible, the global random streams untouched, relative
        error of σ̂ ≈ 1/√(2·num_samples) (2 % with the default 1,000).  Point-estimate sites
        repeat θ*.

        Raises
        ------
        ValueError
            The curvature is not fitted yet.
        """
        self._require_posterior()
        theta_star = {k: v.detach() for k, v in self.map_values().items()}
        posterior = LaplacePosterior(self, theta_star)
        q = check_quantiles(quantiles, posterior.loc)
        num = quantile_draws(num_samples)
        with torch.no_grad():
            flat = posterior.draws(num, generator=seeded_generator(posterior.loc, seed))
            rows = [posterior.unpack(row) for row in gaussian_quantiles(posterior.loc, flat, q)]
        out = {name: theta_star[name].expand(len(q), *theta_star[name].shape).clone() for name in self.fixed_sites}
        out.update({name: torch.stack([row[name] for row in rows]) for name in rows[0]})
        return out

    def make_objective(self, num_particles: int = 1):
        return LaplaceMAPObjective()

    # -------------------------------------------------------------- curvature
    def fit_curvature(self, data, batch_size: int | None = None, reduce_fn=None) -> Laplace:
        """Compute the GGN curvature at the current θ over ``data``; returns ``self``.

        ``data``: ``(x, y)`` tensors, a Dataset or a DataLoader.  ``reduce_fn`` (optional)
        all-reduces the flat dict of curvature sums before they are finalised.
        """
        model = self.base_model
        data = checked_source(model, data, where="Laplace.fit_curvature")
        first = next(iter(_batches(data, batch_size, model, self.curvature_batch_size)))
        x0, y0 = split_batch(first)
        device = self._device(x0)
        with local_params(model, self), evaluation_mode(unwrap_model(model), self):
            self._ensure_setup(x0.to(device), None if y0 is None else y0.to(device))
        held = held_values(self)     # outside local_params: another guide's median
        # eval mode: BatchNorm uses (and keeps) its running statistics, Dropout is off
        with local_params(model, self), evaluation_mode(unwrap_model(model), self):
            values = {k: v.detach().requires_grad_() for k, v in self.map_values().items()}
            values.update(held)
            kind, noise = likelihood_kind(model, values, x0[:2].to(device), self.obs_site)
            check_linearized_evidence(self.evidence, kind, self.structure)
            self._fixed_noise = None if noise is None else noise.detach()
            loader = _batches(data, batch_size, model, self.curvature_batch_size)
            self.posterior = accumulate_curvature(
                self.layers, loader, lambda x: network_output(model, values, x, self.obs_site), kind,
                self.structure, device=device, reduce_fn=reduce_fn, model=model,
                num_augmentations=num_augmentations(model),
                split_bias=self.kron_bias == "separate", gradient=self.evidence == "linearized")
        warn_if_examples_left_out(data, self.posterior.num_data)
        return self

    def _device(self, x):
        return next(iter(self.theta.values())).device if self.prototype_trace is not None else x.device

    def _require_posterior(self):
        if self.posterior is None:
            raise ValueError("the curvature is not fitted yet: call guide.fit_curvature(data) or pb.fit first")

    def log_evidence(self, prior_precision: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
        """Laplace-GGN log marginal likelihood (0-d tensor, differentiable in δ and σ).

        ``log p(D) ≈ log p(D|θ*) − ½[log det P − log det P₀ + θ*ᵀP₀θ*]`` (see
        :func:`pyro_bnn.curvature.marglik.log_evidence`), at the guide's δ and σ unless given;
        its terms one by one: :meth:`evidence_terms`.
        """
        return ml.combine_evidence_terms(self.evidence_terms(prior_precision, noise))

    def evidence_terms(self, prior_precision: torch.Tensor | None = None,
                       noise: torch.Tensor | None = None) -> dict:
        """The terms of :meth:`log_evidence` (0-d tensors, differentiable in δ and σ).

        Returns
        -------
        dict of str to Tensor
            ``"log_likelihood"`` (``log p(D|θ*)``), ``"log_det_ratio"`` (``log det P − log
            det P₀``, the Occam factor) and ``"scatter"`` (``θ*ᵀP₀θ*``), as in
            :func:`pyro_bnn.curvature.marglik.evidence_terms`; the log evidence is
            ``log_likelihood − ½ (log_det_ratio + scatter)``.  Under a log-density scale of
            the prior (``poutine.scale``) the normaliser's correction is part of
            ``log_det_ratio``.
        """
        self._require_posterior()
        theta, deltas = self._block_inputs(prior_precision)
        kind, noise, scale = self._kind_and_scale(noise)
        log_lik = self._likelihood_scale * ml.log_likelihood_from_stats(self.posterior.loglik_stats, noise)
        if self.evidence == "linearized":
            check_linearized_evidence(self.evidence, kind, self.structure)
            terms = ml.linearized_evidence_terms(log_lik, self.posterior.blocks, theta,
                                                 self._block_gradients(), deltas, scale)
        else:
            terms = ml.evidence_terms(log_lik, self.posterior.blocks, theta, deltas, scale)
        if self._prior_scale != 1.0:
            # the Laplace of p(y, θ)^s: its prior term is s·log N(θ | 0, δ⁻¹), whose normaliser
            # differs from that of N(θ | 0, (sδ)⁻¹) (the one ml.evidence_terms includes)
            unscaled = self.layer_prior_precisions(prior_precision)
            correction = self._prior_scale * gaussian_log_normalizer(self.layers, unscaled) \
                - gaussian_log_normalizer(self.layers, [self._prior_scale * d for d in unscaled])
            terms["log_det_ratio"] = terms["log_det_ratio"] - 2.0 * correction
        return terms


def _laplace_last_layer(model, **options):
    """Registry ``"laplace"``: best practice for a trained classifier (laplace-torch's default,
    Daxberger et al. 2021) — last-layer KFAC, δ by the evidence after ``fit``, GLM predictive."""
    return Laplace(model, **{"structure": "kron", "subset": "last_layer", "tune_prior_precision": "marglik",
                             **options})


def _laplace_all_layers(model, **options):
    """Registry ``"laplace_all"``: all-layer KFAC, δ by the evidence after ``fit``, GLM predictive."""
    return Laplace(model, **{"structure": "kron", "subset": "all", "tune_prior_precision": "marglik", **options})


register_guide("laplace", _laplace_last_layer)
register_guide("laplace_all", _laplace_all_layers)
