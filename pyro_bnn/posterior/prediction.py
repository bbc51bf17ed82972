"""Posterior predictive: Monte Carlo over guide samples, batched over inputs.

Works for :class:`~pyro_bnn.BNN` models (the network output is computed directly under
the guide's sampled weights) and for hand-written ``PyroModule`` models (the distribution
of the observed site, ``"obs"`` by default, is read from a replayed trace).

Every predictive runs the model and guide in eval mode (:func:`evaluation_mode`): a
``BatchNorm`` layer normalises with its running statistics, so an input's prediction does
not depend on the other inputs of its batch, and neither those statistics nor any module's
``training`` flag change.  ``Dropout`` is off.

Predictives (``predictive=``)
    ``"sample"``: Monte Carlo over joint draws of the guide through the network.
    ``"glm"`` (Laplace guides): the linearised network's function-space Gaussian
    ``N(f*(x), Σ_f(x))``, Monte Carlo over ``num_samples`` function draws per input for the
    link ("glm-mc(S)").  ``"glm_probit"``: the same Gaussian with the probit approximation
    of the softmax/sigmoid link (closed form, "glm-probit").  ``None`` (default): the
    guide's own (``guide.default_predictive``: ``"glm"`` for the Laplace guide, else
    ``"sample"``), the same default as :func:`pyro_bnn.to_arviz` and :func:`pyro_bnn.compare`.
    Measured on digits (last-layer Laplace of a MAP 64-100-10 net) Monte-Carlo GLM had the
    lower test NLL and ECE (``docs/results/predictives.md``).
"""

from __future__ import annotations

import difflib
from typing import NamedTuple

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.utils.data import DataLoader

from ..arguments import check_int
from ..contract.guide import guide_contract
from ..contract.local_params import local_params, unwrap_model
from ..contract.pyro_objective import call_model
from ..data.batches import BatchCheck, check_inputs
from ..data.prediction_data import data_type_error, prediction_data, read_loader
from ..model.batchnorm import warn_running_statistics_of_random_affine
from ..model.bnn import is_bnn, model_likelihood
from ..model.devices import module_device
from ..model.likelihoods import distribution_kind, inverse_link, kind_and_noise
from ..model.modes import evaluation_mode
from ..training.seeding import seeded
from . import metrics
from .batchnorm import batchnorm_recalibration
from .guide_density import check_global_latents, latent_values

__all__ = ["PredictiveSamples", "predictive_samples", "predict", "evaluate", "predict_checked", "evaluate_checked",
           "sample_latents",
           "evaluation_mode", "default_predictive", "predictive_name", "PREDICTIVES", "check_inputs_first",
           "targets_like", "binary_labels", "bernoulli_as_classes"]

#: The predictives ``pb.predict`` / ``pb.evaluate`` / ``pb.to_arviz`` know by name (a guide
#: may add its own, which are passed on to ``guide.predict``).
PREDICTIVES = ("sample", "glm", "glm_probit")


def default_predictive(guide) -> str:
    """The predictive a guide is evaluated with: ``guide.default_predictive`` (``"glm"`` for
    the Laplace guide), ``"sample"`` for guides that do not name one."""
    return str(guide_contract(guide).default_predictive)


def resolve_predictive(guide, predictive) -> str:
    """``predictive`` checked (a ``str``; a near-miss of a known name is a typo), ``None`` ->
    the guide's default."""
    if predictive is None:
        return default_predictive(guide)
    if not isinstance(predictive, str):
        raise TypeError(f"predictive must be a str or None, got {predictive!r} ({type(predictive).__name__})")
    if predictive not in PREDICTIVES:
        close = difflib.get_close_matches(predictive, PREDICTIVES, n=1, cutoff=0.6)
        if close:
            raise ValueError(f"unknown predictive {predictive!r}; did you mean {close[0]!r}? "
                             f"(known: {', '.join(PREDICTIVES)} and the guide's own)")
    return predictive


def predictive_name(predictive: str, num_samples: int, link_approx: str | None = None) -> str:
    """A label for a predictive, as recorded by ``pb.evaluate`` (``"predictive"``),
    ``pb.to_arviz`` (``attrs["predictive"]``) and ``pb.compare`` (column ``predictive``):
    ``"sample(64)"``, ``"glm-mc(64)"``, ``"glm-probit"``; a guide's own predictive by its name."""
    if predictive == "glm" and link_approx == "probit" or predictive == "glm_probit":
        return "glm-probit"
    if predictive == "glm":
        return f"glm-mc({num_samples})"
    if predictive == "sample":
        return f"sample({num_samples})"
    return str(predictive)


