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

