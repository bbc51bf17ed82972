"""Laplace benchmarks: KFAC evidence vs laplace-torch, GLM predictive vs MAP, online marglik.

Tasks (``--task``):

* ``evidence`` — MNIST 5k/5k, MLP 784-400-400-10: MAP by ``pb.fit``; then, side by side in
  this process, our KFAC fit + log evidence and laplace-torch's ``KronLaplace`` (benchmark-
  only dependency) at the same prior precision; medians over ``--repeats`` and the ratio.
  laplace-torch keeps each bias as its own block (no weight-bias cross terms); we report our
  evidence with the default joint ``[W, b]`` factors and, from the same factor sums, with
  laplace-torch's split-bias convention.
* ``glm`` — MAP vs linearised (probit) predictive at the evidence-optimised prior precision:
  test NLL and ECE on digits and MNIST 5k.
* ``lastlayer`` — MAP vs all-layer KFAC GLM vs last-layer (``subset="last_layer"``, KFAC
  and full) GLM, each at its post-hoc evidence-optimal δ, on the same MAP network: digits
  (``--seeds``) and MNIST 5k (``--mnist-seeds``); plus online marglik, all-layer vs
  last-layer, on digits.
* ``marglik`` — digits: online marglik (Immer 2021 schedule) vs a grid of fixed prior
  precisions {0.01, 0.1, 1, 10, 100}, same epochs; test NLL (MAP and GLM).
* ``targets`` — issue 16 on MNIST 5k/5k, MLP 784-400-400-10, ``--mnist-seeds``: per seed a
  validation split of ``--val`` digits is taken from the 5,000 training digits, one MAP is
  trained on the rest (``--epochs``, ``--lr``, cosine schedule), and from that θ* the
  post-hoc Laplace variants — last layer / all layers, KFAC, δ by the evidence (scalar, per
  layer, per site) or by validation grid search — are scored on the 5,000 test digits
  (NLL, ECE with 15 bins, accuracy) against the MAP net.  ``--online`` adds online-marglik
  runs (own MAP each, same protocol): scalar vs per-layer δ, all layers and last layer.
* ``marglik_noise`` — digits, the former main job's online schedule (all layers, KFAC, every 5
  epochs after 10, 50 steps, 100 epochs, lr 1e-2), constant vs cosine learning rate: the
  evidence at each evaluation, its recorded estimate noise, the spread of the evaluations
  over the second half, and where the best one falls.
* ``llcompare`` — last-layer KFAC, ours vs laplace-torch's ``Laplace(...,
  subset_of_weights="last_layer", hessian_structure="kron")`` on the same MAP and δ:
  largest difference of the GLM probit probabilities on the 5,000 test digits and the time
  of curvature fit + 5,000-point GLM predictive, interleaved ``--repeats`` in one process.

Example::

    .venv/bin/python benchmarks/bench_laplace.py --task all --data-dir ../shared/data/mnist
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature import KronBlock
from pyro_bnn.curvature.marglik import log_evidence
from pyro_bnn.reporting.output_files import check_new_file, write_json


def mlp(d_in, hidden, d_out):
    layers, d = [], d_in
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    return nn.Sequential(*layers, nn.Linear(d, d_out))


def map_metrics(model, guide, x, y):
    with torch.no_grad():
        probs = torch.softmax(model.run_with(guide.median(), x), -1)
    return pb.metrics.classification_metrics(probs[None], y, num_bins=15)


def glm_metrics(model, guide, x, y):
    probs = pb.predict(model, guide, x, predictive="glm_probit", batch_size=500)
    return pb.metrics.classification_metrics(probs, y, num_bins=15)


def train_map(split, hidden, epochs, lr, seed, structure="kron", prior_precision=1.0, marglik=None,
              batch_size=128, kron_bias="joint", lr_schedule="constant", **guide_options):
    torch.manual_seed(seed)
    net = mlp(split.x_train.shape[1], hidden, 10)
    model = pb.BNN(net, "categorical")
    guide = pb.guides.Laplace(model, structure, prior_precision=prior_precision, kron_bias=kron_bias,
                              **guide_options)
    t = time.perf_counter()
    res = pb.fit(model, guide, split.train, epochs=epochs, lr=lr, batch_size=batch_size,
                 progress=False, seed=seed, marglik=marglik, lr_schedule=lr_schedule)
    return model, guide, net, res, time.perf_counter() - t


def split_bias_evidence(guide, delta):
    """Our factor sums, blocks as laplace-torch builds them: W: G ⊗ A[:-1,:-1], b: G·N."""
    blocks, theta, deltas = [], [], []
    values = guide.map_values()
    for layer, blk in zip(guide.layers, guide.posterior.blocks):
        A, G = blk.A, blk.G
        blocks += [KronBlock(A[:-1, :-1], G), KronBlock(A[-1:, -1:], G)]
        theta += [values[layer.weight].detach().reshape(-1), values[layer.bias].detach().reshape(-1)]
        deltas += [delta, delta]
    return log_evidence(guide.posterior.loglik_stats["loglik"], blocks, theta, deltas)


def task_evidence(args, split, out):
    model, guide, net, res, secs = train_map(split, [400, 400], args.epochs, 1e-3, args.seed)
    nparams = sum(p.numel() for p in net.parameters())
    print(f"[evidence] MAP: {args.epochs} epochs in {secs:.1f}s, {nparams} parameters, "
          f"train loss {res.history['loss'][-1]:.1f}")
    # the MAP weights into a plain torch net for laplace-torch
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(guide.map_values()[f"net.{name}"])
    delta = torch.tensor(float(args.prior_precision))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(split.x_train, split.y_train),
                                         batch_size=256, shuffle=False)
    try:
        from laplace import KronLaplace
    except ImportError:
        KronLaplace = None
        print("[evidence] laplace-torch is not installed (pip install laplace-torch); comparing "
              "against our dense-free split-bias computation only")
    ours_t, theirs_t, ours, theirs = [], [], None, None
    for _ in range(args.repeats):
        t = time.perf_counter()
        guide.fit_curvature(split.train, batch_size=256)
        ours = float(guide.log_evidence(delta))
        ours_t.append(time.perf_counter() - t)
        if KronLaplace is not None:
            t = time.perf_counter()
            la = KronLaplace(ref, "classification", prior_precision=float(delta))
            la.fit(loader)
            theirs = float(la.log_marginal_likelihood())
            theirs_t.append(time.perf_counter() - t)
    ours_split = float(split_bias_evidence(guide, delta))
    out["evidence"] = dict(prior_precision=float(delta), ours_joint_bias=ours, ours_split_bias=ours_split,
                           laplace_torch=theirs, ours_seconds=statistics.median(ours_t),
                           laplace_torch_seconds=statistics.median(theirs_t) if theirs_t else None,
                           backend=type(la._backend).__name__ if theirs_t else None)
    print(f"[evidence] δ={float(delta)}: ours (joint [W,b] KFAC) {ours:.3f}, ours (split-bias) "
          f"{ours_split:.3f}, laplace-torch {theirs}")
    if theirs is not None:
        print(f"[evidence] relative difference split-bias vs laplace-torch: "
              f"{abs(ours_split - theirs) / abs(theirs):.2e}; joint vs laplace-torch "
              f"{abs(ours - theirs) / abs(theirs):.2e}")
        print(f"[evidence] fit+evidence median over {args.repeats}: ours {statistics.median(ours_t):.2f}s, "
              f"laplace-torch ({out['evidence']['backend']}) {statistics.median(theirs_t):.2f}s, "
              f"ratio ours/theirs {statistics.median(ours_t) / statistics.median(theirs_t):.2f}")
    return model, guide


def task_glm(args, name, split, hidden, epochs, out, trained=None):
    if trained is None:
        model, guide, *_ = train_map(split, hidden, epochs, 1e-3, args.seed)
    else:
        model, guide = trained
    m = map_metrics(model, guide, split.x_test, split.y_test)
    t = time.perf_counter()
    ev = guide.optimize_prior_precision(steps=200, lr=0.1)
    g = glm_metrics(model, guide, split.x_test, split.y_test)
    secs = time.perf_counter() - t
    out[f"glm_{name}"] = dict(map=m, glm=g, prior_precision=float(guide.prior_precision), log_evidence=ev)
    print(f"[glm {name}] δ*={float(guide.prior_precision):.3g} (evidence {ev:.1f}); "
          f"MAP nll {m['nll']:.4f} ece {m['ece']:.4f} acc {m['accuracy']:.4f} | "
          f"GLM nll {g['nll']:.4f} ece {g['ece']:.4f} acc {g['accuracy']:.4f}  ({secs:.1f}s)")
    glm_delta_sweep(args, name, model, guide, split, out)


def glm_delta_sweep(args, name, model, guide, split, out):
    """Diagnostic: is the MAP over- or underconfident (mean max-probability vs accuracy), and
    the GLM at fixed post-hoc δ (``--sweep``).  As δ → ∞ the GLM tends to the MAP, so a GLM
    can only beat the MAP's NLL if the MAP is overconfident."""
    with torch.no_grad():
        conf = float(torch.softmax(model.run_with(guide.median(), split.x_test), -1).max(-1).values.mean())
    best = guide.log_prior_precision.detach().clone()
    rows = {}
    for d in args.sweep:
        with torch.no_grad():
            guide.log_prior_precision.fill_(torch.tensor(float(d)).log())
        g = glm_metrics(model, guide, split.x_test, split.y_test)
        rows[d] = dict(nll=g["nll"], ece=g["ece"], log_evidence=float(guide.log_evidence()))
    with torch.no_grad():
        guide.log_prior_precision.copy_(best)
    out[f"glm_{name}"].update(map_mean_confidence=conf, sweep=rows)
    print(f"[glm {name}] MAP mean confidence {conf:.4f} (accuracy {out[f'glm_{name}']['map']['accuracy']:.4f}); "
          + "; ".join(f"δ={d:g}: GLM nll {r['nll']:.4f} ece {r['ece']:.4f} ev {r['log_evidence']:.0f}"
                      for d, r in rows.items()))


