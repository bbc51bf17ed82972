"""``BNN``: any ``torch.nn.Module`` as a Pyro model whose weights are ``PyroSample`` sites."""

from __future__ import annotations

import copy
import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import pyro
import torch
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

from ..arguments import check_bool, check_names
from .batch_scaling import UnscaledBatchWatch
from .batchnorm import warn_batchnorm_in_train_mode
from .input_scale import InputScaleWatch
from .likelihoods import Likelihood, check_output_layer, make_likelihood
from .priors import IIDNormal, Prior, PriorSpec, check_prior_keys, resolve_prior
from .vectorized import batched_function, observation_distribution, under_outer_plate
from .weight_norm import is_weight_norm_layer, weight_norm_setup

__all__ = ["BNN", "BayesianNetwork", "is_bnn", "augmentation_of", "example_input", "initial_values_of",
           "model_likelihood", "network_function_of", "network_of", "normal_prior_params",
           "num_augmentations", "random_directions_of", "site_module", "site_prior_modules", "weight_norm_of",
           "BAYESIAN_LAYERS", "default_stochastic", "fan_in_of"]

#: Layer types whose weights and biases are random by default.
BAYESIAN_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def default_stochastic(name: str, module: nn.Module, param: nn.Parameter) -> bool:
    """Default selection: weights and biases of Linear and Conv1d/2d/3d layers, unless frozen
    (``requires_grad=False``: a frozen feature extractor stays deterministic and fixed)."""
    return isinstance(module, BAYESIAN_LAYERS) and param.requires_grad


