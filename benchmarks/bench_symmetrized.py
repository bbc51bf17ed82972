"""Symmetrised vs mean-field VI: step cost, and converged fits on MNIST 5k or digits.

Timing (``--skip-converged`` for timing only): median time of one training step (loss,
backward, Adam) for MeanField and Symmetrized on the same MLP and batches, interleaved in
the same process; the ratio against MeanField is the claim (target: the default
``Symmetrized(model)`` ≤ 2×).  Wall-clock and process CPU time are both reported: on a
shared machine the CPU time is the steadier of the two.

Converged fits (``--skip-timing`` for these only): MeanField vs Symmetrized (local
estimator by default) trained to convergence (``init_scale`` 0.1, Adam lr 5e-2 with a cosine
schedule, 300 epochs), several seeds.  Per fit: full-data ELBO and symmetrised ELBO ``L^G``
(both evaluated for every guide with ``pb.symmetrized_elbo``, local estimator, the same ω
draws), test accuracy / NLL / ECE, and convergence evidence: the epoch-mean ELBO over the
last 10% of epochs against the 10% before, the movement of the scale parameters ρ over the
last 10% of epochs relative to their whole movement, and the largest |Δρ| relative to the
sum of the learning rates (Adam moves a parameter by at most about lr per step, so a ratio
near 1 would mean lr-limited scales).

    python benchmarks/bench_symmetrized.py --skip-converged --threads 1
    python benchmarks/bench_symmetrized.py --skip-timing --dataset digits --threads 1
    python benchmarks/bench_symmetrized.py --skip-timing --dataset mnist --threads 1
    python benchmarks/bench_symmetrized.py --quick              # a few steps / epochs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import pyro
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn._local_params import local_params
from pyro_bnn.training import setup_guide

DEFAULT_WIDTH = {"mnist": 30, "digits": 100}
DEFAULT_BATCH = {"mnist": 100, "digits": 64}


def load(dataset: str, data_dir: str):
    if dataset == "mnist":
        return pb.datasets.mnist_split(data_dir, 5000, 5000)
    return pb.datasets.digits()


def mlp(inputs: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, 10))


def make_guide(kind: str, model, K: int | None, init_scale: float):
    """``kind``: "meanfield", "local" or "uniform" (Symmetrized with that estimator)."""
    if kind == "meanfield":
        return pb.guides.MeanField(model, init_scale=init_scale)
    return pb.guides.Symmetrized(model, num_permutations=K, estimator=kind, init_scale=init_scale)


# ---------------------------------------------------------------------------- timing
def time_steps(x, y, width, configs, steps, batch, device, repeats):
    """Median (wall, CPU) seconds per training step of each ``(kind, K)``, interleaved."""
    states = []
    for kind, K in configs:
        torch.manual_seed(0)
        model = pb.BNN(mlp(x.shape[1], width)).to(device)
        guide = make_guide(kind, model, K, 0.1)
        setup_guide(model, guide, x[:batch], y[:batch], len(x))
        guide.to(device)
        params = list(guide.parameters())
        states.append(((kind, K), model, guide, guide.make_objective(1), torch.optim.Adam(params, lr=1e-3)))
    wall = {key: [] for key, *_ in states}
    cpu = {key: [] for key, *_ in states}
    with local_params(*[s[1] for s in states], *[s[2] for s in states]):
        for _ in range(repeats):
            for key, model, guide, objective, opt in states:
                for i in range(steps + 3):
                    if i == 3:
                        _sync(device)
                        t0, c0 = time.perf_counter(), time.process_time()
                    j = (i * batch) % (len(x) - batch)
                    out = objective(model, guide, x[j:j + batch], y[j:j + batch], num_data=len(x))
                    loss = out[0] if isinstance(out, tuple) else out
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                _sync(device)
                wall[key].append((time.perf_counter() - t0) / steps)
                cpu[key].append((time.process_time() - c0) / steps)
    return ({k: statistics.median(v) for k, v in wall.items()},
            {k: statistics.median(v) for k, v in cpu.items()})


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# -------------------------------------------------------------------- converged fits
def _raw_scales(guide) -> torch.Tensor:
    return torch.cat([guide.loc_and_raw_scale(n)[1].detach().flatten().clone() for n in guide.site_names()])


def converged_run(split, kind, K, seed, args) -> dict:
    torch.manual_seed(seed)
    model = pb.BNN(mlp(split.x_train.shape[1], args.width))
    guide = make_guide(kind, model, K, args.init_scale)
    snapshots = {}
    mark = max(1, args.epochs - max(1, args.epochs // 10))  # start of the last 10% of epochs

    def on_epoch_end(ctx, _hook=guide.on_epoch_end):
        _hook(ctx)
        if ctx.epoch + 1 in (1, mark):
            snapshots[ctx.epoch + 1] = _raw_scales(guide)

    setup_guide(model, guide, split.x_train[:args.batch_size], split.y_train[:args.batch_size],
                len(split.x_train))
    rho0 = _raw_scales(guide)
    guide.on_epoch_end = on_epoch_end
    t0 = time.perf_counter()
    res = pb.fit(model, guide, split.train, epochs=args.epochs, batch_size=args.batch_size,
                 lr=args.lr, lr_schedule="cosine", progress=False, seed=seed)
    fit_s = time.perf_counter() - t0
    del guide.on_epoch_end
    rho = _raw_scales(guide)
    steps = args.epochs * math.ceil(len(split.x_train) / args.batch_size)
    sum_lr = args.lr * steps / 2                     # Σ_t lr_t of the cosine schedule
    moved = (rho - rho0).abs()
    late = (rho - snapshots.get(mark, rho)).abs()
    history = res.history["elbo"]
    n10 = max(1, len(history) // 10)
    metrics = pb.evaluate(model, guide, split.x_test, split.y_test, num_samples=args.test_samples)
    pyro.set_rng_seed(100 + seed)                    # the same ω draws for every guide
    terms = pb.symmetrized_elbo(model, guide, split.train, num_permutations=args.eval_permutations,
                                num_samples=args.eval_samples, return_terms=True)
    n = len(split.x_train)
    row = {"kind": kind, "K": K, "seed": seed, "fit_s": fit_s,
           "acc": metrics["accuracy"], "nll": metrics["nll"], "ece": metrics["ece"],
           "elbo": terms["elbo"] / n, "lg": terms["symmetrized_elbo"] / n, "gap": terms["entropy_gap"],
           "log_group_order": terms["log_group_order"],
           "elbo_last10": statistics.fmean(history[-n10:]) / n,
           "elbo_prev10": statistics.fmean(history[-2 * n10:-n10]) / n,
           "train_gap_last10": statistics.fmean(res.history.get("entropy_gap", [0.0])[-n10:]),
           "rho_max_move_over_sum_lr": float(moved.max()) / sum_lr,
           "rho_late_over_total_median": float((late / moved.clamp_min(1e-12)).median()),
           "rho_moved_median": float(moved.median()),
           "sigma_median": float(rho.exp().median()) if guide.scale_parameterization == "exp" else None,
           "history": history}
    print(f"  {kind:9s} K={K} seed={seed} acc={row['acc']:.4f} nll={row['nll']:.4f} ece={row['ece']:.4f} "
          f"ELBO/N={row['elbo']:.4f} L^G/N={row['lg']:.4f} gap={row['gap']:.1f} "
          f"last10%={row['elbo_last10']:.4f} prev10%={row['elbo_prev10']:.4f} "
          f"max|Δρ|/Σlr={row['rho_max_move_over_sum_lr']:.4f} "
          f"late/total Δρ={row['rho_late_over_total_median']:.3f} fit={fit_s:.0f}s", flush=True)
    return row


def summary(rows, kinds) -> None:
    print("| guide | ELBO/N | L^G/N | gap (nats) | accuracy % | test NLL | ECE | "
          "last 10% − prev 10% ELBO/N | max|Δρ|/Σlr |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, K in kinds:
        sel = [r for r in rows if r["kind"] == kind and r["K"] == K]

        def ms(key, scale=1.0, digits=4, sel=sel):
            v = [scale * r[key] for r in sel]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            return f"{statistics.fmean(v):.{digits}f} ± {sd:.{digits}f}"

        drift = [r["elbo_last10"] - r["elbo_prev10"] for r in sel]
        name = kind if kind == "meanfield" else f"symmetrized ({kind}, K={K})"
        print(f"| {name} | {ms('elbo')} | {ms('lg')} | {ms('gap', digits=1)} | {ms('acc', 100, 2)} | "
              f"{ms('nll')} | {ms('ece')} | {statistics.fmean(drift):+.4f} | "
              f"{max(r['rho_max_move_over_sum_lr'] for r in sel):.4f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--width", type=int, default=None, help="hidden width (mnist 30, digits 100)")
    p.add_argument("--guides", default="meanfield,local", help="meanfield, local, uniform")
    p.add_argument("--K", type=int, default=None, help="num_permutations of the symmetrised guides")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=None, help="mnist 100, digits 64")
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--init-scale", type=float, default=0.1)
    p.add_argument("--eval-permutations", type=int, default=100, help="K of the L^G evaluation")
    p.add_argument("--eval-samples", type=int, default=16, help="ω draws of the L^G evaluation")
    p.add_argument("--test-samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="write the converged runs as JSON")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-converged", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    args.width = args.width or DEFAULT_WIDTH[args.dataset]
    args.batch_size = args.batch_size or DEFAULT_BATCH[args.dataset]
    if args.quick:
        args.seeds, args.epochs, args.steps, args.repeats = 1, 3, 10, 2
        args.eval_samples, args.eval_permutations, args.test_samples = 2, 4, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    split = load(args.dataset, args.data_dir)
    print(f"# {args.dataset} {len(split.x_train)}/{len(split.x_test)}, {split.x_train.shape[1]}-{args.width}-10, "
          f"batch {args.batch_size}, device {args.device}, torch threads {torch.get_num_threads()}")
    if not args.skip_timing:
        x, y = split.x_train.to(args.device), split.y_train.to(args.device)
        configs = [("meanfield", None), ("local", 1), ("local", 4), ("uniform", 10)]
        wall, cpu = time_steps(x, y, args.width, configs, args.steps, args.batch_size, args.device,
                               args.repeats)
        print("| guide | estimator | K | median step wall (ms) | ratio | median step CPU (ms) | ratio |")
        print("|---|---|---|---|---|---|---|")
        base = ("meanfield", None)
        for key in wall:
            kind, K = key
            print(f"| {'meanfield' if kind == 'meanfield' else 'symmetrized'} | "
                  f"{'—' if kind == 'meanfield' else kind} | {K or '—'} | {1e3 * wall[key]:.2f} | "
                  f"{wall[key] / wall[base]:.2f} | {1e3 * cpu[key]:.2f} | {cpu[key] / cpu[base]:.2f} |")
    if not args.skip_converged:
        t0 = time.perf_counter()
        kinds = [(g.strip(), None if g.strip() == "meanfield" else args.K) for g in args.guides.split(",")]
        kinds = [(k, K if K is not None or k == "meanfield" else pb.guides.symmetrized.ESTIMATORS[k][0])
                 for k, K in kinds]
        rows = [converged_run(split, kind, K, seed, args) for kind, K in kinds for seed in range(args.seeds)]
        print(f"# {args.dataset}: {args.epochs} epochs, lr {args.lr} cosine, init_scale {args.init_scale}, "
              f"{args.seeds} seeds (mean ± sd); L^G and gap: local bound, K = {args.eval_permutations}, "
              f"{args.eval_samples} ω draws; log|G| = {rows[0]['log_group_order']:.1f}")
        summary(rows, kinds)
        print(f"# converged runs: {time.perf_counter() - t0:.0f} s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f)


if __name__ == "__main__":
    main()
