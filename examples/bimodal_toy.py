"""The bimodal toy of Bayesian hypernetworks: ŷ = a·b·x fitted to y = x + 0.1 ε.

The posterior over (a, b) is two curved ridges along ab ≈ 1 (around a = b = 1 and
a = b = −1).  A full-weight :class:`pyro_bnn.guides.Hypernet` (a flow over both weights)
starts as MeanField's Gaussian and follows the ridge (negative within-mode correlation of
a and b), so its ELBO ends above a converged mean-field guide's.  Whether mass reaches
*both* modes depends on the start, the prior and the objective; the options below
reproduce the experiments in ``docs/results/hypernet.md``.  Both guides train full batch
with a cosine learning-rate decay; the training ELBO over the last epochs is printed as
convergence evidence.

    python examples/bimodal_toy.py --seeds 3
    python examples/bimodal_toy.py --flow realnvp --num-flows 6 --seeds 3
    python examples/bimodal_toy.py --init zero --precision 20 --seeds 3 --no-meanfield
    python examples/bimodal_toy.py --init zero --alpha 0 --particles 16 --seeds 3 --no-meanfield
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro.distributions as dist
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.hypernet_objective import HypernetELBO, log_weights


def toy_data(num_points: int = 64, noise: float = 0.1, seed: int = 0):
    """``x ~ N(0, 1)``, ``y = x + noise·ε``, shapes ``(n, 1)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_points, 1, generator=g)
    return x, x + noise * torch.randn(num_points, 1, generator=g)


def toy_model(init: float = 0.8, precision: float = 1.0, noise: float = 0.1) -> pb.BNN:
    """``f(x) = b·(a·x)`` as two bias-free Linear(1, 1) layers, prior ``N(0, 1/λ)``."""
    net = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        net[0].weight.fill_(init)
        net[1].weight.fill_(init)
    return pb.BNN(net, "gaussian", prior=pb.priors.IIDNormal(precision ** -0.5), noise=noise)


def train(model, guide, x, y, steps: int, lr: float, objective=None) -> str:
    """Full-batch ``pb.fit`` (one step per epoch), cosine decay; returns the convergence
    evidence: mean training ELBO of the last 5 % of steps and its change from the 5 %
    before the last 10 %."""
    res = pb.fit(model, guide, (x, y), epochs=steps, batch_size=len(x), lr=lr,
                 lr_schedule="cosine", objective=objective, progress=False)
    elbo = res.history["elbo"]
    k = max(1, steps // 20)
    end = statistics.mean(elbo[-k:])
    before = statistics.mean(elbo[int(0.9 * steps) - k:int(0.9 * steps)])
    return f"train {end:.2f} ({end - before:+.2f} over last 10 %)"


@torch.no_grad()
def summarise(model, guide, x, y, num_samples: int = 4000) -> dict:
    """ELBO (Monte Carlo), within-mode corr(a, b), share of draws in the a < 0 mode."""
    if isinstance(guide, pb.guides.Hypernet):
        values, log_q = guide.sample_with_log_prob(num_samples)
    else:
        values, log_q = {}, 0.0
        for name in model.site_names:
            loc, scale = guide.loc_and_scale(name)
            w = loc + scale * torch.randn((num_samples,) + loc.shape)
            values[name] = w
            log_q = log_q + dist.Normal(loc, scale).log_prob(w).reshape(num_samples, -1).sum(1)
    elbo = log_weights(model, values, log_q, x, y)[0].mean().item()
    ab = torch.stack([values["net.0.weight"].reshape(-1), values["net.1.weight"].reshape(-1)])
    folded = ab * torch.sign(ab[:1])
    return {"elbo": elbo, "corr": torch.corrcoef(folded)[0, 1].item(),
            "neg_mode": (ab[0] < 0).float().mean().item()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flow", default="iaf", choices=["iaf", "realnvp"])
    p.add_argument("--num-flows", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--layout", default="stable", choices=["stable", "paper"])
    p.add_argument("--precision", type=float, default=1.0, help="prior precision λ")
    p.add_argument("--init", choices=["network", "zero"], default="network",
                   help="start at a = b = 0.8 (one mode) or at 0 (between the modes)")
    p.add_argument("--alpha", type=float, default=1.0, help="Rényi α (1: ELBO, 0: IW bound)")
    p.add_argument("--particles", type=int, default=1)
    p.add_argument("--init-scale", type=float, default=0.1, help="initial σ of both guides")
    p.add_argument("--mf-steps", type=int, default=2000)
    p.add_argument("--mf-lr", type=float, default=0.1)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--no-meanfield", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x, y = toy_data()
    start = 0.8 if args.init == "network" else 0.0
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        model = toy_model(start, args.precision)
        guide = pb.guides.Hypernet(model, flow=args.flow, num_flows=args.num_flows,
                                   hidden=args.hidden, full=True, init_scale=args.init_scale,
                                   layout=args.layout, alpha=args.alpha, seed=seed)
        evidence = train(model, guide, x, y, args.steps, args.lr,
                         HypernetELBO(args.particles, alpha=args.alpha))
        s = summarise(model, guide, x, y)
        line = (f"seed {seed} hypernet({args.flow}, K={args.num_flows}) ELBO {s['elbo']:.2f} "
                f"[{evidence}] corr {s['corr']:+.3f} mass in a<0 mode {s['neg_mode']:.3f}")
        if not args.no_meanfield:
            torch.manual_seed(seed)
            mf = pb.guides.MeanField(model, init_scale=args.init_scale)
            evidence = train(model, mf, x, y, args.mf_steps, args.mf_lr)
            m = summarise(model, mf, x, y)
            line += f" | meanfield ELBO {m['elbo']:.2f} [{evidence}] corr {m['corr']:+.3f}"
        print(line + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
