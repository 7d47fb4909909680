"""Placeholder until the sweep helper's claim.py lands (exclusive flock on <run_dir>/.lock)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK = ".lock"


class Busy(RuntimeError):
    pass


@contextlib.contextmanager
def claim(run_dir: Path):
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{run_dir} is held by another process") from None
        yield
    finally:
        os.close(fd)
