"""BatchNorm statistics per posterior draw (``pb.predict(..., bn_data=...)``) against the running
statistics of training, on one fitted posterior, side by side.

A sampling guide trains BatchNorm's running statistics over many weight draws; ``bn_data``
re-estimates them under each draw from training inputs (SWAG's practice).  This script fits one
guide on a BatchNorm network and scores the same draws both ways (same seed), printing test
accuracy / NLL / ECE / Brier, MNIST-digit OOD AUROC for Fashion-MNIST, and the prediction time of
each (the ratio is the cost of one pass over ``bn_data`` per draw).

    python benchmarks/batchnorm_draws.py --dataset digits --arch mlp --epochs 100
    python benchmarks/batchnorm_draws.py --dataset fashion-mnist --arch cnn --epochs 30 --bn-inputs 5000
    python benchmarks/batchnorm_draws.py --dataset fashion-mnist --arch cnn --epochs 30 --map   # the MAP net
    python benchmarks/batchnorm_draws.py --dataset digits --arch mlp --guide hypernet --epochs 100

``--guide hypernet`` fits the registry's Hypernet on the weight-norm form of the network (its flow
over the scales g; BatchNorm divides the scales of the layers it follows out, which the library
warns about).

``--map`` trains the same network as a plain PyTorch MAP net instead (Adam 1e-3, cosine, batch 64,
weight decay 1/N: the N(0, 1) prior, as the MAP rows of ``benchmarks/fashion_mnist.py``) and scores
it in eval mode.  The guide's row also reports its full-data ELBO (5 draws, MeanField only),
computed last because it runs the network in train mode.

One JSON line per run (``--out``, refused if the file exists unless ``--overwrite``).

``--checkpoint PATH`` writes the fit's state after every epoch (``pb.fit(checkpoint=...)``); the
same command with ``--resume`` continues it bit for bit after an interruption, so a run longer
than one sitting can be finished later.  ``fit_seconds`` then counts the resumed part only
(``resumed_from_epoch`` says where it started).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.ood import evaluate_probs
from pyro_bnn.reporting.output_files import check_new_file, write_text
from pyro_bnn.training.checkpoint import read_checkpoint


def make_net(arch: str, side: int) -> nn.Module:
    """A BatchNorm MLP (flat inputs) or CNN (``(N, 1, side, side)`` inputs)."""
    if arch == "mlp":
        return nn.Sequential(nn.Linear(side * side, 100), nn.BatchNorm1d(100), nn.ReLU(), nn.Linear(100, 10))
    flat = 16 * (side // 4) ** 2
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(flat, 100), nn.BatchNorm1d(100), nn.ReLU(), nn.Linear(100, 10))


def load(args):
    """Train / test (and MNIST OOD inputs for Fashion-MNIST), shaped for ``args.arch``."""
    flatten = args.arch == "mlp"
    if args.dataset == "digits":
        d = pb.datasets.digits()
        x_train, x_test = d.x_train, d.x_test
        if not flatten:
            x_train, x_test = x_train.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
        return (x_train, d.y_train), (x_test, d.y_test), None, 8
    train = pb.datasets.fashion_mnist(args.data_root, "train", flatten=flatten)
    test = pb.datasets.fashion_mnist(args.data_root, "test", flatten=flatten)
    ood, _ = pb.datasets.mnist(args.mnist_root, "test", flatten=flatten)
    return train, test, ood, 28


def scores(model, guide, x, y, ood, args, bn_data) -> dict:
    """Test metrics (and OOD AUROC by predictive entropy) of one predictive, timed."""
    torch.manual_seed(args.seed + 1)
    start = time.perf_counter()
    probs = pb.predict(model, guide, x, num_samples=args.num_samples, bn_data=bn_data, batch_size=2000)
    seconds = time.perf_counter() - start
    row = {k: float(v) for k, v in pb.metrics.classification_metrics(probs, y, num_bins=15).items()}
    if ood is not None:
        torch.manual_seed(args.seed + 1)
        p_out = pb.predict(model, guide, ood, num_samples=args.num_samples, bn_data=bn_data, batch_size=2000)
        labels = torch.cat([torch.zeros(probs.shape[1]), torch.ones(p_out.shape[1])])
        ood_scores = evaluate_probs(torch.cat([probs, p_out], 1), labels)
        row["ood_auroc_entropy"] = ood_scores["entropy"]["auroc"]
        row["ood_auroc_mi"] = ood_scores["mutual_information"]["auroc"]
    row["predict_seconds"] = seconds
    return row


def map_row(args, train, test, ood, side) -> dict:
    """The plain PyTorch MAP net of the same architecture, scored in eval mode."""
    from _common import train_map_  # benchmarks/_common.py (on sys.path when run as a script)

    x, y = train
    torch.manual_seed(args.seed)
    net = make_net(args.arch, side)
    losses, seconds = train_map_(net, x, y, epochs=args.epochs, seed=args.seed, weight_decay=1.0 / len(x))
    net.eval()
    with torch.no_grad():
        probs = torch.cat([torch.softmax(net(test[0][i:i + 2000]), -1) for i in range(0, len(test[0]), 2000)])[None]
        row = {k: float(v) for k, v in pb.metrics.classification_metrics(probs, test[1], num_bins=15).items()}
        if ood is not None:
            p_out = torch.cat([torch.softmax(net(ood[i:i + 2000]), -1) for i in range(0, len(ood), 2000)])[None]
            labels = torch.cat([torch.zeros(probs.shape[1]), torch.ones(p_out.shape[1])])
            row["ood_auroc_entropy"] = evaluate_probs(torch.cat([probs, p_out], 1), labels)["entropy"]["auroc"]
    return dict(dataset=args.dataset, arch=args.arch, guide="map", epochs=args.epochs, seed=args.seed,
                loss_curve=[round(v, 5) for v in losses], seconds_per_epoch=sum(seconds) / len(seconds), **row)


def resumed_epoch(path) -> int:
    """The epochs already done in the checkpoint at ``path`` (0 when there is none yet)."""
    if path is None:
        raise SystemExit("--resume needs --checkpoint PATH")
    return int(read_checkpoint(path)["epoch"]) if os.path.exists(path) else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["digits", "fashion-mnist"], default="digits")
    parser.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--guide", default="meanfield", help="a registered guide with weight draws")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=50)
    parser.add_argument("--bn-inputs", type=int, default=0, help="training inputs for bn_data (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the guide's own rate for N)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-root", default=None, help="Fashion-MNIST folder (default: Debian's)")
    parser.add_argument("--mnist-root", default="/work/shared/data/mnist", help="MNIST IDX folder (OOD set)")
    parser.add_argument("--out", default=None, help="write the JSON line here")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--map", action="store_true", help="the plain PyTorch MAP net instead of a guide")
    parser.add_argument("--checkpoint", default=None, help="write the fit's state here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue the fit saved at --checkpoint")
    args = parser.parse_args(argv)
    if args.out:
        check_new_file(args.out, overwrite=args.overwrite)
    torch.set_num_threads(args.threads)
    (x, y), (xt, yt), ood, side = load(args)
    if args.map:
        row = map_row(args, (x, y), (xt, yt), ood, side)
        print(json.dumps(row, default=float))
        if args.out:
            write_text(args.out, json.dumps(row, default=float) + "\n", overwrite=args.overwrite)
        return
    torch.manual_seed(args.seed)
    # hypernet: the registry's guide on a weight-norm BNN (its flow over the scales g), which warns
    # that BatchNorm divides those scales out
    model = pb.BNN(make_net(args.arch, side), "categorical", weight_norm=args.guide == "hypernet")
    guide = pb.guides.registered_guides()[args.guide](model)
    resumed_from = resumed_epoch(args.checkpoint) if args.resume else 0
    start = time.perf_counter()
    result = pb.fit(model, guide, (x, y), epochs=args.epochs, seed=args.seed, progress=False, lr=args.lr,
                    checkpoint=args.checkpoint, resume=args.resume)
    fit_seconds = time.perf_counter() - start
    bn_data = x if not args.bn_inputs else x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
                                              [:args.bn_inputs]]
    running = scores(model, guide, xt, yt, ood, args, None)
    per_draw = scores(model, guide, xt, yt, ood, args, bn_data)
    row = dict(dataset=args.dataset, arch=args.arch, guide=args.guide, epochs=args.epochs, seed=args.seed,
               num_samples=args.num_samples, bn_inputs=len(bn_data), lr=result.lr, fit_seconds=fit_seconds,
               resumed_from_epoch=resumed_from,
               converged=result.convergence.converged if result.convergence else None,
               convergence=str(result.convergence), running_statistics=running, per_draw_statistics=per_draw,
               time_ratio=per_draw["predict_seconds"] / running["predict_seconds"],
               loss_curve=[round(v, 1) for v in result.history["loss"]])
    if args.guide == "meanfield":  # last: the ELBO runs the network in train mode (BatchNorm batch statistics)
        from fashion_mnist import full_elbo  # benchmarks/fashion_mnist.py

        row["elbo_full_data"], row["elbo_full_data_se"], row["elbo_full_data_median"] = full_elbo(model, guide, x, y)
    line = json.dumps(row, default=float)
    print(line)
    for name, r in (("running statistics", running), ("per-draw (bn_data)", per_draw)):
        print(f"{name:20s} acc {r['accuracy']:.4f}  NLL {r['nll']:.4f}  ECE {r['ece']:.4f}  "
              f"Brier {r['brier']:.4f}  AUROC {r.get('ood_auroc_entropy', float('nan')):.3f}  "
              f"{r['predict_seconds']:.1f} s")
    if args.out:
        write_text(args.out, line + "\n", overwrite=args.overwrite)


if __name__ == "__main__":
    main()
