"""The warning when a ``pb.BNN`` is trained on changing minibatches without ``num_data=``.

A ``pb.BNN`` observes its targets in ``pyro.plate("data", num_data, subsample_size=len(x))``.
Without ``num_data`` the plate's size is the batch's, so an ELBO computed on a minibatch of M
points treats those M points as the whole data set: the data term counts ``M / N`` of what it
should and the prior's KL term outweighs it.  The fit then stays close to the prior and predicts
at chance, with no error (``docs/pyro.md``: on digits, a small CNN under plain ``SVI``,
accuracy 0.08–0.13 / NLL 2.31 against 0.94–0.96 / 0.16–0.20 from ``pb.fit``).  ``pb.fit``
passes ``num_data`` itself; a Pyro user's own loop must (``svi.step(xb, yb, num_data=N)``).

The model cannot know N, but it can see the symptom: gradient-carrying calls with targets and
without ``num_data`` on inputs that keep changing.  :class:`UnscaledBatchWatch` looks at the
first few such calls only (the inputs' per-feature sums each, so the cost is nil after them)
and warns once if the inputs changed twice, that is when a third batch arrives.  Full-batch
training, even on a tensor moved to the device anew or shuffled every step, keeps the sums;
predictions (no targets, or ``torch.no_grad``, as ``Predictive`` runs) are not
watched; passing ``num_data`` once ends the watch.

A hand-written model collapses the same way when nothing scales its data plate (digits MLP,
``MeanField``, plain ``SVI``: accuracy 0.10–0.11 against 0.96–0.97 with a subsampled plate).
A pyro_bnn guide watches such a model's calls (:class:`WatchesBatches`); since the model may
scale its observations itself (``pyro.plate(..., subsample_size=...)``, ``poutine.scale``),
the warning, when due, is first confirmed by :func:`observations_unscaled`, one run of the
model that leaves no trace.  ``pb.fit`` and our objectives given ``num_data`` end the guide's
watch (:func:`end_batch_watches`), as they scale every batch.  Scaling the guide cannot see (a
``pyro.factor`` of a hand-scaled likelihood, a ``poutine.scale`` around the model given to
``SVI`` only) is taken for none: :class:`UnscaledBatchWarning` can be filtered.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from pyro import poutine
from pyro.infer.autoguide import AutoGuideList

from .modes import buffers_kept

__all__ = ["UnscaledBatchWatch", "subsampled_frames", "UnscaledBatchWarning", "WatchesBatches", "WATCHED_CALLS", "BNN_REMEDY",
           "MODEL_REMEDY", "end_batch_watches", "observations_unscaled"]

#: Gradient-carrying calls with targets and without ``num_data`` that are looked at: enough for
#: three steps when Pyro runs the model once per particle (``Trace_ELBO(num_particles=20)``).
WATCHED_CALLS = 64


def _fingerprint(x: torch.Tensor) -> tuple:
    """Shape, device and per-feature sums over the batch: the same for the same inputs in any
    order (a shuffled full batch), different for another minibatch."""
    sums = x.detach().reshape(len(x), -1).sum(0) if x.dim() and len(x) else torch.zeros(0)
    return tuple(x.shape), x.device, sums.float().cpu()


class UnscaledBatchWarning(UserWarning):
    """A model is trained on changing minibatches with nothing scaling its data term: the fit
    collapses to the prior.  Silence it with ``warnings.filterwarnings("ignore",
    category=pb.UnscaledBatchWarning)`` where the data term is scaled in a way the watch cannot
    see (``pyro.factor`` with a hand-scaled likelihood, a ``poutine.scale`` around the model
    given to ``SVI`` but not to the guide) or where each step does see all the data (fresh
    augmentations of the whole set)."""


#: What a pb.BNN's user is told to do.
BNN_REMEDY = ("Pass the training set's size: svi.step(xb, yb, num_data=N) (pb.fit does this itself); if "
              "every step does see all the data, pass num_data=len(x) to say so")

#: What the user of a hand-written model is told to do (the guide watches it).
MODEL_REMEDY = ("Scale the data term in the model, pyro.plate('data', N, subsample_size=len(x)) around its "
                "observations, or train with the guide's own objective, which scales it: SVI(model, guide, "
                "optim, loss=guide.make_objective()) and svi.step(xb, yb, num_data=N) (pb.fit does this "
                "itself). If the data term is scaled where the guide cannot see it, or every step sees all "
                "the data, silence this: warnings.filterwarnings('ignore', category=pb.UnscaledBatchWarning)")


class UnscaledBatchWatch:
    """Detect minibatch training of a model that was not told the data set's size.

    Parameters
    ----------
    model_name : str
        How the warning names the model.
    remedy : str
        What the warning tells the user to do.

    Attributes
    ----------
    warned : bool
        Whether the warning has been given (once per model: a ``pb.BNN`` holds one watch, as
        ``model.batch_watch``, which its ``forward`` and the guides' objectives both report to;
        a pyro_bnn guide of a hand-written model holds one for it, :class:`WatchesBatches`).
    """

    def __init__(self, model_name: str = "pb.BNN", remedy: str = BNN_REMEDY):
        self.model_name = model_name
        self.remedy = remedy
        self._calls = 0
        self._changes = 0
        self._last: tuple | None = None
        self.warned = False

    @property
    def active(self) -> bool:
        """Whether calls are still looked at."""
        return self._calls < WATCHED_CALLS

    def end(self) -> None:
        """Stop watching (the caller scales its batches, or the question is settled)."""
        self._calls, self._last = WATCHED_CALLS, None

    def see(self, x: torch.Tensor, y, num_data, confirm: Callable[[], bool] | None = None) -> None:
        """Record one call of the model; warn at the second change of inputs.

        Parameters
        ----------
        x : Tensor
            The call's inputs.
        y : object
            The call's targets; ``None`` (a prediction) is not watched.
        num_data : int or None
            The call's ``num_data``; given once, it ends the watch.
        confirm : callable, optional
            Asked when the warning is due: ``True`` to warn; ``False`` if the model turns out to
            scale its data term itself (a hand-written model's subsampled plate), which ends the
            watch without a warning; ``None`` if the call observed nothing (not a training step),
            which starts the count of changes again.
        """
        if not self.active or y is None or not torch.is_grad_enabled():
            return
        if num_data is not None:  # the caller scales its batches: nothing to watch
            self.end()
            return
        self._calls += 1
        last, self._last = self._last, _fingerprint(x)
        if last is not None and not _same(last, self._last):
            self._changes += 1
        if self._changes >= 2:
            verdict = True if confirm is None else confirm()
            if verdict is None:  # nothing observed in this call (weights drawn by hand): keep watching
                self._changes = 0
            else:
                self.end()
            if verdict:
                self.warned = True
                warnings.warn(
                    f"{self.model_name} is being trained on changing batches of {len(x)} inputs without "
                    f"num_data=: each step then treats its batch as the whole data set, so the prior outweighs "
                    f"the data by N / {len(x)} and the posterior stays near the prior (predictions near "
                    f"chance). {self.remedy}", UnscaledBatchWarning, stacklevel=2)
        if not self.active:
            self._last = None


class WatchesBatches:
    """Mixin of the guides that watch their hand-written model's batches (pyro_bnn's
    ``BNNGuide``): the watch, ``guide.batch_watch``, is created at its first use."""

    @property
    def batch_watch(self) -> UnscaledBatchWatch:
        """The guide's :class:`UnscaledBatchWatch` over its model."""
        watch = self.__dict__.get("_batch_watch")
        if watch is None:
            watch = self.__dict__["_batch_watch"] = UnscaledBatchWatch(
                f"The model of this {type(self).__name__} guide", MODEL_REMEDY)
        return watch


