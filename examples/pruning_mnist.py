"""Prune a converged mean-field BNN on MNIST by signal-to-noise, magnitude and zero-probability.

MNIST 5k/5k split (the first 5,000 digits of the MNIST test file train, the next 5,000 test),
784-400-400-10 ReLU MLP, MeanField guide trained to convergence (lr 5e-2, the library's MLP default before its 0.025 ceiling; the
means of wide layers at lr·√(100/fan_in), cosine decay; default 800 epochs, which end within 0.1 % of 1,600 in training ELBO; 400 end 1.6 % below), one of
four weight priors (default N(0, 1), the one the training ELBO picks).  Prints and plots accuracy vs fraction of weights removed for
each score, the fit's convergence evidence (ELBO over the last epochs, the diagnosis of
``pb.fit``, the share of learning-rate-limited scales) and the σ statistics.

Choosing the prior without the test set: ``--val 1000`` trains on the first 4,000 training
digits and also evaluates on the last 1,000 (a validation split of the training data); the
prior is chosen on those numbers (or on the ELBO), then the chosen one is trained on all
5,000 digits.  Test numbers are printed for every run, but only for reporting.

    .venv/bin/python examples/pruning_mnist.py --prior normal --val 1000 --epochs 400 --threads 1
    .venv/bin/python examples/pruning_mnist.py --prior normal --threads 1                # 800 epochs
    .venv/bin/python examples/pruning_mnist.py --prior normal --epochs 1600 --threads 1  # twice as long
    .venv/bin/python examples/pruning_mnist.py --quick                                  # smoke run
    .venv/bin/python examples/pruning_mnist.py --dataset digits --hidden 100 --epochs 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis import pruning
from pyro_bnn.analysis.uncertainty_plots import plot_pruning_curves
from pyro_bnn.reporting.output_files import check_new_file, save_figure, save_torch, write_json

_SPIKE = math.exp(-6)


def _layerwise(net: nn.Sequential) -> dict:
    """Per-layer priors: each layer's weights ``0.5 N(0, 1/fan_in) + 0.5 N(0, e^-12)``
    (a fan-in scaled slab with Blundell's spike), biases N(0, 1)."""
    spec = {"*": pb.priors.IIDNormal(1.0)}
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear):
            spec[f"net.{name}.weight"] = pb.priors.ScaleMixture(0.5, 1.0 / math.sqrt(m.in_features), _SPIKE)
    return spec