def task_marglik(args, split, out):
    rows = {}
    for delta in (0.01, 0.1, 1.0, 10.0, 100.0):
        model, guide, *_ , secs = train_map(split, [100], args.digits_epochs, 1e-3, args.seed,
                                           prior_precision=delta, batch_size=64)
        rows[f"fixed δ={delta:g}"] = (map_metrics(model, guide, split.x_test, split.y_test),
                                      glm_metrics(model, guide, split.x_test, split.y_test), secs)
    model, guide, _, res, secs = train_map(
        split, [100], args.digits_epochs, 1e-3, args.seed, prior_precision=1.0, batch_size=64,
        marglik=pb.MarglikOptions(every=1, burnin=args.burnin, steps=100, lr=0.1))
    rows[f"online marglik (δ→{float(guide.prior_precision):.3g})"] = (
        map_metrics(model, guide, split.x_test, split.y_test),
        glm_metrics(model, guide, split.x_test, split.y_test), secs)
    out["marglik"] = {k: dict(map_nll=v[0]["nll"], glm_nll=v[1]["nll"], map_acc=v[0]["accuracy"],
                              seconds=v[2]) for k, v in rows.items()}
    for k, (m, g, s) in rows.items():
        print(f"[marglik digits] {k:<28} MAP nll {m['nll']:.4f} acc {m['accuracy']:.4f} | "
              f"GLM nll {g['nll']:.4f} | {s:.1f}s")