def end_batch_watches(guide) -> None:
    """End the watch of ``guide`` and of its parts (an ``AutoGuideList``): the caller scales every
    batch by ``num_data`` itself (``pb.fit``, a pyro_bnn objective given ``num_data``)."""
    for part in (guide, *(guide if isinstance(guide, AutoGuideList) else ())):
        if isinstance(part, WatchesBatches):
            part.batch_watch.end()


def observations_unscaled(model: Callable, module: torch.nn.Module | None, args: tuple,
                          kwargs: dict) -> bool | None:
    """Whether ``model(*args, **kwargs)`` observes data, all of it at a scale of at most 1 (no
    subsampled plate, no ``poutine.scale`` above 1 inside the model): then a minibatch counts
    as the whole data set.

    Returns ``True`` or ``False``, or ``None`` when the call observes nothing (a prediction, or
    weights drawn by hand).  The model is run once, hidden from any handler around the call,
    without gradients, on a forked random stream (CPU and every initialised CUDA device), with
    the buffers of ``module`` (BatchNorm's running statistics) put back afterwards, so the run
    changes nothing the user can see; a function model's own modules are not reached.  A model
    that fails on these arguments counts as scaled (no warning rather than a wrong one).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), poutine.block(), buffers_kept(module):
            trace = poutine.trace(model).get_trace(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- any failure means: cannot tell, so do not warn
        return False
    sites = [site for site in trace.nodes.values() if site["type"] == "sample" and site["is_observed"]]
    if not sites:
        return None
    return all(_counts_batch_as_all(site) for site in sites)


def subsampled_frames(site) -> list:
    """The plates of a sample site (or message) that subsample their data (``subsample_size``
    below the declared size): Pyro scales the site by their ``full_size / size``."""
    return [frame for frame in site["cond_indep_stack"] if frame.full_size not in (None, frame.size)]


def _counts_batch_as_all(site) -> bool:
    """Whether an observed site weighs its batch as the whole data set: in no subsampled
    plate, at a scale of at most 1 (a tempering ``poutine.scale(scale=0.5)`` weighs the full
    data term; it does not scale a minibatch up to the data set)."""
    if subsampled_frames(site):
        return False
    return float(torch.as_tensor(site["scale"]).max()) <= 1.0


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != b[0] or a[1] != b[1]:
        return False
    tol = 1e-4 * float(a[2].abs().mean()) if a[2].numel() else 0.0  # summation order
    return bool(torch.allclose(a[2], b[2], rtol=1e-4, atol=tol))
