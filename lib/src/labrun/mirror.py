"""MLflow, a mirror of the run directory: one MLflow run per run directory, built from its files.

The run directory (config.json, status, history.csv, metrics.json) is the record; MLflow shows it.
- One path, `mirror`, makes the MLflow run equal the directory: status, params, every metric
  row, tags, artifacts. MLflow cannot delete a metric row, so a run holding rows the directory
  does not is rebuilt: the old run deleted, a new one with the same name, start time, tags,
  system metrics and the directory's numbers. A job's Tracker calls it (tracking.py), and so do
  the sweep's follower and `sync` (follower.py).
- Tracking URI: `MLFLOW_TRACKING_URI`, else an absolute `sqlite:///<project root>/mlflow.db`
  (artifacts next to it, in `mlruns/`); an HTTP server that does not answer fails within about
  5 s x 2 tries (HTTP_DEFAULTS, unless you set them).
- `tracking.json` in the run directory says which MLflow run it is, what only the job knew
  (params, tags, start and end times, the error) and what MLflow has (`sent_rows`, `ended`);
  checked before use (read_state). One writer per run directory: the job, `sync` and the
  follower all hold the run's claim (claim.py), so a directory never gets two MLflow runs.

Imports neither torch nor mlflow at module level (mlflow costs ~1.5 s to import).
"""

from __future__ import annotations

import collections
import contextlib
import csv
import functools
import hashlib
import json
import logging
import os
import re
import stat
import time
from pathlib import Path

from . import runs
from .config import DEFAULT_EXPERIMENT, PROJECT_ROOT

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


