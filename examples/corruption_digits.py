"""Corruption curves on digits (talk repo): uncertainty vs rotation angle and vs noise level.

Trains each guide on the digits training split, then records the test-set mean predictive
entropy, mutual information and accuracy as every test digit is rotated by 0…180° or has
Gaussian pixel noise of growing std added.  Checks that the mean entropy rises 0 → 90°.

    .venv/bin/python examples/corruption_digits.py --epochs 30 --out docs/results/figures
    .venv/bin/python examples/corruption_digits.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pyro
import torch
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides import init_to_network, registered_guides
from pyro_bnn.uncertainty_plots import plot_corruption_curves

PYRO = {"AutoNormal": lambda m: AutoNormal(m, init_loc_fn=init_to_network(m), init_scale=0.01),
        "AutoDelta": lambda m: AutoDelta(m, init_loc_fn=init_to_network(m))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guides", default=",".join(sorted(registered_guides())) + ",AutoNormal,AutoDelta")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--hidden", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 epochs, 8 samples")
    p.add_argument("--out", default="docs/results/figures")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.num_samples = 3, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    d = pb.datasets.digits()
    angles = list(range(0, 181, 15))
    stds = [0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]
    factories = {**registered_guides(), **PYRO}
    rot, noise, checks = {}, {}, {}
    for name in args.guides.split(","):
        pyro.set_rng_seed(args.seed)
        net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
        model = pb.BNN(net, "categorical", weight_norm=(name == "hypernet"))
        guide = factories[name](model)
        t0 = time.perf_counter()
        pb.fit(model, guide, d.train, epochs=args.epochs, batch_size=64, lr=args.lr, seed=args.seed,
               progress=False)
        secs = time.perf_counter() - t0
        rot[name] = pb.corruption.rotation_curve(model, guide, d.x_test, d.y_test, angles=angles,
                                                 num_samples=args.num_samples, seed=args.seed)
        noise[name] = pb.corruption.noise_curve(model, guide, d.x_test, d.y_test, stds=stds,
                                                num_samples=args.num_samples, seed=args.seed)
        ent = dict(zip(rot[name]["angle"], rot[name]["entropy"]))
        upto90 = [ent[a] for a in angles if a <= 90]
        checks[name] = {"entropy_0": ent[0], "entropy_90": ent[90], "rises_0_to_90": ent[90] > ent[0],
                        "monotone_0_to_90": all(a <= b for a, b in zip(upto90, upto90[1:])),
                        "accuracy_0": rot[name]["accuracy"][0], "train_seconds": secs}
        print(f"{name:30s} acc {checks[name]['accuracy_0']:.3f} entropy 0°={ent[0]:.3f} 45°={ent[45]:.3f} "
              f"90°={ent[90]:.3f} 180°={ent[180]:.3f} monotone 0-90: {checks[name]['monotone_0_to_90']} "
              f"noise H: {[round(h, 2) for h in noise[name]['entropy']]} ({secs:.0f}s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = "quick" if args.quick else f"e{args.epochs}"
    with open(os.path.join(args.out, f"corruption_digits_{tag}.json"), "w") as fh:
        json.dump({"args": vars(args), "checks": checks, "rotation": rot, "noise": noise}, fh, indent=1)
    plot_corruption_curves(rot, "entropy", os.path.join(args.out, f"corruption_rotation_{tag}.png"),
                           title="Digits: mean predictive entropy vs rotation")
    plot_corruption_curves(noise, "entropy", os.path.join(args.out, f"corruption_noise_{tag}.png"),
                           title="Digits: mean predictive entropy vs Gaussian noise",
                           xlabel="noise std (pixels in [0, 1])")


if __name__ == "__main__":
    main()
