"""run.sh --slurm against a real Slurm scheduler (skipped where there is none).

CI brings up a single-node cluster with two fake GPUs first (.ci/slurm-up.sh in the template
repository), so `--gres=gpu:1` gives each array task CUDA_VISIBLE_DEVICES 0 or 1. The jobs are
the stand-in for run.py from test_sweep.py. A task can report success while the node drained
under it, so every test checks the results the tasks wrote, not only what Slurm says.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_sweep import attempts, make_project, run_dirs, run_sweep, wait_for


def slurm_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch not found (no Slurm client here)"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return "sinfo does not answer"
    if not any(s.rstrip("*") in ("idle", "mix", "alloc") for s in states):
        return f"no Slurm node is up (sinfo: {' '.join(states) or 'nothing'})"
    return None


SKIP_REASON = slurm_missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON)),
]

# Small enough for a CI node; the defaults (8 CPUs, 32G) are for real clusters.
SLURM_ENV = {"SLURM_CPUS": "1", "SLURM_MEM": "100M", "SLURM_TIME": "5",
             "SLURM_MAX_PARALLEL": "2"}


def submit(project: Path) -> str:
    result = run_sweep(project, "--slurm", **SLURM_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    return re.search(r"as Slurm array (\d+)", result.stdout)[1]


def squeue(job_id: str) -> list[str]:
    """One line per task still queued or running: 'TASK_ID STATE'."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%K %t"],
                         capture_output=True, text=True)
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def wait_gone(job_id: str, timeout: float = 90) -> None:
    # Polling squeue is much faster than `sbatch --wait` (which polls every ~10 s).
    wait_for(lambda: not squeue(job_id), timeout, f"Slurm job {job_id} to finish")


def test_slurm_array_runs_the_pending_jobs_one_gpu_each(tmp_path):
    project = make_project(tmp_path, ["--sleep 0.5 --tag 0"])
    assert run_sweep(project).returncode == 0   # job 0 is done before submitting
    (project / "jobs.txt").write_text("".join(f"--sleep 0.5 --tag {i}\n" for i in range(4)))
    job_id = submit(project)
    wait_gone(job_id)
    # Every job produced its results (not just "the array completed").
    assert len(run_dirs(project)) == 4
    missing = [d.name for d in run_dirs(project) if not (d / "metrics.json").exists()]
    outs = "".join(p.read_text() for p in project.glob("logs/slurm/*/*.out"))
    assert not missing, outs
    from_slurm = [r for r in attempts(project) if r["task"] is not None]
    assert sorted(r["task"] for r in from_slurm) == ["0", "1", "2"]   # job 0 not submitted
    assert {r["cvd"] for r in from_slurm} <= {"0", "1"}
    assert all(r["wrapper"] == "1" for r in from_slurm)   # PYTHON reached the tasks
    assert len(list(project.glob(f"logs/slurm/*/{job_id}_*.out"))) == 3
    again = run_sweep(project, "--slurm", **SLURM_ENV)
    assert again.returncode == 0
    assert "nothing to submit: all 4 jobs are done" in again.stdout


def test_slurm_warning_signal_checkpoints_and_requeues(tmp_path):
    project = make_project(tmp_path, ["--sleep 0.2 --first-sleep 120 --tag r"])
    job_id = submit(project)
    wait_for(lambda: attempts(project, finished_only=False), 30, "the task to start")
    # What Slurm sends SLURM_SIGNAL_SECS before the time limit (--signal=B:USR1@N).
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job_id}_0"], check=True)
    wait_for(lambda: squeue(job_id) == ["0 PD"], 30, "the task to be requeued")
    (run_dir,) = run_dirs(project)
    assert (run_dir / "status").read_text().strip() == "interrupted"
    # Slurm holds a requeued job back for a couple of minutes (BeginTime); let it start now.
    subprocess.run(["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"], check=True)
    wait_gone(job_id)
    assert (run_dir / "metrics.json").exists()
    assert len(attempts(project)) == 2   # interrupted once, then resumed and finished
    out = next(project.glob(f"logs/slurm/*/{job_id}_0.out")).read_text()
    assert "requeueing" in out
