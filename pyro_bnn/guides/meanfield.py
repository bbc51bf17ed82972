"""Mean-field Gaussian guide (Bayes by Backprop, Blundell et al. 2015).

``q(w) = Π_i N(w_i | μ_i, σ_i²)``, ``σ = softplus(ρ)``, built on Pyro's ``AutoNormal``:

* locations start at the network's current weights (pretrained nets work);
* the initial σ is small and configurable (``init_scale``);
* the KL term is computed in closed form where the prior is Normal (Monte Carlo for the
  scale-mixture prior);
* optional local reparameterisation (Kingma et al. 2015) for Linear/Conv layers: sample
  pre-activations ``N(x μ, x² σ²)`` instead of weights — lower-variance gradients.

For a :class:`pyro_bnn.BNN` the objective bypasses Pyro's tracing (the weights are put
straight into the ``PyroModule`` sample cache); it computes the same ELBO as
``TraceMeanField_ELBO`` (tested) at a fraction of the per-step overhead.
"""

from __future__ import annotations

from contextlib import ExitStack
from operator import attrgetter

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn
from torch.distributions import kl_divergence

from ..likelihoods import log_likelihood
from ..objectives import PyroObjective
from .base import init_to_network, register_guide

__all__ = ["MeanField", "MeanFieldELBO"]


