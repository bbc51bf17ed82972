"""Normalizing flows for Bayesian hypernetworks (Krueger, Huang et al. 2017), on Pyro transforms.

A sample of the D weights is ``z = h(ε)``, ``ε ~ N(0, I_D)``, with

    h = A ∘ T_K ∘ … ∘ T_1,      A(u) = μ + softplus(ρ) ⊙ u,

K blocks ``T_t`` on standardised coordinates followed by an elementwise affine layer ``A``
whose location starts at the network's weights and whose scale starts at ``init_scale``.
The blocks are IAF/MADE blocks (Pyro's
:class:`~pyro.distributions.transforms.AffineAutoregressive`, ``y = m(x) + exp(s(x)) ⊙ x``
with autoregressive m, s) or RealNVP couplings (Pyro's
:class:`~pyro.distributions.transforms.AffineCoupling`) separated by fixed permutations
(Pyro's :class:`~pyro.distributions.transforms.Permute`).  The log-density is the change of
variables

    log q(z) = log N(ε; 0, I) − Σ_t log|det ∂T_t/∂x_{t−1}| − Σ_i log softplus(ρ_i).

Every block starts as the exact identity (its conditioner's output layer starts at zero), so
at the start q is the mean-field Gaussian N(μ, diag σ²) that :class:`~pyro_bnn.guides.MeanField`
starts from, and the flow can only add to it; ``num_flows=0`` *is* a mean-field Gaussian
(Bayes by Backprop).  Three choices keep training stable at the learning rates a
mean-field Gaussian trains at (``docs/results/hypernet.md`` has the measurements):

* the blocks act on standardised coordinates (the affine layer comes last), so a block's
  shift and scale are relative to σ and never rescale the weights' means;
* the conditioners' log-scales are bounded smoothly, ``s = B tanh(s̃/B)`` (``log_scale_bound``
  B = 3), not by Pyro's hard clamp, whose straight-through gradient let raw log-scales drift
  to 10⁴ while the forward pass stayed at the clamp;
* the conditioners are fan-in scaled (:class:`MADE` ``fan_in_scaled``): an Adam step moves
  a pre-activation by at most ``lr · mean|input|`` instead of ``lr · Σ|input|`` (thousands
  of inputs for a flow over every weight).

The paper's layout (affine layer first with scale 0.002, then blocks starting near the
identity; Pyro's clamp, plain conditioners) is ``HypernetFlow(..., affine_last=False,
log_scale_bound=None, fan_in_scaled=False, init_gain=1e-2, init_scale=2e-3)``.

With ``flow_index`` the blocks act on those coordinates only and the rest get the affine layer
alone (a mean-field Gaussian): for a weight-norm network with random directions the flow is over
the few hundred scales and the hundreds of thousands of direction entries are mean-field
(:class:`CoordinateSubset`).

Pyro's ``AutoRegressiveNN`` requires hidden width ≥ D; :class:`MADE` here allows any width
(hidden degrees spread over 1..D−1, Germain et al. 2015), which the hypernetwork needs
(D = hundreds of weight-norm scales, 200 hidden units).
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.distributions.torch_transform import TransformModule
from pyro.distributions.transforms import AffineAutoregressive, AffineCoupling, Permute
from pyro.distributions.transforms.utils import clamp_preserve_gradients
from torch import nn

from .made import MADE, soft_bound

__all__ = ["ElementwiseAffine", "MADE", "CouplingNet", "CoordinateSubset", "HypernetFlow", "hypernet_flow",
           "FLOW_TYPES"]

FLOW_TYPES = ("iaf", "realnvp")


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class ElementwiseAffine(TransformModule):
    """``y = μ + softplus(ρ) ⊙ x`` with learned μ (D,) and ρ (D,); log|det| = Σ log softplus(ρ).

    Parameters
    ----------
    loc : Tensor, shape (D,)
        Initial μ (e.g. the network's weights).
    scale : float
        Initial ``softplus(ρ)`` of every coordinate.
    """

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True
    sign = +1

    def __init__(self, loc: torch.Tensor, scale: float = 2e-3):
        super().__init__(cache_size=1)
        if not scale > 0:
            raise ValueError(f"init_scale must be > 0, got {scale!r}")
        self.loc = nn.Parameter(loc.detach().clone())
        self.rho = nn.Parameter(_inv_softplus(torch.full_like(loc.detach(), float(scale))))

    @property
    def scale(self) -> torch.Tensor:
        return F.softplus(self.rho)

    def set_scale_(self, scale: torch.Tensor) -> ElementwiseAffine:
        """Set ``softplus(ρ)`` to ``scale`` (shape (D,), positive), in place."""
        scale = torch.as_tensor(scale, dtype=self.rho.dtype, device=self.rho.device)
        if scale.shape != self.rho.shape or not bool((scale > 0).all()):
            raise ValueError(f"scale must be positive with shape {tuple(self.rho.shape)}, got shape "
                             f"{tuple(scale.shape)}")
        with torch.no_grad():
            self.rho.copy_(_inv_softplus(scale))
        return self

    def _call(self, x):
        return self.loc + self.scale * x

    def _inverse(self, y):
        return (y - self.loc) / self.scale

    def log_abs_det_jacobian(self, x, y):
        return self.scale.log().sum(-1).expand(x.shape[:-1])


class CoordinateSubset(dist.transforms.Transform):
    """``parts`` (transforms of ``len(index)``-vectors, applied in order) on the coordinates
    ``index`` of a vector; the other coordinates pass unchanged.  ``log|det|`` is that of the
    parts (the Jacobian is block-diagonal with an identity block).

    Parameters
    ----------
    parts : sequence of Transform
        Bijections of ``real_vector`` on ``len(index)`` coordinates.
    index : LongTensor, shape (d,)
        The coordinates they act on (distinct).
    """

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(self, parts, index: torch.Tensor, cache_size: int = 1):
        super().__init__(cache_size=cache_size)
        self.parts, self.index = list(parts), index
        self._last = None   # (x, y, log|det|) of the last forward call: Pyro asks for both in turn

    def _call(self, x):
        y, log_det = _forward_with_log_det(self, x)
        if self._cache_size == 1:   # cached like Pyro's own (x, y) pair; cache_size=0 keeps nothing
            self._last = (x, y, log_det)
        return y

    def _inverse(self, y):
        u = y.index_select(-1, self.index)
        for t in reversed(self.parts):
            u = t.inv(u)
        return y.index_copy(-1, self.index, u)

    def log_abs_det_jacobian(self, x, y):
        if self._last is not None and self._last[0] is x and self._last[1] is y:
            return self._last[2]   # the forward pass that made y (a sample's log-density: no second pass)
        return _forward_with_log_det(self, x)[1]


class HypernetFlow(nn.Module):
    """The hypernetwork ``z = h(ε)``: K IAF blocks or couplings, then an elementwise affine layer.

    Parameters
    ----------
    dim : int
        D, the number of weights it generates.
    flow : {"iaf", "realnvp"}
        Block type.
    num_flows : int
        K ≥ 0 blocks (0: mean-field Gaussian).
    hidden : int
        Hidden units of each block's conditioner (one hidden ReLU layer).
    init_loc : Tensor, shape (D,), optional
        Initial μ of the affine layer (default 0).
    init_scale : float
        Initial scale ``softplus(ρ)`` of the affine layer.
    init_gain : float
        Factor on the conditioners' output-layer initial weights; 0 (default) starts every
        block at the exact identity.
    seed : int
        Seed of the fixed permutations.
    affine_last : bool
        ``z = A(T(ε))`` (default: blocks on standardised coordinates) or, ``False``, the
        paper's order ``z = T(A(ε))``.
    log_scale_bound : float or None
        Smooth bound B of the blocks' log-scales (``B tanh(s̃/B)``); ``None``: Pyro's hard
        clamp to [−5, 3] with straight-through gradients.
    fan_in_scaled : bool
        Fan-in scaled conditioners (see :class:`MADE`).
    flow_index : LongTensor, optional
        The coordinates the blocks act on (default all D); the others get the affine layer
        only.  Needs ``affine_last`` (the blocks then work on standardised coordinates).
    """

    def __init__(self, dim: int, flow: str = "iaf", num_flows: int = 8, hidden: int = 200,
                 init_loc: torch.Tensor | None = None, init_scale: float = 0.1,
                 init_gain: float = 0.0, seed: int = 0, affine_last: bool = True,
                 log_scale_bound: float | None = 3.0, fan_in_scaled: bool = True,
                 flow_index: torch.Tensor | None = None):
        super().__init__()
        flow_index = _check_flow_index(flow_index, dim, affine_last)
        # the blocks' width: D, or the coordinates of ``flow_index``
        width = dim if flow_index is None else len(flow_index)
        self.affine_last = bool(affine_last)
        if log_scale_bound is not None and not log_scale_bound > 0:
            raise ValueError(f"log_scale_bound must be > 0 or None, got {log_scale_bound!r}")
        self.log_scale_bound = None if log_scale_bound is None else float(log_scale_bound)
        self.fan_in_scaled = bool(fan_in_scaled)
        if flow not in FLOW_TYPES:
            raise ValueError(f"flow must be one of {FLOW_TYPES}, got {flow!r}")
        if not isinstance(num_flows, int) or num_flows < 0:
            raise ValueError(f"num_flows must be an integer >= 0, got {num_flows!r}")
        if num_flows > 0 and width < 2:
            raise ValueError(f"flow blocks need at least 2 latent dimensions, got {width}; "
                             "use num_flows=0")
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be a positive integer, got {hidden!r}")
        self.dim, self.flow, self.num_flows = int(dim), flow, num_flows
        loc = torch.zeros(dim) if init_loc is None else init_loc.detach().reshape(-1)
        if loc.numel() != dim:
            raise ValueError(f"init_loc must have {dim} values, got {loc.numel()}")
        self.affine = ElementwiseAffine(loc, init_scale)
        # saved with the parameters: they define this distribution in this layout only
        self.register_buffer("layout", _layout_code(self.affine_last, self.log_scale_bound))
        if flow_index is not None:
            self.register_buffer("flow_index", flow_index)
        else:
            self.flow_index = None
        gen = torch.Generator().manual_seed(seed)
        perms = [_permutation(width, i, gen) for i in range(num_flows)]
        blocks = []
        for i in range(num_flows):
            if flow == "iaf":
                block = AffineAutoregressive(MADE(width, hidden, perms[i],
                                                  log_scale_bound=self.log_scale_bound,
                                                  fan_in_scaled=self.fan_in_scaled))
                block.arn.scale_output_(init_gain)
            else:
                split = width // 2
                block = AffineCoupling(split, CouplingNet(split, hidden, width - split,
                                                          self.log_scale_bound,
                                                          self.fan_in_scaled))
                block.nn.scale_output_(init_gain)
                self.register_buffer(f"perm{i}", perms[i])
            if self.log_scale_bound is not None:  # the smooth bound replaces Pyro's hard clamp
                block.log_scale_min_clip, block.log_scale_max_clip = -math.inf, math.inf
            blocks.append(block)
        self.blocks = nn.ModuleList(blocks)
        self.to(device=loc.device, dtype=loc.dtype)  # the flow computes in the weights' dtype

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The same parameters mean a different distribution in another layout: refuse.  (A
        # state dict without the layout is left for the strict load to report as incomplete.)
        key = prefix + "layout"
        if key in state_dict:
            saved = _layout_dict(state_dict[key])
            if saved != _layout_dict(self.layout) and self.num_flows > 0:
                raise ValueError(
                    f"this state dict was saved by a flow with layout {saved}, but this flow has "
                    f"{_layout_dict(self.layout)}; the same parameters define another distribution "
                    "there. Build the flow with the saved affine_last and log_scale_bound "
                    "(a Hypernet guide: layout='paper' for the paper's layout) to load it.")
            state_dict[key] = self.layout.clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def transforms(self) -> list:
        """The transforms ``[A, T_1, (Permute,) T_2, …]`` (RealNVP: a permutation before
        every coupling but the first); with ``affine_last`` the affine layer comes last."""
        out = []
        for i, block in enumerate(self.blocks):
            if self.flow == "realnvp" and i > 0:
                out.append(Permute(getattr(self, f"perm{i}")))
            out.append(block)
        if self.flow_index is not None and out:   # the blocks on their coordinates only
            out = [CoordinateSubset(out, self.flow_index)]
        return out + [self.affine] if self.affine_last else [self.affine] + out

    def base_dist(self) -> dist.TorchDistribution:
        """``N(0, I_D)`` on the flow's device."""
        zero = self.affine.loc.new_zeros(())
        return dist.Normal(zero, zero + 1).expand([self.dim]).to_event(1)

    def distribution(self) -> dist.TransformedDistribution:
        """``q(z)`` as a Pyro ``TransformedDistribution`` (sample, ``log_prob``)."""
        return dist.TransformedDistribution(self.base_dist(), self.transforms())

    def rsample_with_log_prob(self, num_samples: int = 1, eps: torch.Tensor | None = None):
        """Reparameterised samples and their log-density in one forward pass.

        Parameters
        ----------
        num_samples : int
            S, number of draws (ignored if ``eps`` is given).
        eps : Tensor, shape (S, D), optional
            Base noise; default ``N(0, I)`` draws.

        Returns
        -------
        z : Tensor, shape (S, D)
        log_q : Tensor, shape (S,)
        """
        if eps is None:
            # the draws and log-density of ``self.base_dist()`` (N(0, I): ``rsample`` is
            # ``0 + ε·1``, ``log_prob`` ``−(ε − 0)²/(2·1) − log 1 − log √(2π)`` summed), bit for
            # bit and from the same random stream, without building distributions every step
            loc = self.affine.loc
            eps = torch.empty((num_samples, self.dim), dtype=loc.dtype, device=loc.device).normal_()
            log_q = (-(eps ** 2) / 2.0 - _LOG_SQRT_2PI).sum(-1)
        else:
            log_q = self.base_dist().log_prob(eps)  # validates a given eps
        x = eps
        for t in self.transforms():
            x, log_det = _forward_with_log_det(t, x)
            log_q = log_q - log_det
        return x, log_q

    def extra_repr(self) -> str:
        return f"dim={self.dim}, flow={self.flow!r}, num_flows={self.num_flows}"


_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))   # the constant of torch's Normal.log_prob


