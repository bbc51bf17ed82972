"""Hypernet and Symmetrized against plain-PyTorch reference steps of the same algorithms (issue 27).

A guide's step is judged against the *same algorithm written as one plain PyTorch function*
(no library: same sampling scheme, same KL / entropy terms, same optimiser), timed in the
same process, and against a plain MAP step.  Guides (MNIST 5k, MLP 784-400-400-10, batch
128, Adam lr 1e-3, fused where the library's default optimiser is fused):

* ``hypernet0``: ``Hypernet(weight-norm model, num_flows=0)``: ``g = μ + softplus(ρ) ε``
  over the D = 810 weight-norm scales, ``W_j = g_j v_j/‖v_j‖`` (``torch._weight_norm``, the
  kernel of ``torch.nn.utils.parametrizations.weight_norm``), Monte Carlo KL
  ``log q(g) − log p(g)``.
* ``hypernet8``: the same with 8 IAF blocks (MADE conditioners with 200 hidden units, the
  ``"stable"`` layout: blocks on standardised coordinates, fan-in scaled conditioners,
  ``3 tanh(s/3)`` log-scales).  The reference's MADE is the textbook one: dense masked
  matrices ``(W ⊙ M)``; the library stores only the staircase blocks the masks allow.
* ``symmetrized``: ``Symmetrized(model, local_reparameterization=False)``: mean-field Gaussian
  over every weight, ``σ = exp ρ``, weight noise, closed-form KL to N(0, 1), minus the local entropy-gap bound
  ``log|G| + Σ_k log ρ_k(e | ω)`` (Sinkhorn-balanced unit/slot assignment, K = 1) on the
  same draw ω; means of wide layers at the guide's fan-in learning-rate factors.

Before timing, each reference is checked against the library on the *same parameters and
noise*: loss and gradients (``check_*``; the benchmark stops if they disagree).  Then blocks
of ``--block`` epochs of every method are interleaved ``--repeats`` times; medians of wall
and process-CPU seconds per epoch, and ratios.  Methods per guide: ``ref`` (the reference),
``loop`` (the guide's objective in the same plain loop) and ``fit`` (``pb.fit``, one call per
block with a persistent optimiser, as ``bench_core.py``).

    python benchmarks/bench_reference.py --threads 1 --block 2 --repeats 3
    python benchmarks/bench_reference.py --guides hypernet8 --check-only
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from _common import map_epoch, sync  # benchmarks/_common.py (on sys.path when run as a script)
from _common import mnist_mlp as mlp

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.data.batches import TensorBatches
from pyro_bnn.training.guide_setup import setup_guide
from pyro_bnn.training.optimizer import default_optimizer

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
GUIDES = ("hypernet0", "hypernet8", "symmetrized")


# ============================================================== Hypernet: the reference
def hypernet_reference_params(model, guide) -> dict:
    """Leaf copies of a set-up :class:`~pyro_bnn.guides.Hypernet`'s and its weight-norm model's
    parameters in the reference's layout (set-up only: the step below touches none of the library).

    Returns ``{"layers": [(v, b)], "sizes": [out], "prior_scale": float, "loc", "rho",
    "blocks": [dict(w_in, m_in, inv_in, b_in, w_out, m_out, inv_out, b_out)], "bound"}``;
    the MADE weights are stored as the library stores them (times the unit's fan-in), dense
    with the masks ``M`` (zeros outside)."""
    flow = guide.flow
    if not flow.affine_last or flow.flow != "iaf" or not flow.fan_in_scaled or flow.log_scale_bound is None:
        raise ValueError("the reference covers the 'stable' IAF layout only")
    sites = guide.site_names()
    layers, sizes = [], []
    for name in sites:
        module, _ = pb.model.bnn.site_module(model, name)
        layers.append((leaf(module.weight_v), leaf(module.bias)))
        sizes.append(module.weight_v.shape[0])
    prior = [model.site_normal_prior(name) for name in sites]
    if any(float(m) != 0.0 or float(s) != float(prior[0][1]) for m, s in prior):
        raise ValueError("the reference assumes one N(0, s²) prior on every scale")
    blocks = []
    for block in flow.blocks:
        made = block.arn
        w_in, b_in, w_out, b_out = made.dense_weights()         # effective weights, original order
        rank = torch.empty_like(made.permutation)
        dev = made.permutation.device
        rank[made.permutation] = torch.arange(made.dim, device=dev) + 1     # 1-based autoregressive rank
        deg = 1 + (torch.arange(made.hidden_units, device=dev) * (made.dim - 1)) // made.hidden_units
        m_in = (rank[None, :] <= deg[:, None]).to(w_in)          # hidden k sees inputs of rank <= deg_k
        m_out_half = (rank[:, None] > deg[None, :]).to(w_in)     # output i sees hidden units of degree < rank_i
        m_out = torch.cat([m_out_half, m_out_half])
        n_in, n_out = m_in.sum(1).clamp_min(1), m_out.sum(1).clamp_min(1)
        blocks.append({"w_in": leaf(w_in * n_in[:, None]), "m_in": m_in, "inv_in": 1 / n_in,
                       "b_in": leaf(b_in), "w_out": leaf(w_out * n_out[:, None]), "m_out": m_out,
                       "inv_out": 1 / n_out, "b_out": leaf(b_out)})
    out = {"layers": layers, "sizes": sizes, "prior_scale": float(prior[0][1]),
           "loc": leaf(flow.affine.loc), "rho": leaf(flow.affine.rho), "blocks": blocks,
           "bound": flow.log_scale_bound}
    if any(isinstance(m, torch.nn.Conv2d) for m in model.net.modules()):
        out["steps"] = _network_steps(model)
    return out


def _network_steps(model) -> list:
    """A convolutional net for :func:`_network_forward`: per child of the ``nn.Sequential``,
    ``("conv", (stride, padding, dilation, groups))`` or ``("linear", None)`` for a weight-norm
    layer (in site order), else ``("module", a copy of the parameter-free torch layer)``."""
    net = model.net
    if not isinstance(net, torch.nn.Sequential):
        raise ValueError("the convolutional reference runs an nn.Sequential")
    steps = []
    for module in net:
        if isinstance(module, torch.nn.Conv2d):
            if module.padding_mode != "zeros":
                raise ValueError("the reference covers zero-padded convolutions")
            steps.append(("conv", (module.stride, module.padding, module.dilation, module.groups)))
        elif isinstance(module, torch.nn.Linear):
            steps.append(("linear", None))
        elif any(True for _ in module.parameters()):
            raise ValueError(f"a parametrised {type(module).__name__} is not covered")
        else:   # a plain torch layer of the same class and settings (no Pyro module in the step)
            steps.append(("module", _plain_copy(module)))
    return steps


def _plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The torch class of a ``PyroModule``-converted parameter-free layer, with its settings."""
    cls = next(c for c in type(module).__mro__ if c.__module__.startswith("torch.nn"))
    plain = cls.__new__(cls)
    torch.nn.Module.__init__(plain)
    plain.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("_")})
    return plain


