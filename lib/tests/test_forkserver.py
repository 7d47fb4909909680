"""A slot's fork server (labrun/forkserver.py) and the sweep's forked jobs (FORK_JOBS=auto).

Through the engine with test_sweep's stand-in run.py (its exit codes, claim, stop signal and
attempt records, no torch; the server still imports torch): forked jobs keep their exit codes,
their stop signal, the parent-death signal when the sweep is killed, and the code on disk. Then
the real run.py forked from a server that a small driver holds (a subreaper, as the sweep is):
the same numbers as a fresh process, and SIGTERM -> checkpoint, exit 75.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY
from test_sweep import (
    attempts,
    is_gone,
    make_project,
    run_dirs,
    run_sweep,
    script_calls,
    start_sweep,
    wait_for,
)

from labrun import sweep


def server_ready(project: Path, slot: int = 0) -> bool:
    out = project / "logs" / "sweep" / f"forkserver-{slot}.out"
    return out.exists() and "ready" in out.read_text()


def started(project: Path, tag: str) -> list[dict]:
    return [
        r for r in attempts(project, finished_only=False)
        if r.get("phase") == "started" and tag in r["name"]
    ]  # fmt: skip


def job_log(project: Path, tag: str) -> str:
    (log,) = (project / "logs" / "sweep").glob(f"*{tag}*.log")
    return log.read_text()


def short(run_dir: Path) -> str:
    """A stand-in run's name without its hash, each run of _ as one: wait_for_go_tag_a."""
    return re.sub("_+", "_", run_dir.name.rsplit("-", 1)[0])


def start_forking_sweep(project: Path, **env: str) -> subprocess.Popen:
    """A one-slot sweep whose first job waits for `go`: it is released once the slot's server
    is ready, so that the jobs after it are forked."""
    proc = start_sweep(project, GPUS="0", **env)
    wait_for(lambda: server_ready(project), 120, "the fork server's imports")
    (project / "go").touch()
    return proc


def test_forked_jobs_keep_their_exit_codes_and_stop_signal(tmp_path):
    jobs = ["--wait-for go --tag a", "--fail --tag b", "--sleep 60 --tag c", "--tag d"]
    project = make_project(tmp_path, jobs)
    proc = start_forking_sweep(project)
    wait_for(lambda: started(project, "tag_c"), 60, "job c to start")
    os.kill(started(project, "tag_c")[0]["pid"], signal.SIGTERM)  # checkpoint, exit 75
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    for tag in ("a", "b", "c", "d"):  # the slot's first job too: it waited for the imports
        assert f"tag_{tag}" in "".join(x for x in out.splitlines() if x.endswith("forked)")), out
        assert job_log(project, f"tag_{tag}").startswith("=== "), tag
        assert "  (forked)\n" in job_log(project, f"tag_{tag}")
    assert re.search(r"FAILED   fail_+tag_b-\w+  \(exit 1, ", out)  # its own exit code
    assert re.search(r"stopped  sleep_+60_+tag_c-\w+  \(exit 75;", out)
    assert "2 done (2 ran now, 0 skipped: already done), 1 failed, 1 interrupted" in out
    statuses = {short(d): (d / "status").read_text().strip() for d in run_dirs(project)}
    assert statuses == {
        "wait_for_go_tag_a": "finished", "fail_tag_b": "failed",
        "sleep_60_tag_c": "interrupted", "tag_d": "finished",
    }  # fmt: skip
    # Every attempt is its own process, each pid the one the claim and the engine saw.
    pids = [r["pid"] for r in attempts(project, finished_only=False) if r.get("phase")]
    assert len(set(pids)) == 4
    # The server ended with the sweep and no job left a process or a zombie.
    assert all(is_gone(p) for p in pids)
    assert "stand-in: failing on purpose" in job_log(project, "tag_b")  # its stderr: its log


