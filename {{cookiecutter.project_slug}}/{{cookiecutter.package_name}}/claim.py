"""Placeholder until the sweep helper's claim.py lands (exclusive flock on <run_dir>/.lock)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from .runs import LOCK


class Busy(RuntimeError):
    pass


class Claim:
    def __init__(self, run_dir: Path, created: bool) -> None:
        self.run_dir, self.created = run_dir, created

    def discard(self) -> None:
        """Remove the run directory again if this claim created it and nothing else is in it."""
        if self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK]:
            (self.run_dir / LOCK).unlink()
            self.run_dir.rmdir()


@contextlib.contextmanager
def claim(run_dir: Path):
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{run_dir} is held by another process") from None
        yield Claim(run_dir, created)
    finally:
        os.close(fd)