def _network_forward(p: dict, scales, x):
    """The convolutional net's output with the weight-norm scales ``scales`` (one tensor per
    layer): ``torch._weight_norm`` per layer, then ``F.conv2d``/``F.linear``; other layers as they are."""
    f, layer = x, 0
    for kind, item in p["steps"]:
        if kind == "module":
            f = item(f)
            continue
        (v, b), g = p["layers"][layer], scales[layer]
        w = torch._weight_norm(v, g.reshape((-1,) + (1,) * (v.dim() - 1)), 0)
        f = F.linear(f, w, b) if kind == "linear" else F.conv2d(f, w, b, *item)
        layer += 1
    return f


def hypernet_reference_loss(p: dict, x, y, num_data: int, eps=None, parts: bool = False):
    """One-sample negative ELBO of the hypernetwork, plain PyTorch:
    ``−(N/M) log p(y|x, g) − log p(g) + log q(g)``, ``g = μ + softplus(ρ) ⊙ T_K∘…∘T_1(ε)``
    (``parts``: also ``{"nll", "kl"}``, ``kl = log q − log p``)."""
    dim = p["loc"].shape[0]
    if eps is None:
        eps = torch.randn(1, dim, device=p["loc"].device)
    z = eps
    log_q = -0.5 * eps.square().sum(-1) - dim * HALF_LOG_2PI
    bound = p["bound"]
    for blk in p["blocks"]:   # IAF: z <- m(z) + exp(s(z)) z, MADE with dense masked layers
        h = torch.relu(F.linear(z, blk["w_in"] * blk["m_in"]) * blk["inv_in"] + blk["b_in"])
        mean, log_scale = (F.linear(h, blk["w_out"] * blk["m_out"]) * blk["inv_out"] + blk["b_out"]).chunk(2, -1)
        log_scale = bound * torch.tanh(log_scale / bound)
        z = mean + torch.exp(log_scale) * z
        log_q = log_q - log_scale.sum(-1)
    sigma = F.softplus(p["rho"])
    g = p["loc"] + sigma * z
    log_q = log_q - torch.log(sigma).sum()
    s = p["prior_scale"]
    log_p = (-0.5 * (g / s).square() - math.log(s) - HALF_LOG_2PI).sum(-1)
    if "steps" in p:   # a convolutional net
        f = _network_forward(p, g[0].split(p["sizes"]), x)
    else:
        f = x
        for i, (scales, (v, b)) in enumerate(zip(g[0].split(p["sizes"]), p["layers"])):
            # torch's weight-norm kernel, as torch.nn.utils.parametrizations.weight_norm calls it
            f = F.linear(f, torch._weight_norm(v, scales[:, None], 0), b)
            if i < len(p["layers"]) - 1:
                f = torch.relu(f)
    nll = F.cross_entropy(f, y, reduction="sum") * (num_data / len(x))
    loss = (nll + log_q - log_p).squeeze(0)
    return (loss, {"nll": nll, "kl": (log_q - log_p).squeeze(0)}) if parts else loss