PRIORS = {
    "normal": lambda net: pb.priors.IIDNormal(1.0),
    "fanin": lambda net: pb.priors.FanInNormal(1.0),
    "mixture": lambda net: pb.priors.ScaleMixture(0.5, 1.0, _SPIKE),   # Blundell et al. 2015
    "layerwise": _layerwise,
}


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def convergence_evidence(fit) -> dict:
    """ELBO at the end, its change over the last 10 % / 20 % of epochs, and fit's diagnosis."""
    elbo = fit.history["elbo"]
    n = len(elbo)

    def mean(a, b):
        part = elbo[a:b]
        return sum(part) / len(part)

    w = max(n // 10, 1)
    return {"elbo_last10pct_mean": mean(n - w, n),
            "elbo_prev10pct_mean": mean(n - 2 * w, n - w),
            "elbo_at_80pct_mean": mean(max(int(0.8 * n) - w, 0), int(0.8 * n)),
            "converged": fit.convergence.converged,
            "reasons": fit.convergence.reasons,
            "measures": {k: v for k, v in fit.convergence.measures.items()
                         if isinstance(v, (int, float, bool, str)) or v is None}}


def sigma_stats(model, guide) -> dict:
    scales = torch.cat([guide.loc_and_scale(s)[1].detach().cpu().reshape(-1) for s in model.site_names])
    snr = torch.cat([v.cpu().reshape(-1) for v in pruning.scores(guide, kind="snr", model=model).values()])
    mag = torch.cat([v.cpu().reshape(-1) for v in pruning.scores(guide, kind="magnitude", model=model).values()])
    zp = torch.cat([v.cpu().reshape(-1) for v in pruning.scores(guide, kind="zero_prob", model=model).values()])
    q = torch.tensor([0.01, 0.5, 0.99])
    per_site = {s: [round(float(v), 5) for v in torch.quantile(guide.loc_and_scale(s)[1].detach()
                                                                .cpu().reshape(-1)[:1_000_000], q)]
                for s in model.site_names}
    return {"sigma_quantiles_1_50_99": [float(v) for v in torch.quantile(scales[:1_000_000], q)],
            "sigma_quantiles_per_site": per_site,
            "log_sigma_range": float(scales.log().max() - scales.log().min()),
            "spearman_snr_vs_magnitude": rank_correlation(snr, mag),
            "spearman_snr_vs_zero_prob": rank_correlation(snr, zp)}


def output_tag(args) -> str:
    """The tag of the output files (``--tag``, else ``<prior>_e<epochs>[_lr…][_kla…][_val…][_digits]``)."""
    return args.tag or ("quick" if args.quick else f"{args.prior}_e{args.epochs}"
                        + (f"_lr{args.lr:g}" if args.lr != 5e-2 else "")
                        + (f"_kla{args.kl_annealing}" if args.kl_annealing else "")
                        + (f"_val{args.val}" if args.val else "")
                        + ("_digits" if args.dataset == "digits" else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--dataset", choices=["mnist", "digits"], default="mnist",
                   help="digits: sklearn's 8×8 digits (1,348/449), a fast CPU stand-in")
    p.add_argument("--prior", choices=sorted(PRIORS), default="normal")
    p.add_argument("--val", type=int, default=0,
                   help="hold out the last VAL training digits as a validation split (prior choice)")
    p.add_argument("--epochs", type=int, default=800)
    p.add_argument("--hidden", type=int, default=400)
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-test", type=int, default=5000)
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--init-scale", type=float, default=1e-2)
    p.add_argument("--kl-annealing", type=int, default=0, help="MeanField KL warm-up epochs (0: off)")
    p.add_argument("--num-samples", type=int, default=16, help="predictive draws per fraction")
    p.add_argument("--fractions", default="0,0.5,0.75,0.9,0.95,0.98")
    p.add_argument("--kinds", default="snr,magnitude,zero_prob")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    p.add_argument("--device", default=None, help="training and evaluation device (e.g. cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1k/1k, 5 epochs (smoke run)")
    p.add_argument("--tag", default=None, help="output file tag (default <prior>_e<epochs>[_val<N>])")
    p.add_argument("--out", default="docs/results/figures")
    p.add_argument("--save-state", default=None, help="save model and guide state here")
    p.add_argument("--load-state", default=None, help="skip training: load this saved state")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.num_train, args.num_test = 5, 1000, 1000
    tag = output_tag(args)
    json_path = os.path.join(args.out, f"pruning_mnist_{tag}.json")
    png_path = os.path.join(args.out, f"pruning_mnist_{tag}.png")
    # every output path before any training: a long run is never lost at its end
    for path in [json_path, png_path] + ([args.save_state] if args.save_state and not args.load_state else []):
        check_new_file(path, overwrite=args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    fractions = [float(f) for f in args.fractions.split(",")]

    if args.dataset == "digits":
        data = pb.datasets.digits()
    else:
        data = pb.datasets.mnist_split(args.data_dir, args.num_train, args.num_test)
    x_train, y_train = data.x_train, data.y_train
    evals = {"test": (data.x_test, data.y_test)}
    if args.val:
        if not 0 < args.val < len(x_train):
            raise SystemExit(f"--val must be in (0, {len(x_train)}), got {args.val}")
        evals["val"] = (x_train[-args.val:], y_train[-args.val:])
        x_train, y_train = x_train[:-args.val], y_train[:-args.val]
    d_in = x_train.shape[1]
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(d_in, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                        nn.ReLU(), nn.Linear(args.hidden, 10))
    model = pb.BNN(net, "categorical", prior=PRIORS[args.prior](net))
    if args.device:
        model.to(args.device)
    guide = pb.guides.MeanField(model, init_scale=args.init_scale, kl_annealing=args.kl_annealing)
    summary = {"args": vars(args), "num_train": len(x_train)}
    if args.load_state:
        pb.training.setup_guide(model, guide, x_train[:2].to(args.device or "cpu"),
                                y_train[:2].to(args.device or "cpu"))
        state = torch.load(args.load_state, weights_only=True, map_location=args.device or "cpu")
        model.load_state_dict(state["model"])
        guide.load_state_dict(state["guide"])
        summary["loaded"] = args.load_state
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", pb.ConvergenceWarning)
            fit = pb.fit(model, guide, (x_train, y_train), epochs=args.epochs, batch_size=args.batch_size,
                         lr=args.lr, lr_schedule=args.lr_schedule, seed=args.seed, progress=False,
                         device=args.device)
        summary.update(train_seconds=fit.seconds, convergence=convergence_evidence(fit),
                       elbo_history=fit.history["elbo"],
                       warnings=[str(w.message) for w in caught if issubclass(w.category, pb.ConvergenceWarning)])
        if not math.isfinite(fit.final_loss):
            raise SystemExit("training diverged")
        if args.save_state:
            save_torch({"model": model.state_dict(), "guide": guide.state_dict()}, args.save_state,
                       overwrite=args.overwrite)
    summary["sigma_stats"] = sigma_stats(model, guide)

    t1 = time.perf_counter()
    curves = {}
    for split, (x, y) in evals.items():
        curves[split] = {kind: pruning.pruning_curve(model, guide, x, y, fractions=fractions, kind=kind,
                                                     num_samples=args.num_samples, seed=args.seed)
                         for kind in args.kinds.split(",")}
        curves[split]["snr (mean net)"] = pruning.pruning_curve(model, guide, x, y, fractions=fractions, kind="snr",
                                                                predictive="mean")
    summary.update(eval_seconds=time.perf_counter() - t1, curves=curves)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("curves", "elbo_history")}, indent=1))
    for split, by_kind in curves.items():
        print(f"{split:5s} {'score':18s} " + " ".join(f"{100 * f:6.1f}%" for f in fractions))
        for label, c in by_kind.items():
            print(f"{split:5s} {label:18s} " + " ".join(f"{100 * a:6.2f} " for a in c["accuracy"]))
    write_json(json_path, summary, indent=1, overwrite=args.overwrite)
    test = curves["test"]
    fig = plot_pruning_curves({k: test[k] for k in args.kinds.split(",")},
                              title=f"MeanField {args.dataset} ({len(x_train)} train, {args.prior} prior, "
                                    f"{args.epochs} epochs): pruning",
                              baseline=test["snr"]["accuracy"][0])
    save_figure(fig, png_path, dpi=120, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
