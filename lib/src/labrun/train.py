"""Training pieces that are the same in every project: EMA of the weights, evaluation (device-side
sums, one host read), the LR peak of a schedule, seeding. The step itself is the project's
(run.py); its state is state.py's, the run around it session.py's.

The step never waits for the device (no host sync, whatever the flags; `gpucheck` proves it on
CUDA with `torch.cuda.set_sync_debug_mode("error")`): the loss and the task's metric sums are
added up on the device (state.TrainSums) and read once per epoch; EMA is a foreach lerp over
tensors collected once, its counter a Python int; fp16's GradScaler: fused AdamW takes the inf
check on the device; clipping is foreach.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from .tasks import Task


def lr_peak_step(scheduler) -> float:
    """The optimizer step at which `scheduler`'s LR peaks: early stopping counts only from the
    epoch after it (a run never stops while its LR climbs). OneCycleLR: the end of its warm-up
    (`pct_start` x total steps); any other schedule (or none): 0."""
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        return scheduler._schedule_phases[0]["end_step"] + 1  # OneCycleLR: pct_start x total
    return 0.0


def peak_epoch(peak_step: float, steps_per_epoch: int) -> int:
    """The epoch at whose end the LR has passed its peak."""
    return math.ceil(peak_step / max(steps_per_epoch, 1))


class EMA:
    """Exponential moving average of the weights and float buffers (BatchNorm statistics).

    The first update copies the weights (the random initialisation never enters the average);
    update n >= 1 does `ema = d_n * ema + (1 - d_n) * weight` as one foreach lerp, with the
    warm-up `d_n = min(decay, (1 + n) / (10 + n))` of timm and TensorFlow: without it, 0.999
    keeps 0.999**n of the first weights in the average, 82 % after 200 updates.
    Same arithmetic as `AveragedModel(model, multi_avg_fn=<that lerp>, use_buffers=True)` for
    float tensors (tested). Unlike AveragedModel it keeps its update count as a Python int
    (AveragedModel copies a CPU counter to the device every update: a blocking copy) and copies
    integer buffers instead of averaging them. The count is in `state_dict()`: a resumed run
    continues the warm-up exactly.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        ema = [*self.module.parameters(), *self.module.buffers()]
        pairs = list(zip(ema, [*model.parameters(), *model.buffers()], strict=True))
        # Collected once: the same tensor objects live for the whole run (load_state_dict
        # copies into them in place).
        floats = [(e.detach(), m.detach()) for e, m in pairs if e.is_floating_point()]
        self._float = ([e for e, _ in floats], [m for _, m in floats])
        self._other = [(e, m) for e, m in pairs if not e.is_floating_point()]

    def current_decay(self) -> float:
        """The decay of the next update: 0 (a copy) first, then the warm-up toward `decay`."""
        n = self.updates
        return 0.0 if n == 0 else min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        ema, live = self._float
        decay = self.current_decay()
        if decay == 0.0:
            torch._foreach_copy_(ema, live)
        else:
            torch._foreach_lerp_(ema, live, 1 - decay)
        for e, m in self._other:
            e.copy_(m)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]


def compiler_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "torch.compile could not compile", not "the model is wrong"."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    names = ("InductorError", "OperatorIssue", "CppCompileError", "InvalidCxxCompiler")
    return (
        dynamo_exc.TorchDynamoException,
        *(getattr(inductor_exc, n) for n in names if hasattr(inductor_exc, n)),
    )


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    task: Task,
    loss_fn,
    reduce=None,
) -> dict[str, float]:
    """{loss, metric...} of `task` over a loader, in eval mode; one host sync at the end.
    `loss_fn`: the loss to report (run.py's, given to run.use_loss); `reduce` sums the sums
    over ranks (torchrun: each rank evaluated its shard)."""
    was_training = model.training
    model.eval()
    loss_sum, sums, seen = torch.zeros((), device=device), None, 0
    for x, y in loader:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            outputs = model(x)
        loss_sum += loss_fn(outputs, y) * y.shape[0]
        batch_sums = task.sums(outputs, y)
        sums = batch_sums if sums is None else sums.add_(batch_sums)
        seen += y.shape[0]
    model.train(was_training)
    return finish(task, loss_sum, sums, seen, reduce)[0]  # note: sync point (one per evaluation)


def finish(
    task: Task, loss_sum: torch.Tensor, sums: torch.Tensor | None, seen: int, reduce=None
) -> tuple[dict[str, float], int]:
    """({loss, metric...}, samples) from the device sums: one host read of loss, sums and count
    together, after `reduce` (torchrun: their sum over ranks, one all_reduce)."""
    if sums is None:  # nothing was seen
        return {"loss": float("nan"), **dict.fromkeys(task.metrics, float("nan"))}, 0
    count = torch.full((1,), float(seen), dtype=torch.float64, device=sums.device)
    total = torch.cat([loss_sum.double().reshape(1), sums.double(), count])
    total = (reduce(total) if reduce is not None else total).cpu().numpy()
    seen = int(total[-1])
    metrics = task.finish(total[1:-1], seen)
    values = {k: float(metrics[k]) for k in task.metrics}
    return {"loss": float(total[0] / max(seen, 1)), **values}, seen


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
