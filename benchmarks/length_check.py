"""Are the main job's lengths enough?  ``pb.check_convergence`` on each guide's main-job settings.

For each guide of the main job (digits, MLP 64-100-10, batch 64, the settings of
``pyro_bnn.reporting.cli.GUIDE_DEFAULTS``: its epochs, lr, model options and fit options),
fits E and ``--factor`` × E epochs from one seed and compares the final training objectives
(ELBO; for Laplace the MAP's log joint without its prior normaliser), estimated after
training from ``--draws`` passes over the training data.  Prints the two objectives, the
relative gain and its standard error, the verdict at ``--tolerance``, and each fit's in-fit
diagnosis (``pb.fit``'s ``converged`` label), so the two checks can be compared.

    python benchmarks/length_check.py --threads 1
    python benchmarks/length_check.py --guides meanfield hypernet --threads 1
    python benchmarks/length_check.py --guides symmetrized --epochs 300 --draws 400   # another length
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.guide import registered_guides
from pyro_bnn.reporting.cli import GUIDE_DEFAULTS


def make_pair(name: str):
    """The main job's model (digits MLP 64-100-10 with the guide's model options) and guide."""
    options = dict(GUIDE_DEFAULTS.get(name, {}).get("model", {}))
    factory = registered_guides()[name]

    def make():
        net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
        model = pb.BNN(net, likelihood="categorical", **options)
        return model, factory(model)

    return make


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guides", nargs="*", default=["meanfield", "symmetrized", "hypernet", "laplace"])
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=None,
                    help="the shorter length, for every guide (default: each guide's main-job epochs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = pb.datasets.digits()
    print(f"digits 1,348 train, MLP 64-100-10, batch 64, seed {args.seed}, factor {args.factor}, "
          f"tolerance {100 * args.tolerance:g} %, {args.draws} estimation passes; torch {torch.__version__}")
    print("| guide | epochs | objective | longer | relative gain ± se | verdict | in-fit diagnosis (short / long) | s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.guides:
        settings = GUIDE_DEFAULTS.get(name, {})
        fit_kw = dict(settings.get("fit", {}))
        if "lr" in settings:
            fit_kw["lr"] = settings["lr"]
        t0 = time.perf_counter()
        check = pb.check_convergence(make_pair(name), data.train, epochs=args.epochs or settings.get("epochs", 40),
                                     factor=args.factor, tolerance=args.tolerance, seed=args.seed,
                                     num_samples=args.draws, warn=False, batch_size=64, **fit_kw)
        (e1, e2), (o1, o2) = check.epochs, check.objective
        labels = " / ".join(f.convergence.label() for f in check.fits)
        print(f"| {name} | {e1} → {e2} | {o1:,.1f} ± {check.standard_error[0]:.1f} | {o2:,.1f} ± "
              f"{check.standard_error[1]:.1f} | {100 * check.relative_gain:+.2f} ± {100 * check.relative_gain_se:.2f} % "
              f"| {'enough' if check.converged else 'not enough'} | {labels} | {time.perf_counter() - t0:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
