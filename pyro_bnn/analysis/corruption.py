"""Corruption curves: predictive uncertainty vs rotation angle and vs Gaussian noise level.

The talk repo's experiment: take a test set, corrupt every input by the same amount
(rotate by θ degrees, or add N(0, s²) pixel noise), and record the test-set mean of the
uncertainty scores (predictive entropy, mutual information, variation ratio, confidence)
and the accuracy at each level.  A Bayesian network should grow more uncertain as the
inputs leave the training distribution.

Images may be flat ``(N, H·W)`` vectors of square images (8×8 digits, 28×28 MNIST) or
``(N, C, H, W)`` tensors; flat inputs are returned flat.  The curves move ``x`` and ``y``
to the model's device, and their ``seed`` seeds the draws (and the noise pattern) without
touching the caller's random streams.

The curves take the test set as tensors ``x`` (and optionally ``y``) or as a ``DataLoader``
in place of ``x`` whose batches are ``x``, ``(x,)`` or ``(x, y)`` (with targets in every batch the
curve has ``accuracy``), read once, each batch checked as :func:`pyro_bnn.predict` checks a
loader's (:func:`pyro_bnn.data.prediction_data.read_loader`): the curve is that of its examples
as tensors, bit for bit at the same ``seed``.  A shuffled loader gives the same rotation curve
up to rounding (means over the examples); :func:`noise_curve`'s fixed noise pattern then falls
on other examples, another draw of the same curve.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data.prediction_data import prediction_data
from ..posterior import metrics
from ..posterior.draws import draw_latents, probs_from_latents
from ..posterior.prediction import predict_checked
from .tool_support import class_probabilities, seeded, to_model_device

__all__ = ["rotate", "gaussian_noise", "corruption_curve", "rotation_curve", "noise_curve"]


def _as_images(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    if x.dim() == 4:
        return x, x.shape
    if x.dim() == 2:
        side = int(round(math.sqrt(x.shape[1])))
        if side * side != x.shape[1]:
            raise ValueError(f"flat inputs must be square images (H·W features with H = W), "
                             f"got {x.shape[1]} features")
        return x.reshape(len(x), 1, side, side), x.shape
    raise ValueError(f"expected images (N, C, H, W) or flat square images (N, H·W), "
                     f"got shape {tuple(x.shape)}")


def rotate(x: torch.Tensor, angle: float, *, fill: float = 0.0) -> torch.Tensor:
    """Rotate images counter-clockwise (as displayed, row 0 on top) by ``angle`` degrees.

    Bilinear interpolation about the image centre (``affine_grid`` / ``grid_sample``,
    ``align_corners=False``); pixels coming from outside the image get ``fill``.  Multiples
    of 90° on square images are exact pixel permutations (equal to ``torch.rot90``).

    Parameters
    ----------
    x : Tensor, shape (N, C, H, W) or (N, H·W)
    angle : float
        Degrees, counter-clockwise.

    Returns
    -------
    Tensor
        Same shape as ``x``.
    """
    img, shape = _as_images(x)
    t = math.radians(float(angle))
    c, s = math.cos(t), math.sin(t)
    # Exact values at multiples of 90° so that those rotations are pixel permutations.
    c, s = (round(c) if abs(c - round(c)) < 1e-12 else c), (round(s) if abs(s - round(s)) < 1e-12 else s)
    # theta maps output to input coordinates (x right, y down); this sign convention turns
    # the picture counter-clockwise, matching torch.rot90(img, 1, (-2, -1)) at 90° (tested).
    theta = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=img.dtype, device=img.device)
    grid = F.affine_grid(theta.expand(len(img), 2, 3), list(img.shape), align_corners=False)
    out = F.grid_sample(img - fill, grid, mode="bilinear", padding_mode="zeros",
                        align_corners=False) + fill
    return out.reshape(shape)


def gaussian_noise(x: torch.Tensor, std: float, *, clamp: tuple[float, float] | None = (0.0, 1.0),
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``x + N(0, std²)`` noise, optionally clamped to the valid input range."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    device = x.device if generator is None else generator.device
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=device)
    out = x + std * noise.to(x.device)
    return out.clamp(*clamp) if clamp is not None else out


def _summary(probs, y):
    mean = probs.mean(0)
    res = {
        "entropy": float(metrics.predictive_entropy(probs).mean()),
        "mutual_information": float(metrics.mutual_information(probs).mean()),
        "variation_ratio": float(metrics.variation_ratio(probs).mean()),
        "max_prob": float(mean.max(-1).values.mean()),
    }
    if y is not None:
        res["accuracy"] = metrics.accuracy(mean, y.to(mean.device))
    return res


def corruption_curve(model, guide, x, y: torch.Tensor | None = None, *, transform, levels,
                     num_samples: int = 32, seed: int | None = 0, batch_size: int = 1024,
                     predictive: str = "sample") -> dict[str, list[float]]:
    """Mean uncertainty over ``x`` after ``transform(x, level)``, for each level.

    With ``predictive="sample"`` the posterior weight draws are fixed once (seeded), so the
    curve changes only through the inputs.  Any other ``predictive`` (e.g. a Laplace guide's
    linearised ``"glm"`` predictive) goes through ``guide.predict`` via
    :func:`pyro_bnn.predict`, seeded alike at every level (common random numbers where that
    predictive samples; ``seed=None`` gives up both).  (A deterministic predictive, e.g. GLM
    with the probit link, has one "draw": its mutual information and variation ratio are 0.)

    Parameters
    ----------
    model, guide
        Trained classification model and guide.
    x : Tensor, shape (N, ...), or DataLoader
        Test inputs, or a ``DataLoader`` of them (module docstring).
    y : Tensor, shape (N,), optional
        Labels of tensor ``x`` (adds ``accuracy``); not with a loader (its batches hold them).
    transform : callable
        ``transform(x, level) -> x'``, the corruption.
    levels : sequence of float
        Its levels.
    num_samples, seed, batch_size, predictive
        Posterior draws, their seed, inputs per forward pass, the predictive.

    Returns
    -------
    dict
        Lists over ``level``: ``entropy``, ``mutual_information``, ``variation_ratio``,
        ``max_prob`` and, with targets, ``accuracy``.

    Raises
    ------
    TypeError, ValueError
        ``x`` neither a tensor nor a ``DataLoader`` (naming what was received), ``y`` with a
        loader, a loader that yields no batch or batches of another structure (or targets in
        some batches only), inputs or labels the model cannot take.
    """
    x, y = _test_set(model, guide, x, y, "corruption_curve")
    return _curve(model, guide, x, y, transform, levels, num_samples, seed, batch_size, predictive)


def _test_set(model, guide, x, y, name: str):
    """``(x, y)`` checked (a loader read once; ``y`` where given or held by its batches), on the
    model's device."""
    x, y = prediction_data(model, x, y, where=f"pb.analysis.corruption.{name}", targets=None)
    return to_model_device(model, guide, x, y)


