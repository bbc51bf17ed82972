"""Weight priors.

A prior is a small :class:`torch.nn.Module` whose hyperparameters are *buffers*, so
``model.to("cuda")`` moves them together with the network (a long-standing pain with
priors built from Python floats in Pyro and TyXe).  :class:`~pyro_bnn.BNN` gives each
prior the dtype and device of its weights (a copy, if the prior object has others), and
a conversion to another dtype keeps the exact hyperparameter values
(:class:`ScalarBuffers`).  Calling a prior with a parameter
shape returns a Pyro distribution whose event shape is that shape.

A :class:`~pyro_bnn.BNN` accepts a prior in three forms (as NumPyro's
``random_flax_module`` does):

* one :class:`Prior`, used for every random parameter;
* a dict keyed by parameter path (``"net.0.weight"``; a key ``"*"`` is the default);
* a callable ``(name, parameter) -> Prior``.

Examples
--------
>>> import pyro_bnn as pb
>>> p = pb.priors.IIDNormal(1.0)
>>> p((3, 2)).event_shape
torch.Size([3, 2])
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import nn

__all__ = [
    "Prior",
    "IIDNormal",
    "FanInNormal",
    "ScaleMixture",
    "ScaleMixtureNormal",
    "PriorSpec",
    "resolve_prior",
    "check_prior_keys",
]


def real_scalar(value, what: str, *, positive: bool = False) -> float:
    """``value`` as a finite Python float (``> 0`` if ``positive``), else a clear error.

    Accepted: Python and NumPy real numbers (``0.1``, ``2``, ``np.float32(0.1)``) and
    one-element tensors or arrays (``torch.tensor(0.1)``).  Refused: bools (``True`` is
    not a scale), strings, complex numbers, tensors of several elements, NaN/inf (a
    non-finite hyperparameter makes every ELBO infinite or NaN, which ``fit`` would only
    report later as a diverged loss), and values ``<= 0`` when ``positive``.

    Raises
    ------
    TypeError
        Not a real number.
    ValueError
        Not finite, or not ``> 0`` when ``positive``.
    """
    if _is_bool(value) or not (isinstance(value, numbers.Real) or _is_array(value)):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    if _is_array(value):
        value = _array_item(value, what)
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v}")
    if positive and not v > 0:
        raise ValueError(f"{what} must be > 0, got {v}")
    return v


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _is_array(value) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _array_item(value, what: str):
    """The one real element of a tensor or array, else a ``TypeError``."""
    size = value.size if isinstance(value, np.ndarray) else value.numel()
    if size != 1:
        raise TypeError(f"{what} must be a real number (a float or a one-element tensor), "
                        f"got a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}")
    if isinstance(value, np.ndarray):
        not_real = value.dtype.kind not in "iuf"
    else:
        not_real = value.dtype == torch.bool or value.is_complex()
    if not_real:
        raise TypeError(f"{what} must be a real number, got a {type(value).__name__} of dtype {value.dtype}")
    return value.item()


class ScalarBuffers(nn.Module):
    """A module whose scalar hyperparameters are buffers that keep their exact value.

    ``register_scalar(name, value)`` stores ``value`` as a 0-d float32 buffer (so the module
    follows ``.to(device / dtype)`` like any buffer) and remembers the Python float.  When
    a conversion changes the buffer's dtype while it still holds that value, the buffer is
    rebuilt from the Python float: ``.to(torch.float64)`` gives ``0.1`` as a float64 0.1,
    not as the float32 value 0.10000000149 widened.  A buffer changed since (a loaded state
    dict, a tuned hyperparameter) is converted as it is.
    """

    def register_scalar(self, name: str, value: float) -> None:
        self.__dict__.setdefault("_exact_scalars", {})[name] = float(value)
        self.register_buffer(name, torch.tensor(float(value)))

    def _apply(self, fn, *args, **kwargs):
        exact = self.__dict__.get("_exact_scalars", {})
        before = {name: self._buffers.get(name) for name in exact}
        out = super()._apply(fn, *args, **kwargs)
        for name, value in exact.items():
            old, new = before[name], self._buffers.get(name)
            if (old is None or new is None or not new.is_floating_point() or new.dtype == old.dtype
                    or old.shape != () or old.is_meta
                    or float(old) != float(torch.tensor(value, dtype=old.dtype))):
                continue
            self._buffers[name] = torch.tensor(value, dtype=new.dtype, device=new.device)
        return out


class Prior(ScalarBuffers):
    """Base class: ``prior(shape, fan_in) -> Distribution`` with event shape ``shape``."""

    def forward(self, shape: torch.Size | tuple[int, ...], fan_in: int | None = None):
        raise NotImplementedError

    def normal_params(self, fan_in: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(loc, scale)`` if this prior is an i.i.d. Normal (closed-form KL), else ``None``."""
        return None

    @staticmethod
    def _to_event(d: dist.TorchDistribution, shape) -> dist.TorchDistribution:
        return d.expand(torch.Size(shape)).to_event(len(shape))


