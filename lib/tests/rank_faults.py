"""torchrun's entry for tests that change one rank: run.py, with rank LABRUN_FAULT_RANK altered.

Usage: torchrun --standalone --nproc-per-node 2 tests/rank_faults.py RUN_PY ARGS...
LABRUN_FAULT (on rank LABRUN_FAULT_RANK only; the other ranks run run.py unchanged):
  args:--lr 1                 more arguments for that rank (argparse: the last one wins)
  enospc:MODULE:FUNCTION      FUNCTION raises OSError(ENOSPC), as on a full disk
  fail:MODULE:FUNCTION:N      FUNCTION's call N+1 raises RuntimeError("injected failure ...")
"""

from __future__ import annotations

import errno
import importlib
import os
import runpy
import shlex
import sys


def _patch(spec: str, rank: str) -> None:
    kind, module_name, name, *after = spec.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    calls = [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if kind == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected on rank {rank})")
        if calls[0] > int(after[0]):
            raise RuntimeError(f"injected failure on rank {rank} in {name}")
        return original(*args, **kwargs)

    setattr(module, name, patched)


def main() -> None:
    run_py, *args = sys.argv[1:]
    rank, fault = os.environ.get("RANK", "0"), os.environ.get("LABRUN_FAULT", "")
    if fault and rank == os.environ.get("LABRUN_FAULT_RANK", "1"):
        if fault.startswith("args:"):
            args += shlex.split(fault.removeprefix("args:"))
        else:
            _patch(fault, rank)
    sys.argv = [run_py, *args]
    sys.path.insert(0, os.path.dirname(run_py))
    runpy.run_path(run_py, run_name="__main__")


if __name__ == "__main__":
    main()
