"""Learnable augmentation distributions ``p(T | η)`` for invariant models (LILA).

An invariant model averages the network over ``S`` transformed copies of each input,
``f̂(x) = (1/S) Σ_s f(T_s x)``, ``T_s ~ p(T | η)``.  The transforms are reparameterised,
so ``f̂`` is differentiable in the extents ``η`` (Immer, van der Ouderaa et al. 2022).

2D affine family (six generators, coordinates normalised to [−1, 1])::

    u_k ~ U[−1, 1],   M = Σ_k u_k η_k G_k,   A = matrix_exp(M),   x' = grid_sample(x, A[:2])

with ``G`` = x-translation, y-translation, rotation, x-scale, y-scale, shear.  The
rotation coefficient is limited to ``±π`` (full rotation invariance is ``η_rot = π``).
Because ``u`` is symmetric, only ``|η|`` matters; :attr:`AffineAugmentation.extent`
reports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AffineAugmentation", "Affine1dAugmentation", "GENERATORS", "GENERATORS_1D",
           "affine_generators", "affine_matrices", "apply_affine", "infer_image_shape"]

#: Names of the six 2D generators, in the order of ``η``.
GENERATORS: tuple[str, ...] = ("tx", "ty", "rot", "sx", "sy", "shear")
#: Names of the 1D generators (sequences): translation and scale.
GENERATORS_1D: tuple[str, ...] = ("t", "s")

_ROT = GENERATORS.index("rot")


def affine_generators(dtype=torch.float32, device=None) -> torch.Tensor:
    """The six 3×3 Lie-algebra generators ``G_k`` of 2D affine maps, shape ``(6, 3, 3)``.

    Homogeneous coordinates ``(x, y, 1)``; order ``tx, ty, rot, sx, sy, shear``.
    """
    g = torch.zeros(6, 3, 3, dtype=dtype, device=device)
    g[0, 0, 2] = 1.0                  # x-translation
    g[1, 1, 2] = 1.0                  # y-translation
    g[2, 0, 1], g[2, 1, 0] = -1.0, 1.0  # rotation
    g[3, 0, 0] = 1.0                  # x-scale
    g[4, 1, 1] = 1.0                  # y-scale
    g[5, 0, 1], g[5, 1, 0] = 1.0, 1.0  # shear
    return g


def affine_matrices(u: torch.Tensor, coefficients: torch.Tensor,
                    generators: torch.Tensor) -> torch.Tensor:
    """``A = matrix_exp(Σ_k u_k η_k G_k)``.

    Parameters
    ----------
    u : Tensor, shape (..., K)
        Standardised draws, ``U[−1, 1]`` for the augmentation distribution.
    coefficients : Tensor, shape (K,)
        Extents ``η`` (rotation already limited to ``±π``).
    generators : Tensor, shape (K, D, D)

    Returns
    -------
    Tensor, shape (..., D, D)
        Differentiable in ``u`` and ``coefficients``.
    """
    m = torch.einsum("...k,kij->...ij", u * coefficients, generators)
    return torch.linalg.matrix_exp(m)


def apply_affine(images: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """Resample ``images`` (B, C, H, W) at ``A (x, y, 1)ᵀ`` for each ``A`` in ``matrices``.

    Bilinear ``grid_sample`` with zero padding and ``align_corners=True`` (pixel centres
    at ±1), so the identity map returns the images exactly.  ``matrices``: (B, 3, 3).
    """
    theta = matrices[:, :2, :].to(images.dtype)
    grid = F.affine_grid(theta, list(images.shape), align_corners=True)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=True)


def infer_image_shape(num_features: int) -> tuple[int, int, int]:
    """``(1, H, W)`` of a flat square grey image: 64 → (1, 8, 8), 784 → (1, 28, 28)."""
    side = math.isqrt(int(num_features))
    if side * side != num_features:
        raise ValueError(f"cannot infer an image shape for {num_features} features (not a square); "
                         "pass image_shape=(C, H, W)")
    return (1, side, side)


class _Augmentation(nn.Module):
    """Shared machinery: learnable extents, copying inputs ``S`` times, freezing."""

    names: tuple[str, ...] = ()

    def __init__(self, num_samples: int, init_extent, generators, learnable: bool):
        super().__init__()
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        self.num_samples = num_samples
        active = self.names if generators is None else tuple(generators)
        unknown = set(active) - set(self.names)
        if unknown:
            raise ValueError(f"unknown generators {sorted(unknown)}; expected a subset of {self.names}")
        k = len(self.names)
        if isinstance(init_extent, (int, float)):
            init = torch.full((k,), float(init_extent))
        else:
            init = torch.as_tensor(init_extent, dtype=torch.float32).flatten()
            if init.numel() != k:
                raise ValueError(f"init_extent must be a float or {k} values, got {init.numel()}")
        mask = torch.tensor([n in active for n in self.names], dtype=torch.float32)
        # η is a model parameter but frozen by default: plain SVI/MAP training must not move
        # it by the likelihood gradient. Invariance learning switches it on for its own steps.
        self.eta = nn.Parameter(init * mask, requires_grad=False)
        self.register_buffer("mask", mask, persistent=False)
        self.learnable = bool(learnable)

    @property
    def extent(self) -> torch.Tensor:
        """Current extents ``|η|`` (detached), one per generator, in :attr:`names` order."""
        return self.coefficients().detach().abs()

    def coefficients(self) -> torch.Tensor:
        """The ``η`` used in ``Σ u_k η_k G_k`` (inactive generators zeroed)."""
        return self.eta * self.mask

    def is_identity(self) -> bool:
        """True when the transform is the identity and η gets no gradient (fast path)."""
        return (not self.eta.requires_grad) and bool((self.eta * self.mask == 0).all())

    def sample_noise(self, n: int, device=None, dtype=None) -> torch.Tensor:
        """Standardised draws ``u ~ U[−1, 1]``, shape ``(n, S, K)``."""
        return 2.0 * torch.rand(n, self.num_samples, len(self.names), device=device,
                                dtype=dtype or self.eta.dtype) - 1.0

    def extra_repr(self) -> str:
        ext = ", ".join(f"{n}={v:.3g}" for n, v in zip(self.names, self.extent.tolist()))
        return f"num_samples={self.num_samples}, extent=({ext})"


class AffineAugmentation(_Augmentation):
    """Learnable 2D affine augmentation distribution (six generators).

    ``forward(x)`` returns ``S`` transformed copies of every input, flattened example-major:
    row ``n·S + s`` is ``T_{n,s} x_n`` — the model averages the network outputs over ``s``.

    Parameters
    ----------
    num_samples : int
        Copies ``S`` per input (31 on MNIST in the paper).
    init_extent : float or sequence of 6 floats
        Initial ``η`` (0: identity).
    generators : sequence of str, optional
        Subset of ``("tx", "ty", "rot", "sx", "sy", "shear")`` to use; default all six.
    image_shape : (C, H, W), optional
        Shape of flat inputs ``(N, C·H·W)``; default inferred for square grey images
        (digits 64 → 1×8×8, MNIST 784 → 1×28×28).  Image inputs ``(N, C, H, W)`` need none.
    learnable : bool
        Whether invariance learning may train ``η`` (False: fixed augmentation).

    Examples
    --------
    >>> aug = AffineAugmentation(num_samples=8, init_extent=[0, 0, math.pi, 0, 0, 0])
    >>> aug(torch.rand(5, 1, 8, 8)).shape
    torch.Size([40, 1, 8, 8])
    """

    names = GENERATORS

    def __init__(self, num_samples: int = 31, init_extent: float | Sequence[float] = 0.0,
                 generators: Sequence[str] | None = None,
                 image_shape: tuple[int, int, int] | None = None, learnable: bool = True):
        super().__init__(num_samples, init_extent, generators, learnable)
        self.image_shape = None if image_shape is None else tuple(int(s) for s in image_shape)
        self.register_buffer("generators", affine_generators(), persistent=False)

    def coefficients(self) -> torch.Tensor:
        eta = self.eta * self.mask
        # Rotation beyond ±π repeats itself: limit it (the sign of η is irrelevant).
        rot = eta[_ROT].clamp(-math.pi, math.pi)
        return torch.cat([eta[:_ROT], rot.reshape(1), eta[_ROT + 1:]])

    def matrices(self, u: torch.Tensor) -> torch.Tensor:
        """Affine matrices ``(…, 3, 3)`` for standardised draws ``u`` of shape ``(…, 6)``."""
        return affine_matrices(u, self.coefficients(), self.generators.to(u.dtype))

    def forward(self, x: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """``S`` transformed copies of each input.

        Parameters
        ----------
        x : Tensor, shape (N, C, H, W) or (N, D)
        u : Tensor, shape (N, S, 6), optional
            Standardised draws; default fresh ``U[−1, 1]``.

        Returns
        -------
        Tensor, shape (N·S, C, H, W) or (N·S, D)
        """
        flat = x.dim() == 2
        if flat:
            shape = self.image_shape or infer_image_shape(x.shape[1])
            if math.prod(shape) != x.shape[1]:
                raise ValueError(f"image_shape {shape} does not match {x.shape[1]} input features")
            img = x.reshape(len(x), *shape)
        elif x.dim() == 4:
            img = x
        else:
            raise ValueError(f"expected inputs of shape (N, C, H, W) or (N, D), got {tuple(x.shape)}")
        s = self.num_samples
        if u is None and self.is_identity():
            out = img.repeat_interleave(s, dim=0) if s > 1 else img
        else:
            if u is None:
                u = self.sample_noise(len(x), device=x.device, dtype=self.eta.dtype)
            if u.shape != (len(x), s, 6):
                raise ValueError(f"u must have shape {(len(x), s, 6)}, got {tuple(u.shape)}")
            a = self.matrices(u).reshape(-1, 3, 3)
            out = apply_affine(img.repeat_interleave(s, dim=0), a)
        return out.reshape(len(out), -1) if flat else out


class Affine1dAugmentation(_Augmentation):
    """Learnable translation/scale augmentation of sequences ``(N, C, L)`` (or ``(N, L)``).

    ``u ~ U[−1, 1]²``, ``A = matrix_exp(u_t η_t G_t + u_s η_s G_s)`` on the normalised
    coordinate ``t ∈ [−1, 1]``, applied by linear interpolation (``grid_sample`` on a
    one-row image).  Output shape ``(N·S, C, L)`` (or ``(N·S, L)``), example-major.
    """

    names = GENERATORS_1D

    def __init__(self, num_samples: int = 31, init_extent: float | Sequence[float] = 0.0,
                 generators: Sequence[str] | None = None, learnable: bool = True):
        super().__init__(num_samples, init_extent, generators, learnable)
        g = torch.zeros(2, 2, 2)
        g[0, 0, 1] = 1.0   # translation
        g[1, 0, 0] = 1.0   # scale
        self.register_buffer("generators", g, persistent=False)

    def forward(self, x: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() not in (2, 3):
            raise ValueError(f"expected sequences of shape (N, C, L) or (N, L), got {tuple(x.shape)}")
        seq = x.unsqueeze(1) if x.dim() == 2 else x
        s = self.num_samples
        rep = seq.repeat_interleave(s, dim=0)
        if u is None and self.is_identity():
            out = rep
        else:
            if u is None:
                u = self.sample_noise(len(x), device=x.device, dtype=self.eta.dtype)
            a = affine_matrices(u, self.coefficients(), self.generators.to(u.dtype)).reshape(-1, 2, 2)
            length = seq.shape[-1]
            t = torch.linspace(-1.0, 1.0, length, device=x.device, dtype=a.dtype)
            src = a[:, 0, :1] * t + a[:, 0, 1:]                       # (N·S, L)
            grid = torch.stack([src, torch.zeros_like(src)], -1).unsqueeze(1).to(x.dtype)
            out = F.grid_sample(rep.unsqueeze(2), grid, mode="bilinear", padding_mode="zeros",
                                align_corners=True).squeeze(2)
        return out.squeeze(1) if x.dim() == 2 else out
