"""Fashion-MNIST at full scale (issue 26): every guide on the 60,000 training images.

Trains each row on the Fashion-MNIST training images and scores it on the 10,000 test
images: accuracy, NLL, ECE (15 bins), Brier, OOD AUROC of Fashion-MNIST test vs MNIST test
digits by predictive entropy and by mutual information, the ELBO (or log evidence), the
convergence diagnosis (``pb.fit``'s ``FitResult.convergence``; for the plain PyTorch nets the
same :func:`pyro_bnn.training.convergence.diagnose` on their per-epoch loss), seconds per epoch and
its ratio to the MAP row's, and the growth of the process's peak RSS during the row.

Rows (``--rows``, comma separated):

* ``map`` — a plain PyTorch net (same architecture), Adam lr 1e-3, cosine schedule, batch
  64, cross-entropy + L2 with Adam ``weight_decay = 1/N`` (exactly the MAP of an N(0, 1)
  prior on every weight, since the loss is the *mean* cross-entropy); ``--map-wd 0`` for none;
* ``ensemble`` — 5 such nets (seeds seed..seed+4), predictive the average;
* ``meanfield`` — ``pb.guides.MeanField`` with ``pb.fit`` defaults (lr, batch 64, cosine);
  the user sets epochs only (``--prior-scale``, ``--prior-gain``, ``--lr``, ``--kl-weight``,
  ``--init-scale``, ``--loc-lr-scaling``
  change the defaults for the investigation);
* ``laplace_ll`` — a MAP net trained by ``pb.fit`` with ``pb.guides.Laplace`` (N(0,1) prior)
  on 55,000 images, then last-layer KFAC Laplace with δ by the evidence and δ by a grid on
  the 5,000 validation images; GLM predictive with the Monte-Carlo softmax link
  (``predictive="glm"``, ``--num-samples`` draws);
* ``laplace_marglik`` — all-layer KFAC Laplace with online marginal likelihood, layer-wise δ
  (``pb.fit(..., marglik=MARGLIK_SCHEDULE)``), same predictive; side by side with
  laplace-torch: ``benchmarks/fmnist_laplace_torch.py``; ``--lap-validation`` trains it on the
  55,000 and adds δ chosen on the 5,000 validation images (the evidence's δ times one factor,
  and one δ for all layers);
* ``hypernet``, ``symmetrized`` — the registry's guides under ``pb.fit`` defaults
  (``--hn-prior-precision``: fixed g-prior precisions; ``--bound-draws K``: the full-data ELBO
  from K draws, default 4; ``--hn-marglik``: learned by the Laplace
  evidence of the mean network, ``pb.fit(..., marglik=)``);
* ``autonormal`` — Pyro's ``AutoNormal`` under plain ``SVI`` (``Trace_ELBO``, Adam, lr ``--an-lr``, default 1e-3;
  ``--an-schedule cosine``: ``pyro.optim.CosineAnnealingLR`` stepped once per epoch;
  ``--an-full-elbo-every K``: the full-data ELBO every K epochs as well, ``elbo_full_curve``:
  epoch, mean, standard error and median of 5 draws; ``--an-tail-draws K``: K full-data draws at
  the end, ``elbo_tail_draws``, beside ``last_epoch_steps``, the last epoch's per-step estimates:
  mean, median and low quantiles, to see whether rare draws carry the mean).

Architectures (``--arch``): ``mlp`` 784-200-200-10 ReLU; ``cnn`` LeNet-5 style: conv 1→6 5×5,
max-pool 2, conv 6→16 5×5, max-pool 2, fc 256→120→84→10, ReLU; ``bn-cnn`` the BatchNorm CNN of
``benchmarks/batchnorm_draws.py`` (conv 3×3 8 → BatchNorm → ReLU → pool, conv 16 → BatchNorm →
ReLU → pool, fc 784 → 100 → BatchNorm → ReLU → 10; BatchNorm's affine parameters are point
estimates, or random sites in the MeanField and Symmetrized rows with ``--bn-affine random``).  ``--bn-data N``: the sampling predictives re-estimate BatchNorm's statistics under
each draw from N training images (``pb.predict(..., bn_data=)``); the MAP nets predict in eval
mode with their running statistics.

``--subset N`` trains on the first N images of a seeded permutation of the training set
(for the quick controlled experiments); scoring is always on the full 10,000 test images.

Example::

    nice -n 10 .venv/bin/python benchmarks/fashion_mnist.py --rows map --epochs 30 --out map30.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import resource
import statistics
import sys
import time
import warnings

import pyro
import torch
from _common import emit_row, train_map_  # benchmarks/_common.py (on sys.path when run as a script)
from torch import nn

import pyro_bnn as pb
from pyro_bnn.analysis.ood import evaluate_probs
from pyro_bnn.contract.guide import registered_guides
from pyro_bnn.guides.symmetrized import symmetrized_elbo
from pyro_bnn.posterior.prediction import evaluation_mode
from pyro_bnn.training.convergence import LIMITED_MOVE, diagnose
from pyro_bnn.training.convergence_check import objective_draws
from pyro_bnn.training.optimizer import default_optimizer
from pyro_bnn.training.seeding import seeded

ROWS = ("map", "ensemble", "meanfield", "laplace_ll", "laplace_marglik", "hypernet", "symmetrized",
        "autonormal")


def make_net(arch: str, width: int = 200) -> nn.Module:
    """The benchmark network (``mlp`` takes ``(N, 784)``, ``cnn`` ``(N, 1, 28, 28)``).

    ``width`` is the MLP's hidden units per layer (784-width-width-10); the CNN has none.
    """
    if arch == "mlp":
        return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 10))
    if arch == "bn-cnn":
        from batchnorm_draws import make_net as batchnorm_net  # benchmarks/batchnorm_draws.py

        return batchnorm_net("cnn", 28)
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, 10))


def load(args):
    """Train (all or ``--subset``), train-minus-validation, validation, test, and MNIST OOD."""
    flatten = args.arch == "mlp"
    split = pb.datasets.fashion_mnist_split(args.data_root, num_validation=5000, seed=0, flatten=flatten)
    x_all, y_all = pb.datasets.fashion_mnist(args.data_root, "train", flatten=flatten)
    if args.subset:  # the first N of the (already shuffled) 55,000: validation stays held out
        x_all, y_all = split.x_train[:args.subset], split.y_train[:args.subset]
        split = split._replace(x_train=x_all, y_train=y_all)
    x_ood, _ = pb.datasets.mnist(args.mnist_root, "test", flatten=flatten)
    return dict(train=(x_all, y_all), train55=split.train, valid=split.valid, test=split.test, ood=x_ood)


def score(probs_in: torch.Tensor, probs_out: torch.Tensor, y: torch.Tensor) -> dict:
    """Test metrics of ``(S, N, C)`` probabilities, the mean confidence and the OOD AUROCs (entropy, MI)."""
    if probs_in.dim() == 2:
        probs_in, probs_out = probs_in.unsqueeze(0), probs_out.unsqueeze(0)
    row = pb.metrics.classification_metrics(probs_in, y, num_bins=15)
    # mean top-class probability: above the accuracy = overconfident, below = underconfident
    row["mean_confidence"] = float(probs_in.mean(0).max(-1).values.mean())
    labels = torch.cat([torch.zeros(probs_in.shape[1]), torch.ones(probs_out.shape[1])])
    ood = evaluate_probs(torch.cat([probs_in, probs_out], 1), labels)
    row["ood_auroc_entropy"] = ood["entropy"]["auroc"]
    row["ood_auroc_mi"] = ood["mutual_information"]["auroc"] if probs_in.shape[0] > 1 else None
    return row


def convergence_of(diag) -> dict:
    m = diag.measures
    return dict(converged=diag.converged, reasons=[r[:300] for r in diag.reasons],
                objective_gain=m.get("objective_gain"), objective_gain_se=m.get("objective_gain_se"),
                window=m.get("window"))


# ----------------------------------------------------------------------------- plain PyTorch MAP
def train_map_net(arch, x, y, *, epochs, seed, weight_decay, lr=1e-3, batch_size=64, width=200):
    """Adam + cosine schedule, mean cross-entropy; returns net, per-epoch losses and seconds."""
    torch.manual_seed(seed)
    net = make_net(arch, width)
    losses, seconds = train_map_(net, x, y, epochs=epochs, seed=seed, weight_decay=weight_decay, lr=lr,
                                 batch_size=batch_size)
    return net.eval(), losses, seconds  # eval: BatchNorm predicts with its running statistics


def softmax_of(net, x, batch=2000):
    with torch.no_grad():
        return torch.cat([torch.softmax(net(x[i:i + batch]), -1) for i in range(0, len(x), batch)])


def row_map(args, data, *, members=1):
    x, y = data["train"]
    wd = 1.0 / len(x) if args.map_wd is None else args.map_wd
    nets, diags, secs, losses = [], [], [], []
    for k in range(members):
        net, loss, sec = train_map_net(args.arch, x, y, epochs=args.epochs, seed=args.seed + k,
                                       weight_decay=wd, width=args.width)
        nets.append(net)
        losses.append(loss)
        secs += sec
        diags.append(convergence_of(diagnose([-v * len(x) for v in loss], lr_decayed=True)))
        print(f"member {k + 1}/{members}: final loss per point {loss[-1]:.5f}, "
              f"{sum(sec) / len(sec):.1f} s/epoch", file=sys.stderr, flush=True)  # progress of long rows
    p_in = torch.stack([softmax_of(n, data["test"][0]) for n in nets])
    p_out = torch.stack([softmax_of(n, data["ood"]) for n in nets])
    row = score(p_in, p_out, data["test"][1])
    if members > 1:  # each member on its own: member 0 is the `map` row (same seed and recipe)
        row["member_scores"] = [score(p_in[k], p_out[k], data["test"][1]) for k in range(members)]
        row["member_seconds_per_epoch"] = [sum(secs[k * args.epochs:(k + 1) * args.epochs]) / args.epochs
                                           for k in range(members)]
    train_acc = [float((softmax_of(n, x).argmax(-1) == y).float().mean()) for n in nets]
    row.update(weight_decay=wd, members=members, train_accuracy=sum(train_acc) / members,
               final_loss_per_point=[round(l[-1], 5) for l in losses],
               loss_curve=[round(v, 5) for v in losses[0]], seconds_per_epoch=sum(secs) / len(secs) * members,
               convergence=diags if members > 1 else diags[0])
    return row


# ----------------------------------------------------------------------------- pb.fit rows
def bnn(args, prior_scale=1.0, stochastic=None):
    torch.manual_seed(args.seed)
    return pb.BNN(make_net(args.arch, args.width), "categorical", prior=pb.priors.IIDNormal(prior_scale),
                  stochastic=stochastic)


def with_normalization_affine(name, module, param):
    """``stochastic=``: Linear/Conv2d weights and biases and BatchNorm's γ, β random."""
    return isinstance(module, (nn.Linear, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d))


