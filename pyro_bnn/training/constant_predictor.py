"""What a classifier's fit must beat to have learned anything: the best constant predictor.

A network that predicts the training set's class frequencies for every input, whatever the
input, reaches the log-likelihood ``N Σ_c p̂_c log p̂_c`` (``p̂_c`` the share of class ``c``
among the labels) with no parameters to pay for.  A variational objective (an ELBO) is a lower
bound on the log evidence and at most the expected log-likelihood, so a fit whose ELBO ends at or
below this value does, by its own bound, no better than ignoring the inputs.  A short fit that
has not learned yet ends there (its predictions may already beat chance: it pays more in KL than
it gains), and so does a fit collapsed to its prior, which is as flat as a converged one
(measured: MeanField on a LeNet CNN at a learning rate too high for it).
:func:`pyro_bnn.training.convergence.diagnose` flags it (check (e)); a MAP objective (Laplace,
``AutoDelta``) is no such bound and is not compared (``BNNGuide.bounds_evidence``)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..data.batches import as_tensors, dataset_size
from ..model.bnn import model_likelihood
from ..model.likelihoods import kind_and_noise

__all__ = ["constant_predictor_log_likelihood"]


def _labels(data) -> torch.Tensor | None:
    """The training targets when ``data`` holds them as one tensor (``(x, y)``, a
    ``TensorDataset``, or a ``DataLoader`` that draws from the whole of one); ``None`` otherwise
    (other datasets are not read, and a loader over part of its dataset, a train/validation split,
    has other class frequencies)."""
    if isinstance(data, DataLoader):
        try:
            whole = isinstance(data.dataset, TensorDataset) and dataset_size(data) == len(data.dataset)
        except (TypeError, ValueError):  # a sampler of one's own: which examples it covers is unknown
            whole = False
        if not whole:
            return None
        data = data.dataset
    try:
        return as_tensors(data)[1]
    except (TypeError, ValueError):
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
        data whose targets are not one tensor (a dataset of pairs, a loader over one), a loader
        over part of its dataset, or no targets.
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