def last_layer_guide(model, guide, structure, prior_precision=1.0):
    """A last-layer Laplace of the same MAP network as the all-layer ``guide``."""
    theta = guide.median()
    return pb.guides.Laplace(model, structure, prior_precision=prior_precision, subset="last_layer",
                             init_loc_fn=lambda site: theta[site["name"]])


def task_lastlayer(args, name, split, hidden, epochs, seeds, out):
    """Same MAP net (trained with δ = 1 on all layers); δ* by 300 Adam steps on log δ each."""
    fmt = lambda m: f"nll {m['nll']:.4f} ece {m['ece']:.4f} acc {m['accuracy']:.4f}"  # noqa: E731
    rows = out.setdefault(f"lastlayer_{name}", {})
    for seed in seeds:
        model, guide, _, _, secs = train_map(split, hidden, epochs, 1e-3, seed)
        m = map_metrics(model, guide, split.x_test, split.y_test)
        with torch.no_grad():
            probs = torch.softmax(model.run_with(guide.median(), split.x_test), -1)
        row = dict(map=m, map_mean_confidence=float(probs.max(-1).values.mean()), train_seconds=secs)
        print(f"[lastlayer {name} seed {seed}] MAP ({epochs} epochs, {secs:.0f}s) {fmt(m)} "
              f"mean conf {row['map_mean_confidence']:.4f}", flush=True)
        variants = [("last-layer kron", last_layer_guide(model, guide, "kron")),
                    ("last-layer full", last_layer_guide(model, guide, "full")), ("all-layer kron", guide)]
        for label, g in variants:
            t = time.perf_counter()
            ev = g.optimize_prior_precision(split.train, steps=300, lr=0.1)
            probs = pb.predict(model, g, split.x_test, predictive="glm_probit", batch_size=500)
            r = pb.metrics.classification_metrics(probs, split.y_test, num_bins=15)
            r["mean_confidence"] = float(probs[0].max(-1).values.mean())
            row[label] = dict(glm=r, prior_precision=float(g.prior_precision), log_evidence=ev,
                              seconds=time.perf_counter() - t)
            print(f"[lastlayer {name} seed {seed}] {label:<15} δ*={float(g.prior_precision):.3g} "
                  f"(evidence {ev:.1f}) GLM {fmt(r)} mean conf {r['mean_confidence']:.4f}  beats MAP in NLL and ECE: "
                  f"{r['nll'] < m['nll'] and r['ece'] < m['ece']}  ({row[label]['seconds']:.0f}s)", flush=True)
        rows[seed] = row


