"""Benchmark: where a quick job's fixed cost goes, phase by phase, in a fresh `python run.py`
(the one process model of run.sh's sweep: every job a fresh interpreter).

    .venv/bin/python benchmarks/bench_job_phases.py                  # 3 jobs, in a fresh render
    .venv/bin/python benchmarks/bench_job_phases.py --project DIR --repeats 5 -- --device cpu

Runs the quick preset's job (`run.py --epochs 6 --width 16`, as `bash run.sh --quick` runs it,
MLflow deferred to the follower as in a sweep) `--repeats` times, each in its own results folder,
after one untimed warm-up (the digits cache, __pycache__). A driver in the job's interpreter
stamps the end of each phase by wrapping labrun's verbs (nothing of run.py is changed):

    interpreter    Python itself up (from the parent's Popen)
    import torch   `import torch`
    import labrun  labrun's package
    run set up     run.py's imports, its flags, the claim, the device: the TrainingJob made
    data: load     labrun.load_data: splits and loaders
    data: preflight  preflight.check_memory: the model on the meta device, the memory estimate
    model, resume  model, optimizer, job.resume (the run directory, run.log)
    compile        hardware.decide_compile: the compile decision (and its probe)
    warm-up        the rest of job.compile (a compile, when chosen)
    first epoch    the first epoch's steps, evaluation and history row
    other epochs   the rest of the loop, the test, metrics.json
    teardown       from job.finish's return to the process's exit (parent's wait)

Prints a markdown table (median seconds per phase) for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
QUICK = ["--epochs", "6", "--width", "16"]
PHASES = ["interpreter", "import torch", "import labrun", "run set up", "data: load",
          "data: preflight", "model, resume", "compile", "warm-up", "first epoch", "other epochs",
          "teardown"]  # fmt: skip

# Runs in the job's interpreter: run.py as __main__, each phase's end appended to PHASE_FILE
# (run.py leaves with os._exit: nothing may wait for an atexit hook).
DRIVER = r"""
import os, sys, time, runpy
out = open(os.environ["PHASE_FILE"], "a")
def mark(name):
    out.write(f"{name}\t{time.time()}\n"); out.flush()
mark("interpreter")
import torch
mark("import torch")
import labrun
from labrun import hardware, preflight, train
from labrun.session import TrainingJob
def after(owner, method, name, once=True):
    original = getattr(owner, method)
    def wrapped(*a, **k):
        result = original(*a, **k)
        if not (once and getattr(wrapped, "done", False)):
            wrapped.done = True
            mark(name)
        return result
    setattr(owner, method, wrapped)
after(TrainingJob, "__init__", "run set up")
check_memory = preflight.check_memory
def checked(*a, **k):
    mark("data: load")
    return check_memory(*a, **k)
preflight.check_memory = checked
after(train, "load_data", "data: preflight")
after(TrainingJob, "resume", "model, resume")
after(hardware, "decide_compile", "compile")
after(TrainingJob, "compile", "warm-up")
after(TrainingJob, "end_epoch", "first epoch")
after(TrainingJob, "finish", "other epochs")
sys.argv = ["run.py", *sys.argv[1:]]
mark("import labrun")
runpy.run_path("run.py", run_name="__main__")
"""


def render(out: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out)))


def one_job(project: Path, argv: list[str], env: dict) -> dict[str, float]:
    """Seconds of each phase of one fresh job."""
    with tempfile.NamedTemporaryFile("r", suffix=".tsv") as marks:
        env = {**env, "PHASE_FILE": marks.name}
        t0 = time.time()
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, *argv],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
        )
        t_end = time.time()
        if done.returncode != 0:
            raise SystemExit(f"the job failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        stamps = dict(line.split("\t") for line in marks.read().splitlines())
    times, last = {}, t0
    for phase in PHASES[:-1]:
        if phase in stamps:
            times[phase], last = float(stamps[phase]) - last, float(stamps[phase])
    times["teardown"] = t_end - last
    times["total"] = t_end - t0
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, help="a rendered project [a fresh render]")
    ap.add_argument("--repeats", type=int, default=3, help="timed jobs [3]")
    ap.add_argument("extra", nargs="*", help="more run.py arguments (after --)")
    args = ap.parse_args()
    env = {**os.environ, "LAB_TRACKING_FOLLOWER": "1", "OMP_NUM_THREADS": "1",
           "LAB_JOB_CPUS": "1", "LC_ALL": "C"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        project = args.project or render(Path(tmp))
        warm = [*QUICK, *args.extra, "--results-dir", f"{tmp}/warm"]
        one_job(project, warm, env)
        runs = [
            one_job(project, [*QUICK, *args.extra, "--results-dir", f"{tmp}/r{i}"], env)
            for i in range(args.repeats)
        ]
    print(
        f"- machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}, load average "
        f"(1 min) {os.getloadavg()[0]:.2f}"
    )
    print(
        f"- command: `python benchmarks/bench_job_phases.py --repeats {args.repeats}"
        f"{' -- ' + ' '.join(args.extra) if args.extra else ''}` (1 thread, MLflow deferred)\n"
    )
    print("| phase | median (s) | all (s) |\n|---|---:|---|")
    for phase in [*PHASES, "total"]:
        values = [r.get(phase, 0.0) for r in runs]
        print(
            f"| {phase} | {statistics.median(values):.2f} | "
            f"{', '.join(f'{v:.2f}' for v in values)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
