"""MAP objective of the Laplace guide: the negative log joint with the guide's Gaussian prior.

    loss(θ) = −(N/M) Σ_{n∈batch} log p(y_n | f(x_n; θ)) − log N(θ | 0, diag(δ)⁻¹)

δ is the guide's (possibly learned) prior precision, taken as a constant here; sites
outside the guide's ``subset`` (point estimates) add their fixed model-prior term.  For a
:class:`pyro_bnn.BNN` the network is run directly; for a hand-written model the
observed sites' log densities are read from a trace conditioned on θ.
"""

from __future__ import annotations

import math

import torch
from pyro import poutine

from ...contract.objective import GuideObjective
from ...contract.pyro_objective import call_model, observed_sites, scale_observations
from ...model.bnn import is_bnn
from ...model.likelihoods import log_likelihood

__all__ = ["LaplaceMAPObjective", "gaussian_log_prior", "gaussian_log_normalizer"]


def gaussian_log_prior(layers, values: dict, deltas: list) -> torch.Tensor:
    """``Σ_l log N(W̃_l | 0, δ_l⁻¹)`` (0-d); ``deltas`` as ``Laplace.layer_prior_precisions``."""
    return gaussian_log_normalizer(layers, deltas) - _gaussian_quadratic(layers, values, deltas)


def gaussian_log_normalizer(layers, deltas: list) -> torch.Tensor:
    """``Σ_l log N(0 | 0, δ_l⁻¹)``: the θ-independent part of :func:`gaussian_log_prior`."""
    total = 0.0
    for layer, d in zip(layers, deltas):
        log_det = layer.numel * torch.log(d) if d.dim() == 0 else torch.log(d).sum()
        total = total + 0.5 * (log_det - layer.numel * math.log(2 * math.pi))
    return torch.as_tensor(total)


def _gaussian_quadratic(layers, values: dict, deltas: list) -> torch.Tensor:
    """``½ Σ_l δ_l ‖W̃_l‖²``: the θ-dependent part of ``−log N(θ | 0, δ⁻¹)``."""
    return sum(0.5 * (d * layer.flatten(values).reshape(-1) ** 2).sum() for layer, d in zip(layers, deltas))


class LaplaceMAPObjective(GuideObjective):
    """``objective(model, guide, x, y, num_data) -> (loss, extras)`` for :class:`Laplace`.

    Extras: ``log_lik``, ``log_prior`` and ``loss_constant``, the part of the loss that does
    not depend on θ (minus the Gaussian prior's normaliser), which :func:`pyro_bnn.fit`'s
    convergence diagnosis leaves out.

    A Pyro ``ELBO`` as well (:class:`~pyro_bnn.contract.objective.GuideObjective`):
    ``SVI(model, guide, optim, loss=guide.make_objective())`` trains the MAP with the guide's
    own prior precision δ, as :func:`pyro_bnn.fit` does.
    """

    def __call__(self, model, guide, x, y, num_data=None):
        guide._ensure_setup(x, y, num_data)
        values = guide.map_values()
        n = num_data or len(x)
        if is_bnn(model):
            f = model.run_with(values, x)
            loglik = log_likelihood(model.likelihood, f, y).sum() * (n / len(x))
        else:
            args, kwargs, factor = call_model(model, x, y, n)
            scaled = model if num_data is None else scale_observations(factor, num_data, len(x))(model)
            tr = poutine.trace(poutine.condition(scaled, data=values)).get_trace(*args, **kwargs)
            tr.compute_log_prob()
            # condition() marks the latent sites it fixes as observed too (ours, and those of a
            # pyro.condition around the model): count data sites only
            loglik = sum(site["log_prob_sum"] for _, site in observed_sites(tr, values, guide._conditioned_values))
        deltas = [d.detach() for d in guide.layer_prior_precisions()]
        # the Gaussian prior's normaliser does not depend on θ; with ~0.9 nats per weight it can
        # be most of the loss (440k of a 478k-weight MLP's), which would hide the data term's
        # progress from fit's convergence diagnosis: reported apart as ``loss_constant``
        # under poutine.scale(model, s) the log joint is s·(log p(y|θ) + log p(θ)): the trace's
        # log-likelihood carries s, the guide's Gaussian prior is scaled here
        prior_scale = guide._prior_scale
        normalizer = prior_scale * gaussian_log_normalizer(guide.layers, deltas)
        log_prior = normalizer + prior_scale * (guide.fixed_log_prior(values)
                                                - _gaussian_quadratic(guide.layers, values, deltas))
        loss = -(loglik + log_prior)
        return loss, {"log_lik": loglik.detach(), "log_prior": log_prior.detach(),
                      "loss_constant": -normalizer.detach()}
