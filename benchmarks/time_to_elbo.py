"""Time to a converged ELBO: ``pb.fit`` + MeanField (defaults) vs plain Pyro ``AutoNormal`` + ``SVI``.

MNIST 5k (first 5,000 training digits of the IDX files in ``--data-dir``), MLP
784-400-400-10, N(0, 1) priors on every weight, batch 128, one process, one thread.

* ``pb.fit`` + ``MeanField(model)``: the library defaults (σ₀ 0.01, local reparameterisation,
  lr 5e-2 with the means of wide layers at ``lr·√(100/fan_in)``, cosine decay); one fit per
  budget ``--pb-epochs``, each timed as a whole.
* plain Pyro: a hand-written ``PyroModule`` with ``PyroSample`` priors, ``AutoNormal``
  (σ₀ 0.01), ``pyro.optim.Adam`` at each ``--pyro-lrs`` (constant, as Pyro's examples train);
  one long run per lr, the ELBO estimated every ``--every`` epochs.

Every ELBO is the full-data ELBO estimated with ``--draws`` draws of the trained guide (the
same estimator for both: Pyro's ``TraceMeanField_ELBO`` on the plain model, MeanField's own
closed-form-KL loss on the BNN; they agree in expectation, tested). For each method the
script prints the wall time at which its ELBO first came within ``--within`` (default 2 %) of
the best ELBO any run reached, and the ratio of the two times. Pyro's lr is the best of its
grid by its own final ELBO.

    python benchmarks/time_to_elbo.py --data-dir ../shared/data/mnist
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import pyro
import torch
from _common import PlainPyroMLP  # benchmarks/_common.py (on sys.path when run as a script)
from _common import mnist_mlp as mlp
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_bnn as pb
from pyro_bnn.data.batches import TensorBatches
from pyro_bnn.training.convergence_check import estimate_objective


def elbo_plain(model, guide, x, y, draws):
    loss = TraceMeanField_ELBO()
    with torch.no_grad():
        total = 0.0
        for _ in range(draws):
            total += sum(loss.loss(model, guide, xb, yb) for xb, yb in TensorBatches(x, y, 1000))
        return -total / draws


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data/mnist")
    parser.add_argument("--num-train", type=int, default=5000)
    parser.add_argument("--pb-epochs", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--pyro-lrs", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--pyro-epochs", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    split = pb.datasets.mnist_split(args.data_dir, args.num_train, 100)
    x, y = split.x_train, split.y_train
    rows = []
    for epochs in args.pb_epochs:
        pyro.clear_param_store()
        torch.manual_seed(args.seed)
        model = pb.BNN(mlp(), likelihood="categorical")
        guide = pb.guides.MeanField(model)
        start = time.perf_counter()
        result = pb.fit(model, guide, (x, y), epochs=epochs, batch_size=args.batch_size, seed=args.seed,
                        progress=False)
        seconds = time.perf_counter() - start
        rows.append(dict(method="pb.fit+MeanField", epochs=epochs, seconds=seconds,
                         elbo=estimate_objective(model, guide, (x, y), num_samples=args.draws, eval_batch_size=len(x))[0],
                         diagnosed_converged=result.convergence.converged))
        print(json.dumps(rows[-1]), flush=True)
    for lr in args.pyro_lrs:
        pyro.clear_param_store()
        pyro.set_rng_seed(args.seed)
        model = PlainPyroMLP(len(x))
        guide = AutoNormal(model, init_scale=0.01)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
        batches = TensorBatches(x, y, args.batch_size)
        seconds = 0.0
        for epoch in range(1, args.pyro_epochs + 1):
            start = time.perf_counter()
            for xb, yb in batches:
                svi.step(xb, yb)
            seconds += time.perf_counter() - start
            if epoch % args.every == 0:
                rows.append(dict(method=f"Pyro AutoNormal+SVI lr {lr:g}", epochs=epoch, seconds=seconds,
                                 elbo=elbo_plain(model, guide, x, y, args.draws)))
                print(json.dumps(rows[-1]), flush=True)
    best = max(r["elbo"] for r in rows)
    target = best - args.within * abs(best)
    print(f"\nbest ELBO of any run {best:.1f}; target (within {100 * args.within:.0f} %) {target:.1f}")
    pyro_final = {}
    for r in rows:
        if r["method"].startswith("Pyro"):
            pyro_final[r["method"]] = r["elbo"]
    best_pyro = max(pyro_final, key=pyro_final.get)
    times = {}
    for method in ("pb.fit+MeanField", best_pyro):
        hits = [r["seconds"] for r in rows if r["method"] == method and r["elbo"] >= target]
        times[method] = min(hits) if hits else None
        final = max(r["elbo"] for r in rows if r["method"] == method)
        print(f"{method}: best ELBO {final:.1f}; time to target "
              f"{'not reached' if times[method] is None else f'{times[method]:.0f} s'}")
    a, b = times["pb.fit+MeanField"], times[best_pyro]
    if a is not None and b is not None:
        print(f"ratio (Pyro / pb.fit): {b / a:.1f}x")


if __name__ == "__main__":
    main()
