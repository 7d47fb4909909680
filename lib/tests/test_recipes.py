"""labrun's README, "Datasets" and "Models: the registry", followed literally in a project's copy.

The code blocks are read from lib/README.md and appended to the files it names (`<package>/...`
in the project's package); the commands under them are run as written (plus tiny CPU settings
when they train).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import LIB, PACKAGE, ROOT, TINY

RECIPE = re.compile(
    r"(?:append one function to|write a function in) `(?P<file>[^`]+)`.*?```python\n"
    r"(?P<code>.*?)```\n"
    r"```bash\n(?P<command>.*?)\n```",
    re.DOTALL | re.IGNORECASE,
)


def recipes() -> list[dict]:
    found = [m.groupdict() for m in RECIPE.finditer((LIB / "README.md").read_text())]
    for recipe in found:
        recipe["file"] = recipe["file"].replace("<package>", PACKAGE)
        recipe["command"] = recipe["command"].splitlines()[0]  # the block's first command
    assert [Path(r["file"]).name for r in found] == ["data.py", "model.py"]
    return found


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of this project with both recipes applied, and the .npz the data recipe reads."""
    copy = tmp_path / "project"
    shutil.copytree(
        ROOT,
        copy,
        ignore=shutil.ignore_patterns(
            "results", "data", "figures", "mlflow.db", ".git", "__pycache__", ".pytest_cache"
        ),
    )
    for recipe in recipes():
        assert (copy / recipe["file"]).is_file(), f"the README names {recipe['file']}"
        with open(copy / recipe["file"], "a") as f:
            f.write("\n\n" + recipe["code"])
    rng = np.random.default_rng(0)
    np.savez(
        copy / "mydata.npz",
        x_train=rng.integers(0, 256, (60, 1, 12, 12), dtype=np.uint8),
        y_train=np.arange(60) % 2,
        x_test=rng.integers(0, 256, (10, 1, 12, 12), dtype=np.uint8),
        y_test=np.arange(10) % 2,
    )
    return copy


def run_command(project: Path, command: str, *extra: str, env=None):
    argv = shlex.split(command)
    assert argv[:2] == ["python", "run.py"]
    # The copy finds itself (its pyproject.toml), not the project conftest.py names.
    env = {k: v for k, v in (env or os.environ).items() if k != "LABRUN_PROJECT"}
    return subprocess.run(
        [sys.executable, "run.py", *argv[2:], *extra],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_recipes_appear_in_help_and_in_the_run_name(project):
    help_text = " ".join(run_command(project, "python run.py --help").stdout.split())  # unwrap
    assert "mydata" in help_text and "my lab's arrays" in help_text
    assert "mlp" in help_text and "a two-layer perceptron" in help_text
    data_recipe, model_recipe = recipes()
    data_dir = run_command(project, data_recipe["command"], "--print-run-dir")
    assert Path(data_dir.stdout.strip()).name.startswith("mydata_data_path=mydata.npz"), data_dir
    model_dir = run_command(project, model_recipe["command"], "--print-run-dir")
    assert "model=mlp" in Path(model_dir.stdout.strip()).name, model_dir


@pytest.mark.slow
def test_recipes_train(project, env):
    env = {**env, "LAB_TRACKING": "off"}
    for recipe in recipes():
        done = run_command(
            project,
            recipe["command"],
            *TINY,
            "--epochs",
            "1",
            "--max-steps",
            "2",
            "--batch-size",
            "8",
            env=env,
        )
        assert done.returncode == 0, done.stderr
        (metrics,) = (project / "results").rglob("metrics.json")
        config = (metrics.parent / "config.json").read_text()
        if "mydata" in recipe["command"]:
            assert '"class_names": [\n    "healthy",' in config and '"channels": 1' in config
        metrics.unlink()  # the next recipe's run is the only finished one
