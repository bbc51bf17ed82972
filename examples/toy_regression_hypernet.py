"""1D toy regression (Blundell et al. 2015, fig. 5) with a Bayesian hypernetwork.

Training inputs lie in [0, 0.5]; the weight-norm MLP's scales get a flow posterior
(``pb.guides.Hypernet``).  Prints the predictive standard deviation of f inside the
training range and on x ∈ [0.8, 1.0] (it should grow away from the data) and optionally
plots the predictive band.

    python examples/toy_regression_hypernet.py --epochs 300 --plot toy_regression.png
    python examples/toy_regression_hypernet.py --epochs 300 --seeds 8     # the ratio over seeds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pyro_bnn as pb


def run(epochs: int = 300, num_flows: int = 4, hidden: int = 50, width: int = 64,
        num_points: int = 64, lr: float = 3e-3, seed: int = 0, num_samples: int = 200,
        flow: str = "iaf", noise: float = 0.02):
    """Train and return ``(model, guide, x_grid, f_samples, ratio)`` where ``f_samples`` is
    ``(S, G)`` and ``ratio`` = mean std on [0.8, 1] / mean std on [0, 0.5]."""
    torch.manual_seed(seed)
    x, y = pb.datasets.toy_regression(num_points, seed=seed, noise=noise)
    net = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 1))
    model = pb.BNN(net, "gaussian", noise=noise, weight_norm=True)
    guide = pb.guides.Hypernet(model, flow=flow, num_flows=num_flows, hidden=hidden)
    pb.fit(model, guide, (x, y), epochs=epochs, batch_size=num_points, lr=lr,
           progress=False, seed=seed, clip_norm=10.0)
    grid = torch.linspace(-0.2, 1.2, 141).unsqueeze(-1)
    f = pb.predict(model, guide, grid, num_samples=num_samples)[..., 0]
    std = f.std(0)
    inside = std[(grid[:, 0] >= 0) & (grid[:, 0] <= 0.5)].mean()
    outside = std[(grid[:, 0] >= 0.8) & (grid[:, 0] <= 1.0)].mean()
    return model, guide, grid, f, (outside / inside).item(), (x, y)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--num-flows", type=int, default=4)
    p.add_argument("--flow", default="iaf", choices=["iaf", "realnvp"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="save a figure here (needs matplotlib)")
    p.add_argument("--seeds", type=int, default=0,
                   help="run seeds 0..N-1 and print every ratio, the median and how many reach 3")
    args = p.parse_args(argv)
    if args.seeds:
        ratios = []
        for seed in range(args.seeds):
            ratios.append(run(args.epochs, args.num_flows, lr=args.lr, seed=seed, flow=args.flow)[4])
            print(f"seed {seed}: ratio {ratios[-1]:.2f}", flush=True)
        print(f"median {statistics.median(ratios):.2f}; >= 3 in {sum(r >= 3 for r in ratios)}/{len(ratios)}")
        return
    t0 = time.perf_counter()
    _, _, grid, f, ratio, (x, y) = run(args.epochs, args.num_flows, lr=args.lr, seed=args.seed,
                                       flow=args.flow)
    std = f.std(0)
    print(f"std inside [0, 0.5]: {std[(grid[:, 0] >= 0) & (grid[:, 0] <= 0.5)].mean():.4f}  "
          f"std on [0.8, 1.0]: {std[(grid[:, 0] >= 0.8) & (grid[:, 0] <= 1.0)].mean():.4f}  "
          f"ratio {ratio:.2f}  ({time.perf_counter() - t0:.0f} s)")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        m, s = f.mean(0), f.std(0)
        plt.figure(figsize=(6, 3.5))
        plt.fill_between(grid[:, 0], m - 2 * s, m + 2 * s, alpha=0.3, label="±2 std")
        plt.plot(grid[:, 0], m, label="predictive mean")
        plt.scatter(x[:, 0], y[:, 0], s=8, c="k", label="train")
        plt.legend()
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