def task_lastlayer_marglik(args, split, out):
    """Online marglik on digits (batch 64, as ``marglik``): all-layer vs last-layer Laplace;
    the last-layer run learns δ of the last layer, the body keeps its model prior (δ = 1)."""
    rows = {}
    for label, subset in (("all-layer", "all"), ("last-layer", "last_layer")):
        torch.manual_seed(args.seed)
        model = pb.BNN(mlp(64, [100], 10), "categorical")
        guide = pb.guides.Laplace(model, "kron", prior_precision=1.0, subset=subset)
        t = time.perf_counter()
        pb.fit(model, guide, split.train, epochs=args.digits_epochs, lr=1e-3, batch_size=64, progress=False,
               seed=args.seed, marglik=pb.MarglikOptions(every=1, burnin=args.burnin, steps=100, lr=0.1))
        m = map_metrics(model, guide, split.x_test, split.y_test)
        g = glm_metrics(model, guide, split.x_test, split.y_test)
        rows[label] = dict(map=m, glm=g, prior_precision=float(guide.prior_precision),
                           seconds=time.perf_counter() - t)
        print(f"[lastlayer marglik digits] {label:<10} δ→{float(guide.prior_precision):.3g}: MAP nll "
              f"{m['nll']:.4f} ece {m['ece']:.4f} acc {m['accuracy']:.4f} | GLM nll {g['nll']:.4f} "
              f"ece {g['ece']:.4f} acc {g['accuracy']:.4f} ({rows[label]['seconds']:.0f}s)", flush=True)
    out["lastlayer_marglik"] = rows


def validation_split(split, num_val, seed):
    """``(train, val)``: ``num_val`` digits of the training set (seeded permutation) for
    validation, the rest for training; the test set is untouched."""
    perm = torch.randperm(len(split.x_train), generator=torch.Generator().manual_seed(1000 + seed))
    val, tr = perm[:num_val], perm[num_val:]
    train = pb.datasets.DataSplit(split.x_train[tr], split.y_train[tr], split.x_test, split.y_test)
    return train, (split.x_train[val], split.y_train[val])


def objective_constant(guide):
    """The θ-independent part of the MAP objective, ``Σ_l ½·numel_l·(log 2π − log δ_l)``
    (scalar δ per layer).  For the 478k-weight MLP it is ≈ 439,612 nats, so the objective's
    trend is only visible once it is subtracted."""
    total = 0.0
    for layer, d in zip(guide.layers, guide.layer_prior_precisions()):
        total += 0.5 * float((math.log(2 * math.pi) - torch.log(d)).expand(layer.numel).sum())
    return total


def convergence(res, epochs, constant=0.0):
    """Training objective (epoch means of the MAP objective minus ``constant``) at
    50/75/90/100 % of the epochs."""
    loss = res.history["loss"]
    return {f"{q}%": loss[max(0, int(q / 100 * epochs) - 1)] - constant for q in (50, 75, 90, 100)}


def evidence_gradient(guide) -> float:
    """``max |∂ log p(D) / ∂ log δ|`` at the guide's δ: ≈ 0 once the evidence is maximised."""
    log_pp = guide.log_prior_precision.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(guide.log_evidence(log_pp.exp()), log_pp)
    return float(grad.abs().max())


def posthoc(model, guide, structure, subset, **options):
    """A Laplace of the same MAP network θ* as ``guide`` (no training)."""
    theta = guide.median()
    return pb.guides.Laplace(model, structure, subset=subset, init_loc_fn=lambda site: theta[site["name"]],
                             **options)


POSTHOC_VARIANTS = {   # name: (subset, Laplace options, tuning)
    "last-layer, δ evidence": ("last_layer", {}, "marglik"),
    "last-layer, δ per site evidence": ("last_layer", {"prior_structure": "sitewise", "kron_bias": "separate"},
                                        "marglik"),
    "last-layer, δ grid search": ("last_layer", {}, "gridsearch"),
    "all layers, δ evidence": ("all", {}, "marglik"),
    "all layers, δ per layer evidence": ("all", {"prior_structure": "layerwise"}, "marglik"),
    "all layers, δ per site evidence": ("all", {"prior_structure": "sitewise", "kron_bias": "separate"}, "marglik"),
    "all layers, δ grid search": ("all", {}, "gridsearch"),
}


