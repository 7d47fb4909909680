"""MLflow mirrors the run directory (labrun.mirror): after kills, a full disk, a deleted
metrics.json and the re-run (or `sync`, or the sweep's follower), the MLflow run's status, params
and metric rows equal the directory's files, compared field by field here with a reader of our
own (not mirror.py's). Real processes, real signals, a real sqlite store; the full disk is a
real tmpfs (root).

The fast tests build run directories by hand (the files run.py writes); the slow ones train.
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEADLINE, ROOT, cli_command, popen_cli, wait_while_running

from labrun import follower as tracking_cli  # `python -m labrun.tracking sync|follow`
from labrun import mirror, tracking
from labrun.claim import claim

IS_ROOT = os.geteuid() == 0
STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
TIMINGS = {
    "epoch_time_s",
    "samples_per_sec",
    "wall_time_s",
    "train_time_s",
    "compile_time_s",
    "peak_mem_bytes",
}


# ---- the two views compared --------------------------------------------------------------------
def directory_view(run_dir: Path) -> dict:
    """What the run directory says: status, params, every metric row {key: [(step, value)]}."""
    status = STATUS.get((run_dir / "status").read_text().strip(), "KILLED")
    config = json.loads((run_dir / "config.json").read_text())
    keys = config["experiment_keys"]
    params = {k: str(config[k]) for k in keys if k in config} | {"experiment_keys": str(keys)}
    rows = collections.defaultdict(list)
    if (run_dir / "history.csv").exists():
        with open(run_dir / "history.csv", newline="") as f:
            for record in csv.DictReader(f):
                for key, value in record.items():
                    if key not in ("epoch", "step") and value != "":
                        rows[key].append((int(float(record["epoch"])), f"{float(value):.6g}"))
    if (run_dir / "metrics.json").exists():
        summary = json.loads((run_dir / "metrics.json").read_text())
        for key, value in summary.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                rows[key].append((summary["steps"], f"{float(value):.6g}"))
    return {"status": status, "params": params, "metrics": {k: sorted(v) for k, v in rows.items()}}


def mlflow_runs_of(uri: str, run_dir: Path) -> list:
    """The active MLflow runs tagged with this run directory (as its job named it)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    tag = str(run_dir)
    if (run_dir / "tracking.json").exists():
        tag = (
            json.loads((run_dir / "tracking.json").read_text()).get("tags", {}).get("run_dir", tag)
        )
    return client.search_runs(ids, filter_string=f"tags.run_dir = '{tag}'")


