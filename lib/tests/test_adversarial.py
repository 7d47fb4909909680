"""The run-directory contract under attack (issue 20 of the template): links and foreign files in
a shared results folder, a directory deleted under a training job, hang-ups and late signals, a
shared MLflow DB, a tracker outage at the end, `tracking sync` beside a live job, bad settings."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    DEADLINE,
    ROOT,
    cli_command,
    mlflow_run,
    popen_cli,
    read_metrics,
    run_dir_of,
    wait_for_handler,
    wait_while_running,
)

from labrun import runs

QUICK = ("--epochs", "1", "--max-steps", "3")
IS_ROOT = os.geteuid() == 0
ATTACK = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIattacker attacker@evil"


def _nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


def _run_dir(main_in_process, results: Path, capsys, *args: str) -> Path:
    assert main_in_process(*args, "--results-dir", str(results), "--print-run-dir") == 0
    out = Path(capsys.readouterr().out.strip())
    out.mkdir(parents=True)
    return out


def _history_epochs(uri: str, run_id: str, key: str = "val_acc") -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def _runs_named(uri: str, name: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = []
    for experiment in client.search_experiments():
        found += client.search_runs(
            [experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'"
        )
    return found


# ---- no write through a link, no trust in foreign files ---
@pytest.mark.parametrize("owner", ["me", "nobody"])
def test_a_planted_run_log_link_is_refused_and_nothing_is_written_through_it(
    main_in_process, tmp_path, capsys, owner
):
    if owner == "nobody" and not IS_ROOT:
        pytest.skip("planting a file owned by another user needs root")
    victim = tmp_path / "home" / "authorized_keys"
    victim.parent.mkdir()
    victim.write_text("ssh-ed25519 AAAA mine@laptop\n")
    before = victim.read_bytes()
    out = _run_dir(main_in_process, tmp_path / "results", capsys, *QUICK)
    (out / "run.log").symlink_to(victim)
    if owner == "nobody":
        os.lchown(out / "run.log", _nobody(), _nobody())
    code = main_in_process(*QUICK, "--results-dir", str(tmp_path / "results"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "run.log" in err, err
    assert "symbolic link" in err
    assert victim.read_bytes() == before
    assert {p.name for p in out.iterdir()} <= {"run.log", ".lock"}  # nothing else written


def test_the_log_is_never_appended_through_a_link(tmp_path):
    # The check at the start has a window; the log file itself refuses a link too.
    victim = tmp_path / "victim"
    victim.write_text("x\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.log").symlink_to(victim)
    with pytest.raises(OSError):
        runs.setup_logging(tmp_path / "run", "linked")
    os.link(victim, tmp_path / "run" / "hard.log")  # a hard link: the same file, two names
    with pytest.raises(runs.ForeignFile):
        runs.NoFollowFileHandler(tmp_path / "run" / "hard.log")
    assert victim.read_text() == "x\n"


@pytest.mark.slow  # trains and tracks for real
def test_a_crafted_tracking_json_is_ignored_not_logged(main_in_process, tmp_path, capsys, env):
    # The attack: run.log a link into ~/.ssh, and a run id that carries a key.
    out = _run_dir(main_in_process, tmp_path / "results", capsys, *QUICK)
    crafted = {"run_id": f"0123\n{ATTACK}\n", "sent_rows": 0, "ended": None}
    (out / "tracking.json").write_text(json.dumps(crafted))
    assert main_in_process(*QUICK, "--results-dir", str(tmp_path / "results")) == 0
    err = capsys.readouterr().err
    log = (out / "run.log").read_text()
    assert "tracking.json ignored: its run_id is not 32 hex digits" in log
    for text in (err, log):
        assert not any(line.startswith("ssh-ed25519") for line in text.splitlines()), text
        assert "attacker" not in text
    state = json.loads((out / "tracking.json").read_text())
    assert len(state["run_id"]) == 32 and state["sent_rows"] == 1  # a fresh, real MLflow run
    assert mlflow_run(env["MLFLOW_TRACKING_URI"], state["run_id"]).info.status == "FINISHED"


@pytest.mark.parametrize(
    "state",
    [
        {"run_id": "A" * 32},
        {"run_id": "0" * 31},
        {"run_id": 12},
        {"run_id": "0" * 32, "sent_rows": "3"},
        {"run_id": "0" * 32, "sent_rows": -1},
        {"run_id": "0" * 32, "sent_rows": True},
        {"run_id": "0" * 32, "ended": "DONE\nx"},
        ["0" * 32],
    ],
)
def test_tracking_json_values_are_checked(tmp_path, state, caplog):
    from labrun.mirror import read_state

    (tmp_path / "tracking.json").write_text(json.dumps(state))
    assert read_state(tmp_path, __import__("logging").getLogger("t")) == {}
    assert "ignored" in caplog.text
    (tmp_path / "tracking.json").write_text(json.dumps({"run_id": "0" * 32, "sent_rows": 3}))
    assert read_state(tmp_path)["sent_rows"] == 3


@pytest.mark.skipif(not IS_ROOT, reason="files owned by another user need root to make")
def test_foreign_files_are_not_trusted(main_in_process, tmp_path, capsys):
    out = _run_dir(main_in_process, tmp_path / "results", capsys, *QUICK)
    (out / "metrics.json").write_text('{"test_acc": 0.99}')
    os.chown(out / "metrics.json", _nobody(), _nobody())
    assert not runs.is_done(out)  # a result someone else put there is no result
    code = main_in_process(*QUICK, "--results-dir", str(tmp_path / "results"))
    err = capsys.readouterr().err
    assert code == 2 and "metrics.json" in err and "belongs to nobody" in err, err
    (out / "metrics.json").unlink()
    os.chown(out, _nobody(), _nobody())  # a colleague's run directory
    code = main_in_process(*QUICK, "--results-dir", str(tmp_path / "results"))
    err = capsys.readouterr().err
    assert code == 2 and "the run directory" in err and "belongs to nobody" in err, err
    assert not (out / "config.json").exists()


# ---- one owner, even when the directory is deleted ---
@pytest.mark.slow
def test_a_run_directory_deleted_while_training_gets_one_owner(env, data_dir, tmp_path):
    results, uri = tmp_path / "results", env["MLFLOW_TRACKING_URI"]
    args = ("--epochs", "40", "--checkpoint-every", "0")
    first = popen_cli(*args, results_dir=results, data_dir=data_dir, env=env)
    history = lambda: list(results.glob("*/history.csv"))  # noqa: E731
    wait_while_running(lambda: history() and history()[0].read_text().count("\n") >= 2, first)
    run_dir = run_dir_of(results)
    # "rm -rf it and start again": rm races the job's next write (a file made in the directory
    # while rm empties it: "Directory not empty"), and the user runs it again, as here.
    for _ in range(20):
        if subprocess.run(["rm", "-rf", str(run_dir)], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    assert not run_dir.exists()
    second = popen_cli(*args, results_dir=results, data_dir=data_dir, env=env)
    _, err1 = first.communicate(timeout=300)
    _, err2 = second.communicate(timeout=300)
    assert first.returncode == 73, err1
    assert err1.strip().splitlines()[-1].startswith("error: lost the claim on "), err1
    assert "Traceback" not in err1
    assert second.returncode == 0, err2
    n = read_metrics(run_dir)["epochs_run"]  # early stopping may end it before 40
    epochs = [line.split(",")[0] for line in (run_dir / "history.csv").read_text().splitlines()]
    assert epochs == ["epoch", *map(str, range(1, n + 1))]
    assert (run_dir / "run.log").read_text().count("finished (") == 1
    mine = read_metrics(run_dir)["mlflow_run_id"]
    assert _history_epochs(uri, mine) == list(range(1, n + 1))  # one set of epochs, each once
    others = [r for r in _runs_named(uri, run_dir.name) if r.info.run_id != mine]
    assert [r.info.status for r in others] == ["FAILED"]  # the first job's run, closed
    assert "lost the claim" in others[0].data.tags["error"]


# ---- stop signals ---
def _start_and_wait_for_the_loop(env, data_dir, results: Path, *args: str) -> subprocess.Popen:
    proc = popen_cli(*args, results_dir=results, data_dir=data_dir, env=env)
    wait_while_running(
        lambda: any("steps/epoch" in p.read_text() for p in results.glob("*/run.log")), proc
    )
    return proc


@pytest.mark.slow
def test_sighup_checkpoints_and_exits_75(env, data_dir, tmp_path):
    """The job is started as a terminal starts it, SIGHUP at its default: a test runner under
    nohup (or any parent ignoring SIGHUP) would hand the job an ignored SIGHUP, which it keeps
    ignoring by design (test_a_job_started_under_nohup_keeps_ignoring_sighup), and it trained
    on past any time limit. It is sent once the job catches it (/proc SigCgt) and trains; the
    output goes to files (a pipe nobody reads could block the job); generous limits."""
    cmd = cli_command("--epochs", "50", results_dir=tmp_path / "results", data_dir=data_dir)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=err, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )  # fmt: skip
        logs = (tmp_path / "results").glob
        wait_while_running(lambda: any("steps/epoch" in p.read_text() for p in logs("*/run.log")),
                           proc, timeout=600)  # fmt: skip
        wait_for_handler(proc, signal.SIGHUP, timeout=600)
        proc.send_signal(signal.SIGHUP)  # the terminal closed, the ssh session dropped
        proc.wait(timeout=600)
        err.seek(0)
        assert proc.returncode == 75, err.read()
    run_dir = run_dir_of(tmp_path / "results")
    assert (run_dir / "status").read_text() == "interrupted\n"
    assert (run_dir / "checkpoint.pt").exists()
    assert "interrupted by SIGHUP" in (run_dir / "run.log").read_text()


@pytest.mark.slow
def test_a_stop_signal_after_the_checkpoint_still_ends_in_75(env, data_dir, tmp_path):
    env = {**env, "LAB_TRACKING": "off"}
    proc = _start_and_wait_for_the_loop(env, data_dir, tmp_path, "--epochs", "50")
    status = run_dir_of(tmp_path) / "status"
    proc.send_signal(signal.SIGUSR1)
    wait_while_running(lambda: status.read_text() == "interrupted\n", proc)
    while proc.poll() is None:  # TERM after TERM while main() returns and Python exits
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 75, err


def test_a_job_started_under_nohup_keeps_ignoring_sighup():
    from labrun.stopping import STOP_SIGNALS, GracefulStop

    old = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # put back after the test
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
    stop = GracefulStop()
    try:
        with stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# ---- the shared MLflow DB ---
def test_the_mlflow_db_and_its_journal_follow_the_umask(tmp_path, monkeypatch):
    from labrun import mirror

    db = tmp_path / "shared" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    old = os.umask(0o002)
    try:
        mirror.init("umask")
        with sqlite3.connect(db, isolation_level=None) as con:  # a write keeps a journal open
            con.execute("BEGIN IMMEDIATE")
            con.execute("CREATE TABLE probe (x)")
            con.execute("INSERT INTO probe VALUES (1)")
            journal = Path(f"{db}-journal")
            journal_mode = stat.S_IMODE(journal.stat().st_mode) if journal.exists() else None
            con.execute("COMMIT")
    finally:
        os.umask(old)
    assert stat.S_IMODE(db.stat().st_mode) == 0o664
    assert journal_mode in (None, 0o664), oct(journal_mode)


@pytest.mark.slow
def test_a_deleted_mlflow_db_is_one_warning_not_a_flood(env, data_dir, tmp_path, monkeypatch):
    from labrun import mirror

    db = tmp_path / "mlflow.db"
    env = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    mirror.init()
    proc = _start_and_wait_for_the_loop(env, data_dir, tmp_path / "results", "--epochs", "6")
    db.unlink()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    ours = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING) ")
    assert [line for line in err.splitlines() if not ours.match(line)] == [], err
    # At most one tracker warning (the project may warn once more, e.g. that it is no git repo).
    assert err.count(" WARNING MLflow") <= 1, err


# ---- the end is always reported ---
LOCKER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
con.execute("ROLLBACK")
"""