def task_targets(args, mnist, out):
    """Issue 16's targets: see the module docstring."""
    rows = out.setdefault("targets", {})
    fmt = lambda m: f"nll {m['nll']:.4f} ece {m['ece']:.4f} acc {m['accuracy']:.4f}"  # noqa: E731
    for seed in args.mnist_seeds:
        train, val = validation_split(mnist, args.val, seed)
        model, guide, _, res, secs = train_map(train, [400, 400], args.epochs, args.lr, seed,
                                               lr_schedule="cosine")
        m = map_metrics(model, guide, train.x_test, train.y_test)
        const = objective_constant(guide)
        row = {"MAP": dict(metrics=m, train_seconds=secs, loss=convergence(res, args.epochs, const),
                           objective_constant=const, train_log_lik=res.history["log_lik"][-1],
                           convergence=str(res.convergence))}
        print(f"[targets seed {seed}] MAP ({args.epochs} epochs, lr {args.lr} cosine, {secs:.0f}s) {fmt(m)}; "
              f"training objective − {const:.1f} at 50/75/90/100 % of the epochs: "
              f"{[round(v, 2) for v in row['MAP']['loss'].values()]}, "
              f"final train log-lik {row['MAP']['train_log_lik']:.2f}; fit's diagnosis: "
              f"converged={res.convergence.converged}", flush=True)
        for name, (subset, options, tuning) in ({} if args.skip_posthoc else POSTHOC_VARIANTS).items():
            t = time.perf_counter()
            g = posthoc(model, guide, "kron", subset, **options)
            g.fit_curvature(train.train)
            if tuning == "marglik":
                value = g.optimize_prior_precision(steps=args.steps, lr=0.1)
            else:
                value = g.optimize_prior_precision(method="gridsearch", val=val, link_approx="probit")
            r = glm_metrics(model, g, train.x_test, train.y_test)
            delta = [round(float(v), 4) for v in g.prior_precision.reshape(-1)]
            row[name] = dict(metrics=r, prior_precision=delta, value=value, log_evidence=float(g.log_evidence()),
                             evidence_gradient=evidence_gradient(g), seconds=time.perf_counter() - t,
                             beats_map_nll=r["nll"] < m["nll"], beats_map_ece=r["ece"] < m["ece"])
            if tuning == "gridsearch":           # a δ at the end of the grid would call for a wider grid
                grid = g.gridsearch_losses[0].reshape(len(g.gridsearch_losses[0]), -1)[:, 0]
                row[name]["grid_edge"] = float(g.prior_precision.reshape(-1)[0]) in (float(grid[0]), float(grid[-1]))
            print(f"[targets seed {seed}] {name:<34} δ={delta} ({tuning} {value:.4g}, log evidence "
                  f"{row[name]['log_evidence']:.1f}, max|∂ log Z/∂ log δ| {row[name]['evidence_gradient']:.2g}) "
                  f"GLM {fmt(r)}  NLL<MAP {r['nll'] < m['nll']} ECE<MAP {r['ece'] < m['ece']} "
                  f"({row[name]['seconds']:.0f}s){' AT THE GRID EDGE' if row[name].get('grid_edge') else ''}",
                  flush=True)
        if args.online:
            for name, subset, structure in (("online, last-layer, δ scalar", "last_layer", "scalar"),
                                            ("online, last-layer, δ per site", "last_layer", "sitewise"),
                                            ("online, all layers, δ scalar", "all", "scalar"),
                                            ("online, all layers, δ per layer", "all", "layerwise")):
                extra = {"kron_bias": "separate"} if structure == "sitewise" else {}
                mo, go, _, ro, so = train_map(train, [400, 400], args.epochs, args.lr, seed, lr_schedule="cosine",
                                              marglik=pb.MarglikOptions(every=args.every, burnin=args.burnin, steps=100, lr=0.1),
                                              subset=subset, prior_structure=structure, **extra)
                mm = map_metrics(mo, go, train.x_test, train.y_test)
                r = glm_metrics(mo, go, train.x_test, train.y_test)
                ev = [v for v in ro.history["log_evidence"] if v == v]
                row[name] = dict(metrics=r, map_metrics=mm, seconds=so,
                                 loss=convergence(ro, args.epochs, objective_constant(go)),
                                 prior_precision=[round(float(v), 4) for v in go.prior_precision.reshape(-1)],
                                 best_log_evidence=ro.history["best_log_evidence"][0], log_evidence=ev,
                                 beats_map_nll=r["nll"] < m["nll"], beats_map_ece=r["ece"] < m["ece"])
                print(f"[targets seed {seed}] {name:<34} δ={row[name]['prior_precision']} best evidence "
                      f"{row[name]['best_log_evidence']:.1f} (evaluation {ev.index(max(ev)) + 1}/{len(ev)}); "
                      f"own MAP {fmt(mm)}; GLM {fmt(r)}; loss {[round(v, 1) for v in row[name]['loss'].values()]} "
                      f"({so:.0f}s)", flush=True)
        rows[seed] = row
    _summarise_targets(rows)


