"""Masked autoencoder (MADE, Germain et al. 2015) for the hypernetwork's IAF blocks.

Pyro's ``AutoRegressiveNN`` requires hidden width ≥ D; :class:`MADE` allows any width (hidden
degrees spread over 1..D−1).  In autoregressive order each mask is a staircase, so the layers
store only the row blocks the masks allow (no mask multiplication per step) and a custom
backward keeps the masked-out entries' gradients at zero.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MADE"]


class MADE(nn.Module):
    """One-hidden-layer masked autoencoder: ``x (…, D) -> (mean, log_scale)``, each (…, D),
    output ``i`` depending only on inputs that come before ``i`` in ``permutation``.

    Degrees: input/output ``i`` has degree ``rank(i)`` ∈ 1..D, hidden unit ``k`` of H has
    degree ``1 + ⌊k (D−1)/H⌋`` (spread evenly over 1..D−1); hidden ``k`` sees input ``i`` iff
    ``deg_k ≥ rank(i)``, output ``i`` sees hidden ``k`` iff ``rank(i) > deg_k``.  Works for
    any hidden width (also < D).  The function is that of the dense masked layers

        h = relu((W_in ⊙ M_in) x + b_in),   (mean, log_scale) = (W_out ⊙ M_out) h + b_out,

    with ``W_in`` (H, D), ``W_out`` (2D, H) initialised as ``nn.Linear``.

    Storage (speed, same maths): in rank order the masks are staircases (hidden ``k`` sees
    the first ``deg_k`` inputs, output of rank ``r`` the first ``#{k: deg_k < r}`` hidden
    units), so each layer keeps only ``groups`` row blocks of its masked matrix, block ``b``
    of shape (rows_b, widest prefix in the block): ≈ (1/2 + 1/(2·groups)) of the dense
    entries.  The entries outside the mask inside a block are stored as zeros and get zero
    gradient (the backward multiplies the block's diagonal strip by the mask), so no mask is
    applied in the forward pass and gradient-based optimisers (SGD, Adam, weight decay) keep
    them zero; after editing the parameters by hand call :meth:`apply_masks_`.  For one
    noise sample the layers are matrix-vector products, memory-bound: the cost of a training
    step (forward, backward, Adam) scales with the number of stored entries.  The layers are
    a custom ``torch.autograd.Function``: first-order autograd only (no ``torch.func``
    transforms such as ``vmap``/``jacrev``, no double backward).

    Parameters
    ----------
    dim : int
        D ≥ 2.
    hidden : int
        Hidden units H.
    permutation : LongTensor, shape (D,)
        Autoregressive order (a buffer; Pyro's ``AffineAutoregressive`` reads it for its
        inverse).
    groups : int, optional
        Row blocks per layer (≥ 1; capped at the number of rows).  Default: 4 when the
        input layer has ≥ 160,000 entries (D·H; e.g. D = 810, H = 200), else 1 — more
        blocks store fewer entries but cost ~10 small tensor operations each per step,
        which dominates for small layers.
    """

    def __init__(self, dim: int, hidden: int, permutation: torch.Tensor,
                 groups: int | None = None):
        super().__init__()
        if dim < 2:
            raise ValueError(f"an autoregressive block needs dimension >= 2, got {dim}")
        if groups is None:
            groups = 4 if dim * hidden >= 160_000 else 1
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive integer, got {groups!r}")
        self.dim, self.hidden_units = int(dim), int(hidden)
        self.register_buffer("permutation", permutation.long().clone())
        rank = torch.empty(dim, dtype=torch.long)
        rank[self.permutation] = torch.arange(1, dim + 1)
        deg_h = 1 + (torch.arange(hidden) * (dim - 1)) // hidden  # nondecreasing
        # input layer, columns in rank order: hidden k sees the first deg_k columns
        self._in = _Staircase(deg_h, groups)
        # output layer, rows = [mean (rank order), log_scale (rank order)], columns = hidden
        prefix_out = torch.searchsorted(deg_h, torch.arange(1, dim + 1), right=False)
        self._out = _Staircase(torch.cat([prefix_out, prefix_out]), groups, pair=dim)
        # gather indices: inputs into rank order, outputs from the blocks' order back
        self.register_buffer("in_index", self.permutation.clone(), persistent=False)
        self.register_buffer("rank0", rank - 1, persistent=False)
        self.register_buffer("out_index", self._out.inverse_rows(rank - 1), persistent=False)
        dense_in, dense_out = nn.Linear(dim, hidden), nn.Linear(hidden, 2 * dim)
        with torch.no_grad():
            w_out = dense_out.weight.view(2, dim, hidden)[:, self.permutation].reshape(2 * dim, hidden)
            b_out = dense_out.bias.view(2, dim)[:, self.permutation].reshape(-1)
            self.w_in = self._in.pack(dense_in.weight[:, self.permutation])
            self.w_out = self._out.pack(w_out)
        self.b_in = nn.Parameter(dense_in.bias.detach().clone())
        self.b_out = nn.Parameter(self._out.order_rows(b_out))
        for i, m in enumerate(self._in.masks):
            self.register_buffer(f"strip_in{i}", m, persistent=False)
        for i, m in enumerate(self._out.masks):
            self.register_buffer(f"strip_out{i}", m, persistent=False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # state dicts saved before the block storage (dense ``hidden``/``out`` Linear layers
        # and ``mask_in``/``mask_out`` buffers) are converted on load
        old = [prefix + k for k in ("hidden.weight", "hidden.bias", "out.weight", "out.bias")]
        if all(k in state_dict for k in old):
            w_in, b_in, w_out, b_out = (state_dict.pop(k) for k in old)
            for k in ("mask_in", "mask_out"):
                state_dict.pop(prefix + k, None)
            perm, dim = self.permutation.to(w_in.device), self.dim
            for i, w in enumerate(self._in.pack(w_in[:, perm])):
                state_dict[f"{prefix}w_in.{i}"] = w.detach()
            w_out = w_out.view(2, dim, -1)[:, perm].reshape(2 * dim, -1)
            for i, w in enumerate(self._out.pack(w_out)):
                state_dict[f"{prefix}w_out.{i}"] = w.detach()
            state_dict[prefix + "b_in"] = b_in
            state_dict[prefix + "b_out"] = self._out.order_rows(b_out.view(2, dim)[:, perm].reshape(-1))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _strips(self, name, n):
        return [getattr(self, f"strip_{name}{i}") for i in range(n)]

    def forward(self, x):
        shape = x.shape[:-1]
        xr = x.reshape(-1, self.dim).index_select(-1, self.in_index)
        h = _StaircaseLinear.apply(xr, self.b_in, self._in, self._strips("in", len(self.w_in)),
                                   *self.w_in).relu()
        y = _StaircaseLinear.apply(h, self.b_out, self._out,
                                   self._strips("out", len(self.w_out)), *self.w_out)
        mean, log_scale = y.index_select(-1, self.out_index).view(*shape, 2 * self.dim).chunk(2, -1)
        return mean, log_scale

    @torch.no_grad()
    def apply_masks_(self) -> MADE:
        """Zero the stored entries outside the autoregressive mask (after manual edits)."""
        for w, m, lo in zip(self.w_in, self._strips("in", len(self.w_in)), self._in.lo):
            w[:, lo:].mul_(m)
        for w, m, lo in zip(self.w_out, self._strips("out", len(self.w_out)), self._out.lo):
            w[:, lo:].mul_(m)
        return self

    @torch.no_grad()
    def scale_output_(self, gain: float) -> MADE:
        """Multiply the output layer's weights by ``gain`` and zero its bias (near-identity
        initialisation of an IAF block)."""
        for w in self.w_out:
            w.mul_(gain)
        self.b_out.zero_()
        return self

    @torch.no_grad()
    def dense_weights(self) -> tuple[torch.Tensor, ...]:
        """The masked dense layers in the original input/output order:
        ``(W_in ⊙ M_in (H, D), b_in (H,), W_out ⊙ M_out (2D, H), b_out (2D,))``."""
        w_in = torch.zeros(self.hidden_units, self.dim, device=self.b_in.device,
                           dtype=self.b_in.dtype)
        w_in[:, self.permutation] = self._in.unpack(list(self.w_in), self.dim)
        rows = torch.cat([self.rank0, self.rank0 + self.dim])  # original row -> rank-order row
        w_out = self._out.unpack(list(self.w_out), self.hidden_units)[rows.cpu()]
        return w_in, self.b_in.clone(), w_out, self.b_out[self.out_index].clone()

    def num_stored(self) -> int:
        """Stored parameter entries (dense masked layers: ``3 D H + H + 2 D``)."""
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden_units}, groups={len(self.w_in)}"


class _Staircase:
    """Row blocks of a masked matrix whose row ``i`` sees the first ``prefix[i]`` columns.

    Rows are grouped into ``groups`` contiguous blocks of (at most) equal size (with
    ``pair=n``, rows ``j`` and ``j + n`` share a block: mean and log-scale of one output).
    Block ``b`` stores columns ``[0, hi_b)``; columns ``[lo_b, hi_b)`` are its strip, where a
    0/1 mask applies.
    """

    def __init__(self, prefix: torch.Tensor, groups: int, pair: int | None = None):
        n = len(prefix) if pair is None else pair
        groups = max(1, min(groups, n))
        bounds = [(n * b) // groups for b in range(groups + 1)]
        self.rows, self.hi, self.lo, self.masks = [], [], [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            rows = torch.arange(a, b)
            if pair is not None:
                rows = torch.cat([rows, rows + pair])
            p = prefix[rows]
            hi, lo = int(p.max()), int(p.min())
            self.rows.append(rows)
            self.hi.append(hi)
            self.lo.append(lo)
            self.masks.append((torch.arange(lo, hi)[None, :] < p[:, None]).float())
        self.order = torch.cat(self.rows)  # row of the stacked blocks -> original row
        self.sizes = [len(r) for r in self.rows]

    def pack(self, dense: torch.Tensor) -> nn.ParameterList:
        out = []
        for rows, hi, lo, m in zip(self.rows, self.hi, self.lo, self.masks):
            w = dense[rows, :hi].detach().clone()
            w[:, lo:] *= m
            out.append(nn.Parameter(w))
        return nn.ParameterList(out)

    def order_rows(self, vec: torch.Tensor) -> torch.Tensor:
        return vec.detach()[self.order].clone()

    def inverse_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the stacked order of the original rows ``[index, index + n]``
        (``pair=n``), i.e. the gather index that restores the original output order."""
        pos = torch.empty_like(self.order)
        pos[self.order] = torch.arange(len(self.order))
        n = len(index)
        return torch.cat([pos[index], pos[index + n]]) if len(self.order) == 2 * n else pos[index]

    def unpack(self, weights: list, cols: int) -> torch.Tensor:
        dense = weights[0].new_zeros(len(self.order), cols)
        for rows, w in zip(self.rows, weights):
            dense[rows.to(w.device), : w.shape[1]] = w
        return dense


