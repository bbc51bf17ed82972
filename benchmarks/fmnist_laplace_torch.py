"""Fashion-MNIST Laplace rows side by side with the peer library laplace-torch (issue 26).

Two modes, each one process that runs pyro_bnn and laplace-torch on the same network, the
same data and the same optimiser settings, and scores both on the 10,000 Fashion-MNIST test
images with the same metrics (``benchmarks/fashion_mnist.py``'s ``score``: accuracy, NLL,
ECE (15 bins), Brier, OOD AUROC vs the MNIST test digits by predictive entropy and by
mutual information):

* ``--mode marglik`` — **online marginal-likelihood Laplace** (Immer et al. 2021,
  Algorithm 1) on all training images (60,000 unless ``--subset``): all layers, KFAC,
  layer-wise δ.  pyro_bnn: ``pb.fit(model, Laplace(model, "kron",
  prior_structure="layerwise"), marglik=pb.MarglikOptions(every=F, burnin=B - F, steps=K, lr=γ))``;
  laplace-torch: ``marglik_training(net, loader, "classification", "kron",
  marglik_frequency=F, n_epochs_burnin=B, n_hypersteps=K, lr_hyp=γ,
  prior_structure="layerwise")``.  Both: the same initial weights, Adam lr 1e-3, batch 64,
  the same per-step cosine learning-rate schedule, δ₀ = 1; the hyperparameter steps happen
  after the same epochs (laplace-torch: ``epoch >= B and epoch % F == 0``; pyro_bnn:
  ``epoch > burnin and (epoch - burnin) % every == 0``, hence ``burnin = B - F``).
* ``--mode posthoc`` — a MAP net trained by ``pb.fit`` (Laplace guide's MAP phase, δ = 1,
  i.e. the N(0, 1) prior) on the 55,000 training images of
  ``pb.datasets.fashion_mnist_split`` (5,000 held out for validation), then last-layer KFAC
  Laplace on that SAME net by both libraries, δ by the evidence and δ by a validation grid
  search (both libraries' default grid: 100 values, 1e-4..1e4, probit-scored).

Predictive: the linearised (GLM) predictive with a Monte-Carlo softmax link, 100 function
draws, in both libraries (pyro_bnn ``pb.predict(..., predictive="glm")`` = "glm-mc(100)";
laplace-torch ``predictive_samples(x, pred_type="glm", n_samples=100)``), so that the
mutual information is defined.

**Compare like with like.**  laplace-torch's all-layer GLM predictive costs ~0.3 s per image on
this CPU, so it scores only the first ``--peer-limit`` (500) test and OOD images.  In
``--mode marglik`` the laplace-torch row's top-level figures are therefore pyro_bnn's
predictive on laplace-torch's posterior (its θ* and δ, curvature refitted) over *all* images —
the same images and predictive as the pyro_bnn row — and its own predictive's figures are under
``own_predictive``, to be read only beside the pyro_bnn row's ``first500``; the script prints
both pairings at the end.  (Until the fifteenth session the top level held the 500-image
figures, and four seeds were compared with the pyro_bnn row's all-image ones: a wrong
comparison, corrected in ``docs/results/fmnist_laplace.md``.)

laplace-torch is an optional benchmark dependency, never a test dependency.  Install it
next to (not into) the project's environment::

    .venv/bin/pip install --no-deps --target /work/peerlibs laplace-torch asdfghjkl==0.1a4 \\
        backpack-for-pytorch curvlinops-for-pytorch torchmetrics einops unfoldNd \\
        lightning-utilities einconv linear_operator

and run with ``PYTHONPATH=$PWD:/work/peerlibs``::

    PYTHONPATH=$PWD:/work/peerlibs nice -n 10 .venv/bin/python benchmarks/fmnist_laplace_torch.py \\
        --mode marglik --epochs 20 --out /work/runs/lapscale/marglik.jsonl
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bnn as pb
from pyro_bnn.training.convergence import diagnose

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion_mnist as fm  # noqa: E402  (the shared loaders, networks and metrics)
from _common import emit_row  # benchmarks/_common.py (on sys.path when run as a script)

INSTALL_HINT = ("laplace-torch is not importable. It is an optional benchmark dependency: install it "
                "outside the project environment with\n  .venv/bin/pip install --no-deps --target "
                "/work/peerlibs laplace-torch asdfghjkl==0.1a4 backpack-for-pytorch curvlinops-for-pytorch "
                "torchmetrics einops unfoldNd lightning-utilities einconv linear_operator\n"
                "and run with PYTHONPATH=$PWD:/work/peerlibs")


def import_laplace():
    """The ``laplace`` package (laplace-torch), imported lazily, or a clear install hint."""
    try:
        import laplace
    except ImportError as exc:
        raise SystemExit(f"{INSTALL_HINT}\n(import error: {exc})") from None
    return laplace


def cosine_factor(total_steps: int):
    """pb.fit's per-step cosine factor (``pyro_bnn.lr_schedule``), for laplace-torch's LambdaLR."""
    total = max(int(total_steps), 1)
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total - 1) / total))


def loader(x, y, *, batch_size=64, shuffle=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=g)


def peer_samples(lap, x, *, num_samples=100, batch=200, seed=0):
    """laplace-torch's GLM predictive draws ``(S, N, C)``, streamed in batches."""
    g = torch.Generator().manual_seed(seed)
    out = [lap.predictive_samples(x[i:i + batch], pred_type="glm", n_samples=num_samples, generator=g)
           for i in range(0, len(x), batch)]
    return torch.cat([o.detach() for o in out], 1)