def _guide_predictive(predictive: str, kwargs: dict) -> tuple[str, dict]:
    """``(predictive, kwargs)`` for ``guide.predict``: ``"glm"`` -> ``link_approx="mc"``
    (unless the caller passed ``link_approx``), ``"glm_probit"`` -> ``"glm"`` with the probit
    link."""
    kwargs = dict(kwargs)
    if predictive == "glm_probit":
        if kwargs.get("link_approx", "probit") != "probit":
            raise ValueError(f"predictive='glm_probit' is the probit link; got link_approx="
                             f"{kwargs['link_approx']!r} (use predictive='glm' for Monte Carlo)")
        kwargs["link_approx"] = "probit"
        return "glm", kwargs
    if predictive == "glm":
        kwargs.setdefault("link_approx", "mc")
    return predictive, kwargs


class PredictiveSamples(NamedTuple):
    """Per-sample predictive parameters.

    ``kind`` is ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``; ``probs`` is
    ``(S, N, C)`` (classification), ``loc``/``scale`` are ``(S, N, D)`` (regression).
    """

    kind: str
    probs: torch.Tensor | None = None
    loc: torch.Tensor | None = None
    scale: torch.Tensor | None = None


def sample_latents(model, guide, x, y=None, *, check_plates: bool = True) -> dict[str, torch.Tensor]:
    """One joint draw of all latent sites from the guide, ``{site: value}``.

    ``check_plates``: run the model once on the draw to refuse a latent sampled inside an
    unsubsampled data plate (see :class:`_LatentPlateSizes`; models other than
    :class:`~pyro_bnn.BNN`); a loop over draws checks its first only (the shapes do not change).

    Run in eval mode (:func:`evaluation_mode`).  The index sites of subsampling plates are
    not latents and are left out.

    Raises
    ------
    ValueError
        The guide is not ready to predict, or a latent site lies in a subsampled plate
        (a local latent: no value for new inputs; see
        :func:`pyro_bnn.posterior.guide_density.check_global_latents`).
    """
    problem = guide_contract(guide).prediction_problem()
    if problem is not None:
        raise ValueError(problem)
    args, kwargs, _ = call_model(model, x, y, len(x))
    with evaluation_mode(model, guide):
        tr = poutine.trace(poutine.block(guide, hide_types=["param"])).get_trace(*args, **kwargs)
    check_global_latents(tr)
    latents = latent_values(tr)
    if check_plates and not is_bnn(model):
        with evaluation_mode(model, guide):
            poutine.trace(_LatentPlateSizes(latents, x.device)(
                whole_batch_plates()(poutine.condition(model, data=latents)))).get_trace(*args, **kwargs)
    return latents


class _LatentPlateSizes(Messenger):
    """Refuse a drawn latent whose size along one of its plates is not that plate's size.

    Run on a model conditioned on a draw, called on the inputs the draw was made for (one
    row in :func:`predictive_samples`): a site sampled inside a data plate without
    subsampling (``with pyro.plate("data", len(x)): b = self.b``) is local, one value per
    training point, and the guide keeps the training set's size; on new inputs of that same
    size the per-point values were used as if they belonged to the new points (silently), on
    any other size the model failed on a broadcast.  Every other sample site gets a zero
    placeholder instead of a draw, so the check consumes no random numbers.
    """

    def __init__(self, latents, device):
        super().__init__()
        self.latents, self.device = latents, device

    def _process_message(self, msg):
        if msg["type"] != "sample" or site_is_subsample(msg):
            return
        fn, name = msg["fn"], msg["name"]
        if name not in self.latents:
            if msg["value"] is None:
                msg["value"] = torch.zeros(fn.batch_shape + fn.event_shape, device=self.device)
            return
        value, event_dims = self.latents[name], len(fn.event_shape)
        for frame in msg["cond_indep_stack"]:
            if not frame.vectorized or frame.dim is None:
                continue
            dim = frame.dim - event_dims
            if value.dim() >= -dim and value.shape[dim] not in (1, frame.size):
                raise ValueError(
                    f"latent site {name!r} has {value.shape[dim]} values along plate {frame.name!r} "
                    f"(dim {frame.dim}), which has size {frame.size} for these inputs: it is sampled "
                    "inside that plate, so the guide holds one value per training point (a local "
                    "latent) and has no value for new inputs. If it is meant to be a global weight, "
                    "sample it outside the plate (read PyroSample attributes before `with "
                    "pyro.plate(...)`) and train again")