def hypernet_reference_leaves(p: dict) -> list[torch.Tensor]:
    out = [t for layer in p["layers"] for t in layer] + [p["loc"], p["rho"]]
    return out + [blk[k] for blk in p["blocks"] for k in ("w_in", "b_in", "w_out", "b_out")]


def make_hypernet(num_flows: int, hidden: int = 400, flow_hidden: int = 200, seed: int = 0, sizes=None):
    torch.manual_seed(seed)
    net = mlp(hidden) if sizes is None else _mlp(sizes)
    model = pb.BNN(net, "categorical", weight_norm=True)
    return model, pb.guides.Hypernet(model, flow="iaf", num_flows=num_flows, hidden=flow_hidden)


def _mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def check_hypernet(model, guide, x, y, num_data: int, seed: int = 1) -> dict:
    """Library loss and gradients vs the reference's at the guide's current parameters and the
    same noise draw.  Returns ``{"loss_lib", "loss_ref", "rel_loss", "max_rel_grad"}``."""
    p = hypernet_reference_params(model, guide)
    objective = guide.make_objective(1)
    with local_params(model, guide):
        torch.manual_seed(seed)
        loss_lib, extras = objective(model, guide, x, y, num_data)
        lib_leaves = [lf for v, b in ((m.weight_v, m.bias) for m in
                                      (pb.model.bnn.site_module(model, n)[0] for n in guide.site_names()))
                      for lf in (v, b)] + [guide.flow.affine.loc, guide.flow.affine.rho]
        made = [block.arn for block in guide.flow.blocks]
        lib_leaves += [t for m in made for t in (m.b_in, m.b_out)]
        grads_lib = list(torch.autograd.grad(loss_lib, lib_leaves))
    for i, m in enumerate(made):   # the library stores b_out in its blocks' row order
        j = len(lib_leaves) - 2 * len(made) + 2 * i + 1
        grads_lib[j] = grads_lib[j][m.out_index]
    torch.manual_seed(seed)
    loss_ref, parts = hypernet_reference_loss(p, x, y, num_data, parts=True)
    ref_leaves = [t for layer in p["layers"] for t in layer] + [p["loc"], p["rho"]]
    ref_leaves += [blk[k] for blk in p["blocks"] for k in ("b_in", "b_out")]
    grads_ref = torch.autograd.grad(loss_ref, ref_leaves)
    return _compare(loss_lib, loss_ref, grads_lib, grads_ref, {"kl": (extras["kl"], parts["kl"])})


