"""Old against new: the Laplace GLM covariance of a pruned model, and its δ grid search.

``python benchmarks/pruned_glm.py [--inputs 64] [--grid-inputs 200] [--repeats 3]``

The old implementation is :mod:`pyro_bnn.curvature.masks` as of commit ``da9a2b3`` (read with
``git show`` and executed as a module here; the library no longer holds it): per masked layer and
per δ, the masked Jacobian as ``T·P`` pattern factors through the block's
``functional_variance``; its grid search recomputed ``Σ_f`` from the factors for every δ.  The
new one rotates the masked Jacobian into the Kronecker eigenbasis once and evaluates every δ on
it (:func:`pyro_bnn.curvature.glm.batch_covariances`).

Cases (random weights and data, float32, one thread, Laplace ``structure="kron"`` on all
layers, 90 % of all weights and biases pruned by random scores):

(a) MLP 784-200-200-10; (b) LeNet-style CNN (conv 1→6 5×5, pool, conv 6→16 5×5, pool,
256-120-84-10, 28×28 inputs).

Printed per case: ``Σ_f`` time per input (the Jacobian factors excluded, shared by both),
old / new / ratio and the largest relative difference; the grid search over 100 δ on
``--grid-inputs`` inputs: the old covariance time for ``--old-grid`` δ scaled to 100 (its time
is linear in the number of δ: every δ redoes all the work), the new all-δ covariance, and the
whole new ``validation_nll`` (Jacobian pass and Monte-Carlo predictive included); and the
unpruned grid search (``batch_covariance`` one δ at a time, the old grid search's way and
unchanged, against ``batch_covariances`` with all δ at once), with their largest difference.  Times are medians of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.pruning import prune_, unprune_
from pyro_bnn.curvature import jacobian_factors
from pyro_bnn.curvature.glm import batch_covariance, batch_covariances

OLD_COMMIT = "da9a2b3"


def old_masks_module():
    """``pyro_bnn/curvature/masks.py`` of :data:`OLD_COMMIT`, imported with absolute imports."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:pyro_bnn/curvature/masks.py"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    src = src.replace("from .", "from pyro_bnn.curvature.")
    module = types.ModuleType("old_masks")
    exec(compile(src, "old_masks.py", "exec"), module.__dict__)
    return module


def old_batch_covariance(old, layers, blocks, deltas, scale, fac, masks):
    """``batch_covariance`` of :data:`OLD_COMMIT` (non-dense structures)."""
    total = 0
    for layer, block, delta, mask in zip(layers, blocks, deltas, masks):
        a, g = fac.a[layer.path], fac.g[layer.path]
        if mask is None:
            part = block.functional_variance(a, g, delta, scale)
        else:
            part = old.masked_layer_variance(layer, block, a, g, mask, delta, scale)
        total = total + part
    return total.detach()


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                         nn.Linear(200, 10))


def lenet():
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, 10))


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(name, net, args, old):
    torch.manual_seed(0)
    x = torch.randn(max(args.inputs, args.grid_inputs, 256), 1, 28, 28)
    y = torch.randint(0, 10, (len(x),))
    model = pb.BNN(net, "categorical").eval()
    guide = pb.guides.Laplace(model, structure="kron")
    guide.fit_curvature((x[:256], y[:256]))
    gen = torch.Generator().manual_seed(1)
    score = {s: torch.rand(v.shape, generator=gen) for s, v in model.initial_values().items()}
    grid = torch.logspace(-4, 4, 100, dtype=torch.float64)
    layers, blocks = guide.layers, guide.posterior.blocks
    _, _, scale = guide._kind_and_scale()

    def factors_of(xs):
        with guide._linearization() as (run, device):
            return list(jacobian_factors(layers, run, xs, 256))

    unpruned_factors = factors_of(x[:args.grid_inputs])
    handle = prune_(model, guide, fraction=0.9, score=score)
    try:
        masks = guide._layer_masks()
        fac = factors_of(x[:args.inputs])
        deltas = [d.detach() for d in guide._block_inputs()[1]]
        t_old = median_time(lambda: [old_batch_covariance(old, layers, blocks, deltas, scale, f, masks)
                                     for f in fac], args.repeats) / args.inputs
        t_new = median_time(lambda: [batch_covariance(layers, blocks, deltas, scale, f, masks) for f in fac],
                            args.repeats) / args.inputs
        c_old = torch.cat([old_batch_covariance(old, layers, blocks, deltas, scale, f, masks) for f in fac])
        c_new = torch.cat([batch_covariance(layers, blocks, deltas, scale, f, masks) for f in fac])
        rel = float((c_new - c_old).abs().max() / c_old.abs().max())
        print(f"({name}) {100 * handle.num_pruned / handle.num_total:.0f} % pruned; Σ_f per input "
              f"(float32, {args.inputs} inputs, Jacobian factors excluded): old {1e3 * t_old:.2f} ms, "
              f"new {1e3 * t_new:.2f} ms, old/new {t_old / t_new:.1f}x; max |new − old| / max |old| {rel:.1e}",
              flush=True)

        gfac = factors_of(x[:args.grid_inputs])
        cands = [guide._block_inputs(guide._candidate(v))[1] for v in grid]
        few = cands[:: len(cands) // args.old_grid][:args.old_grid]
        t_old_grid = median_time(lambda: [old_batch_covariance(old, layers, blocks, d, scale, f, masks)
                                          for d in few for f in gfac], 1) * len(cands) / len(few)
        t_new_grid = median_time(lambda: [batch_covariances(layers, blocks, cands, scale, f, masks)
                                          for f in gfac], args.repeats)
        t_nll = median_time(lambda: guide.validation_nll(x[:args.grid_inputs], y[:args.grid_inputs], grid),
                            args.repeats)
        print(f"({name}) grid search, 100 δ on {args.grid_inputs} inputs, Σ_f for all δ: old {t_old_grid:.1f} s "
              f"(measured on {len(few)} δ, scaled), new {t_new_grid:.2f} s, old/new {t_old_grid / t_new_grid:.0f}x; "
              f"new validation_nll in all (Jacobians and 100-draw MC predictive too) {t_nll:.2f} s", flush=True)
    finally:
        unprune_(model)
    t_un_old = median_time(lambda: [batch_covariance(layers, blocks, d, scale, f, None)
                                    for d in cands for f in unpruned_factors], args.repeats)
    t_un_new = median_time(lambda: [batch_covariances(layers, blocks, cands, scale, f, None)
                                    for f in unpruned_factors], args.repeats)
    f = unpruned_factors[0]
    together = batch_covariances(layers, blocks, cands, scale, f, None)
    alone = torch.stack([batch_covariance(layers, blocks, d, scale, f, None) for d in cands])
    same = "bit-identical" if torch.equal(together, alone) else \
        f"max |all − one| / max |one| {float((together - alone).abs().max() / alone.abs().max()):.1e}"
    print(f"({name}) unpruned grid search, Σ_f for 100 δ on {args.grid_inputs} inputs: one δ at a time "
          f"{t_un_old:.2f} s, all at once {t_un_new:.2f} s, ratio {t_un_old / t_un_new:.1f}x; {same}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--grid-inputs", type=int, default=200)
    parser.add_argument("--old-grid", type=int, default=4, help="δ values the old grid search is timed on")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", choices=["mlp", "cnn", "both"], default="both")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; old = {OLD_COMMIT}'s masks.py", flush=True)
    old = old_masks_module()
    if args.case in ("mlp", "both"):
        run_case("a: MLP 784-200-200-10", mlp(), args, old)
    if args.case in ("cnn", "both"):
        run_case("b: LeNet CNN", lenet(), args, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
