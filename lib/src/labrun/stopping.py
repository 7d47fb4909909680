"""When training stops: stop signals, early stopping, a loss that is no longer finite.

Stop signals: whatever arrives, and however often, the job checkpoints once and exits 75.

Who sends what (README, "Stops and resume"): Slurm sends SIGTERM to every process of the job step
on preemption (after the partition's GraceTime), on `scancel` and at the time limit, and SIGUSR1
first when the job was submitted with `--signal=B:USR1@SECONDS`; a terminal's Ctrl-C sends SIGINT
to the whole foreground process group; run.sh forwards SIGTERM. Bursts are normal: two SIGTERMs a
few milliseconds apart (the step's and the wrapper's) are one request to stop, not two. A closed
terminal or a dropped ssh session sends SIGHUP: also a stop (unless the job was started under
`nohup`, which ignores it: then it keeps training, as `nohup` asked).

So the first signal asks the training loop to stop after the current step; later ones are logged
and ignored, except
- a second Ctrl-C (SIGINT) while run.py runs in a terminal: the person asked twice, exit at once;
- any signal more than `LAB_STOP_GRACE_S` seconds (default 120) after the first: writing a
  checkpoint takes far less, so the job is stuck; exit at once.
A process whose main thread waits in C++ (a collective of torchrun whose peer is gone, the
rendezvous, a stuck read) runs no Python handler at all: a watchdog thread sees every signal
through `signal.set_wakeup_fd` and applies the same rules from outside the main thread; a stop
request the main thread has not taken up `LAB_STOP_GRACE_S` seconds after it came (at least
HANDLER_LATENCY_S) means it is blocked: exit at once too.
An exit at once writes status `interrupted` and exits 130; the last checkpoint (end of the previous
epoch, or the one being written, which is atomic) is still there, so re-running resumes.
Handlers are installed in the first lines of run.py's main(), before anything slow, and stay
installed until the process exits: a signal that comes after main() has returned (its checkpoint
written) cannot turn exit 75 (or 0) into death by that signal.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .runs import EXIT_FORCED, RunFailed, seconds_from_env

if TYPE_CHECKING:  # torch is imported after the handlers are installed (it takes ~2 s)
    import torch
    from torch import nn

GRACE_ENV = "LAB_STOP_GRACE_S"
DEFAULT_GRACE_S = 120.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
HANDLER_LATENCY_S = 2.0  # a main thread that runs Python takes up a signal far sooner


class GracefulStop:
    """Context manager: `requested` is None, or the name of the first stop signal received."""

    def __init__(self) -> None:
        self.log = logging.getLogger(__name__)  # the job's run.log once it has one
        # LAB_STOP_GRACE_S: 0 makes a second signal force the exit at once
        self.grace_s = seconds_from_env(GRACE_ENV, DEFAULT_GRACE_S, zero=True)
        self.interactive = False  # a second Ctrl-C exits at once only in a terminal
        with contextlib.suppress(OSError, ValueError):  # closed or replaced (pytest, daemons)
            self.interactive = sys.stdin is not None and sys.stdin.isatty()
        self.requested: str | None = None
        self.on_force_exit: Callable[[], None] | None = None  # e.g. mark the status file
        self.on_request: Callable[[], None] | None = None  # at the first request (claim note)
        # the first stop signal the watchdog saw (0: none yet), when, and how many came since
        self._seen, self._first_at, self._ignored = 0, 0.0, 0

    def _handle(self, signum: int, _frame) -> None:
        """The main thread's handler: the first stop request. Every signal also reaches the
        watchdog (_watch), which sees it while this thread waits in C++ and runs no handler."""
        if self.requested is None:
            self.requested = name = signal.Signals(signum).name
            self.log.warning(
                f"{name} received: finishing the current step, then checkpoint and exit"
            )
            if self.on_request is not None:
                self.on_request()

    def _arrived(self, signum: int) -> None:
        """Every stop signal, in order (from the watchdog thread): a second Ctrl-C in a
        terminal, or any signal later than the grace after the first, exits at once."""
        now = time.monotonic()
        if not self._seen:
            self._seen, self._first_at = signum, now
            return
        name = signal.Signals(signum).name
        late = now - self._first_at > self.grace_s
        if (signum == signal.SIGINT and self.interactive) or late:
            first = signal.Signals(self._seen).name
            why = f"{name} {self.grace_s:.0f}s after {first}" if late else "second Ctrl-C"
            self.force_exit(why)
        self._ignored += 1
        if self._ignored == 1:  # one line, however long the burst
            within = f"signals within {self.grace_s:.0f}s are one request"
            self.log.info(f"{name} received again: already stopping ({within})")

    def force_exit(self, why: str) -> None:
        """Exit 130 now, from any thread: status `interrupted` (on_force_exit), run.log."""
        self.log.warning(f"{why}: exiting now; the last checkpoint is kept")
        if self.on_force_exit is not None:
            with contextlib.suppress(Exception):  # the exit must happen whatever fails here
                self.on_force_exit()
        logging.shutdown()
        os._exit(EXIT_FORCED)

    def __enter__(self) -> GracefulStop:
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: a hang-up is to be ignored, not obeyed
            signal.signal(sig, self._handle)
        _watch(self)
        return self

    def __exit__(self, *exc) -> None:
        """Leaves the handlers installed: between main()'s return and the interpreter's exit
        (joining MLflow's threads, flushing) a stop signal must not kill the process with its
        default action and replace the exit code main() returned (75 after a checkpoint).
        Python's finalization resets Python handlers to the default action, so at exit (atexit)
        the stop signals are ignored instead: nothing is left to stop by then."""
        atexit.unregister(_ignore_stop_signals)
        atexit.register(_ignore_stop_signals)


_watched: list[GracefulStop] = []  # the GracefulStop the watchdog serves: the latest entered


def _watch(stop: GracefulStop) -> None:
    """One watchdog thread per process reads the signal numbers Python's C-level handler writes
    to its wakeup fd: it runs while the main thread is blocked in C++, where no Python handler
    can (a gloo or NCCL collective, the rendezvous). Called from the main thread (as
    signal.signal must be), where set_wakeup_fd works."""
    started = bool(_watched)
    _watched[:] = [stop]
    if not started:
        reader, writer = socket.socketpair()  # both kept open for the life of the process
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=_watchdog, args=(reader, writer), daemon=True).start()


def _watchdog(reader: socket.socket, _writer: socket.socket) -> None:
    while True:
        stop, wait = _watched[0], None
        if stop._seen and stop.requested is None:  # a request the main thread never took up
            limit = max(stop.grace_s, HANDLER_LATENCY_S)
            wait = stop._first_at + limit - time.monotonic()
            if wait <= 0:
                name = signal.Signals(stop._seen).name
                stop.force_exit(f"{name} not taken up in {limit:.0f}s (the process is blocked)")
        if select.select([reader], [], [], wait)[0]:
            for signum in reader.recv(64):
                stop = _watched[0]  # only while its handler is the one installed for signum
                if signal.getsignal(signum) == stop._handle:
                    stop._arrived(signum)


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class NonFiniteLoss(RuntimeError):
    """The training loss became nan/inf: the run fails, its last good checkpoint is kept."""


def check_finite(mean_loss: float, epoch: int, first_step: int, last_step: int) -> None:
    """Fail clearly when the accumulated loss of an interval is nan/inf (checked once per epoch)."""
    if not math.isfinite(mean_loss):
        raise NonFiniteLoss(
            f"non-finite training loss ({mean_loss}) in epoch {epoch}, between "
            f"optimizer steps {first_step} and {last_step}; the last good "
            "checkpoint is kept (try a lower --lr or --clip-grad)"
        )


class EarlyStopping:
    """Patience on a validation score; keeps a copy of the best weights.

    mode "max": higher is better (accuracy, r2); "min": lower is better (a loss, mse). A NaN
    score is never a new best. patience=0 never stops early but still keeps (and lets you
    restore) the best weights. Epochs up to `start_epoch` never count against patience (their
    bests are still kept): a run must not stop in its warm-up, while the learning rate climbs
    and validation scores jump.
    """

    def __init__(
        self, patience: int, start_epoch: int = 0, mode: str = "max", monitor: str = "score"
    ) -> None:
        self.patience, self.start_epoch, self.mode = patience, start_epoch, mode
        self.monitor, self.epochs = monitor, 0
        self.best_score = -math.inf if mode == "max" else math.inf
        self.best_epoch = self.bad_epochs = 0
        self.best_state: dict[str, torch.Tensor] | None = None

    def update(self, score: float, epoch: int, model: nn.Module) -> bool:
        """Record an epoch's score; return True if it is a new best (weights copied to CPU)."""
        self.epochs = epoch
        if score > self.best_score if self.mode == "max" else score < self.best_score:
            self.best_score, self.best_epoch, self.bad_epochs = score, epoch, 0
            weights = model.state_dict().items()
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in weights}
            return True
        if epoch > self.start_epoch:
            self.bad_epochs += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_epochs >= self.patience

    @classmethod
    def after_warm_up(cls, args, task, scheduler, steps_per_epoch: int) -> EarlyStopping:
        """--patience on the task's monitored metric (its direction), counted only after the
        epoch in which `scheduler`'s LR peaks and after --min-epochs."""
        from .train import lr_peak_step, peak_epoch

        start = max(args.min_epochs, peak_epoch(lr_peak_step(scheduler), steps_per_epoch))
        mode = task.directions[task.monitor.removeprefix("val_")]  # its 'max' or 'min'
        return cls(args.patience, start_epoch=start, mode=mode, monitor=task.monitor)

    def restore(self, model: nn.Module) -> None:
        """The best epoch's weights into `model`; RunFailed when the score was never finite
        (no best weights to test)."""
        if self.best_state is None:
            raise RunFailed(
                f"{self.monitor} was never finite in {self.epochs} epoch(s): no best weights "
                "to test (try a lower --lr or --clip-grad)"
            )
        model.load_state_dict(self.best_state)

    def state_dict(self) -> dict:
        return dict(vars(self))  # numbers, the mode and the best weights: weights_only loads it

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)  # a checkpoint from before `monitor`: this run's stays
