"""The resumable state of a training run: where it is, what it has seen, and everything to go on.

`TrainingState` owns it all -- progress (epoch, optimizer step, position in the epoch), history,
timers, early stopping and the Trainer's own state (model, optimizer, scheduler, GradScaler, EMA,
partial-epoch sums) -- so saving and resuming are one call each. The best weights are in the
checkpoint too, not only in best_model.pt (a plain state_dict, written at every new best): a hard
kill after a new best_model.pt but before the next checkpoint would otherwise resume with the
weights of an epoch the checkpoint has not reached. On resume the checkpoint's copy wins and
best_model.pt is rewritten from it when they differ.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .distributed import Dist
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


class TrainingState:
    """Progress + Trainer + early stopping, checkpointed together and restored together."""

    def __init__(
        self,
        trainer,
        stopper: EarlyStopping,
        *,
        device: torch.device,
        config_hash: str,
        dist: Dist | None = None,
    ) -> None:
        self.trainer, self.stopper, self.device = trainer, stopper, device
        self.config_hash = config_hash
        self.dist = dist or Dist()  # torchrun: rank 0 writes, with every rank's own part
        self.progress = Progress()
        self._clock = time.perf_counter()  # wall time is accumulated across resumes

    def tick(self) -> None:
        """Add the wall time since the last tick (call before saving or reporting)."""
        now = time.perf_counter()
        self.progress.wall_time_s += now - self._clock
        self._clock = now

    def state_dict(self) -> dict:
        early = self.stopper.state_dict()  # with the best weights (see the module docstring)
        return {
            "trainer": self.trainer.state_dict(),
            "early_stopping": early,
            "progress": dataclasses.asdict(self.progress),
            "rng": ckpt.rng_state(self.device),
            "config_hash": self.config_hash,
        }

    def save(self, path: Path) -> None:
        """Collective under torchrun: every rank calls it, rank 0 writes."""
        self.tick()
        state = self.dist.gather_state(self.state_dict())
        if state is not None:
            ckpt.save(path, state)

    def save_best(self, path: Path) -> None:
        if self.dist.is_main:
            ckpt.save_weights(path, self.stopper.best_state)

    @staticmethod
    def _best_model_matches(early: dict, best_model: Path) -> bool:
        try:
            on_disk = ckpt.load_weights(best_model)
        except ckpt.CheckpointError:  # missing or unreadable: rewritten
            return False
        best = early["best_state"]
        return on_disk.keys() == best.keys() and all(torch.equal(on_disk[k], best[k]) for k in best)

    def resume(self, path: Path, best_model: Path, log) -> bool:
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
            self.trainer.load_state_dict(state["trainer"])
            early = state["early_stopping"]
            if early.get("best_state") is None and early["best_epoch"]:  # older checkpoints
                early["best_state"] = ckpt.load_weights(best_model)
            elif (
                early["best_epoch"]
                and self.dist.is_main  # one writer
                and not self._best_model_matches(early, best_model)
            ):
                log.warning(
                    "%s is not the checkpoint's best (epoch %d): a hard kill came between "
                    "the two writes; rewritten from the checkpoint",
                    best_model.name,
                    early["best_epoch"],
                )
                ckpt.save_weights(best_model, early["best_state"])
            self.stopper.load_state_dict(early)
            self.progress = Progress(**state["progress"])
            note = ckpt.set_rng_state(state["rng"], self.device)
        except ckpt.CheckpointError:
            raise
        except Exception as exc:  # whatever torch or this code raises: refused, with the reason
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ckpt.CheckpointError(
                f"{path} does not fit this code or this machine ({type(exc).__name__}: "
                f"{first}); re-run with --fresh to start over"
            ) from exc
        if note:
            log.warning(note)
        return True