def peer_score(lap, data, num_samples, limit=None):
    """Scores of laplace-torch's own GLM predictive, on the first ``limit`` test and OOD
    images (its all-layer GLM predictive costs ~0.3 s per image on this CPU: not all 20,000)."""
    t0 = time.perf_counter()
    x_in, y_in, x_out = data["test"][0][:limit], data["test"][1][:limit], data["ood"][:limit]
    row = fm.score(peer_samples(lap, x_in, num_samples=num_samples),
                   peer_samples(lap, x_out, num_samples=num_samples), y_in)
    row["predict_seconds"] = time.perf_counter() - t0
    row["scored_images"] = len(x_in)
    return row


def ours_score(args, model, guide, data, num_samples, limit=None):
    """Scores of pyro_bnn's GLM predictive (glm-mc) on all test and OOD images, plus (with
    ``limit``) on the first ``limit`` of each, for the comparison with :func:`peer_score`."""
    t0 = time.perf_counter()
    p_in, p_out = fm.predict_pair(args, model, guide, data, num_samples=num_samples, predictive="glm")
    row = fm.score(p_in, p_out, data["test"][1])
    row["predict_seconds"] = time.perf_counter() - t0
    if limit:
        row[f"first{limit}"] = fm.score(p_in[:, :limit], p_out[:, :limit], data["test"][1][:limit])
    return row