def _compare(loss_lib, loss_ref, grads_lib, grads_ref, terms=None) -> dict:
    """Relative differences of the losses, of named terms ``{name: (lib, ref)}`` and the largest
    relative difference of a gradient (``‖g_lib − g_ref‖ / ‖g_ref‖``)."""
    rel = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads_lib, grads_ref)]
    out = {"loss_lib": float(loss_lib.detach()), "loss_ref": float(loss_ref.detach()),
           "rel_loss": _rel(loss_lib, loss_ref), "max_rel_grad": max(rel)}
    for name, (a, b) in (terms or {}).items():
        out[name + "_lib"], out[name + "_ref"] = float(a.detach()), float(b.detach())
        out["rel_" + name] = _rel(a, b)
    return out


def _rel(a, b) -> float:
    a, b = float(a.detach()), float(b.detach())
    return abs(a - b) / max(abs(b), 1e-30)


# =========================================================== Symmetrized: the reference
def symmetrized_reference_params(model, guide) -> dict:
    """Leaf copies of a set-up :class:`~pyro_bnn.guides.Symmetrized` guide's μ, ρ (σ = exp ρ), its
    means' learning-rate factors, and the MLP's permutation groups (set-up only)."""
    if guide.scale_parameterization != "exp" or guide.local_reparameterization:
        raise ValueError("the reference covers σ = exp(ρ) with weight noise only")
    if guide.estimator != "local" or guide.num_permutations != 1:
        raise ValueError("the reference covers the default local bound with K = 1")
    sites = guide.site_names()
    prior = [model.site_normal_prior(name) for name in sites]
    if any(float(m) != 0.0 or float(s) != 1.0 for m, s in prior):
        raise ValueError("the reference assumes N(0, 1) priors")
    locs = {n: leaf(guide.loc_and_raw_scale(n)[0]) for n in sites}
    rhos = {n: leaf(guide.loc_and_raw_scale(n)[1]) for n in sites}
    layers = mlp_layers(sites)
    return {"sites": sites, "layers": layers, "locs": locs, "rhos": rhos, "groups": mlp_permutation_groups(layers),
            "lr_factors": guide.loc_lr_factors()}


def mlp_layers(sites) -> list[str]:
    """The Linear layers ``net.<i>`` of an MLP's weight and bias sites, in order."""
    return sorted({n.rsplit(".", 1)[0] for n in sites}, key=lambda s: int(s.rsplit(".", 1)[1]))


def mlp_permutation_groups(layers) -> list[dict]:
    """Hidden layer k permutes its weights' rows, its bias, and the next layer's columns."""
    return [{f"{a}.weight": 0, f"{a}.bias": 0, f"{b}.weight": 1} for a, b in zip(layers[:-1], layers[1:])]


def symmetrized_reference_loss(p: dict, x, y, num_data: int, parts: bool = False):
    """``−ELBO − gap``: one weight draw ω = μ + exp(ρ) ε (sites in order), closed-form
    KL(q ‖ N(0, 1)), gap ``log|G| + Σ_k log ρ_k(e | ω)``, plain PyTorch (``parts``: also
    ``{"elbo", "entropy_gap"}``)."""
    values, kl = {}, 0.0
    for name in p["sites"]:
        loc, rho = p["locs"][name], p["rhos"][name]
        sigma = torch.exp(rho)
        values[name] = loc + sigma * torch.empty_like(loc).normal_()
        kl = kl + 0.5 * (sigma.square() + loc.square()).sum() - rho.sum() - 0.5 * loc.numel()
    f = x
    for i, layer in enumerate(p["layers"]):
        f = F.linear(f, values[f"{layer}.weight"], values[f"{layer}.bias"])
        if i < len(p["layers"]) - 1:
            f = torch.relu(f)
    nll = F.cross_entropy(f, y, reduction="sum") * (num_data / len(x))
    sigmas = {n: torch.exp(r) for n, r in p["rhos"].items()}
    gap = symmetrized_reference_gap(values, p["locs"], sigmas, p["groups"])
    loss = nll + kl - gap
    return (loss, {"elbo": -(nll + kl), "entropy_gap": gap}) if parts else loss


