"""Data-parallel mean-field VI on the digits data with ``torch.distributed``.

Run on one machine with two processes (CPU: Gloo; GPUs: NCCL, one process per GPU)::

    torchrun --standalone --nproc_per_node=2 examples/distributed_digits.py --epochs 20

Several machines (run on each, with its own ``--node_rank``)::

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 \\
        --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 examples/distributed_digits.py

``--batch-size`` is the *global* minibatch: each of the W processes reads ``batch/W``
examples of it, so the result does not depend on W (with ``--seed`` it is the same as
``python examples/distributed_digits.py`` in one process, up to float rounding, when the
training-set size is divisible by W and ``--no-shuffle`` is given).  Only rank 0 prints
and writes the checkpoint.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training import distributed as pbd


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global minibatch size")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", action="store_true")
    parser.add_argument("--checkpoint", default=None, help="written by rank 0 after each epoch")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parser.parse_args(argv)

    distributed = pbd.torchrun_env() is not None       # launched by torchrun?
    data = pb.datasets.digits(seed=0)
    torch.manual_seed(args.seed)                       # same initial network on every rank
    net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model = pb.BNN(net, "categorical")
    guide = pb.guides.MeanField(model, init_scale=1e-3)
    result = pb.fit(model, guide, data.train, epochs=args.epochs, batch_size=args.batch_size,
                    lr=args.lr, seed=args.seed, shuffle=not args.no_shuffle, device=args.device,
                    checkpoint=args.checkpoint, distributed=distributed)
    if pbd.is_main_process():
        scores = pb.evaluate(model, guide, data.x_test, data.y_test, num_samples=32)
        print(f"processes={pbd.get_world_size()} epochs={args.epochs} "
              f"global_batch={args.batch_size} final_loss={result.final_loss:.4f} "
              f"seconds={result.seconds:.1f}")
        print("test " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in scores.items()))
    pbd.leave_process_group()   # every rank waits for rank 0's evaluation, then all leave


if __name__ == "__main__":
    main()