def ours_on_peer(args, data, net, delta, limit):
    """laplace-torch's all-layer posterior (its θ*, its per-tensor δ, bias blocks apart) refitted
    and predicted by pyro_bnn (``prior_structure="sitewise"``, ``kron_bias="separate"``): the
    peer's fit scored on all 20,000 images, and its evidence by our estimator."""
    model = pb.BNN(copy.deepcopy(net), "categorical", prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.Laplace(model, "kron", prior_precision=torch.as_tensor(delta), prior_structure="sitewise",
                              kron_bias="separate")
    t0 = time.perf_counter()
    guide.fit_curvature(data["train"])
    row = dict(curvature_seconds=time.perf_counter() - t0, log_evidence_ours=float(guide.log_evidence()))
    row.update(ours_score(args, model, guide, data, args.num_samples, limit))
    return row


def map_epoch_seconds(args, data, epochs=2):
    """Seconds per epoch of the plain PyTorch MAP net (``fashion_mnist.py``'s ``map`` row) on
    the same data, in this process: the reference for the epoch-time ratios."""
    x, y = data["train"]
    _, _, secs = fm.train_map_net(args.arch, x, y, epochs=epochs, seed=args.seed, weight_decay=1.0 / len(x))
    return sum(secs) / len(secs)


def initial_net(args):
    torch.manual_seed(args.seed)
    return fm.make_net(args.arch)


# ----------------------------------------------------------------------------- online marglik
def marglik_schedule(args) -> dict:
    """Both libraries' settings for the same hyper-step epochs."""
    if args.burnin % args.every:
        raise SystemExit(f"--burnin must be a multiple of --every, got {args.burnin} and {args.every}")
    return dict(ours={"every": args.every, "burnin": max(args.burnin - args.every, 0), "steps": args.hypersteps,
                      "lr": args.lr_hyp},
                peer=dict(marglik_frequency=args.every, n_epochs_burnin=args.burnin,
                          n_hypersteps=args.hypersteps, lr_hyp=args.lr_hyp))


def run_ours_marglik(args, data, net0, schedule):
    model = pb.BNN(copy.deepcopy(net0), "categorical", prior=pb.priors.IIDNormal(1.0))
    # "layer": one δ per layer ([W, b] one block); "tensor": laplace-torch's layerwise, one δ per
    # parameter tensor with the bias its own block (prior_structure="sitewise", kron_bias="separate")
    structure = dict(layer=("layerwise", "joint"), tensor=("sitewise", "separate"))[args.ours_delta]
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0, prior_structure=structure[0],
                              kron_bias=structure[1])
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # --ours-adam-eps-per-datum: Adam's eps times N, which is laplace-torch's step exactly (its
        # loss is ours / N, and Adam scaled by c is Adam with eps / c): isolates that difference
        opt = {} if args.ours_adam_eps_per_datum is None else dict(optimizer=lambda ps: torch.optim.Adam(
            ps, lr=1e-3, eps=args.ours_adam_eps_per_datum * len(data["train"][0]), fused=True), lr=None)
        res = pb.fit(model, guide, data["train"], epochs=args.epochs, seed=args.seed, progress=False,
                     batch_size=64, lr_schedule="cosine", marglik=pb.MarglikOptions(**schedule),
                     **({"lr": 1e-3} | opt))
    wall = time.perf_counter() - t0
    h = res.history
    row = dict(library="pyro_bnn", fit_seconds=wall, seconds_per_epoch=wall / args.epochs,
               sgd_seconds_per_epoch=sum(h["epoch_seconds"]) / len(h["epoch_seconds"]),
               loss_curve=[round(v, 1) for v in h["loss"]],
               log_evidence_curve=[round(v, 1) for v in h.get("log_evidence", []) if v == v],
               best_log_evidence=h.get("best_log_evidence", [None])[0],
               convergence=fm.convergence_of(res.convergence),
               prior_precision=[float(d) for d in guide.prior_precision.detach().reshape(-1)],
               log_evidence=float(guide.log_evidence()), settings=dict(marglik=schedule, kron_bias=structure[1],
                                                                         prior_structure=structure[0]),
               evidence_terms={k: float(v) for k, v in guide.evidence_terms().items()})
    row.update(ours_score(args, model, guide, data, args.num_samples, args.peer_limit))
    return row


def run_peer_marglik(args, data, net0, schedule):
    laplace = import_laplace()
    net = copy.deepcopy(net0)
    x, y = data["train"]
    train = loader(x, y, seed=args.seed)
    steps = args.epochs * len(train)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lap, net, margliks, losses = laplace.marglik_training(
            net, train, likelihood="classification", hessian_structure="kron",
            optimizer_kwargs={"lr": 1e-3}, scheduler_cls=torch.optim.lr_scheduler.LambdaLR,
            scheduler_kwargs={"lr_lambda": cosine_factor(steps)}, n_epochs=args.epochs,
            prior_structure="layerwise", prior_prec_init=1.0, **schedule)
    wall = time.perf_counter() - t0
    n = len(x)
    diag = diagnose([-v * n for v in losses], lr_decayed=True)
    k = schedule["n_hypersteps"]
    row = dict(library="laplace-torch", fit_seconds=wall, seconds_per_epoch=wall / args.epochs,
               loss_curve=[round(v * n, 1) for v in losses],
               log_evidence_curve=[round(-margliks[i], 1) for i in range(k - 1, len(margliks), k)],
               convergence=fm.convergence_of(diag),
               prior_precision=[float(d) for d in lap.prior_precision.reshape(-1)],
               log_evidence=float(lap.log_marginal_likelihood()),
               settings=dict(schedule, hessian_structure="kron", backend="AsdlGGN", prior_structure="layerwise"),
               evidence_terms={k: float(getattr(lap, k)) for k in ("log_likelihood", "log_det_ratio", "scatter")})
    delta = row["prior_precision"]
    # the row's figures are like for like with pyro_bnn's row: every test and OOD image, the same
    # (pyro_bnn's) GLM predictive, on laplace-torch's posterior (θ*, δ); laplace-torch's own
    # predictive costs ~0.3 s per image on this CPU, so it scores only the first --peer-limit
    # images, beside pyro_bnn's row's "first<limit>" figures (never beside its all-image ones)
    refit = ours_on_peer(args, data, net, delta, args.peer_limit)
    row.update({k: refit.pop(k) for k in LIKE_FOR_LIKE if k in refit})
    row["scored_by"] = "pyro_bnn GLM predictive on laplace-torch's posterior, all images"
    row["refit_by_pyro_bnn"] = refit
    row["own_predictive"] = peer_score(lap, data, args.num_samples, args.peer_limit)
    return row