def _summarise_targets(rows):
    names = [k for k in next(iter(rows.values())) if k != "MAP"]
    print(f"[targets] over {len(rows)} seeds (MAP NLL / ECE mean "
          f"{statistics.mean(r['MAP']['metrics']['nll'] for r in rows.values()):.4f} / "
          f"{statistics.mean(r['MAP']['metrics']['ece'] for r in rows.values()):.4f}):")
    for name in names:
        runs = [r[name] for r in rows.values() if name in r]
        print(f"[targets]   {name:<34} NLL {statistics.mean(x['metrics']['nll'] for x in runs):.4f} "
              f"ECE {statistics.mean(x['metrics']['ece'] for x in runs):.4f}; NLL < MAP in "
              f"{sum(x['beats_map_nll'] for x in runs)}/{len(runs)}, ECE < MAP in "
              f"{sum(x['beats_map_ece'] for x in runs)}/{len(runs)}, both in "
              f"{sum(x['beats_map_nll'] and x['beats_map_ece'] for x in runs)}/{len(runs)}")
    need = math.ceil(0.8 * len(rows))                         # ≥ 4 of 5 seeds
    for label, name, both in (("last layer, δ by the evidence: NLL < MAP", "last-layer, δ evidence", False),
                              ("last layer, δ by grid search: NLL and ECE < MAP", "last-layer, δ grid search", True)):
        runs = [r[name] for r in rows.values() if name in r]
        if runs:
            hits = sum(x["beats_map_nll"] and (x["beats_map_ece"] or not both) for x in runs)
            print(f"[targets] verdict: {label} in {hits}/{len(runs)} seeds (need {need}): "
                  f"{'met' if hits >= need and len(runs) == len(rows) else 'NOT met'}")
    print("| seed | MAP | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    fmt = lambda m: f"{m['nll']:.4f} / {m['ece']:.4f} / {m['accuracy']:.4f}"  # noqa: E731
    for seed, r in rows.items():
        print(f"| {seed} | {fmt(r['MAP']['metrics'])} | "
              + " | ".join(f"{fmt(r[n]['metrics'])} (δ {r[n]['prior_precision']})" if n in r else "–" for n in names)
              + " |")


def task_marglik_noise(args, digits, out):
    rows = {}
    for schedule in ("constant", "cosine"):
        torch.manual_seed(args.seed)
        model = pb.BNN(mlp(64, [100], 10), "categorical")
        guide = pb.guides.Laplace(model, "kron")
        res = pb.fit(model, guide, digits.train, epochs=args.digits_epochs, lr=1e-2, batch_size=64, progress=False,
                     seed=args.seed, lr_schedule=schedule, marglik=pb.MarglikOptions(every=5, burnin=10, steps=50, lr=0.1))
        ev = [v for v in res.history["log_evidence"] if v == v]
        second = ev[len(ev) // 2:]
        again = float(guide.log_evidence())
        guide.fit_curvature(digits.train)                       # a second pass at the restored state
        rows[schedule] = dict(log_evidence=ev, noise=res.history["log_evidence_noise"],
                              best=res.history["best_log_evidence"][0], best_index=ev.index(max(ev)),
                              second_half_sd=statistics.stdev(second),
                              second_half_step_sd=statistics.stdev([b - a for a, b in zip(second, second[1:])]),
                              restored=again, repass=float(guide.log_evidence()))
        r = rows[schedule]
        print(f"[marglik_noise {schedule}] evidence per evaluation {[round(v, 1) for v in ev]}; recorded estimate "
              f"noise max {max(r['noise']):.3g}; best {r['best']:.1f} at evaluation {r['best_index'] + 1}/{len(ev)}; "
              f"second half sd {r['second_half_sd']:.1f} (successive differences sd {r['second_half_step_sd']:.1f}); "
              f"restored state {r['restored']:.2f}, re-computed {r['repass']:.2f}", flush=True)
    out["marglik_noise"] = rows


def task_llcompare(args, mnist, out):
    """Last-layer KFAC vs laplace-torch on one MAP (seed ``--seed``) at one δ (ours by the
    evidence, given to both): probabilities and side-by-side timings."""
    from laplace import Laplace as TorchLaplace

    train, _ = validation_split(mnist, args.val, args.seed)
    model, guide, net, _, secs = train_map(train, [400, 400], args.epochs, args.lr, args.seed, lr_schedule="cosine")
    tuned = posthoc(model, guide, "kron", "last_layer", kron_bias="separate")
    tuned.fit_curvature(train.train)
    tuned.optimize_prior_precision(steps=args.steps, lr=0.1)
    delta = float(tuned.prior_precision)
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(guide.map_values()[f"net.{name}"])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train.x_train, train.y_train),
                                         batch_size=256)
    ours_t, theirs_t, split_t = [], [], {"ours_fit": [], "ours_predict": [], "theirs_fit": [], "theirs_predict": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        g = posthoc(model, guide, "kron", "last_layer", kron_bias="separate", prior_precision=delta)
        g.fit_curvature(train.train, batch_size=256)
        t1 = time.perf_counter()
        mine = pb.predict(model, g, train.x_test, predictive="glm", batch_size=500)[0]
        t2 = time.perf_counter()
        ours_t.append(t2 - t)
        split_t["ours_fit"].append(t1 - t)
        split_t["ours_predict"].append(t2 - t1)
        t = time.perf_counter()
        la = TorchLaplace(ref, "classification", subset_of_weights="last_layer", hessian_structure="kron",
                          prior_precision=delta)
        la.fit(loader)
        t1 = time.perf_counter()
        with torch.no_grad():
            theirs = la(train.x_test, pred_type="glm", link_approx="probit")
        t2 = time.perf_counter()
        theirs_t.append(t2 - t)
        split_t["theirs_fit"].append(t1 - t)
        split_t["theirs_predict"].append(t2 - t1)
    diff = float((mine - theirs).abs().max())
    r_ours = pb.metrics.classification_metrics(mine[None], train.y_test, num_bins=15)
    r_theirs = pb.metrics.classification_metrics(theirs[None], train.y_test, num_bins=15)
    out["llcompare"] = dict(prior_precision=delta, max_abs_prob_diff=diff, ours_seconds=ours_t, parts=split_t,
                            laplace_torch_seconds=theirs_t, ours_nll=r_ours["nll"], laplace_torch_nll=r_theirs["nll"],
                            laplace_torch_log_evidence=float(la.log_marginal_likelihood()),
                            ours_log_evidence=float(g.log_evidence()))
    print(f"[llcompare] MAP {args.epochs} epochs ({secs:.0f}s); δ = {delta:.4g}; max |p_ours − p_laplace-torch| = "
          f"{diff:.2e} over {tuple(mine.shape)}; NLL {r_ours['nll']:.5f} vs {r_theirs['nll']:.5f}; evidence "
          f"{out['llcompare']['ours_log_evidence']:.3f} vs {out['llcompare']['laplace_torch_log_evidence']:.3f}")
    print(f"[llcompare] fit + 5,000-point GLM predictive: ours {[round(v, 3) for v in ours_t]} s, "
          f"laplace-torch {[round(v, 3) for v in theirs_t]} s; medians {statistics.median(ours_t):.3f} s vs "
          f"{statistics.median(theirs_t):.3f} s, ratio ours/theirs "
          f"{statistics.median(ours_t) / statistics.median(theirs_t):.2f}; medians of the parts (s): "
          + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in split_t.items()))