def norm_affine(args):
    """``stochastic=`` of the MeanField and Symmetrized rows: BatchNorm's γ, β random with
    ``--bn-affine random`` (then Symmetrized's groups pass through BatchNorm), else the default."""
    return with_normalization_affine if args.bn_affine == "random" else None


def fit_row(args, model, guide, data_xy, *, num_samples, predictive="sample", **fit_kw):
    x, y = data_xy
    n = len(x)
    num_data = round(n / args.kl_weight) if args.kl_weight != 1.0 else None
    if getattr(args, "adam_eps_per_datum", None) is not None:
        # pb.fit's default optimiser (the guide's rate and groups) with ε = this × N: the Adam step
        # of a mean (per-datum) loss, as plain PyTorch training takes it (pb.fit's is the full-data sum)
        contract = pb.guides.guide_contract(guide)
        lr = fit_kw.pop("lr", None) or contract.learning_rate(num_data or n) or 1e-3
        eps = args.adam_eps_per_datum * (num_data or n)

        def optimizer(params):
            opt = default_optimizer(params, lr, contract.learning_rate_factors())
            for group in opt.param_groups:
                group["eps"] = eps
            return opt
        fit_kw["optimizer"] = optimizer
    if args.checkpoint_dir:  # one file per guide, net, length and seed; a rerun continues it
        name = f"{type(guide).__name__}_{args.arch}_e{args.epochs}_s{args.seed}.pt"
        fit_kw.update(checkpoint=os.path.join(args.checkpoint_dir, name), resume=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pb.fit(model, guide, (x, y), epochs=args.epochs, seed=args.seed, progress=False,
                     num_data=num_data, **fit_kw)
    return res


def predict_pair(args, model, guide, data, *, num_samples, predictive="sample", **kw):
    if predictive == "sample" and args.bn_data:  # BatchNorm statistics re-estimated under each draw
        kw["bn_data"] = data["train"][0][torch.randperm(len(data["train"][0]),
                                                        generator=torch.Generator().manual_seed(0))[:args.bn_data]]
    with seeded(0):
        p_in = pb.predict(model, guide, data["test"][0], num_samples=num_samples, predictive=predictive,
                          batch_size=2000, **kw)
        p_out = pb.predict(model, guide, data["ood"], num_samples=num_samples, predictive=predictive,
                           batch_size=2000, **kw)
    return p_in, p_out


def running_statistics_scores(args, model, guide, data) -> dict:
    """With ``--bn-data``, the same sampling predictive scored with training's running BatchNorm
    statistics instead (``{}`` without ``--bn-data``): both ways of predicting from one fit."""
    if not args.bn_data:
        return {}
    plain = copy.copy(args)
    plain.bn_data = 0
    probs = predict_pair(plain, model, guide, data, num_samples=args.num_samples)
    return {"running_statistics": score(*probs, data["test"][1])}


def full_elbo(model, guide, x, y, objective=None) -> tuple[float, float, float]:
    """Full-data training objective (the ELBO): the mean of 5 draws, its standard error, and the
    median of the draws (the typical value when one draw of the weights wrecks the net).  The
    draws are the library's :func:`~pyro_bnn.training.convergence_check.objective_draws` over all
    of ``x`` in chunks of 10,000 (no gradients; the model in its current mode, buffers put back).
    Far less noisy than an epoch's mean of minibatch estimates (each scaled by N/64)."""
    draws = objective_draws(model, guide, (x, y), num_samples=5, eval_batch_size=10000, objective=objective)
    return statistics.fmean(draws), statistics.stdev(draws) / math.sqrt(len(draws)), statistics.median(draws)


def trace_elbo_loss(model, guide, x, y, num_data):
    """Pyro's ``Trace_ELBO`` loss as an ``estimate_objective`` objective (a guide under plain SVI)."""
    from pyro.infer import Trace_ELBO

    return Trace_ELBO().loss(model, guide, x, y, num_data)


def fit_summary(res) -> dict:
    h = res.history
    loss = h["loss"]
    tenth = max(len(loss) // 10, 1)
    return dict(final_loss=loss[-1], loss_last_tenth=sum(loss[-tenth:]) / tenth,
                loss_previous_tenth=sum(loss[-2 * tenth:-tenth]) / tenth if len(loss) >= 2 * tenth else None,
                loss_curve=[round(v, 1) for v in loss],
                seconds_per_epoch=sum(h["epoch_seconds"]) / len(h["epoch_seconds"]),
                convergence=convergence_of(res.convergence))


def meanfield_prior(args):
    """The MeanField row's prior: ``--prior-gain`` → ``FanInNormal(gain)``, ``--prior-scale`` →
    ``IIDNormal(scale)``, neither → ``None`` (the library's default prior)."""
    if args.prior_gain is not None and args.prior_scale is not None:
        raise ValueError("give --prior-scale or --prior-gain, not both")
    if args.prior_gain is not None:
        return pb.priors.FanInNormal(args.prior_gain)
    return None if args.prior_scale is None else pb.priors.IIDNormal(args.prior_scale)


def row_meanfield(args, data):
    torch.manual_seed(args.seed)
    net, warm = make_net(args.arch, args.width), {}
    if args.warm_start_epochs:  # the means start at a short MAP fit (N(0, 1) prior: weight decay 1/N)
        x, y = data["train"]
        net, loss, sec = train_map_net(args.arch, x, y, epochs=args.warm_start_epochs, seed=args.seed,
                                       weight_decay=1.0 / len(x), width=args.width)
        warm = dict(warm_start_epochs=args.warm_start_epochs, warm_start_loss=[round(v, 5) for v in loss],
                    warm_start_seconds=sum(sec))
        torch.manual_seed(args.seed)
    model = pb.BNN(net, "categorical", prior=meanfield_prior(args), stochastic=norm_affine(args))
    opts = {} if args.init_scale is None else {"init_scale": args.init_scale}
    if args.kl_annealing:
        opts["kl_annealing"] = args.kl_annealing
    if args.learn_prior_scale:
        opts["learn_prior_scale"] = True
    if args.loc_lr_scaling is not None:
        opts["loc_lr_scaling"] = None if args.loc_lr_scaling == "none" else args.loc_lr_scaling
    guide = pb.guides.MeanField(model, **opts)
    fit_kw = {} if args.lr is None else {"lr": args.lr}
    res = fit_row(args, model, guide, data["train"], num_samples=args.num_samples, **fit_kw)
    row = fit_summary(res)
    row["elbo_full_data"], row["elbo_full_data_se"], row["elbo_full_data_median"] = full_elbo(model, guide, *data["train"])
    row.update(score(*predict_pair(args, model, guide, data, num_samples=args.num_samples), data["test"][1]))
    row.update(running_statistics_scores(args, model, guide, data))
    x, y = data["train"]
    p = pb.predict(model, guide, x[:10000], num_samples=16, batch_size=2000)
    row["train_accuracy_first10k"] = pb.metrics.accuracy(p.mean(0), y[:10000])
    with seeded(0):
        pv = pb.predict(model, guide, data["valid"][0], num_samples=args.num_samples, batch_size=2000)
    row["valid"] = pb.metrics.classification_metrics(pv, data["valid"][1], num_bins=15)
    row["valid_held_out"] = bool(args.subset)
    sig = [guide.loc_and_scale(s)[1] for s in model.site_names]
    row["mean_sigma_by_site"] = {s: float(v.detach().mean()) for s, v in zip(model.site_names, sig)}
    row["prior_scale_by_site"] = {s: float(model.site_normal_prior(s)[1]) if model.site_normal_prior(s) else None
                                  for s in model.site_names}
    row.update(prior=repr(model.priors[model.site_names[0].replace(".", "__")]), prior_scale=args.prior_scale,
               prior_gain=args.prior_gain, kl_weight=args.kl_weight, lr=res.lr,
               init_scale=args.init_scale, loc_lr_scaling=guide.loc_lr_scaling,
               kl_annealing=args.kl_annealing, learn_prior_scale=args.learn_prior_scale, **warm)
    return row


def row_registry(args, data, name):
    """``hypernet`` (the registry's guide on a weight-norm BNN: 8 IAF blocks over the scales g,
    directions and biases point estimates) or ``symmetrized`` (on the plain BNN), ``pb.fit``
    defaults; the full-data bound each maximises (Hypernet: the weight-norm model's ELBO;
    Symmetrized: the symmetrised ELBO ``L^G`` and its base q's plain ELBO)."""
    if name == "hypernet":
        torch.manual_seed(args.seed)
        prior = None
        if args.hn_prior_precision:  # one precision per weight-norm layer, in network order
            lams = [float(v) for v in args.hn_prior_precision.split(",")]
            names = pb.BNN(make_net(args.arch, args.width), "categorical", weight_norm=True).site_names
            if len(lams) != len(names):
                raise SystemExit(f"--hn-prior-precision: expected {len(names)} values ({names}), got {lams}")
            prior = {name: pb.priors.IIDNormal(lam ** -0.5) for name, lam in zip(names, lams)}
        torch.manual_seed(args.seed)
        model = pb.BNN(make_net(args.arch, args.width), "categorical", weight_norm=True, prior=prior,
                       random_directions=args.hn_random_directions)
        opts = {} if args.hn_flows is None else {"num_flows": args.hn_flows}
        if args.hn_prior_structure is not None:
            opts["prior_structure"] = args.hn_prior_structure
    else:
        model, opts = bnn(args, stochastic=norm_affine(args)), {}
        if name == "symmetrized" and args.sym_weight_noise:
            opts = {"local_reparameterization": False}
    guide = registered_guides()[name](model, **opts)
    fit_kw = {} if name != "hypernet" or args.hn_lr is None else {"lr": args.hn_lr}
    if name == "symmetrized" and args.sym_lr is not None:
        fit_kw["lr"] = args.sym_lr
    if name == "hypernet" and args.hn_marglik:  # the g prior's precision by the Laplace evidence
        fit_kw["marglik"] = hn_marglik(args.hn_marglik)
    res = fit_row(args, model, guide, data["train"], num_samples=args.num_samples, **fit_kw)
    row = fit_summary(res)
    h = res.history
    row["lr"] = res.lr
    if "marglik" in fit_kw:
        row.update(marglik=dataclasses.asdict(fit_kw["marglik"]), settings=guide.settings_description(),
                   scale_prior_precision_curve=[[round(d, 3) for d in ds] for ds in h["scale_prior_precision"]],
                   mean_network_log_evidence_curve=[round(v, 1) for v in h["mean_network_log_evidence"]],
                   seconds_per_epoch_with_updates=res.seconds / max(args.epochs, 1))
    for key in ("elbo", "symmetrized_elbo", "entropy_gap", "nll", "kl"):
        if key in h:
            row[f"train_{key}_last_epoch"] = h[key][-1]
            row[f"train_{key}_curve"] = [round(v, 1) for v in h[key]]
    with seeded(1):
        if name == "symmetrized":
            terms = symmetrized_elbo(model, guide, data["train"], num_samples=8, batch_size=4000,
                                               return_terms=True)
            row["bound_name"] = "symmetrized ELBO L^G = ELBO + (H(q_G) - H(q)) lower bound, local estimator"
            row["bound_full_data"] = terms["symmetrized_elbo"]
            row["elbo_full_data"] = terms["elbo"]
            row["entropy_gap_full_data"] = terms["entropy_gap"]
            row["log_group_order"] = terms["log_group_order"]
            row["symmetry_groups"] = [sorted(g) for g in guide.symmetry()]
        else:
            draws = objective_draws(model, guide, data["train"], num_samples=args.bound_draws, eval_batch_size=4000)
            elbo = statistics.fmean(draws)
            se = statistics.stdev(draws) / math.sqrt(len(draws)) if len(draws) > 1 else float("nan")
            row["bound_full_data_median"] = statistics.median(draws)
            row["bound_draws"] = tail_summary(draws)
            row["bound_name"] = ("ELBO of the weight-norm model (g, v random; b point estimates)"
                                 if args.hn_random_directions else
                                 "ELBO of the weight-norm model (g random; v, b point estimates)")
            row["bound_full_data"], row["bound_full_data_se"] = elbo, se
            row["elbo_full_data"] = elbo
    row["guide"] = (f"{type(guide).__name__}({guide.extra_repr()})" if name == "hypernet"
                    else f"Symmetrized({guide.settings_description()})")
    if name == "hypernet":
        row["prior_scale_by_site"] = {s: float(model.site_normal_prior(s)[1]) for s in model.site_names}
    row.update(score(*predict_pair(args, model, guide, data, num_samples=args.num_samples), data["test"][1]))
    row.update(running_statistics_scores(args, model, guide, data))
    return row


def hn_marglik(text: str) -> pb.MarglikOptions:
    """``--hn-marglik EVERY,BURNIN,STEPS,LR`` as the options of ``pb.fit(..., marglik=)``."""
    parts = text.split(",")
    if len(parts) != 4:
        raise SystemExit(f"--hn-marglik: expected EVERY,BURNIN,STEPS,LR (e.g. 5,0,100,0.1), got {text!r}")
    return pb.MarglikOptions(every=int(parts[0]), burnin=int(parts[1]), steps=int(parts[2]), lr=float(parts[3]))


def row_laplace_ll(args, data):
    model = bnn(args)
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pb.fit(model, guide, data["train55"], epochs=args.epochs, seed=args.seed, progress=False,
                     batch_size=64, lr=1e-3)
    row = fit_summary(res)
    theta = guide.median()
    with evaluation_mode(model):  # BatchNorm: its running statistics, used and left as they are
        p_in = softmax_of(lambda z: model.run_with(theta, z), data["test"][0]).unsqueeze(0)
        p_out = softmax_of(lambda z: model.run_with(theta, z), data["ood"]).unsqueeze(0)
    row["map_55k"] = score(p_in, p_out, data["test"][1])
    for how in ("evidence", "validation"):
        ll = pb.guides.Laplace(model, "kron", prior_precision=1.0, subset="last_layer",
                               init_loc_fn=lambda site: theta[site["name"]])
        t0 = time.perf_counter()
        ll.fit_curvature(data["train55"])
        if how == "evidence":
            ev = ll.optimize_prior_precision(steps=300, lr=0.1)  # the curvature is fitted above
        else:
            ev = ll.optimize_prior_precision(method="gridsearch", val=data["valid"])
        # predictive="glm" is the Monte-Carlo GLM ("glm-mc(S)"): S = --num-samples draws, not 1
        r = score(*predict_pair(args, model, ll, data, num_samples=args.num_samples, predictive="glm"),
                  data["test"][1])
        r.update(prior_precision=float(ll.prior_precision), log_evidence=float(ll.log_evidence()),
                 tuning_value=_float(ev), predictive=f"glm-mc({args.num_samples})",
                 posthoc_seconds=time.perf_counter() - t0)
        row[f"delta_by_{how}"] = r
    return row


def _float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def row_autonormal(args, data):
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    x, y = data["train"]
    model = bnn(args)
    guide = AutoNormal(model, init_scale=0.01)
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    if args.an_schedule == "cosine":  # Pyro's own scheduler wrapper, stepped once per epoch
        optim = pyro.optim.CosineAnnealingLR({"optimizer": torch.optim.Adam, "optim_args": {"lr": args.an_lr},
                                             "T_max": args.epochs})
    else:
        optim = pyro.optim.Adam({"lr": args.an_lr})
    svi = SVI(model, guide, optim, Trace_ELBO())
    losses, secs, lrs, full_curve = [], [], [], []
    scales0 = None
    for epoch in range(1, args.epochs + 1):
        t0, total, steps = time.perf_counter(), 0.0, []
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            idx = perm[i:i + 64]
            steps.append(svi.step(x[idx], y[idx], len(x)))  # one draw's estimate of the full-data loss
            total += steps[-1] * len(idx) / len(x)
            if scales0 is None:  # AutoNormal's unconstrained scales, right after their creation
                scales0 = {k: v.detach().clone() for k, v in _autonormal_scales(guide).items()}
            lrs.append(args.an_lr if args.an_schedule == "constant" else _current_lr(optim))
        if args.an_schedule == "cosine":
            optim.step()
        losses.append(total)
        secs.append(time.perf_counter() - t0)
        if args.an_full_elbo_every and epoch % args.an_full_elbo_every == 0 and epoch < args.epochs:
            # on streams of its own: the fit draws the same numbers with or without these estimates
            with seeded(args.seed + epoch):
                full_curve.append((epoch, *full_elbo(model, guide, x, y, trace_elbo_loss)))
    # check (b) of pb.fit's diagnosis: the share of scales that moved at Adam's maximum rate
    budget = sum(lrs)
    moved = [(v.detach() - scales0[k]).abs() >= LIMITED_MOVE * budget for k, v in _autonormal_scales(guide).items()]
    share = float(sum(int(m.sum()) for m in moved) / sum(m.numel() for m in moved))
    diag = diagnose([-v for v in losses], lr_decayed=args.an_schedule == "cosine", scale_limited=(share, budget))
    row = dict(lr=args.an_lr, lr_schedule=args.an_schedule, loss_curve=[round(v, 1) for v in losses],
               seconds_per_epoch=sum(secs) / len(secs), convergence=convergence_of(diag),
               bound_name="ELBO (Trace_ELBO over all the training images in chunks of 10,000, 5 draws)",
               last_epoch_elbo=-losses[-1],
               # the constrained σ (AutoNormal's scales are softplus-positive): from the param store
               mean_sigma=float(torch.cat([v.detach().reshape(-1) for k, v in pyro.get_param_store().items()
                                           if ".scales." in k]).mean()))
    row["elbo_full_data"], row["elbo_full_data_se"], row["elbo_full_data_median"] = full_elbo(
        model, guide, x, y, trace_elbo_loss)
    row["bound_full_data"] = row["elbo_full_data"]
    # the last epoch's per-step estimates (one weight draw each, scaled to all N images): their
    # mean is the epoch's training estimate; a mean far above the median is a heavy tail
    row["last_epoch_steps"] = tail_summary([-v for v in steps])
    if args.an_tail_draws:
        with seeded(args.seed + args.epochs + 1):
            row["elbo_tail_draws"] = tail_summary(objective_draws(
                model, guide, (x, y), num_samples=args.an_tail_draws, eval_batch_size=10000,
                objective=trace_elbo_loss))
    # the full-data ELBO along the fit: (epoch, mean, standard error, median), the last at the end
    end = (args.epochs, row["elbo_full_data"], row["elbo_full_data_se"], row["elbo_full_data_median"])
    row["elbo_full_curve"] = [[e, round(m, 1), round(s, 1), round(md, 1)] for e, m, s, md in full_curve + [end]]
    row.update(score(*predict_pair(args, model, guide, data, num_samples=args.num_samples), data["test"][1]))
    return row


def tail_summary(values) -> dict:
    """Mean, standard error, median, 1 % and 10 % quantiles and minimum of estimates of an
    objective to maximise, and the share of the mean's shortfall below the median that its
    lowest 1 % carry (near 1: a few draws that wreck the net make the mean)."""
    v = sorted(float(u) for u in values)
    n, mean, median = len(v), statistics.fmean(v), statistics.median(v)
    low = v[:max(n // 100, 1)]
    shortfall = median - mean
    return dict(n=n, mean=round(mean, 1), se=round(statistics.stdev(v) / math.sqrt(n), 1) if n > 1 else None,
                median=round(median, 1), q01=round(v[int(0.01 * (n - 1))], 1), q10=round(v[int(0.1 * (n - 1))], 1),
                min=round(v[0], 1),
                lowest_1pct_share=round(sum(median - u for u in low) / n / shortfall, 3) if shortfall > 0 else None)


def _autonormal_scales(guide) -> dict:
    """AutoNormal's unconstrained scale parameters (what Adam moves), by site."""
    return {name: p for name, p in guide.named_parameters() if name.startswith("scales.")}


def _current_lr(optim) -> float:
    """The learning rate of a ``pyro.optim`` scheduler's (first) optimiser."""
    return next(iter(optim.optim_objs.values())).optimizer.param_groups[0]["lr"]


def run_row(args, data, name):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if name in ("map", "ensemble"):
        row = row_map(args, data, members=1 if name == "map" else 5)
    elif name == "meanfield":
        row = row_meanfield(args, data)
    elif name == "laplace_ll":
        row = row_laplace_ll(args, data)
    elif name == "autonormal":
        row = row_autonormal(args, data)
    elif name == "laplace_marglik":
        row = row_laplace_marglik(args, data)
    else:
        row = row_registry(args, data, name)
    row.update(row=name, arch=args.arch, width=args.width if args.arch == "mlp" else None,
               epochs=args.epochs, seed=args.seed, subset=args.subset or None, bn_data=args.bn_data or None,
               bn_affine=args.bn_affine if args.arch == "bn-cnn" else None,
               num_train=len(data["train"][0]), seconds=time.perf_counter() - t0,
               peak_rss_growth_mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    return row


#: Online-evidence schedule of the ``laplace_marglik`` row (keys of pyro_bnn.marglik.MARGLIK_DEFAULTS):
#: 100 Adam steps (lr 0.1) on log δ after epochs 5, 10, 15, ... — laplace-torch's
#: ``marglik_training(marglik_frequency=5, n_epochs_burnin=5, n_hypersteps=100, lr_hyp=0.1)``.
MARGLIK_SCHEDULE = pb.MarglikOptions(every=5, burnin=0, steps=100, lr=0.1)


def row_laplace_marglik(args, data):
    # subset="unnormalized" covers BatchNorm's γ, β: they must be random sites of the model
    model = bnn(args, stochastic=with_normalization_affine if args.lap_subset == "unnormalized" else None)
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0, prior_structure=args.lap_prior_structure,
                              kron_bias=args.lap_kron_bias, subset=args.lap_subset)
    # --lap-validation: the 5,000 validation images stay out of training (all: the 55,000)
    train = data["train55"] if args.lap_validation and not args.subset else data["train"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pb.fit(model, guide, train, epochs=args.epochs, seed=args.seed, progress=False,
                     batch_size=64, lr=1e-3, marglik=MARGLIK_SCHEDULE)
    row = fit_summary(res)
    row.update(score(*predict_pair(args, model, guide, data, num_samples=args.num_samples, predictive="glm"),
                     data["test"][1]))
    row.update(prior_precision=guide.prior_precision.tolist(),   # per layer, per tensor (sitewise) or one
               log_evidence=float(guide.log_evidence()), best_log_evidence=res.history.get("best_log_evidence", [None])[0],
               log_evidence_curve=[round(v, 1) for v in res.history["log_evidence"] if v == v],
               # the evidence's terms (fit, Occam factor, prior cost) at the kept state and per update
               evidence_terms={k: round(float(v), 1) for k, v in guide.evidence_terms().items()},
               evidence_terms_curve={k: [round(v, 1) for v in res.history[f"evidence_{k}"]]
                                     for k in ("log_likelihood", "log_det_ratio", "scatter")},
               marglik=dataclasses.asdict(MARGLIK_SCHEDULE), predictive=f"glm-mc({args.num_samples})",
               prior_structure=args.lap_prior_structure, kron_bias=args.lap_kron_bias,
               lap_subset=args.lap_subset, num_train_fit=len(train[0]))
    if args.lap_validation:
        row["delta_by_validation"] = delta_by_validation(args, model, guide, data)
    return row


#: ``--lap-validation``'s factors on the evidence's δ (log-spaced, 0.1 to 100)
VALIDATION_FACTORS = torch.logspace(-1, 2, 16, dtype=torch.float64)


def delta_by_validation(args, model, guide, data) -> dict:
    """Post-hoc δ chosen by the GLM predictive's NLL on the 5,000 validation images (never the
    test images), on the online fit's MAP and curvature: ``"factor"`` — the evidence's δ times
    one factor from :data:`VALIDATION_FACTORS` (keeps the evidence's ratios between layers);
    ``"scalar"`` — one δ for every layer (the guide's default grid).  Each is scored on the test
    and OOD images; the evidence's δ is put back afterwards."""
    delta = guide.prior_precision.detach().clone()
    grids = {"factor": [delta.double() * c for c in VALIDATION_FACTORS], "scalar": None}
    out = {}
    for how, grid in grids.items():
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            valid_nll = guide.optimize_prior_precision(method="gridsearch", val=data["valid"], grid=grid)
        r = score(*predict_pair(args, model, guide, data, num_samples=args.num_samples, predictive="glm"),
                  data["test"][1])
        losses = guide.gridsearch_losses[1]
        r.update(prior_precision=guide.prior_precision.tolist(), valid_nll=valid_nll,
                 log_evidence=float(guide.log_evidence()), grid_valid_nll=[round(float(v), 4) for v in losses],
                 seconds=time.perf_counter() - t0,
                 at_grid_edge=int(losses.argmin()) in (0, len(losses) - 1))  # the grid may be too narrow
        if how == "factor":
            r["factor"] = float((guide.prior_precision.detach() / delta).mean())
        out[how] = r
    with torch.no_grad():
        guide.log_prior_precision.copy_(delta.log())
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["mlp", "cnn", "bn-cnn"], default="mlp")
    parser.add_argument("--width", type=int, default=200, help="MLP hidden units per layer (784-W-W-10)")
    parser.add_argument("--rows", default="map", help=f"comma separated, from {', '.join(ROWS)}")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--check-length", action="store_true", help="also run each row at 2x epochs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--subset", type=int, default=0, help="train on this many images (0: all)")
    parser.add_argument("--data-root", default=None, help="Fashion-MNIST folder (default: Debian's)")
    parser.add_argument("--mnist-root", default="/work/shared/data/mnist", help="MNIST IDX folder (OOD set)")
    parser.add_argument("--num-samples", type=int, default=100, help="posterior draws for predictions")
    parser.add_argument("--bn-data", type=int, default=0,
                        help="bn-cnn: BatchNorm statistics per draw from this many training images (0: off)")
    parser.add_argument("--bn-affine", choices=["point", "random"], default="point",
                        help="bn-cnn, MeanField and Symmetrized rows: BatchNorm's γ, β point estimates (pb.BNN's "
                             "default) or random sites with the weights' prior (Symmetrized then permutes them "
                             "with the channels)")
    parser.add_argument("--map-wd", type=float, default=None, help="MAP weight decay (default 1/N)")
    parser.add_argument("--prior-scale", type=float, default=None,
                        help="MeanField IIDNormal prior scale (default: the library's default prior)")
    parser.add_argument("--prior-gain", type=float, default=None, help="MeanField FanInNormal(gain) prior")
    parser.add_argument("--loc-lr-scaling", choices=["fan_in", "none"], default=None,
                        help="MeanField loc_lr_scaling (default: the guide's)")
    parser.add_argument("--lr", type=float, default=None, help="MeanField lr (default: the guide's)")
    parser.add_argument("--init-scale", type=float, default=None, help="MeanField init_scale")
    parser.add_argument("--sym-lr", type=float, default=None, help="Symmetrized lr (default: the guide's)")
    parser.add_argument("--sym-weight-noise", action="store_true",
                        help="Symmetrized with weight noise (default: local reparameterisation, the gap on its own draw)")
    parser.add_argument("--kl-weight", type=float, default=1.0,
                        help="MeanField KL weight β (num_data = N/β: the likelihood is upweighted)")
    parser.add_argument("--warm-start-epochs", type=int, default=0,
                        help="MeanField: start the means at a MAP net trained this many epochs (0: off)")
    parser.add_argument("--kl-annealing", type=int, default=0,
                        help="MeanField kl_annealing (KL weight epoch/E over the first E epochs; 0: off)")
    parser.add_argument("--learn-prior-scale", action="store_true",
                        help="MeanField(learn_prior_scale=True): per-site prior scales by empirical Bayes")
    parser.add_argument("--hn-random-directions", action="store_true",
                        help="Hypernet on pb.BNN(..., random_directions=True): the directions v random with "
                             "an N(0, I) prior (a mean-field Gaussian in the guide), not point estimates")
    parser.add_argument("--hn-prior-precision", default=None,
                        help="Hypernet: comma-separated prior precision of the scales g, one per layer "
                             "(default: N(0, 1) for every layer)")
    parser.add_argument("--hn-marglik", default=None,
                        help="Hypernet: learn each layer's g-prior precision by the KFAC Laplace evidence of "
                             "the mean network, pb.fit(marglik=MarglikOptions(EVERY, BURNIN, STEPS, LR)), "
                             "e.g. 5,0,100,0.1 (the starting prior: --hn-prior-precision or N(0, 1))")
    parser.add_argument("--hn-prior-structure", choices=["layerwise", "scalar"], default=None,
                        help="Hypernet prior_structure with --hn-marglik: one δ for all layers (the guide's "
                             "default since 2026-12-03) or one per layer")
    parser.add_argument("--lap-prior-structure", choices=["layerwise", "scalar", "sitewise"], default="layerwise",
                        help="laplace_marglik: one δ per layer (Immer et al. 2021, the default), one δ for "
                             "the whole net, or one per weight and bias tensor (laplace-torch's 'layerwise')")
    parser.add_argument("--lap-kron-bias", choices=["joint", "separate"], default="joint",
                        help="laplace_marglik: a layer's bias in its weights' Kronecker block or its own "
                             "(laplace-torch's layout)")
    parser.add_argument("--lap-subset", choices=["all", "last_layer", "unnormalized"], default="all",
                        help="laplace_marglik: the Laplace over every layer (Immer et al. 2021), the last "
                             "(the body a point estimate with its fixed prior), or (bn-cnn) BatchNorm's "
                             "γ, β and the layers that feed no BatchNorm (the weights before BatchNorm "
                             "point estimates)")
    parser.add_argument("--lap-validation", action="store_true",
                        help="laplace_marglik: train on the 55,000 (not all 60,000) and add δ chosen on the "
                             "5,000 validation images: the evidence's δ times one factor, and one δ for all")
    parser.add_argument("--hn-lr", type=float, default=None, help="Hypernet lr (default: the guide's 1e-2)")
    parser.add_argument("--hn-flows", type=int, default=None, help="Hypernet IAF blocks (default the registry's 8)")
    parser.add_argument("--an-lr", type=float, default=1e-3, help="AutoNormal's Adam lr (plain SVI)")
    parser.add_argument("--an-full-elbo-every", type=int, default=0,
                        help="AutoNormal: also estimate the full-data ELBO every this many epochs (0: only at the end)")
    parser.add_argument("--bound-draws", type=int, default=4,
                        help="hypernet row: full-data ELBO draws (mean, standard error, median, quantiles)")
    parser.add_argument("--an-tail-draws", type=int, default=0,
                        help="autonormal: this many full-data ELBO draws at the end (elbo_tail_draws: mean, "
                             "median, quantiles: is the ELBO heavy-tailed over draws?)")
    parser.add_argument("--an-schedule", choices=["constant", "cosine"], default="constant",
                        help="AutoNormal's lr schedule: constant, or pyro.optim.CosineAnnealingLR stepped per epoch")
    parser.add_argument("--adam-eps-per-datum", type=float, default=None,
                        help="pb.fit rows: Adam eps = this x N (1e-8: a mean-loss Adam step)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="the pb.fit rows (meanfield, hypernet, symmetrized) checkpoint every epoch into "
                             "this existing folder and continue from it when rerun with the same arguments "
                             "(one folder per command: a different run there is refused)")
    parser.add_argument("--out", default=None, help="append one JSON line per row to this file")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        parser.error(f"unknown rows {bad}; expected some of {', '.join(ROWS)}")
    if args.arch != "mlp" and args.width != 200:
        parser.error(f"--width sets the MLP's hidden units; the {args.arch} has none (got --width {args.width})")
    if args.lap_subset == "unnormalized" and args.arch != "bn-cnn":
        parser.error(f"--lap-subset unnormalized needs normalisation layers; the {args.arch} has none")
    if args.bn_affine == "random" and args.arch != "bn-cnn":
        parser.error(f"--bn-affine random makes BatchNorm's γ, β random; the {args.arch} has no BatchNorm")
    if args.bn_data and args.arch != "bn-cnn":
        parser.error(f"--bn-data re-estimates BatchNorm statistics; the {args.arch} has no BatchNorm")
    if args.checkpoint_dir and not os.path.isdir(args.checkpoint_dir):
        parser.error(f"--checkpoint-dir must be an existing folder; got {args.checkpoint_dir!r}")
    torch.set_num_threads(args.threads)
    data = load(args)
    lengths = [args.epochs, 2 * args.epochs] if args.check_length else [args.epochs]
    for name in rows:
        for epochs in lengths:
            run_args = copy.copy(args)
            run_args.epochs = epochs
            emit_row(run_row(run_args, data, name), args.out)


if __name__ == "__main__":
    sys.exit(main())
