"""The ReLU rescaling symmetry and the online-marglik Laplace's layer-wise δ (issue 26).

Scaling a hidden layer's weights and bias by ``c`` and the next layer's weights by ``1/c``
leaves a ReLU net's function unchanged.  With the layer-wise prior precisions co-transformed
(``δ_l → δ_l / c²``, ``δ_{l+1} → δ_{l+1} c²``) the KFAC Laplace evidence is invariant too, except
for the biases, which share their layer's δ but scale differently.  This experiment runs
``benchmarks/fashion_mnist.py --rows laplace_marglik`` with one of two hooks after every evidence
update (``pb.MarglikOptions(every=5)``):

* ``--probe``: rescale the net to the gauge in which every layer's δ equals their geometric mean,
  recompute the curvature and the evidence there (δ co-transformed, not re-optimised), then put
  θ, δ and Adam's moments back (the training run itself changes only by the rounding of the
  scale-and-unscale);
* ``--gauge``: the same rescale, kept: the gauge is fixed after every update, so the δ cannot
  drift apart.

Adam's moments are co-transformed with θ (``m → m/f``, ``v → v/f²`` for ``θ → f θ``).  The log is
printed as one ``GAUGELOG`` JSON line.  It reaches into the Laplace guide's online-evidence
schedule (``pyro_bnn.guides.laplace.online.OnlineEvidence``) — an experiment, not an API.

    python benchmarks/fmnist_laplace_gauge.py --probe --rows laplace_marglik --epochs 60 --out probe.jsonl
    python benchmarks/fmnist_laplace_gauge.py --gauge --rows laplace_marglik --epochs 30 --out gauge.jsonl
"""

from __future__ import annotations

import json
import math
import sys

import fashion_mnist  # benchmarks/fashion_mnist.py (on sys.path when run as a script)
import torch

from pyro_bnn.guides.laplace import online


def _rescale(guide, optimizer, two_log_c, inverse=False) -> None:
    """θ_l → (c_l / c_{l−1}) W_l, c_l b_l (``c_0 = c_L = 1``), Adam's moments with them."""
    theta = guide.map_values()   # the trained leaves themselves (the MLP's sites are unconstrained)
    with torch.no_grad():
        for i, layer in enumerate(guide.layers):
            factors = ((layer.weight, math.exp(0.5 * (two_log_c[i + 1] - two_log_c[i]))),
                       (layer.bias, math.exp(0.5 * two_log_c[i + 1])))
            for site, f in factors:
                if site is None:
                    continue
                f = 1.0 / f if inverse else f
                p = theta[site]
                p.mul_(f)
                state = optimizer.state.get(p, {})
                if "exp_avg" in state:
                    state["exp_avg"].div_(f)
                    state["exp_avg_sq"].div_(f * f)


def _set_log_delta(schedule, values) -> None:
    guide = schedule.guide
    with torch.no_grad():
        new = torch.as_tensor(values, dtype=guide.log_prior_precision.dtype,
                              device=guide.log_prior_precision.device).expand_as(guide.log_prior_precision)
        guide.log_prior_precision.copy_(new)
        schedule.hyper[0].copy_(new)


def equal_delta_gauge(schedule, ctx, keep: bool) -> dict:
    guide = schedule.guide
    if guide.prior_structure != "layerwise":
        raise SystemExit("the gauge experiment needs prior_structure='layerwise'")
    log_delta = [math.log(float(d)) for d in guide.layer_prior_precisions()]
    mean = sum(log_delta) / len(log_delta)
    two_log_c = [0.0]   # δ_l c_{l−1}² / c_l² = exp(mean) for every layer
    for ld in log_delta[:-1]:
        two_log_c.append(two_log_c[-1] + ld - mean)
    two_log_c.append(0.0)
    entry = {"epoch": ctx.epoch, "delta": [math.exp(v) for v in log_delta], "delta_equalised": math.exp(mean),
             "log_evidence": ctx.history["log_evidence"][-1]}
    _rescale(guide, ctx.optimizer, two_log_c)
    _set_log_delta(schedule, mean)
    if not keep:
        online.deterministic_curvature(guide, ctx)
        with torch.no_grad():
            entry["log_evidence_rescaled"] = float(guide.log_evidence())
        _rescale(guide, ctx.optimizer, two_log_c, inverse=True)
        _set_log_delta(schedule, log_delta)
        online.deterministic_curvature(guide, ctx)   # the curvature of the θ that trains on
    return entry


def main(argv: list[str]) -> None:
    mode = [a for a in argv if a in ("--probe", "--gauge")]
    if len(mode) != 1:
        raise SystemExit("give exactly one of --probe, --gauge")
    argv = [a for a in argv if a not in mode]
    log = []
    after_epoch = online.OnlineEvidence.after_epoch

    def hooked(self, ctx):
        after_epoch(self, ctx)
        if not math.isnan(ctx.history["log_evidence"][-1]):   # an update happened in this epoch
            log.append(equal_delta_gauge(self, ctx, keep=mode[0] == "--gauge"))

    online.OnlineEvidence.after_epoch = hooked
    try:
        fashion_mnist.main(argv)
    finally:
        online.OnlineEvidence.after_epoch = after_epoch
        print("GAUGELOG", json.dumps(log), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