def symmetrized_reference_gap(values: dict, locs: dict, sigmas: dict, groups: list[dict]):
    """The local entropy-gap bound ``Σ_k [log d_k! + log ρ_k(e | ω)]`` at the draw ``values``."""
    gap = 0.0
    last = {}
    for k, group in enumerate(groups):
        for site in group:
            last[site] = k
    for k, group in enumerate(groups):
        sites = [s for s in group if last[s] == k]   # sites no later group moves
        cost = sum(_unit_cost(*(_rows(t[s], group[s]) for t in (values, locs, sigmas))) for s in sites)
        d = cost.shape[0]
        gap = gap + math.lgamma(d + 1) + _log_identity_probability(-0.5 * cost)
    return gap


def _rows(t, axis):
    t = t.movedim(axis, 0)
    return t.reshape(t.shape[0], -1)


def _unit_cost(w, mu, sd):
    """``M[a, r] = Σ_c (ω[a, c] − μ[r, c])² / σ[r, c]²`` (columns centred for float32 accuracy,
    diagonal elementwise)."""
    prec = sd.reciprocal().square()
    centre = mu.mean(0, keepdim=True)
    w_c, mu_c = w - centre, mu - centre
    cost = w_c.square() @ prec.T - 2.0 * (w_c @ (mu_c * prec).T) + (mu_c.square() * prec).sum(-1)[None, :]
    diag = ((w - mu).square() * prec).sum(-1)
    return torch.diagonal_scatter(cost, diag)


def _log_identity_probability(log_w, iterations: int = 3, floor: float = 1e-3, clamp: float = 30.0):
    """``log ρ(e)``: Sinkhorn (columns then rows, log space; clamp after the first column step),
    ``Λ[a, r] = log S[a, r] + Σ_{s>r} log(1 − (1 − floor) S[a, s])``, then the sequential
    assignment probability of the identity."""
    log_s = log_w
    for t in range(iterations):
        log_s = torch.log_softmax(log_s, 0)
        if t == 0:
            log_s = log_s.clamp_min(-clamp)
        log_s = torch.log_softmax(log_s, 1)
    later = torch.log1p(-(1.0 - floor) * log_s.clamp_min(-80.0).exp())
    after = later.sum(1, keepdim=True) - later.cumsum(1)
    lam = log_s + after
    d = lam.shape[0]
    upper = torch.ones(d, d, dtype=torch.bool, device=lam.device).triu(1)   # slot r chooses among units s >= r
    return torch.log_softmax(lam.masked_fill(upper, -math.inf), 0).diagonal().sum()


def symmetrized_reference_optimizer(p: dict, lr: float):
    """Fused Adam with the guide's parameter groups: each mean at ``lr × factor``, the rest at ``lr``."""
    groups: dict[float, list] = {}
    for name in p["sites"]:
        groups.setdefault(p["lr_factors"][name], []).append(p["locs"][name])
    groups.setdefault(1.0, []).extend(p["rhos"].values())
    return torch.optim.Adam([{"params": ps, "lr": lr * f} for f, ps in groups.items()], lr=lr, fused=True)


def make_symmetrized(hidden: int = 400, seed: int = 0, sizes=None):
    torch.manual_seed(seed)
    model = pb.BNN(mlp(hidden) if sizes is None else _mlp(sizes), "categorical")
    # weight noise: the reference draws ω once for the data term and the gap (the guide's default,
    # local reparameterisation, draws the gap's ω apart; bench_fmnist_speed.py times it)
    return model, pb.guides.Symmetrized(model, local_reparameterization=False)


