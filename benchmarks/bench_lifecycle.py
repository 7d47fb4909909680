"""Benchmark: many jobs on one fresh project, and a tracker that is down (issue "Many jobs").

    .venv/bin/python benchmarks/bench_lifecycle.py            # both checks, markdown to stdout

1. Eight `python run.py --seed S` started at once on a freshly rendered project: no run.sh, no
   `--init-tracking`, so all eight race to create `mlflow.db`. Counts the jobs that finished, the
   MLflow runs and metric rows in the DB, and checks the DB (`pragma integrity_check`, no
   half-migrated `_alembic_tmp_*` tables).
2. One job with `MLFLOW_TRACKING_URI` pointing at a local port where nothing listens: the wall
   time of the job against the same job with `--tracking off`, so the difference is the cost of the
   unreachable tracker (it must be seconds, not the minutes of MLflow's default retries).
3. Two `bash run.sh` started at once on one project (the default 9-job sweep, tiny jobs): every
   job must be trained once -- one MLflow run and one history row per run directory.

Every job is tiny (digits, width 8, 3 optimizer steps): what is measured is start-up and the
shared-DB path, not training.

Issue 34, "Leave at once" and "Start in seconds" (`--lib DIR`: another checkout's lib/src first
on PYTHONPATH, e.g. the template before the change, on the same rendered project; `--before DIR`:
that one and this one, interleaved):

    .venv/bin/python benchmarks/bench_lifecycle.py quick [--repeats 3] [--lib DIR] [--before DIR]
    .venv/bin/python benchmarks/bench_lifecycle.py exit [--workers 0 2 8] [--lib DIR]

quick: the README's quick job, `run.py --epochs 6 --width 16` on digits (data cached, MLflow DB
  created beforehand, as run.sh does), with MLflow on and off, interleaved; its phases from the
  times its log lines reach this process: start (interpreter, imports, data, model, layout
  probe) to the first line, MLflow run creation, the compile decision, 6 epochs, test + MLflow
  end, and exit (the last line to the process's end).
exit: the delay from the `finished` line to the process's end on the GPU path run on CPU
  (lib/tests/pinned_workers.py: persistent workers, the pin-memory thread, and the per-worker
  exit hook of torch <= 2.12, which joins each worker still alive for 5 s), per worker count.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
JOB = ["--device", "cpu", "--width", "8", "--batch-size", "64", "--epochs", "1", "--max-steps",
       "3", "--progress", "off"]


def render(out: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out)))


def parallel_jobs(project: Path, n: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's own default: <project>/mlflow.db
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "run.py", *JOB, "--seed", str(seed)], cwd=project,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for seed in range(n)]
    errors = [proc.communicate()[1] for proc in procs]
    wall = time.perf_counter() - started
    codes = [proc.returncode for proc in procs]
    with sqlite3.connect(project / "mlflow.db") as con:
        runs = con.execute("select status, count(*) from runs group by status").fetchall()
        rows = con.execute("select count(*) from metrics").fetchone()[0]
        integrity = con.execute("pragma integrity_check").fetchone()[0]
        tmp_tables = [r[0] for r in con.execute("select name from sqlite_master")
                      if r[0].startswith("_alembic_tmp")]
    failed = [err.strip().splitlines()[-1] for code, err in zip(codes, errors, strict=True)
              if code != 0]
    return {"jobs": n, "finished": codes.count(0), "runs": dict(runs), "metric_rows": rows,
            "integrity": integrity, "tmp_tables": tmp_tables, "wall_s": wall, "failed": failed}


def tracker_down(project: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    times = {}
    for label, extra, env_uri in (("tracking off", ["--tracking", "off"], None),
                                  ("tracker down", [], f"http://127.0.0.1:{port}")):
        env = {**os.environ}
        env.pop("MLFLOW_TRACKING_URI", None)
        if env_uri:
            env["MLFLOW_TRACKING_URI"] = env_uri
        results = project / "results" / label.replace(" ", "_")
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "run.py", *JOB, *extra, "--results-dir",
                               str(results)], cwd=project, env=env, capture_output=True,
                              text=True)
        times[label] = (time.perf_counter() - started, proc.returncode,
                        proc.stderr.count("training goes on"))
    return times


def two_sweeps(project: Path) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "CPU_JOBS": "1", "OMP_NUM_THREADS": "1",
           "SWEEP_NAME": "twice", "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'twice.db'}"}
    extra = ["--", "--device", "cpu", "--width", "8", "--epochs", "1", "--max-steps", "3"]
    started = time.perf_counter()
    procs = [subprocess.Popen(["bash", "run.sh", *extra], cwd=project, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [proc.communicate()[0] for proc in procs]
    wall = time.perf_counter() - started
    run_dirs = sorted(p.parent for p in (project / "results" / "twice").glob("*/config.json"))
    rows = {d.name: (d / "history.csv").read_text().count("\n") - 1 for d in run_dirs}
    with sqlite3.connect(project / "twice.db") as con:
        per_dir = con.execute("select value, count(*) from tags where key = 'run_dir' "
                              "group by value").fetchall()
    summaries = [next((line for line in out.splitlines() if "sweep summary" in line), "?")
                 for out in outputs]
    return {"dirs": len(run_dirs), "max_rows": max(rows.values(), default=0),
            "mlflow_runs": sum(n for _, n in per_dir), "max_runs_per_dir": max(
                (n for _, n in per_dir), default=0), "codes": [p.returncode for p in procs],
            "summaries": summaries, "wall_s": wall}


def stamped_run(cmd: list[str], cwd: Path, env: dict) -> tuple[int, list[tuple[float, str]], float]:
    """Run `cmd`; (exit code, its stderr lines with the second each arrived, wall seconds)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines = [(time.perf_counter() - started, line.rstrip()) for line in proc.stderr]
    proc.wait()
    return proc.returncode, lines, time.perf_counter() - started


