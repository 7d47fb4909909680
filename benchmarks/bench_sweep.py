"""Benchmark: planning a large sweep, `bash run.sh --dry-run` with 1000 jobs (target: < 5 s);
with --quick, the README's first sweep: `bash run.sh --quick` (9 real jobs) end to end.

    .venv/bin/python benchmarks/bench_sweep.py                 # 1000 jobs, 3 timed repeats
    .venv/bin/python benchmarks/bench_sweep.py --jobs 200 --per-job 20
    .venv/bin/python benchmarks/bench_sweep.py --quick         # wall time, slots, load

Renders the template into a temporary directory, replaces run.sh's job list by JOBS jobs
(lr x seed), marks a quarter of them done (a metrics.json that parses) and a few failed or
interrupted, then times `bash run.sh --dry-run` end to end (one `run.py --plan` call with the real
parser: interpreter start, imports, 1000 parses and state checks, the listing) `--repeats` times
after one untimed warm-up. For comparison it also times the old way, one
`run.py ARGS --print-run-dir` interpreter per job, over `--per-job` jobs. Prints a markdown table
for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]


def render(out: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out)))


def set_jobs(project: Path, n_jobs: int) -> list[list[str]]:
    """Rewrite run.sh's job list to N jobs: 100 learning rates x N/100 seeds."""
    seeds = max(1, n_jobs // 100)
    lrs = [f"{1e-4 * (i + 1):.4g}" for i in range(n_jobs // seeds)]
    text = (project / "run.sh").read_text()
    start = text.index("define_jobs() {")
    end = text.index("\n}\n", start) + 3
    loops = (f"define_jobs() {{\n  local lr seed\n  for lr in {' '.join(lrs)}; do\n"
             f"    for seed in {' '.join(map(str, range(seeds)))}; do\n"
             '      job --lr "${lr}" --seed "${seed}"\n    done\n  done\n}\n')
    (project / "run.sh").write_text(text[:start] + loops + text[end:])
    return [["--results-dir", "results/sweep", "--lr", lr, "--seed", str(s)]
            for lr in lrs for s in range(seeds)]


def mark_states(project: Path, jobs: list[list[str]]) -> None:
    """A quarter done, a few failed / interrupted: every branch of the state check runs."""
    data = b"".join(f"{len(a)}\0".encode() + b"".join(x.encode() + b"\0" for x in a)
                    for a in jobs)
    out = subprocess.run([sys.executable, "run.py", "--plan"], input=data, cwd=project,
                         capture_output=True, check=True).stdout.decode().split("\0")
    dirs = [Path(out[3 * i + 1]) for i in range(len(jobs))]
    for i, d in enumerate(dirs):
        if i % 4 == 0:
            d.mkdir(parents=True)
            (d / "metrics.json").write_text(json.dumps({"test_acc": 0.9}))
            (d / "status").write_text("finished\n")
        elif i % 50 == 1:
            d.mkdir(parents=True)
            (d / "status").write_text("failed\n" if i % 100 == 1 else "interrupted\n")


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def quick_sweep(env: dict) -> int:
    """`bash run.sh --quick` in a fresh render, as the README's first sweep runs it: its wall
    time, the slots line run.sh prints, and the load before and after (the machine may be
    shared). The digits cache is built by an untimed one-job warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        project = render(Path(tmp))
        subprocess.run([sys.executable, "run.py", "--epochs", "1", "--width", "8",
                        "--tracking", "off", "--results-dir", "results/warmup"], cwd=project,
                       env=env, check=True, capture_output=True)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        out = subprocess.run(["bash", "run.sh", "--quick"], cwd=project, env=env, check=True,
                             capture_output=True, text=True).stdout
        wall = time.perf_counter() - t0
    slots = next(line for line in out.splitlines() if "slot(s)" in line).split("; ", 1)[1]
    print(f"- machine: {platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"- command: `python benchmarks/bench_sweep.py --quick`; load average (1 min) "
          f"before / after: {load:.2f} / {os.getloadavg()[0]:.2f}\n")
    print("| sweep | wall (s) | slots, as run.sh prints them |\n|---|---:|---|")
    print(f"| `bash run.sh --quick` (9 jobs) | {wall:.0f} | {slots.split('; logs in')[0]} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-job", type=int, default=20,
                    help="jobs to time the old one-interpreter-per-job planning on")
    ap.add_argument("--quick", action="store_true",
                    help="time the 9-job quick sweep instead (real training)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHON": sys.executable, "GPUS": "", "LC_ALL": "C"}
    if args.quick:
        return quick_sweep(env)
    with tempfile.TemporaryDirectory() as tmp:
        project = render(Path(tmp))
        jobs = set_jobs(project, args.jobs)
        mark_states(project, jobs)
        cmd = ["bash", "run.sh", "--dry-run"]
        listing = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True,
                                 check=True).stdout   # warm-up: file cache, __pycache__
        times = [timed(cmd, project, env) for _ in range(args.repeats)]
        t0 = time.perf_counter()
        for argv in jobs[: args.per_job]:
            subprocess.run([sys.executable, "run.py", *argv, "--print-run-dir"], cwd=project,
                           check=True, capture_output=True)
        per_job = (time.perf_counter() - t0) / args.per_job
    load = os.getloadavg()[0]
    print(f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"- command: `python benchmarks/bench_sweep.py --jobs {args.jobs} "
          f"--repeats {args.repeats} --per-job {args.per_job}`; load average (1 min): {load:.2f}")
    print(f"- summary line of the listing: `{listing.strip().splitlines()[-2]}`\n")
    print("| what | jobs | time (s) | all runs (s) |")
    print("|---|---:|---:|---|")
    print(f"| `run.sh --dry-run` (one `run.py --plan`) | {args.jobs} | "
          f"{statistics.median(times):.2f} (median) | {', '.join(f'{t:.2f}' for t in times)} |")
    print(f"| old: one `run.py --print-run-dir` per job | {args.per_job} | "
          f"{per_job:.3f} per job -> {per_job * args.jobs:.0f} for {args.jobs} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