class IIDNormal(Prior):
    """Independent ``N(loc, scale²)`` on every weight.

    Parameters
    ----------
    scale : float
        Prior standard deviation σ (Blundell et al. use σ = 1).
    loc : float
        Prior mean.
    """

    def __init__(self, scale: float = 1.0, loc: float = 0.0):
        super().__init__()
        scale = real_scalar(scale, "IIDNormal scale", positive=True)
        loc = real_scalar(loc, "IIDNormal loc")
        self.register_scalar("loc", loc)
        self.register_scalar("scale", scale)

    def forward(self, shape, fan_in=None):
        return self._to_event(dist.Normal(self.loc, self.scale), shape)

    def normal_params(self, fan_in=None):
        return self.loc, self.scale

    def extra_repr(self) -> str:
        return f"loc={self.loc.item():g}, scale={self.scale.item():g}"


class FanInNormal(Prior):
    """``N(0, gain² / fan_in)``: the fan-in scaled prior (Radford Neal; He et al.).

    With ``gain = sqrt(2)`` this is He initialisation read as a prior; with ``gain = 1``
    it is the LeCun/Radford scaling that keeps the prior function variance independent of
    width.

    Parameters
    ----------
    gain : float
        Multiplier of ``1 / sqrt(fan_in)``.
    """

    def __init__(self, gain: float = 1.0):
        super().__init__()
        gain = real_scalar(gain, "FanInNormal gain", positive=True)
        self.register_scalar("gain", gain)

    def forward(self, shape, fan_in=None):
        if fan_in is None:
            fan_in = int(math.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        scale = self.gain / math.sqrt(max(fan_in, 1))
        return self._to_event(dist.Normal(torch.zeros_like(self.gain), scale), shape)

    def normal_params(self, fan_in=None):
        if fan_in is None:
            return None
        return torch.zeros_like(self.gain), self.gain / math.sqrt(max(fan_in, 1))

    def extra_repr(self) -> str:
        return f"gain={self.gain.item():g}"


class ScaleMixtureNormal(dist.TorchDistribution):
    """``π N(0, σ1²) + (1 − π) N(0, σ2²)`` elementwise (Blundell et al. 2015, eq. 7)."""

    arg_constraints = {
        "pi": constraints.unit_interval,
        "sigma1": constraints.positive,
        "sigma2": constraints.positive,
    }
    support = constraints.real
    has_rsample = False

    def __init__(self, pi, sigma1, sigma2, validate_args=None):
        self.pi, self.sigma1, self.sigma2 = torch.broadcast_tensors(
            torch.as_tensor(pi), torch.as_tensor(sigma1), torch.as_tensor(sigma2)
        )
        super().__init__(self.pi.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        return ScaleMixtureNormal(
            self.pi.expand(batch_shape),
            self.sigma1.expand(batch_shape),
            self.sigma2.expand(batch_shape),
        )

    def log_prob(self, value):
        lp1 = dist.Normal(0.0, self.sigma1).log_prob(value) + torch.log(self.pi)
        lp2 = dist.Normal(0.0, self.sigma2).log_prob(value) + torch.log1p(-self.pi)
        return torch.logaddexp(lp1, lp2)

    def sample(self, sample_shape=torch.Size()):  # noqa: B008 (torch's own signature)
        shape = self._extended_shape(sample_shape)
        with torch.no_grad():
            like = {"device": self.sigma1.device, "dtype": self.sigma1.dtype}
            pick = torch.rand(shape, **like) < self.pi.expand(shape)
            scale = torch.where(pick, self.sigma1.expand(shape), self.sigma2.expand(shape))
            return torch.randn(shape, **like) * scale

    @property
    def mean(self):
        return torch.zeros_like(self.pi)

    @property
    def variance(self):
        return self.pi * self.sigma1**2 + (1 - self.pi) * self.sigma2**2


class ScaleMixture(Prior):
    """Blundell's scale-mixture prior ``π N(0, σ1²) + (1−π) N(0, σ2²)``.

    The paper's grid is π ∈ {1/4, 1/2, 3/4}, −log σ1 ∈ {0, 1, 2}, −log σ2 ∈ {6, 7, 8}.
    Its KL has no closed form, so the ELBO uses a Monte Carlo estimate for these sites.
    """

    def __init__(self, pi: float = 0.5, sigma1: float = 1.0, sigma2: float = math.exp(-6)):
        super().__init__()
        pi = real_scalar(pi, "ScaleMixture pi")
        if not 0.0 < pi < 1.0:
            raise ValueError(f"ScaleMixture pi must be in (0, 1), got {pi!r}")
        sigma1 = real_scalar(sigma1, "ScaleMixture sigma1", positive=True)
        sigma2 = real_scalar(sigma2, "ScaleMixture sigma2", positive=True)
        self.register_scalar("pi", pi)
        self.register_scalar("sigma1", sigma1)
        self.register_scalar("sigma2", sigma2)

    def forward(self, shape, fan_in=None):
        return self._to_event(ScaleMixtureNormal(self.pi, self.sigma1, self.sigma2), shape)


PriorSpec = Prior | Mapping[str, Prior] | Callable[[str, torch.Tensor], Prior]


class IIDDistribution(Prior):
    """Any scalar torch/Pyro distribution as an i.i.d. prior on every weight (TyXe's habit:
    ``pb.BNN(net, prior=dist.Normal(0., 1.))``).  A scalar ``Normal`` becomes
    :class:`IIDNormal` (closed-form KL) in :func:`resolve_prior`; other distributions keep
    their tensors where they were created (build them on the model's device)."""

    def __init__(self, distribution: torch.distributions.Distribution):
        super().__init__()
        if distribution.batch_shape != torch.Size() or distribution.event_shape != torch.Size():
            raise ValueError("a distribution used as a prior must be scalar (one i.i.d. factor per weight), got "
                             f"batch_shape {tuple(distribution.batch_shape)}, event_shape "
                             f"{tuple(distribution.event_shape)}")
        self.distribution = distribution

    def forward(self, shape, fan_in=None):
        d = self.distribution
        if not isinstance(d, dist.torch_distribution.TorchDistributionMixin):  # a torch distribution: Pyro's methods
            d = _as_pyro(d)
        return self._to_event(d, shape)

    def extra_repr(self) -> str:
        return repr(self.distribution)


def _as_pyro(d: torch.distributions.Distribution) -> dist.TorchDistribution:
    """A torch distribution with Pyro's ``expand``/``to_event`` (through ``ExpandedDistribution``)."""
    return dist.torch_distribution.ExpandedDistribution(d, d.batch_shape)


def prior_from_distribution(d: torch.distributions.Distribution) -> Prior:
    """:class:`IIDNormal` for a scalar ``Normal``, else :class:`IIDDistribution`."""
    if type(d) in (torch.distributions.Normal, dist.Normal) and d.batch_shape == torch.Size():
        return IIDNormal(scale=float(d.scale), loc=float(d.loc))
    return IIDDistribution(d)


def resolve_prior(spec: PriorSpec, name: str, param: torch.Tensor) -> Prior:
    """Pick the :class:`Prior` for parameter ``name`` from any of the three accepted forms.

    Raises
    ------
    KeyError
        A dict without ``name`` and without a ``"*"`` default.
    TypeError
        The spec (or what the callable returned) is not a :class:`Prior`.
    """
    if isinstance(spec, torch.distributions.Distribution):  # before `callable`: Pyro's are callable
        spec = prior_from_distribution(spec)
    if isinstance(spec, Prior):
        prior = spec
    elif isinstance(spec, Mapping):
        if name in spec:
            prior = spec[name]
        elif "*" in spec:
            prior = spec["*"]
        else:
            raise KeyError(
                f"prior dict has no entry for parameter {name!r} and no '*' default; "
                f"keys given: {sorted(spec)}"
            )
    elif callable(spec):
        prior = spec(name, param)
    else:
        raise TypeError(
            "prior must be a pyro_bnn.model.priors.Prior or a scalar torch/Pyro distribution, a dict of them keyed by parameter path, "
            f"or a callable (name, param) -> Prior; got {type(spec).__name__}"
        )
    if isinstance(prior, torch.distributions.Distribution):
        prior = prior_from_distribution(prior)
    if not isinstance(prior, Prior):
        raise TypeError(
            f"prior for {name!r} must be a pyro_bnn.model.priors.Prior, got {type(prior).__name__}"
        )
    return prior


def check_prior_keys(spec: PriorSpec, site_names: Sequence[str]) -> None:
    """Reject keys of a prior dict that match no random parameter.

    With a ``"*"`` default, :func:`resolve_prior` never looks at a misspelled key
    (``"net.0.wieght"``), so the prior the user meant would be silently replaced by the
    default.  Call this once after every site has been resolved.

    Parameters
    ----------
    spec : Prior, dict or callable
        The ``prior=`` argument; only dicts are checked.
    site_names : sequence of str
        The model's random sites (``"net.0.weight"``, ...).

    Raises
    ------
    ValueError
        A key other than ``"*"`` names no site; the message names the closest site.
    """
    if not isinstance(spec, Mapping):
        return
    sites = list(site_names)
    unknown = [k for k in spec if k != "*" and k not in sites]
    if not unknown:
        return
    hints = []
    for key in unknown:
        text = str(key)
        if f"net.{text}" in sites:
            close = [f"net.{text}"]
        else:
            close = difflib.get_close_matches(text, sites, n=1, cutoff=0.5)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise ValueError(
        f"prior dict key(s) {', '.join(hints)} match no random parameter of the model; "
        f"expected keys among {sites} or '*' for the default")
