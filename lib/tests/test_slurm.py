"""run.sh --slurm (labrun's sweep engine and slurm_task.sh) against a real Slurm scheduler
(skipped where there is none).

CI brings up a single-node cluster with two fake GPUs first (.ci/slurm-up.sh in the template
repository), so `--gres=gpu:1` gives each array task CUDA_VISIBLE_DEVICES 0 or 1. The jobs are
the stand-in for run.py from test_sweep.py. A task can report success while the node drained
under it, so every test checks the results the tasks wrote, not only what Slurm says.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEADLINE
from test_sweep import (
    attempts,
    copy_real_project,
    make_project,
    real_env,
    run_dirs,
    run_sweep,
    wait_for,
)


def slurm_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch not found (no Slurm client here)"
    try:
        states = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return "sinfo does not answer"
    if not any(s.rstrip("*") in ("idle", "mix", "alloc") for s in states):
        return f"no Slurm node is up (sinfo: {' '.join(states) or 'nothing'})"
    return None


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    """Asked only when these (slow) tests run: sinfo takes seconds to give up on no controller."""
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(reason)


# Small enough for a CI node; the defaults (8 CPUs, 32G) are for real clusters.
# 2G: a real job's share (torch alone is ~300 MB resident). 100M ran only because this cluster does
# not enforce --mem (no cgroups); the preflight now holds a job to its SLURM_MEM_PER_NODE.
SLURM_ENV = {"SLURM_CPUS": "1", "SLURM_MEM": "2G", "SLURM_TIME": "5", "SLURM_MAX_PARALLEL": "2"}


def submit(project: Path, **env: str) -> str:
    result = run_sweep(project, "--slurm", **{**SLURM_ENV, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return re.search(r"as Slurm array (\d+)", result.stdout)[1]


def squeue(job_id: str) -> list[str]:
    """One line per task still queued or running: 'TASK_ID STATE'."""
    out = subprocess.run(
        ["squeue", "-h", "-r", "-j", job_id, "-o", "%K %t"], capture_output=True, text=True
    )
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def wait_gone(job_id: str, timeout: float = DEADLINE) -> None:
    # Polling squeue is much faster than `sbatch --wait` (which polls every ~10 s).
    wait_for(lambda: not squeue(job_id), timeout, f"Slurm job {job_id} to finish")


def test_slurm_array_runs_the_pending_jobs_one_gpu_each(tmp_path):
    project = make_project(tmp_path, ["--sleep 0.5 --tag 0"])
    assert run_sweep(project).returncode == 0  # job 0 is done before submitting
    (project / "jobs.txt").write_text("".join(f"--sleep 0.5 --tag {i}\n" for i in range(4)))
    job_id = submit(project)
    wait_gone(job_id)
    # Every job produced its results (not just "the array completed").
    assert len(run_dirs(project)) == 4
    missing = [d.name for d in run_dirs(project) if not (d / "metrics.json").exists()]
    outs = "".join(p.read_text() for p in project.glob("logs/slurm/*/*.out"))
    assert not missing, outs
    from_slurm = [r for r in attempts(project) if r["task"] is not None]
    assert sorted(r["task"] for r in from_slurm) == ["0", "1", "2"]  # job 0 not submitted
    assert {r["cvd"] for r in from_slurm} <= {"0", "1"}
    assert all(r["wrapper"] == "1" for r in from_slurm)  # PYTHON reached the tasks
    assert len(list(project.glob(f"logs/slurm/*/{job_id}_*.out"))) == 3
    again = run_sweep(project, "--slurm", **SLURM_ENV)
    assert again.returncode == 0
    assert "nothing to submit: all 4 jobs are done" in again.stdout


def test_slurm_warning_signal_checkpoints_and_requeues(tmp_path):
    project = make_project(tmp_path, ["--sleep 0.2 --first-sleep 120 --tag r"])
    job_id = submit(project)
    wait_for(lambda: attempts(project, finished_only=False), DEADLINE, "the task to start")
    # What Slurm sends SLURM_SIGNAL_SECS before the time limit (--signal=B:USR1@N).
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job_id}_0"], check=True)
    wait_for(lambda: squeue(job_id) == ["0 PD"], DEADLINE, "the task to be requeued")
    (run_dir,) = run_dirs(project)
    assert (run_dir / "status").read_text().strip() == "interrupted"
    # Slurm holds a requeued job back for a couple of minutes (BeginTime); let it start soon.
    release_requeued_until_gone(job_id, timeout=300)
    assert (run_dir / "metrics.json").exists()
    assert len(attempts(project)) == 2  # interrupted once, then resumed and finished
    out = next(project.glob(f"logs/slurm/*/{job_id}_0.out")).read_text()
    assert "requeueing" in out and "SIGUSR1 (the time limit is near)" in out


def test_cancelled_task_checkpoints_and_stays_cancelled(tmp_path):
    project = make_project(tmp_path, ["--sleep 0.2 --first-sleep 120 --tag c"])
    job_id = submit(project)
    wait_for(lambda: attempts(project, finished_only=False), DEADLINE, "the task to start")
    subprocess.run(["scancel", job_id], check=True)  # TERM to every process, then KILL
    wait_gone(job_id)  # not requeued
    (run_dir,) = run_dirs(project)
    assert (run_dir / "status").read_text().strip() == "interrupted"
    out = next(project.glob(f"logs/slurm/*/{job_id}_0.out")).read_text()
    assert "run.py exited with 75" in out and "not requeueing: the job is COMPLETING" in out, out
    assert len(attempts(project)) == 1


def test_resubmitting_skips_tasks_queued_or_running_from_an_earlier_array(tmp_path):
    jobs = [f"--sleep 0.2 --first-sleep 120 --tag {i}" for i in range(3)]
    project = make_project(tmp_path, jobs)
    job_id = submit(project, SLURM_MAX_PARALLEL="1")  # task 0 runs, tasks 1 and 2 wait
    try:
        wait_for(lambda: attempts(project, finished_only=False), DEADLINE, "task 0 to start")
        dry = run_sweep(project, "--slurm", "--dry-run", **SLURM_ENV)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert "0 pending, 0 interrupted, 0 failed, 1 running elsewhere, 2 queued" in dry.stdout
        assert re.search(rf"queued .*\(Slurm task {job_id}_1 PENDING", dry.stdout), dry.stdout
        again = run_sweep(project, "--slurm", **SLURM_ENV)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "nothing to submit" in again.stdout
        # A job added to the sweep is the only one submitted now.
        (project / "jobs.txt").write_text("".join(j + "\n" for j in [*jobs, "--tag new"]))
        third = run_sweep(project, "--slurm", "--dry-run", **SLURM_ENV)
        assert "would submit 1 job(s)" in third.stdout, third.stdout
    finally:
        subprocess.run(["scancel", job_id], check=False)
        wait_gone(job_id)


# ---- real training under Slurm (needs run.py's signal handling: see issue 10) ------------------

REAL = [
    "--dataset",
    "digits",
    "--epochs",
    "3",
    "--width",
    "8",
    "--batch-size",
    "16",
    "--workers",
    "2",
    "--compile",
    "off",
    "--progress",
    "off",
    "--deterministic",
    "--device",
    "cpu",
]


def real_project(tmp_path: Path, args: list[str] = REAL) -> tuple[Path, dict]:
    """A copy of the real project (run.py, package, run.sh) with one real job."""
    project = copy_real_project(tmp_path / "project", [" ".join(args)])
    # 10-minute limit, warning 60 s before it: no USR1 unless a test shortens the limit.
    env = {
        **real_env(),
        "PYTHON": sys.executable,
        "LAB_TRACKING": "off",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        **SLURM_ENV,
        "SLURM_TIME": "10",
        "SLURM_SIGNAL_SECS": "60",
    }
    return project, env


def reference_metrics(tmp_path: Path, project: Path, env: dict, args: list[str] = REAL) -> dict:
    out = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "run.py", *args, "--results-dir", str(out)],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (metrics,) = out.glob("*/metrics.json")
    return json.loads(metrics.read_text())


def same_result(a: dict, b: dict) -> bool:
    keys = ("test_acc", "test_loss", "best_val_acc", "best_epoch", "epochs_run", "steps")
    return all(a[k] == b[k] for k in keys)


def submit_real(project: Path, env: dict, **extra: str) -> str:
    result = subprocess.run(
        ["bash", "sweep.sh", "--slurm"],
        cwd=project,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return re.search(r"as Slurm array (\d+)", result.stdout)[1]


def finish_after_requeue(project: Path, job_id: str) -> tuple[Path, str]:
    wait_for(lambda: squeue(job_id) == ["0 PD"], DEADLINE, "the task to be requeued")
    (run_dir,) = (project / "results" / "sweep").iterdir()
    assert (run_dir / "status").read_text().strip() == "interrupted"
    assert (run_dir / "checkpoint.pt").exists()
    release_requeued_until_gone(job_id, timeout=600)
    out = next(project.glob(f"logs/slurm/*/{job_id}_0.out")).read_text()
    return run_dir, out


def test_real_task_stopped_by_term_checkpoints_requeues_and_matches(tmp_path):
    project, env = real_project(tmp_path)
    expected = reference_metrics(tmp_path, project, env)
    job_id = submit_real(project, env)
    history = lambda: list((project / "results" / "sweep").glob("*/history.csv"))  # noqa: E731
    wait_for(history, 300, "the first epoch")  # then stop it in the middle of the second
    subprocess.run(["scancel", "--signal=TERM", "--full", f"{job_id}_0"], check=True)
    run_dir, out = finish_after_requeue(project, job_id)
    assert "run.py exited with 75" in out and "SIGTERM" in out, out
    assert same_result(json.loads((run_dir / "metrics.json").read_text()), expected), out


def release_requeued_until_gone(job_id: str, timeout: float = 900) -> None:
    """Let every requeued start begin at once (Slurm holds it back a while), until it is done."""
    last_seen, pending_since = [time.monotonic()], [None]

    def gone() -> bool:
        tasks = squeue(job_id)
        if tasks != ["0 PD"]:
            pending_since[0] = None
        elif pending_since[0] is None:
            pending_since[0] = time.monotonic()
        # Started again at once, the node refuses it ("Job credential revoked"): wait 10 s.
        elif time.monotonic() - pending_since[0] > 10:
            subprocess.run(
                ["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"], capture_output=True
            )
            pending_since[0] = None
        if tasks:
            last_seen[0] = time.monotonic()
        # Right after a requeue squeue can briefly list nothing: gone means gone for 10 s.
        return time.monotonic() - last_seen[0] > 10

    wait_for(gone, timeout, f"Slurm job {job_id} to finish")


def test_real_task_at_its_time_limit_checkpoints_requeues_and_matches(tmp_path):
    # ~70 s of training on an idle 2-core machine, no early stop: long enough to meet the
    # warning (15 epochs, early-stopped at 12, once finished first: 21 s).
    args = [*REAL, "--epochs", "60", "--patience", "0"]
    project, env = real_project(tmp_path, args)
    expected = reference_metrics(tmp_path, project, env, args)
    # 2-minute limit, warning 110 s before it: USR1 early in every start (Slurm checks the
    # signal times periodically, so some seconds later); each start trains until its warning.
    job_id = submit_real(project, env, SLURM_TIME="2", SLURM_SIGNAL_SECS="110")
    release_requeued_until_gone(job_id)
    out = next(project.glob(f"logs/slurm/*/{job_id}_0.out")).read_text()
    if "SIGUSR1" not in out:
        pytest.skip("the job finished before Slurm sent the time-limit warning")
    assert "run.py exited with 75" in out and "SIGUSR1 (the time limit is near)" in out, out
    (run_dir,) = (project / "results" / "sweep").iterdir()
    assert same_result(json.loads((run_dir / "metrics.json").read_text()), expected), out
