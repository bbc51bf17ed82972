"""How MeanField's defaults were chosen: the converged training ELBO by setting and by run length.

Every number is a statistic of the training data only: the full-data ELBO at the end of the
fit, estimated with 200 independent draws (``meanfield_loss`` on all training points).

Problems (``--problem``):

* ``digits``: offline digits 1,348 train, MLP 64-100-10, IIDNormal(1), batch 64;
* ``regression``: a hand-written ``PyroModule`` (``tests/test_pyro_interop._Regression``):
  sin(2x) + 0.1 noise on 200 points, 1-50-1 tanh, learned ``sigma ~ HalfNormal(1)``, full batch.

Runs (``--runs``), each ``init_scale,lr,epochs,seed[,local|weight]``; the schedule is cosine::

    python benchmarks/meanfield_defaults.py --problem digits --runs 0.01,0.05,300,0 0.1,0.05,300,0
    python benchmarks/meanfield_defaults.py --problem regression --runs 0.01,0.05,1500,0,weight

One JSON line per run: settings, seconds, the ELBO estimate, the mean training loss over the
last two tenths of the epochs, ``pb.fit``'s convergence verdict, and test metrics (reported for
information; the settings were chosen by the ELBO).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import pyro
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.meanfield import meanfield_loss

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def full_data_elbo(model, guide, x, y, num_draws=200) -> float:
    """``mean_s [log p(y | w_s) + log p(w_s) − log q(w_s)]`` over all of ``(x, y)``, or for a
    hand-written model Pyro's ``TraceMeanField_ELBO`` (closed-form KL where available)."""
    with torch.no_grad(), local_params(model, guide):
        if pb.model.is_bnn(model):
            return -sum(float(meanfield_loss(model, guide, x, y, len(x))) for _ in range(num_draws)) / num_draws
        elbo = pyro.infer.TraceMeanField_ELBO()
        return -sum(elbo.loss(model, guide, x, y) for _ in range(num_draws)) / num_draws


def problem(name):
    if name == "digits":
        data = pb.datasets.digits()

        def make(seed):
            torch.manual_seed(seed)
            return pb.BNN(nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)))

        return data.train, data.test, make, 64
    from test_pyro_interop import _Regression

    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 200).unsqueeze(-1)
    y = torch.sin(2 * x).squeeze(-1) + 0.1 * torch.randn(200)
    xt = torch.linspace(-2, 2, 101).unsqueeze(-1)

    def make(seed):
        torch.manual_seed(seed)
        return _Regression(200)

    return (x, y), (xt, torch.sin(2 * xt).squeeze(-1)), make, 200


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=["digits", "regression"], default="digits")
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    train, test, make, batch_size = problem(args.problem)
    for spec in args.runs:
        parts = spec.split(",")
        init_scale, lr, epochs, seed = float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])
        local = {"local": True, "weight": False}.get(parts[4], "auto") if len(parts) > 4 else "auto"
        pyro.clear_param_store()
        model = make(seed)
        guide = pb.guides.MeanField(model, init_scale=init_scale, local_reparameterization=local)
        start = time.perf_counter()
        result = pb.fit(model, guide, train, epochs=epochs, batch_size=batch_size, lr=lr,
                        lr_schedule="cosine", seed=seed, progress=False)
        seconds = time.perf_counter() - start
        loss = result.history["loss"]
        tenth = max(epochs // 10, 1)
        row = dict(problem=args.problem, init_scale=init_scale, lr=lr, epochs=epochs, seed=seed,
                   local_reparameterization=guide.local_reparameterization, seconds=round(seconds, 1),
                   elbo=round(full_data_elbo(model, guide, *train), 1),
                   loss_last_tenth=round(sum(loss[-tenth:]) / tenth, 1),
                   loss_previous_tenth=round(sum(loss[-2 * tenth:-tenth]) / tenth, 1),
                   diagnosed_converged=result.convergence.converged)
        row.update({k: round(v, 4) if isinstance(v, float) else v
                    for k, v in pb.evaluate(model, guide, *test, num_samples=100).items()})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