def _lock_db(db: Path) -> subprocess.Popen:
    """Another process holding the DB's write lock: every write times out (a tracker outage)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def _unlock(locker: subprocess.Popen) -> None:
    locker.communicate(b"\n", timeout=DEADLINE)


@pytest.mark.slow
def test_a_short_outage_near_the_end_still_reports_the_end(env, data_dir, tmp_path):
    uri = env["MLFLOW_TRACKING_URI"]
    db = Path(uri.removeprefix("sqlite:///"))
    results = tmp_path / "results"
    proc = popen_cli("--epochs", "8", results_dir=results, data_dir=data_dir, env=env)
    history = lambda: list(results.glob("*/history.csv"))  # noqa: E731
    wait_while_running(lambda: history() and history()[0].read_text().count("\n") >= 2, proc)
    locker = _lock_db(db)
    log = run_dir_of(results) / "run.log"
    try:
        wait_while_running(lambda: "training goes on" in log.read_text(), proc)
    finally:
        _unlock(locker)  # back within seconds: well inside the 60 s back-off
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    run_dir = run_dir_of(results)
    run = mlflow_run(uri, read_metrics(run_dir)["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert _history_epochs(uri, run.info.run_id) == list(range(1, 9))
    assert run.data.metrics["test_acc"] == pytest.approx(read_metrics(run_dir)["test_acc"])
    assert json.loads((run_dir / "tracking.json").read_text())["ended"] == "FINISHED"


@pytest.mark.slow
def test_an_outage_through_the_end_is_written_down_and_sync_completes_it(
    env, data_dir, tmp_path, monkeypatch
):
    from labrun import follower

    uri = env["MLFLOW_TRACKING_URI"]
    results = tmp_path / "results"
    proc = popen_cli("--epochs", "3", results_dir=results, data_dir=data_dir, env=env)
    history = lambda: list(results.glob("*/history.csv"))  # noqa: E731
    wait_while_running(lambda: history() and history()[0].read_text().count("\n") >= 2, proc)
    locker = _lock_db(Path(uri.removeprefix("sqlite:///")))
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        _unlock(locker)
    assert proc.returncode == 0, err
    run_dir = run_dir_of(results)
    state = json.loads((run_dir / "tracking.json").read_text())
    assert (state["sent_rows"], state["ended"]) == (1, None), state  # what MLflow has
    assert mlflow_run(uri, state["run_id"]).info.status == "RUNNING"
    assert follower.main(["sync", str(results)]) == 0
    run = mlflow_run(uri, state["run_id"])
    assert run.info.status == "FINISHED" and _history_epochs(uri, state["run_id"]) == [1, 2, 3]
    state = json.loads((run_dir / "tracking.json").read_text())
    assert (state["sent_rows"], state["ended"]) == (3, "FINISHED"), state


# ---- tracking sync beside a live job ---
@pytest.mark.slow
def test_sync_beside_a_live_job_sends_every_row_once_to_one_run(env, data_dir, tmp_path):
    from labrun import follower

    uri, results = env["MLFLOW_TRACKING_URI"], tmp_path / "results"
    proc = popen_cli("--epochs", "12", results_dir=results, data_dir=data_dir, env=env)
    wait_while_running(lambda: any(results.glob("*/config.json")), proc)
    syncs = 0
    while proc.poll() is None:  # before the job reaches MLflow, and at every epoch after
        follower.main(["sync", str(results)])
        syncs += 1
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert follower.main(["sync", str(results)]) == 0
    run_dir = run_dir_of(results)
    found = _runs_named(uri, run_dir.name)
    assert len(found) == 1, [r.info.run_id for r in found]
    n = read_metrics(run_dir)["epochs_run"]
    assert _history_epochs(uri, found[0].info.run_id) == list(range(1, n + 1)), syncs
    assert found[0].info.status == "FINISHED"


# ---- settings from the environment, and flags ---
def test_a_bad_stop_grace_is_one_line(main_in_process, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LAB_STOP_GRACE_S", "abc")
    assert main_in_process("--results-dir", str(tmp_path), "--print-run-dir") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: LAB_STOP_GRACE_S=") and err.count("\n") == 1, err


@pytest.mark.parametrize(("value", "expected"), [("OFF", "off"), (" On ", "on"), ("", "on")])
def test_lab_tracking_is_case_insensitive(monkeypatch, value, expected):
    from labrun.config import parse_args

    monkeypatch.setenv("LAB_TRACKING", value)
    assert parse_args([])[0].tracking == expected


def test_a_bad_lab_tracking_is_refused(monkeypatch, capsys):
    from labrun.config import parse_args

    monkeypatch.setenv("LAB_TRACKING", "no")
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: LAB_TRACKING=") and err.count("\n") == 1, err


def test_width_1_names_the_flag(main_in_process, tmp_path, capsys):
    assert main_in_process(*QUICK, "--width", "1", "--results-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --width: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_claim_knows_when_its_directory_is_gone(tmp_path):
    from labrun.claim import LostClaim, claim

    held = claim(tmp_path / "run")
    assert held.still_ours()
    subprocess.run(["rm", "-rf", str(tmp_path / "run")], check=True)
    assert not held.still_ours()
    with claim(tmp_path / "run") as second:  # a new process would get the path
        assert second.still_ours() and not held.still_ours()
        with pytest.raises(LostClaim, match="now held by pid"):
            held.check()
        held.discard()  # must not remove the new owner's lock
        assert (tmp_path / "run" / ".lock").exists()


# ---- the sweep and `sync` beside others: links, other users' directories, a silent tracker ---
def _standin_sweep(tmp_path: Path, jobs: list[str]) -> Path:
    """test_sweep.py's stand-in project (no torch) with these job lines."""
    from test_sweep import make_project

    return make_project(tmp_path / "p", jobs)


