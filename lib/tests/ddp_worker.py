"""A few training steps on the shards of global batches, for test_distributed.py.

Usage: torchrun --standalone --nproc-per-node N tests/ddp_worker.py OUT GRAD_ACCUM
(or `python tests/ddp_worker.py OUT GRAD_ACCUM`: one process, whole batches). A model without
BatchNorm and an evaluation loader (no augmentation): the only difference N processes may make
is the order of float additions. The step is run.py's: the mean loss of each micro-batch over
--grad-accum, DDP's no_sync on the non-final micro-steps. Rank 0 saves the weights, the epoch
sums reduced over ranks and the number of gradient all-reduces DDP ran.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

from labrun.data import Split
from labrun.distributed import session
from labrun.loaders import Loader

STEPS, BATCH = 4, 32


def main(out: str, grad_accum: int) -> int:
    cpu = torch.device("cpu")
    with session("cpu") as dist:
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (512, 1, 8, 8), dtype=torch.uint8, generator=generator)
        split = Split(images, torch.randint(0, 10, (512,), generator=generator))
        loader = Loader(
            split, BATCH, train=False, device=cpu, workers=0, seed=0, shard=(dist.rank, dist.world)
        )
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
        net = dist.ddp(model) or model
        reduces: list[int] = []
        if net is not model:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counted(state, bucket):
                reduces.append(1)
                return allreduce_hook(state, bucket)

            net.register_comm_hook(None, counted)
        sums, batches = torch.zeros(3, dtype=torch.float64), iter(loader)
        for _ in range(STEPS):
            micro_batches = [next(batches) for _ in range(grad_accum)]
            for i, (x, y) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with contextlib.nullcontext() if last or net is model else net.no_sync():
                    logits = net(x)
                    loss = F.cross_entropy(logits, y)
                    (loss / grad_accum).backward()
                correct = (logits.argmax(1) == y).sum()
                sums += torch.stack([loss.detach() * len(y), correct, torch.tensor(len(y))])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss_sum, correct, seen = dist.sum(sums).tolist()
        if dist.is_main:
            values = {"loss": loss_sum / seen, "acc": correct / seen}
            torch.save(
                {
                    "weights": model.state_dict(),
                    "sums": (values, int(seen)),
                    "reduces": len(reduces),
                },
                out,
            )
        return dist.finish(0)


if __name__ == "__main__":
    # Leave as run.py's ranks do (labrun.jobs._leave): a rank whose interpreter is still tearing
    # down gloo's threads when torchrun stops the other aborts (SIGABRT, "terminate called
    # without an active exception"), seen under load on 2 cores; its result is written by then.
    from labrun.jobs import _leave

    _leave(main(sys.argv[1], int(sys.argv[2])), hooks=False)
