"""The generated project's own test suite, run in a subprocess on CPU, as a user would."""

import os
import shutil
import subprocess
import sys

from conftest import BIN


def cluster_is_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return states.returncode == 0 and "idle" in states.stdout


def run_project_tests(project, *args):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's tests isolate MLflow themselves
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=1500,
    )


def test_default_project_passes_its_own_tests(bake):
    project = bake()
    result = run_project_tests(project)
    print(result.stdout[-6000:], result.stderr[-3000:])
    assert result.returncode == 0
    if cluster_is_up():  # CI brings one up (.ci/slurm-up.sh): then the Slurm test must run
        skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
        assert not [line for line in skipped if "test_slurm" in line], skipped


def test_project_without_options_collects_its_tests(bake):
    """Without Slurm and CI files the suite still collects: nothing refers to removed files."""
    project = bake(use_slurm=False, use_github_actions=False)
    result = run_project_tests(project, "--collect-only")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tests/test_slurm.py" not in result.stdout
