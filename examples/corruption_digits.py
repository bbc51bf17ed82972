"""Corruption curves (talk repo): uncertainty vs rotation angle and vs noise level.

Trains each guide on the training split, then records the test-set mean predictive entropy,
mutual information and accuracy as every test image is rotated by 0…``--max-angle``° or has
Gaussian pixel noise of growing std added.  Checks that the mean entropy rises 0 → 90°
(and whether it does so monotonically).

Data: ``--dataset digits`` (8×8 scikit-learn digits, 75/25 split) or ``--dataset mnist``
(28×28; the first ``--num-train`` images of the MNIST test file for training, the next
``--num-test`` for evaluation; IDX files in ``--data-dir``).  The Laplace guide is
evaluated with its linearised (GLM) predictive *and* with weight samples.

Training protocol (converged posteriors): cosine learning-rate decay over ``--epochs``;
each guide at its own ``default_lr`` (``--lr`` overrides), point-estimate training (the MAP
net ``AutoDelta`` and the Laplace guides' MAP) at ``--map-lr``, guides without a default at
``--other-lr``.  Each fit's ELBO over the last 10 % of epochs and ``pb.fit``'s convergence
diagnosis are printed and saved in the JSON.

    .venv/bin/python examples/corruption_digits.py --dataset mnist --data-dir ../shared/data/mnist \\
        --hidden 200 --prior fanin --guides meanfield,hypernet,AutoDelta,laplace --threads 1
    .venv/bin/python examples/corruption_digits.py --epochs 300 --out docs/results/figures
    .venv/bin/python examples/corruption_digits.py --quick
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.uncertainty_plots import plot_corruption_curves
from pyro_bnn.contract.guide import guide_contract
from pyro_bnn.guides import init_to_network, registered_guides
from pyro_bnn.reporting.output_files import check_new_file, save_figure, write_json

PYRO = {"AutoNormal": lambda m: AutoNormal(m, init_loc_fn=init_to_network(m), init_scale=0.01),
        "AutoDelta": lambda m: AutoDelta(m, init_loc_fn=init_to_network(m))}
PRIORS = {"normal": lambda: pb.priors.IIDNormal(1.0), "fanin": lambda: pb.priors.FanInNormal(1.0)}
#: guides trained as a point estimate (Laplace: its MAP, then the curvature)
POINT_ESTIMATES = ("AutoDelta", "laplace", "laplace_all")


def mlp(sizes: list[int]) -> nn.Sequential:
    """``sizes[0]-…-sizes[-1]`` ReLU MLP."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def load(args) -> pb.datasets.DataSplit:
    if args.dataset == "digits":
        return pb.datasets.digits()
    return pb.datasets.mnist_split(args.data_dir, args.num_train, args.num_test)


def evaluations(name: str) -> dict[str, str]:
    """Curve label -> predictive method for guide ``name``."""
    if name == "laplace":
        return {"laplace (GLM)": "glm", "laplace (sampled)": "sample"}
    if name == "AutoDelta":
        return {"AutoDelta (MAP)": "sample"}
    return {name: "sample"}


