"""One claim per run directory: at most one process trains a run at a time.

A process that trains holds an exclusive, non-blocking `fcntl.flock` on `<run_dir>/.lock` for its
whole life. The kernel drops the lock when the process ends, however it ends (crash, SIGKILL,
power loss of the node), so there is never a stale claim to clean up. A second process for the
same run directory gets `Busy`, whose message names the holder; run.py exits 73 and the sweep
shows the job as "running elsewhere".

    with claim(run_dir):          # raises Busy if another live process holds it
        train()
    held = claim(run_dir)         # or keep it until `held.release()` / the process ends

Imports no torch and no mlflow: the sweep's planner asks `holder()` for every job.
On NFS, Linux emulates flock with POSIX byte-range locks, so the claim holds across nodes there
too; on file systems without working locks it fails with OSError instead of silently passing.

fcntl, not filelock (which the data caches and the MLflow DB use: dataversion.file_lock,
mirror.mlflow_client): the claim is more than a lock. Its file holds the holder's description,
which others read through descriptors of their own (some filelock versions truncate it at
every open); holder() probes with a shared lock, which filelock has not; still_ours() compares
the inode this descriptor locked; and on a file system without flock the claim must fail, where
filelock may fall back to a lock file that a crash leaves behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

from .runs import LOCK as LOCK_FILE

# holder() takes the lock for an instant to see whether it is free; a claim that collides with
# such a probe tries again for this long before reporting Busy, so a look never blocks a start.
_RETRY_S = 0.2
STOPPING = "stopping"  # field in the lock file: the holder got a stop signal and is exiting


class Busy(RuntimeError):
    """The run directory is claimed by another live process; str() names that process."""


class LostClaim(RuntimeError):
    """The run directory's lock is no longer the one this process holds (the directory was
    deleted, or its .lock replaced): another process may own the path now. str() says so."""


class Claim(contextlib.AbstractContextManager):
    """A held claim; released by `release()`, by leaving a `with` block, or at process end."""

    def __init__(self, run_dir: Path, fd: int, created: bool, info: str = "") -> None:
        self.run_dir, self.created, self._fd, self._info = run_dir, created, fd, info

    def mark_stopping(self) -> None:
        """Note in the lock file that this holder is stopping (checkpointing, then exiting): the
        sweep's planner then waits a few seconds for it instead of calling the run "running
        elsewhere" (run.sh re-run right after its own jobs were told to stop)."""
        if self._fd is None or STOPPING in self._info:
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._info = f"{self._info.rstrip()} {STOPPING}={now}\n"
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, self._info.encode(), 0)

    def discard(self) -> None:
        """Release, and remove the run directory if this claim created it and it holds nothing
        else (a run refused before any work leaves nothing behind). The lock file goes first,
        while still held: a process waiting on it sees another inode at the path and retries."""
        # Not ours to remove unless still_ours(): a deleted directory's path may be another's.
        ours = self.created and self.still_ours()
        with contextlib.suppress(OSError):
            if ours and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                (self.run_dir / LOCK_FILE).unlink()
                self.run_dir.rmdir()
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def still_ours(self) -> bool:
        """True while the file at <run_dir>/.lock is the one this claim locked (same device and
        inode). `rm -rf` of the run directory, or a replaced .lock, makes it False for good: a
        new process can then claim the path, and this one must write nothing more there."""
        return self._fd is not None and _locked_is_at(self._fd, self.run_dir / LOCK_FILE)

    def check(self) -> None:
        """Raise LostClaim unless still_ours(): call before every write that matters."""
        if not self.still_ours():
            raise LostClaim(self.lost_message())

    def lost_message(self) -> str:
        now = holder(self.run_dir)
        return (
            f"lost the claim on {self.run_dir}: the directory was deleted or its .lock replaced "
            "while this process worked in it" + (f" (now held by {now})" if now else "") + "; "
            "stopping without writing anything more there"
        )

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    __del__ = release  # a forgotten Claim releases when collected, not at exit only


def _locked_is_at(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except OSError:
        return False


def _open_lock(path: Path) -> int:
    # 0o666 minus the umask: colleagues sharing the results folder can read who holds a run.
    flags = os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags | os.O_RDWR, 0o666)
    except PermissionError:  # someone else's lock file: flock works on a read-only descriptor
        return os.open(path, flags | os.O_RDONLY, 0o666)


def _describe(fd: int) -> str:
    """Who holds the lock file open at `fd`, as its holder wrote there (claim)."""
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "pid" not in fields:
        return "a process that is just starting (no holder recorded yet)"
    stopping = f", {STOPPING} since {fields[STOPPING]}" if STOPPING in fields else ""
    return (
        f"pid {fields['pid']} on {fields.get('host', '?')} since "
        f"{fields.get('start', '?').replace('T', ' ')}{stopping.replace('T', ' ')}"
    )


def claim(run_dir: str | os.PathLike) -> Claim:
    """Claim `run_dir` (created if missing) for this process, or raise Busy naming the holder."""
    directory = Path(run_dir)
    created = not directory.exists()
    path = directory / LOCK_FILE
    deadline = time.monotonic() + _RETRY_S
    while True:
        directory.mkdir(parents=True, exist_ok=True)  # again: a discarded claim removes it
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The file we locked must still be the one at `path` (someone may have deleted
            # it): otherwise a later process would lock a new file and both would train.
            if _locked_is_at(fd, path):
                break
        except BlockingIOError:  # held; any other OSError (no flock here) ends the job
            if time.monotonic() >= deadline:
                who = _describe(fd)
                os.close(fd)
                raise Busy(f"{directory} is claimed by {who}") from None
            time.sleep(0.01)
        os.close(fd)  # and try again
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    info = f"pid={os.getpid()} host={socket.gethostname()} start={start}\n".encode()
    with contextlib.suppress(OSError):  # read-only lock file: the claim holds, unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
    return Claim(directory, fd, created, info.decode())


def holder(run_dir: str | os.PathLike) -> str | None:
    """Who holds the claim on `run_dir` ("pid N on HOST since TIME"), or None when it is free."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        # flock has no "test" operation: take a shared lock for an instant. claim() retries
        # for _RETRY_S, so this probe never makes a starting job give up.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _describe(fd)
    finally:
        os.close(fd)