def mlflow_view(uri: str, run_dir: Path) -> dict:
    """The same, from the one MLflow run of `run_dir` (system metrics apart)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = mlflow_runs_of(uri, run_dir)
    assert len(found) == 1, [r.info.run_id for r in found]  # one run per directory
    run = found[0]
    state = json.loads((run_dir / "tracking.json").read_text())
    assert state["run_id"] == run.info.run_id
    metrics = {
        key: sorted(
            (m.step, f"{m.value:.6g}") for m in client.get_metric_history(run.info.run_id, key)
        )
        for key in run.data.metrics
        if not key.startswith("system/")
    }
    return {"status": run.info.status, "params": run.data.params, "metrics": metrics}


def assert_mirrors(uri: str, run_dir: Path) -> None:
    want, got = directory_view(run_dir), mlflow_view(uri, run_dir)
    assert got["status"] == want["status"]
    assert got["params"] == want["params"]
    assert sorted(got["metrics"]) == sorted(want["metrics"])
    for key, rows in want["metrics"].items():
        assert got["metrics"][key] == rows, key  # every row once: no lost attempt, no repeat


# ---- run directories built by hand ---------------------------------------------------------------
def make_run_dir(results: Path, history: list[dict], *, status="finished", summary=None) -> Path:
    """A run directory as run.py leaves it (config.json, status, history.csv, metrics.json)."""
    run_dir = results / "digits_width=8-0123abcd"
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "width": 8,
        "lr": 0.01,
        "experiment": "mirror-test",
        "experiment_keys": ["lr", "width"],
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "status").write_text(status + "\n")
    write_history(run_dir, history)
    if summary is not None:
        (run_dir / "metrics.json").write_text(json.dumps(summary))
    return run_dir


def write_history(run_dir: Path, history: list[dict]) -> None:
    names = list(history[0])
    lines = [",".join(names)] + [",".join(f"{row[k]:.6g}" for k in names) for row in history]
    (run_dir / "history.csv").write_text("\n".join(lines) + "\n")


def history_of(losses: list[float]) -> list[dict]:
    return [
        {"epoch": i + 1, "step": 10 * (i + 1), "val_loss": loss, "val_acc": 1 - loss / 3}
        for i, loss in enumerate(losses)
    ]


SUMMARY = {"test_acc": 0.5, "test_loss": 1.25, "steps": 30, "stop_reason": "max_epochs"}


@pytest.fixture
def sync(caplog):
    """sync(*paths): `python -m labrun.tracking sync PATHS` (in this process: mlflow is imported
    once); what it said."""

    def call(*paths: Path) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tracking.sync"):
            assert tracking_cli.main(["sync", *map(str, paths)]) == 0
        return caplog.text

    return call


def test_sync_replaces_a_run_holding_a_lost_attempts_rows(env, tmp_path, sync):
    uri = env["MLFLOW_TRACKING_URI"]
    run_dir = make_run_dir(tmp_path, history_of([2.16253, 1.5, 1.2]), summary=SUMMARY)
    assert "created MLflow run" in sync(run_dir)
    assert_mirrors(uri, run_dir)
    first = mlflow_runs_of(uri, run_dir)[0].info.run_id
    # A hard kill lost epochs 2-3 since the last checkpoint; the re-run trained them again.
    write_history(run_dir, history_of([2.16253, 1.49, 1.21]))
    printed = sync(run_dir)
    assert f"replaced MLflow run {first}" in printed and "val_loss has rows" in printed, printed
    assert_mirrors(uri, run_dir)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(first).info.lifecycle_stage == "deleted"  # in the UI's "Deleted" list
    new = mlflow_runs_of(uri, run_dir)[0]
    assert new.info.run_name == run_dir.name
    assert "replaced" not in sync(run_dir) and "sent" not in sync(run_dir)  # nothing left to do


def test_sync_finishes_a_finished_run_left_running_and_logs_summaries_once(env, tmp_path, sync):
    from mlflow.tracking import MlflowClient

    uri = env["MLFLOW_TRACKING_URI"]
    run_dir = make_run_dir(tmp_path, history_of([2.0, 1.5]), summary=SUMMARY)
    sync(run_dir)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    MlflowClient(tracking_uri=uri).update_run(run_id, status="RUNNING")  # a kill left it so
    printed = sync(run_dir)
    assert "status RUNNING -> FINISHED" in printed, printed
    assert_mirrors(uri, run_dir)


def test_a_kill_inside_the_final_mlflow_call_is_completed_by_the_next_sync(env, tmp_path, sync):
    # SIGKILL inside set_terminated (the rows, summaries and files are in; the status is not).
    uri = env["MLFLOW_TRACKING_URI"]
    run_dir = make_run_dir(tmp_path, history_of([2.0, 1.5, 1.0]), summary=SUMMARY)
    killer = (
        "import os, signal, sys\n"
        "from mlflow.tracking import MlflowClient\n"
        "MlflowClient.set_terminated = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from labrun import follower\n"
        "sys.exit(follower.main(['sync', sys.argv[1]]))\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", killer, str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert mlflow_runs_of(uri, run_dir)[0].info.status == "RUNNING"
    printed = sync(run_dir)
    assert "status RUNNING -> FINISHED" in printed and "replaced" not in printed, printed
    assert_mirrors(uri, run_dir)  # the 3 summaries once


def test_a_lost_tracking_json_finds_its_run_instead_of_a_second_one(env, tmp_path, sync):
    uri = env["MLFLOW_TRACKING_URI"]
    run_dir = make_run_dir(tmp_path, history_of([2.0, 1.5]), summary=SUMMARY)
    sync(run_dir)
    (run_dir / "tracking.json").unlink()
    assert "by its run_dir tag" in sync(run_dir)
    assert_mirrors(uri, run_dir)


def test_a_live_job_reads_its_rows_back_once_not_every_epoch(env, tmp_path, monkeypatch):
    """Each epoch sends only the rows past those the job sent itself; MLflow's rows are read back
    by the job's first mirror (a resume's check) and by its end, which makes MLflow equal the
    directory. Reading them back every epoch made a long run's tracking quadratic."""
    from mlflow import MlflowClient

    reads = collections.Counter()
    history_of_key = MlflowClient.get_metric_history

    def counted(self, run_id, key, *args, **kwargs):
        reads[key] += 1
        return history_of_key(self, run_id, key, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "get_metric_history", counted)
    losses = [2.0 - 0.05 * i for i in range(30)]
    run_dir = make_run_dir(tmp_path, history_of(losses[:1]), status="running")
    tracker = tracking.Tracker(
        run_dir, enabled=True, experiment="mirror-test",
        log=logging.getLogger("test"), system_metrics=False,
        params=mirror.run_params(json.loads((run_dir / "config.json").read_text())),
    )  # fmt: skip
    for epoch in range(2, len(losses) + 1):
        write_history(run_dir, history_of(losses[:epoch]))
        tracker.log_history()
    assert not reads, "read back while training"  # the first mirror created the run: none yet
    tracker.end("FINISHED", metrics=SUMMARY)
    assert reads == {"val_loss": 1, "val_acc": 1}, reads  # the end's full comparison
    (run_dir / "metrics.json").write_text(json.dumps(SUMMARY))
    (run_dir / "status").write_text("finished\n")
    assert_mirrors(env["MLFLOW_TRACKING_URI"], run_dir)


