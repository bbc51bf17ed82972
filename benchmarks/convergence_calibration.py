"""The convergence diagnosis of pb.fit on fits known to be converged or not (training data only).

MeanField on the offline digits (MLP 64-100-10, IIDNormal(1.0), batch 64, seed per row),
trained with the settings of each row; prints the statistics :mod:`pyro_bnn.training.convergence`
measures (trend of the epoch objective over the last window and its standard error, share
of scales moved at the optimiser's maximum rate) and its verdict, next to the final training
ELBO (mean of the last 5 % of epochs) — the reference being the 1,000-epoch cosine row.

    python benchmarks/convergence_calibration.py            # all rows (~2,600 epochs)
    python benchmarks/convergence_calibration.py --rows conv300 cos20
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import pyro
import torch
from torch import nn

import pyro_bnn as pb

#: name -> (init_scale, lr, lr_schedule, epochs, seed)
ROWS = {
    "conv300": (0.1, 5e-2, "cosine", 300, 0),
    "conv300s1": (0.1, 5e-2, "cosine", 300, 1),
    "conv300s2": (0.1, 5e-2, "cosine", 300, 2),
    "conv1000": (0.1, 5e-2, "cosine", 1000, 0),
    "cos20": (0.1, 5e-2, "cosine", 20, 0),
    "cos50": (0.1, 5e-2, "cosine", 50, 0),
    "cos100": (0.1, 5e-2, "cosine", 100, 0),
    "const20": (0.1, 1e-2, "constant", 20, 0),
    "const100": (0.1, 1e-2, "constant", 100, 0),
    "const300_5e-2": (0.1, 5e-2, "constant", 300, 0),
    "lrlim100": (1e-3, 1e-3, "constant", 100, 0),
}


def run(data, init_scale, lr, lr_schedule, epochs, seed):
    pyro.set_rng_seed(seed)
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
    model = pb.BNN(net, likelihood="categorical", prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.MeanField(model, init_scale=init_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        return pb.fit(model, guide, data.train, epochs=epochs, batch_size=64, lr=lr, lr_schedule=lr_schedule,
                      seed=seed, progress=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = pb.datasets.digits()
    print("| row | init σ | lr | schedule | epochs | seed | final ELBO | window | gain ± se (% of |ELBO|) "
          "| σ at max rate | other params at max rate | converged | reasons | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.rows:
        init_scale, lr, schedule, epochs, seed = ROWS[name]
        t0 = time.perf_counter()
        result = run(data, init_scale, lr, schedule, epochs, seed)
        d = result.convergence
        m = d.measures
        elbo = result.history["elbo"]
        final = sum(elbo[-max(1, math.ceil(0.05 * epochs)):]) / max(1, math.ceil(0.05 * epochs))
        gain = (f"{100 * m['objective_gain']:+.2f} ± {100 * m['objective_gain_se']:.2f}"
                if m["objective_gain"] is not None else "–")
        reasons = "; ".join(d.short_reasons()) or "–"
        print(f"| {name} | {init_scale:g} | {lr:g} | {schedule} | {epochs} | {seed} | {final:.0f} | {m['window']} "
              f"| {gain} | {m['scale_limited_share']:.2f} | {m['param_limited_share']:.2f} | {d.converged} | {reasons} "
              f"| {time.perf_counter() - t0:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
