"""Observation models: how the network output ``f`` explains the targets ``y``.

Each likelihood is a small module with

* ``distribution(f)`` — the Pyro distribution of one batch of targets given outputs ``f``;
* ``validate(f_or_none, y)`` — clear errors for targets of the wrong kind;
* ``hessian_factor``-style information is left to the curvature code.

Observation noise of the Gaussian likelihood is either fixed (a buffer) or learned as a
point estimate (an ``nn.Parameter`` on the log scale, optimised with the network).
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import nn

from ..arguments import check_choice
from .priors import ScalarBuffers, real_scalar

__all__ = ["Likelihood", "Categorical", "Gaussian", "Bernoulli", "make_likelihood", "check_output_layer",
           "LIKELIHOOD_KINDS", "kind_and_noise", "distribution_kind", "inverse_link"]


class Likelihood(nn.Module):
    """Base class of observation models."""

    name: str = ""
    #: True for likelihoods whose predictions are class probabilities.
    is_classification: bool = False

    def distribution(self, f: torch.Tensor, batch_dims: int = 1) -> dist.TorchDistribution:
        """The distribution of targets given outputs ``f`` whose first ``batch_dims``
        dimensions are batch dimensions (the examples, and any draws left of them)."""
        raise NotImplementedError

    def validate(self, y: torch.Tensor, f: torch.Tensor | None = None) -> None:
        """Raise ``ValueError``/``TypeError`` if ``y`` cannot be a target."""

    def check_shape(self, y: torch.Tensor, f_shape: torch.Size) -> None:
        """Raise ``ValueError`` if targets ``y`` cannot go with outputs of shape ``f_shape``
        ``(M, ...)``: a shape check only, cheap enough for every model call (torch would
        broadcast a mismatch silently: a Gaussian target ``(M,)`` against ``(M, 1)`` is
        ``(M, M)``).  The base class accepts every shape."""


def _target_shape_error(kind: str, y: torch.Tensor, expected: tuple, f_shape, hint: str) -> ValueError:
    return ValueError(f"{kind} targets must have shape {expected} for a network output of shape "
                      f"{tuple(f_shape)}, got {tuple(y.shape)}{hint}")


class Categorical(Likelihood):
    """``y ~ Categorical(softmax(f))`` with integer class labels."""

    name = "categorical"
    is_classification = True

    def distribution(self, f, batch_dims=1):
        return dist.Categorical(logits=f)

    def check_shape(self, y, f_shape):
        if tuple(y.shape) != tuple(f_shape[:-1]):
            hint = (" (one-hot targets: pass y.argmax(-1))" if y.shape == f_shape else
                    " (labels in a column: pass y.squeeze(-1))" if y.shape == (*f_shape[:-1], 1) else "")
            raise _target_shape_error("categorical", y, tuple(f_shape[:-1]), f_shape, hint)

    def validate(self, y, f=None):
        if y.is_floating_point() or y.dtype == torch.bool or y.is_complex():
            raise TypeError(f"categorical likelihood expects integer class labels, got dtype {y.dtype}"
                            + _label_hint(y))
        if y.dtype not in (torch.int64, torch.uint8):
            raise TypeError(f"categorical labels must be int64 (torch.long), got {y.dtype}; "
                            "convert them with y.long()")
        if y.dim() != 1:
            raise ValueError(f"categorical labels must have shape (N,), got {tuple(y.shape)}" + _label_hint(y))
        if y.numel():
            lo, hi = (int(v) for v in torch.aminmax(y))
            num_classes = None if f is None else f.shape[-1]
            if lo < 0 or (num_classes is not None and hi >= num_classes):
                expected = (f"in [0, {num_classes - 1}] for a network with {num_classes} outputs"
                            if num_classes is not None else ">= 0")
                hint = (" (negative labels such as PyTorch's ignore_index -100 are not supported: "
                        "drop those examples)") if lo < 0 else ""
                if num_classes == 1:  # a softmax over one output is certain of class 0
                    hint += (" (a categorical likelihood needs one output per class: for two classes "
                             "give the network 2 outputs, or use the 'bernoulli' likelihood with 1)")
                raise ValueError(f"labels must lie {expected}; got labels in [{lo}, {hi}]{hint}")


def _label_hint(y) -> str:
    """What categorical targets that are not ``(N,)`` integer labels look like, and the fix:
    one-hot rows (``y.argmax(-1)``), rows of class probabilities (soft labels: not a
    categorical observation), whole numbers stored as floats (``y.long()``)."""
    if y.is_complex() or not y.numel():
        return ""
    v = y.double()
    if y.dim() == 2 and y.shape[1] > 1:
        sums_to_one = bool(((v.sum(-1) - 1).abs() < 1e-6).all()) and bool((v >= 0).all())
        if sums_to_one and bool(((v == 0) | (v == 1)).all()):
            return f" (one-hot rows of {y.shape[1]} classes: pass y.argmax(-1))"
        if sums_to_one:
            return " (rows of class probabilities: soft labels are not supported; pass hard labels y.argmax(-1))"
        return ""
    if y.dim() == 1 and y.dtype != torch.bool and bool((v == v.round()).all()):
        return " (whole numbers stored as floats: convert them with y.long())"
    return ""


class Bernoulli(Likelihood):
    """``y ~ Bernoulli(sigmoid(f))`` with 0/1 targets of the same shape as ``f``."""

    name = "bernoulli"
    is_classification = True

    def distribution(self, f, batch_dims=1):
        return dist.Bernoulli(logits=f).to_event(f.dim() - batch_dims)

    def check_shape(self, y, f_shape):
        _check_same_shape("bernoulli", y, f_shape)

    def validate(self, y, f=None):
        if y.numel() and not torch.all((y == 0) | (y == 1)):
            raise ValueError("bernoulli targets must be 0 or 1; got other values")
        if f is not None and y.shape[1:] != f.shape[1:]:
            raise ValueError(
                f"bernoulli targets must have shape (N, {', '.join(map(str, f.shape[1:]))}) like "
                f"the network output, got {tuple(y.shape)}"
            )


class Gaussian(ScalarBuffers, Likelihood):
    """``y ~ N(f, σ²)``; σ fixed (``noise=0.1``) or learned (``noise="learned"``).

    Parameters
    ----------
    noise : float or "learned"
        Observation standard deviation (a positive finite number: Python or NumPy scalar,
        or a one-element tensor), or ``"learned"`` to learn it as a point estimate.
    init_noise : float
        Starting value of a learned σ.
    """

    name = "gaussian"

    def __init__(self, noise: float | str = 1.0, init_noise: float = 1.0):
        super().__init__()
        if isinstance(noise, str):
            try:
                check_choice("noise", noise, ["learned"])
            except ValueError as error:
                raise ValueError(f"{error} (or a positive number, not a string)") from None
            init = real_scalar(init_noise, "init_noise", positive=True)
            self.log_noise = nn.Parameter(torch.tensor(math.log(init)))
        else:
            try:
                value = real_scalar(noise, "noise", positive=True)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{error}; expected a positive finite number (a float, NumPy "
                                  "scalar or 0-d tensor) or 'learned'") from None
            self.register_scalar("log_noise", math.log(value))

    @property
    def learned(self) -> bool:
        return isinstance(self.log_noise, nn.Parameter)

    @property
    def noise(self) -> torch.Tensor:
        """Observation standard deviation σ (a 0-d tensor)."""
        return self.log_noise.exp()

    def distribution(self, f, batch_dims=1):
        return dist.Normal(f, self.noise).to_event(f.dim() - batch_dims)

    def check_shape(self, y, f_shape):
        _check_same_shape("gaussian", y, f_shape)

    def validate(self, y, f=None):
        if not y.is_floating_point():
            raise TypeError(f"gaussian likelihood expects floating-point targets, got {y.dtype}")
        if f is not None and y.shape[1:] != f.shape[1:]:
            raise ValueError(
                f"targets must have shape (N, {', '.join(map(str, f.shape[1:]))}) like the network "
                f"output, got {tuple(y.shape)} (for one output use y of shape (N, 1))"
            )


def _check_same_shape(kind: str, y: torch.Tensor, f_shape: torch.Size) -> None:
    if tuple(y.shape) != tuple(f_shape):
        hint = (" (one output: pass y.unsqueeze(-1))"
                if tuple(y.shape) == tuple(f_shape[:1]) and tuple(f_shape[1:]) == (1,) else "")
        raise _target_shape_error(kind, y, tuple(f_shape), f_shape, hint)


#: Likelihood names :func:`make_likelihood` accepts ("normal" and "regression" mean "gaussian").
LIKELIHOOD_NAMES = ("categorical", "gaussian", "bernoulli", "normal", "regression")


def make_likelihood(likelihood: str | Likelihood, noise: float | str | None = None) -> Likelihood:
    """Build a likelihood from its name (``"categorical"``, ``"gaussian"``, ``"bernoulli"``).

    Raises
    ------
    ValueError
        An unknown name (the message names the closest one: ``"Gaussian"``, ``"categorial"``).
    TypeError
        Neither a name nor a :class:`Likelihood` (e.g. ``torch.nn.CrossEntropyLoss()``).
    """
    if isinstance(likelihood, Likelihood):
        return likelihood
    if not isinstance(likelihood, str):
        raise TypeError(f"likelihood must be one of {list(LIKELIHOOD_NAMES)} or a "
                        f"pyro_bnn.model.likelihoods.Likelihood, got {type(likelihood).__name__} {likelihood!r}")
    check_choice("likelihood", likelihood, LIKELIHOOD_NAMES)
    if likelihood == "categorical":
        return Categorical()
    if likelihood == "bernoulli":
        return Bernoulli()
    return Gaussian(1.0 if noise is None else noise)


#: squashing layers that turn logits into probabilities (the likelihoods apply their own link)
_SQUASHING = (nn.Softmax, nn.Softmin, nn.Sigmoid, nn.Hardsigmoid)


def check_output_layer(net: nn.Module, likelihood: Likelihood) -> None:
    """Refuse a network that ends in a softmax or sigmoid under a classification likelihood.

    :class:`Categorical` and :class:`Bernoulli` read the network output as logits and apply
    the softmax / sigmoid themselves; a second one squashes the logits into (0, 1) and trains
    a network that cannot be confident (digits, MeanField, 100 epochs: a final ``nn.Softmax``
    gave NLL 1.67 and ECE 0.63 against 0.13 and 0.057 without it; a final ``nn.Sigmoid`` under
    Bernoulli 48 % test accuracy against 97.6 %).  ``nn.LogSoftmax`` is harmless and accepted.  Only the
    last layer of (nested) ``nn.Sequential`` networks is seen: a custom ``forward`` is not read.

    Raises
    ------
    ValueError
        The last layer is ``nn.Softmax``, ``nn.Softmin``, ``nn.Sigmoid`` or ``nn.Hardsigmoid``
        and the likelihood is categorical or bernoulli.
    """
    if not isinstance(likelihood, (Categorical, Bernoulli)):
        return
    last, path = net, []
    while isinstance(last, nn.Sequential) and len(last):
        path.append(str(len(last) - 1))
        last = last[-1]
    if isinstance(last, _SQUASHING):
        name = ".".join(["net", *path])
        link = "softmax" if isinstance(likelihood, Categorical) else "sigmoid"
        raise ValueError(f"the network ends in {type(last).__name__} ({name}), but the {likelihood.name} "
                         f"likelihood takes logits and applies the {link} itself: remove that layer "
                         "(pb.predict returns probabilities). A second squashing keeps every output in "
                         "(0, 1), so the network cannot become confident and its predictions are "
                         "miscalibrated")


def log_likelihood(lik: Likelihood, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pointwise ``log p(y_n | f_n)``, shape ``(N,)`` — a fast path without Pyro tracing.

    Categorical: ``log softmax(f)[n, y_n]`` by ``gather``, not ``F.cross_entropy``, which
    silently drops labels equal to its ``ignore_index`` (−100) from the sum (bit-identical
    values and gradients otherwise); a label out of range raises ``ValueError``.
    """
    if isinstance(lik, Categorical):
        if y.dtype != torch.int64:
            lik.validate(y)  # float, bool or int32 labels: a TypeError, not a silent cast
            y = y.long()
        try:
            return f.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        except (RuntimeError, IndexError):
            lik.validate(y, f)  # names the labels out of range
            raise
    if isinstance(lik, Bernoulli):
        return -F.binary_cross_entropy_with_logits(f, y.to(f.dtype), reduction="none").flatten(1).sum(1)
    return lik.distribution(f).log_prob(y)


