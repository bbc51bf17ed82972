"""The ELPD-LOO columns of :func:`pyro_bnn.compare`, on all training observations or a sample.

PSIS-LOO in ArviZ fits one Pareto tail per observation in a Python-level loop: on the 60,000
Fashion-MNIST training images its two variants took 64–68 s per guide (one core, 25 draws),
most of the Fashion-MNIST main job's time outside training.  Above ``observations`` training
points the columns are therefore estimated from a simple random sample of ``m`` of the ``N``
observations (the same sample for every guide, so rows are compared on the same points):

* ``elpd_loo = N · mean_i elpd_i`` over the sample, and ``elpd_loo_psis`` likewise;
* ``elpd_loo_se``: ArviZ's ``sqrt(N · var_i elpd_i)`` from the sample, and the sampling error
  of the estimate, ``N · sd_i / sqrt(m) · sqrt(1 − m / N)``, added in quadrature;
* ``pareto_k_bad``: the share of the sample's ``k̂`` above ArviZ's threshold;
* ``loo_observations``: ``m`` (``N`` when every observation was scored).

The guide's draws and the importance weights of ``elpd_loo`` (which use the whole training
set's log joint) are those of the full ``DataTree``, which the report keeps whole, so
``az.loo`` on it gives the full-data figures.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from ..posterior.arviz import MIN_PSIS_TAIL, OBS_DIM, loo_approximate, psis_loo

__all__ = ["loo_columns", "loo_sample", "DEFAULT_LOO_OBSERVATIONS", "MIN_LOO_DRAWS"]

#: :func:`pyro_bnn.compare`'s default ``loo_observations``: larger training sets are scored on a
#: sample of this many.  Measured on a MeanField MLP's 25 draws over the 60,000 Fashion-MNIST
#: training images (one core): 10–11 s against 64 s for all of them; three samples gave
#: ``elpd_loo`` −30,493 / −29,902 / −30,444 (``elpd_loo_se`` 555 / 516 / 569) against −30,523 ± 225
#: from every observation (``docs/results/fashion_mnist.md``, fortieth session).
DEFAULT_LOO_OBSERVATIONS = 10_000

#: The fewest draws ArviZ's PSIS fits: its tail is ``floor(S / 5)`` draws, at least
#: :data:`~pyro_bnn.posterior.arviz.MIN_PSIS_TAIL`.
MIN_LOO_DRAWS = 5 * MIN_PSIS_TAIL


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


def _num_draws(dt) -> int:
    """Chains × draws of a DataTree's ``log_likelihood`` group (0 without one)."""
    try:
        sizes = dt["log_likelihood"].sizes
    except KeyError:
        return 0
    return int(sizes.get("chain", 1) * sizes.get("draw", 0))


def _sampled_estimate(res, num_data: int) -> tuple[float, float]:
    """``N · mean`` of a sample's per-observation ELPDs and its standard error: ArviZ's
    ``sqrt(n · var)`` (ddof 1) over the whole set's points and the sampling error, in quadrature."""
    elpd_i = res.elpd_i
    per_obs = np.asarray(elpd_i.sum([d for d in elpd_i.dims if d != OBS_DIM]), dtype=np.float64)
    m = per_obs.size
    points = num_data * elpd_i.size // m                   # ArviZ's n_data_points, whole set
    spread = math.sqrt(points * np.asarray(elpd_i, dtype=np.float64).var(ddof=1))
    sampling = num_data * per_obs.std(ddof=1) / math.sqrt(m) * math.sqrt(1 - m / num_data)
    return num_data * float(per_obs.mean()), math.hypot(spread, sampling)


def loo_columns(dt, index: np.ndarray | None = None) -> dict:
    """``elpd_loo``, ``elpd_loo_se``, ``pareto_k_bad``, ``elpd_loo_psis`` and ``loo_observations``
    of a guide's ``DataTree`` (see the module docstring).

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
    scale = num_data / m
    out = {"elpd_loo": math.nan, "elpd_loo_se": math.nan, "pareto_k_bad": math.nan,
           "elpd_loo_psis": math.nan, "loo_observations": m}
    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            res = loo_approximate(part, pointwise=True)
            if index is None:
                out["elpd_loo"], out["elpd_loo_se"] = float(res.elpd), float(res.se)
            else:
                out["elpd_loo"], out["elpd_loo_se"] = _sampled_estimate(res, num_data)
            out["pareto_k_bad"] = float((res.pareto_k.values > res.good_k).mean())
        except (ValueError, FloatingPointError) as exc:  # e.g. identical draws: PSIS undefined
            notes.append(f"loo_approximate_posterior: {exc}")
        try:
            out["elpd_loo_psis"] = scale * psis_loo(part)[0]
        except (ValueError, FloatingPointError) as exc:
            notes.append(f"loo: {exc}")
    draws = _num_draws(dt)
    hint = (f"; PSIS fits its tail to floor(S/5) >= 5 draws, so it needs at least {MIN_LOO_DRAWS} "
            f"draws and got {draws}: pass loo_samples >= {MIN_LOO_DRAWS}" if draws < MIN_LOO_DRAWS else "")
    for note in notes:
        warnings.warn(f"ELPD-LOO not computed ({note}{hint})", RuntimeWarning, stacklevel=3)
    return out