def _forward_with_log_det(t, x):
    """``(t(x), log|det ∂t/∂x|)``.  The elementwise affine layer and IAF blocks are computed
    here with the same formulas as their Pyro ``_call`` / ``log_abs_det_jacobian``
    (``y = μ + exp(s) ⊙ x`` with Pyro's gradient-preserving clamp of s), without the
    transform-call and cache overhead; a :class:`CoordinateSubset` gathers its coordinates once
    for all its parts; other transforms go through Pyro."""
    if type(t) is CoordinateSubset:
        u, log_det = x.index_select(-1, t.index), 0.0
        for part in t.parts:
            u, part_log_det = _forward_with_log_det(part, u)
            log_det = log_det + part_log_det
        return x.index_copy(-1, t.index, u), log_det
    if type(t) is ElementwiseAffine:
        scale = t.scale
        return t.loc + scale * x, scale.log().sum(-1).expand(x.shape[:-1])
    if type(t) is AffineAutoregressive and not t.stable:
        mean, log_scale = t.arn(x)
        if t.log_scale_min_clip != -math.inf or t.log_scale_max_clip != math.inf:
            # (an unbounded clamp adds ``(s − s).detach() = 0``: the same values and gradients,
            # so the blocks whose MADE bounds s smoothly skip its four operations)
            log_scale = clamp_preserve_gradients(log_scale, t.log_scale_min_clip,
                                                 t.log_scale_max_clip)
        return torch.addcmul(mean, torch.exp(log_scale), x), log_scale.sum(-1)
    y = t(x)
    return y, t.log_abs_det_jacobian(x, y)


