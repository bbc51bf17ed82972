"""Normalizing flows for Bayesian hypernetworks (Krueger, Huang et al. 2017), on Pyro transforms.

A sample of the D weights is ``z = h(ε)``, ``ε ~ N(0, I_D)``, with

    h = T_K ∘ … ∘ T_1 ∘ A,      A(ε) = μ + softplus(ρ) ⊙ ε,

an elementwise affine layer ``A`` (initial scale ``init_scale`` ≈ 0.002, the paper's choice:
the flow starts as a narrow Gaussian around the network's weights) followed by K blocks,
either IAF/MADE blocks (Pyro's :class:`~pyro.distributions.transforms.AffineAutoregressive`,
``y = μ(x) + exp(s(x)) ⊙ x`` with autoregressive μ, s) or RealNVP couplings (Pyro's
:func:`~pyro.distributions.transforms.affine_coupling`) separated by fixed permutations
(Pyro's :class:`~pyro.distributions.transforms.Permute`).  The log-density is the change of
variables

    log q(z) = log N(ε; 0, I) − Σ_t log|det ∂T_t/∂x_{t−1}| − Σ_i log softplus(ρ_i).

Each block's output layer starts at ``init_gain`` × its default initialisation (bias 0), so
every block starts near the identity.  ``num_flows=0`` is the mean-field Gaussian (Bayes by
Backprop).

Pyro's ``AutoRegressiveNN`` requires hidden width ≥ D; :class:`MADE` here allows any width
(hidden degrees spread over 1..D−1, Germain et al. 2015), which the hypernetwork needs
(D = hundreds of weight-norm scales, 200 hidden units).
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.distributions.torch_transform import TransformModule
from pyro.distributions.transforms import AffineAutoregressive, Permute, affine_coupling
from pyro.distributions.transforms.utils import clamp_preserve_gradients
from torch import nn

from .made import MADE

__all__ = ["ElementwiseAffine", "MADE", "HypernetFlow", "hypernet_flow", "FLOW_TYPES"]

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

    def _call(self, x):
        return self.loc + self.scale * x

    def _inverse(self, y):
        return (y - self.loc) / self.scale

    def log_abs_det_jacobian(self, x, y):
        return self.scale.log().sum(-1).expand(x.shape[:-1])


class HypernetFlow(nn.Module):
    """The hypernetwork ``z = h(ε)``: elementwise affine, then K IAF blocks or couplings.

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
        Initial scale of the affine layer.
    init_gain : float
        Factor on the blocks' output-layer initial weights (near-identity start).
    seed : int
        Seed of the fixed permutations.
    affine_last : bool
        Put the affine layer after the blocks (``z = μ + s ⊙ T(ε)``: the blocks then act
        on standardised coordinates); default ``False``, the paper's order.
    """

    def __init__(self, dim: int, flow: str = "iaf", num_flows: int = 8, hidden: int = 200,
                 init_loc: torch.Tensor | None = None, init_scale: float = 2e-3,
                 init_gain: float = 1e-2, seed: int = 0, affine_last: bool = False):
        super().__init__()
        self.affine_last = bool(affine_last)
        if flow not in FLOW_TYPES:
            raise ValueError(f"flow must be one of {FLOW_TYPES}, got {flow!r}")
        if not isinstance(num_flows, int) or num_flows < 0:
            raise ValueError(f"num_flows must be an integer >= 0, got {num_flows!r}")
        if num_flows > 0 and dim < 2:
            raise ValueError(f"flow blocks need at least 2 latent dimensions, got {dim}; "
                             "use num_flows=0")
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be a positive integer, got {hidden!r}")
        self.dim, self.flow, self.num_flows = int(dim), flow, num_flows
        loc = torch.zeros(dim) if init_loc is None else init_loc.detach().reshape(-1)
        if loc.numel() != dim:
            raise ValueError(f"init_loc must have {dim} values, got {loc.numel()}")
        self.affine = ElementwiseAffine(loc, init_scale)
        gen = torch.Generator().manual_seed(seed)
        perms = [_permutation(dim, i, gen) for i in range(num_flows)]
        blocks = []
        for i in range(num_flows):
            if flow == "iaf":
                block = AffineAutoregressive(MADE(dim, hidden, perms[i]))
                block.arn.scale_output_(init_gain)
            else:
                block = affine_coupling(dim, hidden_dims=[hidden])
                last = block.nn.layers[-1]
                self.register_buffer(f"perm{i}", perms[i])
                with torch.no_grad():
                    last.weight.mul_(init_gain)
                    last.bias.zero_()
            blocks.append(block)
        self.blocks = nn.ModuleList(blocks).to(loc.device)
        self.to(loc.device)

    def transforms(self) -> list:
        """The transforms ``[A, T_1, (Permute,) T_2, …]`` (RealNVP: a permutation before
        every coupling but the first); with ``affine_last`` the affine layer comes last."""
        out = []
        for i, block in enumerate(self.blocks):
            if self.flow == "realnvp" and i > 0:
                out.append(Permute(getattr(self, f"perm{i}")))
            out.append(block)
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
        base = self.base_dist()
        if eps is None:
            eps = base.rsample(torch.Size([num_samples]))
        log_q = base.log_prob(eps)
        x = eps
        for t in self.transforms():
            x, log_det = _forward_with_log_det(t, x)
            log_q = log_q - log_det
        return x, log_q

    def extra_repr(self) -> str:
        return f"dim={self.dim}, flow={self.flow!r}, num_flows={self.num_flows}"


def _forward_with_log_det(t, x):
    """``(t(x), log|det ∂t/∂x|)``.  The elementwise affine layer and IAF blocks are computed
    here with the same formulas as their Pyro ``_call`` / ``log_abs_det_jacobian``
    (``y = μ + exp(s) ⊙ x`` with Pyro's gradient-preserving clamp of s), without the
    transform-call and cache overhead; other transforms go through Pyro."""
    if type(t) is ElementwiseAffine:
        scale = t.scale
        return t.loc + scale * x, scale.log().sum(-1).expand(x.shape[:-1])
    if type(t) is AffineAutoregressive and not t.stable:
        mean, log_scale = t.arn(x)
        log_scale = clamp_preserve_gradients(log_scale, t.log_scale_min_clip,
                                             t.log_scale_max_clip)
        return torch.addcmul(mean, torch.exp(log_scale), x), log_scale.sum(-1)
    y = t(x)
    return y, t.log_abs_det_jacobian(x, y)


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

