"""LILA at scale: invariance learning on fully rotated Fashion-MNIST, LILA vs no invariance vs Augerino.

Every training image (a stated subset of the 60,000, or all) and every one of the 10,000 test
images is rotated once by its own angle drawn uniformly from ±180° (fixed seeds,
:func:`pyro_bnn.invariance.transformed_fashion_mnist`).  The same network is trained by
:func:`pyro_bnn.invariance.learn_invariance` three ways — ``lila`` (η by the Laplace-KFAC
evidence), ``augerino`` (η by the likelihood plus a width reward), ``none`` (η = 0, S = 1) —
with per-layer prior precisions learned by the evidence in all three.  One command per table;
it prints the table (learned extents of the six generators, test accuracy, test NLL, log
evidence per datum, seconds) and appends one JSON line per method to ``--out`` (with the
per-epoch extent, loss and evidence histories for the convergence check).

``--time-only`` trains one epoch and one evidence step per method and prints the seconds
(for sizing a run on a CPU budget).

    python benchmarks/fmnist_invariance.py --quick
    python benchmarks/fmnist_invariance.py --time-only --subset 10000 --samples 8 --hidden 1000
    python benchmarks/fmnist_invariance.py --subset 10000 --samples 8 --epochs 60 --arch mlp \\
        --hidden 500 --threads 1 --out runs/fmnist_inv.jsonl
    python benchmarks/fmnist_invariance.py --arch cnn --subset 5000 --epochs 24 --burnin 3 \\
        --hyper-lr 0.1 --marglik-batch-size 128 --methods none,lila --out runs/fmnist_inv_cnn.jsonl

On the CNN, evidence batches of 128 images (1,024 copies at S = 8) made the LILA evidence step
1.7× faster than batches of 512 on a CPU (our reading: glibc maps allocations over 32 MB afresh,
paying page faults each time, and reuses smaller ones); the batch size changes which copies are
drawn, not what is computed.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

import pyro_bnn as pb  # noqa: E402
from pyro_bnn.invariance import (  # noqa: E402
    GENERATORS,
    AffineAugmentation,
    learn_invariance,
    map_predict,
    transformed_fashion_mnist,
)
from pyro_bnn.reporting.output_files import check_new_file, save_figure  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=None, help="Fashion-MNIST folder (default: pb.datasets.fashion_mnist's)")
    p.add_argument("--subset", type=int, default=None, help="training images (seeded subset; default all 60,000)")
    p.add_argument("--num-test", type=int, default=None, help="test images (default all 10,000)")
    p.add_argument("--methods", default="lila,none,augerino")
    p.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--hidden", type=int, default=1000, help="MLP hidden tanh units (paper: 1000)")
    p.add_argument("--samples", type=int, default=8, help="S augmented copies (paper: 31)")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--burnin", type=int, default=5)
    p.add_argument("--every", type=int, default=1, help="evidence step every this many epochs")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--marglik-batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine")
    p.add_argument("--hyper-lr", type=float, default=0.05, help="Adam lr of η in LILA's evidence steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-only", action="store_true", help="one epoch + one evidence step per method")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (500 images, 2 epochs)")
    p.add_argument("--progress", default=None, help="JSON-lines file: one line per epoch and method")
    p.add_argument("--out", default=None, help="JSON-lines file the result rows are appended to")
    p.add_argument("--plot", nargs=2, metavar=("JSONL", "PNG"), default=None,
                   help="no training: print the table of the rows in JSONL and plot their extent and "
                        "evidence trajectories to PNG")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return p.parse_args(argv)


def make_net(arch: str, hidden: int) -> nn.Module:
    """The paper's MLP (784-hidden-10, tanh) or the LeNet-style CNN of ``pyro-bnn --arch cnn``."""
    if arch == "mlp":
        return nn.Sequential(nn.Linear(784, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    from pyro_bnn.reporting.cli import lenet

    return lenet(10)


def run_method(method, data, args):
    """Train one method; return its result row (figures and histories)."""
    torch.manual_seed(args.seed)
    aug = AffineAugmentation(num_samples=1 if method == "none" else args.samples)
    model = pb.BNN(make_net(args.arch, args.hidden), "categorical", augmentation=aug)
    n = len(data.x_train)
    t0 = time.perf_counter()

    def log(epoch, res):
        h = res.history
        ev = h["log_evidence"][-1] / n if h["log_evidence"] else None
        row = {"method": method, "epoch": epoch, "seconds": time.perf_counter() - t0,
               "loss": h["loss"][-1], "extent": h["extent"][-1], "log_evidence_per_datum": ev}
        if args.progress:
            with open(args.progress, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        if epoch % max(1, args.epochs // 20) == 0 or epoch == args.epochs or args.time_only:
            ext = " ".join(f"{v:.2f}" for v in h["extent"][-1])
            print(f"  [{method}] epoch {epoch:4d} {row['seconds']:7.0f}s loss {row['loss']:.4f} "
                  f"extent [{ext}] log-ev/N {ev if ev is None else round(ev, 4)}", flush=True)

    epochs, burnin = (1, 0) if args.time_only else (args.epochs, args.burnin)
    res = learn_invariance(model, data.train, method=method, epochs=epochs, batch_size=args.batch_size,
                           lr=args.lr, hyper_lr=args.hyper_lr, burnin=burnin, every=args.every,
                           seed=args.seed, lr_schedule=args.lr_schedule,
                           marglik_batch_size=args.marglik_batch_size, callback=log)
    h = res.history
    t_pred = time.perf_counter()
    probs = map_predict(model, res.values, data.x_test)
    idx = torch.arange(len(probs))
    return {
        "bench": "fmnist_invariance", "method": method, "arch": args.arch,
        "hidden": args.hidden if args.arch == "mlp" else None,
        "samples": 1 if method == "none" else args.samples, "num_train": n, "num_test": len(data.x_test),
        "epochs": epochs, "burnin": burnin, "lr": args.lr, "lr_schedule": args.lr_schedule,
        "hyper_lr": args.hyper_lr, "seed": args.seed, "threads": args.threads, "time_only": args.time_only,
        "accuracy": float((probs.argmax(-1) == data.y_test).float().mean()),
        "nll": float(-probs[idx, data.y_test].clamp_min(1e-12).log().mean()),
        "extent": h["extent"][-1],
        "log_evidence_per_datum": h["log_evidence"][-1] / n if h["log_evidence"] else None,
        "prior_precision": res.prior_precision.tolist(),
        "seconds": res.seconds, "predict_seconds": time.perf_counter() - t_pred,
        "epoch_seconds": h["epoch_seconds"], "hyper_seconds": h["hyper_seconds"],
        "loss_history": h["loss"], "extent_history": h["extent"],
        "log_evidence_history": [v / n for v in h["log_evidence"]], "evidence_epoch": h["evidence_epoch"],
    }


def print_table(rows):
    print("\n| method | S | test acc | test NLL | learned extent [" + " ".join(GENERATORS)
          + "] | log evidence / N | s/epoch (MAP) | s/evidence step | total s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ext = " ".join(f"{v:.2f}" for v in r["extent"])
        ev = "—" if r["log_evidence_per_datum"] is None else f"{r['log_evidence_per_datum']:.3f}"
        ep = sum(r["epoch_seconds"]) / len(r["epoch_seconds"])
        hs = sum(r["hyper_seconds"]) / len(r["hyper_seconds"]) if r["hyper_seconds"] else float("nan")
        print(f"| {r['method']} | {r['samples']} | {100 * r['accuracy']:.2f} % | {r['nll']:.3f} | {ext} | {ev} "
              f"| {ep:.1f} | {hs:.1f} | {r['seconds']:.0f} |")


def plot_rows(rows, path, *, overwrite=False):
    """Extents of the six generators (top) and log evidence / N (bottom) per epoch, one column per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(rows), figsize=(4.2 * len(rows), 5.4), squeeze=False, sharex="col")
    for k, r in enumerate(rows):
        ext = torch.tensor(r["extent_history"])
        for j, name in enumerate(GENERATORS):
            axes[0][k].plot(range(1, len(ext) + 1), ext[:, j], label=name)
        axes[0][k].axhline(math.pi, color="grey", ls=":", lw=1)
        axes[0][k].set_title(f"{r['method']} (S = {r['samples']}, acc {100 * r['accuracy']:.1f} %)")
        axes[0][k].set_ylabel("extent η")
        axes[1][k].plot(r["evidence_epoch"], r["log_evidence_history"], ".-")
        axes[1][k].set_ylabel("log evidence / N")
        axes[1][k].set_xlabel("epoch")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"rotated Fashion-MNIST (±π), {rows[0]['num_train']} train images")
    fig.tight_layout()
    save_figure(fig, path, dpi=110, overwrite=overwrite)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        check_new_file(args.plot[1], overwrite=args.overwrite)
        with open(args.plot[0]) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        print_table(rows)
        plot_rows(rows, args.plot[1], overwrite=args.overwrite)
        return rows
    if args.quick:
        args.subset, args.num_test, args.epochs, args.burnin, args.samples, args.hidden = 500, 500, 2, 1, 2, 32
    torch.set_num_threads(args.threads)
    data = transformed_fashion_mnist(args.root, "rotate", math.pi, num_train=args.subset, num_test=args.num_test,
                                     seed=args.seed, flatten=args.arch == "mlp")
    print(f"rotated Fashion-MNIST (±π): {len(data.x_train)} train / {len(data.x_test)} test; arch {args.arch}"
          + (f" 784-{args.hidden}-10 tanh" if args.arch == "mlp" else " (LeNet)")
          + f"; S = {args.samples}; {args.epochs} epochs, {args.lr_schedule} MAP lr {args.lr}", flush=True)
    rows = []
    for method in args.methods.split(","):
        row = run_method(method, data, args)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        rows.append(row)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
