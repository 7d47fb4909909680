"""A new lab member's first hour, scripted: render from a git checkout named by a relative path,
run the README's one-job example, run the sweep, plot, check for template updates.

Each step asserts the fix of the first-hour issue it exercises: the trial run stays out of the
sweep's figures, .cruft.json points at the template (cruft check answers), the sweep trains every
job once and plot.py reads only the sweep. Tiny settings (width 8, 1 epoch) keep it to about a
minute of training on 2 cores.
"""

import csv
import json
import os
import subprocess
import sys

from conftest import BIN
from test_cruft import git

TINY = ["--device", "cpu", "--width", "8", "--epochs", "1", "--max-steps", "3", "--progress",
        "off"]


def streamed(command, *, capsys, step, **kwargs) -> subprocess.CompletedProcess:
    """Run a step with its output lines printed as they come (past pytest's capture), so the
    minute of training is never a silent stretch; returns the output like subprocess.run."""
    timeout = kwargs.pop("timeout")
    lines = []
    with capsys.disabled():
        print(f"\n--- first hour: {step} ---", flush=True)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1, **kwargs)
        for line in process.stdout:
            lines.append(line)
            print(f"    {line}", end="", flush=True)
        returncode = process.wait(timeout=timeout)
    output = "".join(lines)
    return subprocess.CompletedProcess(command, returncode, output, output)


def test_first_hour_walkthrough(template_copy, tmp_path, capsys):
    repo = tmp_path / "template"
    subprocess.run(["cp", "-r", str(template_copy), str(repo)], check=True)
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "v1", cwd=repo)

    # cookiecutter ../template, from a sibling folder: the relative path of the issue.
    work = tmp_path / "work"
    work.mkdir()
    made = subprocess.run([BIN / "cookiecutter", "--no-input", "../template"], cwd=work,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert "not a clean git checkout" not in made.stdout + made.stderr
    project = work / "lab_project"
    recorded = json.loads((project / ".cruft.json").read_text())["template"]
    assert os.path.samefile(recorded, repo)

    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "PYTHON": sys.executable}
    for name in ("CPU_JOBS", "OMP_NUM_THREADS", "GPUS"):  # run.sh's defaults, as a user has
        env.pop(name, None)

    # The README's "Run one job": a trial run, written to results/trials.
    trial = streamed([sys.executable, "run.py", "--dataset", "digits", *TINY], cwd=project,
                     env=env, timeout=300, capsys=capsys, step="a trial run (run.py)")
    assert trial.returncode == 0, trial.stderr
    assert "Creating initial MLflow database tables" not in trial.stderr  # no MLflow noise
    assert list((project / "results" / "trials").glob("*/metrics.json"))

    # The sweep, then the figures: only the sweep's runs are aggregated.
    sweep = streamed(["bash", "run.sh", "--", *TINY], cwd=project, env=env, timeout=900,
                     capsys=capsys, step="the sweep (run.sh, 9 jobs)")
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert "sweep summary: 9 done (9 ran now" in sweep.stdout
    assert "thread(s) each (CPU_JOBS=auto: " in sweep.stdout  # the cores shared out, said so
    plot = streamed([sys.executable, "plot.py"], cwd=project, env=env, timeout=300,
                    capsys=capsys, step="the figures (plot.py)")
    assert plot.returncode == 0, plot.stderr
    with open(project / "figures" / "aggregate.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3  # 3 learning rates x 3 seeds; the trial run is not a configuration
    assert (project / "figures" / "aggregate.tex").read_text().endswith("\n")
    assert {p.name for p in (project / "figures").glob("*.png")} >= {
        "learning_curves.png", "final_vs_hparam.png", "throughput.png"}

    # cruft check answers (it ended in a traceback when .cruft.json named the project itself).
    check = subprocess.run([BIN / "cruft", "check"], cwd=project, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
