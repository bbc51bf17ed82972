"""The guide contract: :class:`BNNGuide`, and what every pyro_bnn guide shares.

A guide is any Pyro guide.  Pyro's own autoguides work with :func:`pyro_bnn.fit`,
:func:`pyro_bnn.predict` and the other tools as they are; pyro_bnn's guides additionally
derive from :class:`BNNGuide`, which is the whole contract in one place: the hooks
:func:`pyro_bnn.fit` calls, the training objective, alternative predictives, the density
of a draw, and how the guide's parameters meet Pyro's global parameter store.  The training
loop and the tools read these through :func:`guide_contract`, which gives Pyro's own guides
the default behaviour, so no tool probes a guide with ``hasattr``.

New guides derive from :class:`BNNGuide` (listed *before* the Pyro base class) and join the
registry with :func:`register_guide` so the parametrised contract tests and ``pb.compare``
pick them up.  ``docs/DEVELOPING.md`` walks through an example.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pyro.poutine as poutine
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoLaplaceApproximation, AutoNormal
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.poutine.messenger import Messenger

from ..model.batch_scaling import WatchesBatches, observations_unscaled
from ..model.batchnorm import warn_batchnorm_in_train_mode, warn_running_statistics_of_random_affine
from ..model.bnn import BNN, example_input, initial_values_of, site_module
from ..model.input_scale import WatchesInputs, inputs_warned
from .local_params import local_params, prepare_local_params
from .param_store import expose_unconstrained, global_param_mode, sync_param_store
from .pyro_objective import PyroObjective, model_arguments

__all__ = ["BNNGuide", "GuideStateWarning", "guide_contract", "init_to_network", "register_guide",
           "registered_guides", "GUIDE_REGISTRY"]


class GuideStateWarning(UserWarning):
    """A guide's draws are not what its user may think (e.g. a Laplace guide whose curvature is
    missing or stale).  A set-up run, whose draw is discarded (``pb.fit``'s first call of the
    guide), silences this category: it is news only for draws that are used."""

class BNNGuide(WatchesBatches, WatchesInputs):
    """The pyro_bnn guide contract, as a mixin placed before the Pyro guide class.

    ``class MyGuide(BNNGuide, AutoGuide): ...``.  Every method has a default, so a guide
    overrides only what it changes.  :func:`pyro_bnn.fit` calls, in order,
    ``make_objective`` once, ``on_fit_start``, then per epoch ``on_epoch_start``, the
    minibatch steps of the objective, ``on_epoch_end``, and finally ``on_fit_end``; each
    hook receives the :class:`pyro_bnn.training.loop.FitContext`.

    Attributes
    ----------
    supports_marglik : bool
        Whether the guide learns hyperparameters online from ``fit(..., marglik=...)``
        (the Laplace guide: δ, a learned noise, LILA's η; the Hypernet: its weight-norm scales'
        prior precisions).  ``fit`` rejects ``marglik=`` for other guides.
    default_lr : float or None
        Learning rate :func:`pyro_bnn.fit` uses when none is given (``None``: fit's own),
        through :meth:`learning_rate`, which a guide may override to adapt it to the data size.
    linearized : bool
        Whether the guide offers the linearised (GLM) predictive and its draws
        (``map_values``, ``likelihood_kind``, ``linearized_samples``; the Laplace guide):
        ``pb.to_arviz(..., predictive="glm")`` reads it.
    default_predictive : str
        The ``predictive`` :func:`pyro_bnn.predict`, :func:`pyro_bnn.evaluate`, ``pb.compare`` and
        ``pb.to_arviz`` use when none is given: ``"sample"`` (the default, Monte Carlo over
        the guide's draws) or one of the guide's own :meth:`predict` predictives (the Laplace
        guide: ``"glm"``).
    normal_per_site : bool
        Whether ``q`` is one independent Normal per site whose mean and standard deviation
        :meth:`loc_and_scale` returns exactly, over the sites :meth:`site_names` lists
        (:class:`~pyro_bnn.guides.MeanField` and the guides built on it).  The tools read exact
        moments then (``site_moments``, pruning scores without a model); otherwise they use
        Pyro's ``AutoNormal`` quantiles or Monte Carlo draws.  Default ``False``.
    bounds_evidence : bool
        Whether the training objective's ``−loss`` is a lower bound on the log evidence
        ``log p(y)`` (an ELBO, or the symmetrised ELBO), so that :func:`pyro_bnn.fit`'s
        diagnosis may compare it with a constant predictor's log-likelihood (check (e) of
        :mod:`pyro_bnn.training.convergence`).  Default ``True``; ``False`` for the Laplace
        guide (a MAP objective, whose prior penalty is no Occam factor) and for Pyro's
        point-mass guides (``AutoDelta``: the log joint).

    Every attribute a tool reads of a guide is declared here, with its default; the tools reach
    it through :func:`guide_contract` and never probe a guide with ``getattr``/``hasattr``
    (``tests/test_layering.py`` checks this).
    """

    supports_marglik: bool = False
    linearized: bool = False
    default_lr: float | None = None
    default_predictive: str = "sample"
    normal_per_site: bool = False
    bounds_evidence: bool = True
    #: sample sites of the model that hold data; they are never latent variables of the
    #: guide, even when the guide is first set up without targets (``Predictive(model,
    #: guide=guide)(x)`` on a guide restored from Pyro's param store)
    observation_sites: tuple[str, ...] = ("obs",)

    def learning_rate(self, num_data: int) -> float | None:
        """The learning rate :func:`pyro_bnn.fit` uses when none is given, for a fit on
        ``num_data`` data points: :attr:`default_lr` whatever the size, unless overridden."""
        return self.default_lr

    # ---------------------------------------------------------- as a Pyro guide
    def __call__(self, *args, **kwargs):
        """Run the guide as Pyro does, keeping its parameters consistent with Pyro's store.

        In Pyro's default (global param store) mode a guide that is not set up yet is set
        up in module-local mode first, then its parameters and its model's follow the rules
        of :mod:`pyro_bnn.contract.param_store` (a loaded store is picked up; another guide's values
        are never taken or changed).  In module-local mode this is a plain call.
        """
        modules = [self, *self.synced_modules()]
        if not global_param_mode():
            prepare_local_params(*modules)
        self.set_up(*args, **kwargs)
        # Pyro's Predictive runs the guide under poutine.mask(False) (draws, not densities; no
        # training objective masks every site): a user's own model with BatchNorm in train mode
        # would predict on batch statistics and overwrite its running ones (pb.BNN warns itself)
        # (each once per guide: Predictive calls the guide once per draw)
        model = self.approximated_model() if poutine.get_mask() is False else None
        given = self.__dict__.setdefault("_predictive_warnings_given", set()) if model is not None else None
        if model is not None and not isinstance(model, BNN):
            warn_batchnorm_in_train_mode(model, "pyro.infer.Predictive runs the model", given)
        if model is not None and self.prototype_trace is not None:  # eval mode: running statistics
            latents = [n for n, site in self.prototype_trace.nodes.items()
                       if site["type"] == "sample" and not site["is_observed"]]
            warn_running_statistics_of_random_affine(model, latents, "pyro.infer.Predictive", given)
        if poutine.get_mask() is not False and self.batch_watch.active:  # training: unscaled minibatches?
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            self.watch_batch(x, True, kwargs.get("num_data"), args, kwargs)
        if True in self.input_watch.looking:  # unscaled pixels given to a hand-written model? (first calls)
            self.watch_inputs(args, kwargs)
        if global_param_mode():
            sync_param_store(*modules)
        else:
            expose_unconstrained(*modules)
        return super().__call__(*args, **kwargs)

    def watch_batch(self, x, y, num_data, args: tuple, kwargs: dict) -> None:
        """Show one training call to the watch over a hand-written model trained on changing
        minibatches with nothing scaling its data term (``pyro_bnn/model/batch_scaling.py``); it
        warns once.  A :class:`~pyro_bnn.BNN` watches itself (``model.batch_watch``).

        Parameters
        ----------
        x : Tensor or None
            The call's inputs (``None``: nothing to watch).
        y : object
            The call's targets (``None``: a prediction, not watched).
        num_data : int or None
            The data set's size if the caller gave it (then the batches are scaled).
        args, kwargs
            The model's arguments for this call: the model is run on them once, when the
            warning is due, to see whether it scales its observations itself.
        """
        if x is None or not self.batch_watch.active:  # (after the first steps: no work at all)
            return
        model = self.approximated_model()
        if isinstance(model, BNN):  # it watches itself
            self.batch_watch.end()
        else:
            self.batch_watch.see(x, y, num_data,
                                 confirm=lambda: observations_unscaled(self.given_model(), model, args, kwargs))

    def watch_inputs(self, args: tuple, kwargs: dict) -> None:
        """Look at the inputs of a hand-written model for unscaled 0-255 pixels
        (``pyro_bnn/model/input_scale.py``): the first call with targets and the first without
        (``svi.step(x, y)``, ``Predictive(model, guide=guide, ...)(x)``) are looked at, and the
        guide warns once, naming the inputs as given to the model of this guide.  A
        :class:`~pyro_bnn.BNN` looks at its own inputs, and a model whose inputs a caller has
        warned about (``pb.fit``, ``pb.evaluate``, ...:
        :func:`~pyro_bnn.model.input_scale.inputs_warned`) is not looked at again: the watch ends.

        Parameters
        ----------
        args, kwargs
            The model's arguments for this call, read as ``(x, y=None, num_data=None)``
            (:func:`~pyro_bnn.contract.pyro_objective.model_arguments`); a model that takes
            other arguments is not watched (the watch ends; nothing is raised).
        """
        watch = self.input_watch
        try:
            x, y, _ = model_arguments(self.given_model(), args, kwargs)
        except TypeError:  # arguments that are not (x, y, num_data); none at all: a later call may tell
            if args or kwargs:
                watch.end()
            return
        if not watch.looking[y is None]:
            return
        model = self.approximated_model()
        if isinstance(model, BNN) or inputs_warned(model) or inputs_warned(self.given_model()):
            watch.end()  # a pb.BNN watches itself; a caller has warned already
            return
        watch.see(x, y is None)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a saved guide's state, as ``torch.nn.Module.load_state_dict`` does.

        A guide creates its parameters at its first call.  A fresh guide of a
        :class:`~pyro_bnn.BNN` whose network starts with a Linear or Flatten layer sets itself
        up here from a one-row dummy input, so ``guide.load_state_dict(torch.load(path))``
        works on a guide that was never called (Pyro's own autoguides need a call first).

        Raises
        ------
        RuntimeError
            The guide is not set up and no dummy input can be built for its model (a CNN, a
            hand-written model): call it once on a batch, ``guide(x)``, first.
        """
        if getattr(self, "prototype_trace", True) is None:
            try:
                x = example_input(self.approximated_model())
            except ValueError:
                raise RuntimeError(f"{type(self).__name__} is not set up yet, so it has no parameters to load "
                                   "the state into; call it once on a batch of inputs, guide(x), then "
                                   "load_state_dict (its model takes no dummy input: only a pb.BNN whose "
                                   "network starts with a Linear or Flatten layer does)") from None
            self.set_up(x)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ------------------------------------------------- copying and pickling
    def __getstate__(self) -> dict:
        """The state ``copy.deepcopy`` and ``pickle``/``torch.save`` copy, taken without
        changing the guide.

        Pyro's ``AutoGuide.__getstate__`` sets the guide's own model reference and parent
        (``master``) to ``None`` before pickling, which leaves the *original* guide without
        its model (its next call fails) and the copy without one.  Here the original is left
        as it is, and the copy keeps a reference to the model: ``copy.deepcopy(guide)`` gives
        a guide with its own copy of the model (``copy.deepcopy((model, guide))`` pairs the
        copied guide with the copied model), ``torch.save(guide)`` writes the model with it.
        Only what cannot be copied is left out: the ``unconstrained`` weak references Pyro
        attaches to parameters (restored on the next call), the weak reference to a
        parent ``AutoGuideList`` (a copy has none) and the last input/output that Pyro's
        flow transforms cache (tensors of the last step's graph, which ``deepcopy`` refuses;
        a cache miss recomputes them).  The prototype trace holds no autograd graph: the
        set-up runs without gradients (:meth:`_setup_prototype`).
        """
        for param in self.parameters(recurse=True):
            param.__dict__.pop("unconstrained", None)
        for module in self.modules():
            _clear_transform_cache(module)
        state = dict(self.__dict__)
        if "master" in state:
            state["master"] = None
        context = state.get("_pyro_context")
        if context is not None and context.active:
            raise RuntimeError(f"cannot copy or pickle the {type(self).__name__} guide while it runs")
        return state

    def _setup_prototype(self, *args, **kwargs):
        """Pyro's lazy set-up (one traced call of the model), without gradients: the values it
        keeps in ``prototype_trace`` (the model's output among them) would otherwise hold the
        call's whole forward graph for the guide's lifetime (a plain ``guide(x, y)`` or
        ``svi.step`` sets up with gradients on).  Parameters made here still require grad."""
        with torch.no_grad():
            super()._setup_prototype(*args, **kwargs)

    def set_up(self, *args, **kwargs) -> None:
        """Create the guide's parameters from one call's arguments, if not done yet.

        Runs the Pyro guide's own lazy set-up (``_setup_prototype``) in module-local mode,
        so no parameter is taken from or registered in Pyro's global store on the way.
        """
        if getattr(self, "prototype_trace", True) is not None:
            return
        # The observation sites are marked observed by a handler between the autoguide's
        # trace of the model and the model itself, i.e. around AutoGuide's stored model.
        wrapped = self._model
        self._model = (_ObservedDuringSetUp(self.observation_sites)(wrapped[0]),)
        try:
            with local_params(self, *self.synced_modules()), self._pyro_context:
                self._setup_prototype(*args, **kwargs)
        finally:
            self._model = wrapped

    def approximated_model(self):
        """The model this guide approximates (a module, or ``None`` if it is not one).

        Autoguides keep the model wrapped in Pyro handlers (e.g. the ``InitMessenger`` of
        their ``init_loc_fn``); handlers wrap a callable as a ``functools.partial`` whose
        last argument is the wrapped callable, which is unwrapped here.
        """
        model = getattr(self, "model", None)
        while isinstance(model, functools.partial) and model.args:
            model = model.args[-1]
        return model if isinstance(model, torch.nn.Module) else None

    def given_model(self):
        """The model as the user passed it: a module, a function, or a model wrapped in Pyro
        handlers (``pyro.condition(model, ...)``, ``poutine.scale(model, 0.1)``), without the
        autoguide's own ``InitMessenger``.  Fast paths that bypass Pyro's handlers apply only
        when this is the model itself (a wrapped model's handlers must run)."""
        model = getattr(self, "model", None)
        while (isinstance(model, functools.partial) and len(model.args) == 2
               and isinstance(model.args[0], InitMessenger)):
            model = model.args[-1]
        return model

    def synced_modules(self) -> list[torch.nn.Module]:
        """Modules whose parameters follow the guide's into Pyro's store: its model."""
        model = self.approximated_model()
        return [] if model is None else [model]

    # ------------------------------------------------------------ training
    def make_objective(self, num_particles: int = 1):
        """The training loss ``objective(model, guide, x, y, num_data=N)``.

        Returns a callable giving a scalar tensor, or ``(loss, extras)`` with ``extras`` a
        dict of scalar tensors that ``fit`` records per epoch.  Default: Pyro's
        ``Trace_ELBO`` with minibatch scaling (:class:`pyro_bnn.contract.pyro_objective.PyroObjective`).
        """
        return PyroObjective(Trace_ELBO(num_particles=num_particles))

    def on_fit_start(self, ctx) -> None:
        """Called once before the first epoch."""

    def on_epoch_start(self, ctx) -> None:
        """Called before each epoch (``ctx.epoch`` counts from 1)."""

    def on_epoch_end(self, ctx) -> None:
        """Called after each epoch's steps, before the epoch is recorded and checkpointed."""

    def on_fit_end(self, ctx) -> None:
        """Called once after the last epoch."""

    def on_fit_abort(self, ctx) -> None:
        """Called instead of :meth:`on_fit_end` when the fit stops by an exception (Ctrl-C, a
        divergence): undo any fit-only setting so the guide outside the fit is what it says."""

    def fit_state(self) -> dict:
        """What the hooks keep across the epochs of one fit outside ``state_dict`` (e.g.
        Laplace's evidence optimiser and best state), as plain data (tensors, numbers,
        strings, lists, dicts).  :func:`pyro_bnn.fit` writes it into its checkpoints, so
        ``fit(..., resume=True)`` continues exactly.  Default: nothing."""
        return {}

    def load_fit_state(self, state: dict) -> None:
        """Restore :meth:`fit_state` when a fit resumes (called after ``on_fit_start``)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no fit state, but the checkpoint holds "
                             f"{sorted(state)}; was it written by a fit of another guide?")

    def scale_parameters(self) -> list[torch.Tensor]:
        """The unconstrained parameters of the posterior scales (``ρ`` with ``σ = exp ρ`` or
        ``softplus ρ``), which :func:`pyro_bnn.fit` watches to detect scales still limited by
        the learning rate.  Default: none."""
        return []

    def learning_rate_factors(self) -> list[tuple[torch.Tensor, float]]:
        """``(parameter, factor)`` pairs: parameters that :func:`pyro_bnn.fit`'s default
        optimiser trains at ``factor × lr`` instead of ``lr`` (called after set-up).
        Default: none, every parameter at ``lr``."""
        return []

    # ---------------------------------------------------------- prediction
    def predict(self, model, x, *, predictive: str = "sample", num_samples: int = 64,
                batch_size: int = 1024, **kwargs):
        """Alternative predictives (``predictive != "sample"``), e.g. Laplace's ``"glm"``.

        The default supports only Monte Carlo over the guide's draws, which
        :func:`pyro_bnn.predict` computes itself.
        """
        raise ValueError(f"{type(self).__name__} supports only predictive='sample', got {predictive!r}")

    def prediction_problem(self) -> str | None:
        """Why the guide cannot be sampled for predictions yet, or ``None`` if it can.

        :func:`pyro_bnn.predict` and the tools raise this message instead of returning draws
        of an untrained guide.
        """
        return _not_set_up_message(self)

    def likelihood_kind(self) -> tuple[str, torch.Tensor | None] | None:
        """``(kind, noise)`` of the predictive that :meth:`predict` returns for a model without
        a ``likelihood`` attribute (a hand-written ``PyroModule``): ``kind`` is
        ``"categorical"``, ``"bernoulli"`` or ``"gaussian"`` and ``noise`` the Gaussian
        σ (else ``None``).  ``None`` (the default): the guide does not know.
        """
        return None

    def site_names(self) -> list[str]:
        """The latent sites of ``q``, in a fixed order (a guide with :attr:`normal_per_site`
        provides it).  Default: ``NotImplementedError``."""
        raise NotImplementedError(f"the {type(self).__name__} guide does not list its sites")

    def loc_and_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean μ and standard deviation σ of site ``name`` under ``q`` (a guide with
        :attr:`normal_per_site` provides it).  Default: ``NotImplementedError``."""
        raise NotImplementedError(f"the {type(self).__name__} guide has no per-site Normal marginals "
                                  "(normal_per_site is False)")

    # ----------------------------------------------------------- reporting
    def num_variational_parameters(self) -> int:
        """Number of trained values of ``q`` (the ``pb.compare`` column).  Default: the
        guide's ``nn.Parameter`` count (buffers such as MADE masks or Laplace's curvature
        factors are not counted)."""
        return _parameter_count(self)

    def log_evidence(self) -> torch.Tensor | None:
        """The guide's estimate of the log marginal likelihood ``log p(D)`` (0-d tensor), or
        ``None`` (the default) if it has none; ``pb.compare`` reports ``None`` as NaN.  The
        Laplace guide returns its Laplace-GGN evidence (and raises if its curvature is not
        fitted)."""
        return None

    def training_bound(self, model, data, *, num_samples: int = 32) -> tuple[float, str, float] | None:
        """The bound the guide maximises on ``data``, when it is not the ELBO nor
        :meth:`log_evidence`: ``(value, kind, standard_error)`` for ``pb.compare``'s ``bound``
        and ``bound_se`` columns (the symmetrised guide: ``(L^G, "symmetrized_elbo", se)`` from
        ``num_samples`` draws; ``se`` NaN when the estimate has none).
        Default ``None``: the ELBO, or the log evidence where the guide has one."""
        return None

    def settings_description(self) -> str:
        """The guide's settings as ``pb.compare``'s ``configuration`` column shows them
        (``"init_scale=0.01, local reparameterisation on"``).  Default: ``extra_repr()``."""
        return self.extra_repr() if isinstance(self, torch.nn.Module) else ""

    def fit_fingerprint(self) -> dict | None:
        """The guide's options that a resumed fit must match, ``{name: value}``, or ``None``
        (the default): :func:`pyro_bnn.training.resume.fit_fingerprint` then records the
        scalar attributes the guide holds (its constructor options)."""
        return None

    def log_density(self, values: dict) -> torch.Tensor | None:
        """``log q(θ)`` (0-d) at a joint draw ``{site: tensor}``, or ``None``.

        ``None`` (the default) means: read ``log q`` from the guide's own trace of the draw
        (the summed ``log_prob`` of its sample sites, auxiliary ones included), which is right
        for any guide that puts its density in its sample sites; see
        :mod:`pyro_bnn.posterior.guide_density`.
        """
        return None


class _ObservedDuringSetUp(Messenger):
    """Treat the named sample sites as observed (with a value drawn from their
    distribution) while a guide traces its model to set itself up."""

    def __init__(self, names):
        super().__init__()
        self.names = frozenset(names)

    def _pyro_sample(self, msg):
        if msg["name"] in self.names and not msg["is_observed"]:
            if msg["value"] is None:
                msg["value"] = msg["fn"].sample()
            msg["is_observed"] = True


def _clear_transform_cache(module) -> None:
    """Empty the caches of a Pyro/torch ``Transform`` module (``cache_size=1``): the last
    ``(x, y)`` pair and the derived ``_cached_*`` tensors (AffineAutoregressive's log scale)."""
    if not isinstance(module, torch.distributions.Transform):
        return
    if getattr(module, "_cache_size", 0) == 1:
        module._cached_x_y = None, None
    for name, value in list(vars(module).items()):
        if name.startswith("_cached") and name != "_cached_x_y" and isinstance(value, torch.Tensor):
            setattr(module, name, None)


def _parameter_count(module) -> int:
    if not isinstance(module, torch.nn.Module):
        return 0
    return int(sum(p.numel() for p in module.parameters()))


def _not_set_up_message(guide) -> str | None:
    if getattr(guide, "prototype_trace", False) is not None:
        return None
    return (f"the {type(guide).__name__} guide has no parameters yet: train it with pb.fit or SVI; "
            "to use values loaded into Pyro's param store, call the guide once with data, "
            "guide(x, y), first")


class _PyroGuideContract(BNNGuide):
    """The contract's defaults for a guide that does not derive from :class:`BNNGuide`."""

    def __init__(self, guide):
        self.guide = guide

    def prediction_problem(self) -> str | None:
        return _not_set_up_message(self.guide)

    def predict(self, model, x, *, predictive="sample", num_samples=64, batch_size=1024, **kwargs):
        raise ValueError(f"{type(self.guide).__name__} supports only predictive='sample', got {predictive!r}")

    @property
    def bounds_evidence(self) -> bool:
        """False if the guide, or a part of an ``AutoGuideList``, trains a point mass
        (``AutoDelta``, ``AutoLaplaceApproximation``: their ELBO is the log joint, no bound on
        the evidence), or is one of our guides that says so."""
        parts = list(self.guide) if isinstance(self.guide, AutoGuideList) else [self.guide]
        return not any(isinstance(part, (AutoDelta, AutoLaplaceApproximation))
                       or (isinstance(part, BNNGuide) and not part.bounds_evidence) for part in parts)

    def _parts(self) -> list[BNNGuide]:
        """The pyro_bnn guides among an ``AutoGuideList``'s parts: their fit hooks run too (a
        Laplace part fits its curvature at the end of ``pb.fit``)."""
        if not isinstance(self.guide, AutoGuideList):
            return []
        return [part for part in self.guide if isinstance(part, BNNGuide)]

    def on_fit_start(self, ctx) -> None:
        for part in self._parts():
            part.on_fit_start(ctx)

    def on_epoch_start(self, ctx) -> None:
        for part in self._parts():
            part.on_epoch_start(ctx)

    def on_epoch_end(self, ctx) -> None:
        for part in self._parts():
            part.on_epoch_end(ctx)

    def on_fit_end(self, ctx) -> None:
        for part in self._parts():
            part.on_fit_end(ctx)

    def on_fit_abort(self, ctx) -> None:
        for part in self._parts():
            part.on_fit_abort(ctx)

    def num_variational_parameters(self) -> int:
        return _parameter_count(self.guide)

    def settings_description(self) -> str:
        """``extra_repr()``, and the initial scale that Pyro's Gaussian autoguides keep as the
        private ``_init_scale`` (``AutoNormal``, ``AutoMultivariateNormal``, ...)."""
        text = self.guide.extra_repr() if isinstance(self.guide, torch.nn.Module) else ""
        init_scale = getattr(self.guide, "_init_scale", None)  # a Pyro guide's own attribute
        if isinstance(init_scale, float) and "init_scale" not in text:
            return ", ".join(p for p in (text, f"init_scale={init_scale:g}") if p)
        return text

    def scale_parameters(self) -> list[torch.Tensor]:
        if isinstance(self.guide, AutoNormal) and self.guide.prototype_trace is not None:
            return [p for name, p in self.guide.scales.named_parameters()]
        return []


def guide_contract(guide) -> BNNGuide:
    """The guide itself if it is a :class:`BNNGuide`, else an adapter with the defaults.

    This is how :func:`pyro_bnn.fit` and the tools reach hooks, objectives and predictives
    of any guide, Pyro's own autoguides included.
    """
    return guide if isinstance(guide, BNNGuide) else _PyroGuideContract(guide)


#: name -> factory(model, **options) -> guide
GUIDE_REGISTRY: dict[str, Callable] = {}


def register_guide(name: str, factory: Callable | None = None):
    """Register a guide factory under ``name`` (usable as a decorator)."""

    def deco(f):
        GUIDE_REGISTRY[name] = f
        return f

    return deco(factory) if factory is not None else deco


def registered_guides() -> dict[str, Callable]:
    """A copy of the registry of guide factories."""
    return dict(GUIDE_REGISTRY)


class init_to_network:
    """Initialisation strategy: start each site at the network's own weights.

    For a :class:`pyro_bnn.BNN` these are the weights of the network it was built from (so
    a pretrained network's weights become the posterior means' starting point).  For a
    hand-written ``PyroModule`` whose weights are ``PyroSample`` attributes the original
    weights are gone, so weights of shape ``(out, in, ...)`` get PyTorch's default
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` and vectors (biases) the same bound from the
    matching weight when found; other sites fall back to ``fallback`` (the prior median).

    Parameters
    ----------
    model : torch.nn.Module
        The model the guide approximates.
    fallback : callable
        Pyro init strategy for sites it cannot place.
    """

    def __init__(self, model, fallback=init_to_median):
        self.values = initial_values_of(model)
        self.model = model
        self.fallback = fallback

    def __call__(self, site):
        name = site["name"]
        fn = site["fn"]
        if name in BNNGuide.observation_sites:  # data, not a latent (see BNNGuide.set_up)
            return fn.sample()
        device = getattr(fn, "mean", torch.zeros(())).device
        if name in self.values:  # a copy: guides must never share (or write into) these tensors
            return self.values[name].to(device=device, copy=True)
        shape = fn.event_shape if len(fn.event_shape) else fn.batch_shape
        if len(shape) >= 2:
            bound = 1.0 / math.sqrt(max(1, math.prod(shape[1:])))
            return torch.empty(shape, device=device).uniform_(-bound, bound)
        if len(shape) == 1 and name.endswith("bias"):
            w_shape = _sibling_weight_shape(self.model, name)
            if w_shape is not None and len(w_shape) >= 2:
                bound = 1.0 / math.sqrt(max(1, math.prod(w_shape[1:])))
                return torch.empty(shape, device=device).uniform_(-bound, bound)
        return self.fallback(site)


def _sibling_weight_shape(model, bias_site: str):
    module, _ = site_module(model, bias_site)
    if module is None:
        return None
    samples = module.__dict__.get("_pyro_samples", {})
    if "weight" in samples:
        prior = samples["weight"]
        if not hasattr(prior, "sample"):
            prior = prior(module)
        return prior.event_shape if len(prior.event_shape) else prior.batch_shape
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return None if weight is None else weight.shape
