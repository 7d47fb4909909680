"""A job's MLflow tracking (`Tracker`), its provenance tags, and `python -m labrun.tracking
sync|follow` (follower.py's command). What MLflow holds is made by mirror.py's `mirror`, the one
path from a run directory to MLflow.
- Interactive (`python run.py`): the job mirrors its directory as RUNNING at its start, after
  each epoch (the history rows past `sent_rows`: some 10 ms on a local sqlite DB), and with its
  end status at its end.
- In a sweep (run.sh sets `LAB_TRACKING_FOLLOWER=1`): jobs never talk to MLflow; the sweep's one
  follower mirrors them (follower.py). A sweep killed with -9 loses nothing: the next sweep's
  follower, or `python -m labrun.tracking sync`, mirrors the rest.
- Never fatal: an unreachable tracker is one warning; what was not sent follows at a later
  epoch, at the end, on resume, or by `sync`.

Imports neither torch nor mlflow at module level (mlflow costs ~1.5 s to import).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path

from . import runs
from .config import PROJECT_ROOT
from .mirror import (
    RETRY_AFTER_S,
    as_texts,
    mirror,
    mlflow_client,
    read_state,
    save_state,
    system_monitor,
    tracking_uri,
)

FOLLOWER_ENV = "LAB_TRACKING_FOLLOWER"  # "1" (run.sh): the sweep's follower mirrors this job
MAX_ERROR_CHARS = 20000  # a traceback kept in tracking.json for traceback.txt


def provenance(log: logging.Logger | None = None) -> dict[str, str]:
    """Tags that let someone reproduce the run: code, command, versions, hardware. `log` warns
    outside a git repository: a run whose code cannot be found again nobody can reproduce."""
    import torch

    code = runs.code_version(PROJECT_ROOT)
    if code["git_commit"] == "unknown" and log is not None:
        log.warning(
            "%s is not in a git repository (or git is missing): provenance records "
            "git_commit=unknown; make it one: git init && git add -A && git commit",
            PROJECT_ROOT,
        )
    diff = code["git_diff"]  # a hash of the uncommitted diff ("none": clean)
    tags = {
        "git_commit": code["git_commit"],
        "git_diff": diff,
        "code_project": code["project"],  # the project's code as it was on disk
        "labrun_version": code["labrun_version"],
        "labrun_source": code["labrun"],
        "git_dirty": "unknown" if diff == "unknown" else str(diff != "none").lower(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "hostname": socket.gethostname(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    if "SLURM_JOB_ID" in os.environ:
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return tags


class Tracker:
    """The MLflow side of one job's run directory; every call is guarded and none raises. It
    keeps tracking.json (mirror.py), so a resumed job, the follower or `sync` continues the same
    MLflow run. Deferred (`LAB_TRACKING_FOLLOWER=1`): tracking.json only, no MLflow at all."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        experiment: str,
        log: logging.Logger,
        params: dict | None = None,
        tags: dict | None = None,
        system_metrics: bool = True,
    ) -> None:
        self.run_dir, self.log, self.enabled = Path(run_dir), log, enabled
        self.deferred = enabled and os.environ.get(FOLLOWER_ENV) == "1"
        self.state = read_state(self.run_dir, log)
        self.monitor = self._failed_at = self._monitored = None  # _monitored: the monitor's run
        self.system_metrics = system_metrics
        self._warned = self._frozen = False  # _frozen: abandon(), the directory is not ours
        self._verified = False  # this process has compared MLflow with the directory once
        if not self.enabled:
            return
        # What only this process knows, for whoever mirrors the directory later.
        self.state.setdefault("started_at", time.time())
        self.state.update(
            experiment=experiment,
            params=as_texts(params or {}, 6000),
            tags=as_texts(tags or {}, 8000),
        )
        self.state.pop("ended_at", None)
        save_state(self.run_dir, self.state)
        self.log_history()  # the MLflow run: found (a resume) or created, RUNNING

    @property
    def run_id(self) -> str | None:
        return self.state.get("run_id")

    def _guard(self, what: str, fn, *args, force: bool = False):
        """fn(*args) unless tracking is off or failed recently (`force`: whatever the back-off);
        a failure warns once, never raises."""
        if not self.enabled or self.deferred:
            return None
        recent = self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S
        if recent and not force:
            return None
        try:
            result = fn(*args)
        except Exception as exc:  # the tracker is never a reason to stop training
            self._failed_at = time.monotonic()
            if not self._warned:
                self._warned = True
                self.log.warning(
                    "MLflow (%s) failed to %s: %s: %s -- training goes on; the run directory "
                    "keeps everything and unsent metrics follow later (or run `python -m "
                    "%s.tracking sync %s`)",
                    *(tracking_uri(), what, type(exc).__name__, runs.first_line(exc)),
                    *(__package__, self.run_dir),
                )
            return None
        if self._failed_at is not None:
            self.log.info("MLflow reachable again")
            self._failed_at = None
        return result

    def _mirror(self, status: str, summary: dict | None = None, known=None) -> list[str]:
        client = mlflow_client(tracking_uri())
        changes = mirror(client, self.run_dir, self.state, status, summary, known)
        for change in changes:  # a rebuild is news; the usual rows, tags and status are not
            if change.startswith(("replaced", "MLflow run")):
                self.log.warning("MLflow: %s", change)
        return changes

    def log_history(self) -> None:
        # After one full comparison, an epoch sends the rows past those this job sent: reading
        # every row back each epoch made a long run's tracking quadratic in its epochs.
        known = self.state.get("sent_rows") if self._verified else None
        if self._guard("log metrics", self._mirror, "RUNNING", {}, known) is None:
            return
        self._verified = True
        if self.system_metrics and self._monitored != self.run_id:
            self.close()  # a rebuilt MLflow run: the monitor follows it
            self._monitored = self.run_id
            self.monitor = self._guard("start system metrics", system_monitor, self.run_id)

    def end(
        self,
        status: str,
        *,
        metrics: dict | None = None,
        tags: dict | None = None,
        artifacts: list[Path] = (),
        error: str | None = None,
    ) -> None:
        """Record how the run ended (tracking.json), then mirror the run directory (deferred: the
        follower does), tried whatever the back-off: a short outage near the end must not leave
        the run RUNNING with half its epochs. `artifacts`: files of the run directory."""
        if not self.enabled:
            return
        self.state.update(
            ended_at=time.time(),
            end_tags=as_texts(tags or {}, 8000),
            artifacts=[p.name for p in artifacts if Path(p).parent == self.run_dir],
            error=(error or "")[-MAX_ERROR_CHARS:],
        )
        if not self._frozen:  # abandon(): the directory is another's
            save_state(self.run_dir, self.state)
        self._guard("end the MLflow run", self._mirror, status, metrics or {}, force=True)
        self.close()

    def abandon(self, reason: str) -> None:
        """The run directory is another's now (claim.LostClaim): end this MLflow run FAILED with
        `reason`, and write nothing more to the directory (not even tracking.json)."""
        self._frozen = True
        if self.run_id is not None:
            self._guard("end the MLflow run", self._abandon, reason, force=True)
        self.close()

    def _abandon(self, reason: str) -> None:
        client = mlflow_client(tracking_uri())
        client.set_tag(self.run_id, "error", reason[:4000])
        client.set_terminated(self.run_id, status="FAILED")

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                self.monitor.finish()
            self.monitor = None


if __name__ == "__main__":  # `python -m labrun.tracking sync|follow`: follower.py's command
    from labrun.follower import main

    sys.exit(main())