def _curve(model, guide, x, y, transform, levels, num_samples, seed, batch_size, predictive):
    """:func:`corruption_curve` on a checked test set."""
    if predictive == "sample":
        with seeded(seed):
            latents = draw_latents(model, guide, x, num_samples=num_samples)
    out: dict[str, list] = {"level": []}
    for level in levels:
        xt = transform(x, level)
        if predictive == "sample":
            probs = probs_from_latents(model, latents, xt, batch_size=batch_size)
        else:
            with seeded(seed):
                probs = predict_checked(model, guide, xt, num_samples=num_samples, batch_size=batch_size,
                                        predictive=predictive)
            if probs.dim() == 2:  # deterministic predictive (N, C)
                probs = probs.unsqueeze(0)
            probs = class_probabilities(model, guide, probs)
        out["level"].append(float(level))
        for k, v in _summary(probs, y).items():
            out.setdefault(k, []).append(v)
    return out


def rotation_curve(model, guide, x, y: torch.Tensor | None = None, *,
                   angles=tuple(range(0, 181, 15)), num_samples: int = 32, seed: int | None = 0,
                   batch_size: int = 1024, predictive: str = "sample") -> dict[str, list[float]]:
    """:func:`corruption_curve` over rotation ``angles`` (degrees); key ``angle`` added.
    ``x``: tensors or a ``DataLoader`` (module docstring)."""
    x, y = _test_set(model, guide, x, y, "rotation_curve")
    out = _curve(model, guide, x, y, rotate, angles, num_samples, seed, batch_size, predictive)
    out["angle"] = out["level"]
    return out


def noise_curve(model, guide, x, y: torch.Tensor | None = None, *,
                stds=(0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0), num_samples: int = 32, seed: int | None = 0,
                clamp: tuple[float, float] | None = (0.0, 1.0), batch_size: int = 1024,
                predictive: str = "sample") -> dict[str, list[float]]:
    """:func:`corruption_curve` over Gaussian noise ``stds``; key ``std`` added.

    The noise pattern is the same at every level (one seeded standard-normal draw, scaled).
    ``x``: tensors or a ``DataLoader`` (module docstring; a shuffled loader puts the pattern on
    other examples).
    """
    x, y = _test_set(model, guide, x, y, "noise_curve")
    with seeded(seed):
        base = torch.randn(x.shape).to(x.device, x.dtype)

    def transform(x_, s):
        out = x_ + float(s) * base
        return out.clamp(*clamp) if clamp is not None else out

    out = _curve(model, guide, x, y, transform, stds, num_samples, seed, batch_size, predictive)
    out["std"] = out["level"]
    return out