def fan_in_of(module: nn.Module, param_name: str, param: torch.Tensor) -> int:
    """Fan-in of the layer a parameter belongs to (a bias uses its weight's fan-in)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
        return int(weight[0].numel())
    return int(param[0].numel()) if param.dim() >= 2 else int(param.numel())


class BayesianNetwork(Protocol):
    """What pyro_bnn's fast paths need of a model: a network with named random sites.

    :class:`BNN` implements it; a hand-written ``PyroModule`` that implements it gets the
    same fast paths (objectives without Pyro tracing, KFAC curvature, predictives).  Models
    that do not are handled through Pyro traces of their ``forward(x, y)``.

    Attributes
    ----------
    site_names : list of str
        The random sites, in a fixed order.
    likelihood : pyro_bnn.model.likelihoods.Likelihood
        Observation model of the network output.

    Optional members, each read through one function that gives its default:
    ``site_normal_prior(site)`` (:func:`normal_prior_params`, default ``None``),
    ``weight_norm`` (:func:`weight_norm_of`, default ``None``: not said), ``initial_values()``
    (:func:`initial_values_of`, default ``{}``), ``net`` (:func:`network_of`, default ``None``);
    a model's
    ``likelihood`` is read through :func:`model_likelihood` (``None`` for a hand-written model
    outside the protocol).
    """

    site_names: list[str]
    likelihood: Likelihood

    def site_prior(self, site: str):
        """The prior distribution of one site."""

    def run_with(self, values: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The network output ``f(x)`` with every random site fixed to ``values[site]``."""

    def site_normal_prior(self, site: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional: ``(loc, scale)`` of an i.i.d. Normal prior on ``site`` (closed-form KL and
        ``log p``), or ``None``.  A model without this member is read through
        :func:`normal_prior_params`, whose default is ``None`` (every prior through
        :meth:`site_prior`)."""


def model_likelihood(model) -> Likelihood | None:
    """The observation model of ``model``: its ``likelihood`` (a :class:`BayesianNetwork`
    member), or ``None`` (the default) for a hand-written model that declares none — its
    observations are then read from its Pyro trace."""
    return getattr(model, "likelihood", None)  # the one read of a model's optional likelihood


def initial_values_of(model) -> dict[str, torch.Tensor]:
    """The starting weights of a model's sites, ``{site: tensor}``: a :class:`BNN`'s
    ``initial_values()`` (copies of the network it was built from), ``{}`` (the default) for a
    model without them."""
    values = getattr(model, "initial_values", None)  # the one read of a model's optional initial_values
    return values() if callable(values) else {}


def network_of(model) -> nn.Module | None:
    """The torch network a model runs (a :class:`BNN`'s ``net``, with its ``"net.<path>"``
    sites), or ``None`` (the default) for a model without one."""
    net = getattr(model, "net", None)  # the one read of a model's optional net
    return net if isinstance(net, nn.Module) else None


def augmentation_of(model) -> nn.Module | None:
    """The learnable input augmentation of an invariant model (``pb.BNN(..., augmentation=)``),
    or ``None`` (the default)."""
    return model._modules.get("augmentation") if isinstance(model, nn.Module) else None


def example_input(model) -> torch.Tensor:
    """A one-row dummy input for drawing from a guide (guides ignore input values): ``(1, F)``
    for a :class:`BNN` whose network starts with a Linear or Flatten layer, on the model's device.

    Raises
    ------
    ValueError
        Any other model (pass an input batch instead)."""
    spec = getattr(model, "_input_spec", None)  # a BNN's own (private) record of its input layer
    if spec is not None and spec[0] in ("linear", "flatten"):  # (1, F) is valid for Flatten too
        for t in list(model.parameters()) + list(model.buffers()):
            return torch.zeros(1, spec[1], device=t.device)
        return torch.zeros(1, spec[1])
    raise ValueError("could not build an example input for this model; pass x= (one batch of "
                     "inputs) so the guide can be sampled")


def site_prior_modules(model) -> dict[str, Prior]:
    """``{site: prior module}`` of a :class:`BNN` (the modules in its ``priors``, keyed by site
    name), ``{}`` (the default) for a model that keeps its priors otherwise."""
    priors = getattr(model, "priors", None)  # the one read of a BNN's prior modules
    if not isinstance(priors, nn.ModuleDict) or not hasattr(model, "site_names"):
        return {}
    return {site: priors[site.replace(".", "__")] for site in model.site_names}


def network_function_of(model):
    """``f(x)``, the network output under the current (sampled or replayed) weights: a
    :class:`BNN`'s ``function``, ``None`` (the default) for a model without one."""
    return getattr(model, "function", None)  # the one read of a model's optional function


def check_input_of(model, x: torch.Tensor) -> None:
    """Run a :class:`BNN`'s cheap input check (:meth:`BNN.check_input`) on all of ``x``;
    nothing for a model without one."""
    check = getattr(model, "check_input", None)  # the one read of a model's optional check_input
    if check is not None:
        check(x)


def weight_norm_of(model) -> bool | None:
    """Whether ``model`` is weight-normalised (``pb.BNN(..., weight_norm=True)``: only the
    scales ``g`` are random): a :class:`BNN`'s ``weight_norm``, ``None`` (the default) for a
    model that does not say."""
    value = getattr(model, "weight_norm", None)  # the one read of a model's optional weight_norm
    return value if isinstance(value, bool) else None


def random_directions_of(model) -> bool:
    """Whether a weight-norm :class:`BNN`'s directions are random (``random_directions=True``);
    ``False`` for any other model."""
    value = getattr(model, "random_directions", False)  # the one read of this optional member
    return value is True


def normal_prior_params(model, site: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``model.site_normal_prior(site)`` of a :class:`BayesianNetwork`, or ``None`` (the
    protocol's default for this optional member: no closed-form Normal prior known)."""
    member = getattr(model, "site_normal_prior", None)  # the protocol's one optional member
    return None if member is None else member(site)


def is_bnn(model) -> bool:
    """Whether ``model`` implements :class:`BayesianNetwork` (the one check the library uses).

    Checked member by member with ``hasattr``: ``isinstance(model, BayesianNetwork)`` does not
    see attributes that ``nn.Module`` keeps in its registries (``likelihood`` is a submodule),
    since Python 3.12 inspects protocols with ``getattr_static``.
    """
    return all(hasattr(model, name) for name in _PROTOCOL_MEMBERS)


def num_augmentations(model) -> int:
    """``S``: the transformed copies an invariant model (``pb.BNN(..., augmentation=)``)
    averages its network over, else 1."""
    aug = augmentation_of(model)
    return 1 if aug is None else int(aug.num_samples)


def site_module(model: nn.Module, site: str) -> tuple[nn.Module | None, str]:
    """``(module, attribute)`` of a site named by its module path (``"net.0.weight"`` →
    ``(model.net[0], "weight")``), as ``pb.BNN`` and ``PyroSample`` attributes of a
    hand-written ``PyroModule`` name them; ``module`` is ``None`` if the path names none."""
    path, _, attr = site.rpartition(".")
    try:
        return (model.get_submodule(path) if path else model), attr
    except AttributeError:
        return None, attr


_PROTOCOL_MEMBERS = ("site_names", "likelihood", "site_prior", "run_with")


class _SitePrior:
    """Callable stored in ``PyroSample``: builds the prior distribution on demand.

    It holds the prior *module*, so the distribution is created on whatever device the
    prior's buffers are on after ``model.to(device)``.
    """

    def __init__(self, prior: Prior, shape: torch.Size, fan_in: int):
        self.prior = prior
        self.shape = torch.Size(shape)
        self.fan_in = fan_in

    def __call__(self, module: nn.Module):
        return self.prior(self.shape, self.fan_in)


class BNN(PyroModule):
    """A Bayesian neural network: a torch network whose parameters are random.

    The network is copied and converted to a ``PyroModule``; each selected parameter
    becomes a ``PyroSample`` site named by its ``named_parameters()`` path under ``net``
    (``"net.0.weight"``).  ``forward(x, y=None)`` is a Pyro model: it samples the weights,
    computes ``f = net(x)`` and observes ``y`` inside
    ``pyro.plate("data", num_data, subsample_size=len(x))``, so an ELBO computed on a
    minibatch is scaled to the whole data set.

    Parameters
    ----------
    net : torch.nn.Module
        Any network; its current weights become the guides' initial locations, so a
        pretrained network can be made Bayesian.
    likelihood : {"categorical", "gaussian", "bernoulli"} or Likelihood
        Observation model.
    prior : Prior, dict or callable, optional
        One prior for all random parameters, a dict keyed by parameter path
        (``"net.0.weight"``, with ``"*"`` as default) or a callable
        ``(name, param) -> Prior``.  Default ``IIDNormal(1.0)``.
    noise : float or "learned", optional
        Gaussian likelihood given by name only: fixed observation std (a positive finite
        Python/NumPy number or one-element tensor), or ``"learned"``.
    stochastic : callable or iterable of str, optional
        Which parameters are random: a predicate ``(name, module, param) -> bool`` or a
        collection of parameter paths (``"net.0.weight"``).  Default: weights and biases of
        Linear and Conv1d/2d/3d layers, except frozen ones (``requires_grad=False``: they stay
        deterministic and are not trained, as a frozen feature extractor is meant).  The rest
        stay deterministic (point estimates trained by :func:`pyro_bnn.fit`); the default warns
        when it leaves another layer's weight matrix so.
    augmentation : nn.Module, optional
        A learnable augmentation distribution (e.g.
        :class:`pyro_bnn.invariance.AffineAugmentation`) mapping ``(N, ...)`` inputs to
        ``S`` transformed copies ``(N·S, ...)`` (example-major, ``augmentation.num_samples``
        = S); the model becomes invariant, ``f̂(x) = (1/S) Σ_s f(T_s x)``, at training and
        test time.  Its extents η are model parameters, frozen unless invariance learning
        trains them (:mod:`pyro_bnn.invariance`).
    weight_norm : bool
        (``True``/``False`` only: a string such as ``"False"`` is an error.)  Weight-norm parametrisation (:mod:`pyro_bnn.model.weight_norm`): Linear/Conv2d weights
        ``W_j = g_j v_j/‖v_j‖``; only the scales ``g`` are random (sites
        ``"net.<path>.weight_g"``, shape ``(out,)``, initial value the row norms), the
        directions ``v`` and the biases are point estimates.
    weight_norm_precision : float, optional
        Prior precision λ of the scales, ``g ~ N(0, 1/λ)`` (default 1).
    random_directions : bool
        With ``weight_norm=True``: the directions ``v`` are random too (sites
        ``"net.<path>.weight_v"``) with the isotropic prior ``v ~ N(0, I)``, under which the
        direction ``v/‖v‖`` is uniform on the sphere and the weight's length is the scale's alone
        (``prior=`` / ``weight_norm_precision`` apply to the scales).  Every row of ``v`` starts
        rescaled to norm √fan_in (entries of order 1, the prior's typical length; the function is
        unchanged).  Default ``False``: the directions are point estimates, as in the paper —
        maximum-likelihood parameters that no ELBO term regularises (``docs/results/fmnist_guides.md``).

    Raises
    ------
    ValueError
        If no parameter is selected as random, a random parameter is shared (a layer used
        twice, tied weights: give each use its own layer, or keep the tensor deterministic
        with ``stochastic=``), or an option has an unknown value (the message names the
        closest valid one).
    TypeError
        An option of the wrong type.

    Notes
    -----
    The priors and the likelihood take the dtype and device of the network's weights
    (``pb.BNN(net.to(torch.float64))`` has float64 priors and noise); a prior or likelihood
    object of another dtype is copied, not changed, so it can be shared with other models.
    ``model.to(dtype)`` converts them along with the network.

    Examples
    --------
    >>> import torch.nn as nn, pyro_bnn as pb
    >>> model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "categorical")
    >>> model.site_names
    ['net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias']
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: str | Likelihood = "categorical",
        prior: PriorSpec | None = None,
        *,
        noise: float | str | None = None,
        stochastic: Callable[[str, nn.Module, nn.Parameter], bool] | Iterable[str] | None = None,
        augmentation: nn.Module | None = None,
        weight_norm: bool = False,
        weight_norm_precision: float | None = None,
        random_directions: bool = False,
    ):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        weight_norm = check_bool("weight_norm", weight_norm)
        random_directions = check_bool("random_directions", random_directions)
        likelihood_module = make_likelihood(likelihood, noise)
        _check_noise_option(likelihood, likelihood_module, noise)
        check_output_layer(net, likelihood_module)
        _refuse_lazy_parameters(net)
        net = copy.deepcopy(net)
        default_selection = stochastic is None
        self.weight_norm = weight_norm
        self.random_directions = random_directions
        if weight_norm:  # the scales g of W_j = g_j v_j/|v_j| are random (Hypernet), the directions v optionally
            net, prior, stochastic = weight_norm_setup(net, prior, stochastic, weight_norm_precision,
                                                       random_directions)
        elif weight_norm_precision is not None or random_directions:
            raise ValueError("weight_norm_precision= and random_directions= need weight_norm=True; got "
                             f"weight_norm_precision={weight_norm_precision!r}, random_directions={random_directions!r}")
        prior = IIDNormal(1.0) if prior is None else prior
        select = _make_selector(stochastic, net)

        chosen = []
        for mod_name, module in net.named_modules():
            for p_name, param in list(module.named_parameters(recurse=False)):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if select(full, module, param):
                    chosen.append((mod_name, module, p_name, param, full))
        _refuse_shared_parameters(net, chosen)
        if default_selection:
            _warn_point_estimate_layers(net, chosen, weight_norm)
        if not chosen:
            raise ValueError(
                "the network has no parameter selected as random (expected Linear/Conv "
                "layers that are not frozen, or a `stochastic=` selection that matches parameter names; got "
                f"parameters {[n for n, _ in net.named_parameters()]})"
            )
        # The priors' and the likelihood's tensors take the dtype and device of the weights
        # they go with (a float64 network gets float64 priors); later .to() moves them along.
        self.likelihood = _like(likelihood_module, chosen[0][3], {})

        check_prior_keys(prior, [f"net.{c[-1]}" for c in chosen])
        self._initial_values: dict[str, torch.Tensor] = {}
        self._fan_in: dict[str, int] = {}
        to_pyro_module_(net)
        self.priors = nn.ModuleDict()
        converted: dict = {}
        for mod_name, _, p_name, param, full in chosen:
            module = net.get_submodule(mod_name) if mod_name else net
            site = f"net.{full}"
            the_prior = _like(resolve_prior(prior, site, param), param, converted)
            fan_in = fan_in_of(module, p_name, param)
            self.priors[site.replace(".", "__")] = the_prior
            self._initial_values[site] = param.detach().clone()
            self._fan_in[site] = fan_in
            setattr(module, p_name, PyroSample(_SitePrior(the_prior, param.shape, fan_in)))
        self.net = net
        if augmentation is not None and not isinstance(augmentation, nn.Module):
            raise TypeError(f"augmentation must be an nn.Module, got {type(augmentation).__name__}")
        self.augmentation = augmentation
        self.site_names: list[str] = [f"net.{c[-1]}" for c in chosen]
        # Plain values, not a module reference: a second reference would re-register the
        # layer under another name and rename its Pyro sites.
        self._input_spec = _input_spec(net)
        self.__dict__["_weights_dtype"] = self._common_weights_dtype()
        self.__dict__["batch_watch"] = UnscaledBatchWatch()  # minibatches without num_data= (one per model)
        self.__dict__["input_watch"] = InputScaleWatch()  # unscaled 0-255 pixels (input_scale.py)

    # ------------------------------------------------------------------ model
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, num_data: int | None = None):
        """Pyro model: sample weights, compute ``f = net(x)``, observe ``y``.

        Parameters
        ----------
        x : Tensor, shape (M, ...)
            A minibatch of inputs.
        y : Tensor, optional
            Targets; ``None`` to sample predictions.
        num_data : int, optional
            Size N of the whole data set (the plate's size); default ``len(x)``.

        Returns
        -------
        Tensor
            Network output ``f``, shape ``(M, num_outputs)``; ``(*P, M, num_outputs)`` when
            Pyro hands the model batched weight draws ``(*P, *shape)``
            (:mod:`pyro_bnn.model.vectorized`).

        Raises
        ------
        ValueError
            ``y`` does not have the shape the likelihood expects of ``f`` (a Gaussian target
            of shape ``(M,)`` for an output ``(M, 1)`` would broadcast to ``(M, M)``).
        """
        if self.input_watch.looking[y is None]:  # unscaled pixels? (first training / prediction call)
            self.input_watch.see(x, y is None)
        # inside a caller's plate (Predictive(parallel=True), vectorize_particles) the weight
        # draws may be batched: one network pass per draw, f of shape (*P, M, ...)
        f, batch_dims = batched_function(self, x) if under_outer_plate() else (self.function(x), 0)
        if y is not None:
            self.likelihood.check_shape(y, f.shape[batch_dims:])
        elif self.training:  # predicting: BatchNorm in train mode would use and overwrite batch stats
            warn_batchnorm_in_train_mode(self, given=self.__dict__.setdefault("_warnings_given", set()))
        self.batch_watch.see(x, y, num_data)
        size = len(x) if num_data is None else int(num_data)
        with pyro.plate("data", size, subsample_size=len(x)):
            pyro.sample("obs", observation_distribution(self.likelihood, f, batch_dims), obs=y)
        return f

    def run_with(self, values: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The network output ``f(x)`` with the random sites fixed to ``values`` (no Pyro tracing).

        Parameters
        ----------
        values : mapping site name -> Tensor
            One value per site, with the site's shape (sites left out are drawn from their
            priors, as in :meth:`function`).
        x : Tensor, shape (M, ...)
            Inputs.

        Returns
        -------
        Tensor, shape (M, num_outputs)
            Differentiable in ``values`` (and in the model's deterministic parameters).

        Notes
        -----
        The values go straight into the ``PyroModule`` context cache, which is where
        ``PyroSample`` looks first, so no Pyro messenger is involved: this is the fast path
        of the objectives, the curvature and the predictives.
        """
        ctx = self._pyro_context
        with ctx:
            for name, value in values.items():
                ctx.set(name, value)
            return self.function(x)

    def function(self, x: torch.Tensor) -> torch.Tensor:
        """The network output ``f(x)`` under the current (sampled or replayed) weights."""
        self.check_input(x)
        # Read past PyroModule.__getattr__: η is not a Pyro param (invariance learning owns it).
        aug = self._modules.get("augmentation")
        if aug is None:
            return self.net(x)
        # Invariant model: f̂(x) = mean_s f(T_s x); copies are example-major (n·S + s).
        f = self.net(aug(x))
        return f.reshape(len(x), aug.num_samples, *f.shape[1:]).mean(1)

    # ------------------------------------------------------------- utilities
    def check_input(self, x: torch.Tensor) -> None:
        """Cheap shape/type checks that give a clear error before the network fails.

        The input layout is known only where the network's first operation is: a ``Linear``
        (the last axis holds its ``in_features``), a ``Flatten`` then a ``Linear`` (each example
        holds ``in_features`` values, any shape), or a ``Conv2d`` (``(N, C, H, W)``).  Other
        networks (custom ``forward``s, reshapes) are not checked here: they raise their own
        errors, and valid input is never rejected.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        kind, size = self._input_spec or (None, None)
        if kind is not None:
            self._check_input_dtype(x)
        if kind == "linear" and (x.dim() == 0 or x.shape[-1] != size):
            raise ValueError(
                f"input has {x.shape[-1] if x.dim() else 0} features (shape {tuple(x.shape)}) but "
                f"the first Linear layer expects {size}"
            )
        if kind == "flatten" and (x.dim() < 2 or x[0].numel() != size):
            raise ValueError(
                f"each input example must hold {size} values for Flatten -> Linear({size}, ...), got "
                f"input of shape {tuple(x.shape)}"
            )
        if kind == "conv2d" and (x.dim() != 4 or x.shape[1] != size):
            raise ValueError(
                f"input must have shape (N, {size}, H, W) for the first Conv2d layer, "
                f"got {tuple(x.shape)}"
            )

    def _check_input_dtype(self, x: torch.Tensor) -> None:
        """Floating ``x`` of another dtype than the weights (torch's own error names
        neither the input nor the fix); skipped under autocast and for mixed-dtype models."""
        if not x.is_floating_point() or torch.is_autocast_enabled(x.device.type):
            return
        dtype = self.__dict__.get("_weights_dtype")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"x has dtype {x.dtype} but the model's weights are {dtype}; convert "
                            f"the inputs with x.to({dtype}), or convert the model with "
                            f"model.to({x.dtype})")

    def _apply(self, fn, *args, **kwargs):
        # .to(device / dtype), .double(), ... move the initial values too: they define the
        # model's dtype and device for input checks and the guides' initial locations
        out = super()._apply(fn, *args, **kwargs)
        self._initial_values = {name: fn(value) for name, value in self._initial_values.items()}
        self.__dict__["_weights_dtype"] = self._common_weights_dtype()
        return out

    def _common_weights_dtype(self) -> torch.dtype | None:
        """The floating dtype of all weights (random and deterministic), ``None`` if mixed."""
        dtypes = {t.dtype for t in self._initial_values.values() if t.is_floating_point()}
        dtypes |= {p.dtype for p in self.net.parameters() if p.is_floating_point()}
        return dtypes.pop() if len(dtypes) == 1 else None

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Copies of the weights of the network it was built from, keyed by site name."""
        return {name: value.clone() for name, value in self._initial_values.items()}

    def site_normal_prior(self, site: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(loc, scale)`` of an i.i.d. Normal prior on ``site`` (closed-form KL), else ``None``."""
        return self.priors[site.replace(".", "__")].normal_params(self._fan_in[site])

    def site_prior(self, site: str):
        """The prior distribution of one site (on the prior's current device)."""
        return self.priors[site.replace(".", "__")](self._initial_values[site].shape, self._fan_in[site])

    def set_prior_(self, site: str, prior: Prior) -> None:
        """Give one site its own prior module (in place): the Pyro model, ``site_prior`` and
        ``site_normal_prior`` use it from now on; the other sites keep theirs.

        Parameters
        ----------
        site : str
            A random site (``"net.0.weight"``).
        prior : Prior
            Moved to the dtype and device of the site's weights (a copy if they differ).

        Raises
        ------
        KeyError
            ``site`` is not a random site of this model.
        TypeError
            ``prior`` is not a :class:`~pyro_bnn.model.priors.Prior`.
        """
        if site not in self._fan_in:
            raise KeyError(f"{site!r} is not a random site of this model; its sites are {self.site_names}")
        if not isinstance(prior, Prior):
            raise TypeError(f"prior for {site!r} must be a pyro_bnn.model.priors.Prior, got {type(prior).__name__}")
        key = site.replace(".", "__")
        # the old prior's tensors follow model.to(); the initial values are kept where they were
        reference = next((t for t in self.priors[key].buffers() if t.is_floating_point()),
                         self._initial_values[site])
        prior = _like(prior, reference, {})
        self.priors[key] = prior
        module, attr = site_module(self, site)
        setattr(module, attr, PyroSample(_SitePrior(prior, self._initial_values[site].shape, self._fan_in[site])))

    def extra_repr(self) -> str:
        return f"likelihood={self.likelihood.name!r}, sites={len(self.site_names)}"


def _input_spec(net: nn.Module) -> tuple[str, int] | None:
    """What :meth:`BNN.check_input` can check of the network's input, from its first
    operation (``None`` when that is not known)."""
    first = net
    while isinstance(first, nn.Sequential) and len(first):
        if isinstance(first[0], nn.Flatten) and len(first) > 1 and isinstance(first[1], nn.Linear) \
                and first[0].start_dim == 1 and first[0].end_dim == -1:
            return "flatten", first[1].in_features
        first = first[0]
    if isinstance(first, nn.Linear):
        return "linear", first.in_features
    if isinstance(first, nn.Conv2d):
        return "conv2d", first.in_channels
    return None


def _check_noise_option(name_or_module, likelihood: Likelihood, noise) -> None:
    """``noise=`` belongs to a Gaussian likelihood given by name (a ``Likelihood`` instance
    carries its own noise; ``noise=`` next to it would be ignored).  A Gaussian by name without
    ``noise=`` is warned of: its σ = 1 is fixed, whatever the scale of the targets."""
    if noise is None:
        if isinstance(name_or_module, str) and likelihood.name == "gaussian":
            warnings.warn(f"likelihood={name_or_module!r} without noise=: the observation noise is fixed at "
                          "σ = 1, whatever the scale of your targets (targets in [0, 0.1] would be all noise, "
                          "targets in the thousands would make σ negligible); pass noise=<the targets' noise "
                          "std> or noise='learned' (noise=1.0 keeps this default without the warning)",
                          UserWarning, stacklevel=3)
        return
    if isinstance(name_or_module, Likelihood):
        raise ValueError(f"noise= is ignored next to a likelihood instance "
                         f"({type(name_or_module).__name__}); give the noise to it instead, "
                         "e.g. pb.likelihoods.Gaussian(noise=0.1), or pass likelihood='gaussian'")
    if likelihood.name != "gaussian":
        raise ValueError(f"noise= applies to the gaussian likelihood, not {name_or_module!r}")


def _like(module: nn.Module, reference: torch.Tensor, converted: dict) -> nn.Module:
    """``module`` with its floating tensors in the dtype and on the device of ``reference``.

    A module already there is returned as it is; otherwise a converted copy, so a prior or
    likelihood object that the caller also uses elsewhere (with a float32 network) is left
    unchanged.  ``converted`` maps ``id(module)`` to its copy, so a prior shared by several
    sites stays one shared module.
    """
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    if all(t.dtype == reference.dtype and t.device == reference.device for t in tensors):
        return module
    if id(module) not in converted:
        converted[id(module)] = copy.deepcopy(module).to(device=reference.device, dtype=reference.dtype)
    return converted[id(module)]


def _refuse_lazy_parameters(net: nn.Module) -> None:
    """Refuse a network whose lazy layers (``nn.LazyLinear`` ...) have no shapes yet: a prior
    needs its weight's shape."""
    lazy = [f"{type(m).__name__} {('net.' + n) if n else 'net'!r}" for n, m in net.named_modules()
            if any(nn.parameter.is_lazy(p) for p in m.parameters(recurse=False))]
    if lazy:
        raise ValueError(f"the network has uninitialised lazy parameters ({', '.join(lazy)}); run it once on "
                         "a batch of inputs (net(x[:1])) before pb.BNN, so that every weight has the shape "
                         "its prior needs")


def _refuse_shared_parameters(net: nn.Module, chosen: list) -> None:
    """Refuse a random parameter that the network reaches under more than one path.

    A layer used twice (``nn.Sequential(a, act, a)``) or tied weights (``b.weight =
    a.weight``) share one tensor.  As ``PyroSample`` sites it would either become two
    independent random weights (the tie silently lost) or one site that Pyro names by its
    last path while the guides look for its first; neither is the user's model.
    """
    paths: dict[int, list[str]] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(f"net.{name}")
    for *_, param, _full in chosen:
        shared = paths.get(id(param), [])
        if len(shared) > 1:
            raise ValueError(
                f"the network uses one parameter tensor under {len(shared)} paths, {', '.join(shared)} "
                "(a layer used twice, or tied weights); pb.BNN cannot make a shared tensor one random "
                "site. Give each use its own layer (copy.deepcopy(layer)), or keep the shared tensor "
                "deterministic with a stochastic= predicate that returns False for it")


def _warn_point_estimate_layers(net: nn.Module, chosen: list, weight_norm: bool) -> None:
    """Warn when the default selection leaves a layer's weight matrices deterministic.

    The defaults make Linear and Conv1d/2d/3d random (with ``weight_norm=True``: the scales of
    Linear and Conv2d); a ConvTranspose, Embedding, recurrent layer or a module's own matrix
    would otherwise stay a point estimate without a word.  Normalisation layers' 1-D affine
    parameters are deterministic by convention and not named.
    """
    random = {id(c[3]) for c in chosen}
    left = [f"{type(module).__name__} {('net.' + name) if name else 'net'!r}"
            for name, module in net.named_modules()
            if not (weight_norm and is_weight_norm_layer(module))
            and any(p.dim() >= 2 and p.requires_grad and id(p) not in random
                    for p in module.parameters(recurse=False))]
    if left:
        rule = ("weight_norm=True makes random the scales of nn.Linear and nn.Conv2d layers only" if weight_norm
                else "by default only the weights and biases of nn.Linear and nn.Conv1d/2d/3d layers are random")
        warnings.warn(f"pb.BNN: {rule}; {', '.join(left)} keep{'s' if len(left) == 1 else ''} point-estimate "
                      "weights. Choose the random parameters with stochastic= (a predicate (name, module, "
                      "param) -> bool, or parameter paths), which also silences this warning",
                      UserWarning, stacklevel=3)


def _make_selector(stochastic, net: nn.Module):
    """The predicate ``(name, module, param) -> bool`` of a ``stochastic=`` option."""
    if stochastic is None:
        return lambda full, module, param: default_stochastic(full, module, param)
    if callable(stochastic):
        return stochastic
    names = _stochastic_names(stochastic)
    known = [n for n, _ in net.named_parameters()]
    stripped = {n[4:] if n.startswith("net.") else n for n in names}
    unknown = sorted(stripped - set(known))
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hints.append(f"{name!r} (did you mean {'net.' + close[0]!r}?)" if close else repr(name))
        raise ValueError(f"stochastic= names parameters the network lacks: {', '.join(hints)}; "
                         f"it has {['net.' + n for n in known]}")
    return lambda full, module, param: full in stripped


def _stochastic_names(stochastic) -> list[str]:
    """The parameter paths of a ``stochastic=`` collection (one string is one path)."""
    return check_names(stochastic, expected="stochastic must be None, a predicate (name, module, param) -> "
                                            "bool or a collection of parameter paths ('net.0.weight')",
                       element="stochastic= parameter paths must be strings ('net.0.weight')")