def test_the_sweep_marks_a_killed_job_without_writing_through_a_planted_link(tmp_path):
    from labrun.jobqueue import mark_interrupted

    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    (run_dir / "status").write_text("running\n")  # its job was killed before writing its own
    victim.write_text(ATTACK)
    (run_dir / ".status.sweep.tmp").symlink_to(victim)
    mark_interrupted(str(run_dir))
    assert victim.read_text() == ATTACK
    assert not (run_dir / "status").is_symlink()
    assert (run_dir / "status").read_text() == "interrupted\n"


def test_the_sweep_never_appends_to_a_log_through_a_planted_link(tmp_path):
    from test_sweep import run_sweep

    project = _standin_sweep(tmp_path, ["--tag a"])
    name = Path(
        subprocess.run(
            [sys.executable, "run.py", "--tag", "a", "--results-dir", "results/sweep",
             "--print-run-dir"],
            cwd=project, capture_output=True, text=True, check=True,
        ).stdout.strip()
    ).name  # fmt: skip
    victim = tmp_path / "victim"
    victim.write_text(ATTACK)
    (project / "logs" / "sweep").mkdir(parents=True)
    (project / "logs" / "sweep" / f"{name}.log").symlink_to(victim)
    done = run_sweep(project)
    assert victim.read_text() == ATTACK
    assert done.returncode == 1 and f"FAILED   {name}  (not started: its log:" in done.stdout
    assert "1 failed" in done.stdout, done.stdout + done.stderr

    (project / "logs" / "sweep" / f"{name}.log").unlink()
    (project / "logs" / "sweep" / "mlflow-follower.out").unlink()  # the first sweep's
    (project / "logs" / "sweep" / "mlflow-follower.out").symlink_to(victim)
    done = run_sweep(project)
    assert victim.read_text() == ATTACK
    assert done.returncode == 2 and "mlflow-follower.out" in done.stderr, done.stderr
    assert not list(project.glob("results/sweep/*/attempts.jsonl"))  # no job started


