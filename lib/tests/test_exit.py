"""A job leaves the moment it ends (issue 34, "Leave at once").

However a run ends (finished, failed, interrupted, a tool), its loaders' workers are shut down
before the interpreter's exit hooks run: on the GPU path (persistent workers, the pin-memory
thread) torch <= 2.12 joined each worker still alive there for 5 s. pinned_workers.py runs that
very path on CPU, old hook included, and reports what the hook found. A job run as a script then
leaves by os._exit, after what Python's own exit does first (non-daemon threads, atexit hooks,
flushed output): these tests check that nothing of that is lost.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RUN_PY, TINY, mlflow_run, read_metrics, run_dir_of

PINNED = Path(__file__).resolve().parent / "pinned_workers.py"


def pinned_command(data_dir: Path, results: Path, *args: str) -> list[str]:
    """run.py with persistent pinned workers (2 per loader) and torch <= 2.12's exit hook."""
    cmd = [sys.executable, str(PINNED), "--old-exit-hook", str(RUN_PY), *TINY]
    cmd += ["--data-dir", str(data_dir), "--results-dir", str(results), "--workers", "2"]
    return [*cmd, "--tracking", "off", *args]


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, cwd=RUN_PY.parent, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def worker_report(stderr: str) -> tuple[set[int], dict[int, str]]:
    """The workers pinned_workers.py saw started, and what the exit hook found of each."""
    started: set[int] = set()
    for pids, how in re.findall(r"pinned-workers: started ([\d,]+) \((.*)\)", stderr):
        assert how == "persistent, pin thread alive", how  # the GPU path, not the CPU one
        started.update(int(pid) for pid in pids.split(","))
    found = {int(pid): state for pid, state in re.findall(r"exit hook: worker (\d+) (\w+)", stderr)}
    return started, found


def failing_after_first_evaluation(cmd: list[str]) -> list[str]:
    """`cmd` (pinned_command) with a run that fails once the train and val workers are up."""
    code = (
        "import runpy, sys\n"
        "from labrun import train\n"
        "evaluate = train.evaluate\n"
        "def broken(*args, **kwargs):\n"
        "    evaluate(*args, **kwargs)\n"
        "    raise RuntimeError('boom after evaluation')\n"
        "train.evaluate = broken\n"
        f"sys.argv = [{str(PINNED)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(PINNED)!r}, run_name='__main__')\n"
    )
    return [sys.executable, "-c", code, *cmd[2:]]


@pytest.mark.parametrize(
    ("ending", "code"),
    [
        ("finished", 0),
        ("interrupted", 75),
        pytest.param("failed", 1, marks=pytest.mark.slow),
        pytest.param("tool", 0, marks=pytest.mark.slow),
    ],
)
def test_persistent_pinned_workers_are_shut_down_before_the_exit_hooks(
    ending, code, env, data_dir, tmp_path
):
    results = tmp_path / "results"
    seen = ""
    if ending == "interrupted":
        proc = start(pinned_command(data_dir, results, "--epochs", "50"), env)
        for line in proc.stderr:  # the first epoch done: train and val workers are up
            seen += line
            if "epoch 1/50" in line:
                proc.send_signal(signal.SIGTERM)
                break
    elif ending == "failed":
        proc = start(failing_after_first_evaluation(pinned_command(data_dir, results)), env)
    else:
        extra = ["--find-lr"] if ending == "tool" else ["--epochs", "2"]
        proc = start(pinned_command(data_dir, results, *extra), env)
    _, err = proc.communicate(timeout=600)
    err = seen + err
    assert proc.returncode == code, err
    started, found = worker_report(err)
    assert started, err  # the path under test was taken: workers with a pin-memory thread
    # Every worker was joined by the run itself: the hook that waited 5 s for each found it gone.
    assert found == dict.fromkeys(started, "done"), err
    assert "exited unexpectedly" not in err  # no worker was killed on the way out
    if ending != "tool":  # a tool writes no status
        assert (run_dir_of(results) / "status").read_text().strip() == ending


def test_a_job_run_as_a_script_leaves_with_nothing_lost(env, data_dir, tmp_path, mlflow_uri):
    """A job leaves by os._exit: its threads, exit hooks and output all made it, and so did its
    files and MLflow run; the code after main() in the script never runs."""
    results = tmp_path / "results"
    args = [*TINY, "--epochs", "2", "--data-dir", str(data_dir), "--results-dir", str(results)]
    code = (
        "import atexit, runpy, sys, threading\n"
        f"sys.argv = [{str(RUN_PY)!r}, *{args!r}]\n"
        "atexit.register(print, 'exit hook ran', end='')  # no newline: only a flush sends it\n"
        "def after_main():\n"
        "    threading.main_thread().join()  # Python's exit waits for this thread\n"
        "    print('thread ran', file=sys.stderr, flush=True)\n"
        "threading.Thread(target=after_main).start()\n"
        f"runpy.run_path({str(RUN_PY)!r}, run_name='__main__')\n"
        "print('main returned')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=RUN_PY.parent, text=True, capture_output=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("exit hook ran") and "main returned" not in done.stdout
    assert "thread ran" in done.stderr
    run_dir = run_dir_of(results)
    metrics = read_metrics(run_dir)
    assert (run_dir / "status").read_text() == "finished\n"
    assert "finished (max_epochs)" in (run_dir / "run.log").read_text().splitlines()[-1]
    run = mlflow_run(mlflow_uri, metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_acc"] == pytest.approx(metrics["test_acc"])
    assert json.loads((run_dir / "config.json").read_text())["epochs"] == 2


def test_main_called_by_other_code_returns(main_in_process, tmp_path):
    """Imported (a test, a notebook, a tool), run.py's main() returns: the caller goes on."""
    assert main_in_process("--epochs", "1", "--max-steps", "2", "--tracking", "off",
                           "--results-dir", str(tmp_path)) == 0  # fmt: skip
