"""Seconds per epoch on full Fashion-MNIST (issue 27): MAP, plain-PyTorch references and the guides.

The real-scale networks of ``benchmarks/fashion_mnist.py`` (``mlp`` 784-200-200-10, ``cnn`` the
LeNet-5 style net), the 60,000 training images (``pb.datasets.fashion_mnist``), batch 128.  Per
architecture and guide, each method trains its own copy from the same initial state:

* ``map``: a plain PyTorch MAP step (mean cross-entropy, fused Adam lr 1e-3);
* ``<guide>:ref``: the same algorithm as the guide, as one plain PyTorch function (same
  sampling scheme, same KL, same optimiser and parameter groups, no library in the step);
* ``<guide>:loop``: the guide's own objective (``guide.make_objective(1)``) in a plain loop;
* ``<guide>:fit``: ``pb.fit``, one call per measurement with a persistent optimiser.

Guides: ``meanfield`` (``MeanField``, local reparameterisation: the default for both nets),
``hypernet0`` / ``hypernet8`` (``Hypernet`` over the weight-norm scales, 0 or 8 IAF blocks),
``symmetrized`` (``Symmetrized``, local bound, K = 1, its default local reparameterisation: the
gap on a weight draw of its own) and ``symmetrized_wn`` (the same with weight noise: one draw for
the data term and the gap).  References: MeanField for both nets
(:func:`meanfield_reference_loss`, a functional pass over the ``nn.Sequential``); Hypernet for
both (``benchmarks/bench_reference.py``'s: ``torch._weight_norm`` then ``F.linear`` on the MLP,
``F.conv2d``/``F.linear`` and the net's parameter-free layers on the CNN); Symmetrized for the
MLP only (its gap reference is written for MLPs; the default's is MeanField's reference plus
that gap on a draw of its own) — on the CNN it gets ``loop`` and ``fit`` rows
without a reference.

Every reference is checked against the library's loss and gradients on the same parameters
and noise before timing (the benchmark stops on a mismatch).

**Measured steps, extrapolated epochs.**  A measurement is ``--steps`` minibatch steps
(``map``/``ref``/``loop``: steps over a fixed shuffled prefix of the data, sliced in order,
or with ``--shuffled`` gathered from a fresh permutation of it per measurement as ``pb.fit``
does; ``fit``: ``pb.fit``
for one epoch over the first ``--steps`` × 128 images with ``num_data=60000``, so the loss has
the full-data scaling and the call's set-up is included, amortised over those steps); seconds
per epoch are the per-step median × 469 (= ⌈60000/128⌉).  ``pb.fit``'s set-up on the full
60,000 images (``epochs=0``: validation, fingerprint, snapshot) is measured separately and
reported per call.  With ``--fit-epoch`` each guide's ``pb.fit`` also runs 2 epochs in one call,
and ``fit epoch`` = (2 epochs − 1 epoch) per repeat is what one more epoch of a fit costs, without
the per-call set-up (which a real fit pays once); ``--compile`` adds the same for
``pb.fit(compile=True)`` (``fitc``, ``fitc epoch``).  Measurements of all methods are interleaved ``--repeats`` times; medians of
process CPU and wall time.  Peak memory: the growth of the process's peak RSS during a
measurement over its RSS at the start (Linux ``/proc/self/clear_refs``; CPU), or
``torch.cuda.max_memory_allocated`` (CUDA).

    python benchmarks/bench_fmnist_speed.py --arch mlp --threads 1 --steps 200 --repeats 3
    python benchmarks/bench_fmnist_speed.py --arch cnn --guides meanfield hypernet0 --threads 2
    python benchmarks/bench_fmnist_speed.py --arch mlp --check-only
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
from _common import sync  # benchmarks/_common.py (on sys.path when run as a script)
from bench_reference import (
    _perturb_flow,
    check_symmetrized,
    hypernet_reference_leaves,
    hypernet_reference_loss,
    hypernet_reference_params,
    mlp_layers,
    mlp_permutation_groups,
    run_checks,
    symmetrized_reference_gap,
    symmetrized_reference_loss,
    symmetrized_reference_optimizer,
    symmetrized_reference_params,
)
from fashion_mnist import make_net
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.data.batches import TensorBatches
from pyro_bnn.training.guide_setup import setup_guide
from pyro_bnn.training.optimizer import default_optimizer

GUIDES = ("meanfield", "hypernet0", "hypernet8", "symmetrized", "symmetrized_wn")
NUM_TRAIN = 60_000


# ========================================================== MeanField: the reference
def meanfield_reference_params(model, guide) -> dict:
    """Leaf copies of a set-up local-reparameterisation :class:`~pyro_bnn.guides.MeanField`
    guide's μ and ρ (``σ = exp ρ``) per Linear/Conv layer of ``model.net`` (an
    ``nn.Sequential``), the N(0, s²) prior scales and the means' learning-rate factors
    (set-up only: the step touches none of the library)."""
    if guide.scale_parameterization != "exp" or not guide.local_reparameterization:
        raise ValueError("the reference covers σ = exp(ρ) with local reparameterisation only")
    net = model.net
    if not isinstance(net, nn.Sequential):
        raise ValueError("the reference runs an nn.Sequential")
    factors = guide.loc_lr_factors()
    layers = []
    for i, module in enumerate(net):
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            sites = [f"net.{i}.weight"] + ([f"net.{i}.bias"] if module.bias is not None else [])
            entry = {"module": module, "sites": sites}
            for site in sites:
                loc, s = model.site_normal_prior(site)
                if float(loc) != 0.0 or loc.numel() != 1 or s.numel() != 1:
                    raise ValueError("the reference assumes an i.i.d. N(0, s²) prior per site")
                mu, rho = guide.loc_and_raw_scale(site)
                entry[site] = {"mu": _leaf(mu), "rho": _leaf(rho), "s": float(s), "factor": factors[site]}
            layers.append(entry)
        elif any(True for _ in module.parameters()):
            raise ValueError(f"a parametrised {type(module).__name__} is not covered")
        else:
            layers.append({"module": module})
    return {"layers": layers}


def meanfield_reference_loss(p: dict, x, y, num_data: int, parts: bool = False):
    """``−(N/M) log p(y|x) + KL(q‖p)`` with local reparameterisation, plain PyTorch: per
    Linear/Conv layer the output ``layer(x; μ) + √(layer(x²; σ²)) ε`` (variance clamped at
    1e-30), ``σ = exp ρ``; ``KL = Σ ½ (σ² + μ²)/s² − ρ + log s − ½`` per weight."""
    f, kl = x, 0.0
    for entry in p["layers"]:
        module = entry["module"]
        if "sites" not in entry:
            f = module(f)   # ReLU, MaxPool2d, Flatten: parameter-free torch modules
            continue
        w, b = (entry[s] for s in entry["sites"]) if len(entry["sites"]) == 2 else (entry[entry["sites"][0]], None)
        sw = torch.exp(w["rho"])
        sb = None if b is None else torch.exp(b["rho"])
        if isinstance(module, nn.Linear):
            mean = F.linear(f, w["mu"], None if b is None else b["mu"])
            var = F.linear(f * f, sw * sw, None if b is None else sb * sb)
        else:
            conv = dict(stride=module.stride, padding=module.padding, dilation=module.dilation, groups=module.groups)
            mean = F.conv2d(f, w["mu"], None if b is None else b["mu"], **conv)
            var = F.conv2d(f * f, sw * sw, None if b is None else sb * sb, **conv)
        f = mean + var.clamp_min(1e-30).sqrt() * torch.empty_like(mean).normal_()
        for site, s in ((w, sw), (b, sb)):
            if site is not None:
                inv = 1.0 / (site["s"] * site["s"])
                kl = kl + (0.5 * inv * (s.square().sum() + site["mu"].square().sum()) - site["rho"].sum()
                           + site["mu"].numel() * (math.log(site["s"]) - 0.5))
    nll = F.cross_entropy(f, y, reduction="sum") * (num_data / len(x))
    loss = nll + kl
    return (loss, {"nll": nll, "kl": kl}) if parts else loss


def meanfield_reference_leaves(p: dict) -> list[torch.Tensor]:
    return [e[s][k] for e in p["layers"] for s in e.get("sites", ()) for k in ("mu", "rho")]


def meanfield_reference_optimizer(p: dict, lr: float):
    """Fused Adam with the guide's groups: each mean at ``lr × factor``, ρ and the rest at ``lr``."""
    groups: dict[float, list] = {1.0: []}
    for e in p["layers"]:
        for s in e.get("sites", ()):
            groups.setdefault(e[s]["factor"], []).append(e[s]["mu"])
            groups[1.0].append(e[s]["rho"])
    return torch.optim.Adam([{"params": ps, "lr": lr * f} for f, ps in groups.items() if ps], lr=lr, fused=True)


