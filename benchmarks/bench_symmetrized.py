"""Symmetrised vs mean-field VI: step cost, and converged fits on MNIST 5k or digits.

Timing (``--skip-converged`` for timing only): median time of one training step (loss,
backward, Adam) for MeanField and Symmetrized on the same MLP and batches, interleaved in
the same process; the ratio against MeanField is the claim (target: the default
``Symmetrized(model)`` ≤ 2×).  Wall-clock and process CPU time are both reported: on a
shared machine the CPU time is the steadier of the two.

Converged fits (``--skip-timing`` for these only): MeanField vs Symmetrized (local
estimator by default) trained to convergence (``init_scale`` 0.1, Adam lr 5e-2 with a cosine
schedule, 300 epochs), several seeds.  Per fit: full-data ELBO and symmetrised ELBO ``L^G``
(both evaluated for every guide with ``pb.guides.symmetrized.symmetrized_elbo``, local estimator, the same ω
draws), test accuracy / NLL / ECE, and convergence evidence: the epoch-mean ELBO over the
last 10% of epochs against the 10% before, the movement of the scale parameters ρ over the
last 10% of epochs relative to their whole movement, and the largest |Δρ| relative to the
sum of the learning rates (Adam moves a parameter by at most about lr per step, so a ratio
near 1 would mean lr-limited scales).

    python benchmarks/bench_symmetrized.py --skip-converged --threads 1
    python benchmarks/bench_symmetrized.py --skip-timing --dataset digits --threads 1
    python benchmarks/bench_symmetrized.py --skip-timing --dataset mnist --threads 1
    python benchmarks/bench_symmetrized.py --quick              # a few steps / epochs

Bound tightness (``--bounds``): on small nets whose group can be enumerated, the exact gap
``H(q_G) − H(q)`` against the local and uniform bounds at equal K, on the same ω draws.

    python benchmarks/bench_symmetrized.py --bounds
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
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.reporting.output_files import check_new_file, write_json
from pyro_bnn.training.guide_setup import setup_guide

DEFAULT_WIDTH = {"mnist": 30, "digits": 100, "regression": 6}
DEFAULT_BATCH = {"mnist": 100, "digits": 64, "regression": 16}
#: Test metrics reported per task.
METRICS = {"classification": ("accuracy", "nll", "ece"), "regression": ("rmse", "nll", "coverage_95")}


def load(dataset: str, data_dir: str):
    if dataset == "mnist":
        return pb.datasets.mnist_split(data_dir, 5000, 5000)
    if dataset == "regression":   # 1-D, 64 points: a net small enough to enumerate G
        x, y = pb.datasets.toy_regression(64, seed=0)
        x_test, y_test = pb.datasets.toy_regression(500, seed=1)
        return pb.datasets.DataSplit(x, y, x_test, y_test)
    return pb.datasets.digits()


def make_model(dataset: str, inputs: int, width: int) -> pb.BNN:
    if dataset == "regression":
        return pb.BNN(nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, 1)),
                      "gaussian", noise=0.05)
    return pb.BNN(mlp(inputs, width))


def mlp(inputs: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, 10))


def make_guide(kind: str, model, K: int | None, init_scale: float):
    """``kind``: "meanfield", or an estimator of Symmetrized ("local", "uniform", "exact")."""
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


def converged_run(split, kind, K, seed, args, start=None, epochs=None, lr=None) -> dict:
    """Train one guide (from ``start``, a guide state dict, if given) and evaluate it."""
    epochs, lr = epochs or args.epochs, lr or args.lr
    torch.manual_seed(seed)
    model = make_model(args.dataset, split.x_train.shape[1], args.width)
    guide = make_guide(kind, model, K, args.init_scale)
    snapshots = {}
    mark = max(1, epochs - max(1, epochs // 10))  # start of the last 10% of epochs

    def on_epoch_end(ctx, _hook=guide.on_epoch_end):
        _hook(ctx)
        if ctx.epoch + 1 in (1, mark):
            snapshots[ctx.epoch + 1] = _raw_scales(guide)

    setup_guide(model, guide, split.x_train[:args.batch_size], split.y_train[:args.batch_size],
                len(split.x_train))
    if start is not None:
        guide.load_state_dict(start)
    rho0 = _raw_scales(guide)
    guide.on_epoch_end = on_epoch_end
    t0 = time.perf_counter()
    res = pb.fit(model, guide, split.train, epochs=epochs, batch_size=args.batch_size,
                 lr=lr, lr_schedule="cosine", progress=False, seed=seed)
    fit_s = time.perf_counter() - t0
    del guide.on_epoch_end
    rho = _raw_scales(guide)
    steps = epochs * math.ceil(len(split.x_train) / args.batch_size)
    sum_lr = lr * steps / 2                          # Σ_t lr_t of the cosine schedule
    moved = (rho - rho0).abs()
    late = (rho - snapshots.get(mark, rho)).abs()
    history = res.history["elbo"]
    n10 = max(1, len(history) // 10)
    metrics = pb.evaluate(model, guide, split.x_test, split.y_test, num_samples=args.test_samples)
    pyro.set_rng_seed(100 + seed)                    # the same ω draws for every guide
    terms = pb.guides.symmetrized.symmetrized_elbo(model, guide, split.train, num_permutations=args.eval_permutations,
                                num_samples=args.eval_samples, estimator=args.eval_estimator,
                                return_terms=True)
    n = len(split.x_train)
    task = "regression" if args.dataset == "regression" else "classification"
    acc, nll, ece = (metrics[k] for k in METRICS[task])
    row = {"kind": kind, "K": K, "seed": seed, "fit_s": fit_s,
           "acc": acc, "nll": nll, "ece": ece,
           "elbo": terms["elbo"] / n, "lg": terms["symmetrized_elbo"] / n, "gap": terms["entropy_gap"],
           "log_group_order": terms["log_group_order"],
           "elbo_last10": statistics.fmean(history[-n10:]) / n,
           "elbo_prev10": statistics.fmean(history[-2 * n10:-n10]) / n,
           "train_gap_last10": statistics.fmean(res.history.get("entropy_gap", [0.0])[-n10:]),
           "rho_max_move_over_sum_lr": float(moved.max()) / sum_lr,
           "rho_late_over_total_median": float((late / moved.clamp_min(1e-12)).median()),
           "rho_moved_median": float(moved.median()),
           "sigma_median": float(rho.exp().median()) if guide.scale_parameterization == "exp" else None,
           "fit_converged": res.convergence.converged if res.convergence else None,
           "fit_convergence": res.convergence.reasons if res.convergence else None,
           "history": {k: v for k, v in res.history.items()
                       if k in ("loss", "elbo", "symmetrized_elbo", "entropy_gap")},
           "state": {k: v.detach().clone() for k, v in guide.state_dict().items()}}
    labels = METRICS[task]
    print(f"  {kind:9s} K={K} seed={seed} {labels[0]}={acc:.4f} {labels[1]}={nll:.4f} {labels[2]}={ece:.4f} "
          f"ELBO/N={row['elbo']:.4f} L^G/N={row['lg']:.4f} gap={row['gap']:.1f} "
          f"last10%={row['elbo_last10']:.4f} prev10%={row['elbo_prev10']:.4f} "
          f"max|Δρ|/Σlr={row['rho_max_move_over_sum_lr']:.4f} "
          f"late/total Δρ={row['rho_late_over_total_median']:.3f} fit={fit_s:.0f}s", flush=True)
    return row


def bound_table(draws: int, seed: int = 0) -> None:
    """Exact gap vs the local and uniform bounds (mean over ``draws`` paired ω ∼ q, ± s.e.)."""
    from pyro_bnn.guides import symmetrized_entropy as se
    from pyro_bnn.guides import symmetry as sym

    Ks = (1, 2, 4, 16)
    print("| net | spread | log|G| | exact gap | " + " | ".join(f"local K={K}" for K in Ks) + " | "
          + " | ".join(f"uniform K={K}" for K in Ks[1:]) + " |")
    print("|---" * (4 + 2 * len(Ks) - 1) + "|")
    for widths in ((1, 3, 1), (2, 4, 2), (2, 3, 3, 1)):
        for spread in (0.2, 0.4):
            layers = []
            for a, b in zip(widths[:-1], widths[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            model = pb.BNN(nn.Sequential(*layers[:-1]), "gaussian", noise=0.5)
            shapes = {k: v.shape for k, v in model.initial_values().items()}
            gen = torch.Generator().manual_seed(seed)     # μ ∼ spread·N(0,1), σ ∼ U(0.25, 0.75)
            locs = {k: spread * torch.randn(v, generator=gen, dtype=torch.float64) for k, v in shapes.items()}
            scales = {k: 0.25 + 0.5 * torch.rand(v, generator=gen, dtype=torch.float64) for k, v in shapes.items()}
            groups = sym.find_symmetries(model, shapes)
            sizes = sym.group_sizes(groups, shapes)
            all_g = sym.enumerate_group(sizes)
            log_order = sym.log_group_order(sizes)
            torch.manual_seed(seed)
            rows = []
            for _ in range(draws):
                v = {k: locs[k] + scales[k] * torch.randn(locs[k].shape, generator=gen, dtype=torch.float64)
                     for k in locs}
                row = [log_order - torch.logsumexp(se.log_density_ratios(v, locs, scales, groups, all_g), 0)]
                row += [se.local_entropy_gap(v, locs, scales, groups, K)[0] for K in Ks]
                row += [se.uniform_entropy_gap(v, locs, scales, groups, sym.sample_permutations(sizes, K - 1))
                        for K in Ks[1:]]
                rows.append(torch.stack(row))
            t = torch.stack(rows)
            mean, sem = t.mean(0), t.std(0) / math.sqrt(draws)
            cells = [f"{m:.3f} ± {e:.3f}" for m, e in zip(mean.tolist(), sem.tolist())]
            print(f"| {'-'.join(map(str, widths))} | {spread} | {log_order:.3f} | " + " | ".join(cells) + " |")


def summary(rows, kinds, task="classification") -> None:
    names = ("accuracy %", "test NLL", "ECE") if task == "classification" else ("test RMSE", "test NLL",
                                                                                 "95% coverage")
    print(f"| guide | ELBO/N | L^G/N | gap (nats) | {' | '.join(names)} | "
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
        acc = ms('acc', 100, 2) if task == "classification" else ms('acc')
        print(f"| {name} | {ms('elbo')} | {ms('lg')} | {ms('gap', digits=2)} | {acc} | "
              f"{ms('nll')} | {ms('ece')} | {statistics.fmean(drift):+.4f} | "
              f"{max(r['rho_max_move_over_sum_lr'] for r in sel):.4f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["mnist", "digits", "regression"], default="mnist")
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--width", type=int, default=None, help="hidden width (mnist 30, digits 100)")
    p.add_argument("--guides", default="meanfield,local", help="meanfield, local, uniform, exact")
    p.add_argument("--K", type=int, default=None, help="num_permutations of the symmetrised guides")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=None, help="mnist 100, digits 64")
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--init-scale", type=float, default=0.1)
    p.add_argument("--eval-permutations", type=int, default=100, help="K of the L^G evaluation")
    p.add_argument("--eval-samples", type=int, default=16, help="ω draws of the L^G evaluation")
    p.add_argument("--eval-estimator", default=None,
                   help="estimator of the L^G evaluation (default: exact for regression, else local)")
    p.add_argument("--test-samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="write the converged runs as JSON")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-converged", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--warm-start", type=int, default=0, metavar="EPOCHS",
                   help="then continue every guide for EPOCHS from the converged MeanField of its seed")
    p.add_argument("--warm-lr", type=float, default=1e-2)
    p.add_argument("--bounds", action="store_true", help="only the bound-tightness table")
    p.add_argument("--bound-draws", type=int, default=2000)
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = p.parse_args(argv)
    if args.out and not args.bounds and not args.skip_converged:   # before any training
        check_new_file(args.out, overwrite=args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.bounds:
        bound_table(args.bound_draws)
        return
    args.width = args.width or DEFAULT_WIDTH[args.dataset]
    args.eval_estimator = args.eval_estimator or ("exact" if args.dataset == "regression" else "local")
    args.batch_size = args.batch_size or DEFAULT_BATCH[args.dataset]
    if args.quick:
        args.seeds, args.epochs, args.steps, args.repeats = 1, 3, 10, 2
        args.eval_samples, args.eval_permutations, args.test_samples = 2, 4, 8
    split = load(args.dataset, args.data_dir)
    print(f"# {args.dataset} {len(split.x_train)}/{len(split.x_test)}, {split.x_train.shape[1]}-{args.width}-10, "
          f"batch {args.batch_size}, device {args.device}, torch threads {torch.get_num_threads()}")
    if not args.skip_timing:
        x, y = split.x_train.to(args.device), split.y_train.to(args.device)
        if args.dataset == "regression":
            raise SystemExit("timing: use --dataset mnist or digits")
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
        first = [("meanfield", None)] if args.warm_start else kinds
        rows = [converged_run(split, kind, K, seed, args) for kind, K in first for seed in range(args.seeds)]
        if args.warm_start:   # every guide continues from the converged MeanField of its seed
            starts = {r["seed"]: r["state"] for r in rows}
            print(f"# warm start: {args.warm_start} more epochs at lr {args.warm_lr} (cosine) from "
                  "each seed's converged MeanField")
            rows = [converged_run(split, kind, K, seed, args, start=starts[seed], epochs=args.warm_start,
                                  lr=args.warm_lr)
                    for kind, K in kinds for seed in range(args.seeds)]
        print(f"# {args.dataset}: {args.epochs} epochs, lr {args.lr} cosine, init_scale {args.init_scale}, "
              f"{args.seeds} seeds (mean ± sd); L^G and gap: {args.eval_estimator} estimator"
              f"{'' if args.eval_estimator == 'exact' else f', K = {args.eval_permutations}'}, "
              f"{args.eval_samples} ω draws; log|G| = {rows[0]['log_group_order']:.1f}")
        summary(rows, kinds, "regression" if args.dataset == "regression" else "classification")
        print(f"# converged runs: {time.perf_counter() - t0:.0f} s")
        if args.out:
            write_json(args.out, {"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "state"}
                                                               for r in rows]},
                       indent=None, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