def start_follower(results: Path) -> subprocess.Popen:
    """The sweep's follower on `results`, as run.sh starts it: it follows until stdin closes."""
    return subprocess.Popen(
        [sys.executable, "-m", "labrun.tracking", "follow", str(results)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_follower_mirrors_a_run_once_its_claim_is_released(env, tmp_path):
    uri = env["MLFLOW_TRACKING_URI"]
    results = tmp_path / "results"
    follower = start_follower(results)
    try:
        # A job (this process) holds the claim while it writes the directory and ends.
        held = claim(results / "digits_width=8-0123abcd")
        run_dir = make_run_dir(results, history_of([2.0, 1.5]), summary=SUMMARY)
        started = time.time()
        state = {"run_id": None, "started_at": started - 30, "ended_at": started, "tags": {}}
        state |= {"params": {"lr": "0.01", "width": "8", "experiment_keys": "['lr', 'width']"}}
        state |= {"experiment": "mirror-test"}
        (run_dir / "tracking.json").write_text(json.dumps(state))
        time.sleep(3 * tracking_cli.FOLLOW_POLL_S)  # passes over it while it is held
        assert mlflow_runs_of(uri, run_dir) == []
        held.release()
        deadline = time.monotonic() + DEADLINE
        while not mlflow_runs_of(uri, run_dir) or "mirrored" not in (
            json.loads((run_dir / "tracking.json").read_text())
        ):
            assert follower.poll() is None, follower.communicate()
            assert time.monotonic() < deadline, "the follower did not mirror the run in time"
            time.sleep(0.1)
        assert follower.poll() is None  # it follows on until the sweep closes its stdin
    finally:
        out, _ = follower.communicate(timeout=DEADLINE)
    assert follower.returncode == 0, out
    assert "created MLflow run" in out, out
    assert_mirrors(uri, run_dir)


def test_the_follower_claims_no_run_the_sweep_may_start(env, tmp_path):
    # An interrupted run from an earlier sweep is the sweep's to resume: the follower leaves it
    # until the sweep ends (stdin closes), then mirrors it.
    uri = env["MLFLOW_TRACKING_URI"]
    results = tmp_path / "results"
    run_dir = make_run_dir(results, history_of([2.0]), status="interrupted")
    (run_dir / "tracking.json").write_text(json.dumps({"started_at": time.time() - 5}))
    follower = start_follower(results)
    time.sleep(3 * tracking_cli.FOLLOW_POLL_S)
    assert mlflow_runs_of(uri, run_dir) == []
    out, _ = follower.communicate(timeout=DEADLINE)
    assert follower.returncode == 0, out
    assert_mirrors(uri, run_dir)


# ---- real jobs -----------------------------------------------------------------------------
KILLER = r"""
import os, runpy, signal, sys
point, run_py = sys.argv[1], sys.argv[2]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if point == "before-metrics-json":  # MLflow has ended the run; status and metrics.json not yet
    from labrun import runs
    write_status = runs.write_status
    runs.write_status = lambda d, s: die() if s == "finished" else write_status(d, s)
elif point == "in-set-terminated":  # inside the final MLflow call
    from mlflow.tracking import MlflowClient
    MlflowClient.set_terminated = die
sys.argv = [run_py, *sys.argv[3:]]
runpy.run_path(run_py, run_name="__main__")
"""


def run_py(*args, results: Path, data_dir: Path, env: dict, point: str | None = None):
    cmd = cli_command(*args, results_dir=results, data_dir=data_dir)
    if point is not None:
        cmd = [sys.executable, "-c", KILLER, point, *cmd[1:]]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def only_run_dir(results: Path) -> Path:
    (run_dir,) = [p for p in results.iterdir() if p.is_dir()]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-metrics-json", "in-set-terminated"])
def test_a_kill_at_the_end_of_a_live_run_is_mirrored_by_the_re_run(point, env, data_dir, tmp_path):
    uri, results = env["MLFLOW_TRACKING_URI"], tmp_path / "results"
    killed = run_py("--epochs", "2", results=results, data_dir=data_dir, env=env, point=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = only_run_dir(results)
    assert not (run_dir / "metrics.json").exists()
    again = run_py("--epochs", "2", results=results, data_dir=data_dir, env=env)
    assert again.returncode == 0, again.stderr
    assert_mirrors(uri, run_dir)  # FINISHED, each summary once


@pytest.mark.slow
def test_a_deleted_metrics_json_re_finishes_and_mlflow_follows(env, data_dir, tmp_path):
    uri, results = env["MLFLOW_TRACKING_URI"], tmp_path / "results"
    assert run_py("--epochs", "2", results=results, data_dir=data_dir, env=env).returncode == 0
    run_dir = only_run_dir(results)
    (run_dir / "metrics.json").unlink()
    again = run_py("--epochs", "2", results=results, data_dir=data_dir, env=env)
    assert again.returncode == 0, again.stderr
    assert_mirrors(uri, run_dir)


@pytest.mark.slow
def test_a_hard_kill_mid_run_then_the_re_run_mirrors_the_kept_epochs(env, data_dir, tmp_path):
    uri, results = env["MLFLOW_TRACKING_URI"], tmp_path / "results"
    proc = popen_cli("--epochs", "6", results_dir=results, data_dir=data_dir, env=env)
    state = lambda: [json.loads(p.read_text()) for p in results.glob("*/tracking.json")]  # noqa: E731
    wait_while_running(lambda: state() and state()[0].get("sent_rows", 0) >= 3, proc, 300)
    proc.kill()  # SIGKILL: epochs since the last checkpoint are lost
    proc.communicate()
    run_dir = only_run_dir(results)
    again = run_py("--epochs", "6", results=results, data_dir=data_dir, env=env)
    assert again.returncode == 0, again.stderr
    assert_mirrors(uri, run_dir)


@pytest.mark.slow
@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_a_full_disk_then_the_re_run_mirrors_the_directory(env, data_dir, tmp_path):
    uri, results = env["MLFLOW_TRACKING_URI"], tmp_path / "disk"
    results.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(results)])
    if mounted.returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        proc = popen_cli(
            "--epochs", "6", "--checkpoint-every", "0", results_dir=results, data_dir=data_dir,
            env=env,
        )  # fmt: skip
        rows = lambda: [p.read_text().count("\n") for p in results.glob("*/history.csv")]  # noqa: E731
        wait_while_running(lambda: rows() and rows()[0] >= 3, proc, 300)  # 2 epochs written
        filler = results / "filler"
        # The disk full: every later write fails ENOSPC.
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        filler.unlink()
        run_dir = only_run_dir(results)
        assert (run_dir / "status").read_text().strip() == "failed"
        again = run_py(
            "--epochs", "6", "--checkpoint-every", "0", results=results, data_dir=data_dir, env=env
        )
        assert again.returncode == 0, again.stderr
        assert_mirrors(uri, run_dir)
    finally:
        subprocess.run(["umount", "-l", str(results)])


@pytest.mark.slow
def test_sweep_mode_mirrors_what_live_tracking_records(env, data_dir, tmp_path):
    # The same job live (interactive) and in sweep mode (no MLflow in the job; the follower
    # mirrors it): MLflow holds the same params, metric keys and steps, values (timings apart),
    # tags, artifacts and status.
    from mlflow.tracking import MlflowClient

    uri = env["MLFLOW_TRACKING_URI"]
    client = MlflowClient(tracking_uri=uri)
    args = ("--epochs", "2")
    live = run_py(*args, results=tmp_path / "live", data_dir=data_dir, env=env)
    assert live.returncode == 0, live.stderr
    swept = tmp_path / "sweep"
    deferred = {**env, tracking.FOLLOWER_ENV: "1"}
    job = run_py(*args, results=swept, data_dir=data_dir, env=deferred)
    assert job.returncode == 0, job.stderr
    assert "MLflow: the sweep's follower" in job.stderr
    run_dir = only_run_dir(swept)
    assert mlflow_runs_of(uri, run_dir) == []  # the job never talked to MLflow
    follower = subprocess.run(
        [sys.executable, "-m", "labrun.tracking", "follow", str(swept)],
        stdin=subprocess.DEVNULL,  # the sweep has ended: mirror everything, then exit
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert follower.returncode == 0, follower.stdout + follower.stderr
    assert_mirrors(uri, run_dir)
    (a,) = mlflow_runs_of(uri, only_run_dir(tmp_path / "live"))
    (b,) = mlflow_runs_of(uri, run_dir)
    assert (a.info.status, a.info.run_name, a.data.params) == (
        b.info.status,
        b.info.run_name,
        b.data.params,
    )
    volatile = {"run_dir", "command"}  # the results folder is in them
    assert {k: v for k, v in a.data.tags.items() if k not in volatile} == {
        k: v for k, v in b.data.tags.items() if k not in volatile
    }
    keys = lambda run: {k for k in run.data.metrics if not k.startswith("system/")}  # noqa: E731
    assert keys(a) == keys(b)
    for key in keys(a):
        rows = [
            [(m.step, f"{m.value:.6g}") for m in client.get_metric_history(r.info.run_id, key)]
            for r in (a, b)
        ]
        if key in TIMINGS:
            rows = [[step for step, _ in r] for r in rows]
        assert sorted(rows[0]) == sorted(rows[1]), key
    names = lambda run: sorted(f.path for f in client.list_artifacts(run.info.run_id))  # noqa: E731
    assert names(a) == names(b) == ["best_model.pt", "config.json", "history.csv"]
    assert (a.info.start_time < a.info.end_time) and (b.info.start_time < b.info.end_time)


@pytest.mark.slow
def test_a_sweep_killed_with_kill_9_loses_nothing_the_next_sweep_recovers(tmp_path):
    from test_sweep import copy_real_project, real_env

    from labrun.claim import holder

    tiny = "--dataset digits --epochs 3 --width 8 --workers 0 --compile off --progress off"
    copy_real_project(tmp_path, [f"{tiny} --seed 0", f"{tiny} --seed 1"])
    env = real_env(PYTHON=sys.executable, GPUS="", CPU_JOBS="1")  # one job after the other
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's own mlflow.db
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = subprocess.Popen(
        ["bash", "sweep.sh"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    results = tmp_path / "results" / "sweep"
    done = lambda: list(results.glob("*/metrics.json"))  # noqa: E731
    started = lambda: len(list(results.glob("*/history.csv")))  # noqa: E731
    wait_while_running(lambda: done() and started() == 2, sweep, 600)  # one done, one training
    sweep.kill()  # kill -9 run.sh: its jobs and its follower get SIGTERM from the kernel
    sweep.communicate()
    run_dirs = sorted(p for p in results.iterdir() if p.is_dir())
    deadline = time.monotonic() + 300
    while any(holder(d) for d in run_dirs):  # the stopped job checkpoints and exits
        assert time.monotonic() < deadline, "the killed sweep's job did not exit"
        time.sleep(0.1)
    again = subprocess.run(
        ["bash", "sweep.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert again.returncode == 0, again.stdout + again.stderr
    for run_dir in run_dirs:
        assert_mirrors(uri, run_dir)


# run.py, held after its 2nd epoch (its row in history.csv) until GATE_DIR/<run dir name> exists:
# the test sees MLflow while the job is certainly still running.
GATED = r"""
import os, runpy, sys, time
from pathlib import Path
from labrun.session import TrainingJob
end_epoch, epochs = TrainingJob.end_epoch, []
def held(self, sums, val, **kw):
    row = end_epoch(self, sums, val, **kw)
    epochs.append(row)
    go = Path(os.environ["GATE_DIR"]) / self.out.name
    while len(epochs) == 2 and not go.exists():
        time.sleep(0.05)
    return row
TrainingJob.end_epoch = held
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
GATED_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == run.py && "$2" != --plan ]]; then exec "%s" -c "${GATED}" "$@"; fi
exec "%s" "$@"
"""


@pytest.mark.slow
def test_a_sweep_shows_each_run_live_in_mlflow_then_finished(tmp_path):
    # A real 2-job sweep, polled through MLflow: each run RUNNING with its epochs and the
    # machine's system metrics (sampled every second here) while its job trains (held after
    # epoch 2), then FINISHED with exactly history.csv's rows.
    from test_sweep import copy_real_project, real_env

    tiny = "--dataset digits --epochs 3 --width 8 --workers 0 --compile off --progress off"
    project = copy_real_project(tmp_path / "p", [f"{tiny} --seed 0", f"{tiny} --seed 1"])
    python = tmp_path / "python-gated"
    python.write_text(GATED_PYTHON % (sys.executable, sys.executable))
    python.chmod(0o755)
    gates = tmp_path / "gates"
    gates.mkdir()
    env = real_env(PYTHON=str(python), GPUS="", CPU_JOBS="2", GATED=GATED, GATE_DIR=str(gates))
    env["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = "1"
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's own mlflow.db
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = mirror.mlflow_client(uri)  # the schema made once, under mirror.py's lock
    sweep = subprocess.Popen(
        ["bash", "sweep.sh"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    results = project / "results" / "sweep"

    def live(run_dir: Path) -> bool:
        found = mlflow_runs_of(uri, run_dir)
        if not found or found[0].info.status != "RUNNING":
            return False
        system = any(key.startswith("system/cpu") for key in found[0].data.metrics)
        return system and len(client.get_metric_history(found[0].info.run_id, "val_loss")) == 2

    def both_live() -> bool:
        run_dirs = [p for p in results.glob("*") if p.is_dir()] if results.is_dir() else []
        return len(run_dirs) == 2 and all(live(d) for d in run_dirs)

    try:
        wait_while_running(both_live, sweep, 300)
        run_dirs = sorted(p for p in results.iterdir() if p.is_dir())
        for run_dir in run_dirs:  # the jobs have not ended: MLflow shows them as they train
            assert (run_dir / "status").read_text().strip() == "running"
            assert not (run_dir / "metrics.json").exists()
            (gates / run_dir.name).touch()
        out, _ = sweep.communicate(timeout=600)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, out
    for run_dir in run_dirs:
        assert_mirrors(uri, run_dir)  # FINISHED, every history.csv row once
