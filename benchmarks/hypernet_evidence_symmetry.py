"""Digits check of the drift of layer-wise evidence δ under the Hypernet (helper hyper, 2026-12-03).

Weight-norm MLP 64-100-100-10 ReLU, Hypernet (8 IAF, hidden 64), digits train (1,348), batch 64,
constant Adam lr 1e-2, chunks of 5 epochs; between chunks the g prior is set by the evidence of the
mean network: layer-wise (the library's update_prior_precision_) or one shared δ (this script, from
the same public functions). Prints δ, the evidence and the per-layer δ·‖θ‖² after each chunk (and the test NLL, for
information only: nothing is chosen by it).  Usage (logs of 2026-12-03: /work/runs/hyper/scratch/)::

    PYTHONPATH=$PWD nice -n 10 .venv/bin/python benchmarks/hypernet_evidence_symmetry.py layerwise 20
    PYTHONPATH=$PWD nice -n 10 .venv/bin/python benchmarks/hypernet_evidence_symmetry.py scalar 20
"""
import sys
import warnings

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature import accumulate_curvature, likelihood_kind, network_output
from pyro_bnn.curvature import marglik as ml
from pyro_bnn.guides.hypernet_evidence import (
    curvature_batches,
    mean_network_values,
    scale_layers,
    scale_prior_precisions,
    set_scale_prior_precisions_,
)

torch.set_num_threads(1)
mode = sys.argv[1]
chunks = int(sys.argv[2]) if len(sys.argv) > 2 else 20
d = pb.datasets.digits()
x, y = d.x_train, d.y_train
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
model = pb.BNN(net, "categorical", weight_norm=True)
# layer-wise δ by the guide's own update (explicit: the guide's default became "scalar" after these runs)
guide = pb.guides.Hypernet(model, hidden=64, prior_structure="layerwise")


def shared_update(guide, model):
    sites = guide.site_names()
    scales = guide.mean_scales()
    pairs = scale_layers(model, sites)
    layers = [l for _, l in pairs]
    values = {s: g.detach().requires_grad_() for s, g in scales.items()}
    kind, _ = likelihood_kind(model, values, x[:2])
    fit = accumulate_curvature(layers, curvature_batches((x, y), model, where="x"),
                               lambda xb: network_output(model, values, xb), kind, "kron")
    loglik = ml.log_likelihood_from_stats(fit.loglik_stats)
    w = mean_network_values(pairs, scales)
    theta = [l.flatten(w).reshape(-1) for l in layers]
    start = scale_prior_precisions(model, sites)[sites[0]]
    log_d = torch.tensor(float(start)).log().requires_grad_()
    value = ml.maximize_evidence(lambda: ml.log_evidence(loglik, fit.blocks, theta, [log_d.exp()] * len(layers)),
                                 [log_d], 100, 0.1)
    set_scale_prior_precisions_(model, {s: float(log_d.detach().exp()) for s in sites})
    return value


def norms(guide, model):
    pairs = scale_layers(model, guide.site_names())
    w = mean_network_values(pairs, guide.mean_scales())
    return [float(l.flatten(w).pow(2).sum()) for _, l in pairs]


for c in range(chunks):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=5, lr=1e-2, lr_schedule="constant", progress=False, seed=c)
    if mode == "layerwise":
        ev = guide.update_prior_precision_((x, y)).log_evidence
    else:
        ev = shared_update(guide, model)
    deltas = list(scale_prior_precisions(model, guide.site_names()).values())
    sq = norms(guide, model)
    acc = pb.evaluate(model, guide, d.x_test, d.y_test, num_samples=8)
    print(f"epoch {5 * (c + 1):4d} evidence {ev:9.1f} delta " + " ".join(f"{v:8.3g}" for v in deltas)
          + " | delta*|theta|^2 " + " ".join(f"{dd * s:8.1f}" for dd, s in zip(deltas, sq))
          + f" | test nll {acc['nll']:.3f}", flush=True)