#: the scores of a marglik row that compare like with like across the two libraries
LIKE_FOR_LIKE = ("accuracy", "nll", "ece", "brier", "ood_auroc_entropy", "ood_auroc_mi", "predict_seconds")


def print_like_for_like(rows) -> None:
    """Ours against laplace-torch on the same images with the same predictive (all images), and
    each library's own predictive on the first ``--peer-limit`` images."""
    ours = next((r for r in rows if r["library"] == "pyro_bnn"), None)
    peer = next((r for r in rows if r["library"] == "laplace-torch"), None)
    if ours is None or peer is None:
        return
    print("like for like (acc / NLL / ECE):")
    print(f"  all images, pyro_bnn's predictive: ours {ours['accuracy']:.4f} / {ours['nll']:.4f} / {ours['ece']:.4f}"
          f"   laplace-torch's posterior {peer['accuracy']:.4f} / {peer['nll']:.4f} / {peer['ece']:.4f}")
    own, limit = peer["own_predictive"], peer["own_predictive"].get("scored_images")
    mine = ours.get(f"first{limit}")
    if mine is not None:
        print(f"  first {limit} images, each its own predictive: ours {mine['accuracy']:.4f} / {mine['nll']:.4f} / "
              f"{mine['ece']:.4f}   laplace-torch {own['accuracy']:.4f} / {own['nll']:.4f} / {own['ece']:.4f}")


def mode_marglik(args, data):
    schedule = marglik_schedule(args)
    net0 = initial_net(args)
    rows = []
    if not args.skip_ours:
        rows.append(run_ours_marglik(args, data, net0, schedule["ours"]))
        emit(args, rows[-1])
    if not args.skip_peer:
        rows.append(run_peer_marglik(args, data, net0, schedule["peer"]))
        emit(args, rows[-1])
    print_like_for_like(rows)
    return rows


