"""Learn rotation invariance from data with the Laplace evidence (LILA) — and compare.

Trains the same tanh MLP three ways on transformed digits (or MNIST 5k/5k):

* ``lila``      — invariant model, η learned by the Laplace-KFAC evidence gradient;
* ``augerino``  — invariant model, η learned by Augerino (likelihood + 0.01‖η‖² reward);
* ``none``      — no invariance (η = 0, S = 1);

prints the learned extents and a test-accuracy table, and plots the η trajectories.

Examples
--------
    python examples/invariance_rotated_digits.py --quick
    python examples/invariance_rotated_digits.py --kind rotate --epochs 100 --out runs/rot
    python examples/invariance_rotated_digits.py --kind none --methods lila --epochs 100
    python examples/invariance_rotated_digits.py --dataset mnist --data-dir ../shared/data/mnist
    # rotated MNIST 5k/5k on a 2-core CPU budget (~35 min for LILA; docs/results/invariance.md)
    python examples/invariance_rotated_digits.py --dataset mnist --methods lila --hidden 500 \
        --samples 16 --epochs 60 --burnin 5 --out runs/rotmnist_lila
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.invariance import (
    GENERATORS,
    AffineAugmentation,
    learn_invariance,
    map_predict,
    transformed_digits,
    transformed_mnist,
)
from pyro_bnn.reporting.output_files import check_new_file, save_figure, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--kind", choices=["rotate", "translate", "scale", "none"], default="rotate")
    p.add_argument("--extent", type=float, default=math.pi, help="data transform range")
    p.add_argument("--methods", default="lila,augerino,none")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--burnin", type=int, default=10)
    p.add_argument("--samples", type=int, default=31, help="S augmented copies")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="MAP learning-rate schedule (cosine: θ settles, so the final evidence is a converged MAP's)")
    p.add_argument("--hyper-lr", type=float, default=0.05)
    p.add_argument("--eta-steps", type=int, default=1)
    p.add_argument("--every", type=int, default=1, help="evidence step every this many epochs")
    p.add_argument("--marglik-batch-size", type=int, default=512)
    p.add_argument("--size", type=int, default=None,
                   help="resize images to size×size first (digits: upsample from 8, default 8; "
                        "mnist: downsample from 28, default 28)")
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-test", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--out", default=None, help="folder for results.json and eta.png")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return p.parse_args(argv)


def load(args):
    if args.dataset == "digits":
        return transformed_digits(args.kind, args.extent if args.kind != "none" else 0.0,
                                  seed=args.seed, size=args.size or 8)
    d = transformed_mnist(args.data_dir, args.kind, args.extent if args.kind != "none" else 0.0,
                          num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    if args.size and args.size != 28:   # downsample the (already transformed) images
        def down(t):
            img = torch.nn.functional.interpolate(t.reshape(-1, 1, 28, 28), size=(args.size,) * 2,
                                                  mode="bilinear", antialias=True)
            return img.flatten(1)
        d = pb.datasets.DataSplit(down(d.x_train), d.y_train, down(d.x_test), d.y_test)
    return d


def run_method(method, data, args):
    torch.manual_seed(args.seed)
    d_in = data.x_train.shape[1]
    net = nn.Sequential(nn.Linear(d_in, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
    aug = AffineAugmentation(num_samples=1 if method == "none" else args.samples)
    model = pb.BNN(net, "categorical", augmentation=aug)
    t0 = time.perf_counter()
    n = len(data.x_train)       # history["log_evidence"] holds totals; printed per datum

    def log(epoch, res):
        if epoch % max(1, args.epochs // 10) == 0 or epoch == args.epochs:
            ext = " ".join(f"{v:.2f}" for v in res.history["extent"][-1])
            ev = res.history["log_evidence"][-1] / n if res.history["log_evidence"] else float("nan")
            print(f"  [{method}] epoch {epoch:4d}  {time.perf_counter() - t0:6.0f}s  "
                  f"extent [{ext}]  log-ev/N {ev:.4f}", flush=True)

    res = learn_invariance(model, data.train, method=method, epochs=args.epochs,
                           batch_size=args.batch_size, lr=args.lr, hyper_lr=args.hyper_lr,
                           burnin=args.burnin, every=args.every, eta_steps=args.eta_steps,
                           seed=args.seed, lr_schedule=args.lr_schedule,
                           marglik_batch_size=args.marglik_batch_size,
                           callback=log)
    probs = map_predict(model, res.values, data.x_test)
    return {
        "method": method,
        "accuracy": float((probs.argmax(-1) == data.y_test).float().mean()),
        "nll": float(-torch.log(probs[torch.arange(len(probs)), data.y_test].clamp_min(1e-12)).mean()),
        "extent": res.history["extent"][-1],
        "extent_history": res.history["extent"],
        "log_evidence": res.history["log_evidence"][-1] if res.history["log_evidence"] else None,
        "log_evidence_per_datum": res.history["log_evidence"][-1] / n if res.history["log_evidence"] else None,
        "log_evidence_history": res.history["log_evidence"],
        "evidence_epoch": res.history["evidence_epoch"],
        "prior_precision": res.prior_precision.tolist(),
        "seconds": res.seconds,
        "epoch_seconds": res.history["epoch_seconds"],
        "hyper_seconds": res.history["hyper_seconds"],
    }


def plot(results, path, title, *, overwrite=False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        hist = torch.tensor(r["extent_history"])
        if hist.numel():
            for k, name in enumerate(GENERATORS):
                ax.plot(range(1, len(hist) + 1), hist[:, k], label=name)
        ax.axhline(math.pi, color="grey", ls=":", lw=1)
        ax.set_title(f"{r['method']} (acc {100 * r['accuracy']:.1f}%)")
        ax.set_xlabel("epoch")
        ax.set_ylabel("extent η")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, overwrite=overwrite)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.out:   # before any training: a long run is never lost at its end
        for name in ("results.json", "eta.png"):
            check_new_file(os.path.join(args.out, name), overwrite=args.overwrite)
    if args.quick:
        args.epochs, args.burnin, args.samples, args.hidden = 4, 1, 4, 32
        args.num_train, args.num_test = 500, 500
    torch.set_num_threads(args.threads)
    data = load(args)
    print(f"{args.dataset} ({args.kind}, extent {args.extent:.2f}): {len(data.x_train)} train / "
          f"{len(data.x_test)} test; S={args.samples}, MLP {args.hidden} tanh, {args.epochs} epochs")
    results = [run_method(m, data, args) for m in args.methods.split(",")]
    print("\nmethod     test acc   test nll   " + "  ".join(f"{g:>5}" for g in GENERATORS) + "   seconds")
    for r in results:
        print(f"{r['method']:<9} {100 * r['accuracy']:8.2f}%  {r['nll']:8.4f}   "
              + "  ".join(f"{v:5.2f}" for v in r["extent"]) + f"   {r['seconds']:7.0f}")
    if args.out:
        write_json(os.path.join(args.out, "results.json"), {"args": vars(args), "results": results}, indent=1,
                   overwrite=args.overwrite)
        plot(results, os.path.join(args.out, "eta.png"),
             f"{args.dataset}, {args.kind} ±{args.extent:.2f}: learned extents", overwrite=args.overwrite)
        print(f"wrote {args.out}/results.json and eta.png")
    return results


if __name__ == "__main__":
    main()
