"""MLflow tracking that never stops training: one run per run directory, sent when it can be.

- Tracking URI: `MLFLOW_TRACKING_URI` if set, else an absolute `sqlite:///<project root>/mlflow.db`
  (absolute, so it does not depend on the directory you start from). Artifacts go next to the
  database, in `mlruns/`.
- Safe from any number of processes at once: creating or migrating the sqlite schema happens under
  an exclusive lock on `mlflow.db.lock` (concurrent first-time migrations of one sqlite file
  corrupt it), so `python run.py` needs no set-up step.
- Bounded: an HTTP tracking server that does not answer fails within about
  `MLFLOW_HTTP_REQUEST_TIMEOUT` x (`MLFLOW_HTTP_REQUEST_MAX_RETRIES` + 1) seconds; this module
  sets those to 5 s and 1 retry unless you set them yourself.
- Never fatal: when the tracker cannot be reached or errors, the job warns once and keeps
  training; the run directory (history.csv, metrics.json, status) stays the record. What was not
  sent is sent at the next epoch that reaches the tracker, at the end (tried once more whatever
  the back-off), when the run is resumed, or with `python -m <package>.tracking sync
  RESULTS_OR_RUN_DIR...`. `tracking.json` in the run directory says which MLflow run it is, how
  much of the history it holds and, when the end could not be sent, what is `missing`. It is
  checked before use (a run id is 32 hex digits, counts are integers): a bad one is a warning and
  a fresh MLflow run.
- One sender per run directory: a training job holds the run's claim (claim.py), and `sync`
  takes it too, skipping directories a live job holds: rows are never sent twice, and a
  directory never gets two MLflow runs.
- The sqlite DB is created with the umask's permissions (like every other file), so a group
  can share it; SQLite gives its journal the database's permissions.
- `--tracking off` (or `LAB_TRACKING=off`) runs without MLflow at all.

Imports neither torch nor mlflow at module level (mlflow costs ~1.5 s to import).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import platform
import re
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from . import runs
from .config import DEFAULT_EXPERIMENT, PROJECT_ROOT

STATE_FILE = "tracking.json"
RETRY_AFTER_S = 60.0  # after a failure, try the tracker again at the next epoch this much later
ARTIFACT_MAX_BYTES = 200 * 2**20  # larger best_model.pt files stay in the run directory only
SYSTEM_METRICS_INTERVAL_S = 10.0  # CPU/RAM (psutil) and GPU (nvidia-ml-py) sampling period
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def _artifact_location(uri: str) -> str | None:
    """`mlruns/` next to a sqlite DB; the server's default for anything else."""
    db = _sqlite_path(uri)
    return (db.parent / "mlruns").as_uri() if db is not None else None


def _quiet_mlflow() -> None:
    """MLflow's INFO lines (creating tables, system metrics started) are not the job's news."""
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # A failing DB call logs its whole traceback at ERROR here (and the system-metrics thread
    # warns on its own): the Tracker already says it once, in one line.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    logging.getLogger("mlflow.system_metrics").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _schema_lock(uri: str) -> Iterator[None]:
    """Serialise the first touch of a sqlite DB across processes (it creates and migrates)."""
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{db}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        # SQLite would create the file 0644 whatever the umask; an empty file is a valid empty
        # database, so create it here with what the umask allows (its journal copies the mode).
        with contextlib.suppress(FileExistsError):
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        yield
    finally:
        os.close(fd)


def _client():
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    _quiet_mlflow()
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    with _schema_lock(uri):  # creating the client opens the store, which creates the schema
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store (and schema) exists after this
    return client