def first(lines: list[tuple[float, str]], text: str, last: bool = False) -> float:
    found = [t for t, line in lines if text in line]
    return found[-1 if last else 0]


def job_env(lib: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if lib:
        env["PYTHONPATH"] = os.pathsep.join([lib, env.get("PYTHONPATH", "")])
    return env


def quick_job(project: Path, repeats: int, libs: dict[str, str | None]) -> dict:
    """Phases of `run.py --epochs 6 --width 16` with MLflow on and off, for each labrun in
    `libs` (label -> lib/src, None: this one), interleaved; medians in seconds."""
    env = {**job_env(None), "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}"}
    subprocess.run([sys.executable, "run.py", "--init-tracking"], cwd=project, env=env,
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "run.py", "--max-steps", "1", "--tracking", "off",
                    "--results-dir", str(project / "warm")], cwd=project, env=env, check=True,
                   capture_output=True)  # digits decoded into data/ once, files in the cache
    phases: dict[tuple[str, str], dict[str, list[float]]] = {}
    for i in range(repeats):
        for tracking in ("on", "off"):
            for label, lib in libs.items():
                results = project / f"q{i}{tracking}{label}"  # tracking is no part of the identity
                cmd = [sys.executable, "run.py", "--epochs", "6", "--width", "16", "--progress",
                       "off", "--tracking", tracking, "--results-dir", str(results)]
                code, lines, wall = stamped_run(cmd, project, {**env, **job_env(lib)})
                assert code == 0, lines[-5:]
                opened, run = first(lines, "INFO data:"), first(lines, "INFO run ")
                decided, finished = first(lines, "INFO compile:"), first(lines, "INFO finished")
                last_epoch = first(lines, " INFO epoch ", True)
                for name, value in (("start to first line", opened), ("MLflow run", run - opened),
                                    ("compile decision", decided - run),
                                    ("6 epochs", last_epoch - decided),
                                    ("test, MLflow end", finished - last_epoch),
                                    ("exit after `finished`", wall - finished), ("wall", wall)):
                    phases.setdefault((label, tracking), {}).setdefault(name, []).append(value)
    return {key: {k: statistics.median(v) for k, v in p.items()} for key, p in phases.items()}


def exit_delay(project: Path, workers: list[int], lib: str | None) -> dict:
    """Seconds from `finished` to the process's end, persistent pinned workers, old exit hook."""
    pinned = TEMPLATE / "lib" / "tests" / "pinned_workers.py"
    delays = {}
    for n in workers:
        cmd = [sys.executable, str(pinned), "--old-exit-hook", "run.py", "--epochs", "2",
               "--width", "8", "--workers", str(n), "--tracking", "off", "--progress", "off",
               "--results-dir", str(project / f"exit{n}")]
        code, lines, wall = stamped_run(cmd, project, job_env(lib))
        assert code == 0, lines[-5:]
        alive = sum("exit hook: worker" in line and line.endswith("alive") for _, line in lines)
        delays[n] = (wall - first(lines, "INFO finished"), alive)
    return delays


