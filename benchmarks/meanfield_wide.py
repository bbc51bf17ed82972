"""MeanField on a wide net: how the means' learning rate per layer decides where the fit ends.

MNIST 5k (the first 5,000 digits of the MNIST test file for training, the next 2,000 for
the test), MLP 784-400-400-10, N(0, 1) priors (``--prior fanin``: N(0, 1/fan_in)),
``MeanField`` (σ₀ 0.01, local reparameterisation), batch 128, lr 5e-2 with cosine decay,
one torch thread.  ``--rule``:

* ``default``: the library's (``loc_lr_scaling="fan_in"``: the means of a layer with fan-in
  ``f`` at ``lr·min(1, √(100/f))``);
* ``none``: every parameter at ``lr`` (the defaults before the rule);
* a number ``c``: the means at ``c/√f`` (scales ρ at ``lr``), to test the rule's constant.

Prints one JSON line: the full-data ELBO from 10 draws after the fit, the training ELBO
averaged over each twentieth of the epochs (the trajectory), ``pb.fit``'s diagnosis, test
accuracy and NLL (20 draws) and the 10/50/90 % quantiles of σ.

    python benchmarks/meanfield_wide.py --epochs 400 --rule default
    python benchmarks/meanfield_wide.py --epochs 400 --rule none
    python benchmarks/meanfield_wide.py --epochs 400 --rule 0.4
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import pyro
import torch
from _common import mnist_mlp  # benchmarks/_common.py (on sys.path when run as a script)
from time_to_elbo import elbo_bnn

import pyro_bnn as pb
from pyro_bnn.guides.meanfield import REFERENCE_FAN_IN
from pyro_bnn.training.optimizer import default_optimizer


def optimizer_for(guide, rule: str, lr: float):
    """``pb.fit``'s ``optimizer=`` for the rule (``None``: the library default)."""
    if rule == "default":
        return None
    c = 0.0 if rule == "none" else float(rule)

    def make(params):
        factors = []
        if c:  # every wide layer's means at c/√f (fan-in f = REFERENCE_FAN_IN / default factor²)
            for name, factor in guide.loc_lr_factors().items():
                if factor < 1.0:
                    fan_in = REFERENCE_FAN_IN / factor ** 2
                    factors.append((guide.loc_and_raw_scale(name)[0], c / math.sqrt(fan_in) / lr))
        return default_optimizer(params, lr, factors)

    return make


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data/mnist")
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--rule", default="default", help="default, none, or a constant c (μ lr = c/√fan_in)")
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--prior", choices=["normal", "fanin"], default="normal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    split = pb.datasets.mnist_split(args.data_dir, 5000, 2000)
    x, y = split.x_train, split.y_train
    torch.manual_seed(args.seed)
    pyro.clear_param_store()
    prior = pb.priors.IIDNormal(1.0) if args.prior == "normal" else pb.priors.FanInNormal()
    model = pb.BNN(mnist_mlp(), likelihood="categorical", prior=prior)
    guide = pb.guides.MeanField(model)
    start = time.perf_counter()
    optimizer = optimizer_for(guide, args.rule, args.lr)  # a factory sets its own lr: fit's lr= is for the default
    result = pb.fit(model, guide, (x, y), epochs=args.epochs, batch_size=128, lr=args.lr if optimizer is None else None,
                    seed=args.seed, progress=False, optimizer=optimizer)
    seconds = time.perf_counter() - start
    elbo = result.history["elbo"]
    k = max(args.epochs // 20, 1)
    metrics = pb.evaluate(model, guide, split.x_test, split.y_test, num_samples=20)
    sigma = torch.cat([guide.loc_and_scale(n)[1].detach().flatten() for n in guide.site_names()])
    print(json.dumps(dict(
        vars(args), seconds=round(seconds), elbo=round(elbo_bnn(model, guide, x, y, 10)),
        converged=result.convergence.label(),
        trajectory=[round(sum(elbo[i:i + k]) / len(elbo[i:i + k])) for i in range(0, len(elbo), k)],
        accuracy=round(metrics["accuracy"], 4), nll=round(metrics["nll"], 4),
        sigma_quantiles=[round(float(v), 4) for v in sigma.quantile(torch.tensor([0.1, 0.5, 0.9]))])), flush=True)


if __name__ == "__main__":
    main()
