"""Per-example weight noise on a CNN: Flipout (MeanField's estimator since the thirtieth session)
against the local reparameterisation it replaced on convolutions, and against plain weight noise.

Local reparameterisation samples each output of a convolution independently, although the
outputs of one image at different positions share one weight draw; its "ELBO" is then not the
ELBO.  This script measures how far off it was on the benchmark's nets and data, where the
earlier sessions reported CNN bounds with it:

1. trains ``MeanField`` on the LeNet-style CNN of ``benchmarks/fashion_mnist.py`` for
   ``--epochs`` with the **old** estimator (conv layers: ``out + √(conv(x², σ²)) ε``,
   re-created here by replacing ``add_layer_noise`` for convolutions), as those sessions did;
2. estimates that posterior's negative ELBO on all training images with the old estimator,
   with Flipout, and with weight noise (one weight draw per pass: unbiased by construction),
   ``--passes`` passes each (mean ± standard error, median);
3. trains the same net from the same seed with Flipout (the new default) and reports both fits'
   seconds per epoch, final training objective and test accuracy / NLL (a fixed budget: the
   point is the estimator, not convergence);
4. times one training step of each estimator side by side in this process (``step_times``:
   median CPU milliseconds and their ratio).

Example::

    nice -n 10 .venv/bin/python benchmarks/conv_noise.py --epochs 10 --out conv_noise.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from _common import emit_row  # benchmarks/_common.py (on sys.path when run as a script)
from fashion_mnist import make_net

import pyro_bnn as pb
import pyro_bnn.guides.local_reparam_forward as noise_module
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.meanfield import meanfield_loss
from pyro_bnn.training.convergence_check import objective_draws
from pyro_bnn.training.guide_setup import setup_guide
from pyro_bnn.training.seeding import seeded

_NEW = noise_module.add_layer_noise


def _old_add_layer_noise(out, x, layer, function, params, noise):
    """The estimator before Flipout: independent pre-activation noise on convolutions too."""
    if function is F.linear:
        return _NEW(out, x, layer, function, params, noise)
    _, _, scale_w, scale_b = params
    var = function(x ** 2, scale_w ** 2, None if scale_b is None else scale_b ** 2, layer.stride, layer.padding,
                   layer.dilation, layer.groups)
    return out + var.clamp_min(1e-30).sqrt() * noise(out)


@contextlib.contextmanager
def estimator(name: str):
    """``"old"``: the replaced estimator for the duration; ``"flipout"``: the library's own."""
    if name == "old":
        noise_module.add_layer_noise = _old_add_layer_noise
    try:
        yield
    finally:
        noise_module.add_layer_noise = _NEW


def train(args, data, name):
    x, y = data["train"]
    torch.manual_seed(args.seed)
    model = pb.BNN(make_net("cnn"), "categorical")
    guide = pb.guides.MeanField(model)
    with estimator(name), warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        res = pb.fit(model, guide, (x, y), epochs=args.epochs, lr=args.lr, seed=args.seed, progress=False)
    return model, guide, res


def negative_elbo(model, guide, x, y, name, passes, seed):
    setting = guide.local_reparameterization_setting
    guide.local_reparameterization_setting = False if name == "weight noise" else setting
    try:
        with estimator("old" if name == "old" else "flipout"), seeded(seed):
            draws = [-v for v in objective_draws(model, guide, (x, y), num_samples=passes, eval_batch_size=10000)]
    finally:
        guide.local_reparameterization_setting = setting
    return dict(mean=round(statistics.fmean(draws), 1),
                se=round(statistics.stdev(draws) / len(draws) ** 0.5, 1), median=round(statistics.median(draws), 1))


def test_scores(model, guide, data, num_samples):
    x, y = data["test"]
    probs = pb.predict(model, guide, x, num_samples=num_samples).mean(0)
    return dict(accuracy=round(float((probs.argmax(-1) == y).float().mean()), 4),
                nll=round(float(-probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean()), 4))


def step_times(arch: str = "cnn", repeats: int = 7, steps: int = 50, seed: int = 0) -> dict:
    """Milliseconds of process CPU time per training step (objective and gradients, batch 64) of
    each estimator, blocks of ``steps`` interleaved ``repeats`` times in this process; medians and
    the ratio Flipout / old."""
    torch.manual_seed(seed)
    model = pb.BNN(make_net(arch), "categorical")
    guide = pb.guides.MeanField(model)
    x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    setup_guide(model, guide, x[:2], y[:2], 60000)
    params = list(guide.parameters())
    times = {"old": [], "flipout": []}
    with local_params(model, guide):
        for _ in range(repeats):
            for name in times:
                with estimator(name):
                    t0 = time.process_time()
                    for _ in range(steps):
                        torch.autograd.grad(meanfield_loss(model, guide, x, y, 60000), params)
                    times[name].append(1000 * (time.process_time() - t0) / steps)
    medians = {name: statistics.median(v) for name, v in times.items()}
    return dict(ms_per_step={k: round(v, 2) for k, v in medians.items()},
                ratio_flipout_to_old=round(medians["flipout"] / medians["old"], 3))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01, help="the main job's CNN lr for MeanField")
    parser.add_argument("--passes", type=int, default=8, help="passes over the training data per estimate")
    parser.add_argument("--num-samples", type=int, default=32, help="predictive draws for the test scores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = {split: pb.datasets.fashion_mnist(args.data_root, split, flatten=False) for split in ("train", "test")}
    row = dict(epochs=args.epochs, lr=args.lr, seed=args.seed, passes=args.passes, step_times=step_times())
    for name in ("old", "flipout"):
        t0 = time.perf_counter()
        model, guide, res = train(args, data, name)
        fit = dict(seconds_per_epoch=round(sum(res.history["epoch_seconds"]) / args.epochs, 2),
                   final_training_loss=round(res.history["loss"][-1], 1),
                   seconds=round(time.perf_counter() - t0, 1), **test_scores(model, guide, data, args.num_samples))
        if name == "old":  # the posterior the earlier sessions' estimator trained, judged by all three
            fit["negative_elbo"] = {est: negative_elbo(model, guide, *data["train"], est, args.passes, args.seed + 1)
                                    for est in ("old", "flipout", "weight noise")}
        row[f"trained_{name}"] = fit
    emit_row(row, args.out)


if __name__ == "__main__":
    main()
