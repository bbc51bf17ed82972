"""``pyro-bnn``: the main job — train a BNN on the offline default data and report metrics."""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from . import datasets
from .guides.base import GUIDE_REGISTRY
from .model import BNN
from .prediction import evaluate
from .training import fit

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyro-bnn", description=__doc__)
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--data-dir", default="../shared/data/mnist", help="folder with MNIST IDX files")
    p.add_argument("--guide", default="meanfield", help=f"one of {sorted(GUIDE_REGISTRY)}")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=100)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    split = datasets.digits() if args.dataset == "digits" else datasets.mnist_split(args.data_dir)
    d_in = split.x_train.shape[1]
    net = nn.Sequential(nn.Linear(d_in, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model = BNN(net, likelihood="categorical")
    if args.guide not in GUIDE_REGISTRY:
        print(f"unknown guide {args.guide!r}; choose from {sorted(GUIDE_REGISTRY)}", file=sys.stderr)
        return 2
    guide = GUIDE_REGISTRY[args.guide](model)
    result = fit(model, guide, split.train, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                 device=args.device, seed=args.seed, progress=not args.no_progress)
    scores = evaluate(model, guide, split.x_test, split.y_test, num_samples=args.num_samples)
    scores["train_seconds"] = result.seconds
    print(json.dumps({"dataset": args.dataset, "guide": args.guide, **scores}, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