def task_timing(args, split, out):
    """Fit KFAC + evidence, ours vs laplace-torch, interleaved repeats on an untrained MLP."""
    from laplace import KronLaplace
    torch.manual_seed(args.seed)
    net = mlp(784, [400, 400], 10)
    model = pb.BNN(net, "categorical")
    guide = pb.guides.Laplace(model, "kron")
    guide.fit_curvature(split.train)                         # warm-up (setup, allocations)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(split.x_train, split.y_train),
                                         batch_size=256)
    ours, theirs = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        guide.fit_curvature(split.train)
        guide.log_evidence()
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        la = KronLaplace(net, "classification")
        la.fit(loader)
        la.log_marginal_likelihood()
        theirs.append(time.perf_counter() - t)
    out["timing"] = dict(ours=ours, laplace_torch=theirs)
    print(f"[timing] ours {[round(v, 2) for v in ours]} laplace-torch {[round(v, 2) for v in theirs]}; "
          f"medians {statistics.median(ours):.2f}s vs {statistics.median(theirs):.2f}s, "
          f"ratio {statistics.median(ours) / statistics.median(theirs):.2f}")


def task_crosscheck(args, split, out):
    """Evidence and GLM probit predictive vs laplace-torch on digits (same MAP net, same δ)."""
    from laplace import KronLaplace
    model, guide, net, *_ = train_map(split, [50], 15, 3e-3, args.seed, kron_bias="separate")
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(guide.map_values()[f"net.{name}"])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(split.x_train, split.y_train),
                                         batch_size=256)
    rows = []
    for delta in (1.0, 5.0):
        with torch.no_grad():
            guide.log_prior_precision.fill_(torch.tensor(delta).log())
        mine = pb.predict(model, guide, split.x_test, predictive="glm")[0]
        la = KronLaplace(ref, "classification", prior_precision=delta)
        la.fit(loader)
        theirs = la(split.x_test, pred_type="glm", link_approx="probit")
        row = dict(prior_precision=delta, ours_evidence=float(guide.log_evidence()),
                   laplace_torch_evidence=float(la.log_marginal_likelihood()),
                   max_abs_prob_diff=float((mine - theirs).abs().max()),
                   ours_nll=pb.metrics.classification_metrics(mine[None], split.y_test, num_bins=15)["nll"],
                   laplace_torch_nll=pb.metrics.classification_metrics(theirs[None], split.y_test, num_bins=15)["nll"])
        rows.append(row)
        print(f"[crosscheck digits] {row}")
    out["crosscheck"] = rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["evidence", "glm", "marglik", "mnist", "digits", "crosscheck", "timing", "lastlayer",
                                       "targets", "llcompare", "marglik_noise", "all"], default="all",
                   help="mnist = evidence + GLM on MNIST; digits = GLM on digits + marglik")
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epochs", type=int, default=20, help="MAP epochs on MNIST 5k")
    p.add_argument("--digits-epochs", type=int, default=100)
    p.add_argument("--burnin", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prior-precision", type=float, default=1.0)
    p.add_argument("--sweep", type=float, nargs="*", default=[10.0, 30.0, 100.0, 300.0],
                   help="post-hoc δ values at which the GLM task also reports NLL/ECE (diagnostic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="digits seeds of --task lastlayer (none: skip digits and its marglik runs)")
    p.add_argument("--mnist-seeds", type=int, nargs="*", default=[0], help="MNIST 5k seeds of --task lastlayer")
    p.add_argument("--lr", type=float, default=1e-3, help="MAP learning rate of --task targets/llcompare")
    p.add_argument("--val", type=int, default=500, help="validation digits taken from the training set")
    p.add_argument("--steps", type=int, default=300, help="Adam steps on log δ for post-hoc evidence tuning")
    p.add_argument("--online", action="store_true", help="--task targets: also the online-marglik runs")
    p.add_argument("--every", type=int, default=5, help="online marglik: epochs between evidence steps")
    p.add_argument("--skip-posthoc", action="store_true", help="--task targets: only the MAP (and --online runs)")
    p.add_argument("--json", default=None, help="write the results dict there")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (before 2026-11-29 13:20 UTC the script always used 2)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--no-flush-denormal", dest="flush_denormal", action="store_false",
                   help="keep denormal floats (default: flush them to 0; MAP training of the MNIST MLP "
                        "slowed from 0.2 to ~1 s per epoch over 150 epochs as prior-only weights "
                        "of blank pixels decayed into the denormal range)")
    args = p.parse_args(argv)
    if args.json:   # before any training: a long run is never lost at its end
        check_new_file(args.json, overwrite=args.overwrite)
    if args.quick:
        args.epochs, args.digits_epochs, args.burnin, args.repeats, args.val = 2, 5, 1, 1, 100
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(args.flush_denormal)
    out = {}
    digits = pb.datasets.digits()
    trained = None
    if args.task in ("evidence", "all", "glm", "mnist", "timing", "lastlayer", "targets", "llcompare"):
        mnist = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
        if args.quick:
            mnist = pb.datasets.DataSplit(mnist.x_train[:500], mnist.y_train[:500], mnist.x_test[:500],
                                          mnist.y_test[:500])
    if args.task in ("evidence", "all", "mnist"):
        trained = task_evidence(args, mnist, out)
    if args.task in ("glm", "all", "digits"):
        task_glm(args, "digits", digits, [100], args.digits_epochs, out)
    if args.task in ("glm", "all", "mnist"):
        task_glm(args, "mnist5k", mnist, [400, 400], args.epochs, out, trained)
    if args.task in ("marglik", "all", "digits"):
        task_marglik(args, digits, out)
    if args.task == "lastlayer":
        if args.seeds:
            task_lastlayer(args, "digits", digits, [100], args.digits_epochs, args.seeds, out)
            task_lastlayer_marglik(args, digits, out)
        task_lastlayer(args, "mnist5k", mnist, [400, 400], args.epochs, args.mnist_seeds, out)
    if args.task == "timing":
        task_timing(args, mnist, out)
    if args.task in ("crosscheck", "all"):
        task_crosscheck(args, digits, out)
    if args.task == "targets":
        task_targets(args, mnist, out)
    if args.task == "llcompare":
        task_llcompare(args, mnist, out)
    if args.task == "marglik_noise":
        task_marglik_noise(args, digits, out)
    if args.json:
        write_json(args.json, out, indent=1, default=str, overwrite=args.overwrite)
    return out


if __name__ == "__main__":
    main()