def check_meanfield(model, guide, x, y, num_data: int, seed: int = 1) -> dict:
    """Library loss and gradients vs the reference's at the guide's parameters and the same noise."""
    p = meanfield_reference_params(model, guide)
    objective = guide.make_objective(1)
    sites = [s for e in p["layers"] for s in e.get("sites", ())]
    with local_params(model, guide):
        torch.manual_seed(seed)
        loss_lib = objective(model, guide, x, y, num_data)
        loss_lib = loss_lib[0] if isinstance(loss_lib, tuple) else loss_lib
        grads_lib = torch.autograd.grad(loss_lib, [t for s in sites for t in guide.loc_and_raw_scale(s)])
    torch.manual_seed(seed)
    loss_ref, parts = meanfield_reference_loss(p, x, y, num_data, parts=True)
    grads_ref = torch.autograd.grad(loss_ref, meanfield_reference_leaves(p))
    rel = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads_lib, grads_ref)]
    loss_lib, loss_ref = loss_lib.detach(), loss_ref.detach()
    return {"loss_lib": float(loss_lib), "loss_ref": float(loss_ref),
            "rel_loss": abs(float(loss_lib) - float(loss_ref)) / abs(float(loss_ref)), "max_rel_grad": max(rel)}


def symmetrized_local_reference_params(model, guide) -> dict:
    """MeanField's local-reparameterisation reference leaves (:func:`meanfield_reference_params`)
    plus the site order and the MLP's permutation groups, for ``Symmetrized``'s default path."""
    if guide.estimator != "local" or guide.num_permutations != 1:
        raise ValueError("the reference covers the default local bound with K = 1")
    p = meanfield_reference_params(model, guide)
    p["sites"] = guide.site_names()
    p["leaves"] = {s: e[s] for e in p["layers"] for s in e.get("sites", ())}
    if sorted(p["leaves"]) != sorted(p["sites"]) or any(e[s]["s"] != 1.0 for e in p["layers"]
                                                         for s in e.get("sites", ())):
        raise ValueError("the reference covers an MLP BNN with N(0, 1) priors on every weight and bias")
    p["groups"] = mlp_permutation_groups(mlp_layers(p["sites"]))
    return p


