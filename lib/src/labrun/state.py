"""The resumable state of a training run: where it is, what it has seen, and everything to go on.

`TrainingState` owns it all -- progress (epoch, optimizer step, position in the epoch), history,
timers, early stopping, the partial epoch's metric sums and every object run.py registered with
`run.restore(model=..., optimizer=..., ...)` (by its `state_dict()`), so saving and resuming are
one call each. The library assumes nothing of those objects but `state_dict()` /
`load_state_dict()`: any optimizer, a scheduler or None, any number of parameter groups.
A checkpoint written under another precision (a requeue onto another GPU generation) continues
under this run's (load_scaler).
The best weights are in the checkpoint too, not only in best_model.pt (a plain state_dict,
written at every new best): a hard kill after a new best_model.pt but before the next checkpoint
would otherwise resume with the weights of an epoch the checkpoint has not reached. On resume the
checkpoint's copy wins: best_model.pt is rewritten from it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import runs
from .checkpoint import CheckpointError
from .stopping import EarlyStopping


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
        self.loss_sum += loss.detach() * targets.shape[0]
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


class TrainingState:
    """Progress + registered objects + early stopping + sums, checkpointed and restored together.

    `objects`: name -> an object with state_dict()/load_state_dict(), or None (an EMA that is
    off, a run without scheduler): None is recorded, and a checkpoint that disagrees is refused.
    """

    def __init__(self, objects: dict, stopper: EarlyStopping, sums: TrainSums, run) -> None:
        """`run` (session.Run): its device, precision, config hash, torchrun (rank 0 writes,
        with every rank's part), run.log and progress."""
        self.objects, self.stopper, self.sums = objects, stopper, sums
        self.device, self.dtype, self.dist, self.log = run.device, run.amp_dtype, run.dist, run.log
        self.config_hash, self.progress = run.config["config_hash"], run.progress
        self.saved_at = time.monotonic()  # the last save (the start): wall time, checkpoint()

    def precision(self) -> dict:
        """What the checkpoint records of the arithmetic: the autocast dtype and the scaler."""
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}
        scaled = (o for o in self.objects.values() if isinstance(o, torch.amp.GradScaler))
        scaler = any(s.is_enabled() for s in scaled)
        return {"autocast": names.get(self.dtype, str(self.dtype)), "grad_scaler": scaler}

    def state_dict(self) -> dict:
        objects = {k: None if o is None else o.state_dict() for k, o in self.objects.items()}
        return {
            # "trainer": the name distributed.py's gather_state / own_state read the sums from
            "trainer": {**objects, "precision": self.precision(), "sums": self.sums.state_dict()},
            "early_stopping": self.stopper.state_dict(),  # with the best weights (see above)
            "progress": dataclasses.asdict(self.progress),
            "rng": ckpt.rng_state(self.device),
            "config_hash": self.config_hash,
        }

    def save(self, path: Path) -> None:
        """Collective under torchrun: every rank calls it, rank 0 writes."""
        now, p = time.monotonic(), self.progress  # wall time is accumulated across resumes
        p.wall_time_s, self.saved_at = p.wall_time_s + now - self.saved_at, now
        state = self.dist.gather_state(self.state_dict())
        if state is not None:
            ckpt.save(path, state)

    def load_objects(self, saved: dict) -> None:
        """Every registered object from the checkpoint's copy (strict: refused when it differs)."""
        for name, obj in self.objects.items():
            if name not in saved:
                raise CheckpointError(f"the checkpoint holds no {name!r}")
            if (saved[name] is None) != (obj is None):
                raise CheckpointError(f"the checkpoint's {name!r} setting differs from this run's")
            if obj is None:
                continue
            if isinstance(obj, torch.amp.GradScaler):
                load_scaler(obj, saved[name], saved["precision"], self.precision(), self.log)
            elif isinstance(obj, torch.nn.Module):
                ckpt.load_model_state(obj, saved[name], f"the checkpoint's {name}")
            else:
                obj.load_state_dict(saved[name])
        self.sums.load_state_dict(saved["sums"])

    def resume(self, path: Path, best_model: Path) -> bool:
        """Load the checkpoint at `path` if there is one; False if there is none.

        Raises CheckpointError (corrupt, another configuration, another model, anything that
        fails while loading it) with the reason: a checkpoint that cannot be loaded is refused
        in one line, never a traceback. The RNG state is restored last, so nothing after it
        consumes random numbers.
        """
        if not path.exists():
            return False
        state = ckpt.load(path, config_hash=self.config_hash)
        try:
            state = self.dist.own_state(state, path)
            self.load_objects(state["trainer"])
            early = state["early_stopping"]
            if early["best_epoch"] and self.dist.is_main:  # one writer; see the docstring
                ckpt.save_weights(best_model, early["best_state"])
            self.stopper.load_state_dict(early)
            self.progress = Progress(**state["progress"])
            note = ckpt.set_rng_state(state["rng"], self.device)
        except CheckpointError:
            raise
        except Exception as exc:  # whatever torch or this code raises: refused, with the reason
            raise CheckpointError(
                f"{path} does not fit this code or this machine ({type(exc).__name__}: "
                f"{runs.first_line(exc)}); re-run with --fresh to start over"
            ) from exc
        if note:
            self.log.warning(note)
        return True
