"""How many posterior draws does a Monte Carlo test NLL need?

``pb.evaluate`` / ``pb.predict`` score the Bayesian model average ``p̄(y) = mean_s p_s(y)`` from S
weight draws.  ``−log p̄`` is concave in the draws, so the S-draw NLL is biased *upwards* (Jensen):
``E[NLL_S] ≥ NLL_∞``, with a bias that shrinks like 1/S.  A MAP net has no such bias, so a
comparison "BNN NLL vs MAP NLL" at small S is tilted against the BNN.  This script measures the
bias on one fitted posterior: it draws ``--max-samples`` predictive draws once, then reports the
NLL (and accuracy, ECE) of S = 8, 16, … draws averaged over the disjoint groups of S draws, beside
the all-draw figure and the estimated bias ``NLL_S − NLL_max``.

The posterior comes from a ``benchmarks/batchnorm_draws.py --checkpoint`` file (restored by
``pb.fit(..., resume=True)`` with no epoch left, on a private copy of the file), or is fitted here
on digits (``--dataset digits``, seconds; the smoke run)::

    python benchmarks/nll_draws.py --dataset digits --epochs 100
    python benchmarks/nll_draws.py --dataset fashion-mnist --arch cnn --checkpoint run.pt --bn-inputs 5000

``--bn-inputs`` scores with BatchNorm statistics per draw (``bn_data=``, as the BatchNorm-CNN rows
of the results); 0 uses the running statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

import torch
from batchnorm_draws import load, make_net  # benchmarks/batchnorm_draws.py (on sys.path as a script)

import pyro_bnn as pb
from pyro_bnn.training.checkpoint import read_checkpoint


def restore(args, x, y, side):
    """The fitted model and guide: from ``--checkpoint`` (a copy, untouched), else fitted here."""
    torch.manual_seed(args.seed)
    model = pb.BNN(make_net(args.arch, side), "categorical")
    guide = pb.guides.registered_guides()[args.guide](model)
    if args.checkpoint is None:
        pb.fit(model, guide, (x, y), epochs=args.epochs, seed=args.seed, progress=False)
        return model, guide, args.epochs
    epochs = int(read_checkpoint(args.checkpoint)["epoch"])
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "fit.pt")
        shutil.copyfile(args.checkpoint, copy)
        pb.fit(model, guide, (x, y), epochs=epochs, seed=args.seed, progress=False, checkpoint=copy, resume=True)
    return model, guide, epochs


def by_draws(probs: torch.Tensor, y: torch.Tensor, sizes) -> list[dict]:
    """Metrics of S-draw averages, each the mean over the ``max // S`` disjoint groups of S draws."""
    rows = []
    for s in sizes:
        groups = [probs[i:i + s] for i in range(0, probs.shape[0] - s + 1, s)]
        scored = [pb.metrics.classification_metrics(g, y, num_bins=15) for g in groups]
        nll = [float(m["nll"]) for m in scored]
        mean = sum(nll) / len(nll)
        sd = math.sqrt(sum((v - mean) ** 2 for v in nll) / (len(nll) - 1)) if len(nll) > 1 else float("nan")
        rows.append(dict(num_samples=s, groups=len(groups), nll=mean, nll_sd=sd,
                         accuracy=sum(float(m["accuracy"]) for m in scored) / len(scored),
                         ece=sum(float(m["ece"]) for m in scored) / len(scored)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["digits", "fashion-mnist"], default="digits")
    parser.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--guide", default="meanfield")
    parser.add_argument("--checkpoint", default=None, help="a batchnorm_draws.py --checkpoint file (read only)")
    parser.add_argument("--epochs", type=int, default=100, help="epochs when fitting here (no --checkpoint)")
    parser.add_argument("--max-samples", type=int, default=512)
    parser.add_argument("--bn-inputs", type=int, default=0, help="training inputs for bn_data (0: running statistics)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-root", default=None, help="Fashion-MNIST folder (default: Debian's)")
    parser.add_argument("--mnist-root", default="/work/shared/data/mnist", help="MNIST IDX folder (read by the shared loader; not scored here)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    (x, y), (xt, yt), _, side = load(args)
    model, guide, epochs = restore(args, x, y, side)
    bn_data = None
    if args.bn_inputs:
        bn_data = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:args.bn_inputs]]
    torch.manual_seed(args.seed + 1)
    start = time.perf_counter()
    probs = pb.predict(model, guide, xt, num_samples=args.max_samples, bn_data=bn_data, batch_size=2000)
    seconds = time.perf_counter() - start
    sizes = [s for s in (8, 16, 32, 50, 64, 128, 256, 512, 1024) if s <= args.max_samples // 2]
    rows = by_draws(probs, yt, sizes + [args.max_samples])
    reference = rows[-1]["nll"]
    for r in rows:
        r["bias"] = r["nll"] - reference
        print(f"S = {r['num_samples']:5d} ({r['groups']:3d} groups)  NLL {r['nll']:.4f} ± {r['nll_sd']:.4f}  "
              f"NLL_S − NLL_{args.max_samples} {r['bias']:+.4f}  acc {r['accuracy']:.4f}  ECE {r['ece']:.4f}")
    print(json.dumps(dict(dataset=args.dataset, arch=args.arch, guide=args.guide, epochs=epochs,
                          checkpoint=args.checkpoint, bn_inputs=args.bn_inputs, predict_seconds=seconds, rows=rows)))


if __name__ == "__main__":
    main()
