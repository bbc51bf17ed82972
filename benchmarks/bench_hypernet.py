"""Bayesian hypernetwork benchmarks: accuracy (digits, MNIST 5k/5k) and seconds per epoch.

* ``--task digits``: MLP 64-100-10, MeanField (all weights) vs Hypernet (weight-norm scales,
  IAF), same epochs, batch size and learning rate; test accuracy and NLL.
* ``--task mnist``: weight-norm MLP 784-800-800-10 on MNIST 5k/5k (first 5,000 digits of the
  MNIST test file for training, next 5,000 for testing), Hypernet with 0/4/8 blocks
  (0 = Bayes by Backprop on g).
* ``--task speed``: one epoch of plain PyTorch MAP vs ``pb.fit`` with Hypernet (8 IAF blocks,
  weight-norm; ``--num-flows``, ``--hidden`` lists) on MLP 784-400-400-10, epochs interleaved in
  one process, medians of wall and CPU (``time.process_time``) seconds and ratios.

    python benchmarks/bench_hypernet.py --task digits --epochs 100
    python benchmarks/bench_hypernet.py --task mnist --epochs 10 --data-dir ../shared/data/mnist
    python benchmarks/bench_hypernet.py --task speed --epochs 5 --data-dir ../shared/data/mnist
    python benchmarks/bench_hypernet.py --task speed --threads 1 --fused --hidden 200 64 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import map_epoch, sync  # benchmarks/_common.py (on sys.path when run as a script)
from torch import nn

import pyro_bnn as pb
from pyro_bnn._local_params import local_params
from pyro_bnn.data import TensorBatches
from pyro_bnn.training import setup_guide


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _fit_eval(model, guide, train, test, args, **kw):
    t0 = time.perf_counter()
    pb.fit(model, guide, train, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
           progress=False, seed=args.seed, **kw)
    secs = time.perf_counter() - t0
    m = pb.evaluate(model, guide, *test, num_samples=args.num_samples)
    return m, secs


def task_digits(args):
    d = pb.datasets.digits()
    rows = []
    torch.manual_seed(args.seed)
    net = mlp([64, 100, 10])
    if not args.no_meanfield:
        mf_model = pb.BNN(net, "categorical")
        rows.append(("MeanField (all weights)",)
                    + _fit_eval(mf_model, pb.guides.MeanField(mf_model), d.train, d.test, args))
    rows += _hypernet_rows(net, d.train, d.test, args, " (weight-norm g)")
    print(f"digits 1348/449, MLP 64-100-10, {args.epochs} epochs, batch {args.batch_size}, "
          f"lr {args.lr}, {args.num_samples} predictive samples")
    _table(rows)


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
            model = pb.BNN(net, "categorical", weight_norm=True)
            guide = pb.guides.Hypernet(model, flow=args.flow, num_flows=k, hidden=h)
            rows.append((f"Hypernet {args.flow} K={k} H={h}{suffix}",)
                        + _fit_eval(model, guide, train, test, args, clip_norm=10.0))
    return rows


def _table(rows):
    print(f"  {'guide':40s} {'accuracy':>9s} {'nll':>8s} {'ece':>7s} {'fit s':>8s}")
    for name, m, secs in rows:
        print(f"  {name:40s} {m['accuracy']:9.4f} {m['nll']:8.4f} {m['ece']:7.4f} {secs:8.1f}")


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
    configs = [(k, h) for k in args.num_flows for h in (args.hidden if k else args.hidden[:1])]
    for k, h in configs:
        torch.manual_seed(args.seed)
        model = pb.BNN(mlp(sizes), "categorical", weight_norm=True).to(device)
        guides[k, h] = (model, pb.guides.Hypernet(model, flow="iaf", num_flows=k, hidden=h))

    def epoch_hn(h):
        model, guide = guides[h]
        if not args.loop:
            pb.fit(model, guide, (x, y), epochs=1, batch_size=args.batch_size, progress=False, device=device,
                   optimizer=lambda params: torch.optim.Adam(params, **adam))
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
        name = f"{'loop' if args.loop else 'pb.fit'} + Hypernet ({c[0]} IAF, H={c[1]})"
        print(f"  {name:38s} {n_flow:10,d} {med[c]:8.3f} "
              f"{med_cpu[c]:8.3f} {med[c] / med['map']:10.2f} {med_cpu[c] / med_cpu['map']:9.2f}")
    print("  (ratio target <= 2; params: flow parameters stored)")
    return med, med_cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["digits", "mnist", "speed"], default="digits")
    ap.add_argument("--data-dir", default="../shared/data/mnist")
    ap.add_argument("--epochs", type=int, default=None,
                    help="default: 100 (digits), 10 (mnist), 5 timed epochs (speed)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 64 (digits), 100, 128 (speed)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--flow", default=None, help="iaf (digits, speed) / realnvp couplings (mnist)")
    ap.add_argument("--num-flows", type=int, nargs="+", default=None)
    ap.add_argument("--hidden", type=int, nargs="+", default=[200],
                    help="hidden units of the IAF/coupling conditioners (several: one run each)")
    ap.add_argument("--mlp-width", type=int, default=800, help="MLP hidden width (mnist)")
    ap.add_argument("--no-meanfield", action="store_true", help="skip MeanField (digits)")
    ap.add_argument("--loop", action="store_true",
                    help="speed: Hypernet epochs as a plain loop like MAP's instead of pb.fit")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused", action="store_true", help="fused Adam on both sides (speed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (speed task)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = {"digits": (100, 64, "iaf", [8]), "mnist": (10, 100, "realnvp", [0, 4, 8]),
                "speed": (5, 128, "iaf", [8])}[args.task]
    args.epochs = defaults[0] if args.epochs is None else args.epochs
    args.batch_size = defaults[1] if args.batch_size is None else args.batch_size
    args.flow = defaults[2] if args.flow is None else args.flow
    args.num_flows = defaults[3] if args.num_flows is None else args.num_flows
    {"digits": task_digits, "mnist": task_mnist, "speed": task_speed}[args.task](args)


if __name__ == "__main__":
    main()