def machine_line() -> str:
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return (f"- machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores "
            f"({names[0] if names else platform.processor()}); Python "
            f"{platform.python_version()}; torch "
            f"{torch.__version__}; load average (1 min) now {os.getloadavg()[0]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", nargs="?", choices=("many", "quick", "exit"), default="many",
                        help="many: the three checks above; quick, exit: issue 34's")
    parser.add_argument("--jobs", type=int, default=8, help="parallel jobs on the fresh project")
    parser.add_argument("--repeats", type=int, default=3, help="quick: jobs per setting")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 8],
                        help="exit: DataLoader workers per loader")
    parser.add_argument("--lib", help="quick, exit: this labrun (a lib/src) instead")
    parser.add_argument("--before", help="quick: also this labrun (a lib/src), interleaved")
    args = parser.parse_args()
    if args.check == "quick":
        libs = {"before": args.before, "after": args.lib} if args.before else {"": args.lib}
        with tempfile.TemporaryDirectory() as tmp:
            before = os.getloadavg()[0]
            phases = quick_job(render(Path(tmp)), args.repeats, libs)
        print(machine_line() + f" (at the start {before:.2f})")
        print(f"- command: `python benchmarks/bench_lifecycle.py quick --repeats {args.repeats}"
              f"{' --before ' + args.before if args.before else ''}"
              f"{' --lib ' + args.lib if args.lib else ''}`\n")
        columns = [(label, t) for t in ("on", "off") for label in libs]
        print("| phase (median, s) | " + " | ".join(f"MLflow {t} {label}".strip()
                                                    for label, t in columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for name in phases[columns[0]]:
            print(f"| {name} | " + " | ".join(f"{phases[c][name]:.2f}" for c in columns) + " |")
        return 0
    if args.check == "exit":
        with tempfile.TemporaryDirectory() as tmp:
            before = os.getloadavg()[0]
            delays = exit_delay(render(Path(tmp)), args.workers, args.lib)
        print(machine_line() + f" (at the start {before:.2f})")
        print(f"- command: `python benchmarks/bench_lifecycle.py exit --workers "
              f"{' '.join(map(str, args.workers))}{' --lib ' + args.lib if args.lib else ''}`\n")
        print("| workers per loader | exit after `finished` (s) | workers the exit hook found "
              "alive |\n|---:|---:|---:|")
        for n, (delay, alive) in delays.items():
            print(f"| {n} | {delay:.2f} | {alive} |")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        project = render(Path(tmp))
        load_before = os.getloadavg()[0]
        par = parallel_jobs(project, args.jobs)
        down = tracker_down(project)
        twice = two_sweeps(project)
        load_after = os.getloadavg()[0]
    print(f"- machine: {platform.machine()}, {os.cpu_count()} cores; Python "
          f"{platform.python_version()}; load average (1 min) before / after: {load_before:.2f} "
          f"/ {load_after:.2f}")
    print("- command: `python benchmarks/bench_lifecycle.py`\n")
    print("| check | result |\n|---|---|")
    print(f"| {par['jobs']} parallel `run.py` on a fresh project | {par['finished']} finished, "
          f"MLflow runs {par['runs']}, {par['metric_rows']} metric rows, integrity "
          f"{par['integrity']}, half-migrated tables {par['tmp_tables'] or 'none'}, "
          f"{par['wall_s']:.1f} s wall |")
    off, down_ = down["tracking off"], down["tracker down"]
    print(f"| one job, `--tracking off` | exit {off[1]}, {off[0]:.1f} s |")
    print(f"| one job, tracker down (closed local port) | exit {down_[1]}, {down_[0]:.1f} s, "
          f"{down_[2]} warning line(s); cost of the dead tracker {down_[0] - off[0]:+.1f} s |")
    print(f"| two `run.sh` at once, 9 jobs | {twice['dirs']} run directories, at most "
          f"{twice['max_rows']} history row and {twice['max_runs_per_dir']} MLflow run per "
          f"directory ({twice['mlflow_runs']} runs in all), exit codes {twice['codes']}, "
          f"{twice['wall_s']:.1f} s wall |")
    for summary in twice["summaries"]:
        print(f"\n    {summary.strip()}")
    if par["failed"]:
        print("\nfailed jobs:", *par["failed"], sep="\n  ")
    once = twice["dirs"] == 9 and twice["max_rows"] == 1 and twice["max_runs_per_dir"] == 1
    return 0 if par["finished"] == par["jobs"] and off[1] == down_[1] == 0 and once else 1


if __name__ == "__main__":
    sys.exit(main())
