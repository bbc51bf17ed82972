"""1D toy regression (Blundell et al. 2015, fig. 5) with a Bayesian hypernetwork.

Training inputs lie in [0, 0.5]; the weight-norm MLP's scales get a flow posterior
(``pb.guides.Hypernet``).  Prints the predictive standard deviation of f inside the
training range and on x ∈ [0.8, 1.0] (it should grow away from the data), the training
ELBO over the last epochs as convergence evidence, and optionally plots the predictive band.

    python examples/toy_regression_hypernet.py --plot toy_regression.png
    python examples/toy_regression_hypernet.py --seeds 8                  # the ratio over seeds
    python examples/toy_regression_hypernet.py --seeds 8 --num-flows 0    # mean-field on the scales
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.reporting.output_files import check_new_file, save_figure


def run(epochs: int = 1000, num_flows: int = 4, hidden: int = 50, width: int = 64,
        num_points: int = 64, lr: float = 1e-2, seed: int = 0, num_samples: int = 200,
        flow: str = "iaf", noise: float = 0.02, layout: str = "stable",
        lr_schedule: str = "cosine"):
    """Train and return ``(model, guide, x_grid, f_samples, ratio, (x, y), result)`` where
    ``f_samples`` is ``(S, G)``, ``ratio`` = mean std on [0.8, 1] / mean std on [0, 0.5] and
    ``result`` the :class:`pyro_bnn.FitResult` (full batch: one step per epoch)."""
    torch.manual_seed(seed)
    x, y = pb.datasets.toy_regression(num_points, seed=seed, noise=noise)
    net = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 1))
    model = pb.BNN(net, "gaussian", noise=noise, weight_norm=True)
    guide = pb.guides.Hypernet(model, flow=flow, num_flows=num_flows, hidden=hidden, layout=layout)
    result = pb.fit(model, guide, (x, y), epochs=epochs, batch_size=num_points, lr=lr,
                    lr_schedule=lr_schedule, progress=False, seed=seed)
    grid = torch.linspace(-0.2, 1.2, 141).unsqueeze(-1)
    f = pb.predict(model, guide, grid, num_samples=num_samples)[..., 0]
    std = f.std(0)
    inside = std[(grid[:, 0] >= 0) & (grid[:, 0] <= 0.5)].mean()
    outside = std[(grid[:, 0] >= 0.8) & (grid[:, 0] <= 1.0)].mean()
    return model, guide, grid, f, (outside / inside).item(), (x, y), result


def convergence(history: dict, fraction: float = 0.05) -> str:
    """Mean training ELBO over the last ``fraction`` of epochs and its change from the
    ``fraction`` before the last 10 %."""
    elbo = history["elbo"]
    k = max(1, int(len(elbo) * fraction))
    end = statistics.mean(elbo[-k:])
    before = statistics.mean(elbo[int(0.9 * len(elbo)) - k:int(0.9 * len(elbo))])
    return f"ELBO {end:.1f} (last {k} epochs; {end - before:+.1f} over the last 10 %)"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--num-flows", type=int, default=4)
    p.add_argument("--flow", default="iaf", choices=["iaf", "realnvp"])
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"])
    p.add_argument("--layout", default="stable", choices=["stable", "paper"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="save a figure here (needs matplotlib)")
    p.add_argument("--seeds", type=int, default=0,
                   help="run seeds 0..N-1 and print every ratio, the median and how many reach 3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = p.parse_args(argv)
    if args.plot and not args.seeds:   # before any training (--seeds writes no figure)
        check_new_file(args.plot, overwrite=args.overwrite)
    torch.set_num_threads(args.threads)
    options = dict(epochs=args.epochs, num_flows=args.num_flows, lr=args.lr, flow=args.flow,
                   layout=args.layout, lr_schedule=args.lr_schedule)
    if args.seeds:
        ratios = []
        for seed in range(args.seeds):
            *_, ratio, _, result = run(seed=seed, **options)
            ratios.append(ratio)
            print(f"seed {seed}: ratio {ratio:.2f}  {convergence(result.history)}", flush=True)
        print(f"median {statistics.median(ratios):.2f}; >= 3 in {sum(r >= 3 for r in ratios)}/{len(ratios)}")
        return
    t0 = time.perf_counter()
    _, _, grid, f, ratio, (x, y), result = run(seed=args.seed, **options)
    std = f.std(0)
    print(f"std inside [0, 0.5]: {std[(grid[:, 0] >= 0) & (grid[:, 0] <= 0.5)].mean():.4f}  "
          f"std on [0.8, 1.0]: {std[(grid[:, 0] >= 0.8) & (grid[:, 0] <= 1.0)].mean():.4f}  "
          f"ratio {ratio:.2f}  {convergence(result.history)}  ({time.perf_counter() - t0:.0f} s)")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        m, s = f.mean(0), f.std(0)
        fig = plt.figure(figsize=(6, 3.5))
        plt.fill_between(grid[:, 0], m - 2 * s, m + 2 * s, alpha=0.3, label="±2 std")
        plt.plot(grid[:, 0], m, label="predictive mean")
        plt.scatter(x[:, 0], y[:, 0], s=8, c="k", label="train")
        plt.legend()
        plt.tight_layout()
        save_figure(fig, args.plot, dpi=120, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
