"""Symmetrised vs mean-field VI on MNIST 5k/5k: step cost and accuracy.

Paper setting (Gelberg et al. 2024, MNIST): one hidden layer of width 30, 10 epochs, batch
100, Adam lr 1e-3; MeanField vs Symmetrized with K = 5/10/20 (full MNIST in the paper:
95.43% vs 95.53–95.55%).  Here: the 5k/5k split of ``pb.datasets.mnist_split``.

Timing: median wall time of one training step (loss, backward, Adam) for MeanField and
Symmetrized(K) on the same MLP and batches, interleaved in the same process; the ratio
against MeanField is the claim (target: K = 10 ≤ 2×).

    python benchmarks/bench_symmetrized.py --data-dir ../shared/data/mnist
    python benchmarks/bench_symmetrized.py --quick            # few steps, 1 seed, 1 epoch
    python benchmarks/bench_symmetrized.py --skip-accuracy     # timing only
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn._local_params import local_params
from pyro_bnn.training import setup_guide


def make_guide(kind: str, model, K: int):
    if kind == "meanfield":
        return pb.guides.MeanField(model)
    return pb.guides.Symmetrized(model, num_permutations=K)


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, 10))


def time_steps(x, y, width, Ks, steps, batch, device, repeats=5):
    """Median seconds per training step for each guide, interleaved over ``repeats`` rounds."""
    configs = [("meanfield", 1)] + [("symmetrized", K) for K in Ks]
    states = []
    for kind, K in configs:
        torch.manual_seed(0)
        model = pb.BNN(mlp(width)).to(device)
        guide = make_guide(kind, model, K)
        setup_guide(model, guide, x[:batch], y[:batch], len(x))
        guide.to(device)
        params = list(guide.parameters())
        states.append((kind, K, model, guide, guide.make_objective(1), torch.optim.Adam(params, lr=1e-3)))
    times = {(k, K): [] for k, K, *_ in states}
    with local_params(*[s[2] for s in states], *[s[3] for s in states]):
        for _ in range(repeats):
            for kind, K, model, guide, objective, opt in states:
                for i in range(steps + 3):
                    if i == 3:
                        _sync(device)
                        t0 = time.perf_counter()
                    j = (i * batch) % (len(x) - batch)
                    out = objective(model, guide, x[j:j + batch], y[j:j + batch], num_data=len(x))
                    loss = out[0] if isinstance(out, tuple) else out
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                _sync(device)
                times[(kind, K)].append((time.perf_counter() - t0) / steps)
    return {key: statistics.median(v) for key, v in times.items()}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def accuracy_runs(split, width, Ks, seeds, epochs, batch, lr, device, lg_permutations, lg_samples):
    rows = []
    for kind, K in [("meanfield", 1)] + [("symmetrized", K) for K in Ks]:
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = pb.BNN(mlp(width))
            guide = make_guide(kind, model, K)
            t0 = time.perf_counter()
            res = pb.fit(model, guide, split.train, epochs=epochs, batch_size=batch, lr=lr,
                         device=device, progress=False, seed=seed)
            fit_s = time.perf_counter() - t0
            metrics = pb.evaluate(model, guide, split.x_test.to(device), split.y_test.to(device),
                                  num_samples=32)
            pyro.set_rng_seed(100 + seed)
            sym = guide if kind == "symmetrized" else pb.guides.Symmetrized(model, num_permutations=2)
            groups = sym.symmetry() if kind == "symmetrized" else [
                {"net.0.weight": 0, "net.0.bias": 0, "net.2.weight": 1}]
            terms = pb.symmetrized_elbo(model, guide, (split.x_train, split.y_train),
                                        num_permutations=lg_permutations, permutations=groups,
                                        num_samples=lg_samples, return_terms=True)
            rows.append({"kind": kind, "K": K, "seed": seed, "acc": metrics["accuracy"],
                         "nll": metrics["nll"], "elbo": terms["elbo"] / len(split.x_train),
                         "lg": terms["symmetrized_elbo"] / len(split.x_train),
                         "gap": terms["entropy_gap"], "fit_s": fit_s,
                         "train_gap": res.history.get("entropy_gap", [0.0])[-1]})
            print(f"  {kind:11s} K={K:2d} seed={seed} acc={metrics['accuracy']:.4f} "
                  f"nll={metrics['nll']:.4f} ELBO/N={rows[-1]['elbo']:.4f} L^G/N={rows[-1]['lg']:.4f} "
                  f"gap={terms['entropy_gap']:.3f} fit={fit_s:.1f}s", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--width", type=int, default=30)
    p.add_argument("--Ks", type=int, nargs="+", default=[5, 10, 20])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=50, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--lg-permutations", type=int, default=500)
    p.add_argument("--lg-samples", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.steps, args.repeats, args.lg_samples = 1, 1, 10, 2, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    split = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
    print(f"# MNIST 5k/5k, 784-{args.width}-10, batch {args.batch_size}, device {args.device}, "
          f"torch threads {torch.get_num_threads()}")
    if not args.skip_timing:
        x, y = split.x_train.to(args.device), split.y_train.to(args.device)
        med = time_steps(x, y, args.width, args.Ks, args.steps, args.batch_size, args.device, args.repeats)
        base = med[("meanfield", 1)]
        print("| guide | K | median step (ms) | ratio vs MeanField |")
        print("|---|---|---|---|")
        for (kind, K), t in med.items():
            print(f"| {kind} | {K} | {1e3 * t:.2f} | {t / base:.2f} |")
    if not args.skip_accuracy:
        t0 = time.perf_counter()
        rows = accuracy_runs(split, args.width, args.Ks, args.seeds, args.epochs, args.batch_size,
                             args.lr, args.device, args.lg_permutations, args.lg_samples)
        print(f"| guide | K | accuracy (mean ± sd over {args.seeds} seeds) | test NLL | ELBO/N | "
              f"L^G/N (K={args.lg_permutations}) | Ĥ−H(q) |")
        print("|---|---|---|---|---|---|---|")
        for kind, K in [("meanfield", 1)] + [("symmetrized", K) for K in args.Ks]:
            sel = [r for r in rows if r["kind"] == kind and r["K"] == K]
            acc = [r["acc"] for r in sel]
            sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
            mean = lambda key, sel=sel: statistics.fmean(r[key] for r in sel)  # noqa: E731
            print(f"| {kind} | {K} | {100 * statistics.fmean(acc):.2f} ± {100 * sd:.2f} | "
                  f"{mean('nll'):.4f} | {mean('elbo'):.4f} | {mean('lg'):.4f} | {mean('gap'):.2f} |")
        print(f"# accuracy runs: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
