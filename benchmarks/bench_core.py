"""Seconds per epoch: plain PyTorch MAP vs plain Pyro (AutoNormal + SVI) vs ``pb.fit`` + MeanField.

Same MLP 784-400-400-10 on the first 5,000 digits of the MNIST test file, same batch size,
one process; epochs of the three are interleaved (a, b, c, a, b, c, ...) so machine noise hits
all of them alike, and medians and ratios are reported.

    python benchmarks/bench_core.py --data-dir ../shared/data/mnist --epochs 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

import pyro_bnn as pb
from pyro_bnn.data import TensorBatches


def mlp(hidden=400):
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


class PlainPyroMLP(PyroModule):
    """How a Pyro user writes it by hand: PyroSample priors, a data plate, SVI."""

    def __init__(self, hidden, num_data):
        super().__init__()
        self.num_data = num_data
        net = mlp(hidden)
        pyro.nn.module.to_pyro_module_(net)
        self.net = net
        for layer in (self.net[0], self.net[2], self.net[4]):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand(layer.bias.shape).to_event(1))

    def forward(self, x, y=None):
        logits = self.net(x)
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data/mnist")
    ap.add_argument("--epochs", type=int, default=5, help="timed epochs per method")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1; 0 leaves torch's default). On a shared 2-core "
                         "machine two threads made small ops in every method far slower")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    split = pb.datasets.mnist_split(args.data_dir, 5000, 5000)
    x, y = split.train
    n = len(x)
    torch.manual_seed(0)
    pyro.set_rng_seed(0)

    # (a) plain PyTorch MAP
    net_a = mlp(args.hidden)
    opt_a = torch.optim.Adam(net_a.parameters(), lr=1e-3)
    batches_a = TensorBatches(x, y, args.batch_size)

    def epoch_a():
        for xb, yb in batches_a:
            loss = F.cross_entropy(net_a(xb), yb)
            opt_a.zero_grad(set_to_none=True)
            loss.backward()
            opt_a.step()

    # (b) plain Pyro: PyroModule + AutoNormal + SVI
    model_b = PlainPyroMLP(args.hidden, n)
    guide_b = AutoNormal(model_b, init_scale=0.01)
    svi = SVI(model_b, guide_b, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    batches_b = TensorBatches(x, y, args.batch_size)

    def epoch_b():
        for xb, yb in batches_b:
            svi.step(xb, yb)

    # (c) pb.fit with MeanField (one epoch per call; guide state carries over)
    model_c = pb.BNN(mlp(args.hidden), likelihood="categorical")
    guide_c = pb.guides.MeanField(model_c)

    def epoch_c():
        pb.fit(model_c, guide_c, (x, y), epochs=1, batch_size=args.batch_size, lr=1e-3, progress=False)

    # (d) the same with local reparameterisation (noise on pre-activations, not weights)
    model_d = pb.BNN(mlp(args.hidden), likelihood="categorical")
    guide_d = pb.guides.MeanField(model_d, local_reparameterization=True)

    def epoch_d():
        pb.fit(model_d, guide_d, (x, y), epochs=1, batch_size=args.batch_size, lr=1e-3, progress=False)

    methods = (("a", epoch_a), ("b", epoch_b), ("c", epoch_c), ("d", epoch_d))
    times = {k: [] for k, _ in methods}
    for _, fn in methods:  # warm-up (also sets up the guides)
        fn()
    for _ in range(args.epochs):
        for key, fn in methods:
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"MNIST {n} train, MLP 784-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, "
          f"torch threads {torch.get_num_threads()}, {args.epochs} timed epochs each (median s/epoch)")
    print(f"  (a) PyTorch MAP              {med['a']:.3f}")
    print(f"  (b) Pyro AutoNormal + SVI    {med['b']:.3f}")
    print(f"  (c) pb.fit + MeanField       {med['c']:.3f}")
    print(f"  (d) pb.fit + MeanField, local reparameterisation {med['d']:.3f}")
    print(f"  ratio (c)/(a) = {med['c'] / med['a']:.2f}   (target <= 1.5)")
    print(f"  ratio (b)/(c) = {med['b'] / med['c']:.2f}   (target >= 2)")
    print(f"  ratio (b)/(a) = {med['b'] / med['a']:.2f}")
    print(f"  ratio (d)/(a) = {med['d'] / med['a']:.2f}   (local reparameterisation)")
    for key, (m, g) in (("c", (model_c, guide_c)), ("d", (model_d, guide_d))):
        acc = pb.evaluate(m, g, *split.test, num_samples=16)["accuracy"]
        print(f"  ({key}) test accuracy after {args.epochs + 1} epochs: {acc:.4f}")
    return med


if __name__ == "__main__":
    main()
