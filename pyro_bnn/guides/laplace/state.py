"""Keep a fitted Laplace curvature in buffers, so ``state_dict`` round-trips and ``.to`` moves it.

The raw curvature (KFAC factors ``A, G/N'`` per layer — per-channel blocks ``U`` for
BatchNorm's affine parameters —, the diagonal ``h`` per layer or the dense ``H``) and the log-likelihood statistics live in fixed-shape buffers of a plain
``nn.Module``; the eigendecomposed blocks are rebuilt from them on demand.
"""

from __future__ import annotations

import torch
from torch import nn

from ...contract.guide import GuideStateWarning
from ...curvature import CurvatureFit, DenseBlock, DiagBlock, KronBlock, SplitBiasKronBlock, UnitBlock

__all__ = ["CurvatureState", "StaleCurvatureWarning"]

_KINDS = ("categorical", "bernoulli", "gaussian")


class StaleCurvatureWarning(GuideStateWarning):
    """The Laplace guide's curvature is missing or was fitted at another θ (call
    ``guide.fit_curvature``)."""


class CurvatureState(nn.Module):
    """Buffers holding one :class:`~pyro_bnn.curvature.CurvatureFit` (or nothing yet)."""

    def __init__(self, layers, structure: str, split_bias: bool, gradient: bool, like: torch.Tensor):
        super().__init__()
        self.gradient = gradient
        self.structure, self.num_layers = structure, len(layers)
        self.split = [split_bias and layer.weight is not None and layer.bias is not None for layer in layers]
        z = lambda *shape: torch.zeros(shape, dtype=like.dtype, device=like.device)  # noqa: E731
        for name in ("fitted", "kind", "num_data", "loglik", "sse", "count", "noise"):
            self.register_buffer(name, z())
        self.unitwise = [layer.unitwise for layer in layers]
        if structure == "kron":
            for i, layer in enumerate(layers):
                if layer.unitwise:     # BatchNorm's affine parameters: one small block per channel
                    self.register_buffer(f"U{i}", z(layer.out_features, layer.in_dim, layer.in_dim))
                    continue
                self.register_buffer(f"A{i}", z(layer.in_dim, layer.in_dim))
                self.register_buffer(f"G{i}", z(layer.out_features, layer.out_features))
        elif structure == "diag":
            for i, layer in enumerate(layers):
                self.register_buffer(f"h{i}", z(*layer.shape))
        else:
            total = sum(layer.numel for layer in layers)
            self.register_buffer("H", z(total, total))
        if gradient:     # the log-likelihood gradient of Laplace(..., evidence="linearized")
            for i, layer in enumerate(layers):
                self.register_buffer(f"grad{i}", z(*layer.shape))

    @torch.no_grad()
    def store(self, fit: CurvatureFit | None, noise: torch.Tensor | None = None) -> None:
        """Copy ``fit`` into the buffers (``None`` marks the state as not fitted)."""
        self.fitted.fill_(0.0 if fit is None else 1.0)
        if fit is None:
            return
        self.kind.fill_(float(_KINDS.index(fit.kind)))
        self.num_data.fill_(float(fit.num_data))
        for key in ("loglik", "sse", "count"):
            if key in fit.loglik_stats:
                getattr(self, key).copy_(fit.loglik_stats[key])
        self.noise.fill_(0.0 if noise is None else float(noise))
        for i, block in enumerate(fit.blocks):
            if isinstance(block, (KronBlock, SplitBiasKronBlock)):
                getattr(self, f"A{i}").copy_(block.A)
                getattr(self, f"G{i}").copy_(block.G)
            elif isinstance(block, UnitBlock):
                getattr(self, f"U{i}").copy_(block.U)
            elif isinstance(block, DiagBlock):
                getattr(self, f"h{i}").copy_(block.h)
            else:
                self.H.copy_(block.H)
        if self.gradient:
            if fit.gradients is None:
                raise ValueError("this Laplace guide (evidence='linearized') needs the curvature's "
                                 "log-likelihood gradients: fit it with accumulate_curvature(..., gradient=True)")
            for i, grad in enumerate(fit.gradients):
                getattr(self, f"grad{i}").copy_(grad)

    def load(self) -> CurvatureFit | None:
        """Rebuild the fit (eigendecompositions included) from the buffers."""
        if not bool(self.fitted):
            return None
        kind = _KINDS[int(self.kind)]
        if self.structure == "kron":
            blocks = [UnitBlock(getattr(self, f"U{i}")) if self.unitwise[i]
                      else (SplitBiasKronBlock if self.split[i] else KronBlock)(getattr(self, f"A{i}"), getattr(self, f"G{i}"))
                      for i in range(self.num_layers)]
        elif self.structure == "diag":
            blocks = [DiagBlock(getattr(self, f"h{i}")) for i in range(self.num_layers)]
        else:
            blocks = [DenseBlock(self.H)]
        stats = {"sse": self.sse, "count": self.count} if kind == "gaussian" else {"loglik": self.loglik}
        gradients = [getattr(self, f"grad{i}") for i in range(self.num_layers)] if self.gradient else None
        return CurvatureFit(blocks, kind, stats, int(self.num_data), gradients)