class whole_batch_plates(Messenger):
    """Subsampling plates of a model take the whole batch, in order, when predicting.

    A hand-written model declares ``pyro.plate("data", N, subsample_size=len(x))`` with
    ``N`` the size of its training set; at prediction time ``x`` is any batch of new inputs.
    This handler gives each subsampling plate the indices ``0 .. len(x) - 1`` instead of a
    random subsample, so a batch larger than ``N`` works (Pyro itself refuses
    ``subsample_size > N``), and nothing random is drawn.  The indices only label the rows
    of the batch; the plate's ``N / len(x)`` scale does not enter the predictive, which is
    read from the observed site's distribution.

    Sites named in ``unsampled`` (the observed site, called with ``y=None``) get a zero
    placeholder instead of a draw: the predictive reads only their distribution, and a draw
    would consume random numbers in proportion to the batch, so that the next weight draw
    would depend on how many inputs were predicted.
    """

    def __init__(self, unsampled=(), device=None):
        super().__init__()
        self.unsampled, self.device = frozenset(unsampled), device

    def _process_message(self, msg):
        if msg["value"] is not None or msg["type"] != "sample":
            return
        if site_is_subsample(msg):
            fn = msg["fn"]
            size = fn.size if fn.subsample_size is None else fn.subsample_size
            msg["value"] = torch.arange(size, device=fn.device)
        elif msg["name"] in self.unsampled:
            fn = msg["fn"]
            msg["value"] = torch.zeros(fn.batch_shape + fn.event_shape, device=self.device)



