"""MeanField on the default digits workflow (MLP 64-100-10, 300 epochs, pb.fit defaults)
under a given prior: the check that a change of MeanField's prior/fit defaults does not
make the digits figure worse (issue 26).

One JSON line per prior: full-data ELBO (``pb.fit``'s final-window objective and a 20-draw
estimate at the end), test accuracy / NLL / ECE (100 draws), the convergence diagnosis.

Example::

    PYTHONPATH=$PWD python benchmarks/meanfield_digits_prior.py --priors default normal:1 fanin:1
    PYTHONPATH=$PWD python benchmarks/meanfield_digits_prior.py --learn-prior-scale   # also --kl-annealing E,
                                                                                      # --warm-start-epochs K
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from _common import emit_row, train_map_  # benchmarks/_common.py (on sys.path when run as a script)
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.meanfield import meanfield_loss
from pyro_bnn.training.seeding import seeded


def make_prior(spec: str):
    """``default`` → None (the library's), ``normal:S`` → IIDNormal(S), ``fanin:G`` → FanInNormal(G)."""
    if spec == "default":
        return None
    kind, _, value = spec.partition(":")
    if kind == "normal":
        return pb.priors.IIDNormal(float(value))
    if kind == "fanin":
        return pb.priors.FanInNormal(float(value))
    raise ValueError(f"expected default, normal:S or fanin:G, got {spec!r}")


def train_map(net, x, y, *, epochs: int, seed: int, lr: float = 1e-3, batch_size: int = 64):
    """A warm start: Adam (cosine decay) on mean cross-entropy + weight decay 1/N (the N(0, 1) MAP)."""
    train_map_(net, x, y, epochs=epochs, seed=seed, weight_decay=1.0 / len(x), lr=lr, batch_size=batch_size)
    return net


def run(spec: str, *, epochs: int, seed: int, learn_prior_scale: bool = False, kl_annealing: int = 0,
        warm_start_epochs: int = 0) -> dict:
    data = pb.datasets.digits()
    (x, y), (xt, yt) = data.train, data.test
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
    if warm_start_epochs:
        net = train_map(net, x, y, epochs=warm_start_epochs, seed=seed)
    model = pb.BNN(net, "categorical", prior=make_prior(spec))
    guide = pb.guides.MeanField(model, learn_prior_scale=learn_prior_scale, kl_annealing=kl_annealing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pb.fit(model, guide, (x, y), epochs=epochs, seed=seed, progress=False)
    with torch.no_grad(), local_params(model, guide), seeded(1):
        elbo = -sum(float(meanfield_loss(model, guide, x, y, len(x))) for _ in range(20)) / 20
    with seeded(0):
        p = pb.predict(model, guide, xt, num_samples=100)
    row = pb.metrics.classification_metrics(p, yt, num_bins=15)
    diag = res.convergence
    row.update(prior=spec, epochs=epochs, seed=seed, elbo_20_draws=elbo,
               objective_end=diag.measures.get("objective_end"), converged=diag.converged,
               objective_gain=diag.measures.get("objective_gain"),
               seconds=sum(res.history["epoch_seconds"]), learn_prior_scale=learn_prior_scale,
               kl_annealing=kl_annealing, warm_start_epochs=warm_start_epochs,
               prior_scale_by_site={s: float(model.site_normal_prior(s)[1]) for s in model.site_names},
               mean_sigma_by_site={s: float(guide.loc_and_scale(s)[1].mean()) for s in model.site_names})
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--priors", nargs="+", default=["default"])
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--learn-prior-scale", action="store_true", help="MeanField(learn_prior_scale=True)")
    parser.add_argument("--kl-annealing", type=int, default=0, help="MeanField(kl_annealing=E)")
    parser.add_argument("--warm-start-epochs", type=int, default=0, help="MAP epochs before MeanField (0: off)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for spec in args.priors:
        emit_row(run(spec, epochs=args.epochs, seed=args.seed, learn_prior_scale=args.learn_prior_scale,
                     kl_annealing=args.kl_annealing, warm_start_epochs=args.warm_start_epochs), args.out)


if __name__ == "__main__":
    sys.exit(main())
