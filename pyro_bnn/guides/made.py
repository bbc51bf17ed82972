"""Masked autoencoder (MADE, Germain et al. 2015) for the hypernetwork's IAF blocks.

Pyro's ``AutoRegressiveNN`` requires hidden width ≥ D; :class:`MADE` allows any width (hidden
degrees spread over 1..D−1).  In autoregressive order each mask is a staircase, so the layers
store only the row blocks the masks allow.  With one block per layer the mask multiplies the
weights in the forward pass (plain autograd); with several, a custom backward keeps the
masked-out entries' gradients at zero and no mask is applied per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MADE", "soft_bound"]


def soft_bound(x: torch.Tensor, bound: float) -> torch.Tensor:
    """``B · tanh(x / B)``: the identity near 0 (slope 1), smoothly bounded to (−B, B)."""
    return bound * torch.tanh(x / bound)


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
    gradient, so gradient-based optimisers (SGD, Adam, weight decay) keep them zero; after
    editing the parameters by hand call :meth:`apply_masks_`.  For one noise sample the layers
    are matrix-vector products, memory-bound: the cost of a training step (forward, backward,
    Adam) scales with the number of stored entries.  With one block per layer (``groups=1``)
    the layers are plain autograd through ``W ⊙ M``, the block's mask applied in the forward
    pass (cheaper than a custom backward's Python steps at these sizes; ``torch.func``
    transforms work); with more blocks they
    are a custom ``torch.autograd.Function`` that applies no mask in the forward pass and
    multiplies the strip's gradient by it: first-order autograd only (no ``torch.func``
    transforms such as ``vmap``/``jacrev``, no double backward).  Both give the same values
    and gradients.

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
    log_scale_bound : float, optional
        If given (B > 0), the log-scale output is bounded smoothly,
        ``B · tanh(log_scale / B)`` ∈ (−B, B), with exact gradients (unlike a hard clamp,
        whose straight-through gradient lets the raw outputs drift without bound).
    fan_in_scaled : bool
        Store each weight multiplied by its unit's fan-in ``n_k`` (inputs the mask lets
        unit ``k`` see) and divide the unit's pre-activation by ``n_k``:
        ``pre_k = (1/n_k) Σ_j W'_kj x_j + b_k``.  Same function and initialisation; what
        changes is how Adam steps act.  Adam moves every stored weight by about the learning
        rate per step, so in the plain layer a step moves ``pre_k`` by up to
        ``lr · Σ_j |x_j|`` — with thousands of inputs (a flow over every weight) an Adam step
        at the learning rate that suits the elementwise layer scrambles the conditioner.
        Scaled, it moves ``pre_k`` by at most ``lr · mean_j |x_j|``, as a step moves a
        mean-field location.  Default ``False`` (the plain masked layers).
    """

    def __init__(self, dim: int, hidden: int, permutation: torch.Tensor,
                 groups: int | None = None, log_scale_bound: float | None = None,
                 fan_in_scaled: bool = False):
        super().__init__()
        if log_scale_bound is not None and not log_scale_bound > 0:
            raise ValueError(f"log_scale_bound must be > 0 or None, got {log_scale_bound!r}")
        self.log_scale_bound = None if log_scale_bound is None else float(log_scale_bound)
        self.fan_in_scaled = bool(fan_in_scaled)
        if dim < 2:
            raise ValueError(f"an autoregressive block needs dimension >= 2, got {dim}")
        if groups is None:
            groups = 4 if dim * hidden >= 160_000 else 1
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive integer, got {groups!r}")
        self.dim, self.hidden_units = int(dim), int(hidden)
        self.register_buffer("permutation", permutation.long().clone())
        deg_h = 1 + (torch.arange(hidden) * (dim - 1)) // hidden  # nondecreasing
        # input layer, columns in rank order: hidden k sees the first deg_k columns
        self._in = _Staircase(deg_h, groups)
        # output layer, rows = [mean (rank order), log_scale (rank order)], columns = hidden
        prefix_out = torch.searchsorted(deg_h, torch.arange(1, dim + 1), right=False)
        self._out = _Staircase(torch.cat([prefix_out, prefix_out]), groups, pair=dim)
        # gather indices: inputs into rank order, outputs from the blocks' order back
        for name in ("in_index", "rank0", "out_index"):
            self.register_buffer(name, None, persistent=False)
        self._set_order()
        # fan-in of every row, in the original (rank) row order, and 1/fan-in in the order
        # the blocks are stacked (the order of the layers' raw outputs)
        self.register_buffer("fan_in_in", deg_h.float(), persistent=False)
        self.register_buffer("fan_in_out", torch.cat([prefix_out, prefix_out]).clamp_min(1).float(),
                             persistent=False)
        self.register_buffer("inv_fan_in_in", 1 / self.fan_in_in[self._in.order], persistent=False)
        self.register_buffer("inv_fan_in_out", 1 / self.fan_in_out[self._out.order], persistent=False)
        # saved with the weights, so that a state dict loads into either convention
        self.register_buffer("stored_fan_in_scaled", torch.tensor(float(self.fan_in_scaled)))
        self.register_buffer("zero_in", torch.zeros(hidden), persistent=False)
        self.register_buffer("zero_out", torch.zeros(2 * dim), persistent=False)
        dense_in, dense_out = nn.Linear(dim, hidden), nn.Linear(hidden, 2 * dim)
        with torch.no_grad():
            w_out = dense_out.weight.view(2, dim, hidden)[:, self.permutation].reshape(2 * dim, hidden)
            b_out = dense_out.bias.view(2, dim)[:, self.permutation].reshape(-1)
            self.w_in = self._in.pack(self._stored(dense_in.weight[:, self.permutation], "in"))
            self.w_out = self._out.pack(self._stored(w_out, "out"))
        self.b_in = nn.Parameter(dense_in.bias.detach().clone())
        self.b_out = nn.Parameter(self._out.order_rows(b_out))
        for i, m in enumerate(self._in.masks):
            self.register_buffer(f"strip_in{i}", m, persistent=False)
        for i, m in enumerate(self._out.masks):
            self.register_buffer(f"strip_out{i}", m, persistent=False)
        # one block per layer: plain autograd through ``W ⊙ M`` (the block's whole mask) is
        # cheaper than the custom Function's Python backward, with the same values and gradients
        self.one_block = len(self.w_in) == 1 and len(self.w_out) == 1
        if self.one_block:
            self.register_buffer("block_mask_in", self._in.block_mask(0), persistent=False)
            self.register_buffer("block_mask_out", self._out.block_mask(0), persistent=False)

    def _set_order(self) -> None:
        """The gather indices of ``permutation`` (the stored weights are in rank order, so
        only these depend on it)."""
        perm = self.permutation
        rank0 = torch.empty_like(perm)
        rank0[perm] = torch.arange(self.dim, device=perm.device)
        self.in_index, self.rank0 = perm.clone(), rank0
        self.out_index = self._out.inverse_rows(rank0.cpu()).to(perm.device)

    def _stored(self, dense: torch.Tensor, layer: str) -> torch.Tensor:
        """Effective weights (rows in rank order) -> the stored ones (× fan-in if scaled)."""
        if not self.fan_in_scaled:
            return dense
        fan_in = self.fan_in_in if layer == "in" else self.fan_in_out
        return dense * fan_in.to(dense)[:, None]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # stored weights of the other fan-in convention are rescaled, so that the loaded MADE
        # computes the saved function (a missing key is left for the strict load to report)
        key = prefix + "stored_fan_in_scaled"
        if key in state_dict:
            saved_scaled = bool(state_dict[key].item())
            state_dict[key] = self.stored_fan_in_scaled.clone()
            if saved_scaled != self.fan_in_scaled:
                for name, stair, fan_in in (("w_in", self._in, self.fan_in_in),
                                            ("w_out", self._out, self.fan_in_out)):
                    for i, rows in enumerate(stair.rows):
                        k = f"{prefix}{name}.{i}"
                        if k in state_dict:
                            f = fan_in[rows.to(fan_in.device)].to(state_dict[k])[:, None]
                            state_dict[k] = state_dict[k] * f if self.fan_in_scaled else state_dict[k] / f
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._set_order()  # the loaded permutation (e.g. of a flow built with another seed)

    def _strips(self, name, n):
        return [getattr(self, f"strip_{name}{i}") for i in range(n)]

    def forward(self, x):
        shape = x.shape[:-1]
        xr = x.reshape(-1, self.dim).index_select(-1, self.in_index)
        if self.one_block:
            y = self._one_block_layers(xr)
        else:
            y = self._block_layers(xr)
        mean, log_scale = y.index_select(-1, self.out_index).view(*shape, 2 * self.dim).chunk(2, -1)
        if self.log_scale_bound is not None:
            log_scale = soft_bound(log_scale, self.log_scale_bound)
        return mean, log_scale

    def _one_block_layers(self, xr):
        """Both layers as dense masked products: ``(W ⊙ M) x`` (one block per layer)."""
        w_in, w_out = self.w_in[0], self.w_out[0]
        xr = xr[:, : w_in.shape[1]]
        if self.fan_in_scaled:
            h = torch.addcmul(self.b_in, F.linear(xr, w_in * self.block_mask_in), self.inv_fan_in_in).relu()
            return torch.addcmul(self.b_out, F.linear(h[:, : w_out.shape[1]], w_out * self.block_mask_out),
                                 self.inv_fan_in_out)
        h = F.linear(xr, w_in * self.block_mask_in, self.b_in).relu()
        return F.linear(h[:, : w_out.shape[1]], w_out * self.block_mask_out, self.b_out)

    def _block_layers(self, xr):
        """Both layers over their row blocks (:class:`_StaircaseLinear`)."""
        strips_in, strips_out = self._strips("in", len(self.w_in)), self._strips("out", len(self.w_out))
        if self.fan_in_scaled:
            h = _StaircaseLinear.apply(xr, self.zero_in, self._in, strips_in, *self.w_in)
            h = torch.addcmul(self.b_in, h, self.inv_fan_in_in).relu()
            return torch.addcmul(self.b_out, _StaircaseLinear.apply(h, self.zero_out, self._out, strips_out,
                                                                    *self.w_out), self.inv_fan_in_out)
        h = _StaircaseLinear.apply(xr, self.b_in, self._in, strips_in, *self.w_in).relu()
        return _StaircaseLinear.apply(h, self.b_out, self._out, strips_out, *self.w_out)

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
        """The masked dense layers (effective weights) in the original input/output order:
        ``(W_in ⊙ M_in (H, D), b_in (H,), W_out ⊙ M_out (2D, H), b_out (2D,))``."""
        w_in = torch.zeros(self.hidden_units, self.dim, device=self.b_in.device,
                           dtype=self.b_in.dtype)
        dense_in = self._in.unpack(list(self.w_in), self.dim)
        dense_out = self._out.unpack(list(self.w_out), self.hidden_units)
        if self.fan_in_scaled:
            dense_in = dense_in / self.fan_in_in[:, None]
            dense_out = dense_out / self.fan_in_out[:, None]
        w_in[:, self.permutation] = dense_in
        rows = torch.cat([self.rank0, self.rank0 + self.dim])  # original row -> rank-order row
        w_out = dense_out[rows.cpu()]
        return w_in, self.b_in.clone(), w_out, self.b_out[self.out_index].clone()

    def num_stored(self) -> int:
        """Stored parameter entries (dense masked layers: ``3 D H + H + 2 D``)."""
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        bound = "" if self.log_scale_bound is None else f", log_scale_bound={self.log_scale_bound}"
        return (f"dim={self.dim}, hidden={self.hidden_units}, groups={len(self.w_in)}{bound}, "
                f"fan_in_scaled={self.fan_in_scaled}")


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

    def block_mask(self, b: int) -> torch.Tensor:
        """Block ``b``'s whole 0/1 mask, shape (rows_b, hi_b): ones left of its strip."""
        m = torch.ones(len(self.rows[b]), self.hi[b])
        m[:, self.lo[b]:] = self.masks[b]
        return m

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
