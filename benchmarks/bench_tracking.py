"""Benchmark: what MLflow costs one quick job, live (interactive) and in sweep mode (issue 34.2).

    .venv/bin/python benchmarks/bench_tracking.py --repeats 3     # markdown to stdout

One `python run.py --epochs 6 --width 16` (run.sh --quick's job) on a freshly rendered project,
in three modes, interleaved so that a change of machine load hits all of them alike:
- live: MLflow on, as `python run.py` (the job creates its MLflow run, sends every epoch, samples
  system metrics, mirrors its end);
- sweep: `LAB_TRACKING_FOLLOWER=1`, as run.sh sets it: the job writes its run directory only,
  then `python -m labrun.tracking follow` (stdin closed) mirrors it, timed on its own: the work a
  sweep's one follower does per job, off the job's critical path;
- off: `--tracking off`, the floor.
Reports each mode's process wall time (median and range), the job's own phases from
metrics.json (wall_time_s: run start to end; train_time_s), and checks that the follower's
MLflow run holds as many metric rows as the live one. The MLflow DB is created before timing
(run.sh creates it once per sweep).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
QUICK = ["--epochs", "6", "--width", "16", "--progress", "off", "--device", "cpu"]


def render(out: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out)))


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    return took


def metric_rows(db: Path, run_dir: Path) -> int:
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    with sqlite3.connect(db) as con:
        query = "select count(*) from metrics where run_uuid = ? and key not like 'system/%'"
        return con.execute(query, (run_id,)).fetchone()[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="jobs per mode")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    project = render(work)
    db = work / "mlflow.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    env.pop("LAB_TRACKING_FOLLOWER", None)
    python = sys.executable
    subprocess.run([python, "run.py", "--init-tracking"],
                   cwd=project, env=env, check=True, capture_output=True)  # fmt: skip
    walls: dict[str, list[float]] = {"live": [], "sweep": [], "off": [], "follower": []}
    phases: dict[str, list[tuple[float, float]]] = {"live": [], "sweep": [], "off": []}
    rows = {}
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats):
        for mode in ("live", "sweep", "off"):
            results = work / f"results-{mode}-{repeat}"
            cmd = [python, "run.py", *QUICK, "--results-dir", str(results)]
            mode_env = dict(env)
            if mode == "sweep":
                mode_env["LAB_TRACKING_FOLLOWER"] = "1"
            if mode == "off":
                cmd += ["--tracking", "off"]
            walls[mode].append(timed(cmd, project, mode_env))
            (run_dir,) = [d for d in results.iterdir() if d.is_dir()]
            metrics = json.loads((run_dir / "metrics.json").read_text())
            phases[mode].append((metrics["wall_time_s"], metrics["train_time_s"]))
            if mode == "sweep":
                follow = [python, "-m", "labrun.tracking", "follow", str(results)]
                walls["follower"].append(timed(follow, project, env))
            if mode != "off":
                rows[mode] = metric_rows(db, run_dir)
    load_after = os.getloadavg()[0]
    import torch

    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load average {load_before:.1f} before / "
          f"{load_after:.1f} after; {args.repeats} jobs per mode, interleaved\n")  # fmt: skip
    print("| mode | process wall s (median, min-max) | run wall_time_s | train_time_s |")
    print("|---|---:|---:|---:|")
    for mode in ("live", "sweep", "off"):
        w = walls[mode]
        wall = statistics.median(x for x, _ in phases[mode])
        train = statistics.median(t for _, t in phases[mode])
        print(f"| {mode} | {statistics.median(w):.1f} ({min(w):.1f}-{max(w):.1f}) | {wall:.1f} "
              f"| {train:.1f} |")  # fmt: skip
    f = walls["follower"]
    print(f"| follower, per job (off the job's path) | {statistics.median(f):.1f} "
          f"({min(f):.1f}-{max(f):.1f}) | | |")  # fmt: skip
    print(f"\nmetric rows (system apart): live {rows['live']}, sweep mode {rows['sweep']}")
    return 0 if rows["live"] == rows["sweep"] else 1


if __name__ == "__main__":
    sys.exit(main())
