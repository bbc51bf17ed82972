"""Bayesian hypernetwork benchmarks: converged ELBO and accuracy (digits, MNIST 5k/5k), seconds per epoch.

* ``--task digits``: MLP 64-100-10.  MeanField over all weights of the ordinary net (its
  defaults: init scale and lr ``default_lr``, or ``--mf-lr``; cosine decay, ``--mf-epochs``)
  vs Hypernet over the weight-norm scales (IAF, ``--num-flows``; 0 = mean-field Gaussian on
  the scales, the like-for-like ELBO baseline; lr ``--lr``, default the guide's
  ``default_lr``, cosine, ``--epochs``).  Per guide: final full-data ELBO (mean of
  ``--elbo-draws`` estimates), the training ELBO's change over the last 10 % of epochs and
  ``pb.fit``'s convergence diagnosis, test accuracy, NLL, ECE, seconds.  ``--seeds`` runs
  several seeds.  The two ELBOs bound different models' evidence (the weight-norm model's
  directions and biases are point estimates): compare Hypernet with MeanField on test
  accuracy/NLL, and with Hypernet K=0 on the ELBO.
* ``--task full``: MLP 64-50-10, the full-weight flow (``Hypernet(full=True)``, ``--flow``
  realnvp by default, ``--num-flows`` 2 blocks of ``--hidden`` 32; lrs ``--full-lrs``) vs
  MeanField on the same ordinary net and prior (an ELBO comparison of one model);
  ``--refine-lrs``: the flow started as the trained MeanField (``init_from``), trained
  ``--refine-epochs`` more at each lr.
* ``--task mnist``: weight-norm MLP 784-800-800-10 on MNIST 5k/5k (first 5,000 digits of the
  MNIST test file for training, next 5,000 for testing), Hypernet with 0/4/8 blocks
  (0 = Bayes by Backprop on g).
* ``--task speed``: one epoch of plain PyTorch MAP vs ``pb.fit`` with Hypernet (8 IAF blocks,
  weight-norm; ``--num-flows``, ``--hidden``, ``--layout`` lists) on MLP 784-400-400-10,
  epochs interleaved in one process, medians of wall and CPU (``time.process_time``)
  seconds and ratios.

    python benchmarks/bench_hypernet.py --task digits --threads 1 --seeds 0 1 2 --json out.json
    python benchmarks/bench_hypernet.py --task full --threads 1 --seeds 0 1
    python benchmarks/bench_hypernet.py --task mnist --epochs 10 --data-dir ../shared/data/mnist
    python benchmarks/bench_hypernet.py --task speed --threads 1 --fused --layout stable paper
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _common import map_epoch, sync  # benchmarks/_common.py (on sys.path when run as a script)
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.data.batches import TensorBatches
from pyro_bnn.reporting.output_files import check_new_file, write_json
from pyro_bnn.training.convergence_check import estimate_objective
from pyro_bnn.training.guide_setup import setup_guide


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _fit_eval(model, guide, train, test, args, epochs=None, lr=None, **kw):
    """Fit, then ``(metrics, seconds, final ELBO, change of the training ELBO over the last
    10 % of epochs in % of |ELBO|, convergence record)``."""
    epochs = args.epochs if epochs is None else epochs
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)  # recorded in the row instead
        res = pb.fit(model, guide, train, epochs=epochs, batch_size=args.batch_size, lr=lr,
                     lr_schedule=args.lr_schedule, progress=False, seed=args.seed, **kw)
    secs = time.perf_counter() - t0
    m = pb.evaluate(model, guide, *test, num_samples=args.num_samples)
    elbo = res.history["elbo"]
    k = max(1, epochs // 10)
    end, before = statistics.mean(elbo[-k:]), statistics.mean(elbo[-2 * k:-k])
    diag = res.convergence
    record = {"epochs": epochs, "lr": lr if lr is not None else pb.guides.guide_contract(guide).default_lr,
              "lr_schedule": args.lr_schedule, "converged": diag.converged, "reasons": diag.reasons,
              "measures": {k: v for k, v in diag.measures.items()
                           if v is None or isinstance(v, (int, float, bool, str))},
              "elbo_history_every_10": elbo[::10] + [elbo[-1]]}
    return (m, secs, estimate_objective(model, guide, train, num_samples=args.elbo_draws,
                                              eval_batch_size=len(train[0]))[0],
            100 * (end - before) / abs(end), record)


def task_digits(args):
    d = pb.datasets.digits()
    out = []
    for seed in args.seeds:
        args.seed = seed
        rows = []
        torch.manual_seed(seed)
        net = mlp([64, 100, 10])
        if not args.no_meanfield:
            mf_model = pb.BNN(net, "categorical", prior=pb.priors.IIDNormal(1.0))
            rows.append((f"MeanField (all weights, {args.mf_epochs} ep)",)
                        + _fit_eval(mf_model, pb.guides.MeanField(mf_model), d.train,
                                    d.test, args, epochs=args.mf_epochs, lr=args.mf_lr))
        if not args.no_hypernet:
            rows += _hypernet_rows(net, d.train, d.test, args, f" g, {args.epochs} ep")
        print(f"digits 1348/449, MLP 64-100-10, seed {seed}, batch {args.batch_size}, "
              f"{args.lr_schedule} lr (MeanField {args.mf_lr or 'default'}, Hypernet {args.lr or 'default'}), "
              f"{args.num_samples} predictive samples, ELBO from {args.elbo_draws} full-data draws")
        _table(rows)
        out += _records(rows, seed)
    return out


def task_full(args):
    """Full-weight flow vs MeanField on one ordinary BNN (64-50-10, N(0, 1) prior)."""
    d = pb.datasets.digits()
    out = []
    for seed in args.seeds:
        args.seed = seed
        rows = []
        torch.manual_seed(seed)
        net = mlp([64, 50, 10])
        if not args.no_meanfield:
            model = pb.BNN(net, "categorical", prior=pb.priors.IIDNormal(1.0))
            meanfield = pb.guides.MeanField(model)
            rows.append((f"MeanField (all weights, {args.mf_epochs} ep)",)
                        + _fit_eval(model, meanfield, d.train, d.test, args,
                                    epochs=args.mf_epochs, lr=args.mf_lr))
            for lr in args.refine_lrs:  # the flow started as the converged MeanField posterior
                guide = pb.guides.Hypernet(model, flow=args.flow, num_flows=args.num_flows[0],
                                           hidden=args.hidden[0], full=True, init_from=meanfield)
                rows.append((f"{args.flow} from MeanField, +{args.refine_epochs} ep lr {lr:g}",)
                            + _fit_eval(model, guide, d.train, d.test, args, epochs=args.refine_epochs, lr=lr))
        for lr in args.full_lrs:
            for k in args.num_flows:
                model = pb.BNN(net, "categorical", prior=pb.priors.IIDNormal(1.0))
                guide = pb.guides.Hypernet(model, flow=args.flow, num_flows=k, hidden=args.hidden[0],
                                           full=True, layout=args.layout[0])
                try:
                    row = _fit_eval(model, guide, d.train, d.test, args, lr=lr)
                except FloatingPointError as err:   # a diverged fit is a result, not a crash
                    print(f"  full-weight {args.flow} K={k} lr {lr:g}: FAILED ({err})")
                    out.append({"seed": seed, "guide": f"full {args.flow} K={k} lr {lr:g}",
                                "failed": str(err)})
                    continue
                rows.append((f"full-weight {args.flow} K={k} H={args.hidden[0]} lr {lr:g}",) + row)
        print(f"digits 1348/449, MLP 64-50-10, N(0, 1) prior, seed {seed}, batch {args.batch_size}, "
              f"{args.lr_schedule} lr, {args.epochs} epochs (MeanField {args.mf_epochs}), "
              f"ELBO from {args.elbo_draws} full-data draws")
        _table(rows)
        out += _records(rows, seed)
    return out


def _records(rows, seed):
    return [{"seed": seed, "guide": name, "elbo": elbo, "elbo_change_last10pct": gain,
             "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "fit_seconds": secs, **rec}
            for name, m, secs, elbo, gain, rec in rows]


def task_mnist(args):
    split = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
    rows = []
    torch.manual_seed(args.seed)
    w = args.mlp_width
    net = mlp([784, w, w, 10])
    rows += _hypernet_rows(net, split.train, split.test, args)
    print(f"MNIST 5k/5k, weight-norm MLP 784-{w}-{w}-10, {args.epochs} epochs, batch "
          f"{args.batch_size}, lr {args.lr}, {args.num_samples} predictive samples")
    _table(rows)


def _hypernet_rows(net, train, test, args, suffix=""):
    """One weight-norm Hypernet per (blocks, hidden width) of ``args``, fitted and scored."""
    rows = []
    for k in args.num_flows:
        for h in args.hidden:
            model = pb.BNN(net, "categorical", weight_norm=True, random_directions=args.random_directions)
            guide = pb.guides.Hypernet(model, flow=args.flow, num_flows=k, hidden=h,
                                       layout=args.layout[0])
            clip = {"clip_norm": 10.0} if args.layout[0] == "paper" else {}
            kind = " random v" if args.random_directions else ""
            rows.append((f"Hypernet{kind} {args.flow} K={k} H={h}{suffix}",)
                        + _fit_eval(model, guide, train, test, args, lr=args.lr, **clip))
    return rows


def _table(rows):
    print(f"  {'guide':44s} {'ELBO':>9s} {'last10%':>8s} {'accuracy':>9s} {'nll':>8s} {'ece':>7s} "
          f"{'fit s':>8s}")
    for name, m, secs, elbo, gain, rec in rows:
        print(f"  {name:44s} {elbo:9.1f} {gain:+7.2f}% {m['accuracy']:9.4f} {m['nll']:8.4f} "
              f"{m['ece']:7.4f} {secs:8.1f}  converged={rec['converged']}")


def task_speed(args):
    try:
        x, y = pb.datasets.mnist_split(args.data_dir, 5000, 5000).train
    except FileNotFoundError:
        print("MNIST not found; timing on random 784-d inputs")
        x, y = torch.rand(5000, 784), torch.randint(0, 10, (5000,))
    device = torch.device(args.device)
    x, y = x.to(device), y.to(device)
    sizes = [784, 400, 400, 10]
    torch.manual_seed(args.seed)
    net_a = mlp(sizes).to(device)
    adam = dict(lr=1e-3, fused=True) if args.fused else dict(lr=1e-3)
    opt_a = torch.optim.Adam(net_a.parameters(), **adam)
    batches = TensorBatches(x, y, args.batch_size)

    def epoch_map():
        map_epoch(net_a, opt_a, batches)

    guides = {}
    configs = [(k, h, layout) for layout in args.layout for k in args.num_flows
               for h in (args.hidden if k else args.hidden[:1])]
    for k, h, layout in configs:
        torch.manual_seed(args.seed)
        model = pb.BNN(mlp(sizes), "categorical", weight_norm=True).to(device)
        guides[k, h, layout] = (model, pb.guides.Hypernet(model, flow="iaf", num_flows=k, hidden=h,
                                                          layout=layout))

    def epoch_hn(h):
        model, guide = guides[h]
        if not args.loop:
            with warnings.catch_warnings():  # one timed epoch: no convergence to judge
                warnings.simplefilter("ignore", pb.ConvergenceWarning)
                pb.fit(model, guide, (x, y), epochs=1, batch_size=args.batch_size, progress=False,
                       device=device, optimizer=lambda params: torch.optim.Adam(params, **adam))
            return
        # --loop: the same steps as MAP's loop (no pb.fit setup, snapshot or checks)
        if h not in loops:
            setup_guide(model, guide, x[:2], y[:2], len(x))
            with local_params(model, guide):
                params = list(model.parameters()) + list(guide.parameters())
            loops[h] = (guide.make_objective(1), torch.optim.Adam(params, **adam))
        objective, opt = loops[h]
        with local_params(model, guide):
            for xb, yb in batches:
                loss, _ = objective(model, guide, xb, yb, len(x))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    loops = {}

    runs = [("map", epoch_map)] + [(c, lambda c=c: epoch_hn(c)) for c in configs]
    wall = {k: [] for k, _ in runs}
    cpu = {k: [] for k, _ in runs}
    for _, fn in runs:  # warm-up (sets up the guides)
        fn()
    for _ in range(args.epochs):
        for key, fn in runs:
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"MNIST 5,000 train, MLP 784-400-400-10, batch {args.batch_size}, {device}, torch threads "
          f"{torch.get_num_threads()}, Adam{' (fused)' if args.fused else ''}, {args.epochs} "
          "interleaved epochs (median s/epoch, wall and CPU time)")
    n_net = sum(p.numel() for p in net_a.parameters())
    print(f"  network parameters {n_net:,}")
    print(f"  {'':38s} {'params':>10s} {'wall s':>8s} {'cpu s':>8s} {'ratio wall':>10s} "
          f"{'ratio cpu':>9s}")
    print(f"  {'PyTorch MAP':38s} {n_net:10,d} {med['map']:8.3f} {med_cpu['map']:8.3f}")
    for c in configs:
        n_flow = sum(p.numel() for p in guides[c][1].parameters())
        name = f"{'loop' if args.loop else 'pb.fit'} + Hypernet ({c[0]} IAF, H={c[1]}, {c[2]})"
        print(f"  {name:38s} {n_flow:10,d} {med[c]:8.3f} "
              f"{med_cpu[c]:8.3f} {med[c] / med['map']:10.2f} {med_cpu[c] / med_cpu['map']:9.2f}")
    print("  (ratio target <= 2; params: flow parameters stored)")
    return med, med_cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["digits", "full", "mnist", "speed"], default="digits")
    ap.add_argument("--data-dir", default="../shared/data/mnist")
    ap.add_argument("--epochs", type=int, default=None,
                    help="default: 300 (digits), 10 (mnist), 5 timed epochs (speed)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 64 (digits), 100, 128 (speed)")
    ap.add_argument("--lr", type=float, default=None,
                    help="Hypernet learning rate (default: the guide's default_lr)")
    ap.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"])
    ap.add_argument("--layout", nargs="+", default=["stable"], choices=["stable", "paper"],
                    help="Hypernet layout(s); speed: several are timed side by side")
    ap.add_argument("--mf-lr", type=float, default=None,
                    help="MeanField learning rate (digits, full; default its default_lr)")
    ap.add_argument("--mf-epochs", type=int, default=None, help="MeanField epochs (default --epochs)")
    ap.add_argument("--full-lrs", type=float, nargs="*", default=[None],
                    help="full task: learning rates of the full-weight flow (default its default_lr)")
    ap.add_argument("--refine-lrs", type=float, nargs="*", default=[],
                    help="full: also train a flow started as the trained MeanField (init_from) at these lrs")
    ap.add_argument("--refine-epochs", type=int, default=100, help="full: epochs of each --refine-lrs fit")
    ap.add_argument("--elbo-draws", type=int, default=64)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="digits: one run per seed")
    ap.add_argument("--flow", default=None, help="iaf (digits, speed) / realnvp couplings (mnist)")
    ap.add_argument("--num-flows", type=int, nargs="+", default=None)
    ap.add_argument("--hidden", type=int, nargs="+", default=None,
                    help="hidden units of the IAF/coupling conditioners (several: one run each)")
    ap.add_argument("--mlp-width", type=int, default=800, help="MLP hidden width (mnist)")
    ap.add_argument("--no-meanfield", action="store_true", help="skip MeanField (digits, full)")
    ap.add_argument("--no-hypernet", action="store_true", help="skip the Hypernet rows (digits)")
    ap.add_argument("--random-directions", action="store_true",
                    help="Hypernet rows on pb.BNN(..., random_directions=True): directions under the posterior")
    ap.add_argument("--json", default=None, help="digits, full: write every row (with convergence) here")
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    ap.add_argument("--loop", action="store_true",
                    help="speed: Hypernet epochs as a plain loop like MAP's instead of pb.fit")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused", action="store_true", help="fused Adam on both sides (speed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (speed task)")
    args = ap.parse_args(argv)
    if args.json and args.task in ("digits", "full"):   # before any training
        check_new_file(args.json, overwrite=args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = {"digits": (300, 64, "iaf", [0, 8], [200]), "full": (300, 64, "realnvp", [2], [32]),
                "mnist": (10, 100, "realnvp", [0, 4, 8], [200]), "speed": (5, 128, "iaf", [8], [200])}[args.task]
    args.epochs = defaults[0] if args.epochs is None else args.epochs
    args.mf_epochs = args.epochs if args.mf_epochs is None else args.mf_epochs
    args.batch_size = defaults[1] if args.batch_size is None else args.batch_size
    args.flow = defaults[2] if args.flow is None else args.flow
    args.num_flows = defaults[3] if args.num_flows is None else args.num_flows
    args.hidden = defaults[4] if args.hidden is None else args.hidden
    rows = {"digits": task_digits, "full": task_full, "mnist": task_mnist, "speed": task_speed}[args.task](args)
    if args.json and args.task in ("digits", "full"):
        write_json(args.json, {"args": vars(args), "rows": rows}, indent=1, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