class _StaircaseLinear(torch.autograd.Function):
    """``y = x [W_1 | … | W_G]ᵀ + b`` over row blocks, block ``b`` reading ``x[:, :hi_b]``;
    the backward masks each block's strip gradient (entries outside the mask stay zero)."""

    @staticmethod
    def forward(ctx, x, bias, stair, strips, *weights):
        biases = bias.split(stair.sizes)
        ys = [torch.addmm(b, x[:, : w.shape[1]], w.t()) for b, w in zip(biases, weights)]
        ctx.stair, ctx.strips = stair, strips
        ctx.save_for_backward(x, *weights)
        return ys[0] if len(ys) == 1 else torch.cat(ys, -1)

    @staticmethod
    def backward(ctx, gy):
        x, *weights = ctx.saved_tensors
        stair = ctx.stair
        gys = gy.split(stair.sizes, -1)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.zeros_like(x)
            for g, w in zip(gys, weights):
                gx[:, : w.shape[1]].addmm_(g, w)
        gws = []
        for g, w, lo, m in zip(gys, weights, stair.lo, ctx.strips):
            gw = torch.mm(g.t(), x[:, : w.shape[1]])
            gw[:, lo:].mul_(m)
            gws.append(gw)
        gb = gy.sum(0) if ctx.needs_input_grad[1] else None
        return (gx, gb, None, None, *gws)