class CouplingNet(nn.Module):
    """Conditioner of a RealNVP coupling: ``x₁ (…, d) -> (mean, log_scale)``, each (…, D − d),
    one hidden ReLU layer of H units.

    ``pre_k = (1/n_k) Σ_j W'_kj x_j + b_k`` with ``n_k`` the layer's fan-in when
    ``fan_in_scaled`` (stored weights × fan-in; same function, Adam steps scaled as in
    :class:`~pyro_bnn.guides.made.MADE`), else ``n_k = 1``; log-scales bounded smoothly by
    ``log_scale_bound`` (if given).  Initialised as ``nn.Linear`` layers.
    """

    def __init__(self, in_features: int, hidden: int, out_features: int,
                 log_scale_bound: float | None = 3.0, fan_in_scaled: bool = True):
        super().__init__()
        self.hidden, self.out = nn.Linear(in_features, hidden), nn.Linear(hidden, 2 * out_features)
        self.log_scale_bound = log_scale_bound
        self.in_factor = 1.0 / in_features if fan_in_scaled else 1.0
        self.out_factor = 1.0 / hidden if fan_in_scaled else 1.0
        with torch.no_grad():
            self.hidden.weight.div_(self.in_factor)
            self.out.weight.div_(self.out_factor)

    def forward(self, x):
        h = torch.addmm(self.hidden.bias, x.reshape(-1, x.shape[-1]), self.hidden.weight.t(),
                        alpha=self.in_factor).relu()
        y = torch.addmm(self.out.bias, h, self.out.weight.t(), alpha=self.out_factor)
        mean, log_scale = y.view(*x.shape[:-1], -1).chunk(2, -1)
        if self.log_scale_bound is not None:
            log_scale = soft_bound(log_scale, self.log_scale_bound)
        return mean, log_scale

    @torch.no_grad()
    def scale_output_(self, gain: float) -> CouplingNet:
        """Multiply the output layer's weights by ``gain`` and zero its bias."""
        self.out.weight.mul_(gain)
        self.out.bias.zero_()
        return self