@functools.cache  # per tracking URI: one client for every sync of a follower or a process
def mlflow_client(uri: str):
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # MLflow's INFO lines (creating tables, system metrics started) are not the job's news, and
    # a failing DB call logs its whole traceback (the system-metrics thread warns on its own):
    # the Tracker already says it once, in one line.
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("mlflow.store.db.utils", "mlflow.system_metrics"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    from filelock import FileLock  # flock: the kernel releases it if this process dies
    from mlflow.tracking import MlflowClient

    db = _sqlite_path(uri)
    if db is not None:  # SQLite would create it 0644 whatever the umask; an empty file is a
        # valid empty database, so it is made here with what the umask allows (and its journal
        # copies the mode).
        db.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    # Creating the client opens the store, which creates or migrates the schema: the schema
    # lock serialises that across processes (concurrent first migrations of one sqlite file
    # corrupt it).
    with FileLock(f"{db}.lock") if db else contextlib.nullcontext():
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store (and schema) exists after this
    return client


def init(experiment: str = DEFAULT_EXPERIMENT, client=None) -> str:
    """Create the DB (schema) and the experiment if missing; return the experiment id.
    Artifacts go to `mlruns/` next to a sqlite DB, to the server's default for anything else."""
    client = client or mlflow_client(tracking_uri())
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    db = _sqlite_path(tracking_uri())
    try:
        return client.create_experiment(
            experiment, artifact_location=(db.parent / "mlruns").as_uri() if db else None
        )
    except Exception:  # another job created it between our two calls
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def run_params(config: dict) -> dict:
    """The MLflow params of a run: its experiment-defining config values and `experiment_keys`
    (analysis.load_runs_from_mlflow tells them apart by it)."""
    keys = list(config.get("experiment_keys", []))
    values = {k: config[k] for k in keys if k in config}
    # As config.json holds them (a tuple is a list there): a live run's params then equal what
    # the follower or `sync` sends from the directory, and a mirror never rebuilds it for that.
    values = json.loads(json.dumps(runs._finite_or_none(values), default=str))
    return {**values, "experiment_keys": keys}


def as_texts(values: dict, limit: int) -> dict[str, str]:
    """Params and tags as MLflow stores them: strings, cut to its limits."""
    return {str(k): str(v)[:limit] for k, v in values.items()}


def system_monitor(run_id: str):
    """MLflow's monitor of this machine (psutil; GPU utilisation and memory where NVML answers),
    started, logging into `run_id`."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id,
        sampling_interval=SYSTEM_METRICS_INTERVAL_S,
        resume_logging=True,
        tracking_uri=tracking_uri(),
    )
    monitor.start()
    return monitor


def save_state(run_dir: Path, state: dict) -> None:
    with contextlib.suppress(OSError):  # a full disk must not turn tracking into a crash
        runs.write_json(run_dir / runs.TRACKING, state)


# ---- the mirror --------------------------------------------------------------------------------
MLFLOW_STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


def expected_metrics(history: list[dict], summary: dict) -> dict[str, list]:
    """Every metric row the MLflow run of these files holds: {key: [(step, value)]}: one per
    history row and column (step = epoch), and one per number of metrics.json (step = steps)."""
    rows: dict[str, list] = {}
    for row in history:
        for key, value in row.items():
            if key not in ("epoch", "step") and value is not None:
                rows.setdefault(key, []).append((int(row["epoch"]), float(value)))
    step = summary.get("steps") if type(summary.get("steps")) is int else 0  # as the job wrote it
    for key, value in summary.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            rows.setdefault(key, []).append((step, float(value)))
    return rows


def _counts(rows) -> collections.Counter:
    """Rows as history.csv writes them (6 significant digits): equal here means equal there."""
    return collections.Counter((step, f"{value:.6g}") for step, value in rows)


def _history_rows(run_dir: Path) -> list[dict]:
    """history.csv as rows of numbers, without its empty cells (run.py never sent them)."""
    try:
        text = runs.read_trusted(run_dir / runs.HISTORY, max_bytes=1 << 30)
    except (OSError, ValueError):
        return []
    rows = []
    for record in csv.DictReader(text.splitlines()):
        with contextlib.suppress(ValueError):
            row = {k: float(v) for k, v in record.items() if k and v not in ("", None)}
            if "epoch" in row:
                rows.append(row)
    return rows


def _artifact_files(run_dir: Path, state: dict, status: str) -> list[Path]:
    """The files to attach: plain files of the run directory's owner, in it (never elsewhere)."""
    names = state.get("artifacts")
    if names is None:  # a directory tracking.json does not describe: what run.py attaches
        names = [runs.CONFIG, runs.HISTORY] + ([runs.BEST_MODEL] if status == "FINISHED" else [])
    found = []
    for name in (n for n in names if isinstance(n, str) and Path(n).name == n):
        with contextlib.suppress(OSError):
            info = (run_dir / name).lstat()
            mine = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
            if mine and info.st_size <= ARTIFACT_MAX_BYTES:
                found.append(run_dir / name)
    return found


def fingerprint(run_dir: Path, state: dict) -> str:
    """A hash of what the mirror reads: unchanged since the last mirror, MLflow needs nothing."""
    files = []
    for name in (runs.CONFIG, runs.STATUS, runs.HISTORY, runs.METRICS, runs.BEST_MODEL):
        with contextlib.suppress(OSError):
            info = (Path(run_dir) / name).stat()
            files.append((name, info.st_size, info.st_mtime_ns))
    notes = ("params", "tags", "end_tags", "artifacts", "error", "started_at", "ended_at")
    text = json.dumps([files, {k: state.get(k) for k in notes}], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def mirror(
    client,
    run_dir: Path,
    state: dict,
    status: str | None = None,
    summary: dict | None = None,
    known: int | None = None,
    *,
    save: bool = True,
    by_tag: bool | None = None,
) -> list[str]:
    """Make the MLflow run of `run_dir` equal the directory; return what was changed. Each step
    is idempotent, so a kill anywhere is repaired by the next mirror.

    status and summary default to the directory's files (the job passes RUNNING and {} at each
    epoch). `state` (tracking.json) is updated in place, and saved after each step that must not
    be repeated unless `save=False` (the follower's live mirror of a job that writes it itself).
    `known`: history rows the live job sent itself (not read back). `by_tag`: whether a run
    found by its run_dir tag is this directory's [not for a RUNNING mirror]."""
    from mlflow.entities import Metric, RunTag

    run_dir = Path(run_dir)
    # A run still "running" whose claim we hold has lost its job: KILLED, as the sweep would
    # have marked it.
    status = status or MLFLOW_STATUS.get(runs.read_status(run_dir) or "", "KILLED")
    history = _history_rows(run_dir)
    if summary is None:
        summary = runs.read_metrics(run_dir) or {}
    params = state.get("params")
    if params is None:  # no job noted them (tracking was never on here): the config's
        config = json.loads(runs.read_trusted(run_dir / runs.CONFIG))
        params = as_texts(run_params(config), 6000)
        state.setdefault("experiment", config.get("experiment", DEFAULT_EXPERIMENT))
    tags = {"run_dir": str(run_dir), **state.get("tags", {}), **state.get("end_tags", {})}
    if isinstance(summary.get("stop_reason"), str):
        tags["stop_reason"] = summary["stop_reason"]
    error = state.get("error")
    if error and status == "FAILED":
        tags["error"] = error.strip().splitlines()[-1][:4000]
    expected = expected_metrics(history, summary)
    changes: list[str] = []

    # A live job never adopts a run by its tag: that run may be a job's that lost the claim.
    by_tag = status != "RUNNING" if by_tag is None else by_tag
    run = _current_run(client, run_dir, state, changes, by_tag=by_tag)
    conflicts, logged = [], {}
    if run is not None and known is not None:  # what this job has not sent yet, nothing read
        expected = expected_metrics(history[known:], summary)
    elif run is not None:
        logged = {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
            if not key.startswith("system/")
        }
        for key in sorted(logged):
            if extra := _counts(logged[key]) - _counts(expected.get(key, [])):
                steps = sorted({step for step, _ in extra})
                conflicts.append(f"{key} has rows the run directory does not (steps {steps})")
        if differ := sorted(
            k for k in {**params, **run.data.params} if params.get(k) != run.data.params.get(k)
        ):
            conflicts.append(f"its params {differ} are not the directory's")
    if run is None or conflicts:
        old, run, logged = run, _new_run(client, run_dir, state, params, run), {}
        state.update(run_id=run.info.run_id, sent_rows=0, ended=None)
        if old is None:
            changes.append(f"created MLflow run {run.info.run_id}")
        else:
            changes.append(
                f"replaced MLflow run {old.info.run_id} by {run.info.run_id} (the old one is "
                f"deleted): {'; '.join(conflicts)}"
            )
        if save:
            save_state(run_dir, state)
    run_id = state["run_id"] = run.info.run_id

    new_tags = [RunTag(k, v) for k, v in tags.items() if run.data.tags.get(k) != v]
    # A row sent after the fact is stamped with the run's start (MLflow's x axis is the step;
    # this keeps "relative time" plots within the run); a live one, with now.
    now = int(time.time() * 1000)
    row_time = now if status == "RUNNING" else _ms(state.get("started_at")) or now
    new_rows = []
    for key, rows in expected.items():
        wanted = _counts(rows) - _counts(logged.get(key, []))
        for step, value in rows:
            if wanted[(step, f"{value:.6g}")] > 0:
                wanted[(step, f"{value:.6g}")] -= 1
                new_rows.append(Metric(key, value, row_time, step))
    if new_tags or new_rows:  # one transaction: all of it arrives, or none
        client.log_batch(run_id, metrics=new_rows, tags=new_tags)
        changes.append(f"sent {len(new_rows)} metric rows, {len(new_tags)} tags")
    state["sent_rows"] = len(history)

    if status != "RUNNING":
        have = {f.path: f.file_size for f in client.list_artifacts(run_id)}
        for path in _artifact_files(run_dir, state, status):
            if new_rows or have.get(path.name) != path.stat().st_size:
                client.log_artifact(run_id, str(path))
                changes.append(f"attached {path.name}")
        if error and status == "FAILED" and "traceback.txt" not in have:
            client.log_text(run_id, error, "traceback.txt")
            changes.append("attached traceback.txt")
    if run.info.status != status:  # a resumed run RUNNING again, or the end (tracking.json's time)
        if status == "RUNNING":
            client.update_run(run_id, status)
        else:
            client.set_terminated(run_id, status=status, end_time=_ms(state.get("ended_at")))
        changes.append(f"status {run.info.status} -> {status}")
    state["ended"] = None if status == "RUNNING" else status
    state["mirrored"] = fingerprint(run_dir, state)
    if save:
        save_state(run_dir, state)
    return changes


def _ms(seconds: object) -> int | None:
    """A time of tracking.json (seconds, if it holds one) in MLflow's milliseconds."""
    return int(seconds * 1000) if isinstance(seconds, int | float) else None


def _current_run(client, run_dir: Path, state: dict, changes: list[str], by_tag: bool):
    """The live MLflow run of this directory: tracking.json's, else (`by_tag`) one tagged with
    its path (a lost tracking.json), else None."""
    from mlflow.exceptions import MlflowException

    if run_id := state.get("run_id"):
        try:
            run = client.get_run(run_id)
        except MlflowException as exc:  # gone, or unreachable (raised: nothing is changed)
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is not None and run.info.lifecycle_stage == "active":
            if _mirrors(run, run_dir):
                return run
            # tracking.json names another directory's run (copied, or crafted): that run is
            # not ours to rebuild or delete.
            changes.append(f"MLflow run {run_id} mirrors {run.data.tags.get('run_dir')}: not used")
        else:
            changes.append(f"MLflow run {run_id} is gone")
        state["run_id"] = None
    experiment = client.get_experiment_by_name(state.get("experiment", DEFAULT_EXPERIMENT))
    where = state.get("tags", {}).get("run_dir", str(run_dir))  # as its job wrote it
    if not by_tag or experiment is None or "'" in where:
        return None
    found = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.run_dir = '{where}'", max_results=1
    )
    if not found or not _mirrors(found[0], run_dir):
        return None
    changes.append(f"found MLflow run {found[0].info.run_id} by its run_dir tag")
    return found[0]


def _mirrors(run, run_dir: Path) -> bool:
    """Whether MLflow's `run` is the one of `run_dir`: its run_dir tag names this directory."""
    tag = run.data.tags.get("run_dir")
    return tag is not None and Path(tag).resolve() == Path(run_dir).resolve()


def _new_run(client, run_dir: Path, state: dict, params: dict, old=None):
    """A new MLflow run for the directory, with its params; in place of `old` (its start, tags
    and system metrics), deleted first: a kill between the two leaves no second run."""
    from mlflow.entities import Metric, Param

    experiment_id = init(state.get("experiment", DEFAULT_EXPERIMENT), client)
    start_ms, tags, system = _ms(state.get("started_at")), dict(state.get("tags", {})), []
    if old is not None:
        experiment_id, start_ms = old.info.experiment_id, old.info.start_time
        tags = {**{k: v for k, v in old.data.tags.items() if not k.startswith("mlflow.")}, **tags}
        system = [
            Metric(m.key, m.value, m.timestamp, m.step)
            for key in old.data.metrics
            if key.startswith("system/")
            for m in client.get_metric_history(old.info.run_id, key)
        ]
        client.delete_run(old.info.run_id)
    run_id = client.create_run(experiment_id, start_ms, tags, run_dir.name).info.run_id
    client.log_batch(
        run_id, metrics=system, params=[Param(k, v) for k, v in sorted(params.items())]
    )
    return client.get_run(run_id)


# ---- tracking.json -------------------------------------------------------------------------------
RUN_ID = re.compile(r"[0-9a-f]{32}")  # MLflow's run ids (uuid4().hex)
# What each key of tracking.json must be, if present: (in words, test).
STATE_FORMS = {
    "run_id": ("32 hex digits", lambda v: v is None or isinstance(v, str) and RUN_ID.fullmatch(v)),
    "sent_rows": ("a count", lambda v: type(v) is int and v >= 0),
    "ended": ("an MLflow end status", lambda v: v in (None, *MLFLOW_STATUS.values())),
    **dict.fromkeys(("params", "tags", "end_tags"), ("a map", lambda v: isinstance(v, dict))),
    "artifacts": ("a list", lambda v: isinstance(v, list)),  # of names: see _artifact_files
    **dict.fromkeys(("started_at", "ended_at"), ("a time", lambda v: isinstance(v, int | float))),
    **dict.fromkeys(
        ("experiment", "error", "mirrored"), ("a string", lambda v: isinstance(v, str))
    ),
}


def read_state(run_dir: Path, log: logging.Logger | None = None) -> dict:
    """tracking.json, checked; {} (a fresh start) if missing, and with a warning if unusable
    (said in our words, never its content)."""
    path = Path(run_dir) / runs.TRACKING
    try:
        state = json.loads(runs.read_trusted(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        state, problem = None, f"unreadable ({type(exc).__name__})"
    else:
        problem = None if isinstance(state, dict) else "not a JSON object"
        for key, (form, ok) in STATE_FORMS.items():
            if problem is None and key in state and not ok(state[key]):
                problem = f"its {key} is not {form}"
    if problem is None:
        return state
    if log is not None:
        log.warning("%s ignored: %s; a new MLflow run is started", path, problem)
    return {}
