"""Issue 50: analysis jobs as first-class as training. A render whose run.sh lists 3 seeds and the
CKA of their 3 pairs, each run named by its arguments: the quick sweep trains the runs, then
analyses them (the same list as the full sweep's), the MLflow follower mirrors the analyses too,
and `plot.py --analysis` draws their mean over the seed pairs with its table. Tiny settings
(width 4, 8x8 digits, 3 steps) keep it to under a minute of work on 2 cores."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import BIN

JOBS = """define_jobs() {
  local seed pair
  for seed in 0 1 2; do
    job --seed "${seed}"
  done
  for pair in "0 1" "0 2" "1 2"; do
    job analyze.py "--seed ${pair% *}" "--seed ${pair#* }" --images 60
  done
}
"""
TINY = ["--width", "4", "--image-size", "8", "--epochs", "1", "--max-steps", "3", "--progress",
        "off", "--device", "cpu"]  # fmt: skip


def test_analysis_jobs_named_by_arguments_run_are_mirrored_and_aggregated(bake, tmp_path):
    project = bake()
    run_sh = project / "run.sh"
    text, n = re.subn(r"(?ms)^define_jobs\(\) \{\n.*?^\}\n", JOBS, run_sh.read_text())
    assert n == 1
    run_sh.write_text(text)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "GPUS": "",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PYTHON": sys.executable}
    for name in ("CPU_JOBS", "OMP_NUM_THREADS", "PRESET", "SWEEP_NAME", "LAB_TRACKING"):
        env.pop(name, None)

    def run(*args: str, timeout: int = 600) -> str:
        done = subprocess.run(args, cwd=project, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout

    # The full sweep's dry run: the analyses wait for the full sweep's runs, listed as typed.
    dry = run("bash", "run.sh", "--dry-run")
    assert "6 jobs: 0 done, 3 pending, 0 interrupted, 0 failed, 3 waiting" in dry, dry
    assert "results/sweep/digits-" in dry and "analyze.py '--seed 0' '--seed 1' --images 60" in dry

    # The quick sweep, `-- ARGS` included: its runs first, then the analyses of those very runs.
    sweep = run("bash", "run.sh", "--quick", "--", *TINY)
    assert "3 job(s) to run, 3 waiting for their inputs, 0 done or skipped" in sweep, sweep
    assert "sweep summary: 6 done (6 ran now" in sweep, sweep
    analyses = sorted((project / "results" / "analysis").iterdir())
    ends = [d.name.rsplit("-", 1)[0].split("_")[-3:] for d in analyses]  # both seeds named
    assert ends == [["seed=0", "vs", "seed=1"], ["seed=0", "vs", "seed=2"],
                    ["seed=1", "vs", "seed=2"]]  # fmt: skip
    for analysis in analyses:
        config = json.loads((analysis / "config.json").read_text())
        assert (analysis / "metrics.json").is_file()
        assert [Path(config[side]).parent.name for side in ("run_a", "run_b")] == ["quick"] * 2
    again = run("bash", "run.sh", "--quick", "--dry-run", "--", *TINY)
    assert "6 jobs: 6 done" in again, again  # the same list names the same runs again

    # The follower mirrored the analyses into MLflow, each a FINISHED run with its `cka`.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiments = [e.experiment_id for e in client.search_experiments()]
    mirrored = {r.info.run_name: r for r in client.search_runs(experiments)}
    for analysis in analyses:
        found = mirrored[analysis.name]
        assert found.info.status == "FINISHED" and 0 <= found.data.metrics["cka"] <= 1

    # plot.py --analysis: a heat map per pair, and their mean over the 3 seed pairs with a table.
    shown = run(sys.executable, "plot.py", "--analysis", "--out", "figures")
    assert "1 mean(s) over seed pairs" in shown, shown
    (table,) = (project / "figures").glob("cka_seeds_*.csv")
    assert {f"{table.stem}.{ext}" for ext in ("pdf", "png", "tex")} <= {
        p.name for p in (project / "figures").iterdir()}  # fmt: skip
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["layer_a"] for r in rows] == ["stem", "stage1", "stage2", "stage3", "pool",
                                            "flatten", "fc"]  # fmt: skip
    assert {r["n"] for r in rows} == {"3"} and all(float(r["best_se"]) >= 0 for r in rows)

    # The project's own tests stay green with this job list.
    run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sweep.py")