def init(experiment: str = DEFAULT_EXPERIMENT, client=None) -> str:
    """Create the DB (schema) and the experiment if missing; return the experiment id."""
    client = client or _client()
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(
            experiment, artifact_location=_artifact_location(tracking_uri())
        )
    except Exception:  # another job created it between our two calls
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def provenance(log: logging.Logger | None = None) -> dict[str, str]:
    """Tags that let someone reproduce the run: code, command, versions, hardware.

    Outside a git repository the commit is `unknown`; `log` then says so (once per run), since a
    run whose code cannot be found again is a result nobody can reproduce."""
    import torch

    commit, dirty = runs.git_state(PROJECT_ROOT)
    if commit is None and log is not None:
        log.warning(
            "%s is not in a git repository (or git is missing): provenance records "
            "git_commit=unknown; make it one: git init && git add -A && git commit",
            PROJECT_ROOT,
        )
    code = runs.code_version(PROJECT_ROOT)
    tags = {
        "git_commit": commit or "unknown",
        "git_diff": code["git_diff"],  # a hash of the uncommitted diff ("none": clean)
        "code_project": code["project"],  # the project's code as it was on disk
        "labrun_version": code["labrun_version"],
        "labrun_source": code["labrun"],
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


def run_params(config: dict) -> dict:
    """The MLflow params of a run: its experiment-defining config values and the list of their
    names, `experiment_keys` (analysis.load_runs_from_mlflow needs it to tell them apart)."""
    keys = list(config.get("experiment_keys", []))
    return {**{k: config[k] for k in keys if k in config}, "experiment_keys": keys}


class Tracker:
    """The MLflow side of one run directory; every call is guarded and none raises.

    `tracking.json` (in the run directory) holds the MLflow run id, how many history rows the run
    has received and whether its end was recorded, so a resumed job or `sync` continues the same
    MLflow run and sends each row once.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        experiment: str,
        run_name: str,
        log: logging.Logger,
        params: dict | None = None,
        tags: dict | None = None,
        system_metrics: bool = True,
        training: bool = True,
    ) -> None:
        self.run_dir, self.log, self.enabled = Path(run_dir), log, enabled
        self.training = training  # False for sync: an ended MLflow run stays as it ended
        self.experiment, self.run_name = experiment, run_name
        self.params, self.tags = params or {}, tags or {}
        self.state = _read_state(self.run_dir, log)
        self.client = self.monitor = None
        self._failed_at: float | None = None
        self._warned = False
        self._frozen = False  # abandon(): the run directory is no longer ours to write
        if self.enabled:
            self._guard("open the MLflow run", self._open)
            if system_metrics and self.ready:
                self._guard("start system metrics", self._start_monitor)

    @property
    def run_id(self) -> str | None:
        return self.state.get("run_id")

    @property
    def ready(self) -> bool:
        return self.client is not None and self.run_id is not None

    # ---- the guarded calls ---------------------------------------------------------------------
    def _guard(self, what: str, fn, *args, force: bool = False):
        """Run fn unless tracking is off or failed recently (`force`: whatever the back-off, for
        the run's end); a failure warns once, never raises."""
        if not self.enabled:
            return None
        recent = self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S
        if recent and not force:
            return None
        try:
            result = fn(*args)
        except Exception as exc:  # the tracker is never a reason to stop training
            self._failed_at = time.monotonic()
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            if not self._warned:
                self._warned = True
                self.log.warning(
                    "MLflow (%s) failed to %s: %s: %s -- training goes on; the run directory "
                    "keeps everything and unsent metrics follow later (or run `python -m "
                    "%s.tracking sync %s`)",
                    tracking_uri(),
                    what,
                    type(exc).__name__,
                    first_line,
                    __package__,
                    self.run_dir,
                )
            return None
        if self._failed_at is not None:
            self.log.info("MLflow reachable again")
            self._failed_at = None
        return result

    def _open(self) -> None:
        from mlflow.entities import Param, RunTag

        if self.client is None:
            self.client = _client()
        if self.run_id is not None:
            try:  # resume: the same run, back to RUNNING
                if self.training:
                    self.client.update_run(self.run_id, status="RUNNING")
                else:
                    self.client.get_run(self.run_id)  # it exists
                return
            except Exception as exc:  # e.g. another MLFLOW_TRACKING_URI than the first attempt
                self.log.warning(
                    "MLflow run %s not found (%s); starting a new one",
                    self.run_id,
                    str(exc).splitlines()[0][:200],
                )
                self.state = {}
        experiment_id = init(self.experiment, self.client)
        run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self.client.log_batch(
            run_id,
            params=[Param(k, str(v)[:6000]) for k, v in sorted(self.params.items())],
            tags=[RunTag(k, str(v)[:8000]) for k, v in self.tags.items()],
        )
        self.state = {"run_id": run_id, "sent_rows": 0, "ended": None}
        self._save_state()

    def _start_monitor(self) -> None:
        try:
            import psutil  # noqa: F401  (MLflow's monitor needs it; without it, no system metrics)
        except ImportError:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=SYSTEM_METRICS_INTERVAL_S,
            resume_logging=True,
            tracking_uri=tracking_uri(),
        )
        self.monitor.start()

    def _save_state(self) -> None:
        if self._frozen:
            return
        with contextlib.suppress(OSError):  # a full disk must not turn tracking into a crash
            runs.write_json(self.run_dir / STATE_FILE, self.state)

    def _reread_state(self) -> None:
        """What tracking.json says was sent, if it says more than this process knows (its
        writer held the run's claim, as this one does now)."""
        disk = _read_state(self.run_dir, self.log)
        if disk.get("run_id") == self.run_id and disk.get("sent_rows", 0) > self.state.get(
            "sent_rows", 0
        ):
            self.state = disk

    # ---- what run.py calls ----------------------------------------------------------------------
    def log_history(self, history: list[dict], *, force: bool = False) -> None:
        """Send every history row the MLflow run has not received yet (one log_batch call)."""
        if self.enabled and not self.ready:
            self._guard("open the MLflow run", self._open, force=force)
        if self.ready:
            self._guard("log metrics", self._send_rows, history, force=force)

    def _send_rows(self, history: list[dict]) -> None:
        from mlflow.entities import Metric

        self._reread_state()
        start = self.state.get("sent_rows", 0)
        if start >= len(history):
            return
        now = int(time.time() * 1000)
        batch = [
            Metric(k, float(v), now, int(row["epoch"]))
            for row in history[start:]
            for k, v in row.items()
            if k not in ("epoch", "step") and v is not None
        ]
        self.client.log_batch(self.run_id, metrics=batch)
        self.state["sent_rows"] = len(history)
        self._save_state()

    def end(
        self,
        status: str,
        history: list[dict],
        *,
        metrics: dict | None = None,
        tags: dict | None = None,
        artifacts: list[Path] = (),
        error: str | None = None,
    ) -> None:
        """Send what is missing, attach files, end the MLflow run: FINISHED, KILLED or FAILED.

        Tried once more whatever the retry back-off (a short outage near the end must not leave
        the run RUNNING with half its epochs); what still did not arrive is written to
        tracking.json as `missing`, for `sync` (or the next resume) to send."""
        self.log_history(history, force=True)
        if self.ready:
            self._guard(
                "end the MLflow run",
                self._end,
                status,
                metrics or {},
                tags or {},
                list(artifacts),
                error,
                force=True,
            )
        if self.enabled:
            sent, missing = self.state.get("sent_rows", 0), []
            if sent < len(history):
                missing.append(f"history rows {sent + 1}-{len(history)}")
            if self.state.get("ended") != status:
                missing.append(f"end {status}")
            if missing or self.state.get("missing"):
                self.state = {"run_id": None, "sent_rows": 0, "ended": None, **self.state}
                self.state["missing"] = missing
                self._save_state()
        self.close()

    def abandon(self, reason: str) -> None:
        """The run directory is another's now (claim.LostClaim): end this MLflow run FAILED with
        `reason`, and write nothing more to the directory (not even tracking.json)."""
        self._frozen = True
        if self.ready:
            self._guard("end the MLflow run", self._end, "FAILED", {}, {}, [], reason, force=True)
        self.close()

    def _end(
        self, status: str, metrics: dict, tags: dict, artifacts: list[Path], error: str | None
    ) -> None:
        from mlflow.entities import Metric, RunTag

        if self.state.get("ended") == status:
            return
        step = int(metrics.get("steps", 0))
        now = int(time.time() * 1000)
        numbers = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if error:
            tags = {**tags, "error": error.strip().splitlines()[-1][:4000]}
        self.client.log_batch(
            self.run_id, metrics=numbers, tags=[RunTag(k, str(v)[:8000]) for k, v in tags.items()]
        )
        for path in artifacts:
            if path.is_file() and path.stat().st_size <= ARTIFACT_MAX_BYTES:
                self.client.log_artifact(self.run_id, str(path))
        if error:
            self.client.log_text(self.run_id, error, "traceback.txt")
        self.client.set_terminated(self.run_id, status=status)
        self.state["ended"] = status
        self._save_state()

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                self.monitor.finish()
            self.monitor = None


RUN_ID = re.compile(r"[0-9a-f]{32}")  # MLflow's run ids (uuid4().hex)
ENDED = (None, "FINISHED", "KILLED", "FAILED")


def _state_problem(state: object) -> str | None:
    """What is wrong with a parsed tracking.json, in our words (never its content), or None."""
    if not isinstance(state, dict):
        return "not a JSON object"
    run_id, sent, ended = state.get("run_id"), state.get("sent_rows", 0), state.get("ended")
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        return "its run_id is not 32 hex digits"
    if not isinstance(sent, int) or isinstance(sent, bool) or sent < 0:
        return "its sent_rows is not a count"
    if ended not in ENDED:
        return "its ended is not an MLflow end status"
    missing = state.get("missing", [])
    if not (isinstance(missing, list) and all(isinstance(m, str) for m in missing)):
        return "its missing is not a list of notes"
    return None


def _read_state(run_dir: Path, log: logging.Logger | None = None) -> dict:
    """tracking.json, checked; {} (a fresh start) if missing, and with a warning if unusable:
    not a plain file of the run directory's owner, not JSON, or a value of the wrong form."""
    path = Path(run_dir) / STATE_FILE
    try:
        state = json.loads(runs.read_trusted(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        state, problem = None, f"unreadable ({type(exc).__name__})"
    else:
        problem = _state_problem(state)
    if problem is None:
        return state
    if log is not None:
        log.warning("%s ignored: %s; a new MLflow run is started", path, problem)
    return {}


def _history_rows(run_dir: Path) -> list[dict]:
    """history.csv as the rows run.py kept in memory (read by analysis.py, the one reader)."""
    from .analysis import read_history

    try:
        columns = read_history((run_dir / runs.HISTORY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = list(columns)
    return [
        dict(zip(names, map(float, values), strict=True))
        for values in zip(*columns.values(), strict=True)
    ]


MLFLOW_STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


def sync(run_dir: Path, log: logging.Logger) -> bool | None:
    """Send to MLflow what a run directory holds and its tracker missed; True if all arrived,
    None if a live job holds the directory (it sends its own metrics: skipped).

    Holds the run's claim while it works, like a training job: no job starts meanwhile, and no
    second sync, so each row is sent once and the directory has one MLflow run."""
    from .claim import Busy, claim

    try:
        held = claim(run_dir)
    except Busy as exc:
        log.info("skipped %s: %s (that job sends its own metrics)", run_dir, exc)
        return None
    except OSError as exc:  # e.g. a colleague's directory without a .lock: cannot claim it
        log.warning("skipped %s: cannot claim it (%s)", run_dir, exc.strerror or exc)
        return False
    with held:
        return _sync_held(run_dir, log)


def _sync_held(run_dir: Path, log: logging.Logger) -> bool:
    try:
        config = json.loads(runs.read_trusted(run_dir / runs.CONFIG))
    except (OSError, ValueError) as exc:
        log.warning("skipped %s: config.json unreadable (%s)", run_dir, type(exc).__name__)
        return False
    status = runs.read_status(run_dir)
    tracker = Tracker(
        run_dir,
        enabled=True,
        experiment=config.get("experiment", DEFAULT_EXPERIMENT),
        run_name=run_dir.name,
        log=log,
        params=run_params(config),
        tags={"run_dir": str(run_dir), "synced_later": "true"},
        system_metrics=False,
        training=False,
    )
    history = _history_rows(run_dir)
    if status in MLFLOW_STATUS:
        tracker.end(
            MLFLOW_STATUS[status],
            history,
            metrics=runs.read_metrics(run_dir),
            artifacts=[run_dir / runs.CONFIG, run_dir / runs.HISTORY],
        )
    else:
        tracker.log_history(history)
    state = tracker.state
    return (
        bool(state.get("run_id"))
        and state.get("sent_rows", 0) >= len(history)
        and (status not in MLFLOW_STATUS or state.get("ended") == MLFLOW_STATUS[status])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}.tracking",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "command",
        choices=("init", "uri", "sync"),
        help="init: create the DB and the experiment; uri: print the tracking URI; "
        "sync: send what run directories hold and MLflow missed",
    )
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help="sync: run directories, or folders holding them (e.g. results/sweep)",
    )
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
    args = p.parse_args(argv)
    if args.command == "uri":
        print(tracking_uri())
        return 0
    if args.command == "init":
        experiment_id = init(args.experiment)
        print(
            f"MLflow ready: {tracking_uri()} (experiment {args.experiment!r}, id {experiment_id})"
        )
        return 0
    log = logging.getLogger("tracking.sync")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_dirs = sorted({c.parent for path in args.paths for c in path.rglob(runs.CONFIG)})
    if not run_dirs:
        p.error("sync: no run directory (a folder with config.json) under the given paths")
    done = {d: sync(d, log) for d in run_dirs}
    missing = [str(d) for d, ok in done.items() if ok is False]
    held = [str(d) for d, ok in done.items() if ok is None]
    print(
        f"synced {len(run_dirs) - len(missing) - len(held)} of {len(run_dirs)} run directories "
        f"to {tracking_uri()}"
        + (f"; skipped, held by a live job: {', '.join(held)}" if held else "")
        + (f"; not reached: {', '.join(missing)}" if missing else "")
    )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
