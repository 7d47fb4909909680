"""Benchmark: the CPU path of a new lab member -- one job's start-up, and a sweep's jobs at a time.

    .venv/bin/python benchmarks/bench_cpu.py startup            # ~2 min: one job's fixed cost
    .venv/bin/python benchmarks/bench_cpu.py sweep               # ~10 min: CPU_JOBS settings
    .venv/bin/python benchmarks/bench_cpu.py default-sweep       # ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_cpu.py startup --template DIR   # another checkout (before)

startup: a freshly rendered project; `run.py` with one optimizer step (digits, width 16), so what
  is left is the fixed cost every job pays: interpreter, imports, data, model, MLflow, the files.
  The first job (it decodes digits into data/) is shown apart; then --repeats jobs with MLflow
  (sqlite, the default) and with `--tracking off`, median wall time and peak RSS of the job's
  process. One more job under `python -X importtime` says where the imports go. Last, the peak
  RSS of a CIFAR-sized job (synthetic 50000 images in memory, one step): what CPU_JOB_MEM_GB
  budgets for.
sweep: the demo's sweep (9 jobs: 3 lr x 3 seeds, digits, width 16, 6 epochs) under each CPU_JOBS
  / OMP_NUM_THREADS setting, each into its own SWEEP_NAME: wall time of `bash run.sh`.
default-sweep: the generated run.sh as it is (9 jobs, width 64, up to 20 epochs with early
  stopping), CPU_JOBS at its default: what "bash run.sh" costs on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
ONE_STEP = ["--width", "16", "--epochs", "1", "--max-steps", "1", "--progress", "off"]
DEMO_ARGS = ["--", "--epochs", "6", "--width", "16"]
# name -> environment for `bash run.sh` (OMP_NUM_THREADS absent: run.sh's rule decides).
SWEEP_SETTINGS = {
    "CPU_JOBS=1, 1 thread": {"CPU_JOBS": "1", "OMP_NUM_THREADS": "1"},
    "CPU_JOBS=1, threads = cores": {"CPU_JOBS": "1"},
    "CPU_JOBS=auto (a job per core, 1 thread each)": {"CPU_JOBS": "auto"},
    "CPU_JOBS=cores, threads = cores (oversubscribed)": {
        "CPU_JOBS": str(len(os.sched_getaffinity(0))),
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
    },
}


def render(template: Path, out: Path) -> Path:
    """The default answers' project (its hook's "next steps" not printed into the table)."""
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", str(template), "-o",
                    str(out)], check=True, capture_output=True)
    return out / "lab_project"


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB of the process, stderr)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss / 1024, err


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LAB_"))}
    env.update(OMP_NUM_THREADS="1", **extra)  # one thread: stable on shared cores
    return env


def top_imports(stderr: str, top: int = 6) -> list[tuple[str, float]]:
    """The slowest imports that run.py's own code triggered (cumulative seconds)."""
    rows = []
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if match:  # only unindented names: the top of each import chain
            rows.append((match.group(2), int(match.group(1)) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def startup(template: Path, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        results = Path(tmp) / "results"
        cmd = [sys.executable, "run.py", *ONE_STEP]
        first = timed([*cmd, "--results-dir", str(results / "first")], project, job_env())
        rows = {}
        for label, extra in (("MLflow (sqlite)", []), ("`--tracking off`", ["--tracking", "off"])):
            samples = [timed([*cmd, *extra, "--seed", str(100 + i), "--results-dir",
                              str(results / label[:6])], project, job_env())
                       for i in range(repeats)]
            rows[label] = ([s[0] for s in samples], max(s[1] for s in samples))
        _, _, trace = timed([sys.executable, "-X", "importtime", "run.py", *ONE_STEP,
                             "--tracking", "off", "--seed", "999", "--results-dir",
                             str(results / "trace")], project, job_env())
        cifar_sized = timed([*cmd, "--dataset", "synthetic", "--synthetic-size", "50000",
                             "--tracking", "off", "--results-dir", str(results / "big")],
                            project, job_env())
    print(f"- template: {template}; {repeats} jobs per row, 1 thread each")
    print("\n| job (digits, width 16, 1 step) | wall time (s), median | all (s) | peak RSS (MB) |")
    print("|---|---:|---|---:|")
    print(f"| first job of the project (decodes digits into data/) | {first[0]:.2f} | | "
          f"{first[1]:.0f} |")
    for label, (walls, rss) in rows.items():
        listed = ", ".join(f"{w:.2f}" for w in walls)
        print(f"| {label} | {statistics.median(walls):.2f} | {listed} | {rss:.0f} |")
    print(f"| CIFAR-sized (synthetic 50000 in memory, `--tracking off`) | {cifar_sized[0]:.2f} | "
          f"| {cifar_sized[1]:.0f} |")
    print("\n| slowest imports of one job (`-X importtime`, top of each chain) | cumulative (s) |")
    print("|---|---:|")
    for name, seconds in top_imports(trace):
        print(f"| `{name}` | {seconds:.2f} |")


def sweep_wall(project: Path, name: str, env_extra: dict[str, str], args: list[str]) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "CPU_JOBS", "GPUS") and not k.startswith("MLFLOW_")}
    env.update(PYTHON=sys.executable, SWEEP_NAME=name, STATUS_EVERY_LOG="0", **env_extra)
    started = time.perf_counter()
    out = subprocess.run(["bash", "run.sh", *args], cwd=project, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"sweep {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    slots = next((line.split("; ")[1] for line in out.stdout.splitlines()
                  if "job(s) to run" in line), "?")
    return f"{wall:.0f} | {slots}"


def sweep(template: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        timed([sys.executable, "run.py", *ONE_STEP, "--tracking", "off"], project, job_env())
        print("| the demo's sweep: 9 jobs, digits, width 16, 6 epochs | wall (s) | slots |")
        print("|---|---:|---|")
        for i, (label, env_extra) in enumerate(SWEEP_SETTINGS.items()):
            load = os.getloadavg()[0]
            row = sweep_wall(project, f"s{i}", env_extra, DEMO_ARGS)
            print(f"| {label} (load before {load:.1f}) | {row} |", flush=True)


def default_sweep(template: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        load = os.getloadavg()[0]
        row = sweep_wall(project, "sweep", {}, [])
        print("| `bash run.sh` as generated: 9 jobs, digits, width 64, <= 20 epochs | wall (s) | "
              "slots |\n|---|---:|---|")
        print(f"| CPU_JOBS at its default (load before {load:.1f}) | {row} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["startup", "sweep", "default-sweep"])
    parser.add_argument("--template", type=Path, default=TEMPLATE,
                        help="template checkout to render (default: this one)")
    parser.add_argument("--repeats", type=int, default=5, help="startup: jobs per row")
    args = parser.parse_args()
    print(f"- machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores; Python "
          f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}; load average (1 min) "
          f"{os.getloadavg()[0]:.2f}")
    print(f"- command: `python benchmarks/bench_cpu.py {args.part}`\n")
    {"startup": lambda: startup(args.template, args.repeats),
     "sweep": lambda: sweep(args.template),
     "default-sweep": lambda: default_sweep(args.template)}[args.part]()
    print(f"\n- load average (1 min) after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
