"""The Laplace posterior N(θ*, P⁻¹): its joint draws with the linearised network
(:class:`LinearizedSamples`), and a Pyro distribution over the flat vector of the guide's
sites (what the guide samples and scores in its trace)."""

from __future__ import annotations

import math
from typing import NamedTuple

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from ...curvature import DenseBlock, DiagBlock, KronBlock, SplitBiasKronBlock, UnitBlock

__all__ = ["LaplacePosterior", "LinearizedSamples"]




class LinearizedSamples(NamedTuple):
    """Joint draws ``θ_s ~ N(θ*, P⁻¹)`` and the linearised network at given inputs.

    ``values``: ``{site: (S, *shape)}`` (point-estimate sites repeat θ*); ``f``: ``(S, N, C)``
    ``f_lin(x_n; θ_s) = f(x_n; θ*) + J_n (θ_s − θ*)``; ``log_q``: ``(S,)`` ``log N(θ_s | θ*, P⁻¹)``
    over the Laplace sites; ``log_prior``: ``(S,)`` the Gaussian prior with the guide's δ at
    the Laplace sites plus the fixed model prior of the point-estimate sites.
    """

    values: dict
    f: torch.Tensor
    log_q: torch.Tensor
    log_prior: torch.Tensor


class LaplacePosterior(dist.TorchDistribution):
    """``N(θ*, P⁻¹)`` over the flat Laplace weights (layers' ``W̃`` in order), from the guide's
    blocks: ``log_prob`` is the exact Gaussian density, ``rsample`` is ``θ* + P^{-1/2} ε``."""

    arg_constraints = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, guide, theta_star: dict):
        self.guide, self.layers = guide, guide.layers
        self.loc = torch.cat([layer.flatten(theta_star).reshape(-1) for layer in self.layers])
        super().__init__(event_shape=self.loc.shape, validate_args=False)

    def rsample(self, sample_shape=torch.Size()):  # noqa: B008 (torch.Size() is immutable)
        num = int(math.prod(sample_shape)) if len(sample_shape) else 1
        return self.draws(num).reshape(*sample_shape, -1)

    def draws(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``num`` flat draws ``(num, P)`` of ``θ* + P^{-1/2} ε``, with ``ε`` from ``generator``
        (default: the global random stream)."""
        offsets, _ = self.guide._draw_offsets(num, generator=generator)
        return self.loc + torch.cat([o.reshape(num, -1) for o in offsets], -1)

    def unpack(self, flat: torch.Tensor) -> dict:
        """Site values of flat draws ``(..., P)``, keeping the leading dimensions (the draws'
        plates: ``Predictive(parallel=True)``, vectorised particles)."""
        values, start = {}, 0
        for layer in self.layers:
            part = flat[..., start:start + layer.numel]
            values.update(layer.unflatten_flat(part, self.guide.site_shapes))
            start += layer.numel
        return values

    def log_prob(self, value):
        guide = self.guide
        theta, deltas = guide._block_inputs()
        _, _, scale = guide._kind_and_scale()
        v = value - self.loc
        if guide.structure == "full":
            parts = [v]
        else:
            parts = list(v.split([layer.numel for layer in self.layers], -1))
        total = 0.0
        for block, d, part in zip(guide.posterior.blocks, deltas, parts):
            quad = _precision_quadratic(block, part, d, scale)
            total = total - 0.5 * quad + 0.5 * block.logdet(d, scale) \
                - 0.5 * part.shape[-1] * math.log(2 * math.pi)
        return total


def _precision_quadratic(block, v: torch.Tensor, delta, scale) -> torch.Tensor:
    """``vᵀ P v`` with ``P = s H + diag(δ)`` of one block, ``v`` of shape ``(..., numel)``."""
    prior = (delta * v ** 2).sum(-1)
    if isinstance(block, DenseBlock):
        return scale * torch.einsum("...i,ij,...j->...", v, block.H, v) + prior
    if isinstance(block, DiagBlock):
        return scale * (block.h.reshape(-1) * v ** 2).sum(-1) + prior
    V = v.reshape(*v.shape[:-1], *block.shape)
    if isinstance(block, UnitBlock):
        return scale * torch.einsum("...ci,cij,...cj->...", V, block.U, V) + prior
    if isinstance(block, SplitBiasKronBlock):
        A = block.A.clone()
        A[:-1, -1] = 0
        A[-1, :-1] = 0
    elif isinstance(block, KronBlock):
        A = block.A
    else:
        raise TypeError(f"unknown curvature block {type(block).__name__}")
    return scale * (V * (block.G @ V @ A)).sum((-2, -1)) + prior
