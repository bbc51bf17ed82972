"""Is a fit length enough?  Train it again for longer and compare (:func:`check_convergence`).

The convergence check that needs new fits, next to the diagnosis that needs none: the end-of-fit
diagnosis (:mod:`pyro_bnn.training.convergence`, which :func:`pyro_bnn.fit` runs, so it cannot
import ``fit`` and host this check) reads one fit's training curve.  Under
a decaying learning-rate schedule that curve is flat at the end whatever the state of the
posterior, because the schedule stops the parameters: a cosine fit that is far too short can
pass.  The only check we know to be reliable is the one the results documents use: train the
same model and guide from the same seed for ``factor`` times the epochs and compare the final
objectives.  If the longer fit ends higher by more than ``tolerance`` (relative, beyond twice
the Monte Carlo standard error of the difference), the shorter length was not enough.

The final objective is estimated on the training data, after training, with the guide's own
objective (the ELBO for variational guides; for Laplace, the MAP's log joint without its
parameter-free prior normaliser), as the mean of ``num_samples`` passes over the data in minibatches
of ``eval_batch_size``: each minibatch loss is an unbiased estimate of the full-data objective
(the likelihood is scaled by ``N / B``), so their ``B / N``-weighted sum over one pass is one.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arguments import check_int, check_positive
from ..contract.guide import guide_contract
from ..contract.local_params import local_params
from ..data.batches import dataset_size, make_loader, split_batch
from ..model.devices import module_device
from ..model.modes import buffers_kept
from .convergence import ConvergenceWarning
from .loop import FitResult, fit
from .seeding import seeded

__all__ = ["LengthCheck", "check_convergence", "estimate_objective", "objective_draws"]

#: standard errors of the difference required before calling the longer fit better
Z = 2.0


@dataclass
class LengthCheck:
    """What :func:`check_convergence` returns.

    Attributes
    ----------
    converged : bool
        The longer fit did not end higher than the shorter one by more than the tolerance
        (beyond ``Z = 2`` standard errors), nor lower (a fit that does not reproduce its
        objective at a longer length is not confirmed either), and the estimates resolve the
        tolerance (two standard errors of the relative gain at most ``tolerance``; otherwise
        raise ``num_samples``).
    epochs : tuple of int
        The two lengths, shorter first.
    objective : tuple of float
        Their final objectives (mean over ``num_samples`` estimates on the training data).
    standard_error : tuple of float
        Monte Carlo standard errors of those means.
    relative_gain : float
        ``(objective_long − objective_short) / max(|objective_long|, 1)``.
    relative_gain_se : float
        Its standard error.
    tolerance : float
        The relative gain that counts as "not converged".
    fits : tuple of FitResult
        Both fits' results (history, in-fit convergence diagnosis).
    model, guide
        The longer fit's model and guide (the better-converged posterior).
    short_model, short_guide
        The shorter fit's.
    """

    converged: bool
    epochs: tuple[int, int]
    objective: tuple[float, float]
    standard_error: tuple[float, float]
    relative_gain: float
    relative_gain_se: float
    tolerance: float
    fits: tuple[FitResult, FitResult]
    model: Any = field(repr=False, default=None)
    guide: Any = field(repr=False, default=None)
    short_model: Any = field(repr=False, default=None)
    short_guide: Any = field(repr=False, default=None)

    def message(self) -> str:
        """One sentence: the two objectives, their gain and the verdict."""
        (e1, e2), (o1, o2) = self.epochs, self.objective
        head = (f"{e1} epochs: objective {o1:.6g}; {e2} epochs: {o2:.6g} (relative gain "
                f"{100 * self.relative_gain:+.2f} % ± {100 * self.relative_gain_se:.2f} %, "
                f"tolerance {100 * self.tolerance:.2g} %)")
        if self.converged:
            return f"{head}: {e1} epochs are enough"
        if Z * self.relative_gain_se > self.tolerance and abs(self.relative_gain) - Z * self.relative_gain_se <= self.tolerance:
            return (f"{head}: the estimates are too noisy to tell (two standard errors exceed the tolerance); "
                    "raise num_samples")
        if self.relative_gain > 0:
            return f"{head}: {e1} epochs are not enough; train longer (at least {e2} epochs) and check again"
        return (f"{head}: the longer fit ended lower, so the objective does not reproduce at this length; "
                f"lower the learning rate or train longer")


@torch.no_grad()
def objective_draws(model, guide, data, *, num_samples: int = 16, eval_batch_size: int = 1024,
                    objective=None, device=None, num_data: int | None = None) -> list[float]:
    """Independent Monte-Carlo estimates of a trained guide's training objective on ``data``.

    Each estimate is one pass over ``data`` in minibatches of ``eval_batch_size``; each
    minibatch loss is an unbiased estimate of the full-data objective (the likelihood scaled by
    ``N / B``), so their ``B / M``-weighted sum over a pass of ``M`` examples is one.  The draws
    themselves matter when they are heavy-tailed: a mean-field guide of 10⁵ weights near its
    prior draws, now and then, a net that misclassifies most of the data, and one such pass
    drags the mean and inflates its standard error.  Their median is then the typical value; the mean stays the
    unbiased estimate.

    Parameters
    ----------
    model, guide
        A model and guide trained by :func:`pyro_bnn.fit` (or set up by it).
    data : (x, y) tensors, Dataset or DataLoader
        The training data (as given to ``fit``).
    num_samples : int
        Passes over the data (>= 1); each gives one estimate.
    eval_batch_size : int
        Minibatch size of a pass (>= 1).
    objective : callable, optional
        ``objective(model, guide, x, y, num_data)``; default the guide's own.
    device : str or torch.device, optional
        Default: where the model is.
    num_data : int, optional
        The data set size N the objective scales to (as ``fit``'s ``num_data``); default the
        size of ``data`` as ``fit`` reads it (:func:`pyro_bnn.data.batches.dataset_size`: a
        ``DataLoader``'s ``SubsetRandomSampler`` counts its indices).

    Returns
    -------
    list of float
        ``num_samples`` estimates of ``−(loss − loss_constant)`` (the ELBO for variational
        guides), in the order drawn.

    Notes
    -----
    The model runs in its current mode, so a model left in train mode by ``fit`` gives the
    training objective (BatchNorm on batch statistics); its buffers (BatchNorm's running
    statistics) are restored afterwards.
    """
    check_int("num_samples", num_samples, minimum=1)
    check_int("eval_batch_size", eval_batch_size, minimum=1)
    device = torch.device(device) if device is not None else module_device(model)
    loader = make_loader(data, batch_size=eval_batch_size, shuffle=False, device=device)
    n = dataset_size(loader) if num_data is None else check_int("num_data", num_data, minimum=1)
    objective = objective or guide_contract(guide).make_objective(1)
    values = []
    # the objective runs the model as it is (train mode: the training objective); BatchNorm then
    # moves its running statistics, so every buffer is put back afterwards
    with local_params(model, guide), buffers_kept(model, guide):
        for _ in range(num_samples):
            total, seen = 0.0, 0   # seen: the examples of this pass, whose batches are averaged
            for batch in loader:
                xb, yb = split_batch(batch)
                xb = xb.to(device)
                yb = None if yb is None else yb.to(device)
                out = objective(model, guide, xb, yb, num_data=n)
                loss, extras = out if isinstance(out, tuple) else (out, {})
                constant = float(extras.get("loss_constant", 0.0))
                total += len(xb) * (float(loss) - constant)
                seen += len(xb)
            values.append(-total / seen)
    return values


def estimate_objective(model, guide, data, *, num_samples: int = 16, eval_batch_size: int = 1024,
                       objective=None, device=None, num_data: int | None = None) -> tuple[float, float]:
    """Estimate a trained guide's final training objective on ``data``: the mean of
    :func:`objective_draws` and its standard error.

    Parameters
    ----------
    model, guide, data, eval_batch_size, objective, device, num_data
        As for :func:`objective_draws`.
    num_samples : int
        Passes over the data, each one unbiased estimate (>= 2, for a standard error).

    Returns
    -------
    (float, float)
        The mean of the ``num_samples`` estimates of ``−(loss − loss_constant)`` (the ELBO for
        variational guides) and its standard error.

    Notes
    -----
    Under heavy-tailed draws the standard error is itself unreliable; :func:`objective_draws`
    gives the draws (their median, say).
    """
    check_int("num_samples", num_samples, minimum=2)
    values = objective_draws(model, guide, data, num_samples=num_samples, eval_batch_size=eval_batch_size,
                             objective=objective, device=device, num_data=num_data)
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def check_convergence(make: Callable[[], tuple[Any, Any]], data, *, epochs: int, factor: int = 2,
                      tolerance: float = 0.02, seed: int = 0, num_samples: int = 16,
                      eval_batch_size: int = 1024,
                      warn: bool = True, **fit_kwargs) -> LengthCheck:
    """Fit twice, for ``epochs`` and ``factor · epochs``, and say whether ``epochs`` is enough.

    Parameters
    ----------
    make : callable
        ``make() -> (model, guide)``, a fresh, untrained pair on each call (a pair is trained
        in place, so it cannot be reused).
    data : (x, y) tensors, Dataset or DataLoader
        Training data, as for :func:`pyro_bnn.fit`.
    epochs : int
        The length to check (>= 1).
    factor : int
        The longer fit has ``factor · epochs`` epochs (>= 2).
    tolerance : float
        Relative gain of the longer fit's objective that counts as "not converged" (> 0).
    seed : int
        Seeds the random-number generators before each ``make()`` and each fit (the same
        initialisation and data order at both lengths); the caller's random streams are left
        as they were.
    num_samples, eval_batch_size : int, int
        How the final objectives are estimated (:func:`estimate_objective`).
    warn : bool
        Warn with :class:`~pyro_bnn.ConvergenceWarning` if ``epochs`` is not enough.
    **fit_kwargs
        Passed to both :func:`pyro_bnn.fit` calls (``lr``, ``batch_size``, ``lr_schedule``,
        ``device``, ...); not ``checkpoint``, ``resume`` or ``distributed``.

    Returns
    -------
    LengthCheck
        The verdict, both objectives and fits, and the longer fit's model and guide.

    Raises
    ------
    TypeError, ValueError
        Bad arguments; ``make`` returning the same objects twice.

    Examples
    --------
    >>> def make():
    ...     model = pb.BNN(nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)))
    ...     return model, pb.guides.MeanField(model)
    >>> check = pb.check_convergence(make, data.train, epochs=300)  # doctest: +SKIP
    >>> check.converged, check.message()                             # doctest: +SKIP
    """
    if not callable(make):
        raise TypeError(f"make must be a callable returning a fresh (model, guide) pair; got {type(make).__name__}")
    check_int("epochs", epochs, minimum=1)
    check_int("factor", factor, minimum=2)
    check_positive("tolerance", tolerance)
    check_int("seed", seed, minimum=0)
    for name in ("checkpoint", "resume", "distributed"):
        if name in fit_kwargs:
            raise TypeError(f"check_convergence does not take fit's {name!r} argument (two fits of "
                            "different lengths cannot share it)")
    fit_kwargs.setdefault("progress", False)
    lengths = (epochs, factor * epochs)
    pairs, fits, estimates = [], [], []
    for length in lengths:
        with seeded(seed):  # the same initialisation for both lengths; the caller's streams kept
            pair = make()
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"make() must return a (model, guide) tuple; got {type(pair).__name__}")
            if any(obj is prev for prev_pair in pairs for obj, prev in zip(pair, prev_pair)):
                raise ValueError("make() returned the same model or guide twice; it must build a fresh, "
                                 "untrained pair on each call")
            model, guide = pair
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)  # this function gives the verdict
                fits.append(fit(model, guide, data, epochs=length, seed=seed, **fit_kwargs))
            estimates.append(estimate_objective(
                model, guide, data, num_samples=num_samples, eval_batch_size=eval_batch_size,
                objective=fit_kwargs.get("objective"), device=fit_kwargs.get("device"),
                num_data=fit_kwargs.get("num_data")))
        pairs.append(pair)
    (o1, s1), (o2, s2) = estimates
    scale = max(abs(o2), 1.0)
    gain, gain_se = (o2 - o1) / scale, math.hypot(s1, s2) / scale
    # "enough" needs the estimate to resolve the tolerance at all: a noisy pair of estimates
    # whose interval is wider than the tolerance says nothing either way
    converged = (Z * gain_se <= tolerance and gain - Z * gain_se <= tolerance
                 and gain + Z * gain_se >= -tolerance)
    result = LengthCheck(converged, lengths, (o1, o2), (s1, s2), gain, gain_se, tolerance, tuple(fits),
                         model=pairs[1][0], guide=pairs[1][1], short_model=pairs[0][0], short_guide=pairs[0][1])
    if warn and not converged:
        warnings.warn(result.message(), ConvergenceWarning, stacklevel=2)
    return result
