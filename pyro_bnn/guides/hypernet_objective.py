"""Training objective of the :class:`~pyro_bnn.guides.Hypernet` guide.

For a :class:`~pyro_bnn.BNN` the loss is computed without Pyro tracing, one network run per
particle (the functional forward of :mod:`pyro_bnn.guides.hypernet_forward` where it applies):

    −ELBO = −(N/M) Σ_{n∈batch} log p(y_n | x_n, θ) − log p(θ) + log q(θ),  θ = h_φ(ε),

with the paper's optional softmax-probability clipping and the Rényi / importance-weighted bound
for ``alpha < 1``; any other model goes through Pyro's ``Trace_ELBO``, or for ``alpha < 1``
through per-particle traces of the guide and the replayed model (:func:`traced_log_weights`).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
from pyro import poutine
from pyro.infer import Trace_ELBO

from ..arguments import check_choice
from ..contract.objective import GuideObjective
from ..contract.pyro_objective import PyroObjective, call_model, scale_observations
from ..model.batch_scaling import end_batch_watches
from ..model.bnn import is_bnn, normal_prior_params
from ..model.likelihoods import Categorical, log_likelihood
from ..model.weight_norm import normalize_directions_
from .hypernet_forward import direct_calls_allowed, run_plan, weight_norm_plan

__all__ = ["HypernetELBO", "clipped_log_likelihood", "log_weights", "traced_log_weights", "DIRECTIONS",
           "DEFAULT_DIRECTIONS"]

#: How the point-estimated weight-norm directions ``v`` are kept: ``"sphere"`` rescales every row to
#: norm √fan_in before each training step (:func:`pyro_bnn.weight_norm.normalize_directions_`; no
#: function or density changes), ``"free"`` leaves ``‖v‖`` to drift (the behaviour before issue 26)
DIRECTIONS = ("free", "sphere")
DEFAULT_DIRECTIONS = "free"


def clipped_log_likelihood(lik, f: torch.Tensor, y: torch.Tensor,
                           prob_clip: tuple[float, float] | None = None) -> torch.Tensor:
    """Pointwise ``log p(y_n | f_n)``, shape ``(M,)``; with ``prob_clip=(lo, hi)`` (categorical)
    ``log clamp(softmax(f_n)[y_n], lo, hi)`` as in the paper's code (gradients vanish for
    confidently right or wrong examples)."""
    if prob_clip is None:
        return log_likelihood(lik, f, y)
    if not isinstance(lik, Categorical):
        raise ValueError(f"prob_clip applies to the categorical likelihood, got {lik.name!r}")
    p = torch.softmax(f, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return p.clamp(*prob_clip).log()


class HypernetELBO(GuideObjective):
    """Training loss of a :class:`Hypernet` guide.

    With S = ``num_particles`` draws ``θ_s = h_φ(ε_s)`` and log-weights
    ``w_s = (N/M) log p(y_batch | θ_s) + log p(θ_s) − log q(θ_s)``:

    * α = 1: ``loss = −mean_s w_s`` (negative ELBO);
    * α ≠ 1: ``loss = −1/(1−α) · log mean_s exp((1−α) w_s)`` (Rényi bound; α = 0 is the
      importance-weighted bound).

    For a :class:`~pyro_bnn.BNN` it runs the network directly (no Pyro trace); otherwise
    Pyro's ``Trace_ELBO`` / ``RenyiELBO``.  Returns ``(loss, {"nll", "kl"})``, both per
    particle averages (``kl`` is the Monte Carlo ``log q − log p``).

    It is also a Pyro ``ELBO`` (:class:`~pyro_bnn.contract.objective.GuideObjective`):
    ``SVI(model, guide, optim, loss=guide.make_objective())`` optimises this same loss
    (the Rényi bound and ``prob_clip`` included), which Pyro's ``Trace_ELBO`` does not.
    """

    def __init__(self, num_particles: int = 1, alpha: float = 1.0,
                 prob_clip: tuple[float, float] | None = None, directions: str = "free"):
        if int(num_particles) < 1:
            raise ValueError(f"num_particles must be >= 1, got {num_particles}")
        super().__init__(num_particles=int(num_particles))
        self.alpha = float(alpha)
        self.prob_clip = prob_clip
        self.directions = check_choice("directions", directions, DIRECTIONS)

    def __call__(self, model, guide, x, y, num_data=None):
        if not is_bnn(model):
            if self.prob_clip is not None:
                raise ValueError("prob_clip needs a pyro_bnn.BNN model")
            if self.alpha == 1.0:
                return PyroObjective(Trace_ELBO(num_particles=self.num_particles))(model, guide, x, y, num_data)
            log_w = traced_log_weights(model, guide, x, y, num_data, self.num_particles)
            return self._renyi(log_w), {"elbo": log_w.detach().mean()}
        if guide.prototype_trace is None:
            guide._setup_prototype(x, y, num_data=num_data)
        if self.directions == "sphere":  # a gauge: the loss and its value are unchanged
            normalize_directions_(model)
        values, log_q, packed = _draws(guide, self.num_particles)
        # a plain weight-norm MLP runs as direct functional calls (same operations, same values)
        # where the model's param statements have no effect (pb.fit's module-local mode); under
        # another Pyro handler (SVI's parameter capture, a trace) the model's own forward runs
        plan = weight_norm_plan(model, values) if direct_calls_allowed() else None
        plain = [] if self.prob_clip is not None else None   # the unclipped data term, for the ELBO
        log_w, nll, kl = log_weights(model, values, log_q, x, y, num_data, self.prob_clip,
                                     run=None if plan is None else functools.partial(run_plan, plan),
                                     packed=packed, plain_nll=plain)
        if self.alpha == 1.0:
            # the mean of one value is that value (sum, then ÷ 1: exact, and so its gradient)
            loss = -(log_w.mean() if len(log_w) > 1 else log_w.reshape(()))
        else:
            loss = self._renyi(log_w)
        if len(log_w) == 1:
            extras = {"nll": nll.detach().reshape(()), "kl": kl.detach().reshape(())}
        else:
            extras = {"nll": nll.mean().detach(), "kl": kl.mean().detach()}
        if self.alpha != 1.0 or plain is not None:
            # the loss is not the negative ELBO (a Rényi bound, or a clipped data term): fit's
            # history["elbo"] gets the ELBO estimate of the same draws, −mean(nll + kl) unclipped
            data = nll if plain is None else torch.stack(plain)
            extras["elbo"] = -(data.detach() + kl.detach()).mean()
        return loss, extras


    def _renyi(self, log_w: torch.Tensor) -> torch.Tensor:
        """The negative Rényi bound ``−1/(1−α) · log mean_s exp((1−α) w_s)`` of the log-weights."""
        a = 1.0 - self.alpha
        return -(torch.logsumexp(a * log_w, 0) - math.log(len(log_w))) / a


def traced_log_weights(model, guide, x, y, num_data=None, num_particles: int = 1) -> torch.Tensor:
    """Log-weights ``w_s = log p(y, θ_s) − log q(θ_s)``, shape ``(S,)``, of any Pyro model by
    tracing the guide and replaying the model on its draw, one particle at a time; the
    observations are scaled by ``N/M`` (``num_data``) as in :class:`~pyro_bnn.contract.PyroObjective`.

    Used for the Rényi bound (``alpha < 1``) of a model that is not a :class:`~pyro_bnn.BNN`
    (Pyro's ``RenyiELBO`` has no differentiable loss); its mean is the ELBO estimate of the same
    draws.
    """
    if num_data is not None:  # the batches are scaled here: the guide need not watch them
        end_batch_watches(guide)
    args, kwargs, factor = call_model(model, x, y, num_data)
    scaled = model if num_data is None else scale_observations(factor, num_data, len(x))(model)
    out = []
    for _ in range(int(num_particles)):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(scaled, trace=guide_trace)).get_trace(*args, **kwargs)
        out.append(model_trace.log_prob_sum() - guide_trace.log_prob_sum())
    return torch.stack(out)


def _draws(guide, num_samples: int):
    """``(values, log_q, packed)``: ``guide.sample_with_log_prob(num_samples)`` and, where the guide
    samples as :class:`~pyro_bnn.guides.Hypernet` does (the method not overridden), the flow's
    packed draws whose split ``values`` is (else ``None``)."""
    # (Hypernet's own method carries the mark; a subclass's override does not)
    if not getattr(type(guide).sample_with_log_prob, "packs_flow_draws", False):
        return (*guide.sample_with_log_prob(num_samples), None)
    packed, log_q = guide.flow.rsample_with_log_prob(num_samples)
    return guide.unpack(packed), log_q, packed


def log_weights(model, values: dict, log_q: torch.Tensor, x, y, num_data=None, prob_clip=None, *, run=None,
                packed: torch.Tensor | None = None, plain_nll: list | None = None):
    """``w_s = (N/M) log p(y|θ_s) + log p(θ_s) − log q(θ_s)`` for S joint draws of a BNN.

    ``run(values, x)`` computes the network output (default ``model.run_with``; the objective
    passes the functional forward of :mod:`pyro_bnn.guides.hypernet_forward` where it applies).
    ``packed`` (optional, shape (S, D)): the draws packed, with ``values`` its split into the
    sites in order (``guide.unpack(packed)``); where every site's prior is N(0, 1) the prior's
    elementwise terms are then computed once over the packed draws (the same values, summed per
    site and added in the same order: bit for bit the per-site terms).
    Returns ``(log_w, nll, kl)``, each of shape ``(S,)`` (``nll`` the scaled negative
    log-likelihood, ``kl = log q − log p``).  ``plain_nll``, a list, receives each draw's scaled
    negative log-likelihood without ``prob_clip`` (detached; for the ELBO that a clipped loss is not).
    """
    scale = (num_data or len(x)) / len(x)
    run = model.run_with if run is None else run
    nll = []
    for s in range(len(log_q)):
        # one draw: ``v.squeeze(0)`` is ``v[0]`` (the same view), with a view's backward
        # instead of a zero-filled gradient per site
        sample = ({name: v.squeeze(0) for name, v in values.items()} if len(log_q) == 1 else
                  {name: v[s] for name, v in values.items()})
        f = run(sample, x)
        nll.append(-clipped_log_likelihood(model.likelihood, f, y, prob_clip).sum() * scale)
        if plain_nll is not None:
            plain_nll.append(-log_likelihood(model.likelihood, f.detach(), y).sum() * scale)
    nll = torch.stack(nll) if len(nll) > 1 else nll[0].reshape(1)   # (one draw: a view, not a copy)
    log_p = None if packed is None else _packed_standard_normal_log_prob(model, values, packed)
    if log_p is None and values:
        log_p = _sum_in_order(_prior_log_prob(model, name, v) for name, v in values.items())
    kl = log_q - (0.0 if log_p is None else log_p)
    return -nll - kl, nll, kl


def _prior_log_prob(model, name: str, value: torch.Tensor) -> torch.Tensor:
    """``log p(θ_site)`` of S draws ``value`` (S, *site shape), summed over the site: (S,).

    An i.i.d. Normal prior (``model.site_normal_prior``) is evaluated in closed form,
    ``Σ −(θ−m)²/(2s²) − log s − ½ log 2π`` (Pyro's ``Normal.log_prob`` without building
    distributions and validating arguments); any other prior through Pyro."""
    normal = normal_prior_params(model, name)
    if normal is None:
        return torch.stack([model.site_prior(name).log_prob(v) for v in value])
    loc, s = normal
    zero_mean = _is_cpu_number(loc, 0.0)
    if zero_mean and _is_cpu_number(s, 1.0):
        lp = _standard_normal_terms(value)
    else:   # (``θ − 0`` is ``θ`` exactly, values and gradients: left out for a zero mean)
        centred = value if zero_mean else value - loc
        lp = -0.5 * (centred / s).square() - torch.as_tensor(s).log() - _HALF_LOG_2PI
    return lp.reshape(len(value), -1).sum(-1)


def _packed_standard_normal_log_prob(model, values: dict, packed: torch.Tensor) -> torch.Tensor | None:
    """``Σ_sites log N(θ_site; 0, I)`` of S draws from their packed form ``packed`` (S, D), or
    ``None`` unless every site's prior is N(0, 1) exactly and ``values`` covers ``packed``.

    The elementwise terms ``−θ²/2 − ½ log 2π`` are computed once over ``packed`` (one operation
    chain instead of one per site); each site's slice is summed and the sums are added in the
    sites' order, as :func:`_prior_log_prob` does site by site, so the values and gradients are
    the per-site computation's bit for bit."""
    draws = len(packed) if packed.dim() == 2 else 0
    if not draws or not values:
        return None
    sizes = []
    for name, v in values.items():
        normal = normal_prior_params(model, name)
        if (normal is None or len(v) != draws
                or not (_is_cpu_number(normal[0], 0.0) and _is_cpu_number(normal[1], 1.0))):
            return None
        sizes.append(v.numel() // draws)
    if sum(sizes) != packed.shape[-1]:
        return None
    return _sum_in_order(part.sum(-1) for part in _standard_normal_terms(packed).split(sizes, -1))


def _standard_normal_terms(value: torch.Tensor) -> torch.Tensor:
    """``log N(θ; 0, 1)`` elementwise: the general formula's ``− 0``, ``/ 1`` and ``− log 1`` are
    exact identities (values and gradients bit for bit), so they are left out."""
    return -0.5 * value.square() - _HALF_LOG_2PI


def _sum_in_order(terms) -> torch.Tensor:
    """``t_1 + t_2 + …`` added left to right (no leading ``0 +``: one operation less, same values)."""
    terms = iter(terms)
    total = next(terms)
    for term in terms:
        total = total + term
    return total


def _is_cpu_number(t, number: float) -> bool:
    """Whether ``t`` is one number equal to ``number``, read without a device synchronisation
    (a Python number, or a one-element CPU tensor that takes no gradient)."""
    if isinstance(t, numbers.Real):
        return float(t) == number
    return (isinstance(t, torch.Tensor) and t.numel() == 1 and t.device.type == "cpu"
            and not t.requires_grad and float(t) == number)


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
