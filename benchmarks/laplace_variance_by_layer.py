"""Where an all-layer Laplace's predictive variance comes from, layer by layer (a diagnosis).

Trains ``Laplace(model, "kron", prior_structure="layerwise")`` with online marginal likelihood
(the schedule of ``benchmarks/fashion_mnist.py``'s ``laplace_marglik`` row) on the first
``--subset`` images of the Fashion-MNIST training split, then prints per layer: the learned δ,
the norm of θ*, the fraction of the KFAC eigenvalues ``s λ`` below δ (directions where the
posterior is the prior), and the mean trace of that layer's share of the GLM functional variance
``J_l P_l⁻¹ J_lᵀ`` over ``--test`` test images (KFAC is block-diagonal, so the shares add up to
the total).  It also prints the test NLL of the GLM predictive with every δ multiplied by 1, 10
and 100: a diagnosis of how far the evidence's δ is from a calibrated one, never a way to choose
δ (that would tune on the test set).

Usage::

    python benchmarks/laplace_variance_by_layer.py --arch bn-cnn [--subset 10000] [--epochs 20]
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from fashion_mnist import MARGLIK_SCHEDULE, make_net  # benchmarks/ (on sys.path when run as a script)

import pyro_bnn as pb
from pyro_bnn.curvature import jacobian_factors, network_output
from pyro_bnn.posterior.prediction import evaluation_mode


def variance_by_layer(model, guide, x, batch_size=500) -> list[float]:
    """Mean over ``x`` of ``tr(J_l P_l⁻¹ J_lᵀ)`` per layer (categorical: curvature scale 1)."""
    layers, blocks, deltas = guide.layers, guide.posterior.blocks, guide.layer_prior_precisions()
    totals = torch.zeros(len(layers))
    with evaluation_mode(model):
        values = {k: v.detach().requires_grad_() for k, v in guide.map_values().items()}
        for fac in jacobian_factors(layers, lambda xb: network_output(model, values, xb), x, batch_size):
            for i, (layer, block, d) in enumerate(zip(layers, blocks, deltas)):
                var = block.functional_variance(fac.a[layer.path], fac.g[layer.path], d.detach(), 1.0)
                totals[i] += float(var.diagonal(dim1=-2, dim2=-1).sum())
    return (totals / len(x)).tolist()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["cnn", "bn-cnn"], default="bn-cnn")
    parser.add_argument("--subset", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-root", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    split = pb.datasets.fashion_mnist_split(args.data_root, num_validation=5000, seed=0, flatten=False)
    x, y = split.x_train[:args.subset], split.y_train[:args.subset]
    x_test, y_test = split.test[0][:args.test], split.test[1][:args.test]
    torch.manual_seed(args.seed)
    model = pb.BNN(make_net(args.arch), "categorical", prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0, prior_structure="layerwise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, guide, (x, y), epochs=args.epochs, seed=args.seed, progress=False, batch_size=64,
               lr=1e-3, marglik=MARGLIK_SCHEDULE)
    deltas = guide.layer_prior_precisions()
    theta = {k: v.detach() for k, v in guide.map_values().items()}
    row = {
        "arch": args.arch, "subset": args.subset, "epochs": args.epochs, "seed": args.seed,
        "layers": [layer.path for layer in guide.layers],
        "delta": [round(float(d), 2) for d in deltas],
        "theta_norm": [round(float(layer.flatten(theta).norm()), 3) for layer in guide.layers],
        "numel": [layer.numel for layer in guide.layers],
        "fraction_of_eigenvalues_below_delta": [round(float((b.eigenvalues(1.0) < d).float().mean()), 3)
                                                for b, d in zip(guide.posterior.blocks, deltas)],
        "train_log_likelihood": round(float(guide.posterior.loglik_stats["loglik"]), 1),
        "variance_trace_by_layer": [round(v, 3) for v in variance_by_layer(model, guide, x_test)],
    }
    for k in (1.0, 10.0, 100.0):   # diagnosis only: the test set must not choose δ
        nll = guide.validation_nll(x_test, y_test, [guide.prior_precision * k], num_samples=50)
        row[f"test_nll_delta_times_{k:g}"] = round(float(nll[0]), 4)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
