"""Run a project's run.py with a GPU box's loaders on CPU: persistent DataLoader workers and the
pin-memory thread, optionally with the exit hook of torch <= 2.12 (pytorch issue 81794).

    python pinned_workers.py [--old-exit-hook] RUN_PY ARGS...

On a GPU, labrun's loaders keep their workers alive between epochs (persistent_workers) and a
pin-memory thread copies each batch into page-locked memory. torch 2.13 only starts that thread
when an accelerator is present, so CPU CI never runs the path that kept finished jobs alive on
the GPU box. Here every DataLoader with workers is made persistent and pinned; torch itself runs
(workers, queues, the pin-memory thread and its shutdown), only the page-locking copy is the
identity (a CPU-only torch has no pinned memory).

--old-exit-hook puts back what torch 2.4-2.12 registered for persistent pinned workers instead
of 2.13's hook: one atexit call per worker that joins it for 5 s (MP_STATUS_CHECK_INTERVAL),
then terminates it. A worker still running when that hook runs costs 5 s of exit.

What it saw goes to stderr, for tests and benchmarks to read:
    pinned-workers: started PID,PID (persistent, pin thread alive)
    exit hook: worker PID alive      (or: done)
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import warnings

import torch
from torch.utils.data import _utils, dataloader


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def persistent_and_pinned() -> None:
    original_loader_init = dataloader.DataLoader.__init__

    def loader_init(self, *args, **kwargs):
        if kwargs.get("num_workers", 0) > 0:
            kwargs.update(persistent_workers=True, pin_memory=True)
        original_loader_init(self, *args, **kwargs)

    original_base_init = dataloader._BaseDataLoaderIter.__init__

    def base_init(self, loader):
        original_base_init(self, loader)
        if loader.pin_memory:  # as with an accelerator present
            self._pin_memory, self._pin_memory_device = True, "cpu"

    original_mp_init = dataloader._MultiProcessingDataLoaderIter.__init__

    def mp_init(self, loader):
        original_mp_init(self, loader)
        pins = getattr(self, "_pin_memory_thread", None)
        state = "pin thread alive" if pins is not None and pins.is_alive() else "no pin thread"
        persistent = "persistent" if self._persistent_workers else "not persistent"
        say(
            f"pinned-workers: started {','.join(str(w.pid) for w in self._workers)} "
            f"({persistent}, {state})"
        )

    dataloader.DataLoader.__init__ = loader_init
    dataloader._BaseDataLoaderIter.__init__ = base_init
    dataloader._MultiProcessingDataLoaderIter.__init__ = mp_init
    # The pin-memory thread's device calls and copy: no accelerator, no page-locked memory.
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.set_device_index = lambda index: None
    _utils.pin_memory.pin_memory = lambda data, device=None: data
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")


def old_exit_hook() -> None:
    """torch 2.4-2.12, _MultiProcessingDataLoaderIter.__init__: for persistent pinned workers,
    `atexit.register(_clean_up_worker, w)` per worker, where _clean_up_worker joins w for
    MP_STATUS_CHECK_INTERVAL (5 s) and terminates it if still alive."""

    def clean_up_worker(w) -> None:
        say(f"exit hook: worker {w.pid} {'alive' if w.is_alive() else 'done'}")
        try:
            w.join(timeout=_utils.MP_STATUS_CHECK_INTERVAL)
        finally:
            if w.is_alive():
                w.terminate()

    def register(self) -> None:
        for w in self._workers:
            atexit.register(clean_up_worker, w)

    dataloader._MultiProcessingDataLoaderIter._register_persistent_workers_atexit = register


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--old-exit-hook":
        args = args[1:]
        old_exit_hook()
    persistent_and_pinned()
    run_py = os.path.abspath(args[0])
    sys.path.insert(0, os.path.dirname(run_py))  # as `python run.py` would have it
    sys.argv = [run_py, *args[1:]]
    runpy.run_path(run_py, run_name="__main__")