def check_symmetrized(model, guide, x, y, num_data: int, seed: int = 1, reference=None) -> dict:
    """As :func:`check_hypernet`: same μ, ρ and noise; also checks the symmetry groups agree.
    ``reference``: ``(params(model, guide), loss(p, x, y, n, parts), leaves(p))`` of another
    Symmetrized reference (default: this weight-noise one)."""
    make_params, reference_loss, leaves = reference or (
        symmetrized_reference_params, symmetrized_reference_loss,
        lambda p: [t for n in p["sites"] for t in (p["locs"][n], p["rhos"][n])])
    p = make_params(model, guide)
    if guide.symmetry() != p["groups"]:
        raise AssertionError(f"the guide's groups {guide.symmetry()} are not the reference's {p['groups']}")
    objective = guide.make_objective(1)
    with local_params(model, guide):
        torch.manual_seed(seed)
        loss_lib, extras = objective(model, guide, x, y, num_data)
        lib_leaves = [t for n in p["sites"] for t in guide.loc_and_raw_scale(n)]
        grads_lib = torch.autograd.grad(loss_lib, lib_leaves)
    torch.manual_seed(seed)
    loss_ref, parts = reference_loss(p, x, y, num_data, parts=True)
    grads_ref = torch.autograd.grad(loss_ref, leaves(p))
    return _compare(loss_lib, loss_ref, grads_lib, grads_ref,
                    {"entropy_gap": (extras["entropy_gap"], parts["entropy_gap"])})


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# ====================================================================== the benchmark
def reference_epoch(loss_fn, p, opt, batches, num_data):
    for xb, yb in batches:
        loss = loss_fn(p, xb, yb, num_data)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _methods(name, model, guide, x, y, args, batches, lr):
    """``{label: run(epochs)}`` for one guide: reference, plain loop of the guide's objective, pb.fit."""
    n = len(x)
    setup_guide(model, guide, x[:2], y[:2], n)
    if name == "symmetrized":
        p = symmetrized_reference_params(model, guide)
        ref_loss, ref_opt = symmetrized_reference_loss, symmetrized_reference_optimizer(p, lr)
    else:
        p = hypernet_reference_params(model, guide)
        ref_loss = hypernet_reference_loss
        ref_opt = torch.optim.Adam(hypernet_reference_leaves(p), lr=lr, fused=True)
    # the library's loop and pb.fit each train their own copy (the same initial state)
    model_l, guide_l = copy.deepcopy(model), copy.deepcopy(guide)
    contract = pb.guides.guide_contract(guide_l)
    with local_params(model_l, guide_l):
        params = list(model_l.parameters()) + list(guide_l.parameters())
    opt_l = default_optimizer(params, lr, contract.learning_rate_factors())
    objective = guide_l.make_objective(1)
    store = {}

    def run_ref(epochs):
        for _ in range(epochs):
            reference_epoch(ref_loss, p, ref_opt, batches, n)

    def run_loop(epochs):
        with local_params(model_l, guide_l):
            for _ in range(epochs):
                for xb, yb in batches:
                    loss, _ = objective(model_l, guide_l, xb, yb, n)
                    opt_l.zero_grad(set_to_none=True)
                    loss.backward()
                    opt_l.step()

    def run_fit(epochs):
        with warnings.catch_warnings():   # timed blocks of a few epochs: nothing to judge
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            pb.fit(model, guide, (x, y), epochs=epochs, batch_size=args.batch_size,
                   optimizer=lambda ps: store.setdefault("opt", default_optimizer(
                       ps, lr, pb.guides.guide_contract(guide).learning_rate_factors())),
                   lr_schedule="constant", progress=False)

    return {f"{name}:ref": run_ref, f"{name}:loop": run_loop, f"{name}:fit": run_fit}


def build(name, hidden):
    if name == "symmetrized":
        return make_symmetrized(hidden)
    return make_hypernet(int(name[len("hypernet"):]), hidden)


