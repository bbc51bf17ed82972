"""Why the weight-norm Hypernet's ELBO keeps rising (issue 26): per-epoch diagnostics.

Trains ``pb.guides.Hypernet`` on a weight-norm MLP (``pb.BNN(..., weight_norm=True)``: only the
scales ``g`` are random, the directions ``v`` and the biases ``b`` are point estimates) and
records, every epoch, the training ELBO and its two terms (scaled NLL, ``KL = log q − log p``),
the norms of the point estimates (``‖v_j‖`` mean per layer, ``‖b‖`` per layer) and the
posterior over ``g`` (mean ``|E g|`` per layer).  One JSON line per run.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/hypernet_convergence.py --data mnist5k \\
        --epochs 100 --num-flows 0 --out runs.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
from _common import emit_row  # benchmarks/_common.py (on sys.path when run as a script)
from torch import nn

import pyro_bnn as pb
from pyro_bnn.model.weight_norm import is_weight_norm_layer


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def point_estimate_norms(model) -> dict:
    """Mean row norm of ``v`` and norm of ``b`` for each weight-norm layer of ``model.net``."""
    out = {}
    for name, module in model.net.named_modules():
        if is_weight_norm_layer(module):
            v = module.weight_v.detach()
            out[name] = {"v_row_norm": float(v.flatten(1).norm(dim=1).mean()),
                         "b_norm": float(module.bias.detach().norm()) if module.bias is not None else 0.0}
    return out


def gaussian_kl_by_layer(guide) -> dict | None:
    """With ``num_flows=0`` q is N(μ, σ²) on the scales: KL(q‖N(0,1)) per layer, split into
    its mean part Σ μ²/2 and its width part Σ (σ² − 1)/2 − log σ, and the counts of units
    whose q is within 0.1 nat of the prior ("pruned")."""
    if guide.num_flows != 0:
        return None
    with torch.no_grad():
        mu, sigma = guide.flow.affine.loc, guide.flow.affine.scale
        mean_part, width_part = mu.square() / 2, (sigma.square() - 1) / 2 - sigma.log()
        out = {}
        for name, part in guide.unpack(torch.stack([mean_part, width_part])).items():
            out[name] = {"kl_mean_part": float(part[0].sum()), "kl_width_part": float(part[1].sum()),
                         "units": int(part[0].numel()),
                         "units_at_prior": int((part[0] + part[1] < 0.1).sum())}
    return out


def scale_summary(guide, draws: int = 64) -> dict:
    with torch.no_grad():
        values, _ = guide.sample_with_log_prob(draws)
    return {k: {"abs_mean": float(v.mean(0).abs().mean()), "sd": float(v.std(0).mean())}
            for k, v in values.items()}


class Recorder:
    """Objective wrapper: the guide's own loss, plus the point-estimate norms at each epoch's
    first step (the objective is called once per step)."""

    def __init__(self, model, guide, steps_per_epoch: int):
        self.model, self.inner, self.steps, self.calls, self.norms = model, None, steps_per_epoch, 0, []
        self.guide = guide

    def __call__(self, model, guide, x, y, num_data=None):
        if self.inner is None:
            self.inner = guide.make_objective()
        if self.calls % self.steps == 0:
            self.norms.append(point_estimate_norms(model))
        self.calls += 1
        return self.inner(model, guide, x, y, num_data)


def load(name: str):
    if name == "mnist5k":
        s = pb.datasets.mnist_split("/work/shared/data/mnist", 5000, 5000)
        return (s.x_train, s.y_train), (s.x_test, s.y_test)
    n = int(name.removeprefix("fmnist"))
    split = pb.datasets.fashion_mnist_split(None, num_validation=5000, seed=0)
    return (split.x_train[:n], split.y_train[:n]), split.valid


def run(args) -> dict:
    train, held = load(args.data)
    torch.manual_seed(args.seed)
    model = pb.BNN(mlp(args.width), "categorical", weight_norm=True)
    guide = pb.guides.Hypernet(model, num_flows=args.num_flows, hidden=args.hidden, directions=args.directions)
    steps = -(-len(train[0]) // args.batch_size)
    rec = Recorder(model, guide, steps)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pb.fit(model, guide, train, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                     seed=args.seed, progress=False, objective=rec, clip_norm=args.clip_norm)
    secs = time.perf_counter() - t0
    with torch.no_grad():
        m = pb.evaluate(model, guide, *held, num_samples=32)
    h = res.history
    every = max(1, args.epochs // 50)
    return dict(data=args.data, directions=args.directions, width=args.width, num_flows=args.num_flows, epochs=args.epochs,
                lr=args.lr, batch_size=args.batch_size, seed=args.seed, seconds=secs,
                held_out={k: m[k] for k in ("accuracy", "nll", "ece")},
                elbo=h["elbo"][::every] + [h["elbo"][-1]], nll=h["nll"][::every] + [h["nll"][-1]],
                kl=h["kl"][::every] + [h["kl"][-1]], norms=rec.norms[::every] + [point_estimate_norms(model)],
                scales=scale_summary(guide), kl_by_layer=gaussian_kl_by_layer(guide),
                seconds_per_epoch=sum(h["epoch_seconds"]) / len(h["epoch_seconds"]), converged=res.convergence.converged,
                reasons=[r[:200] for r in res.convergence.reasons])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="mnist5k", help="mnist5k or fmnistN (first N of the 55,000)")
    ap.add_argument("--width", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--num-flows", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=200)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--clip-norm", type=float, default=None)
    ap.add_argument("--directions", default="free", choices=["free", "sphere"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit_row(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
