"""Active learning on digits: BALD vs entropy / variation ratio / random (BHN paper §5.2).

Start from 20 class-balanced labels, acquire 10 per round for 10 rounds, MeanField guide
(or any registered guide), several seeds; prints final accuracies and plots the curves.
Every round trains to convergence: cosine learning-rate decay over ``--epochs`` at the
guide's ``default_lr`` (``--lr`` overrides); the share of rounds whose fit ``pb.fit``
diagnosed as converged is printed and saved.

    .venv/bin/python examples/active_learning_digits.py --seeds 3 --weight-norm --batch power
    .venv/bin/python examples/active_learning_digits.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.uncertainty_plots import plot_active_curves
from pyro_bnn.guides import registered_guides
from pyro_bnn.reporting.output_files import check_new_file, save_figure, write_json


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guide", default="meanfield")
    p.add_argument("--acquisitions", default="bald,random")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--initial", type=int, default=20)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--epochs", type=int, default=300, help="epochs per round")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--hidden", type=int, default=50)
    p.add_argument("--lr", type=float, default=None, help="default: the guide's default_lr")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, …, first-seed + seeds - 1")
    p.add_argument("--batch", choices=["topk", "power"], default="topk",
                   help="take the top scores or sample ∝ score^beta (stochastic batch acquisition)")
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--weight-norm", action="store_true",
                   help="weight-norm BNN: only the per-unit scales are random (BHN paper's setup)")
    p.add_argument("--warm-start", action="store_true",
                   help="continue the previous round's fit (default: retrain from scratch each round)")
    p.add_argument("--cold-start", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 rounds, 1 seed, 20 epochs")
    p.add_argument("--out", default="docs/results/figures")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seeds, args.epochs = 3, 1, 20
    weight_norm = args.guide == "hypernet" or args.weight_norm
    seeds = f"s{args.seeds}" if not args.first_seed else f"s{args.first_seed}-{args.first_seed + args.seeds - 1}"
    tag = ("quick" if args.quick else f"{args.guide}_r{args.rounds}_{seeds}_{args.batch}_e{args.epochs}"
           f"{'_wn' if weight_norm else ''}{'_warm' if args.warm_start else ''}"
           f"_{'-'.join(args.acquisitions.split(','))}")
    json_path = os.path.join(args.out, f"active_digits_{tag}.json")
    png_path = os.path.join(args.out, f"active_digits_{tag}.png")
    for path in (json_path, png_path):   # before any training: a long run is never lost at its end
        check_new_file(path, overwrite=args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    d = pb.datasets.digits()
    factory = registered_guides()[args.guide]

    def model_fn():
        net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
        return pb.BNN(net, "categorical", weight_norm=weight_norm)

    results = {}
    for acq in args.acquisitions.split(","):
        results[acq] = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pb.ConvergenceWarning)   # counted below instead
                r = pb.analysis.active.run(model_fn, factory, d.train, d.test, acquisition=acq, initial=args.initial,
                                  per_round=args.per_round, rounds=args.rounds, warm_start=args.warm_start,
                                  epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=seed,
                                  selection=args.batch, beta=args.beta, lr_schedule=args.lr_schedule)
            results[acq].append(r)
            print(f"{acq:16s} seed {seed}: {[round(a, 3) for a in r.accuracy]} converged rounds "
                  f"{sum(r.converged)}/{len(r.converged)} ELBO {[round(e, 1) for e in r.elbo]} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    summary = {acq: {"final_mean": statistics.mean(r.final_accuracy for r in runs),
                     "curve_mean": statistics.mean(statistics.mean(r.accuracy) for r in runs),
                     "final_per_seed": [r.final_accuracy for r in runs],
                     "curves": [r.accuracy for r in runs], "num_labelled": runs[0].num_labelled,
                     "elbo": [r.elbo for r in runs], "converged": [r.converged for r in runs]}
               for acq, runs in results.items()}
    for acq, s in summary.items():
        print(f"{acq:16s} final accuracy mean {s['final_mean']:.4f}  per seed {s['final_per_seed']}; "
              f"mean over the curve {s['curve_mean']:.4f}")
    write_json(json_path, {"args": vars(args), "summary": summary}, indent=1, overwrite=args.overwrite)
    fig = plot_active_curves(results, title=f"Active learning on digits ({args.guide}, {args.seeds} seeds)")
    save_figure(fig, png_path, dpi=120, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