@pytest.mark.skipif(not IS_ROOT, reason="a directory of another user needs root to make")
def test_the_sweep_refuses_a_log_folder_of_another_user(tmp_path):
    from test_sweep import run_sweep

    project = _standin_sweep(tmp_path, ["--tag a"])
    (project / "logs" / "sweep").mkdir(parents=True)
    os.chown(project / "logs" / "sweep", _nobody(), _nobody())
    done = run_sweep(project)
    assert done.returncode == 2 and "LOG_DIR" in done.stderr and "nobody" in done.stderr
    assert not list((project / "logs" / "sweep").iterdir())


def _finished(run_dir: Path, lr: float) -> Path:
    """A finished run directory, as a job leaves it (what sync reads)."""
    run_dir.mkdir(parents=True)
    config = {"experiment": "adversarial", "experiment_keys": ["lr"], "lr": lr}
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "history.csv").write_text(f"epoch,val_acc\n1,{lr}\n")
    (run_dir / "metrics.json").write_text(json.dumps({"val_acc": lr, "epochs_run": 1}))
    (run_dir / "status").write_text("finished\n")
    return run_dir


@pytest.mark.skipif(not IS_ROOT, reason="a directory of another user needs root to make")
def test_sync_never_writes_into_another_users_run_directory(env, tmp_path):
    from labrun import follower

    theirs = _finished(tmp_path / "results" / "theirs", 0.1)
    for path in [theirs, *theirs.iterdir()]:
        os.chown(path, _nobody(), _nobody())
    theirs.chmod(0o777)  # a shared folder: writable by all, yet not ours to write
    before = sorted(p.name for p in theirs.iterdir())
    assert follower.main(["sync", str(tmp_path / "results")]) == 1
    assert sorted(p.name for p in theirs.iterdir()) == before  # no .lock, no tracking.json
    assert not _runs_named(env["MLFLOW_TRACKING_URI"], "theirs")