def test_sigkill_of_the_sweep_stops_its_forked_jobs(tmp_path):
    project = make_project(tmp_path, ["--wait-for go --tag a", "--sleep 60 --tag b"])
    proc = start_forking_sweep(project)
    wait_for(lambda: started(project, "tag_b"), 60, "job b to start")
    assert "(forked)" in job_log(project, "tag_b")
    proc.kill()  # SIGKILL: the sweep runs no code at all
    proc.communicate(timeout=10)
    (b,) = started(project, "tag_b")
    wait_for(lambda: is_gone(b["pid"]), 20, "the forked job to end")
    # The kernel sent it SIGTERM (its parent-death signal, set once the sweep adopted it).
    (ended,) = [r for r in attempts(project) if "tag_b" in r["name"]]
    assert (ended["rc"], ended["signal"]) == (75, signal.SIGTERM)
    wait_for(lambda: not list_servers(project), 10, "the fork server to end")


def list_servers(project: Path) -> list[int]:
    """Pids of fork servers started in `project`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
            cwd = os.readlink(cmdline.parent / "cwd")
        except OSError:
            continue
        if b"labrun.forkserver" in words and cwd == str(project):
            found.append(int(cmdline.parent.name))
    return found


def test_a_job_after_an_edit_of_run_py_runs_the_new_code(tmp_path):
    project = make_project(tmp_path, ["--wait-for go --tag a", "--tag b"])
    proc = start_sweep(project, GPUS="0")
    wait_for(lambda: server_ready(project), 120, "the fork server's imports")
    run_py = project / "run.py"
    run_py.write_text(run_py.read_text().replace('{"test_acc": 1.0}', '{"test_acc": 2.0}'))
    (project / "go").touch()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    metrics = {short(d): json.loads((d / "metrics.json").read_text()) for d in run_dirs(project)}
    assert metrics["tag_b"]["test_acc"] == 2.0  # the server had imported 1.0: it was not used
    assert "(forked)" not in job_log(project, "tag_b")


def test_fork_jobs_off_starts_every_job_afresh(tmp_path):
    project = make_project(tmp_path, [f"--tag {t}" for t in "abc"])
    auto = run_sweep(project, GPUS="0")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert any("-m labrun.forkserver" in x for x in calls(project))  # auto: a server started
    off = make_project(tmp_path / "off", [f"--tag {t}" for t in "abc"])
    result = run_sweep(off, GPUS="0", FORK_JOBS="off")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not any("labrun.forkserver" in x for x in calls(off))
    assert not list((off / "logs" / "sweep").glob("forkserver-*"))
    assert len(script_calls(off)) == 4  # --plan, then one fresh interpreter per job


def calls(project: Path) -> list[str]:
    return (project / "python-calls.log").read_text().splitlines()


def test_an_adopted_job_that_is_no_child_reads_as_lost():
    assert sweep.Adopted(os.getpid()).poll() == 255  # waitpid: ECHILD, never a hang


def test_a_server_that_reads_a_request_and_never_answers_is_killed(monkeypatch):
    """The queue waits ANSWER_WAIT_S for a hung server, not longer, and the server cannot fork
    the job later behind the sweep's back (it starts afresh instead)."""
    monkeypatch.setattr(sweep, "ANSWER_WAIT_S", 0.5)
    hung = "import sys, time; sys.stdin.readline(); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-c", hung], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    server = sweep.Server(proc, {}, ready=True)
    assert server.ask({"argv": []}) == ""
    assert proc.wait(timeout=5) == -signal.SIGKILL
    server.stop()  # what the engine does next: no error on a server already gone


# ---- the real run.py, forked ---------------------------------------------------------------