#: the observation models the curvature, the linearised predictive and the metrics know
LIKELIHOOD_KINDS = ("categorical", "bernoulli", "gaussian")


def kind_and_noise(likelihood: Likelihood) -> tuple[str | None, torch.Tensor | None]:
    """``(kind, σ)`` of a likelihood: ``kind`` one of :data:`LIKELIHOOD_KINDS` and ``σ`` the
    Gaussian observation std (with its graph; ``None`` otherwise).  A likelihood of another
    class gives ``(None, None)``: callers use its ``distribution(f)`` or refuse it."""
    if isinstance(likelihood, Gaussian):
        return "gaussian", likelihood.noise
    if isinstance(likelihood, Bernoulli):
        return "bernoulli", None
    if isinstance(likelihood, Categorical):
        return "categorical", None
    return None, None


def distribution_kind(d) -> str | None:
    """The kind of an observation distribution (``Categorical``, ``Bernoulli``, ``Normal``;
    ``d`` already unwrapped of ``Independent``/masks), or ``None`` for any other."""
    if isinstance(d, dist.Categorical):
        return "categorical"
    if isinstance(d, dist.Bernoulli):
        return "bernoulli"
    if isinstance(d, dist.Normal):
        return "gaussian"
    return None


def inverse_link(kind: str, f: torch.Tensor) -> torch.Tensor:
    """The predictive mean of network outputs ``f`` under ``kind``: class probabilities
    ``softmax(f)`` (categorical), success probabilities ``sigmoid(f)`` (bernoulli), ``f``
    itself (gaussian)."""
    if kind == "categorical":
        return torch.softmax(f, -1)
    if kind == "bernoulli":
        return torch.sigmoid(f)
    if kind == "gaussian":
        return f
    raise ValueError(f"unknown likelihood kind {kind!r}; expected one of {LIKELIHOOD_KINDS}")