def test_sync_never_deletes_the_mlflow_run_another_directory_names(env, tmp_path):
    from mlflow.tracking import MlflowClient

    from labrun import follower

    uri = env["MLFLOW_TRACKING_URI"]
    other = _finished(tmp_path / "results" / "other", 0.1)
    assert follower.main(["sync", str(other)]) == 0
    other_run = json.loads((other / "tracking.json").read_text())["run_id"]
    mine = _finished(tmp_path / "results" / "mine", 0.2)  # other params: a rebuild, were it its
    (mine / "tracking.json").write_text(json.dumps({"run_id": other_run}))
    assert follower.main(["sync", str(mine)]) == 0
    run = MlflowClient(tracking_uri=uri).get_run(other_run)
    assert run.info.lifecycle_stage == "active" and run.data.params["lr"] == "0.1"
    assert run.data.tags["run_dir"] == str(other)
    new = json.loads((mine / "tracking.json").read_text())["run_id"]
    assert (
        new != other_run and MlflowClient(tracking_uri=uri).get_run(new).data.params["lr"] == "0.2"
    )


class SilentServer:
    """A loopback port that accepts connections and never answers (a hung tracking server)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted, self.held = 0, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.sock.accept()[0])
                self.accepted += 1

    def close(self) -> None:
        for conn in [*self.held, self.sock]:
            conn.close()


def test_a_silent_tracking_server_is_asked_once_per_follower_not_per_run(tmp_path):
    server = SilentServer()
    try:
        for i in range(6):
            _finished(tmp_path / "results" / f"run{i}", i / 10)
            (tmp_path / "results" / f"run{i}" / "tracking.json").write_text("{}")
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": server.uri,
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "1",
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        }
        follow = subprocess.run(  # stdin at its end: the sweep is over, mirror what is left
            [sys.executable, "-m", "labrun.tracking", "follow", str(tmp_path / "results")],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DEADLINE,
        )  # fmt: skip
        assert follow.returncode == 1, follow.stderr  # not mirrored: `sync` later
        assert "does not answer" in follow.stderr
        # One request (and MLflow's one retry) for the sweep; per run, six times that.
        assert server.accepted <= 2, (server.accepted, follow.stderr)
    finally:
        server.close()


def test_a_second_ctrl_c_ends_a_sweep_whose_follower_waits_on_a_silent_server(tmp_path):
    from test_sweep import run_dirs, start_sweep

    server = SilentServer()
    try:
        project = _standin_sweep(tmp_path, ["--sleep 60 --tag a"])
        # a run of an earlier sweep, finished: the follower mirrors it at once
        _finished(project / "results" / "sweep" / "earlier", 0.1)
        (project / "results" / "sweep" / "earlier" / "tracking.json").write_text("{}")
        # MLflow's timeout, here an hour: a server that never answers holds the follower
        proc = start_sweep(project, MLFLOW_TRACKING_URI=server.uri,
                           MLFLOW_HTTP_REQUEST_TIMEOUT="3600")  # fmt: skip
        wait_while_running(
            lambda: server.accepted and any((d / "attempts.jsonl").exists()
                                            for d in run_dirs(project)), proc)  # fmt: skip
        proc.send_signal(signal.SIGINT)
        wait_while_running(
            lambda: any(runs.read_status(d) == "interrupted" for d in run_dirs(project)), proc
        )
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 128 + signal.SIGINT, out
        assert "1 interrupted" in out
    finally:
        server.close()


# ---- flags bounded by the machine; an ending that says what happened ---
def _exit_code(main_in_process, *args: str) -> int:
    try:
        return main_in_process(*args)
    except SystemExit as exc:  # argparse's refusal
        return exc.code


def test_more_workers_than_cores_is_refused_before_anything_is_written(
    main_in_process, tmp_path, capsys
):
    cores = len(os.sched_getaffinity(0))
    code = _exit_code(main_in_process, *QUICK, "--workers", "1000", "--results-dir", str(tmp_path))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --workers: at most {cores} ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_a_synthetic_set_larger_than_memory_is_refused(main_in_process, tmp_path, capsys):
    args = ("--dataset", "synthetic", "--synthetic-size", "100000000000")
    assert _exit_code(main_in_process, *QUICK, *args, "--results-dir", str(tmp_path / "r")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --synthetic-size: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_an_empty_results_dir_is_refused(main_in_process, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # '' would be this folder: the project's root, for run.py
    assert _exit_code(main_in_process, *QUICK, "--results-dir", "") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --results-dir: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_a_dataset_that_calls_sys_exit_0_fails_the_run(main_in_process, tmp_path, monkeypatch):
    from labrun import arrays

    monkeypatch.setattr(arrays, "load_synthetic_arrays", lambda *args: sys.exit(0))
    args = ("--dataset", "synthetic", "--synthetic-size", "100", "--results-dir", str(tmp_path))
    assert main_in_process(*QUICK, *args) == 1  # failed: no result, whatever the exit said
    assert not list(tmp_path.glob("*/metrics.json"))


@pytest.mark.parametrize("visible", ["-1", "0"])
def test_cuda_visible_devices_names_no_gpu_on_a_machine_without_one(tmp_path, visible):
    """The sweep's dry run (GPUS unset, no nvidia-smi): CPU slots, a job per core."""
    project = _standin_sweep(tmp_path, ["--tag a", "--tag b"])
    env = {k: v for k, v in os.environ.items() if k != "GPUS"}
    env.update(PYTHON=str(project / "python-standin"), CUDA_VISIBLE_DEVICES=visible)
    env["PATH"] = os.pathsep.join(  # as on a machine without a GPU
        d for d in env["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()
    )
    dry = subprocess.run(["bash", "sweep.sh", "--dry-run"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=DEADLINE)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "would run on " in dry.stdout and " CPU slot(s)" in dry.stdout, dry.stdout


def test_cuda_stops_at_the_first_invalid_visible_device(monkeypatch):
    from labrun import slots

    monkeypatch.setattr(slots.shutil, "which", lambda name: f"/usr/bin/{name}")  # a GPU machine
    assert slots.choose_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert slots.choose_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,0"}) == ["1"]


def test_sigusr1_stops_the_sweep_as_sigterm_does(tmp_path):
    from test_sweep import start_sweep, started_pids

    project = _standin_sweep(tmp_path, ["--sleep 60 --tag a"])
    proc = start_sweep(project)
    wait_while_running(lambda: started_pids(project), proc)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 128 + signal.SIGUSR1, out
    assert "0 failed, 1 interrupted" in out and "sweep summary:" in out, out