def _unwrap(d):
    """``d`` without the wrappers that keep its values' distribution per element
    (``Independent``, masks, ``expand``).  Any other wrapper with a ``base_dist`` is kept: a
    ``LogNormal`` or an affine ``TransformedDistribution`` of a ``Normal`` is not that
    ``Normal`` (reading its base gave log-scale or standardised "means" in silence)."""
    while isinstance(d, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        d = d.base_dist
    return d


def _params_from_distribution(d) -> tuple[str, dict]:
    d = _unwrap(d)
    kind = distribution_kind(d)
    if kind in ("categorical", "bernoulli"):
        return kind, {"probs": d.probs}
    if kind == "gaussian":
        return kind, {"loc": d.loc, "scale": d.scale.expand_as(d.loc)}
    raise TypeError(
        "predict supports observation sites with Categorical, Bernoulli or Normal "
        f"distributions (also wrapped by .to_event, .mask or .expand); got {type(d).__name__}"
        + (f" of {type(d.base_dist).__name__}: a transformed distribution's values are not its "
           "base distribution's, so its parameters are not the predictive's"
           if isinstance(d, torch.distributions.TransformedDistribution) else ""))


def check_inputs_first(obs_site: str, shape, num_inputs: int) -> None:
    """Raise ``ValueError`` unless an observed site's values of ``num_inputs`` inputs have
    the inputs as their first dimension, which every predictive, metric and ArviZ group
    reads as the inputs (an observation sampled as ``(D, N)``, e.g. under an outer plate at
    dim -2, was scored against the wrong targets in silence)."""
    if len(shape) == 0 or shape[0] != num_inputs:
        raise ValueError(
            f"the observed site {obs_site!r} has shape {tuple(shape)} for {num_inputs} inputs; the "
            "predictive reads its first dimension as the inputs: sample it with the data "
            "dimension first (e.g. (N, D), the data plate outermost or the outputs as an event)")


def _params_from_bnn(model, f) -> tuple[str, dict]:
    kind, noise = kind_and_noise(model.likelihood)
    if kind == "gaussian":
        return kind, {"loc": f, "scale": noise.expand_as(f)}
    if kind is not None:
        return kind, {"probs": inverse_link(kind, f)}
    return _params_from_distribution(model.likelihood.distribution(f))


def params_under(model, latents: dict, x, batch_size: int = 1024, obs_site: str = "obs",
                 device=None) -> tuple[str, dict]:
    """Predictive parameters of every input in ``x`` under one joint draw ``latents``.

    Batched over inputs.  For a :class:`~pyro_bnn.BNN` the network runs directly with the
    drawn weights; for a hand-written model the observed site's distribution is read from a
    conditioned trace.  Differentiable if called with gradients enabled.

    Returns
    -------
    kind : str
        ``"categorical"``, ``"bernoulli"`` or ``"gaussian"``.
    params : dict
        ``probs`` ``(N, C)`` or ``loc``/``scale`` ``(N, D)``.
    """
    batch_size = check_int("batch_size", batch_size, 1)
    fast = is_bnn(model)
    kind, chunks = None, []
    with evaluation_mode(model):
        for start in range(0, len(x), batch_size):
            xb = x[start:start + batch_size]
            xb = xb if device is None else xb.to(device)
            if fast:
                kind, params = _params_from_bnn(model, model.run_with(latents, xb))
            else:
                conditioned = poutine.condition(model, data=latents)
                tr = poutine.trace(whole_batch_plates([obs_site], xb.device)(conditioned)).get_trace(xb, None)
                if obs_site not in tr.nodes:
                    raise ValueError(f"model has no observed site {obs_site!r}; sites: {list(tr.nodes)}")
                kind, params = _params_from_distribution(tr.nodes[obs_site]["fn"])
                check_inputs_first(obs_site, next(iter(params.values())).shape, len(xb))
            chunks.append(params)
    return kind, {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


@torch.no_grad()
def predictive_samples(model, guide, x, *, num_samples: int = 64, batch_size: int = 1024,
                       obs_site: str = "obs", device=None, bn_data=None,
                       seed: int | None = None) -> PredictiveSamples:
    """Predictive parameters under ``num_samples`` joint draws from ``guide``.

    Each draw's weights are used for every input batch, so memory is bounded by one batch
    of inputs times ``num_samples`` outputs.  Runs in eval mode (module docstring).

    Parameters
    ----------
    model, guide
        A trained model and guide.
    x : Tensor, shape (N, ...), or DataLoader
        Inputs, or a ``DataLoader`` of the test set whose batches are ``x``, ``(x,)`` or
        ``(x, y)`` (a ``y`` is not read), read once as for :func:`predict`
        (:func:`pyro_bnn.data.prediction_data.read_loader`: each batch checked, the same draws
        for every batch, bit-equal to its inputs as a tensor at the same seed).  The output
        follows the loader's order in that pass (with ``shuffle=True`` an order the caller does
        not see).
    num_samples : int
        Posterior draws S (an int >= 1).
    batch_size : int
        Inputs per forward pass (a loader's own batch size does not set it).
    obs_site : str
        The observed site of a hand-written model.
    device : torch.device, optional
        Where to predict (default: where the model is).
    bn_data : Tensor or DataLoader, optional
        Training inputs: re-estimate every BatchNorm layer's statistics under each draw before
        predicting with it (:mod:`pyro_bnn.posterior.batchnorm`; one pass over ``bn_data`` per draw).
    seed : int, optional
        Seeds the draws (every random stream forked: the caller's streams are left as they
        were, :func:`pyro_bnn.training.seeding.seeded`).  Default: the caller's streams.

    Returns
    -------
    PredictiveSamples
        ``probs`` ``(S, N, C)``, or ``loc``/``scale`` ``(S, N, D)``.

    Raises
    ------
    TypeError, ValueError
        ``x`` neither a tensor nor a ``DataLoader`` (naming what was received), inputs the model
        cannot take, a loader's batch of another structure, an empty loader.
    """
    with seeded(seed):
        return _predictive_samples(model, guide, x, num_samples, batch_size, obs_site, device, bn_data)


def _predictive_samples(model, guide, x, num_samples, batch_size, obs_site, device, bn_data) -> PredictiveSamples:
    if isinstance(x, DataLoader):
        x, _ = read_loader(model, x, where="pb.predictive_samples", targets=False)
    elif not isinstance(x, torch.Tensor):
        raise data_type_error(x, "pb.predictive_samples", targets=False)
    num_samples = check_int("num_samples", num_samples, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    check = BatchCheck(model)
    check_inputs(x, "x", check.dtype, allow_integer=check.integer_inputs)
    device = device or module_device(model, guide, default=x.device)
    network = unwrap_model(model)
    with local_params(model, guide), evaluation_mode(model, guide), \
            batchnorm_recalibration(model, bn_data, batch_size, device) as recalibrate:
        per_sample = []
        for _ in range(num_samples):
            latents = sample_latents(model, guide, x[:1].to(device), check_plates=not per_sample)
            if recalibrate is not None:
                recalibrate(latents)
            elif not per_sample and isinstance(network, torch.nn.Module):
                warn_running_statistics_of_random_affine(network, latents)
            kind, params = params_under(model, latents, x, batch_size, obs_site, device)
            per_sample.append(params)
    stacked = {k: torch.stack([p[k] for p in per_sample]) for k in per_sample[0]}
    return PredictiveSamples(kind, **stacked)


def predict(model, guide, x, *, num_samples: int = 64, batch_size: int = 1024,
            predictive: str | None = None, seed: int | None = None, **kwargs) -> torch.Tensor:
    """Posterior predictive: class probabilities ``(S, N, C)`` or regression means ``(S, N, D)``.

    Runs in eval mode and leaves every module's mode and buffers as they were (module
    docstring).

    Parameters
    ----------
    model, guide
        A trained model and guide.
    x : Tensor, shape (N, ...), or DataLoader
        Inputs, or a ``DataLoader`` of the test set whose batches are ``x``, ``(x,)`` or
        ``(x, y)`` (tuples or lists; a ``y`` is not read).  The loader is read once and its
        inputs gathered (:mod:`pyro_bnn.data.prediction_data`), each batch checked as tensor
        inputs are: the result is the one of the same inputs as a tensor, the same draws
        used for every batch (same seed, same result).  The output follows the loader's order
        in that pass: with ``shuffle=True`` an order the caller does not see (another pass gives
        another), so use ``shuffle=False`` to pair the outputs with the data set's examples.
    num_samples : int
        Posterior draws S (an int >= 1).
    batch_size : int
        Inputs per forward pass (bounds memory; an int >= 1; a loader's own batch size
        does not set it).
    predictive : str, optional
        The predictive (module docstring): ``"sample"``, ``"glm"`` (Monte-Carlo GLM),
        ``"glm_probit"``, or a guide's own (passed to ``guide.predict``).  Default: the
        guide's own (``"glm"`` for the Laplace guide, else ``"sample"``).
    seed : int, optional
        Seeds the draws (every random stream forked: the caller's streams are left as they
        were, :func:`pyro_bnn.training.seeding.seeded`), as ``pb.to_arviz(seed=)`` does; the
        same seed gives the same draws for tensor inputs and for a loader of them.  Default:
        the caller's streams.
    **kwargs
        For ``"sample"``: ``bn_data`` (the training inputs, or a loader over them) re-estimates
        every BatchNorm layer's statistics under each draw, as SWAG does: the running
        statistics of training average over the training draws and fit none of them
        (:mod:`pyro_bnn.posterior.batchnorm`; costs one pass over ``bn_data`` per draw, so a
        few thousand inputs are usually enough).  For a guide's own predictive: its options.

    Returns
    -------
    Tensor
        ``(S, N, C)`` probabilities (for ``"bernoulli"``, ``(S, N, D)`` success
        probabilities) or ``(S, N, D)`` predictive means for regression; ``"glm_probit"``
        gives ``(1, N, C)`` probabilities.

    Raises
    ------
    TypeError, ValueError
        Inputs the model cannot take, or a loader whose batches are not of the forms above or
        that yields nothing (:func:`pyro_bnn.data.prediction_data.prediction_data`); bad options.

    Examples
    --------
    >>> probs = pb.predict(model, guide, x_test, num_samples=64)           # doctest: +SKIP
    >>> probs = pb.predict(model, guide, test_loader, num_samples=64)      # doctest: +SKIP
    """
    with seeded(seed):
        x, _ = prediction_data(model, x, where="pb.predict", targets=False)
        return predict_checked(model, guide, x, num_samples=num_samples, batch_size=batch_size,
                               predictive=predictive, **kwargs)


def predict_checked(model, guide, x: torch.Tensor, *, num_samples: int = 64, batch_size: int = 1024,
                    predictive: str | None = None, **kwargs) -> torch.Tensor:
    """:func:`predict` on inputs that :func:`pyro_bnn.data.prediction_data.prediction_data` has
    checked (read from a loader, or tensors): for the tools that check (or read) their data once
    and predict on it, so that it is not checked, nor warned about, a second time."""
    predictive = resolve_predictive(guide, predictive)
    num_samples = check_int("num_samples", num_samples, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    if predictive != "sample":
        if kwargs.get("bn_data") is not None:
            raise ValueError(f"bn_data= re-estimates BatchNorm statistics per weight draw of "
                             f"predictive='sample'; predictive={predictive!r} linearises the network at "
                             "its MAP, whose running statistics are the ones to use")
        guide_predictive, options = _guide_predictive(predictive, kwargs)
        with evaluation_mode(model, guide):
            return guide_contract(guide).predict(model, x, predictive=guide_predictive,
                                                 num_samples=num_samples, batch_size=batch_size, **options)
    out = predictive_samples(model, guide, x, num_samples=num_samples, batch_size=batch_size, **kwargs)
    return out.probs if out.probs is not None else out.loc


def evaluate(model, guide, x, y=None, *, num_samples: int = 64, batch_size: int = 1024,
             predictive: str | None = None, num_bins: int = 15, seed: int | None = None,
             **kwargs) -> dict:
    """Test metrics of the posterior predictive (:func:`predict`'s, same ``predictive`` default).

    Classification: ``accuracy``, ``nll``, ``ece`` (``num_bins`` equal-width bins),
    ``brier``.  Regression: ``rmse``, ``nll`` (Gaussian mixture), ``coverage_95``.
    Runs in eval mode; the model's modes and buffers are left as they were.

    Parameters
    ----------
    model, guide
        A trained model and guide.
    x : Tensor, shape (N, ...), or DataLoader
        Inputs, or a ``DataLoader`` of the test set yielding ``(x, y)`` batches (tuples or
        lists, e.g. torchvision's ``FashionMNIST(..., transform=ToTensor())`` in a loader).
        The loader is read once, each batch checked as tensors are, and the metrics are those
        of its examples as tensors, with the same draws for every batch (same seed, same
        metrics; :mod:`pyro_bnn.data.prediction_data`).  A shuffled loader gives the same
        metrics (each input is scored against its own target; the sums differ in rounding
        only).  It scores the examples one pass yields (a sampler's subset, without the
        ``drop_last`` remainder).
    y : Tensor, shape (N,) or (N, D), optional
        Targets of tensor ``x``; not with a loader (its batches hold them).
    num_samples : int
        Posterior draws S.
    batch_size : int
        Inputs per forward pass (a loader's own batch size does not set it).
    predictive : str, optional
        As for :func:`predict`.
    num_bins : int
        Bins of the expected calibration error.
    seed : int, optional
        Seeds the draws, as for :func:`predict`.
    **kwargs
        As for :func:`predict`.

    Returns
    -------
    dict
        The metrics above and ``predictive``, the predictive's name
        (:func:`predictive_name`, e.g. ``"glm-mc(64)"``).

    Raises
    ------
    TypeError, ValueError
        Inputs or targets the model cannot take (naming ``pb.evaluate`` or the loader's
        batch), tensor ``x`` without ``y``, ``y`` with a loader, a loader's batch without
        targets or of another structure, an empty loader; bad options.

    Examples
    --------
    >>> pb.evaluate(model, guide, x_test, y_test, num_samples=64)          # doctest: +SKIP
    >>> pb.evaluate(model, guide, test_loader, num_samples=64)             # doctest: +SKIP
    """
    with seeded(seed):
        x, y = prediction_data(model, x, y, where="pb.evaluate", targets=True)
        return evaluate_checked(model, guide, x, y, num_samples=num_samples, batch_size=batch_size,
                                predictive=predictive, num_bins=num_bins, **kwargs)


def evaluate_checked(model, guide, x: torch.Tensor, y: torch.Tensor, *, num_samples: int = 64,
                     batch_size: int = 1024, predictive: str | None = None, num_bins: int = 15,
                     **kwargs) -> dict:
    """:func:`evaluate` on inputs and targets that
    :func:`pyro_bnn.data.prediction_data.prediction_data` has checked (as
    :func:`predict_checked`)."""
    predictive = resolve_predictive(guide, predictive)
    scores = _evaluate(model, guide, x, y, num_samples, batch_size, predictive, num_bins, **kwargs)
    scores["predictive"] = predictive_name(predictive, num_samples, kwargs.get("link_approx"))
    return scores


def _evaluate(model, guide, x, y, num_samples, batch_size, predictive, num_bins, **kwargs) -> dict:
    num_bins = check_int("num_bins", num_bins, 1)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if len(y) != len(x):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    if predictive != "sample":
        out = predict_checked(model, guide, x, num_samples=num_samples, batch_size=batch_size,
                              predictive=predictive, **kwargs)
        kind, noise = predictive_likelihood(model, guide)
        if kind == "gaussian":  # draws of the (linearised) function, (S, N, D)
            out = out if out.dim() == 3 else out.unsqueeze(0)
            return metrics.regression_metrics(out.cpu(), noise.detach().cpu(),
                                              targets_like(y, out.shape[1:]).to(out.dtype).cpu())
        if out.dim() == 2:
            out = out.unsqueeze(0)
        if kind == "bernoulli":  # success probabilities (S, N, 1) -> two classes, as below
            out, y = bernoulli_as_classes(out), binary_labels(y)
        return metrics.classification_metrics(out.cpu(), y.cpu(), num_bins=num_bins)
    out = predictive_samples(model, guide, x, num_samples=num_samples, batch_size=batch_size, **kwargs)
    y = y.to(out.probs.device if out.probs is not None else out.loc.device)
    if out.kind == "categorical":
        _check_labels(y, out.probs.shape[-1])
        return metrics.classification_metrics(out.probs, y, num_bins=num_bins)
    if out.kind == "bernoulli":
        return metrics.classification_metrics(bernoulli_as_classes(out.probs), binary_labels(y), num_bins=num_bins)
    return metrics.regression_metrics(out.loc, out.scale, targets_like(y, out.loc.shape[1:]).to(out.loc.dtype))


def targets_like(y: torch.Tensor, shape) -> torch.Tensor:
    """``y`` as targets of the predictive's shape ``shape`` (one draw, ``(N, ...)``): equal,
    or equal up to trailing dimensions of size 1 (``(N,)`` for ``(N, 1)``); any other
    reshape would pair targets with the wrong predictions."""
    shape = tuple(shape)

    def squeezed(s):
        s = list(s)
        while len(s) > 1 and s[-1] == 1:
            s.pop()
        return tuple(s)
    if tuple(y.shape) != shape and squeezed(y.shape) != squeezed(shape):
        raise ValueError(f"targets of shape {tuple(y.shape)} do not match the predictive's "
                         f"{shape} (one value per output of each input)")
    return y.reshape(shape)


def bernoulli_as_classes(p: torch.Tensor) -> torch.Tensor:
    """A Bernoulli predictive's success probabilities ``(S, N, ...)`` as two classes
    ``[1 − p, p]``, shape ``(S, N·D, 2)`` (one row per output of each input), for the metrics
    and tools that read class probabilities."""
    p1 = p.reshape(p.shape[0], -1)
    return torch.stack([1 - p1, p1], -1)


def binary_labels(y: torch.Tensor) -> torch.Tensor:
    """Bernoulli targets as int64 class labels ``(N·D,)``; ``ValueError`` unless every target is
    exactly 0 or 1 (a soft target such as 0.7 was truncated to class 0 in silence)."""
    if y.numel() and not bool(((y == 0) | (y == 1)).all()):
        bad = y[(y != 0) & (y != 1)].reshape(-1)[:3].tolist()
        raise ValueError(f"bernoulli targets must be exactly 0 or 1 to be scored as classes, got e.g. {bad}")
    return y.reshape(-1).long()


def _check_labels(y, num_classes):
    if y.is_floating_point():
        raise TypeError(f"class labels must be integers, got dtype {y.dtype}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes - 1}], got [{int(y.min())}, {int(y.max())}]")


def predictive_likelihood(model, guide) -> tuple[str | None, torch.Tensor | None]:
    """``(kind, Gaussian σ)`` of a guide's non-Monte-Carlo predictive (``predict(...,
    method="glm")``): from the model's likelihood, else (hand-written models) from the guide
    (``BNNGuide.likelihood_kind``); ``(None, None)`` if neither knows."""
    lik = model_likelihood(model)
    if lik is not None:
        kind, noise = kind_and_noise(lik)
        return (lik.name, None) if kind is None else (kind, noise)
    return guide_contract(guide).likelihood_kind() or (None, None)
