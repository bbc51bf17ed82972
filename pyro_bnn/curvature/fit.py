"""Accumulate curvature over a data loader; the single point where sums are finalised.

``accumulate_curvature`` runs :func:`~pyro_bnn.curvature.layers.capture_factors` batch by
batch, adds up the per-batch sums (KFAC factors, diagonal or full GGN, log-likelihood
statistics, N) and then — optionally after ``reduce_fn`` (e.g. an all-reduce across
ranks: it receives and returns a flat ``{name: tensor}`` of *sums*) — turns them into
posterior-precision blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..data.batches import BatchCheck, as_targets, split_batch
from ..model.likelihoods import make_likelihood
from .ggn import diag_blocks, diag_ggn_sums, full_block, full_ggn_sum
from .kfac import kfac_blocks, kfac_sums_from_factors
from .layers import Layer, capture_factors
from .network import hessian_columns, log_likelihood_terms, nll_residual

__all__ = ["CurvatureFit", "accumulate_curvature", "STRUCTURES"]

STRUCTURES = ("kron", "diag", "full")


@dataclass
class CurvatureFit:
    """Result of :func:`accumulate_curvature`.

    Attributes
    ----------
    blocks : list
        ``KronBlock``/``DiagBlock`` per layer, or one ``DenseBlock``.
    kind : str
        Likelihood kind the curvature was computed for.
    loglik_stats : dict
        ``{"loglik"}`` or Gaussian ``{"sse", "count"}`` summed over the data.
    num_data : int
    gradients : list of Tensor or None
        With ``accumulate_curvature(..., gradient=True)``: per layer, the gradient of the
        negative log-likelihood ``Σ_n J_nᵀ r_n`` at the fixed weights, shape ``(out, in')``
        (``W̃`` layout; for a Gaussian likelihood with ``Λ = I``, i.e. times ``σ²``).
    """

    blocks: list
    kind: str
    loglik_stats: dict = field(default_factory=dict)
    num_data: int = 0
    gradients: list | None = None


def _batch_sums(layers, a, g, structure):
    if structure == "kron":
        return {f"{layer.path}/{k}": v for layer in layers
                for k, v in kfac_sums_from_factors(a[layer.path], g[layer.path], layer).items()}
    if structure == "diag":
        return {f"{layer.path}/diag": diag_ggn_sums(a[layer.path], g[layer.path], layer) for layer in layers}
    return {"full": full_ggn_sum(layers, a, g)}


class _BatchTargets:
    """One batch's targets, converted and checked once against the network output ``f``
    (before the log-likelihood: ``cross_entropy`` would skip a label −100)."""

    def __init__(self, kind, x, y, check, where):
        self.kind, self.x, self.y, self.check, self.where = kind, x, y, check, where
        self._checked = None

    def checked(self, f):
        if self._checked is None:
            y = as_targets(self.kind, self.y, f.shape[1:])   # int64 labels; (N,) targets of one output as (N, 1)
            self.check.set_output_shape(f)
            self.check(self.x, y, self.where)
            self._checked = y
        return self._checked

    def residual(self, f):
        """``∂(−log p)/∂f`` (the gradient pass of ``accumulate_curvature(..., gradient=True)``)."""
        return nll_residual(self.kind, f, self.checked(f))


def accumulate_curvature(layers: list[Layer], batches: Iterable, run: Callable, kind: str,
                         structure: str = "kron", *, device=None,
                         reduce_fn: Callable[[dict], dict] | None = None,
                         num_augmentations: int = 1, split_bias: bool = False,
                         gradient: bool = False, where: str = "the curvature data",
                         model=None) -> CurvatureFit:
    """GGN curvature (``structure``) and log-likelihood at fixed weights over ``batches``.

    Parameters
    ----------
    layers : list of Layer
    batches : iterable of (x, y)
    run : callable
        ``run(x) -> f`` under the fixed weights (which must require grad).  Run the network in
        eval mode, as every caller in the library does (``Laplace.fit_curvature``, LILA's
        evidence steps): in train mode BatchNorm normalises with the batch's statistics, which
        couples the examples that the per-example factors treat as independent, and updates
        its running statistics.
    kind : str
        Likelihood kind (:func:`~pyro_bnn.curvature.network.hessian_columns`).
    structure : {"kron", "diag", "full"}
    device : torch.device, optional
        Batches are moved there.
    reduce_fn : callable, optional
        Applied to the flat dict of sums before finalising (distributed all-reduce).
    split_bias : bool
        KFAC only: biases as separate blocks (see :func:`~pyro_bnn.curvature.kfac.kfac_blocks`).
    num_augmentations : int
        ``S`` copies per example averaged inside ``run`` (invariant models, LILA).
    gradient : bool
        Also sum the gradient of the negative log-likelihood per layer
        (:attr:`CurvatureFit.gradients`; one more backward pass per batch), which the
        evidence of the linearised model at its own mode needs
        (:func:`~pyro_bnn.curvature.marglik.linearized_evidence_terms`).
    where : str
        Names the data in messages.
    model : BNN or PyroModule, optional
        The model the batches are for.  Their inputs are looked at for unscaled 0-255 pixels
        only if nobody has warned about its inputs yet (the caller's own check of the data
        usually has: ``pb.fit``, ``Laplace.fit_curvature``), and it is told if they are
        (:class:`~pyro_bnn.data.batches.BatchCheck`'s ``inputs_of``): one warning per model.
        Without it, the first batch is looked at.

    Raises
    ------
    TypeError, ValueError
        A batch the likelihood cannot take (:class:`~pyro_bnn.data.batches.BatchCheck`, the check
        of ``pb.fit``): NaN/inf inputs or targets, as many targets as inputs, categorical
        labels that are not integers in ``[0, C)`` (PyTorch's ignore_index −100, which
        ``F.cross_entropy`` would silently drop from the log-likelihood, is refused),
        Bernoulli targets other than 0/1, targets not shaped like the output.  Integer
        labels of another dtype (``int32``, ``uint8``) are used as int64.
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    sums: dict[str, torch.Tensor] = {}
    check = BatchCheck(likelihood=make_likelihood(kind), inputs_of=model)
    with torch.enable_grad():
        for i, batch in enumerate(batches, 1):
            x, y = split_batch(batch)
            if y is None:
                raise ValueError("curvature needs targets: data must be (x, y)")
            if device is not None:
                x, y = x.to(device), y.to(device)
            targets = _BatchTargets(kind, x, y, check, f"batch {i} of {where}")
            captured = capture_factors(layers, lambda x=x: run(x), lambda out: hessian_columns(kind, out),
                                       num_augmentations=num_augmentations,
                                       residual=targets.residual if gradient else None)
            f, a, g = captured[:3]
            y = targets.checked(f)
            part = _batch_sums(layers, a, g, structure)
            if gradient:
                part.update({f"{layer.path}/grad": captured[3][layer.path] for layer in layers})
            part.update({f"loglik/{k}": v for k, v in log_likelihood_terms(kind, f, y).items()})
            part["num_data"] = torch.tensor(float(len(x)), dtype=f.dtype, device=f.device)
            for k, v in part.items():
                sums[k] = sums[k] + v if k in sums else v
    if not sums:
        raise ValueError("no data: the loader yielded no batches")
    if reduce_fn is not None:
        sums = reduce_fn(sums)
    nested: dict = {}
    for k, v in sums.items():
        head, _, tail = k.rpartition("/")
        nested.setdefault(head, {})[tail] = v
    if structure == "kron":
        blocks = kfac_blocks(layers, nested, split_bias)
    elif structure == "diag":
        blocks = diag_blocks(layers, nested)
    else:
        blocks = full_block(sums)
    gradients = [nested[layer.path]["grad"] for layer in layers] if gradient else None
    return CurvatureFit(blocks, kind, nested["loglik"], int(sums["num_data"].item()), gradients)
