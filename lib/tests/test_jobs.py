"""jobs.py: the run-directory contract for a script that does not train.

The job under test is a real script built on jobs.main (count.py below, torch-free), run as a
user would run it: a subprocess, real signals, the real claim, and run.sh's real sweep engine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEADLINE, LIB, ROOT

import labrun
from labrun import plan, runs
from labrun.claim import claim
from labrun.jobs import NotReady

# The project (count.py imports nothing of it) and this labrun, in the jobs' processes.
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

COUNT = '''
"""count.py: a job that does not train (the README's example, with ways to fail)."""
import sys
import time
from pathlib import Path

from labrun import jobs

parser = jobs.parser("count.py", "Count to --n.", "results/count")
parser.add_argument("--n", type=int, default=3, help="how far to count")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds per number")
parser.add_argument("--fail", action="store_true", help="raise after counting")
parser.add_argument("--after", type=Path, default=None, help="a run that must be finished first")


def identity(args):
    if args.after is not None and not (args.after / "metrics.json").exists():
        raise jobs.NotReady(f"--after: {args.after} is not finished")
    return {"n": args.n, "sleep": args.sleep, "fail": args.fail, "after": str(args.after)}


def work(job):
    for _ in range(job.args.n):
        job.check_stop()
        time.sleep(job.args.sleep)
    if job.args.fail:
        raise RuntimeError("counting failed on purpose")
    (job.out / "count.txt").write_text(f"{job.args.n}\\n")
    job.artifacts.append(job.out / "count.txt")
    return {"count": job.args.n}


if __name__ == "__main__":
    sys.exit(jobs.main(parser, work, identity=identity))
'''


@pytest.fixture
def count_py(tmp_path) -> Path:
    script = tmp_path / "count.py"
    script.write_text(COUNT)
    return script


def count(script: Path, *args: str, results: Path, env: dict | None = None, **kw):
    return subprocess.run(
        [sys.executable, str(script), "--results-dir", str(results), *args],
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "LAB_TRACKING": "off", **(env or {})},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        **kw,
    )


def test_a_job_gets_its_run_directory_files_and_skip_when_done(count_py, tmp_path):
    results = tmp_path / "results"
    where = count(count_py, "--n", "5", "--print-run-dir", results=results)
    out = Path(where.stdout.strip())
    assert where.returncode == 0 and out.parent == results and out.name.startswith("count_n=5-")
    assert not out.exists()  # --print-run-dir does no work
    first = count(count_py, "--n", "5", results=results)
    assert first.returncode == 0, first.stderr
    assert runs.read_status(out) == "finished" and (out / "count.txt").read_text() == "5\n"
    metrics = runs.read_metrics(out)
    assert metrics["count"] == 5 and metrics["wall_time_s"] >= 0
    config = runs.read_json(out / "config.json")
    assert config["identity"]["n"] == 5 and config["run_name"] == out.name
    assert "finished" in (out / "run.log").read_text()
    again = count(count_py, "--n", "5", results=results)
    assert again.returncode == 0 and again.stdout.startswith(f"already finished: {out}")
    # Another identity, another directory; the execution flags are not part of it.
    other = count(count_py, "--n", "6", "--tracking", "off", "--print-run-dir", results=results)
    assert Path(other.stdout.strip()) != out
    fresh = count(count_py, "--n", "5", "--fresh", results=results)
    assert fresh.returncode == 0 and "--fresh: deleting" in fresh.stdout


def test_a_failing_job_exits_1_with_one_line_and_the_traceback_in_run_log(count_py, tmp_path):
    results = tmp_path / "results"
    failed = count(count_py, "--fail", results=results)
    out = Path(count(count_py, "--fail", "--print-run-dir", results=results).stdout.strip())
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1] == (
        "error: RuntimeError: counting failed on purpose"
    )
    assert "Traceback" in (out / "run.log").read_text()  # and in the log on stderr, as run.py
    assert runs.read_status(out) == "failed" and not runs.is_done(out)


def test_bad_input_exits_2_and_leaves_nothing(count_py, tmp_path):
    results = tmp_path / "results"
    bad = count(count_py, "--n", "many", results=results)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --n: invalid int value")
    waiting = count(count_py, "--after", str(tmp_path / "nothing"), results=results)
    assert waiting.returncode == 2 and waiting.stderr.startswith("error: --after: ")
    assert not results.exists() or not any(results.iterdir())


def test_a_bad_lab_tracking_is_refused_as_run_py_refuses_it(count_py, tmp_path):
    results = tmp_path / "results"
    bad = count(count_py, "--print-run-dir", results=results, env={"LAB_TRACKING": "no"})
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert bad.stderr == "error: LAB_TRACKING='no': expected on or off (see count.py --help)\n"
    assert count(count_py, results=results, env={"LAB_TRACKING": " OFF "}).returncode == 0


def test_a_stop_signal_ends_the_job_interrupted_with_75(count_py, tmp_path):
    results = tmp_path / "results"
    out = Path(count(count_py, "--n", "3000", "--sleep", "0.01", "--print-run-dir",
                     results=results).stdout.strip())  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(count_py), "--results-dir", str(results), "--n", "3000",
         "--sleep", "0.01"],
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "LAB_TRACKING": "off"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE
    while runs.read_status(out) != "running":
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 75, stderr
    assert runs.read_status(out) == "interrupted" and not runs.is_done(out)
    assert "SIGTERM" in (out / "run.log").read_text()


def test_a_forced_exit_leaves_the_job_interrupted(count_py, tmp_path):
    """A second signal after LAB_STOP_GRACE_S ends a job that does not check for stops: 130."""
    results = tmp_path / "results"
    args = ["--n", "1", "--sleep", "60"]
    out = Path(count(count_py, *args, "--print-run-dir", results=results).stdout.strip())
    proc = subprocess.Popen(
        [sys.executable, str(count_py), "--results-dir", str(results), *args],
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "LAB_TRACKING": "off",
             "LAB_STOP_GRACE_S": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE
    wchan = Path(f"/proc/{proc.pid}/wchan")  # where the main thread waits in the kernel
    # Running, and asleep past its one check_stop: a SIGTERM before that check is a graceful
    # stop (75), which a loaded machine made this test see once.
    while runs.read_status(out) != "running" or "nanosleep" not in wchan.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 130, stderr
    assert runs.read_status(out) == "interrupted" and not runs.is_done(out)


def test_a_job_claimed_by_another_process_exits_73(count_py, tmp_path):
    results = tmp_path / "results"
    out = Path(count(count_py, "--print-run-dir", results=results).stdout.strip())
    with claim(out):
        busy = count(count_py, results=results)
    assert busy.returncode == 73 and busy.stderr.startswith("error: running elsewhere: ")
    assert not runs.is_done(out)


def test_a_job_whose_directory_is_deleted_exits_73_and_writes_nothing_more(tmp_path):
    """The record a run keeps is a job's too: before each write it checks the claim."""
    lose = COUNT.replace(
        'raise RuntimeError("counting failed on purpose")', "shutil.rmtree(job.out)"
    )
    script = tmp_path / "lose.py"
    script.write_text(lose.replace("import sys\n", "import shutil\nimport sys\n", 1))
    results = tmp_path / "results"
    result = count(script, "--fail", results=results)
    assert result.returncode == 73, result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: lost the claim on "), result.stderr
    assert not list(results.rglob("*.json")), list(results.rglob("*"))


def test_a_job_out_of_memory_ends_with_its_own_line(tmp_path):
    """run.py's remedy for an out-of-memory failure names --batch-size; a job has no such flag,
    so its failure is its own first line (it was an AttributeError inside the failure path)."""
    oom = COUNT.replace(
        'raise RuntimeError("counting failed on purpose")',
        'raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")',
    )
    script = tmp_path / "oom.py"
    script.write_text(oom.replace("import sys\n", "import sys\n\nimport torch\n", 1))
    result = count(script, "--fail", results=tmp_path / "results")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "error: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_plan_answers_for_every_job_of_a_script_in_one_call(count_py, tmp_path):
    results = tmp_path / "results"
    assert count(count_py, "--n", "1", results=results).returncode == 0
    jobs = [["--n", "1"], ["--n", "2"], ["--n", "x"], ["--after", str(tmp_path / "later")]]
    stdin = b"".join(
        f"{len(a) + 2}\0--results-dir\0{results}\0".encode()
        + b"".join(w.encode() + b"\0" for w in a)
        for a in jobs
    )
    answer = subprocess.run(
        [sys.executable, str(count_py), "--plan"],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        input=stdin,
        capture_output=True,
        timeout=DEADLINE,
    )
    fields = answer.stdout.decode().split("\0")[:-1]
    states = [tuple(fields[i : i + 3]) for i in range(0, len(fields), 3)]
    assert [s[0] for s in states] == ["done", "pending", "invalid", "waiting"], states
    assert Path(states[0][1]).name.startswith("count_n=1-") and "later" in states[3][2]


def test_not_ready_is_planned_as_waiting():
    def where(argv):
        raise NotReady("--after: not finished")

    assert plan.plan([["x"]], where) == [("waiting", "", "--after: not finished")]


@pytest.mark.slow
def test_run_sh_sweeps_a_job_line_that_names_a_script(tmp_path, env, monkeypatch):
    """`job count.py ...` runs count.py, planned by its own parser; a job whose input is a run of
    the sweep waits for it and runs once it is done; one whose input never comes stays waiting."""
    # test_sweep.py's stand-in project (helper "sweep" moves it here beside this file)
    sweep = pytest.importorskip("test_sweep")
    make_project, run_sweep = sweep.make_project, sweep.run_sweep
    monkeypatch.delenv("LABRUN_PROJECT")  # count.py's project: the stand-in's folder (its cwd)
    project = make_project(tmp_path / "p", jobs=[])
    (project / "count.py").write_text(COUNT)
    train_dir = subprocess.run(
        [sys.executable, "run.py", "--sleep", "0.5", "--results-dir", "results/sweep",
         "--print-run-dir"],
        cwd=project, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    jobs = [
        f"count.py --n 4 --after {train_dir}",  # first in the list, yet it must wait
        "--sleep 0.5",
        "count.py --n 2",
        f"count.py --n 8 --after {project / 'results' / 'never'}",
    ]
    (project / "jobs.txt").write_text("".join(f"{line}\n" for line in jobs))
    dry = run_sweep(project, "--dry-run")
    assert (
        dry.returncode == 0
        and "4 jobs: 0 done, 2 pending" in dry.stdout
        and "2 waiting" in dry.stdout
    )
    assert f"count.py --n 4 --after {train_dir}" in dry.stdout
    uri = env["MLFLOW_TRACKING_URI"]  # made once: the sweep's --init-tracking only opens it
    first = run_sweep(project, LAB_TRACKING="off", MLFLOW_TRACKING_URI=uri)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "3 done (3 ran now, 0 skipped: already done)" in first.stdout
    assert (
        "1 waiting for unfinished inputs" in first.stdout and "ready    count_n=4" in first.stdout
    )
    calls = (project / "python-calls.log").read_text().splitlines()
    assert "count.py --plan" in calls and "run.py --plan" in calls
    counts = sorted((project / "results" / "count").iterdir())
    assert sorted(json.loads((d / "metrics.json").read_text())["count"] for d in counts) == [2, 4]
    # The analysis started only after its input had finished.
    (after,) = [d for d in counts if d.name.startswith("count_n=4")]
    assert (after / "config.json").stat().st_mtime >= (
        Path(train_dir) / "metrics.json"
    ).stat().st_mtime
    again = run_sweep(project, LAB_TRACKING="off", MLFLOW_TRACKING_URI=uri)
    assert again.returncode == 1 and "3 done (0 ran now, 3 skipped: already done)" in again.stdout


def test_a_slurm_task_runs_the_script_its_job_line_named(count_py, tmp_path):
    """run.sh --slurm records a task's script beside its arguments; the task runs that script."""
    submit = tmp_path / "submit"
    (submit / "args").mkdir(parents=True)
    (submit / "script").mkdir()
    results = tmp_path / "results"
    (submit / "args" / "0").write_bytes(f"--results-dir\0{results}\0--n\0{2}\0".encode())
    (submit / "script" / "0").write_text(f"{count_py}\n")
    (submit / "python").write_text(f"{sys.executable}\n")
    task = subprocess.run(
        ["bash", str(Path(labrun.__file__).with_name("slurm_task.sh")), str(submit)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "LAB_TRACKING": "off",
             "SLURM_ARRAY_TASK_ID": "0"},
        capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert task.returncode == 0, task.stdout + task.stderr
    assert f"{count_py} --results-dir" in task.stdout
    (out,) = results.iterdir()
    assert runs.read_metrics(out)["count"] == 2


@pytest.mark.slow
def test_a_job_is_tracked_in_mlflow(count_py, tmp_path, env):
    from mlflow.tracking import MlflowClient

    results = tmp_path / "results"
    done = count(count_py, "--n", "7", "--tracking", "on", results=results, env=env)
    assert done.returncode == 0, done.stderr
    out = Path(count(count_py, "--n", "7", "--print-run-dir", results=results).stdout.strip())
    run_id = runs.read_metrics(out)["mlflow_run_id"]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == out.name
    assert run.data.metrics["count"] == 7 and run.data.params["n"] == "7"
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.json", "count.txt"}


@pytest.mark.slow
def test_the_readme_example_job_runs_as_written(tmp_path):
    """labrun's README, "A job that does not train": the code block, as count.py beside run.py."""
    readme = (LIB / "README.md").read_text()
    section = readme[readme.index("## A job that does not train") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code.count('PROJECT_ROOT / "data"') == 1  # the one change: a private data folder
    script = tmp_path / "count.py"
    script.write_text(code.replace('PROJECT_ROOT / "data"', repr(str(tmp_path / "data"))))
    first = count(script, results=tmp_path / "results")
    again = count(script, results=tmp_path / "results")
    assert first.returncode == 0, first.stderr
    (out,) = (tmp_path / "results").iterdir()
    assert out.name.startswith("count-") and runs.read_metrics(out)["images"] == 360
    assert runs.read_metrics(out)["classes"] == 10 and (out / "counts.csv").is_file()
    assert again.returncode == 0 and again.stdout.startswith("already finished")
