"""Deprecated: the first invariance-learning API (factor lists and eigen forms).

Invariance learning now runs on :mod:`pyro_bnn.curvature` and :mod:`pyro_bnn.marglik`
(:mod:`pyro_bnn.invariance.evidence`).  The names below keep working for user code and
delegate to that one implementation; each call warns with a ``DeprecationWarning``.  They
keep their old conventions: factors are *sums* over the batch and a Gaussian likelihood's
``G`` carries ``1/σ²`` (the library's convention is ``Λ = I`` with ``s = 1/σ²`` outside).

=============================  =================================================================
old                            new
=============================  =================================================================
``invariant_kfac_factors``     :func:`pyro_bnn.curvature.kfac.batch_kfac_factors` (``num_augmentations=S``)
``accumulate_factors``         :func:`pyro_bnn.invariance.evidence.invariant_curvature`
``eigen_factors``/``KronEigen``  :class:`pyro_bnn.curvature.structures.KronBlock`
``log_evidence``               :func:`pyro_bnn.marglik.log_evidence` (``evidence.log_evidence_at``)
``batch_surrogate``            :func:`pyro_bnn.invariance.evidence.eta_surrogate`
``kfac_layers``                :func:`pyro_bnn.curvature.layers.find_layers`
=============================  =================================================================
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import marglik as ml
from ..curvature import KronBlock, batch_kfac_factors, find_layers
from ..curvature.kfac import differentiable_hessian_columns

__all__ = ["LayerFactors", "kfac_layers", "likelihood_hessian_factor", "invariant_kfac_factors",
           "KronEigen", "eigen_factors", "log_det_posterior", "log_evidence", "batch_surrogate",
           "accumulate_factors"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"pyro_bnn.invariance: {old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


@dataclass
class LayerFactors:
    """Kronecker factor *sums* of one layer (``A``: inputs, ``G``: output gradients)."""

    weight: str
    bias: str | None
    A: torch.Tensor
    G: torch.Tensor
    positions: int

    @property
    def num_params(self) -> int:
        return self.A.shape[0] * self.G.shape[0]


@dataclass
class KronEigen:
    """Eigen form of ``G ⊗ A · scale`` (``scale = 1/(N T)``)."""

    qa: torch.Tensor
    la: torch.Tensor
    qg: torch.Tensor
    lg: torch.Tensor
    scale: float

    def eigenvalues(self) -> torch.Tensor:
        return self.lg[:, None] * self.la[None, :] * self.scale


def _layers(model):
    return find_layers(model, {s: None for s in model.site_names})


def _kind_scale(model, f):
    from .evidence import likelihood_scale
    return likelihood_scale(model, {}, f)[:2]


def kfac_layers(model) -> list:
    """``(path in model.net, module, weight_site, bias_site)`` per layer (deprecated)."""
    _deprecated("kfac_layers", "pyro_bnn.curvature.find_layers")
    return [(layer.path.removeprefix("net").removeprefix("."), layer.module, layer.weight, layer.bias)
            for layer in _layers(model)]


def likelihood_hessian_factor(likelihood, f: torch.Tensor) -> torch.Tensor:
    """``L`` with ``L Lᵀ = Λ`` (Gaussian: ``I/σ``), shape ``(N, C, C)`` (deprecated)."""
    _deprecated("likelihood_hessian_factor", "pyro_bnn.curvature.network.hessian_columns")
    name = getattr(likelihood, "name", None)
    if name not in ("categorical", "gaussian", "bernoulli"):
        raise ValueError(f"KFAC needs a categorical, gaussian or bernoulli likelihood, got {name!r}")
    cols = differentiable_hessian_columns(name, f)
    return cols / likelihood.noise.to(f) if name == "gaussian" else cols


def _factors(model, values, x, create_graph):
    from .evidence import num_augmentations
    values = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in values.items()}
    layers = find_layers(model, {k: v.shape for k, v in values.items()})
    kind, scale = _kind_scale(model, x)
    f, sums = batch_kfac_factors(layers, lambda: model.run_with(values, x), kind,
                                 num_augmentations=num_augmentations(model), create_graph=create_graph)
    out = [LayerFactors(layer.weight, layer.bias, sums[layer.path]["A"], sums[layer.path]["G"] * scale,
                        int(round(float(sums[layer.path]["count"]))) // len(x)) for layer in layers]
    return out, f


def invariant_kfac_factors(model, values: dict, x: torch.Tensor, *, create_graph: bool = False):
    """Augmentation-averaged KFAC factor sums of one batch and ``f̂(x)`` (deprecated)."""
    _deprecated("invariant_kfac_factors", "pyro_bnn.curvature.batch_kfac_factors(num_augmentations=S)")
    return _factors(model, values, x, create_graph)


def accumulate_factors(model, values: dict, batches, *, seeds=None) -> list[LayerFactors]:
    """Sum the factors over ``batches``, batch ``i`` drawn under ``seeds[i]`` (deprecated)."""
    from .evidence import seeded_draws
    _deprecated("accumulate_factors", "pyro_bnn.invariance.evidence.invariant_curvature")
    total = None
    for i, (x, _) in enumerate(batches):
        with seeded_draws(None if seeds is None else seeds[i], x.device):
            facs, _ = _factors(model, values, x, False)
        if total is not None:
            for t, f in zip(total, facs):
                f.A, f.G = t.A + f.A, t.G + f.G
        total = facs
    if total is None:
        raise ValueError("no batches given")
    return total


def eigen_factors(factors: list[LayerFactors], num_data: int) -> list[KronEigen]:
    """Eigendecompositions of every layer's factors, eigenvalues clamped at 0 (deprecated)."""
    _deprecated("eigen_factors", "pyro_bnn.curvature.KronBlock")
    out = []
    for fac in factors:
        block = KronBlock(fac.A.detach(), fac.G.detach())
        out.append(KronEigen(block.QA, block.lA, block.QG, block.lG, 1.0 / (num_data * fac.positions)))
    return out


