"""The permutation-symmetry toy of Gelberg et al. (2024): mean field vs symmetrised guide.

Model: ``f(x) = ReLU(w1 x) + ReLU(w2 x)`` (no biases, output weights fixed at 1), data
``y = α|x|``, ``x ∼ U[−10, 10]``, Gaussian likelihood with noise ``σ`` (the paper does not
state it).  The posterior has two modes, ``(α, −α)`` and ``(−α, α)``: the group is
``G = S_2`` acting on the hidden weights, declared because the fixed output weights hide it
from discovery.  Both guides are scored on the symmetrised ELBO ``L^G`` computed *exactly in
G* (``pb.guides.symmetrized.symmetrized_elbo(..., exact=True)``), normalised by N, and on test MSE.

Paper setting (default): N = 100, batch 10, lr 5e-3, 10 epochs, K = 2, 10 seeds, the
paper's uniform estimator.  Converged σ: ``--converged`` (lr 5e-2 with a cosine schedule, 300
epochs, hidden weights initialised in U(−0.1, 0.1), initial σ 0.1, the local estimator);
it also prints the convergence evidence (the ELBO over the last 10% of epochs against the
10% before, and the largest |Δρ| against the sum of the learning rates).

    python examples/symmetric_toy.py                       # paper setting, σ = 0.4
    python examples/symmetric_toy.py --sigma 0.1
    python examples/symmetric_toy.py --converged --alphas 0.005 0.01 0.05 0.2
    python examples/symmetric_toy.py --alphas 0.002 0.005 0.01 --sigma 0.4   # modes overlap
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import pyro
import torch
from torch import nn

import pyro_bnn as pb

#: The paper's numbers (normalised symmetrised ELBO, test MSE); None where not reported.
PAPER = {0.05: {"mf_elbo": -0.009, "sym_elbo": -0.004, "mf_mse": None, "sym_mse": None},
         0.2: {"mf_elbo": -0.031, "sym_elbo": -0.019, "mf_mse": 0.18, "sym_mse": 0.12}}
SYMMETRY = [{"0.weight": 0}]


def make_model(sigma: float, seed: int, init_range: float | None = None) -> pb.BNN:
    """The toy network as a BNN whose only random weights are the two hidden ones.

    The hidden weights (the guide's initial means) are PyTorch's default ``U(−1, 1)`` for
    fan-in 1, or ``U(−init_range, init_range)``.
    """
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(1, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        if init_range is not None:
            net[0].weight.uniform_(-init_range, init_range)
        net[2].weight.fill_(1.0)
    net[2].weight.requires_grad_(False)
    return pb.BNN(net, "gaussian", noise=sigma, stochastic=["0.weight"])


def make_data(alpha: float, num_points: int, seed: int):
    gen = torch.Generator().manual_seed(10_000 + seed)
    x = torch.rand(num_points, 1, generator=gen) * 20 - 10
    return x, alpha * x.abs()


def run_one(kind: str, alpha: float, seed: int, args) -> dict:
    model = make_model(args.sigma, seed, args.init_range)
    if kind == "mf":
        guide = pb.guides.MeanField(model, init_scale=args.init_scale)
    else:
        guide = pb.guides.Symmetrized(model, num_permutations=args.K, permutations=SYMMETRY,
                                      estimator=args.estimator, init_scale=args.init_scale)
    x, y = make_data(alpha, args.num_points, seed)
    rho0 = math.log(args.init_scale)
    res = pb.fit(model, guide, (x, y), epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                 lr_schedule=args.lr_schedule, progress=False, seed=seed)
    steps = args.epochs * math.ceil(args.num_points / args.batch_size)
    sum_lr = args.lr * steps * (0.5 if args.lr_schedule == "cosine" else 1.0)
    rho = guide.loc_and_raw_scale("net.0.weight")[1].detach()
    history = res.history["elbo"]
    n10 = max(1, len(history) // 10)
    drift = (statistics.fmean(history[-n10:]) - statistics.fmean(history[-2 * n10:-n10])) / len(x) \
        if len(history) >= 2 * n10 else float("nan")
    pyro.set_rng_seed(1234 + seed)  # same ω draws for both guides' evaluations
    terms = pb.guides.symmetrized.symmetrized_elbo(model, guide, (x, y), permutations=SYMMETRY, exact=True,
                                num_samples=args.eval_samples, return_terms=True)
    x_test, y_test = make_data(alpha, 1000, 500 + seed)
    mean = pb.predict(model, guide, x_test, num_samples=100).mean(0)
    locs = guide.loc_and_scale("net.0.weight")[0].detach().flatten().tolist()
    scale = guide.loc_and_scale("net.0.weight")[1].detach().flatten().tolist()
    n = len(x)
    return {"lg": terms["symmetrized_elbo"] / n, "elbo": terms["elbo"] / n,
            "gap": terms["entropy_gap"], "mse": float(((mean - y_test) ** 2).mean()),
            "mu": locs, "sigma": scale, "drift": drift,
            "lr_limited": float((rho - rho0).abs().max()) / sum_lr}


def _fmt(v):
    return "   —   " if v is None else f"{v:+.4f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--sigma", type=float, default=0.4, help="likelihood noise std")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--num-points", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--K", type=int, default=None, help="num_permutations (default: the estimator's)")
    p.add_argument("--estimator", choices=["local", "uniform"], default="uniform")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--init-scale", type=float, default=1e-2, help="initial posterior std")
    p.add_argument("--init-range", type=float, default=None,
                   help="initial hidden weights U(-r, r) (default: PyTorch's U(-1, 1))")
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--converged", action="store_true",
                   help="lr 5e-2 cosine, 300 epochs, init U(-0.1, 0.1), σ0 0.1, local estimator")
    p.add_argument("--verbose", action="store_true", help="print every run's μ, σ")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (1 on a shared machine: tiny ops slow down with 2)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.converged:
        args.lr, args.lr_schedule, args.epochs = 5e-2, "cosine", max(args.epochs, 300)
        args.init_range, args.init_scale, args.estimator = 0.1, 0.1, "local"
    if args.K is None:
        args.K = 2 if args.estimator == "uniform" else 1
    t0 = time.perf_counter()
    print(f"# toy: sigma={args.sigma} N={args.num_points} batch={args.batch_size} lr={args.lr} "
          f"({args.lr_schedule}) epochs={args.epochs} estimator={args.estimator} K={args.K} "
          f"init_scale={args.init_scale} init_range={args.init_range} seeds={args.seeds}")
    print("| α | L^G/N MF | L^G/N Sym | ΔL^G/N (±se) | paper MF | paper Sym | gap MF | gap Sym "
          "| MSE MF | MSE Sym | paper MSE MF/Sym |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for alpha in args.alphas:
        res = {k: [run_one(k, alpha, s, args) for s in range(args.seeds)] for k in ("mf", "sym")}
        if args.verbose:
            for k in res:
                for s, r in enumerate(res[k]):
                    print(f"  α={alpha} {k} seed={s} μ={[round(m, 4) for m in r['mu']]} "
                          f"σ={[round(v, 4) for v in r['sigma']]} L^G/N={r['lg']:.5f} mse={r['mse']:.4f}")
        mean = {k: {m: statistics.fmean(r[m] for r in res[k]) for m in ("lg", "gap", "mse")} for k in res}
        for k in res:
            print(f"  α={alpha} {k}: last10%−prev10% ELBO/N {statistics.fmean(r['drift'] for r in res[k]):+.5f}, "
                  f"max |Δρ|/Σlr {max(r['lr_limited'] for r in res[k]):.4f}, "
                  f"σ {statistics.median(v for r in res[k] for v in r['sigma']):.4f} (median)")
        diffs = [b["lg"] - a["lg"] for a, b in zip(res["mf"], res["sym"])]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        paper = PAPER.get(alpha, {})
        paper_mse = (f"{paper['mf_mse']}/{paper['sym_mse']}" if paper.get("mf_mse") else "—")
        print(f"| {alpha} | {mean['mf']['lg']:+.5f} | {mean['sym']['lg']:+.5f} | "
              f"{statistics.fmean(diffs):+.5f} (±{se:.5f}) | {_fmt(paper.get('mf_elbo'))} | "
              f"{_fmt(paper.get('sym_elbo'))} | {mean['mf']['gap']:.3f} | {mean['sym']['gap']:.3f} | "
              f"{mean['mf']['mse']:.4f} | {mean['sym']['mse']:.4f} | {paper_mse} |", flush=True)
    print(f"# wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
