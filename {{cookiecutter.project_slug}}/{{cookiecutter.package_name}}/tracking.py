"""MLflow: where the database lives, creating it once, one run per job, batched metrics.

- Tracking URI: `MLFLOW_TRACKING_URI` if set, else an absolute `sqlite:///<project root>/mlflow.db`
  (absolute, so it does not depend on the directory you start from). Artifacts go next to the
  database, in `mlruns/`.
- Create the DB once before starting jobs in parallel (concurrent first-time schema migrations of
  one sqlite file fail): `python -m PKG.tracking init` or `python run.py --init-tracking`.
- Metrics are sent once per epoch in one `log_batch` call (about 0.1 s); never one call per step.
- Uses MlflowClient with explicit run ids, never the fluent "active run" global.

Imports no torch at module level (only `provenance()` asks torch for versions).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import sys
import time
import warnings
from pathlib import Path

from .config import DEFAULT_EXPERIMENT, PROJECT_ROOT
from .runs import git_state


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"


def _artifact_location(uri: str) -> str | None:
    """`mlruns/` next to a sqlite DB; the server's default for anything else."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlruns").as_uri()
    return None


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri())


def init(experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Create the DB (schema) and the experiment if missing; return the experiment id."""
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = _client()
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(experiment, artifact_location=_artifact_location(uri))
    except Exception:  # another job created it between our two calls
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def provenance() -> dict[str, str]:
    """Tags that let someone reproduce the run: code, command, versions, hardware."""
    import torch

    commit, dirty = git_state(PROJECT_ROOT)
    tags = {
        "git_commit": commit or "unknown",
        "git_dirty": str(dirty).lower() if dirty is not None else "unknown",
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
    """One MLflow run: created fresh or re-opened (resume), ended FINISHED/KILLED/FAILED."""

    def __init__(self, experiment: str, run_name: str, *, run_id: str | None = None,
                 params: dict | None = None, tags: dict | None = None) -> None:
        from mlflow.entities import Param

        self.client = _client()
        if run_id is not None:  # resume: same run, back to RUNNING
            try:
                self.client.update_run(run_id, status="RUNNING")
            except Exception as exc:  # e.g. another MLFLOW_TRACKING_URI than the first attempt
                warnings.warn(f"MLflow run {run_id} not found ({exc}); starting a new one",
                              stacklevel=2)
                run_id = None
        if run_id is not None:
            self.run_id = run_id
        else:
            experiment_id = init(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self.client.log_batch(
                self.run_id,
                params=[Param(k, str(v)[:6000]) for k, v in sorted((params or {}).items())],
            )
        self.set_tags(tags or {})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """All of one epoch's numbers in one call (values must already be Python floats)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        self.client.log_batch(self.run_id, metrics=batch)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def finish(self, status: str = "FINISHED") -> None:
        """status: FINISHED, KILLED (interrupted, resumable) or FAILED."""
        self.client.set_terminated(self.run_id, status=status)

    def fail(self, traceback_text: str) -> None:
        """Attach the traceback (artifact + short tag) and end the run as FAILED."""
        try:
            self.client.log_text(self.run_id, traceback_text, "traceback.txt")
        finally:
            last_line = traceback_text.strip().splitlines()[-1]
            self.client.set_tag(self.run_id, "error", last_line[:4000])
            self.client.set_terminated(self.run_id, status="FAILED")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}.tracking", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("init", "uri"),
                   help="init: create the DB and the experiment; uri: print the tracking URI")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
    args = p.parse_args(argv)
    if args.command == "uri":
        print(tracking_uri())
        return 0
    experiment_id = init(args.experiment)
    print(f"MLflow ready: {tracking_uri()} (experiment {args.experiment!r}, id {experiment_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