def run_checks(name, model, guide, x, y, n, tol):
    check = check_symmetrized if name.startswith("symmetrized") else check_hypernet
    res = check(model, guide, x, y, n)
    terms = [k[4:] for k in res if k.startswith("rel_") and k not in ("rel_loss",)]
    ok = (res["rel_loss"] <= tol and res["max_rel_grad"] <= 100 * tol
          and all(res["rel_" + t] <= 10 * tol for t in terms))
    shown = ", ".join(f"{t} lib {res[t + '_lib']:.6f} ref {res[t + '_ref']:.6f} (rel {res['rel_' + t]:.1e})"
                      for t in terms)
    print(f"  check {name}: loss lib {res['loss_lib']:.6f} ref {res['loss_ref']:.6f} "
          f"(rel {res['rel_loss']:.1e}), {shown}, max rel. gradient difference {res['max_rel_grad']:.1e} "
          f"-> {'OK' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        raise SystemExit(f"{name}: the reference does not compute the library's loss; ratios would mean nothing")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="/work/shared/data/mnist")
    ap.add_argument("--guides", nargs="+", default=list(GUIDES), choices=GUIDES)
    ap.add_argument("--block", type=int, default=2, help="epochs per timed block")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved blocks per method")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=400)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tol", type=float, default=1e-5, help="relative loss tolerance of the check")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out", default=None, help="append the result as one JSON line here")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="instead of timing: torch.profiler over STEPS steps of each guide's loop and reference")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    x, y = pb.datasets.mnist_split(args.data_dir, 5000, 5000).train
    n = len(x)
    steps = args.profile or len(x)   # --profile: epochs of that many steps
    batches = TensorBatches(x[: steps * args.batch_size], y[: steps * args.batch_size], args.batch_size)
    torch.manual_seed(0)
    net_map = mlp(args.hidden)
    opt_map = torch.optim.Adam(net_map.parameters(), lr=args.lr, fused=True)
    methods = {"map": lambda epochs: [map_epoch(net_map, opt_map, batches) for _ in range(epochs)]}
    checks = {}
    for name in args.guides:
        model, guide = build(name, args.hidden)
        setup_guide(model, guide, x[:2], y[:2], n)
        if name != "symmetrized":   # move the flow off its identity start, so the check covers it
            _perturb_flow(guide)
        checks[name] = run_checks(name, model, guide, x[:args.batch_size], y[:args.batch_size], n, args.tol)
        if args.check_only:
            continue
        model, guide = build(name, args.hidden)
        methods.update(_methods(name, model, guide, x, y, args, batches, args.lr))
    if args.check_only:
        return checks
    if args.profile:
        return profile(methods, args.profile)
    wall = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    for run in methods.values():   # warm-up (one epoch each)
        run(1)
    for _ in range(args.repeats):
        for key, run in methods.items():
            sync(torch.device("cpu"))
            t0, c0 = time.perf_counter(), time.process_time()
            run(args.block)
            wall[key].append((time.perf_counter() - t0) / args.block)
            cpu[key].append((time.process_time() - c0) / args.block)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"MNIST {n} train, MLP 784-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, cpu, torch threads "
          f"{torch.get_num_threads()}, {args.repeats} blocks of {args.block} epochs per method, load {' '.join(load)}")
    print(f"  {'method':22s} {'wall s/ep':>9s} {'cpu s/ep':>9s} {'/ref cpu':>8s} {'/map cpu':>8s}")
    for key in methods:
        ref = key.split(":")[0] + ":ref"
        r_ref = med_cpu[key] / med_cpu[ref] if ref in med_cpu else float("nan")
        print(f"  {key:22s} {med[key]:9.3f} {med_cpu[key]:9.3f} {r_ref:8.2f} {med_cpu[key] / med_cpu['map']:8.2f}")
    row = {"args": vars(args), "load": load, "wall": med, "cpu": med_cpu, "wall_all": wall, "cpu_all": cpu,
           "checks": checks}
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return row


def profile(methods, steps: int):
    """torch.profiler tables (CPU self time) of one epoch of ``steps`` steps of every loop and
    reference (``main`` builds them on the first ``steps`` batches)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for key, run in methods.items():
        if key.endswith(":fit") or key == "map":
            continue
        run(1)   # warm-up
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.process_time()
            run(1)
            secs = time.process_time() - t0
        print(f"== {key}: {steps} steps, {1000 * secs / steps:.1f} ms cpu per step (under the profiler)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


@torch.no_grad()
def _perturb_flow(guide, scale: float = 0.05, seed: int = 123):
    """Random small values in every flow parameter (the blocks start as the exact identity)."""
    gen = torch.Generator().manual_seed(seed)
    for block in guide.flow.blocks:
        for w in block.arn.w_out:
            w.add_((torch.randn(w.shape, generator=gen) * (20 * scale)).to(w.device))
        b = block.arn.b_out
        b.add_((torch.randn(b.shape, generator=gen) * scale).to(b.device))
        block.arn.apply_masks_()
    rho = guide.flow.affine.rho
    rho.add_((torch.randn(rho.shape, generator=gen) * 0.1).to(rho.device))  # drawn on the CPU: the same values anywhere


if __name__ == "__main__":
    main()