class _EigenBlock:
    """A :class:`KronEigen` seen as a block of :func:`pyro_bnn.marglik.log_evidence`."""

    def __init__(self, eig: KronEigen):
        self.eig = eig

    def logdet(self, delta, scale=1.0):
        return torch.log(scale * self.eig.eigenvalues() + delta).sum()


def log_det_posterior(eig: list[KronEigen], prior_precision: torch.Tensor) -> torch.Tensor:
    """``Σ_l log det(H_l + δ_l I)`` (deprecated)."""
    _deprecated("log_det_posterior", "KronBlock.logdet")
    return sum(_EigenBlock(e).logdet(d) for e, d in zip(eig, prior_precision))


def _theta(values, fac):
    parts = [values[fac.weight].detach().reshape(-1)]
    if fac.bias is not None:
        parts.append(values[fac.bias].detach().reshape(-1))
    return torch.cat(parts)


def log_evidence(log_lik: torch.Tensor, values: dict, factors: list[LayerFactors],
                 eig: list[KronEigen], prior_precision: torch.Tensor) -> torch.Tensor:
    """Laplace-KFAC log evidence, a total (deprecated: :func:`pyro_bnn.marglik.log_evidence`)."""
    _deprecated("log_evidence", "pyro_bnn.marglik.log_evidence")
    return ml.log_evidence(log_lik, [_EigenBlock(e) for e in eig], [_theta(values, f) for f in factors],
                           list(prior_precision))


def batch_surrogate(model, values: dict, x: torch.Tensor, y: torch.Tensor,
                    factors: list[LayerFactors], eig: list[KronEigen],
                    prior_precision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's η-surrogate of the evidence (deprecated: ``evidence.eta_surrogate``)."""
    from .evidence import eta_surrogate
    _deprecated("batch_surrogate", "pyro_bnn.invariance.evidence.eta_surrogate")
    values = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in values.items()}
    layers = find_layers(model, {k: v.shape for k, v in values.items()})
    _, scale = _kind_scale(model, x)
    # back to the library's convention: G without 1/σ², normalised by N·T
    blocks = [KronBlock(f.A.detach(), f.G.detach() * e.scale / scale) for f, e in zip(factors, eig)]
    num_data = int(round(1.0 / (eig[0].scale * factors[0].positions)))
    return eta_surrogate(model, values, x, y, layers, blocks, list(prior_precision), num_data)
