"""The README's edits of run.py, made as it words them (owner_edits.py): a new hyperparameter is
one line of Config that `--help` describes, a run trains with and run.sh sweeps; after the SGD
and LBFGS edits `--help` describes only what exists and the project's own tests stay green."""

import ast
import itertools
import json
import os
import re
import subprocess
import sys

import pandas as pd
from owner_edits import lbfgs_edit, sgd_edit
from test_generated_project import run_project_tests

TINY = ["--device", "cpu", "--width", "8", "--batch-size", "64", "--epochs", "2"]
TINY += ["--progress", "off", "--tracking", "off"]


def python(project, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "LABRUN_PROJECT"}, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def help_of(project) -> str:
    done = python(project, "run.py", "--help")
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def read_flags(project) -> set[str]:
    """Every `args.<name>` that run.py reads."""
    tree = ast.parse((project / "run.py").read_text())
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "args"}  # fmt: skip


def test_sgd_edit_adds_momentum_that_trains_and_sweeps(bake):
    project = bake()
    sgd_edit(project)
    text = help_of(project)
    # --help says what exists: the owner's lines, no warm-up of a schedule that is gone
    assert "--lr LR initial learning rate, / 10 after each third of the steps" in text
    assert "--momentum MOMENTUM SGD's Nesterov momentum (default: 0.9)" in text
    assert "--warm-up" not in text and "one-cycle" not in text
    assert {f"--{name.replace('_', '-')}" for name in read_flags(project)} <= set(text.split())
    refused = python(project, "run.py", "--momentum", "1")
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: --momentum: must be in [0, 1), got 1")

    trained = python(project, "run.py", *TINY, "--momentum", "0.5")
    assert trained.returncode == 0, trained.stderr[-3000:]
    [config] = (project / "results" / "trials").glob("*momentum=0.5*/config.json")
    config = json.loads(config.read_text())
    assert config["momentum"] == 0.5 and "momentum" in config["experiment_keys"]

    # swept from run.sh: the dry run lists the job, the sweep trains it
    run_sh = project / "run.sh"
    text = run_sh.read_text()
    start = text.index("define_jobs() {")
    end = text.index("\n}\n", start)
    jobs = f"define_jobs() {{\n  job {' '.join(TINY)} --momentum 0.8\n}}\n"
    run_sh.write_text(text[:start] + jobs + text[end + 3 :])
    env = {**os.environ, "PYTHON": sys.executable, "GPUS": "", "LAB_TRACKING": "off"}
    env.pop("LABRUN_PROJECT", None)
    dry = subprocess.run(["bash", "run.sh", "--dry-run"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert len(re.findall(r"momentum=0\.8", dry.stdout)) == 1, dry.stdout
    swept = subprocess.run(["bash", "run.sh"], cwd=project, env=env, capture_output=True,
                           text=True, timeout=900)  # fmt: skip
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    finished = sorted(p.parent.name for p in (project / "results" / "sweep").glob("*/metrics.json"))
    assert len(finished) == 1 and "momentum=0.8" in finished[0], finished


def test_lbfgs_edit_keeps_the_projects_tests_green(bake, capsys):
    project = bake()
    lbfgs_edit(project)
    text = help_of(project)
    assert "--lr LR LBFGS's step length (its line search scales it)" in text
    assert "--weight-decay" not in text and "--warm-up" not in text
    assert {f"--{name.replace('_', '-')}" for name in read_flags(project)} <= set(text.split())
    # The project tests' size (its conftest's flags), one thread: the same numbers on any CPU.
    # A fixed LBFGS step (no line search) went 2.38 -> 4.40 -> 1.57 here and, on another
    # EPYC, 2.40 -> 2.07 -> 2.55; its strong-Wolfe line search falls every epoch.
    trained = python(project, "run.py", *TINY, "--epochs", "3", "--lr", "0.01",
                     env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    [history] = (project / "results").glob("*/*/history.csv")
    losses = pd.read_csv(history).train_loss.tolist()
    with capsys.disabled():
        print(f"\nLBFGS train loss per epoch: {' -> '.join(f'{x:.3f}' for x in losses)}")
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    returncode, output = run_project_tests(project, "-v", "-rs", capsys=capsys,
                                           label="after the README's LBFGS edit")  # fmt: skip
    assert returncode == 0, output[-6000:]
