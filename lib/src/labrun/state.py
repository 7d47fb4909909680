"""The resumable state of a training run: where it is, what it has seen, and everything to go on.

checkpoint.pt (session.Run.state_dict, Run._resume) holds it all -- progress (epoch, optimizer
step, position in the epoch), history, timers, early stopping, the partial epoch's metric sums
(TrainSums) and every object run.py registered with `run.restore(model=..., optimizer=..., ...)`
(by its `state_dict()`), so saving and resuming are one call each. The library assumes nothing
of those objects but `state_dict()` / `load_state_dict()`: any optimizer, a scheduler or None,
any number of parameter groups.
A checkpoint written under another precision (a requeue onto another GPU generation) continues
under this run's (load_scaler).
The best weights are in the checkpoint too, not only in best_model.pt (a plain state_dict,
written at every new best): a hard kill after a new best_model.pt but before the next checkpoint
would otherwise resume with the weights of an epoch the checkpoint has not reached. On resume the
checkpoint's copy wins: best_model.pt is rewritten from it.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Progress:
    epoch: int = 0  # epochs completed
    batch: int = 0  # micro-batches done in the current epoch
    step: int = 0  # optimizer steps done
    history: list[dict] = dataclasses.field(default_factory=list)
    wall_time_s: float = 0.0
    train_time_s: float = 0.0
    epoch_time_s: float = 0.0  # training time of the current epoch so far, across resumes
    compile_time_s: float = 0.0
    samples: int = 0


class TrainSums:
    """The epoch's training loss and the task's metric sums, accumulated on the device (no host
    sync in the step); read once per epoch by `take()`."""

    def __init__(self, task, device: torch.device) -> None:
        self.task, self.device = task, device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.sums: torch.Tensor | None = None  # the task's sums; their length comes with a batch
        self.seen = 0

    def add(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one micro-batch: `loss` its mean loss, `outputs` the model's outputs."""
        self.loss_sum.add_(loss.detach(), alpha=targets.shape[0])  # one kernel, not two
        sums = self.task.sums(outputs.detach(), targets)
        # A copy first: a CUDA-graph (max-autotune) output is overwritten by the next replay.
        self.sums = sums.clone() if self.sums is None else self.sums.add_(sums)
        self.seen += targets.shape[0]

    def take(self, reduce=None) -> tuple[dict[str, float], int]:
        """({loss, metric...}, samples) since the last reset; `reduce` sums over ranks.
        # note: sync point (one per epoch)"""
        from .train import finish

        return finish(self.task, self.loss_sum, self.sums, self.seen, reduce)

    def state_dict(self) -> dict:
        return {"loss_sum": self.loss_sum, "sums": self.sums, "seen": self.seen}

    def load_state_dict(self, sums: dict) -> None:
        self.loss_sum = sums["loss_sum"].to(self.device, torch.float32)
        if "correct" in sums:  # written before tasks: the classification count
            sums["sums"] = sums["correct"].reshape(1)
        self.sums = None if sums["sums"] is None else sums["sums"].to(self.device, torch.float64)
        self.seen = sums["seen"]


def load_scaler(scaler, saved: dict, then: dict, now: dict, log) -> None:
    """Continue under this run's precision, whatever the checkpoint's (a requeue may land on a GPU
    without bf16, or with it): the GradScaler's state is taken over when both use one, dropped
    when this run needs none, and started afresh when only this run needs one (its first steps
    then find the scale again). run.log says which."""
    if then["autocast"] != now["autocast"]:
        log.warning(
            f"precision: the checkpoint was written under {then['autocast']}, this run "
            f"continues under {now['autocast']}"
        )
    if then["grad_scaler"] and now["grad_scaler"]:
        scaler.load_state_dict(saved)
    elif then["grad_scaler"]:
        log.warning("precision: the checkpoint's GradScaler state is dropped (not needed)")
    elif now["grad_scaler"]:
        log.warning(f"precision: a new GradScaler starts at scale {scaler.get_scale():g}")