def output_paths(args) -> dict[str, str]:
    """The files the run writes: ``json``, ``rotation`` and ``noise`` (figures)."""
    tag = args.tag or ("quick" if args.quick else f"e{args.epochs}")
    # digits keep their earlier file names (corruption_digits_e20.json, corruption_rotation_e20.png)
    prefix = "corruption" if args.dataset == "digits" else "corruption_mnist"
    return {"json": os.path.join(args.out, f"corruption_{args.dataset}_{tag}.json"),
            "rotation": os.path.join(args.out, f"{prefix}_rotation_{tag}.png"),
            "noise": os.path.join(args.out, f"{prefix}_noise_{tag}.png")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=("digits", "mnist"), default="digits")
    p.add_argument("--data-dir", default="../shared/data/mnist", help="MNIST IDX files (--dataset mnist)")
    p.add_argument("--num-train", type=int, default=5000, help="MNIST training images (--dataset mnist)")
    p.add_argument("--num-test", type=int, default=1000, help="MNIST evaluation images (--dataset mnist)")
    p.add_argument("--guides", default=",".join(sorted(registered_guides())) + ",AutoNormal,AutoDelta")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--hidden", default="50", help="hidden widths, comma-separated (e.g. 400,400)")
    p.add_argument("--prior", choices=sorted(PRIORS), default="normal",
                   help="weight prior (hypernet: its weight-norm model's own)")
    p.add_argument("--lr", type=float, default=None, help="one learning rate for every guide")
    p.add_argument("--map-lr", type=float, default=1e-2, help="AutoDelta and the Laplace guides' MAP")
    p.add_argument("--other-lr", type=float, default=1e-2, help="guides without a default_lr")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--max-angle", type=int, default=180, help="angles 0, 15, …, max-angle")
    p.add_argument("--angles", default=None, help="comma-separated angles (overrides --max-angle)")
    p.add_argument("--tag", default=None, help="output file tag (default e<epochs>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 epochs, 8 samples")
    p.add_argument("--out", default="docs/results/figures")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.num_samples = 3, 8
    outputs = output_paths(args)
    for path in outputs.values():   # before any training: a long run is never lost at its end
        check_new_file(path, overwrite=args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    d = load(args)
    sizes = [d.x_train.shape[1], *(int(h) for h in args.hidden.split(",") if h), 10]
    angles = ([float(a) for a in args.angles.split(",")] if args.angles
              else list(range(0, args.max_angle + 1, 15)))
    stds = [0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]
    factories = {**registered_guides(), **PYRO}
    rot, noise, checks = {}, {}, {}
    for name in args.guides.split(","):
        torch.manual_seed(args.seed)
        weight_norm = name == "hypernet"
        model = pb.BNN(mlp(sizes), "categorical", weight_norm=weight_norm,
                       prior=None if weight_norm else PRIORS[args.prior]())
        guide = factories[name](model)
        lr = (args.lr if args.lr is not None else args.map_lr if name in POINT_ESTIMATES
              else guide_contract(guide).default_lr or args.other_lr)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pb.ConvergenceWarning)   # recorded below instead
            fit = pb.fit(model, guide, d.train, epochs=args.epochs, batch_size=args.batch_size, lr=lr,
                         lr_schedule=args.lr_schedule, seed=args.seed, progress=False)
        secs = time.perf_counter() - t0
        elbo = fit.history["elbo"]
        w = max(len(elbo) // 10, 1)
        training = {"lr": lr, "elbo_last10pct": sum(elbo[-w:]) / w, "elbo_prev10pct": sum(elbo[-2 * w:-w]) / w,
                    "converged": fit.convergence.converged, "convergence_reasons": fit.convergence.reasons,
                    "scale_limited_share": fit.convergence.measures.get("scale_limited_share"),
                    "train_seconds": secs}
        print(f"{name:20s} lr {lr:g}: ELBO last 10% {training['elbo_last10pct']:.1f} (previous 10% "
              f"{training['elbo_prev10pct']:.1f}), converged={fit.convergence.converged} "
              f"{fit.convergence.reasons}", flush=True)
        for label, method in evaluations(name).items():
            rot[label] = pb.analysis.corruption.rotation_curve(model, guide, d.x_test, d.y_test, angles=angles,
                                                      num_samples=args.num_samples, seed=args.seed,
                                                      predictive=method)
            noise[label] = pb.analysis.corruption.noise_curve(model, guide, d.x_test, d.y_test, stds=stds,
                                                     num_samples=args.num_samples, seed=args.seed,
                                                     predictive=method)
            ent = dict(zip(angles, rot[label]["entropy"]))
            upto90 = [ent[a] for a in angles if a <= 90]
            checks[label] = {"entropy_0": ent[0], "entropy_90": ent.get(90),
                             "rises_0_to_90": ent.get(90, float("nan")) > ent[0],
                             "monotone_0_to_90": all(a <= b for a, b in zip(upto90, upto90[1:])),
                             "accuracy_0": rot[label]["accuracy"][0], **training}
            print(f"{label:20s} acc {checks[label]['accuracy_0']:.3f} entropy "
                  + " ".join(f"{a:g}°={h:.3f}" for a, h in ent.items())
                  + f" monotone 0-90: {checks[label]['monotone_0_to_90']} "
                  f"noise H: {[round(h, 2) for h in noise[label]['entropy']]} ({secs:.0f}s)", flush=True)
    data_name = "Digits" if args.dataset == "digits" else "MNIST"
    write_json(outputs["json"], {"args": vars(args), "checks": checks, "rotation": rot, "noise": noise},
               indent=1, overwrite=args.overwrite)
    arch = "-".join(map(str, sizes))
    fig = plot_corruption_curves(rot, key="entropy",
                                 title=f"{data_name} ({arch}): mean predictive entropy vs rotation")
    save_figure(fig, outputs["rotation"], dpi=120, overwrite=args.overwrite)
    fig = plot_corruption_curves(noise, key="entropy",
                                 title=f"{data_name} ({arch}): mean predictive entropy vs Gaussian noise",
                                 xlabel="noise std (pixels in [0, 1])")
    save_figure(fig, outputs["noise"], dpi=120, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