def symmetrized_local_reference_loss(p: dict, x, y, num_data: int, parts: bool = False):
    """``−ELBO − gap`` as ``Symmetrized``'s default computes it: the data term and KL of
    :func:`meanfield_reference_loss` (pre-activation noise), then one weight draw
    ``ω = μ + exp(ρ) ε`` of its own (sites in order) for the local gap bound."""
    neg_elbo = meanfield_reference_loss(p, x, y, num_data)
    locs = {s: p["leaves"][s]["mu"] for s in p["sites"]}
    sigmas = {s: torch.exp(p["leaves"][s]["rho"]) for s in p["sites"]}
    values = {s: locs[s] + sigmas[s] * torch.empty_like(locs[s]).normal_() for s in p["sites"]}
    gap = symmetrized_reference_gap(values, locs, sigmas, p["groups"])
    loss = neg_elbo - gap
    return (loss, {"elbo": -neg_elbo, "entropy_gap": gap}) if parts else loss


def check_symmetrized_local(model, guide, x, y, num_data: int, seed: int = 1) -> dict:
    """Library loss, entropy gap and gradients vs the local-reparameterisation reference's
    (same parameters, same noise; ``bench_reference.check_symmetrized``)."""
    return check_symmetrized(model, guide, x, y, num_data, seed, reference=(
        symmetrized_local_reference_params, symmetrized_local_reference_loss,
        lambda p: [p["leaves"][s][k] for s in p["sites"] for k in ("mu", "rho")]))


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


# ================================================================== building the rows
def build(name: str, arch: str, seed: int = 0, device="cpu"):
    """``(model, guide, reference kind or None)`` for one guide on one architecture."""
    torch.manual_seed(seed)
    net = make_net(arch).to(device)
    if name == "meanfield":
        model = pb.BNN(net, "categorical")
        return model, pb.guides.MeanField(model), "meanfield"
    if name.startswith("hypernet"):
        model = pb.BNN(net, "categorical", weight_norm=True)
        guide = pb.guides.Hypernet(model, flow="iaf", num_flows=int(name[len("hypernet"):]), hidden=200)
        return model, guide, "hypernet"
    model = pb.BNN(net, "categorical")
    if name == "symmetrized_wn":   # weight noise: one draw ω for the data term and the gap
        guide = pb.guides.Symmetrized(model, local_reparameterization=False)
        return model, guide, "symmetrized" if arch == "mlp" else None
    return model, pb.guides.Symmetrized(model), "symmetrized_local" if arch == "mlp" else None