class MeanField(AutoNormal):
    """Mean-field Normal guide for BNNs.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model.
    init_scale : float
        Initial posterior standard deviation of every weight (default 1e-2).
    init_loc_fn : callable, optional
        Pyro init strategy; default :class:`~pyro_bnn.guides.base.init_to_network`.
    local_reparameterization : bool
        Sample Linear/Conv pre-activations instead of weights during training
        (:class:`~pyro_bnn.BNN` models only).

    Examples
    --------
    >>> guide = pb.guides.MeanField(model, init_scale=1e-3)        # doctest: +SKIP
    >>> pb.fit(model, guide, (x, y), epochs=10)                     # doctest: +SKIP
    """

    def __init__(self, model, *, init_scale: float = 1e-2, init_loc_fn=None,
                 local_reparameterization: bool = False):
        super().__init__(model, init_loc_fn=init_loc_fn or init_to_network(model),
                         init_scale=float(init_scale))
        self.local_reparameterization = bool(local_reparameterization)

    def loc_and_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean μ and standard deviation σ of site ``name``."""
        return attrgetter(name)(self.locs), attrgetter(name)(self.scales)

    def site_names(self) -> list[str]:
        return [name for name, _ in self.prototype_trace.iter_stochastic_nodes()]

    def forward(self, *args, **kwargs):
        """Sample every weight from ``N(μ, σ²)`` (real-valued sites), so Pyro ELBOs can use
        the closed-form KL.  Constrained sites go through ``AutoNormal``'s transform."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        if not all(_is_real(site["fn"].support)
                   for _, site in self.prototype_trace.iter_stochastic_nodes()):
            return super().forward(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                loc, scale = self.loc_and_scale(name)
                result[name] = pyro.sample(
                    name, dist.Normal(loc, scale).to_event(self._event_dims[name]))
        return result

    def make_objective(self, num_particles: int = 1):
        return MeanFieldELBO(num_particles)


def _is_real(support) -> bool:
    while hasattr(support, "base_constraint"):
        support = support.base_constraint
    return support is dist.constraints.real


register_guide("meanfield", lambda model, **kw: MeanField(model, **kw))


class MeanFieldELBO:
    """Negative ELBO of a :class:`MeanField` guide: ``E_q[−log p(D|w)] + KL(q‖p)``.

    For a :class:`pyro_bnn.BNN` it samples ``w = μ + σ ε`` and runs the network directly
    (no Pyro trace), with ``N/M`` minibatch scaling and the closed-form KL where the prior
    is Normal; otherwise it is Pyro's ``TraceMeanField_ELBO``.
    """

    def __init__(self, num_particles: int = 1):
        self.num_particles = int(num_particles)
        self._fallback = PyroObjective(TraceMeanField_ELBO(num_particles=self.num_particles))

    def __call__(self, model, guide, x, y, num_data=None):
        if not (hasattr(model, "site_names") and hasattr(model, "site_prior")):
            if guide.local_reparameterization:
                raise ValueError("local_reparameterization needs a pyro_bnn.BNN model")
            return self._fallback(model, guide, x, y, num_data)
        if guide.prototype_trace is None:
            guide._setup_prototype(x, y, num_data=num_data)
        return meanfield_loss(model, guide, x, y, num_data, self.num_particles)


def meanfield_loss(model, guide, x, y, num_data, num_particles=1):
    """Negative ELBO for a BNN and a MeanField guide (see :class:`MeanFieldELBO`)."""
    scale_factor = (num_data or len(x)) / len(x)
    sites = model.site_names
    qs = {name: guide.loc_and_scale(name) for name in sites}
    priors = {name: model.site_prior(name) for name in sites}
    kl_closed = 0.0
    mc_sites = []
    for name in sites:
        loc, scale = qs[name]
        try:
            kl_closed = kl_closed + kl_divergence(
                dist.Normal(loc, scale).to_event(loc.dim()), priors[name])
        except NotImplementedError:
            mc_sites.append(name)
    local = guide.local_reparameterization
    nll = 0.0
    for _ in range(num_particles):
        values, hooks = {}, []
        for name in sites:
            loc, scale = qs[name]
            values[name] = loc if local else loc + scale * torch.randn_like(loc)
        if local:
            hooks = _install_local_reparam(model, qs)
        try:
            f = _run_with_values(model, values, x)
        finally:
            for h in hooks:
                h.remove()
        nll = nll - log_likelihood(model.likelihood, f, y).sum() * scale_factor
        for name in mc_sites:
            loc, scale = qs[name]
            w = values[name] if not local else loc + scale * torch.randn_like(loc)
            nll = nll + (dist.Normal(loc, scale).log_prob(w).sum() - priors[name].log_prob(w))
    return nll / num_particles + kl_closed


def _run_with_values(model, values: dict, x):
    """Run ``model.function(x)`` with the sample sites fixed to ``values``.

    The values go straight into the ``PyroModule`` context cache, which is exactly where
    ``PyroSample`` looks first, so no Pyro messenger is involved.
    """
    ctx = model._pyro_context
    with ctx:
        for name, v in values.items():
            ctx.set(name, v)
        return model.function(x)


def _conv_function(module):
    for cls, fn in ((nn.Conv1d, F.conv1d), (nn.Conv2d, F.conv2d), (nn.Conv3d, F.conv3d)):
        if isinstance(module, cls):
            return fn
    raise TypeError(type(module).__name__)


def _install_local_reparam(model, qs):
    """Forward hooks adding ``sqrt(x² σ_W² + σ_b²) ε`` to Linear/Conv outputs.

    The layer itself runs with the posterior means (put in the cache), which is the mean
    of the pre-activation; the hook adds the noise with the matching variance.
    """
    hooks = []
    for path, module in model.net.named_modules():
        wname = f"net.{path}.weight" if path else "net.weight"
        if wname not in qs:
            continue
        bname = f"net.{path}.bias" if path else "net.bias"
        var_w = qs[wname][1] ** 2
        var_b = qs[bname][1] ** 2 if bname in qs else None
        if isinstance(module, nn.Linear):
            def hook(mod, inputs, out, var_w=var_w, var_b=var_b):
                var = F.linear(inputs[0] ** 2, var_w, var_b)
                return out + var.clamp_min(1e-30).sqrt() * torch.randn_like(out)
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.padding_mode == "zeros":
            conv = _conv_function(module)

            def hook(mod, inputs, out, var_w=var_w, var_b=var_b, conv=conv):
                var = conv(inputs[0] ** 2, var_w, var_b, mod.stride, mod.padding,
                           mod.dilation, mod.groups)
                return out + var.clamp_min(1e-30).sqrt() * torch.randn_like(out)
        else:
            raise ValueError(
                f"local reparameterisation supports Linear and zero-padded Conv layers; "
                f"site {wname!r} belongs to {type(module).__name__}")
        hooks.append(module.register_forward_hook(hook))
    return hooks
