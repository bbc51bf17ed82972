"""Trained digits models shared by the uncertainty-tool tests (pruning, OOD, FGSM, corruption).

Every guide in the registry plus Pyro's AutoNormal / AutoDelta / low-rank autoguide is
trained once per test process (cached), on scikit-learn's 8×8 digits with a 64-16-10 MLP.
"""

import warnings
from functools import cache

import pyro
import torch
from pyro.infer.autoguide import AutoDelta, AutoLowRankMultivariateNormal, AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides import init_to_network, registered_guides

PYRO_GUIDES = {
    "AutoNormal": lambda m: AutoNormal(m, init_loc_fn=init_to_network(m), init_scale=0.01),
    "AutoDelta": lambda m: AutoDelta(m, init_loc_fn=init_to_network(m)),
    "AutoLowRankMultivariateNormal": lambda m: AutoLowRankMultivariateNormal(
        m, init_loc_fn=init_to_network(m), init_scale=0.01, rank=4),
}


def all_guides() -> dict:
    """Pyro's autoguides and every registered pyro_bnn guide, read at run time."""
    return {**PYRO_GUIDES, **registered_guides()}


GUIDE_NAMES = sorted(all_guides())

#: Model options a guide is meant for (the hypernetwork's flow is over weight-norm scales).
MODEL_OPTIONS = {"hypernet": {"weight_norm": True}}


def mlp(d_in=64, d_hidden=16, d_out=10):
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))


@cache
def digits():
    return pb.datasets.digits()


@cache
def trained(name: str, classes: tuple = tuple(range(10)), epochs: int = 10, num_train: int = 600):
    """(model, guide) trained on the first ``num_train`` training digits of ``classes``
    (cached per process): 60 Adam steps, ≈ 85-93% test accuracy for every guide."""
    d = digits()
    keep = torch.isin(d.y_train, torch.tensor(classes)) & (torch.arange(len(d.y_train)) < num_train)
    pyro.set_rng_seed(0)
    model = pb.BNN(mlp(d_out=len(classes)), likelihood="categorical", **MODEL_OPTIONS.get(name, {}))
    guide = all_guides()[name](model)
    with warnings.catch_warnings():   # deliberately short fits: the tools' tests need no convergence
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (d.x_train[keep], d.y_train[keep]), epochs=epochs, batch_size=100,
               lr=1e-2, lr_schedule="constant", progress=False, seed=0)
    return model, guide