def check(name, kind, model, guide, x, y, tol):
    if kind in ("meanfield", "symmetrized_local"):
        res = (check_meanfield if kind == "meanfield" else check_symmetrized_local)(model, guide, x, y, NUM_TRAIN)
        ok = (res["rel_loss"] <= tol and res["max_rel_grad"] <= 100 * tol
              and res.get("rel_entropy_gap", 0.0) <= 10 * tol)
        gap = (f"entropy_gap lib {res['entropy_gap_lib']:.6f} ref {res['entropy_gap_ref']:.6f} "
               f"(rel {res['rel_entropy_gap']:.1e}), " if "rel_entropy_gap" in res else "")
        print(f"  check {name}: loss lib {res['loss_lib']:.6f} ref {res['loss_ref']:.6f} (rel {res['rel_loss']:.1e}), "
              f"{gap}max rel. gradient difference {res['max_rel_grad']:.1e} -> {'OK' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            raise SystemExit(f"{name}: the reference does not compute the library's loss")
        return res
    return run_checks(name, model, guide, x, y, NUM_TRAIN, tol)


def methods_for(name, arch, x, y, args, batches, fit_data):
    """``{label: run()}``: one measurement (``args.steps`` steps) per call."""
    model, guide, kind = build(name, arch, device=x.device)
    setup_guide(model, guide, x[:2], y[:2], NUM_TRAIN)
    lr = pb.guides.guide_contract(guide).learning_rate(NUM_TRAIN) or 1e-3   # pb.fit's default rate
    out = {}
    if kind is not None:
        if kind == "meanfield":
            p = meanfield_reference_params(model, guide)
            loss_fn, opt = meanfield_reference_loss, meanfield_reference_optimizer(p, lr)
        elif kind == "symmetrized_local":
            p = symmetrized_local_reference_params(model, guide)
            loss_fn, opt = symmetrized_local_reference_loss, meanfield_reference_optimizer(p, lr)
        elif kind == "hypernet":
            p = hypernet_reference_params(model, guide)
            loss_fn = hypernet_reference_loss
            opt = torch.optim.Adam(hypernet_reference_leaves(p), lr=lr, fused=True)
        else:
            p = symmetrized_reference_params(model, guide)
            loss_fn, opt = symmetrized_reference_loss, symmetrized_reference_optimizer(p, lr)

        def run_ref():
            for xb, yb in batches:
                loss = loss_fn(p, xb, yb, NUM_TRAIN)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        out[f"{name}:ref"] = run_ref
    model_l, guide_l = copy.deepcopy(model), copy.deepcopy(guide)
    with local_params(model_l, guide_l):
        params = list(model_l.parameters()) + list(guide_l.parameters())
    opt_l = default_optimizer(params, lr, pb.guides.guide_contract(guide_l).learning_rate_factors())
    objective = guide_l.make_objective(1)

    def run_loop():
        with local_params(model_l, guide_l):
            for xb, yb in batches:
                loss = objective(model_l, guide_l, xb, yb, NUM_TRAIN)
                loss = loss[0] if isinstance(loss, tuple) else loss
                opt_l.zero_grad(set_to_none=True)
                loss.backward()
                opt_l.step()
    out[f"{name}:loop"] = run_loop
    store = {}

    def run_fit(data=fit_data, epochs=1, compile=False, cuda_graph=False):
        with warnings.catch_warnings():   # timed single epochs: nothing to judge
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            pb.fit(model, guide, data, epochs=epochs, batch_size=args.batch_size, num_data=NUM_TRAIN,
                   optimizer=lambda ps: store.setdefault("opt", default_optimizer(
                       ps, lr, pb.guides.guide_contract(guide).learning_rate_factors())),
                   lr_schedule="constant", progress=False, compile=compile,
                   **({"cuda_graph": True} if cuda_graph else {}))
    out[f"{name}:fit"] = run_fit
    if args.fit_epoch:   # a second epoch in the same call: (fit2 − fit) is what an epoch costs in a fit
        out[f"{name}:fit2"] = lambda: run_fit(epochs=2)
    if args.compile:
        out[f"{name}:fitc"] = lambda: run_fit(compile=True)
        out[f"{name}:fitc2"] = lambda: run_fit(epochs=2, compile=True)
    if args.cuda_graph:
        out[f"{name}:fitg"] = lambda: run_fit(cuda_graph=True)
        out[f"{name}:fitg2"] = lambda: run_fit(epochs=2, cuda_graph=True)
    return out, (model, guide, kind), run_fit


class ShuffledBatches:
    """Minibatches of ``(x, y)`` from a fresh permutation at every pass, gathered with
    ``index_select``: what any plain training loop that reshuffles each epoch does (and
    ``pb.fit``), so the references pay the same gather per batch as the fit."""

    def __init__(self, x, y, batch_size: int, seed: int = 0):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        perm = torch.randperm(len(self.x), generator=self.generator).to(self.x.device)
        for idx in perm.split(self.batch_size):
            yield torch.index_select(self.x, 0, idx), torch.index_select(self.y, 0, idx)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def measure(run, device) -> tuple[float, float, float]:
    """``(cpu s, wall s, peak memory MiB)`` of one call of ``run``."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _rss_kib("VmRSS") if _reset_peak() else None
    c0, t0 = time.process_time(), time.perf_counter()
    run()
    sync(device)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        peak = (_rss_kib("VmHWM") - base) / 1024 if base is not None else math.nan
    return cpu, wall, peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--guides", nargs="+", default=list(GUIDES), choices=GUIDES)
    ap.add_argument("--steps", type=int, default=200, help="minibatch steps per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved measurements per method")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--no-fit-setup", action="store_true", help="skip the full-data pb.fit set-up measurement")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shuffled", action="store_true",
                    help="map/ref/loop draw their minibatches from a fresh permutation per measurement "
                         "(a gather per batch, as pb.fit does) instead of slicing a fixed prefix")
    ap.add_argument("--fit-epoch", action="store_true",
                    help="also time pb.fit for 2 epochs: 'fit epoch' = (2 epochs − 1 epoch), an epoch of "
                         "a fit without the per-call set-up")
    ap.add_argument("--compile", action="store_true",
                    help="also time pb.fit(compile=True) (1 and 2 epochs; compiled during the warm-up)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also pb.fit(cuda_graph=True) (fitg; with --fit-epoch its marginal epoch): CUDA only")
    ap.add_argument("--out", default=None, help="append the result as one JSON line here")
    ap.add_argument("--memory", action="store_true",
                    help="instead of timing: each method's peak memory, one fresh process per method")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)   # (one method, for --memory)
    args = ap.parse_args(argv)
    if args.memory:
        return memory_table(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x, y = pb.datasets.fashion_mnist(split="train", flatten=args.arch == "mlp")
    x, y = x.to(device), y.to(device)
    n_steps = math.ceil(len(x) / args.batch_size)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=gen)[: args.steps * args.batch_size].to(device)
    xs, ys = x[perm], y[perm]
    batches = ShuffledBatches(xs, ys, args.batch_size) if args.shuffled else \
        TensorBatches(xs, ys, args.batch_size, shuffle=False)
    checks = {}
    if args.only is not None:   # one method in this process: no checks, no full-data set-up timing
        args.guides = [g for g in args.guides if args.only.startswith(g + ":")]
        args.no_fit_setup = True
    for name in args.guides if args.only is None else ():
        model, guide, kind = build(name, args.arch, device=device)
        if kind is None:
            print(f"  {name} on {args.arch}: no plain-PyTorch reference for this architecture (loop and fit only)")
            continue
        setup_guide(model, guide, x[:2], y[:2], NUM_TRAIN)
        if name.startswith("hypernet"):   # off the flow's identity start, so the check covers it
            _perturb_flow(guide)
        checks[name] = check(name, kind, model, guide, xs[:args.batch_size], ys[:args.batch_size], args.tol)
    if args.check_only:
        return checks
    torch.manual_seed(0)
    net_map = make_net(args.arch).to(device)
    opt_map = torch.optim.Adam(net_map.parameters(), lr=1e-3, fused=device.type in ("cpu", "cuda"))

    def run_map():
        for xb, yb in batches:
            loss = F.cross_entropy(net_map(xb), yb)
            opt_map.zero_grad(set_to_none=True)
            loss.backward()
            opt_map.step()
    methods = {"map": run_map}
    fit_setup = {}
    for name in args.guides:
        ms, (model, guide, _), run_fit = methods_for(name, args.arch, x, y, args, batches, (xs, ys))
        methods.update(ms)
        if not args.no_fit_setup:   # pb.fit's per-call set-up on the full data set
            run_fit((x, y), 0)
            fit_setup[name] = statistics.median(measure(lambda f=run_fit: f((x, y), 0), device)[0]
                                                for _ in range(3))
    if args.only is not None:   # the first measurement, from a fresh state: Adam's moments are created in it
        cpu, wall, peak = measure(methods[args.only], device)
        print(json.dumps({"method": args.only, "peak_mib": peak}))
        return peak
    for run in methods.values():   # warm-up
        run()
    res = {k: {"cpu": [], "wall": [], "peak_mib": []} for k in methods}
    for _ in range(args.repeats):
        for key, run in methods.items():
            cpu, wall, peak = measure(run, device)
            res[key]["cpu"].append(cpu / args.steps)
            res[key]["wall"].append(wall / args.steps)
            res[key]["peak_mib"].append(peak)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    for key in [k for k in res if k.endswith((":fit2", ":fitc2", ":fitg2"))]:   # the marginal epoch, per repeat
        one = res[key[:-1]]
        res[key[:-1] + " epoch"] = {m: [b - a for a, b in zip(one[m], res[key][m])] for m in ("cpu", "wall")}
        res[key[:-1] + " epoch"]["peak_mib"] = res[key]["peak_mib"]
        methods[key[:-1] + " epoch"] = None
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in res.items()}
    print(f"Fashion-MNIST {len(x)} train, {args.arch}, batch {args.batch_size}, {args.device}, torch threads "
          f"{torch.get_num_threads()}, {args.repeats} measurements of {args.steps} steps per method, load "
          f"{' '.join(load)}; s/epoch = per-step median x {n_steps}")
    paired = paired_ratios(res)
    print(f"  {'method':22s} {'cpu s/ep':>9s} {'wall s/ep':>9s} {'/ref cpu':>8s} {'paired':>7s} {'/map cpu':>8s} "
          f"{'peak MiB':>9s}")
    for key in methods:
        if key.endswith("2"):   # the 2-epoch calls: shown as their difference, "... epoch"
            continue
        ref = key.split(":")[0] + ":ref"
        r_ref = med[key]["cpu"] / med[ref]["cpu"] if ref in med else float("nan")
        print(f"  {key:22s} {med[key]['cpu'] * n_steps:9.2f} {med[key]['wall'] * n_steps:9.2f} {r_ref:8.2f} "
              f"{paired.get(key, float('nan')):7.2f} {med[key]['cpu'] / med['map']['cpu']:8.2f} "
              f"{med[key]['peak_mib']:9.1f}")
    print("  (/ref cpu: ratio of the medians; paired: median over the repeats of method / reference in the same "
          "repeat, the figure that load changes between repeats disturbs least)")
    for name, secs in fit_setup.items():
        print(f"  pb.fit set-up per call on the 60,000 images ({name}): {secs:.3f} cpu s")
    row = {"args": vars(args), "load": load, "steps_per_epoch": n_steps, "median": med, "paired_ratio": paired,
           "all": res,
           "fit_setup_cpu_s": fit_setup, "checks": checks}
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return row


def paired_ratios(res: dict) -> dict:
    """``{method: median over repeats of cpu(method) / cpu(its reference)}``, pairing the
    measurements of one interleaved repeat (methods without a ``<guide>:ref`` are left out)."""
    out = {}
    for key, v in res.items():
        ref = key.split(":")[0] + ":ref"
        if ref in res and key != ref and not key.endswith("2"):
            out[key] = statistics.median(a / b for a, b in zip(v["cpu"], res[ref]["cpu"]))
    return out


def memory_table(args) -> dict:
    """Peak memory per method: each in a fresh process (``--only``) over ``--steps`` steps from
    its initial state, data and model loaded first: on the CPU the growth of the peak RSS over
    the RSS before the steps (what the step's activations, gradients and optimiser state add),
    on CUDA ``max_memory_allocated`` over ``memory_allocated``."""
    import subprocess
    import sys
    keys = ["map"]
    for name in args.guides:
        kind = build(name, args.arch)[2]
        keys += ([f"{name}:ref"] if kind is not None else []) + [f"{name}:loop", f"{name}:fit"]
    out = {}
    for key in keys:
        cmd = [sys.executable, __file__, "--arch", args.arch, "--threads", str(args.threads), "--device",
               args.device, "--steps", str(args.steps), "--only", key]
        line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        out[key] = json.loads(line)["peak_mib"]
        print(f"  {key:22s} peak memory over the start: {out[key]:8.1f} MiB", flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps({"args": vars(args), "peak_mib": out}) + "\n")
    return out


if __name__ == "__main__":
    main()