def _check_flow_index(index, dim: int, affine_last: bool) -> torch.Tensor | None:
    """``index`` as distinct int64 coordinates in [0, dim), ``None`` for "all of them"."""
    if index is None:
        return None
    index = torch.as_tensor(index)
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"flow_index must be a 1-D integer tensor, got dtype {index.dtype}, shape {tuple(index.shape)}")
    index = index.to(torch.int64)
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= dim or len(index.unique()) != len(index)):
        raise ValueError(f"flow_index must hold distinct coordinates in [0, {dim}), got {len(index)} values "
                         f"in [{int(index.min())}, {int(index.max())}]")
    if len(index) == dim:
        return None if bool((index == torch.arange(dim)).all()) else index
    if not affine_last:
        raise ValueError("flow_index (blocks on part of the coordinates) needs affine_last=True")
    return index


def _layout_code(affine_last: bool, log_scale_bound: float | None) -> torch.Tensor:
    """The layout as a buffer: ``[affine_last, log_scale_bound or 0]``."""
    return torch.tensor([float(affine_last), log_scale_bound or 0.0])


def _layout_dict(code: torch.Tensor) -> dict:
    last, bound = (float(v) for v in code.detach().cpu().reshape(-1))
    return {"affine_last": bool(last), "log_scale_bound": bound or None}


def _permutation(dim: int, index: int, gen: torch.Generator) -> torch.Tensor:
    """Fixed permutation of block ``index``: identity for the first, then reversal for
    D = 2 and seeded random permutations otherwise."""
    if index == 0:
        return torch.arange(dim)
    if dim <= 2:
        return torch.arange(dim).flip(0)
    return torch.randperm(dim, generator=gen)


def hypernet_flow(dim: int, flow: str = "iaf", num_flows: int = 8, hidden: int = 200,
                  **kwargs) -> HypernetFlow:
    """Factory for :class:`HypernetFlow` (Pyro's ``affine_autoregressive`` style)."""
    return HypernetFlow(dim, flow, num_flows, hidden, **kwargs)