# ----------------------------------------------------------------------------- post hoc
def train_map(args, data):
    net0 = initial_net(args)
    model = pb.BNN(net0, "categorical", prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pb.fit(model, guide, data["train55"], epochs=args.epochs, seed=args.seed, progress=False,
                     batch_size=64, lr=1e-3)
    row = fm.fit_summary(res)
    row["fit_seconds"] = time.perf_counter() - t0
    theta = {k: v.detach().clone() for k, v in guide.median().items()}
    p_in = fm.softmax_of(lambda z: model.run_with(theta, z), data["test"][0]).unsqueeze(0)
    p_out = fm.softmax_of(lambda z: model.run_with(theta, z), data["ood"]).unsqueeze(0)
    row.update(fm.score(p_in, p_out, data["test"][1]))
    return model, theta, row


def ours_last_layer(args, data, model, theta, how):
    ll = pb.guides.Laplace(model, "kron", prior_precision=1.0, subset="last_layer",
                           init_loc_fn=lambda site: theta[site["name"]])
    t0 = time.perf_counter()
    ll.fit_curvature(data["train55"])
    if how == "evidence":
        ll.optimize_prior_precision(steps=100, lr=0.1)
    else:
        ll.optimize_prior_precision(method="gridsearch", val=data["valid"])
    tune = time.perf_counter() - t0
    row = dict(library="pyro_bnn", delta_by=how, prior_precision=float(ll.prior_precision.mean()),
               log_evidence=float(ll.log_evidence()), posthoc_seconds=tune)
    row.update(ours_score(args, model, ll, data, args.num_samples))
    return row


def peer_last_layer(args, data, theta, how):
    laplace = import_laplace()
    net = fm.make_net(args.arch)
    net.load_state_dict({name[len("net."):]: v for name, v in theta.items()})
    t0 = time.perf_counter()
    lap = laplace.Laplace(net, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    lap.fit(loader(*data["train55"], batch_size=256, shuffle=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "evidence":
            lap.optimize_prior_precision(pred_type="glm", method="marglik", n_steps=100, lr=0.1)
        else:
            lap.optimize_prior_precision(pred_type="glm", method="gridsearch",
                                         val_loader=loader(*data["valid"], batch_size=256, shuffle=False))
    tune = time.perf_counter() - t0
    row = dict(library="laplace-torch", delta_by=how, prior_precision=float(lap.prior_precision.mean()),
               log_evidence=float(lap.log_marginal_likelihood()), posthoc_seconds=tune)
    row.update(peer_score(lap, data, args.num_samples))
    return row


def mode_posthoc(args, data):
    model, theta, map_row = train_map(args, data)
    map_row["library"] = "pyro_bnn MAP (55k)"
    emit(args, map_row)
    rows = [map_row]
    for how in ("evidence", "validation"):
        rows.append(ours_last_layer(args, data, model, theta, how))
        emit(args, rows[-1])
        if not args.skip_peer:
            rows.append(peer_last_layer(args, data, theta, how))
            emit(args, rows[-1])
    return rows


def emit(args, row):
    row.update(mode=args.mode, arch=args.arch, epochs=args.epochs, seed=args.seed, subset=args.subset or None,
               num_train=args.num_train, map_seconds_per_epoch=args.map_epoch)
    if "seconds_per_epoch" in row and args.map_epoch:
        row["epoch_ratio_to_map"] = row["seconds_per_epoch"] / args.map_epoch
    emit_row(row, args.out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["marglik", "posthoc"], required=True)
    parser.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="F: hyper-steps every F epochs")
    parser.add_argument("--burnin", type=int, default=5, help="B: first hyper-step epoch (laplace-torch's)")
    parser.add_argument("--hypersteps", type=int, default=100, help="K: Adam steps on log δ per update")
    parser.add_argument("--lr-hyp", type=float, default=0.1)
    parser.add_argument("--num-samples", type=int, default=100, help="GLM function draws per prediction")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--subset", type=int, default=0, help="train on this many images (0: all)")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--mnist-root", default="/work/shared/data/mnist")
    parser.add_argument("--peer-limit", type=int, default=500,
                        help="marglik: laplace-torch's own all-layer GLM predictive scores the first N test "
                             "and OOD images (0: all; ~0.3 s per image)")
    parser.add_argument("--ours-delta", choices=["layer", "tensor"], default="layer",
                        help="pyro_bnn's δ structure: one per layer (default) or one per parameter tensor "
                             "with separate bias blocks (laplace-torch's 'layerwise')")
    parser.add_argument("--ours-adam-eps-per-datum", type=float, default=None,
                        help="pyro_bnn with Adam eps = this x N (1e-8: laplace-torch's mean-loss step)")
    parser.add_argument("--skip-peer", action="store_true", help="pyro_bnn only")
    parser.add_argument("--skip-ours", action="store_true",
                        help="marglik: laplace-torch only (same initial net and schedule as a full run)")
    parser.add_argument("--map-epochs", type=int, default=2, help="plain MAP epochs timed for the ratio (0: none)")
    parser.add_argument("--out", default=None, help="append one JSON line per row")
    args = parser.parse_args(argv)
    args.peer_limit = args.peer_limit or None
    if args.skip_ours and (args.skip_peer or args.mode != "marglik"):
        parser.error("--skip-ours needs --mode marglik and no --skip-peer")
    torch.set_num_threads(args.threads)
    if not args.skip_peer:
        import_laplace()
    data = fm.load(args)
    args.num_train = len(data["train"][0]) if args.mode == "marglik" else len(data["train55"][0])
    args.map_epoch = map_epoch_seconds(args, data, args.map_epochs) if args.map_epochs else None
    (mode_marglik if args.mode == "marglik" else mode_posthoc)(args, data)


if __name__ == "__main__":
    sys.exit(main())
