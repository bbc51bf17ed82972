"""The ELPD-LOO columns of :func:`pyro_bnn.compare`, on all training observations or a sample.

PSIS-LOO in ArviZ fits one Pareto tail per observation in a Python-level loop: on the 60,000
Fashion-MNIST training images its two variants took 64–68 s per guide (one core, 25 draws),
most of the Fashion-MNIST main job's time outside training.  Above ``observations`` training
points the columns are therefore estimated from a simple random sample of ``m`` of the ``N``
observations (the same sample for every guide, so rows are compared on the same points), by
the *difference estimator* of subsampled LOO (Magnusson et al. 2019, "Bayesian leave-one-out
cross-validation for large data"):

* every observation gets a cheap approximation ``a_n`` of its ``elpd_n``: its log predictive
  density under the draws' weights, without leaving it out (one vectorised pass over the draws);
* the Pareto-smoothed ``elpd_n`` is computed on the sample only, and
  ``elpd_loo = Σ_N a_n + N · mean_sample(elpd_n − a_n)``; ``elpd_loo_psis`` likewise.  The
  estimate is unbiased whatever ``a_n``, and tighter than ``N · mean_sample(elpd_n)`` the less
  the differences spread: for ``elpd_loo`` of a network fitted to a large data set (whose
  correction weights sit on one draw) they vanish, for ``elpd_loo_psis`` the gain is smaller
  (measured in ``docs/results/fashion_mnist.md``, forty-first session);
* ``elpd_loo_se`` and ``elpd_loo_psis_se``: ArviZ's ``sqrt(N · var_n elpd_n)`` (its variance
  estimated from every ``a_n`` and the sample's differences, :func:`difference_estimate`) and the
  sampling error ``N · sd(elpd_n − a_n) / sqrt(m) · sqrt(1 − m / N)``, in quadrature;
* ``pareto_k_bad`` and ``pareto_k_bad_psis``: the share of the scored observations whose Pareto
  ``k̂`` is above ArviZ's threshold (``min(1 − 1/log10 S, 0.7)`` for ``S`` draws), for
  ``elpd_loo`` and ``elpd_loo_psis``: where it is not small the column's estimate is not
  reliable (ArviZ warns on a single such observation; :func:`loo_reliability_note` says so in
  the report).  Observations whose likelihood has a tied tail (scored by plain importance
  sampling, :func:`~pyro_bnn.posterior.arviz.psis_loo_pointwise`) have bounded weights and
  count as reliable;
* ``loo_observations``: ``m`` (``N`` when every observation was scored).

The guide's draws and the importance weights of ``elpd_loo`` (which use the whole training
set's log joint) are those of the full ``DataTree``, which the report keeps whole, so
``az.loo`` on it gives the full-data figures.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy.special import logsumexp

from ..posterior.arviz import MIN_PSIS_DRAWS, OBS_DIM, loo_approximate, num_draws, psis_loo_pointwise

__all__ = ["loo_columns", "loo_sample", "difference_estimate", "loo_reliability_note",
           "DEFAULT_LOO_OBSERVATIONS"]

#: :func:`pyro_bnn.compare`'s default ``loo_observations``: larger training sets are scored on a
#: sample of this many.  Measured on a converged MeanField MLP's 30 draws over the 60,000
#: Fashion-MNIST training images (one core): 8–9 s against 47 s for all of them; ``elpd_loo``
#: equal to the full figure to 0.1 nat, ``elpd_loo_psis`` with a sampling SE of about 550 nats
#: (200 samples; 720 by ``N · mean_sample``) against a full-data SE of 206
#: (``docs/results/fashion_mnist.md``, forty-first session).
DEFAULT_LOO_OBSERVATIONS = 10_000

def loo_sample(num_data: int, observations: int | None, seed: int | None) -> np.ndarray | None:
    """Sorted indices of the observations to score, or ``None`` for all of them.

    Parameters
    ----------
    num_data : int
        N, the training observations.
    observations : int or None
        m; ``None`` or ``m ≥ N``: all.
    seed : int or None
        Seed of the sample (``None``: unseeded).
    """
    if observations is None or observations >= num_data:
        return None
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_data, size=observations, replace=False))


def _lpd(dt, *, corrected: bool) -> np.ndarray:
    """Every observation's log predictive density under the importance weights' draw weights,
    the difference estimator's approximation of its ELPD-LOO; shaped as ``log_likelihood/obs``
    without ``chain`` and ``draw`` (``obs_id`` last).

    ``a_n = logsumexp_s(c_s + log p(y_n | θ_s)) − logsumexp_s(c_s)`` with ``c_s = log p(θ_s, y) −
    log q(θ_s)`` from ``sample_stats`` when ``corrected`` (``loo_approximate``'s weights), else 0
    (``az.loo``'s: the mean of ``p(y_n | θ_s)`` over the draws).  Chosen over the same weights
    without smoothing (plain importance-sampling LOO) and over truncated importance sampling by
    the spread of ``elpd_n − a_n``: on a converged Fashion-MNIST MeanField MLP (60,000 images,
    30 / 100 draws) 1.00 / 1.21 nats against 1.17 / 3.06 and 1.11 / 2.91 for ``az.loo``'s values,
    and below 1e-12 for ``loo_approximate``'s (docs/results/fashion_mnist.md, forty-first session).
    """
    ll = dt["log_likelihood"]["obs"]
    ll = ll.transpose("chain", "draw", ..., OBS_DIM).values.astype(np.float64)
    ll = ll.reshape(-1, *ll.shape[2:])
    if corrected:
        stats = dt["sample_stats"]
        c = (np.asarray(stats["lp"], dtype=np.float64) - np.asarray(stats["log_q"], dtype=np.float64)).reshape(-1)
    else:
        c = np.zeros(ll.shape[0])
    c = c.reshape(-1, *([1] * (ll.ndim - 1)))
    return logsumexp(c + ll, axis=0) - logsumexp(c, axis=0)


def difference_estimate(exact: np.ndarray, approx: np.ndarray, index: np.ndarray) -> tuple[float, float, float]:
    """The difference estimate of ``Σ_n e_n`` from exact values ``e_n`` on a simple random sample
    and approximations ``a_n`` of every one (Magnusson et al. 2019).

    Parameters
    ----------
    exact : ndarray
        ``e_n`` of the sample's points, shaped as ``approx[..., index]``.
    approx : ndarray
        ``a_n`` of every point (the observation axis last; other axes are points of the same
        observation, sampled together).
    index : ndarray of int
        The sample: ``m`` distinct positions on the last axis, drawn without replacement.

    Returns
    -------
    total : float
        ``Σ a_n + N · mean_sample(e_n − a_n)`` (per observation), unbiased for ``Σ e_n``.
    spread_se : float
        ``sqrt(n · var e_n)`` over the ``n`` points (variance with ``n − 1``, ArviZ's ``se``), with
        ``var e = var a + var(e − a) + 2 cov(a, e − a)``: the first over every point, the others over
        the sample's (NaN when ``m = 1``).
    sampling_se : float
        The standard error of ``total`` from the sampling, ``N · sd(e_n − a_n) / sqrt(m) ·
        sqrt(1 − m / N)``; 0 when ``m = N``, NaN when ``m = 1``.
    """
    num_data, m = approx.shape[-1], len(index)
    sampled = approx[..., index]
    exact = np.asarray(exact, dtype=np.float64).reshape(sampled.shape)
    diff = exact - sampled
    per_obs = diff.reshape(-1, m).sum(0)                  # one difference per sampled observation
    total = float(approx.sum()) + num_data * float(per_obs.mean())
    # var e = var a (every point) + var d + 2 cov(a, d) (the sample's points): exact at m = N and
    # whenever the approximation is off by a constant
    if m > 1:
        cov = np.cov(sampled.ravel(), diff.ravel(), ddof=1)
        variance = float(approx.var(ddof=1)) + cov[1, 1] + 2 * cov[0, 1]
    else:
        variance = math.nan
    spread = math.sqrt(approx.size * max(variance, 0.0))
    sampling = (num_data * float(per_obs.std(ddof=1)) / math.sqrt(m) * math.sqrt(1 - m / num_data)
                if m > 1 else math.nan)
    return total, spread, sampling


def loo_columns(dt, index: np.ndarray | None = None) -> dict:
    """``elpd_loo``, ``elpd_loo_se``, ``pareto_k_bad``, ``elpd_loo_psis``, ``elpd_loo_psis_se``,
    ``pareto_k_bad_psis`` and ``loo_observations`` of a guide's ``DataTree`` (see the module
    docstring).

    Parameters
    ----------
    dt : xarray.DataTree
        :func:`pyro_bnn.to_arviz` of the guide on the training data.
    index : ndarray of int, optional
        The observations to score (:func:`loo_sample`); ``None``: all.

    Returns
    -------
    dict
        The columns; NaN (and a ``RuntimeWarning`` that names the cause) where PSIS could not
        be computed.
    """
    num_data = int(dt["log_likelihood"].sizes[OBS_DIM])
    part = dt if index is None else dt.isel({OBS_DIM: index}, missing_dims="ignore")
    m = num_data if index is None else len(index)
    out = {"elpd_loo": math.nan, "elpd_loo_se": math.nan, "pareto_k_bad": math.nan,
           "elpd_loo_psis": math.nan, "elpd_loo_psis_se": math.nan, "pareto_k_bad_psis": math.nan,
           "loo_observations": m}
    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            res = loo_approximate(part, pointwise=True)
            if index is None:
                out["elpd_loo"], out["elpd_loo_se"] = float(res.elpd), float(res.se)
            else:
                approx = _lpd(dt, corrected=True)
                total, spread, sampling = difference_estimate(res.elpd_i.transpose(..., OBS_DIM).values,
                                                              approx, index)
                out["elpd_loo"], out["elpd_loo_se"] = total, math.hypot(spread, sampling)
            out["pareto_k_bad"] = float((res.pareto_k.values > res.good_k).mean())
        except (ValueError, FloatingPointError) as exc:  # e.g. identical draws: PSIS undefined
            notes.append(f"loo_approximate_posterior: {exc}")
        try:
            pointwise, _, pareto_k, good_k = psis_loo_pointwise(part)
            out["pareto_k_bad_psis"] = float((pareto_k > good_k).mean())   # NaN (plain IS): not bad
            if index is None:
                out["elpd_loo_psis"] = float(pointwise.sum())
                out["elpd_loo_psis_se"] = math.sqrt(m * pointwise.var(ddof=1)) if m > 1 else math.nan
            else:
                total, spread, sampling = difference_estimate(pointwise, _lpd(dt, corrected=False), index)
                out["elpd_loo_psis"], out["elpd_loo_psis_se"] = total, math.hypot(spread, sampling)
        except (ValueError, FloatingPointError) as exc:
            notes.append(f"loo: {exc}")
    draws = num_draws(dt)
    hint = f"; in pb.compare: loo_samples >= {MIN_PSIS_DRAWS}" if draws < MIN_PSIS_DRAWS else ""
    for note in notes:
        warnings.warn(f"ELPD-LOO not computed ({note}{hint})", RuntimeWarning, stacklevel=3)
    return out


#: The ELPD-LOO columns and the columns of their ``k̂`` diagnostics.
K_COLUMNS = {"elpd_loo": "pareto_k_bad", "elpd_loo_psis": "pareto_k_bad_psis"}


def loo_reliability_note(table) -> str | None:
    """One sentence for a report: which rows' ELPD-LOO estimates are unreliable by their Pareto
    ``k̂`` (any observation above ArviZ's threshold, as ArviZ warns), with the shares; ``None``
    when every row's are reliable or the table has no such columns.

    Parameters
    ----------
    table : pandas.DataFrame
        :func:`pyro_bnn.compare`'s table (one row per guide).

    Returns
    -------
    str or None
    """
    parts = []
    for column, k_column in K_COLUMNS.items():
        if k_column not in getattr(table, "columns", ()):
            continue
        shares = table[k_column]
        bad = [f"{name} {share:.0%}" for name, share in shares.items()
               if isinstance(share, (int, float)) and share > 0]
        if bad:
            parts.append(f"{column} ({k_column}: {', '.join(bad)})")
    if not parts:
        return None
    return ("Unreliable ELPD-LOO: Pareto k-hat is above ArviZ's threshold for the share of "
            "observations shown, so these estimates are not reliable (importance sampling from "
            "the guide's draws fails there; more draws or a closer posterior approximation would be "
            "needed): " + "; ".join(parts) + ".")
