"""What a classifier's fit must beat to have learned anything: the best constant predictor.

A network that predicts the training set's class frequencies for every input, whatever the
input, reaches the log-likelihood ``N Σ_c p̂_c log p̂_c`` (``p̂_c`` the share of class ``c``
among the labels) with no parameters to pay for.  A variational fit's objective is a lower
bound on the log evidence and is at most its expected log-likelihood (a Laplace MAP objective:
the log-likelihood less the prior's penalty), so a fit whose objective ends at or below this
value does, by its own bound, no better than ignoring the inputs.  A short fit that has not
learned yet ends there (its predictions may already beat chance: it pays more in KL than it
gains), and so does a fit whose every posterior scale went back to its prior: on a narrow
network a learning rate too high sends the scales there in the first epoch, before the means
have learned, the gradient of the data term is then noise, and the fit is as flat as a
converged one.  :func:`pyro_bnn.training.convergence.diagnose` flags it
(check (e)).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..model.bnn import model_likelihood
from ..model.likelihoods import kind_and_noise

__all__ = ["constant_predictor_log_likelihood"]


def _labels(data) -> torch.Tensor | None:
    """The training targets when ``data`` holds them as one tensor (``(x, y)``, a two-tensor
    ``TensorDataset``, or a ``DataLoader`` over one); ``None`` for other datasets (not read)."""
    data = getattr(data, "dataset", data) if isinstance(data, DataLoader) else data
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return data.tensors[1]
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return data[1]
    return None


def constant_predictor_log_likelihood(model, data, num_data: int) -> float | None:
    """Log-likelihood of ``num_data`` points under the training class frequencies, predicted
    for every input.

    Parameters
    ----------
    model : BNN
        A :class:`~pyro_bnn.BNN` with a categorical or Bernoulli likelihood.
    data : tuple of Tensor, TensorDataset or DataLoader
        The training data as given to :func:`pyro_bnn.fit` (a loader: its dataset's targets).
    num_data : int
        The number of points the fit's objective counts (its minibatch scaling): the value is
        scaled from ``len(y)`` to it.

    Returns
    -------
    float or None
        ``num_data · Σ_c p̂_c log p̂_c`` (Bernoulli: ``num_data · (p̂ log p̂ + (1 − p̂) log(1 − p̂))``),
        or ``None`` when it does not apply: another likelihood (regression), a hand-written model,
        data whose targets are not one tensor (a dataset of pairs, a loader over one), or no targets.
    """
    likelihood = model_likelihood(model)
    kind = kind_and_noise(likelihood)[0] if likelihood is not None else None
    y = _labels(data)
    if kind not in ("categorical", "bernoulli") or y is None or len(y) == 0:
        return None
    n = len(y)
    y = y.detach().reshape(n, -1).double()
    if kind == "categorical":
        counts = torch.bincount(y[:, 0].long()).double()
    else:  # each output its own Bernoulli: its positives and negatives
        positives = y.sum(0)
        counts = torch.cat([positives, n - positives])
    counts = counts[counts > 0]
    return float((counts * torch.log(counts / n)).sum()) * num_data / n
