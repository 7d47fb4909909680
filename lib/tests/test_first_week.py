"""The first week's steps: your own model and data in new files, provenance, MLflow experiments,
what git ignores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PACKAGE, ROOT, TINY

# A model in a new folder (no __init__.py) with adaptive pooling, which the built-ins avoid, and
# a dataset in a new module: both as a user writes them after reading the README.
MODEL_FILE = """
from torch import nn

from ..model import register_model


@register_model("pooled", help="a conv and an adaptive average pool")
def pooled(num_classes, channels, image_size, width):
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(width, num_classes),
    )
"""
DATASET_FILE = """
from labrun.datasets import DatasetSplits, register_dataset


@register_dataset("stripes", help="horizontal or vertical stripes, 16x16")
def stripes(options):
    import numpy as np

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 400)
    images = np.zeros((400, 1, 16, 16), dtype=np.uint8)
    images[labels == 0, :, ::2, :] = 255
    images[labels == 1, :, :, ::2] = 255
    return DatasetSplits(train=(images, labels))


def shifted(by):
    def load(options):
        import numpy as np

        images, labels = stripes(options).train
        return DatasetSplits(train=(np.roll(images, by, axis=-1), labels))

    return load


# A paper's variants, registered in a loop: as visible as a decorated function.
for by in (1, 2, 3):
    register_dataset(f"stripes-{by}", help=f"stripes shifted by {by} px")(shifted(by))
"""


def project_with_own_code(dest: Path) -> Path:
    """A copy of the project (run.py, the package, tests/) with the user's two new files."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("run.py", "pyproject.toml", PACKAGE, "tests"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, dest / name)
    (dest / PACKAGE / "models").mkdir()
    (dest / PACKAGE / "models" / "pooled.py").write_text(MODEL_FILE)
    (dest / PACKAGE / "lab_data.py").write_text(DATASET_FILE)
    return dest


def own_project_env(env: dict | None = None) -> dict:
    """The environment for run.py in a copied project: it finds itself, not the rendered one."""
    return {k: v for k, v in (env or os.environ).items() if k != "LABRUN_PROJECT"}


def test_own_model_and_dataset_in_new_files_appear_in_help_without_torch(tmp_path):
    project = project_with_own_code(tmp_path)
    code = (
        "import runpy, sys\n"
        "sys.argv = ['run.py', '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=own_project_env(), capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())
    assert "pooled: a conv and an adaptive average pool" in help_text
    assert "stripes: horizontal or vertical stripes, 16x16" in help_text
    assert "stripes-2: stripes shifted by 2 px" in help_text  # registered in a loop


@pytest.mark.slow  # a training run and the model tests, in subprocesses
def test_own_model_and_dataset_in_new_files_train_and_keep_pytest_green(tmp_path, env, data_dir):
    project = project_with_own_code(tmp_path / "project")
    cmd = [sys.executable, "run.py", *TINY, "--model", "pooled", "--dataset", "stripes-3",
           "--epochs", "1", "--tracking", "off", "--data-dir", str(data_dir)]  # fmt: skip
    env = own_project_env(env)
    result = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    [config] = (project / "results" / "trials").glob("*/config.json")
    config = json.loads(config.read_text())
    assert (config["model"], config["dataset"]) == ("pooled", "stripes-3")
    tests = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q",
             "tests/test_model.py", "-k", "adaptive_pooling or help_names"]  # fmt: skip
    result = subprocess.run(tests, cwd=project, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]


def test_a_name_registered_twice_names_both_places(tmp_path, monkeypatch):
    from labrun import listing, models, project, registry

    package = tmp_path / "pkg"
    package.mkdir()
    for name in ("a", "b"):
        (package / f"{name}.py").write_text(
            'from labrun.models import register_model\n\n\n@register_model("twin")\n'
            f"def {name}(): ...\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(project, "current", lambda: project.Project(tmp_path, "pkg", "pkg"))
    monkeypatch.setattr(models, "MODELS", registry.Registry("register_model"))  # ours alone
    monkeypatch.setattr(models, "register_model", models.MODELS.register)
    with pytest.raises(ValueError, match=r"b.py:4: @register_model\('twin'\) is also at .*a.py:4"):
        listing.collect()


def test_trial_runs_and_sweep_runs_go_to_their_own_experiments():
    from labrun import jobs
    from labrun.config import DEFAULT_EXPERIMENT, parse_args

    trial, _ = parse_args([])
    sweep, _ = parse_args(["--results-dir", str(ROOT / "results" / "sweep")])
    chosen, _ = parse_args(["--experiment", "mine"])
    assert trial.experiment == f"{DEFAULT_EXPERIMENT}-trials"
    assert sweep.experiment == DEFAULT_EXPERIMENT and chosen.experiment == "mine"
    job = jobs.parser("count.py", "Count.", "results/count")  # run.py's flags, settled alike
    assert job.parse_args([]).experiment == DEFAULT_EXPERIMENT
    assert job.parse_args(["--results-dir", str(ROOT / "results" / "trials")]).experiment == (
        f"{DEFAULT_EXPERIMENT}-trials"
    )


def test_provenance_warns_outside_git(tmp_path, monkeypatch, caplog):
    """run.py calls provenance(log) once per run: outside git the run's log says so."""
    import logging

    from labrun.tracking import provenance

    log = logging.getLogger("test.provenance")
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no-repository"))  # git finds no repository
    with caplog.at_level(logging.WARNING, logger="test.provenance"):
        tags = provenance(log)
    assert tags["git_commit"] == "unknown"
    [record] = caplog.records
    assert "not in a git repository" in record.getMessage() and "git init" in record.getMessage()
    monkeypatch.delenv("GIT_DIR")
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "repo" / ".git"))
    commit = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
         "-m", "first"], cwd=tmp_path / "repo", check=True,
    )  # fmt: skip
    assert commit.returncode == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test.provenance"):
        tags = provenance(log)
    assert len(tags["git_commit"]) == 40 and not caplog.records


@pytest.mark.slow  # imports mlflow and creates a sqlite DB
def test_gitignore_ignores_what_tracking_writes(tmp_path, monkeypatch):
    """mlflow.db, its lock and journal, mlruns/: as the tracker really writes them."""
    from labrun import mirror

    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("GIT_DIR", raising=False)
    mirror.init("gitignore-check")
    written = sorted(p.name for p in tmp_path.iterdir() if p.name not in (".git", ".gitignore"))
    assert "mlflow.db" in written and "mlflow.db.lock" in written, written
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    ).stdout.split("\n")
    assert [line for line in status if line and not line.endswith(".gitignore")] == []
