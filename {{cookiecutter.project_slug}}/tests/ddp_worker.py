"""A few Trainer steps on the shards of global batches, for test_distributed.py.

Usage: torchrun --standalone --nproc-per-node N tests/ddp_worker.py OUT GRAD_ACCUM
(or `python tests/ddp_worker.py OUT GRAD_ACCUM`: one process, whole batches). A model without
BatchNorm and an evaluation loader (no augmentation): the only difference N processes may make
is the order of float additions. Rank 0 saves the weights, the reduced epoch sums and the
number of gradient all-reduces DDP ran.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from labrun.data import Split, build_loader
from labrun.distributed import session
from labrun.train import (
    Trainer,
    build_optimizer,
    build_scheduler,
    seed_everything,
)

STEPS, BATCH = 4, 32


def main(out: str, grad_accum: int) -> int:
    cpu = torch.device("cpu")
    with session("cpu") as dist:
        seed_everything(0)
        generator = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (512, 1, 8, 8), dtype=torch.uint8, generator=generator)
        split = Split(images, torch.randint(0, 10, (512,), generator=generator))
        loader = build_loader(
            split, BATCH, train=False, device=cpu, workers=0, seed=0, shard=dist.shard
        )
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        optimizer = build_optimizer(model, 0.01, 0.05, cpu)
        trainer = Trainer(
            model,
            optimizer,
            build_scheduler(optimizer, 0.01, STEPS),
            device=cpu,
            dtype=None,
            grad_accum=grad_accum,
        )
        trainer.ddp = dist.ddp(model)
        reduces: list[int] = []
        if trainer.ddp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counted(state, bucket):
                reduces.append(1)
                return allreduce_hook(state, bucket)

            trainer.ddp.register_comm_hook(None, counted)
        batches = iter(loader)
        for step in range(1, STEPS + 1):
            trainer.step([next(batches) for _ in range(grad_accum)], step)
        sums = trainer.take_sums(dist.sum)
        if dist.is_main:
            torch.save({"weights": model.state_dict(), "sums": sums, "reduces": len(reduces)}, out)
        return dist.finish(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
