"""`python -m labrun.tracking sync|follow`: MLflow made to mirror run directories from outside
their jobs (mirror.py's `mirror`, the one path).

- `sync PATHS`: every run directory under PATHS, each change printed (after a sweep killed with
  -9, a tracker outage, or runs copied from another machine).
- `follow RESULTS`: the sweep's follower (sweep.py starts it; its jobs run with
  `LAB_TRACKING_FOLLOWER=1` and never talk to MLflow): mirrors each run of the sweep's jobs live,
  as its epochs land (RUNNING, with the machine's system metrics), finishes it once its job has
  released the run's claim, and mirrors everything left when the sweep ends (stdin closes).

Neither is part of one run: a job's own tracking is tracking.py's. Imports no mlflow until a
directory is mirrored.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from . import runs
from .claim import LOCK_FILE
from .config import PROJECT_ROOT
from .mirror import (
    RETRY_AFTER_S,
    fingerprint,
    mirror,
    mlflow_client,
    read_state,
    system_monitor,
    tracking_uri,
)
from .runs import first_line

FOLLOW_POLL_S = 1.0  # how often the follower looks for new epochs and runs whose job has ended


def sync(run_dir: Path, log: logging.Logger, run_id: str | None = None) -> bool | None:
    """Make MLflow mirror a run directory, saying each change; True if it does now, False if
    it could not be reached, None if a live job holds the directory (its job mirrors it). Holds
    the run's claim meanwhile, like a job. `run_id`: the run the follower mirrored live, for a
    tracking.json that names none."""
    from .claim import Busy, claim

    # Another user's directory is theirs to sync: a claim would put our .lock (and then our
    # tracking.json) in it, and their next job would refuse the foreign files.
    try:
        if (owner := Path(run_dir).lstat().st_uid) != os.geteuid():
            log.warning("skipped %s: it is %s's, not yours (its owner syncs it)", run_dir,
                        runs.owner_name(owner))  # fmt: skip
            return False
        held = claim(run_dir)
    except Busy as exc:
        log.info("skipped %s: %s (that job mirrors it)", run_dir, exc)
        return None
    except OSError as exc:  # e.g. a colleague's directory without a .lock: cannot claim it
        log.warning("skipped %s: cannot claim it (%s)", run_dir, exc.strerror or exc)
        return False
    with held:
        try:  # a file in it that is not ours: its job would refuse it too
            runs.check_ownership(run_dir)
        except OSError as exc:
            log.warning("skipped %s: %s", run_dir, exc)
            return False
        state = read_state(run_dir, log)
        if run_id and not state.get("run_id"):
            state["run_id"] = run_id
        try:
            changes = mirror(mlflow_client(tracking_uri()), run_dir, state)
        except Exception as exc:
            log.warning("%s: not mirrored: %s: %s", run_dir, type(exc).__name__, first_line(exc))
            return False
    for change in changes:
        log.info("%s: %s", run_dir, change)
    return True


def _answers(log: logging.Logger) -> bool:
    """Whether the tracking server answers one request (within MLflow's HTTP timeout and
    retries, mirror.HTTP_DEFAULTS); if not, said once."""
    uri = tracking_uri()
    try:
        mlflow_client(uri).search_experiments(max_results=1)
        return True
    except Exception as exc:
        log.warning("MLflow at %s does not answer (%s): nothing more is mirrored by this "
                    "follower; `python -m labrun.tracking sync` sends it later", uri,
                    first_line(exc))  # fmt: skip
        return False


def _run_dirs(roots: list[Path], with_state: bool) -> list[Path]:
    name = runs.TRACKING if with_state else runs.CONFIG
    return sorted({c.parent for root in roots if root.is_dir() for c in root.rglob(name)})


def _sweeps_job(run_dir: Path) -> bool:
    """Whether the claim on `run_dir` is held by a job of this follower's sweep (a child of its
    parent, read from the claim's pid and /proc): its live run is ours to mirror. One running
    elsewhere (another sweep, a Slurm task) mirrors itself; no /proc: no live mirror."""
    try:
        found = re.match(r"pid=([0-9]+) ", (run_dir / LOCK_FILE).read_text())
        stat = Path(f"/proc/{found[1]}/stat").read_text() if found else ""
    except (OSError, UnicodeDecodeError):
        return False
    fields = stat.rpartition(")")[2].split()
    return len(fields) > 1 and fields[1] == str(os.getppid())


class Live:
    """The MLflow runs of the sweep's running jobs, mirrored as their epochs land, with the
    machine's system metrics. The job holds the claim and writes its tracking.json; the follower
    keeps the run's id and the rows it sent here, and finds the run again by its run_dir tag
    when it starts anew (a killed sweep's re-run). `sync` finishes each run once its job ends."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.sent: dict[Path, dict] = {}  # run dir -> run_id, sent_rows, mirrored
        self.monitors: dict[Path, tuple[str, object]] = {}  # run dir -> (run id, its monitor)
        self.failed: dict[Path, float] = {}  # run dir -> when its last live mirror failed

    def mirror(self, run_dir: Path, state: dict) -> None:
        mine = self.sent.setdefault(run_dir, {})
        if mine.get("mirrored") == fingerprint(run_dir, state):
            return  # no new epoch
        if time.monotonic() - self.failed.get(run_dir, -RETRY_AFTER_S) < RETRY_AFTER_S:
            return  # an unreachable tracker must not hold up the other runs every second
        live = {**state, **mine}
        known = mine.get("sent_rows") if mine.get("run_id") else None  # else: read back once
        try:
            client = mlflow_client(tracking_uri())
            mirror(client, run_dir, live, "RUNNING", {}, known, save=False, by_tag=True)
        except Exception as exc:  # never fatal: the run's end, or `sync`, sends it
            if run_dir not in self.failed:
                name = type(exc).__name__
                self.log.warning("%s: not mirrored live: %s: %s", run_dir, name, first_line(exc))
            self.failed[run_dir] = time.monotonic()
            return
        mine.update({k: live[k] for k in ("run_id", "sent_rows", "mirrored")})
        if self.monitors.get(run_dir, ("",))[0] != live["run_id"]:  # new, or a rebuilt run
            self._stop_monitor(run_dir)
            with contextlib.suppress(Exception):  # no psutil: no system metrics, the rest goes on
                self.monitors[run_dir] = live["run_id"], system_monitor(live["run_id"])

    def stop(self, run_dir: Path) -> str | None:
        """Its job has ended: stop `run_dir`'s system metrics and forget what was sent (another
        attempt, e.g. re-queued, is compared in full); the MLflow run it was mirrored to, if any
        (a second call finds it by its tag)."""
        self._stop_monitor(run_dir)
        return self.sent.pop(run_dir, {}).get("run_id")

    def _stop_monitor(self, run_dir: Path) -> None:
        _, monitor = self.monitors.pop(run_dir, ("", None))
        if monitor is not None:
            with contextlib.suppress(Exception):
                monitor.finish()


def follow(roots: list[Path], log: logging.Logger) -> int:
    """The sweep's follower: mirror each run directory under `roots` live while its job runs
    (Live), finish it once its job has ended, until stdin closes (run.sh's end), then mirror
    every one left. Ctrl-C is run.sh's to handle; SIGTERM (run.sh died) ends it after the
    directory at hand. During the sweep it claims only directories that changed since it
    started and are no longer `running`, and those done: never a run the sweep may be about to
    start (that would turn its job away)."""
    closed, stopping = threading.Event(), threading.Event()
    if not sys.stdin.isatty():  # under run.sh; at a terminal, Ctrl-C stops it as usual
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: (stopping.set(), closed.set()))

    def read_to_end() -> None:
        with contextlib.suppress(Exception):
            while sys.stdin.read(4096):
                pass
        closed.set()

    threading.Thread(target=read_to_end, daemon=True).start()
    unreached = {}  # run dir -> fingerprint tried
    # MLflow answers (None: not asked yet). One probe before the first directory, another after
    # a directory fails; a server that does not answer is down for the rest of the sweep: each
    # try would cost MLflow's timeout and retries again, per directory (`sync` later sends all).
    answers: bool | None = None
    live = Live(log)
    seen = {d: fingerprint(d, read_state(d)) for d in _run_dirs(roots, with_state=True)}
    while not stopping.is_set():
        final = closed.is_set()
        for run_dir in _run_dirs(roots, with_state=True):
            if stopping.is_set():
                break
            state = read_state(run_dir)
            now = fingerprint(run_dir, state)
            running = runs.read_status(run_dir) == "running"
            if not final and running and _sweeps_job(run_dir):
                if answers is None:
                    answers = _answers(log)
                if answers:  # a silent server is down for the sweep, live rows too
                    live.mirror(run_dir, state)
                continue
            if state.get("mirrored") == now or (not final and unreached.get(run_dir) == now):
                continue  # mirrored; or failed: again when it changes
            if not final and (running or (seen.get(run_dir) == now and not runs.is_done(run_dir))):
                continue
            live_id = live.stop(run_dir)  # the run its job mirrored live, if any
            if answers is None:
                answers = _answers(log)
            synced = sync(run_dir, log, live_id) if answers else False
            if synced is False and answers:  # this directory's fault, or the server's?
                answers = _answers(log)
            if synced is False:
                unreached[run_dir] = now
            else:
                unreached.pop(run_dir, None)
            if synced is None:  # a job still held it: look again next pass, changed or not
                seen[run_dir] = None
        if final:
            break
        closed.wait(FOLLOW_POLL_S)
    for run_dir in list(live.monitors):
        live.stop(run_dir)
    return 1 if unreached else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m labrun.tracking",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "command",
        choices=("sync", "follow"),
        help="sync: make MLflow mirror run directories, printing each change; follow: run.sh's "
        "follower (mirrors each run of its jobs live, finishes it once its job ends, until stdin "
        "closes); `run.py --init-tracking` creates the DB and the experiment",
    )
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help="run directories, or folders holding them [results]",
    )
    args = p.parse_args(argv)
    paths = args.paths or [PROJECT_ROOT / "results"]
    log = logging.getLogger(f"tracking.{args.command}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "follow":
        return follow(paths, log)
    run_dirs = _run_dirs(paths, with_state=False)
    if not run_dirs:
        print(
            "error: sync: no run directory (a folder with config.json) under the given paths",
            file=sys.stderr,
        )
        return 2
    done = [sync(d, log) for d in run_dirs]  # each skip and failure said, with its directory
    print(
        f"synced {done.count(True)} of {len(run_dirs)} run directories to {tracking_uri()} "
        f"({done.count(None)} held by a live job, {done.count(False)} not reached)"
    )
    return 1 if False in done else 0