# Holds a fork server as the sweep does (a subreaper): one JSON request per argument, then
# "pid PID" as each job starts and "rc PID CODE" as each ends.
DRIVER = r"""
import ctypes, json, os, subprocess, sys
assert ctypes.CDLL(None).prctl(36, 1) == 0
server = subprocess.Popen([sys.executable, "-m", "labrun.forkserver", "run.py"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
assert server.stdout.readline() == b"ready\n"
pids = []
for request in sys.argv[1:]:
    server.stdin.write(request.encode() + b"\n")
    server.stdin.flush()
    pids.append(int(server.stdout.readline()))
    print("pid", pids[-1], flush=True)
server.stdin.close()
for pid in pids:
    _, status = os.waitpid(pid, 0)
    print("rc", pid, os.waitstatus_to_exitcode(status), flush=True)
server.wait()
"""


@pytest.fixture(scope="module")
def forked_real_jobs(tmp_path_factory):
    """Two run.py jobs forked from one server: a short one, and a long one stopped by SIGTERM
    after its first epoch; and the short one again as a fresh process."""
    tmp = tmp_path_factory.mktemp("forked")
    data = tmp / "data"
    common = [*TINY, "--data-dir", str(data), "--tracking", "off"]
    short = [*common, "--epochs", "2", "--seed", "3"]
    long = [*common, "--epochs", "500", "--seed", "4", "--results-dir", str(tmp / "long")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fresh = subprocess.run(
        [sys.executable, "run.py", *short, "--results-dir", str(tmp / "fresh")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    jobs = {"short": [*short, "--results-dir", str(tmp / "forked")], "long": long}
    requests = [
        json.dumps({"argv": argv, "log": str(tmp / f"{name}.log"), "cwd": str(ROOT)})
        for name, argv in jobs.items()
    ]
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, *requests],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pids = [int(driver.stdout.readline().split()[1]) for _ in requests]
    history = lambda: list((tmp / "long").glob("*/history.csv"))  # noqa: E731
    wait_for(lambda: history() and len(history()[0].read_text().splitlines()) > 1, 300, "epoch 1")
    os.kill(pids[1], signal.SIGTERM)
    out, _ = driver.communicate(timeout=300)
    codes = {int(w[1]): int(w[2]) for w in map(str.split, out.splitlines()) if w[0] == "rc"}
    return tmp, pids, codes, long


def numbers(run_dir: Path) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    timing = ("time", "_s", "per_s", "samples", "mem", "mlflow", "date", "host")
    return {k: v for k, v in metrics.items() if not any(t in k for t in timing)}


@pytest.mark.slow  # a fresh and two forked run.py jobs
def test_a_forked_run_py_job_computes_what_a_fresh_one_does(forked_real_jobs):
    tmp, pids, codes, _ = forked_real_jobs
    assert codes[pids[0]] == 0
    (fresh,), (forked,) = (list((tmp / name).iterdir()) for name in ("fresh", "forked"))
    assert fresh.name == forked.name
    a, b = numbers(fresh), numbers(forked)
    assert a.keys() == b.keys() and len(a) > 3, a
    for key, value in a.items():
        if isinstance(value, float):
            assert b[key] == pytest.approx(value, abs=1e-6), key
        else:
            assert b[key] == value, key
    assert "finished" in (tmp / "short.log").read_text()  # its output went to its log


@pytest.mark.slow
def test_sigterm_to_a_forked_run_py_job_checkpoints_and_exits_75(forked_real_jobs):
    tmp, pids, codes, long = forked_real_jobs
    assert codes[pids[1]] == 75
    (run_dir,) = list((tmp / "long").iterdir())
    assert (run_dir / "status").read_text().strip() == "interrupted"
    assert (run_dir / "checkpoint.pt").is_file() and not (run_dir / "metrics.json").exists()
    # The sweep's planner reads it as a run to resume.
    plan = subprocess.run(
        [sys.executable, "run.py", "--plan"], cwd=ROOT, capture_output=True, timeout=60,
        input=b"".join(w.encode() + b"\0" for w in [str(len(long)), *long]),
    )  # fmt: skip
    state, where, _ = plan.stdout.decode().split("\0")[:3]
    assert (state, where) == ("interrupted", str(run_dir)), plan.stdout
