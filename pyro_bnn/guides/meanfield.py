"""Mean-field Gaussian guide (Bayes by Backprop, Blundell et al. 2015).

``q(w) = Π_i N(w_i | μ_i, σ_i²)``, ``σ = exp(ρ)`` (or ``softplus(ρ)``), built on Pyro's ``AutoNormal``:

* locations start at the network's current weights (pretrained nets work);
* the initial σ is small and configurable (``init_scale``);
* the KL term is computed in closed form where the prior is Normal (Monte Carlo for the
  scale-mixture prior);
* optional per-example weight noise for Linear/Conv layers (:mod:`.local_reparam_forward`):
  local reparameterisation (Kingma et al. 2015) on Linear layers, sampling pre-activations
  ``N(x μ, x² σ²)``, and Flipout (Wen et al. 2018) on convolutions — lower-variance gradients
  of the same ELBO.
* optional empirical-Bayes prior scales (``learn_prior_scale``): each site's Normal prior
  scale set to its closed-form ELBO optimum after every epoch (:mod:`.prior_scale`).

For a :class:`pyro_bnn.BNN` the objective bypasses Pyro's tracing (the weights are put
straight into the ``PyroModule`` sample cache); it computes the same ELBO as
``TraceMeanField_ELBO`` (tested) at a fraction of the per-step overhead.
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from torch.distributions import kl_divergence

from ..arguments import check_bool, check_positive
from ..contract.guide import BNNGuide, init_to_network, register_guide
from ..contract.objective import GuideObjective
from ..contract.param_store import global_param_mode
from ..contract.pyro_objective import PyroObjective, TraceMeanFieldJacobian_ELBO
from ..model.batchnorm import convolutions_without_normalization, random_convolutions
from ..model.bnn import BAYESIAN_LAYERS, augmentation_of, is_bnn, network_of, normal_prior_params, site_module
from ..model.likelihoods import log_likelihood
from ..model.weight_masks import weight_masks
from ._fused_gaussian import (
    can_fuse,
    can_fuse_kl,
    can_fuse_kl_sites,
    normal_kl_node,
    normal_kl_node_log_scale,
    normal_kl_sites_log_scale,
    sample_and_kl,
)
from .direct_forward import direct_calls_allowed
from .local_reparam_forward import (
    PerExampleNoiseError,
    install_layer_noise,
    layer_function,
    local_reparam_plan,
    noise_parameters,
    run_local_reparam,
)
from .prior_scale import own_normal_priors_, update_prior_scales_

__all__ = ["MeanField", "MeanFieldELBO"]


class MeanField(BNNGuide, AutoNormal):
    """Mean-field Normal guide for BNNs.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model.
    init_scale : float
        Initial posterior standard deviation of every weight (default 0.01).  Chosen by the
        converged training ELBO (``docs/results/convergence.md``): on digits and on a 1-D
        regression with a learned noise scale 0.01 reached the best ELBO; 0.1 ended the
        regression in the optimum that explains the data as noise, 1e-3 converged slower.
    init_loc_fn : callable, optional
        Pyro init strategy; default :class:`~pyro_bnn.contract.guide.init_to_network`.
    local_reparameterization : {"auto", True, False}
        Per-example weight noise instead of one weight draw per step: the same ELBO with
        lower-variance gradients (:mod:`pyro_bnn.guides.local_reparam_forward`).  Linear layers
        on ``(batch, features)`` inputs sample their pre-activations ``N(x μ, x² σ²)`` (local
        reparameterisation, Kingma et al. 2015); convolutions (and Linear layers on inputs with
        more axes) use Flipout (Wen et al. 2018), because the outputs of one image at different
        positions share one weight draw, which independent pre-activation noise would not respect
        (measured before Flipout: −ELBO 1,094 ± 1 against the true 1,130 ± 5 on a small CNN).
        ``"auto"`` (default) uses it for a :class:`~pyro_bnn.BNN` whose random sites are all
        weights and biases of Linear or zero-padded Conv layers, without an input augmentation
        (whose copies must share one weight draw), and weight noise elsewhere — also from the
        first step on which a layer is called twice or on rows folded into the batch axis, where
        it would give one example several draws (``True`` then raises).  On digits
        (64-100-10, 300 epochs) it reached the 1,000-epoch ELBO to within 2-4 %, weight noise to
        within 5-6 %.  ``True`` requires it.
    kl_annealing : int
        KL annealing (a "warm-up"): during the first ``kl_annealing`` epochs of each
        :func:`pyro_bnn.fit` the KL term is weighted by ``epoch / kl_annealing``, so the
        training loss (``history["loss"]``) is not the negative ELBO until the weight reaches 1;
        ``history["elbo"]`` is the ELBO throughout (the KL at full weight).  A fit stopped by an
        exception leaves the weight at 1.  A :class:`pyro_bnn.BNN` only (another model is
        trained by a traced Pyro mean-field ELBO, which has no KL weight: refused).  0 (default): off.
    scale_parameterization : {"exp", "softplus"}
        ``σ = exp(ρ)`` (default) or ``σ = softplus(ρ)`` (Blundell et al.; Pyro's
        ``AutoNormal``).  The two agree to first order for the small σ of weight posteriors
        (``softplus(ρ) = exp(ρ)(1 + O(exp(ρ)))``); ``exp`` is the faster on CPU: it needs no
        softplus, ``log σ`` or sigmoid pass over the weights in the training step
        (``benchmarks/bench_core.py``).  The unconstrained parameters in ``state_dict`` are
        ``ρ`` of the chosen map.
    loc_lr_scaling : {"fan_in", None}
        ``"fan_in"`` (default): :func:`pyro_bnn.fit` trains the means of a Linear or Conv
        layer with fan-in ``f`` at ``lr × min(1, √(REFERENCE_FAN_IN / f))`` (``f`` > 100 only;
        biases with their layer), the scales ``ρ`` at ``lr``.  Adam moves every parameter by
        about ``lr`` per step, whatever its size; weights of a wide layer are of size
        ``1/√f``, so one learning rate that suits a 64-input layer throws a 784-input
        layer's means around.  On MNIST 784-400-400-10 with N(0, 1) priors the defaults
        without it ended at ELBO −13,015 after 400 epochs (test accuracy 20 %), with it at
        −7,447 (91 %), 0.5 % below an 800-epoch fit (``docs/results/convergence.md``).
        ``None``: every parameter at ``lr``.  For ``pyro.infer.SVI`` use
        :meth:`optim_args`.
    learn_prior_scale : bool
        Empirical Bayes for the prior's scale, one per site (each layer's weights and its
        biases apart): after every epoch of :func:`pyro_bnn.fit` each site's prior
        ``N(m, s²)`` gets the scale that maximises the ELBO at the current ``q``,
        ``s² = mean((μ − m)² + σ²)`` (:func:`~pyro_bnn.guides.prior_scale.optimal_normal_scale`),
        so the fit is coordinate ascent on the ELBO in ``(q, s)`` and the reported bound is
        that of the model with the learned scales.  Every site's prior must be an i.i.d.
        Normal (``IIDNormal`` or ``FanInNormal``; its value is the starting point); at the
        start of the fit each site gets its own ``IIDNormal`` in the model
        (:meth:`pyro_bnn.BNN.set_prior_`), so the model's priors change in place.  Under plain
        ``pyro.infer.SVI`` nothing is learned automatically: call
        :meth:`update_prior_scales_` yourself (e.g. after each epoch); ``Predictive`` and
        ``Trace_ELBO`` then use the learned priors.  Default ``False``.

    Examples
    --------
    >>> guide = pb.guides.MeanField(model, init_scale=1e-3)        # doctest: +SKIP
    >>> pb.fit(model, guide, (x, y), epochs=10)                     # doctest: +SKIP
    """

    #: learning rate of :func:`pyro_bnn.fit` when none is given (with its cosine decay), for
    #: up to ``REFERENCE_NUM_DATA`` training points; :meth:`learning_rate` lowers it above, scales
    #: it by ``unnormalized_conv_lr_factor`` for a net whose convolutions feed no normalisation
    #: layer and caps it at ``dense_lr_ceiling`` for a net without random convolutions
    default_lr = 5e-2
    #: :meth:`learning_rate`'s factor for a net with a convolution that feeds no normalisation layer
    unnormalized_conv_lr_factor = 0.5
    #: :meth:`learning_rate`'s ceiling for a net without random convolutions (an MLP); ``None``: none
    dense_lr_ceiling = 2.5e-2
    #: q is one Normal per site: :meth:`loc_and_scale` gives its exact moments
    normal_per_site = True

    def __init__(self, model, *, init_scale: float = 1e-2, init_loc_fn=None,
                 local_reparameterization: bool | str = "auto", kl_annealing: int = 0,
                 scale_parameterization: str = "exp", loc_lr_scaling: str | None = "fan_in",
                 learn_prior_scale: bool = False):
        self.learn_prior_scale = check_bool("learn_prior_scale", learn_prior_scale)
        if loc_lr_scaling not in ("fan_in", None):
            raise ValueError(f"loc_lr_scaling must be 'fan_in' or None, got {loc_lr_scaling!r}")
        self.loc_lr_scaling = loc_lr_scaling
        if scale_parameterization not in _SCALE_CONSTRAINTS:
            raise ValueError(f"scale_parameterization must be one of {sorted(_SCALE_CONSTRAINTS)}, "
                             f"got {scale_parameterization!r}")
        super().__init__(model, init_loc_fn=init_loc_fn or init_to_network(model),
                         init_scale=float(init_scale))
        self.scale_parameterization = scale_parameterization
        self.scale_constraint = _SCALE_CONSTRAINTS[scale_parameterization]
        if local_reparameterization not in ("auto", True, False):
            raise ValueError("local_reparameterization must be 'auto', True or False, got "
                             f"{local_reparameterization!r}")
        self.local_reparameterization_setting = local_reparameterization
        if int(kl_annealing) < 0:
            raise ValueError(f"kl_annealing must be a number of epochs >= 0, got {kl_annealing!r}")
        self.kl_annealing = int(kl_annealing)
        #: weight of the KL term in the training loss (1 outside annealing)
        self.kl_weight = 1.0

    @property
    def local_reparameterization(self) -> bool:
        """Whether the training objective samples pre-activations (the resolved setting)."""
        setting = self.local_reparameterization_setting
        if setting != "auto":
            return bool(setting)
        if self.__dict__.get("_per_example_noise_failed"):  # the network calls a layer per-example noise cannot follow
            return False
        return supports_local_reparameterization(
            self.given_model())  # not through handlers around the model: they must run

    def settings_description(self) -> str:
        """``"init_scale=…[, objective settings], local reparameterisation on|off"``."""
        try:
            local = self.local_reparameterization
        except (RuntimeError, AttributeError):  # not set up: the setting cannot be resolved
            local = None
        parts = [f"init_scale={self._init_scale:g}", *self._objective_settings()]
        if self.learn_prior_scale:
            parts.append("learned prior scales")
        if local is not None:
            parts.append(f"local reparameterisation {'on' if local else 'off'}")
        return ", ".join(parts)

    def _objective_settings(self) -> list[str]:
        """Settings of the training objective for :meth:`settings_description` (none here)."""
        return []

    def on_fit_start(self, ctx) -> None:
        """With ``learn_prior_scale``: give every site its own Normal prior module (before the
        fit remembers any state, so a restored state has the same prior modules)."""
        if self.learn_prior_scale:
            own_normal_priors_(self.approximated_model())

    def on_epoch_end(self, ctx) -> None:
        """With ``learn_prior_scale``: set the prior scales to their ELBO optimum at ``q``."""
        if self.learn_prior_scale:
            self.update_prior_scales_()

    def update_prior_scales_(self) -> dict[str, float]:
        """Set each site's prior scale to its ELBO optimum at the current ``q``,
        ``s = sqrt(mean((μ − m)² + σ²))`` (in place, on the model; the prior means stay).

        What :func:`pyro_bnn.fit` does after every epoch with ``learn_prior_scale=True``; under
        plain ``pyro.infer.SVI`` call it yourself, e.g. once per epoch.  Every site's prior
        must be an i.i.d. Normal; the first call gives each site its own ``IIDNormal``.

        Returns
        -------
        dict
            ``{site: new prior scale}``.

        Raises
        ------
        ValueError
            The model is not a :class:`pyro_bnn.BNN`, or a site's prior is not an i.i.d. Normal.
        RuntimeError
            The guide is not set up yet (call ``guide(x, y)`` once).
        """
        return update_prior_scales_(self.approximated_model(), self)

    def on_epoch_start(self, ctx) -> None:
        """Set the KL weight for the coming epoch (KL annealing)."""
        self.kl_weight = min(1.0, ctx.epoch / self.kl_annealing) if self.kl_annealing else 1.0

    def on_fit_end(self, ctx) -> None:
        self.kl_weight = 1.0

    def on_fit_abort(self, ctx) -> None:
        """A fit stopped by an exception (Ctrl-C, a divergence): the KL weight is 1 again, so the
        objective outside the fit (``SVI``, ``make_objective().loss``) is the negative ELBO, not
        the annealed loss of the epoch that was interrupted."""
        self.kl_weight = 1.0

    def loc_and_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean μ and standard deviation σ of site ``name``."""
        loc, rho = self.loc_and_raw_scale(name)
        return loc, self.scale_from_raw(rho)

    def scale_from_raw(self, rho: torch.Tensor) -> torch.Tensor:
        """σ from the unconstrained scale ρ: ``exp(ρ)`` or ``softplus(ρ)``."""
        return rho.exp() if self.scale_parameterization == "exp" else F.softplus(rho)

    def loc_and_raw_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean μ and the unconstrained scale ρ (``σ = exp(ρ)`` or ``softplus(ρ)``)."""
        # Direct parameter access: PyroModule attribute lookups cost ~10 µs per level,
        # which adds up in the per-step hot path of large nets.
        *path, leaf = name.split(".")
        loc_mod, scale_mod = self.locs, self.scales
        for part in path:
            loc_mod, scale_mod = loc_mod._modules[part], scale_mod._modules[part]
        return (loc_mod._parameters[leaf + "_unconstrained"],
                scale_mod._parameters[leaf + "_unconstrained"])

    def site_names(self) -> list[str]:
        return [name for name, _ in self.prototype_trace.iter_stochastic_nodes()]

    def scale_parameters(self) -> list[torch.Tensor]:
        """The unconstrained scales ``ρ`` of every site (empty before set-up)."""
        if self.prototype_trace is None:
            return []
        return [self.loc_and_raw_scale(name)[1] for name in self.site_names()]

    def learning_rate(self, num_data: int) -> float:
        """The learning rate of :func:`pyro_bnn.fit` when none is given, for ``num_data``
        training points: ``default_lr × min(1, √(REFERENCE_NUM_DATA / num_data))``, then

        * times :attr:`unnormalized_conv_lr_factor` (½; :class:`~pyro_bnn.guides.Symmetrized` ¼)
          when a convolution with random weights feeds no normalisation layer
          (:meth:`convolutions_without_normalization`);
        * at most :attr:`dense_lr_ceiling` (0.025) when no convolution has random weights (an
          MLP), so an MLP trains at 0.025 up to 40,000 points and at the ``1/√N`` rule above.

        Adam moves each mean by about ``lr`` per step, while the posterior's width shrinks as
        ``1/√N``.  Convolutions whose output BatchNorm divides out keep the full rate.  Every
        branch is a measurement, tabulated in ``docs/training.md`` ("The default learning
        rate"): the ``1/√N`` fall on the 60,000-image Fashion-MNIST MLP, the half for the LeNet
        (which collapsed to its prior at 0.05 on 10,000 images), the MLP ceiling on digits,
        MNIST 5k and Fashion-MNIST 5,000–10,000 (0.05 ended up to 13 % lower in ELBO), the full
        rate on the BatchNorm CNN (1.6 % higher than the half at 60,000 images).
        """
        check_positive("num_data", num_data)
        rate = self.default_lr * min(1.0, math.sqrt(REFERENCE_NUM_DATA / num_data))
        if self.convolutions_without_normalization():
            return rate * self.unnormalized_conv_lr_factor
        if self.dense_lr_ceiling is not None and not self.random_convolutions():
            return min(rate, self.dense_lr_ceiling)
        return rate

    def random_convolutions(self) -> list[str]:
        """Paths of the model's convolutions with random weights (the guide's sites once set up,
        a :class:`pyro_bnn.BNN`'s before, else every convolution)."""
        return self._read_convolutions(random_convolutions)

    def convolutions_without_normalization(self) -> list[str]:
        """Paths of the model's convolutions with random weights whose output no normalisation
        layer divides out (:func:`pyro_bnn.model.batchnorm.convolutions_without_normalization`);
        the sites are the guide's once set up, a :class:`pyro_bnn.BNN`'s before, else every
        convolution counts."""
        return self._read_convolutions(convolutions_without_normalization)

    def _read_convolutions(self, reader) -> list[str]:
        model = self.approximated_model()
        if model is None:
            return []
        sites = self.site_names() if self.prototype_trace is not None else (
            model.site_names if is_bnn(model) else None)
        return reader(model, sites=None if sites is None else set(sites))

    def learning_rate_factors(self) -> list[tuple[torch.Tensor, float]]:
        """The means of wide Linear/Conv layers and their factor ``√(REFERENCE_FAN_IN / f)``
        (``loc_lr_scaling="fan_in"``; see the class docstring)."""
        if self.loc_lr_scaling is None or self.prototype_trace is None:
            return []
        return [(self.loc_and_raw_scale(name)[0], factor)
                for name, factor in self.loc_lr_factors().items() if factor < 1.0]

    def loc_lr_factors(self) -> dict[str, float]:
        """Site name → learning-rate factor of its mean (1.0 outside wide Linear/Conv layers)."""
        model = self.approximated_model()
        names = self.site_names()
        factors = {}
        for name in names:
            module, attr = site_module(model, name) if model is not None else (None, name)
            weight = name.rpartition(".")[0] + ".weight" if "." in name else "weight"
            factor = 1.0
            if isinstance(module, BAYESIAN_LAYERS) and attr in ("weight", "bias") and weight in names:
                fan_in = self.loc_and_raw_scale(weight)[0][0].numel()
                factor = min(1.0, math.sqrt(REFERENCE_FAN_IN / fan_in))
            factors[name] = factor
        return factors

    def optim_args(self, lr: float):
        """Per-parameter arguments for ``pyro.optim.Adam`` that apply :meth:`learning_rate_factors`
        under ``pyro.infer.SVI``: ``pyro.optim.Adam(guide.optim_args(5e-2))`` (call after the
        guide is set up, e.g. after one ``guide(x, y)``).  The rate :func:`pyro_bnn.fit` uses for
        ``N`` training points is ``guide.learning_rate(N)``:
        ``guide.optim_args(guide.learning_rate(N))`` trains as ``fit`` does.

        Pyro's global parameter mode only: ``pyro.optim`` hands a callable the parameter's name
        in the param store, which module-local parameters (``pyro.settings.set(
        module_local_params=True)``) do not have (Pyro then fails inside ``step``); there,
        :func:`pyro_bnn.fit` applies the same factors."""
        if not global_param_mode():
            raise RuntimeError("optim_args needs Pyro's global parameter mode: under "
                               "pyro.settings.set(module_local_params=True) pyro.optim cannot name the "
                               "parameters for a per-parameter callable; train with pyro_bnn.fit (which applies "
                               "the same learning-rate factors), or give pyro.optim.Adam one lr")
        if self.prototype_trace is None:
            raise RuntimeError("optim_args needs the guide set up first: call guide(x, y) once (or "
                               "pyro_bnn.training.guide_setup.setup_guide) so the sites, and their fan-ins, are known")
        factors = self.loc_lr_factors() if self.loc_lr_scaling is not None else {}

        def args(param_name: str) -> dict:
            for name, factor in factors.items():
                if param_name.endswith("locs." + name):
                    return {"lr": lr * factor}
            return {"lr": lr}

        return args

    def forward(self, *args, **kwargs):
        """Sample every weight from ``N(μ, σ²)`` (real-valued sites), so Pyro ELBOs can use
        the closed-form KL.  Constrained sites go through ``AutoNormal``'s transform."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        if self.local_reparameterization_setting is True and torch.is_grad_enabled():
            self._warn_weight_noise_training()
        if not all(_is_real(site["fn"].support)
                   for _, site in self.prototype_trace.iter_stochastic_nodes()):
            return super().forward(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                # through PyroModule's attribute access: emits the `param` statements that
                # SVI collects and keeps the values in sync with Pyro's param store
                loc, scale = self._get_loc_and_scale(name)
                result[name] = pyro.sample(
                    name, dist.Normal(loc, scale).to_event(self._event_dims[name]))
        return result

    def make_objective(self, num_particles: int = 1):
        return MeanFieldELBO(num_particles)

    def _warn_weight_noise_training(self) -> None:
        """Warn once: a Pyro ELBO trains through :meth:`forward`, which samples weights, so
        ``local_reparameterization=True`` does not apply to it (it does in
        :meth:`make_objective`'s :class:`MeanFieldELBO`, which ``pb.fit`` uses)."""
        if self.__dict__.get("_warned_weight_noise"):
            return
        self.__dict__["_warned_weight_noise"] = True
        warnings.warn(
            f"{type(self).__name__}(local_reparameterization=True) is trained here through the guide's "
            "forward, which samples weights (a Pyro ELBO such as Trace_ELBO traces the guide), so local "
            "reparameterisation does not apply. Use the guide's own objective: "
            "SVI(model, guide, optim, loss=guide.make_objective()) and svi.step(x, y, num_data=N), "
            "or pb.fit", UserWarning, stacklevel=3)


#: means of layers with a larger fan-in learn at a reduced rate (``loc_lr_scaling="fan_in"``):
#: 100 keeps every layer of the small nets the defaults were tuned on (digits 64-100-10) at ``lr``
REFERENCE_FAN_IN = 100

#: up to this many training points :meth:`MeanField.learning_rate` is ``default_lr``; above it
#: the rate falls as ``1/√N`` (0.02 at 60,000)
REFERENCE_NUM_DATA = 10_000

_SCALE_CONSTRAINTS = {"exp": dist.constraints.positive, "softplus": dist.constraints.softplus_positive}


def _is_real(support) -> bool:
    while hasattr(support, "base_constraint"):
        support = support.base_constraint
    return support is dist.constraints.real


register_guide("meanfield", lambda model, **kw: MeanField(model, **kw))


class MeanFieldELBO(GuideObjective):
    """Negative ELBO of a :class:`MeanField` guide: ``E_q[−log p(D|w)] + KL(q‖p)``.

    For a :class:`pyro_bnn.BNN` it samples ``w = μ + σ ε`` (or, with the guide's
    ``local_reparameterization``, the pre-activations) and runs the network directly (no
    Pyro trace), with ``N/M`` minibatch scaling and the closed-form KL where the prior is
    Normal; the KL term is weighted by the guide's ``kl_weight`` (KL annealing).  For other
    models it is Pyro's ``TraceMeanField_ELBO`` with the log-density of constrained sites kept
    (:class:`~pyro_bnn.contract.pyro_objective.TraceMeanFieldJacobian_ELBO`).

    It is what :func:`pyro_bnn.fit` optimises for a :class:`MeanField` guide, and a Pyro
    ``ELBO``: ``SVI(model, guide, optim, loss=MeanFieldELBO())`` with
    ``svi.step(x, y, num_data=N)`` optimises the same loss (see
    :class:`~pyro_bnn.contract.objective.GuideObjective`).  Under plain ``SVI`` KL annealing
    is the caller's: set ``guide.kl_weight`` before each epoch.
    """

    def __init__(self, num_particles: int = 1):
        super().__init__(num_particles=int(num_particles))
        self._fallback = PyroObjective(TraceMeanFieldJacobian_ELBO(num_particles=self.num_particles))

    def __call__(self, model, guide, x, y, num_data=None):
        if not is_bnn(model):
            if guide.kl_weight != 1.0:   # Pyro's ELBO below has no KL weight: annealing would be ignored
                raise ValueError(f"KL annealing (kl_annealing=, kl_weight={guide.kl_weight:g}) needs a pyro_bnn.BNN "
                                 "model; the Pyro ELBO that trains other models (a mean-field ELBO traced by "
                                 f"Pyro) weighs the KL by 1, got {type(model).__name__}")
            if guide.local_reparameterization:
                raise ValueError("local_reparameterization=True needs a pyro_bnn.BNN model called directly (Pyro "
                                 f"handlers around it must run, so they get weight noise), got {model!r}")
            return self._fallback(model, guide, x, y, num_data)
        if guide.prototype_trace is None:
            guide._setup_prototype(x, y, num_data=num_data)
        if guide.kl_weight == 1.0:
            return meanfield_loss(model, guide, x, y, num_data, self.num_particles)
        # KL annealing: the loss weighs the KL by kl_weight; fit's history["elbo"] is the ELBO
        loss, neg_elbo = meanfield_loss(model, guide, x, y, num_data, self.num_particles, return_neg_elbo=True)
        return loss, {"elbo": -neg_elbo}


def standard_normal_like(t: torch.Tensor) -> torch.Tensor:
    """``N(0, 1)`` noise shaped like ``t``.

    ``empty_like(t).normal_()`` rather than ``randn_like``: on CPU (torch 2.14) the in-place
    fill takes the vectorised path and was ~20× faster for a 478k-weight MLP's noise.
    """
    return torch.empty_like(t, memory_format=torch.contiguous_format).normal_()


def normal_kl(loc, scale, prior_loc, prior_scale) -> torch.Tensor:
    """``Σ KL(N(loc, scale²) ‖ N(prior_loc, prior_scale²))`` elementwise, summed.

    ``= Σ [log(s_p/σ) + (σ² + (μ − μ_p)²) / (2 s_p²) − 1/2]`` — written out so that no
    distribution objects (and no argument validation over every weight) are built per step.
    """
    inv_var = prior_scale.reciprocal() ** 2
    return 0.5 * (((scale**2 + (loc - prior_loc) ** 2) * inv_var).sum()
                  - 2.0 * torch.log(scale).sum()
                  + loc.numel() * (2.0 * torch.log(prior_scale) - 1.0))


def closed_form_kl(model, qs: dict, log_scales: dict | None = None) -> tuple[torch.Tensor | float, list[str]]:
    """Closed-form ``KL(q‖p)`` over the sites whose prior allows it, and the other sites.

    Parameters
    ----------
    model : BNN
        Provides ``site_normal_prior`` (or ``site_prior`` for any registered closed form).
    qs : dict
        ``{site: (μ, σ)}``.
    log_scales : dict, optional
        ``{site: log σ}`` for sites whose ``log σ`` is at hand (``σ = exp(ρ)``: ``ρ``); their
        closed-form KL reads it instead of taking ``log σ`` (the same KL up to ~1e-7 relative).

    Returns
    -------
    kl : Tensor or 0.0
        Sum of closed-form terms.
    mc_sites : list of str
        Sites that need a Monte Carlo estimate ``log q(w) − log p(w)``.
    """
    kl, mc_sites = 0.0, []
    log_scales = log_scales or {}
    priors = {name: normal_prior_params(model, name) for name in qs}   # read once per step
    together = _kl_sites_together(qs, log_scales, priors)
    if together is not None:
        return together, mc_sites
    for name, (loc, scale) in qs.items():
        params = priors[name]
        if params is not None:
            # one autograd node where the prior allows it: with log σ given (σ = exp ρ) the log
            # term reads ρ, else normal_kl's values and gradients bit for bit
            if not can_fuse_kl(loc, scale, *params):
                kl = kl + normal_kl(loc, scale, *params)
            elif name in log_scales:
                kl = kl + normal_kl_node_log_scale(loc, scale, log_scales[name], *params)
            else:
                kl = kl + normal_kl_node(loc, scale, *params)
            continue
        try:
            kl = kl + kl_divergence(dist.Normal(loc, scale, validate_args=False).to_event(loc.dim()),
                                    model.site_prior(name))
        except NotImplementedError:
            mc_sites.append(name)
    return kl, mc_sites


def _kl_sites_together(qs: dict, log_scales: dict, priors: dict) -> torch.Tensor | None:
    """The closed-form KL of every site in one node (:func:`normal_kl_sites_log_scale`: the
    per-site nodes' sum bit for bit, a few ``torch._foreach_*`` operations instead of some twenty
    per site), or ``None`` unless every site has a one-number Normal prior (``priors``: ``{site:
    (m, s) or None}``) and ``log σ`` at hand."""
    if len(qs) < 2 or any(name not in log_scales or priors[name] is None for name in qs):
        return None
    locs = [loc for loc, _ in qs.values()]
    scales = [scale for _, scale in qs.values()]
    prior_locs, prior_scales = [priors[name][0] for name in qs], [priors[name][1] for name in qs]
    if not can_fuse_kl_sites(locs, scales, prior_locs, prior_scales):
        return None
    return normal_kl_sites_log_scale(locs, scales, [log_scales[name] for name in qs], prior_locs, prior_scales)


def meanfield_loss(model, guide, x, y, num_data, num_particles=1, on_draw=None, return_neg_elbo=False):
    """Negative ELBO for a BNN and a MeanField guide (see :class:`MeanFieldELBO`), its KL
    term weighted by ``guide.kl_weight`` (KL annealing).

    Sites with a Normal prior are sampled together with their KL by one
    fused autograd node (:mod:`._fused_gaussian`); the rest go through ``closed_form_kl`` or
    a Monte Carlo KL.  ``on_draw(values)``, if given, is called with each particle's weight
    draw ``{site: ω}`` after its likelihood term (the symmetrised guide adds its entropy
    term on the same ω); with local reparameterisation no weights are drawn and it must
    be ``None``.  ``return_neg_elbo=True`` returns ``(loss, neg_elbo)``, the second detached
    and with the KL at full weight whatever ``kl_weight`` is (the same draw's negative ELBO).
    """
    if on_draw is not None and guide.local_reparameterization:
        raise ValueError("on_draw needs weight draws, but local reparameterisation draws none")
    scale_factor = (num_data or len(x)) / len(x)
    sites = model.site_names
    # a plain Linear/Conv net runs as direct functional calls (the hooks' operations, the same
    # values) where the model's param statements have no effect (pb.fit's module-local mode);
    # such a net is one local reparameterisation applies to, so its plan settles the setting
    plan = (local_reparam_plan(model, sites) if on_draw is None and _may_reparameterize_locally(guide, model)
            and direct_calls_allowed() else None)
    local = plan is not None or guide.local_reparameterization
    fused = {} if local else _fusable_sites(model, guide, sites)
    positive = guide.scale_parameterization
    raw = {name: guide.loc_and_raw_scale(name) for name in sites if name not in fused}
    qs = {name: (loc, guide.scale_from_raw(rho)) for name, (loc, rho) in raw.items()}
    # σ = exp(ρ): the KL's log σ is ρ itself
    log_scales = {name: rho for name, (_, rho) in raw.items()} if positive == "exp" else None
    kl_closed, mc_sites = closed_form_kl(model, qs, log_scales)
    priors = {name: model.site_prior(name) for name in mc_sites}
    kl_weight = guide.kl_weight
    # pruned weights (the model's masks act on drawn weights, and the noise terms draw none):
    # σ = μ = 0 in the noise terms, so that they neither add noise nor get likelihood gradients
    masks = weight_masks(model) if local else {}
    noise_qs = {name: (loc * masks[name].to(loc), scale * masks[name].to(scale)) if name in masks
                else (loc, scale) for name, (loc, scale) in qs.items()} if masks else qs
    nll, kl_mc = 0.0, 0.0   # kl_mc: the Monte Carlo KL terms at full weight (for neg_elbo)
    for _ in range(num_particles):
        values, hooks = {}, []
        for name, (loc, rho, prior_loc, prior_scale) in fused.items():
            values[name], kl = sample_and_kl(loc, rho, standard_normal_like(loc), prior_loc, prior_scale,
                                             positive)
            kl_closed = kl_closed + kl / num_particles
        for name, (loc, scale) in qs.items():
            values[name] = loc if local else loc + scale * standard_normal_like(loc)
        if plan is not None:
            f = run_local_reparam(plan, noise_qs, x, standard_normal_like)
        else:
            if local:
                hooks = _install_local_reparam(model, noise_qs, len(x))
            try:
                f = model.run_with(values, x)
            except PerExampleNoiseError:
                if guide.local_reparameterization_setting != "auto":
                    raise
                # "auto": this network shares a layer between calls or folds an example's rows into
                # the batch; weight noise from now on, and this step again with it (hooks removed)
                guide.__dict__["_per_example_noise_failed"] = True
                f = None
            finally:
                for h in hooks:
                    h.remove()
            if f is None:
                return meanfield_loss(model, guide, x, y, num_data, num_particles=num_particles,
                                      return_neg_elbo=return_neg_elbo)
        nll = nll - log_likelihood(model.likelihood, f, y).sum() * scale_factor
        if on_draw is not None:
            on_draw(values)
        for name in mc_sites:
            loc, scale = qs[name]
            w = values[name] if not local else loc + scale * standard_normal_like(loc)
            kl_w = dist.Normal(loc, scale, validate_args=False).log_prob(w).sum() - priors[name].log_prob(w)
            nll = nll + kl_weight * kl_w
            if return_neg_elbo:
                kl_mc = kl_mc + kl_w.detach()
    loss = nll / num_particles + (kl_closed if kl_weight == 1.0 else kl_weight * kl_closed)
    if not return_neg_elbo:
        return loss
    # the loss's KL terms (closed form and Monte Carlo) at full weight instead of kl_weight
    kl = kl_closed.detach() if isinstance(kl_closed, torch.Tensor) else kl_closed
    return loss, loss.detach() + (1.0 - kl_weight) * (kl + kl_mc / num_particles)


def _may_reparameterize_locally(guide, model) -> bool:
    """Whether ``guide.local_reparameterization`` is ``True`` for ``model`` if local
    reparameterisation applies to it (setting ``True``, or ``"auto"`` for the guide's own model)."""
    setting = guide.local_reparameterization_setting
    return setting is True or (setting == "auto" and guide.given_model() is model)


def _fusable_sites(model, guide, sites) -> dict:
    """``{site: (μ, ρ, prior_loc, prior_scale)}`` for the sites :func:`sample_and_kl` handles."""
    out = {}
    for name in sites:
        params = normal_prior_params(model, name)
        if params is None:
            continue
        loc, rho = guide.loc_and_raw_scale(name)
        if can_fuse(loc, *params):
            out[name] = (loc, rho, *params)
    return out


def supports_local_reparameterization(model) -> bool:
    """Whether per-example weight noise (local reparameterisation on Linear layers, Flipout on
    convolutions) computes ``model``'s ELBO: a BNN whose random sites are all weights and biases
    of Linear or zero-padded Conv layers, with no input augmentation (the copies of one input
    must share one weight draw)."""
    if not is_bnn(model) or network_of(model) is None or augmentation_of(model) is not None:
        return False
    for site in model.site_names:
        module, leaf = site_module(model, site)
        if leaf not in ("weight", "bias"):
            return False
        if layer_function(module) is None:
            return False
    return True


def _install_local_reparam(model, qs, batch_size):
    """Forward hooks adding each Linear/Conv output's per-example weight noise
    (:func:`~pyro_bnn.guides.local_reparam_forward.add_layer_noise`: local reparameterisation or
    Flipout).  The layer itself runs with the posterior means (put in the cache), the mean of its
    output; the hook adds the noise."""
    modules, params = [], {}
    for path, module in model.net.named_modules():
        wname = f"net.{path}.weight" if path else "net.weight"
        if wname not in qs:
            continue
        bname = f"net.{path}.bias" if path else "net.bias"
        function = layer_function(module)
        if function is None:
            raise ValueError(f"local reparameterisation supports Linear and zero-padded Conv layers; site "
                             f"{wname!r} belongs to {type(module).__name__}")
        params[wname] = noise_parameters(module, qs[wname][1], qs[bname][1] if bname in qs else None)
        modules.append((wname, module, function))
    return install_layer_noise(modules, params, standard_normal_like, batch_size)
