"""labrun's sweep engine: the queue behind a project's run.sh.

run.sh holds the job list in shell (`job ARGS...` once per job) and ends with

    exec "${PYTHON}" -m labrun.sweep run.sh "$@" < <(printf '%s\\0' N_QUICK QUICK_ARGS... JOBS...)

where each job is its argument count then its arguments, NUL-terminated (read_job_list). Every
setting is an environment variable, listed with its default in ENVIRONMENT; `bash run.sh --help`
prints run.sh's header, then that list. Imports no torch and no mlflow: `--help` is instant.

How it works:
  1. plan:  each job is one run.py invocation: `--results-dir results/SWEEP_NAME`, the preset's
            arguments (QUICK_ARGS with --quick), the job's own, then those after `--` (the last of
            a flag wins); `job SCRIPT.py ARGS...` one of another script built on labrun's jobs.py
            (e.g. analyze.py), as is. ONE call of `SCRIPT --plan` per script (its own parser, no
            torch) gives every job's run directory and state (plan.py lists them): done, running
            (running elsewhere), stopping (waited for, up to SWEEP_STOPPING_WAIT_S), interrupted,
            failed, refused, pending, waiting (planned again whenever a job of the sweep ends),
            invalid.
  2. queue: JOBS_PER_GPU slots per GPU (gpu_slots); without a GPU CPU_JOBS slots (cpu_slots).
            Every job runs in its own session (process group) with CUDA_VISIBLE_DEVICES set to its
            slot's GPU and a parent-death signal (SIGTERM), so it is told to stop if the sweep
            dies, even by SIGKILL. When a job ends its slot takes the next pending job. A job that
            finds its run claimed by another process exits 73: "running elsewhere".
            Every job is a fresh `python run.py`: one process model for claims, signals and
            exit codes.
  3. stop:  the first INT/TERM/HUP sends SIGTERM to every running job (it checkpoints and exits
            75); any later one SIGKILLs their process groups. Either way the sweep reaps every
            job, marks a killed job's status "interrupted", prints the summary, then exits
            128+first signal.
  4. --slurm: the pending jobs as one sbatch array (slurm_task.sh, beside this file, runs one
            task); tasks still queued or running from an earlier array are not submitted again.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .runs import (
    EXIT_BUSY,
    EXIT_INTERRUPTED,
    ForeignFile,
    open_append,
    own_dir,
    read_status,
    write_status,
)

ENVIRONMENT = """\
Environment (defaults in brackets):
  PYTHON        interpreter that runs run.py [python]
  PRESET        quick: as --quick [empty: the sweep as listed]
  SWEEP_NAME    results go to results/SWEEP_NAME [sweep; quick with the quick preset]
  GPUS          GPU ids to use, e.g. "0 2" [all visible: CUDA_VISIBLE_DEVICES, else nvidia-smi;
                none: run on CPU]
  JOBS_PER_GPU  jobs sharing one GPU [auto: one per 2 cores of the GPU's share and per job,
                as many as the GPU's free memory holds at 2 x the memory a job's preflight
                estimated, then at 1.25 x the largest peak a finished job recorded; one per
                GPU until the first job has estimated, seconds after its start]. A job out of
                GPU memory beside others is re-queued to run alone
  CPU_JOBS      jobs at a time when there is no GPU [auto: one per core, at most one per
                job and per CPU_JOB_MEM_GB of free memory]
                Either way each job gets its share of the cores: OMP_NUM_THREADS (unless
                set) and LAB_JOB_CPUS, from which run.py sizes its loader workers. A resumed
                job keeps the threads it started with (config.json), so it ends with the
                numbers it would have had uninterrupted.
  CPU_JOB_MEM_GB  memory one CPU job needs, in GiB, for CPU_JOBS=auto [2]
  LOG_DIR       one log file per job [logs/SWEEP_NAME]
  STATUS_EVERY  seconds between status lines on a terminal [60]; STATUS_EVERY_LOG: when the
                output goes to a file [600]; 0 = none
  run.sh --slurm: one array task per job (labrun's slurm_task.sh), one GPU each:
  SLURM_PARTITION     partition [empty: the cluster's default]
  SLURM_TIME          time limit per task [24:00:00]; near it a task checkpoints and requeues
  SLURM_MEM, SLURM_CPUS   memory and CPU cores per task [32G, 8]
  SLURM_GRES          GPUs per task [gpu:1], e.g. gpu:a100:1
  SLURM_MAX_PARALLEL  tasks running at once (be fair to the lab) [16]
  SLURM_SIGNAL_SECS   warning before the time limit, to checkpoint [300]
  SLURM_EXTRA         more sbatch options, e.g. "--account=mylab --qos=normal" [empty]
  SLURM_LOG_DIR       one folder per submission: arguments, task logs [logs/slurm]
  SWEEP_JOB_NAME      squeue's name for the array [the project folder's name]
  GPUS_PER_JOB        one job on several GPUs of a node, under torchrun; --batch-size stays
                      the job's global batch [1]
  NODES_PER_JOB       nodes of one job (> 1: srun + c10d rendezvous) [1]
"""

# The defaults of the settings above (PRESET, SWEEP_NAME, LOG_DIR and GPUS depend on others).
DEFAULTS = {
    "PYTHON": "python", "JOBS_PER_GPU": "auto", "CPU_JOBS": "auto", "CPU_JOB_MEM_GB": "2",
    "STATUS_EVERY": "60", "STATUS_EVERY_LOG": "600", "SLURM_PARTITION": "",
    "SLURM_TIME": "24:00:00", "SLURM_MEM": "32G", "SLURM_CPUS": "8", "SLURM_GRES": "gpu:1",
    "SLURM_MAX_PARALLEL": "16", "SLURM_SIGNAL_SECS": "300", "SLURM_EXTRA": "",
    "SLURM_LOG_DIR": "logs/slurm", "SWEEP_JOB_NAME": "", "GPUS_PER_JOB": "1", "NODES_PER_JOB": "1",
}  # fmt: skip
# CUDA MPS would run the slots' kernels side by side; not measured to help yet (no GPU at hand
# when this was written), so it stays off.
MPS = "; CUDA MPS off (not measured to help)"
RUNNABLE = ("pending", "interrupted", "failed")
TASK_SCRIPT = Path(__file__).resolve().with_name("slurm_task.sh")
POSITIVE = re.compile(r"[1-9][0-9]*")
GPU_ID = re.compile(r"[0-9]+|(GPU|MIG)-[A-Za-z0-9/-]+")
ESTIMATE_POLL_S = 0.5  # how often JOBS_PER_GPU=auto looks for the first job's estimate
# A job's preflight estimate in its run.log (preflight.check_memory, runs.size_text's units).
ESTIMATE = re.compile(r"memory: training needs about ([0-9.]+) (GiB|MiB|KiB|bytes)")
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}
# A job that ran out of GPU memory: CUDA's OOM (run.py's line or a traceback), or the preflight's
# refusal of a GPU whose free memory its neighbours held.
OUT_OF_MEMORY = re.compile(r"out of memory|memory on cuda[^\n]* is free", re.I)


class Refused(Exception):
    """Bad settings or a sweep that cannot start: `run.sh: MESSAGE` on stderr, exit 2."""


class BadSetting(Exception):
    """A bad slot setting (GPUS, JOBS_PER_GPU, ...): `error: MESSAGE` on stderr, exit 2."""


def err(message: str) -> None:
    print(f"run.sh: {message}", file=sys.stderr, flush=True)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def read_job_list(stream: BinaryIO) -> tuple[list[str], list[list[str]]]:
    """(QUICK_ARGS, each job's arguments) from run.sh's NUL-separated list: the preset's count
    and arguments, then per job its count and arguments."""
    data = stream.read()
    words = [w.decode("utf-8", "surrogateescape") for w in data.split(b"\0")[:-1]]
    lists: list[list[str]] = []
    i = 0
    try:
        while i < len(words):
            count = int(words[i])
            if count < 0 or i + 1 + count > len(words):
                raise ValueError
            lists.append(words[i + 1 : i + 1 + count])
            i += 1 + count
    except ValueError:
        raise Refused("the job list from run.sh is not 'COUNT\\0ARG\\0...' per job") from None
    if not lists:
        raise Refused("the job list from run.sh has no QUICK_ARGS count")
    return lists[0], lists[1:]


@dataclass
class SweepJob:
    """One job of the sweep: its script and own arguments, then what planning and running say."""

    index: int
    script: str
    own: list[str]
    state: str = ""  # a state of `SCRIPT --plan` (plan.py), or duplicate, queued
    dir: str = ""  # its run directory
    note: str = ""  # detail shown by --dry-run and the summary
    name: str = ""  # basename of its run directory (job-I when it has none)
    result: str = ""  # how it ended here: done, skipped, failed, interrupted, elsewhere, ...
    taken: bool = False  # taken over once from a holder that let go
    alone: bool = False  # out of GPU memory beside other jobs: re-queued to run alone on a GPU

    @classmethod
    def from_line(cls, index: int, args: list[str]) -> SweepJob:
        if args and args[0].endswith(".py"):
            return cls(index, args[0], args[1:])
        return cls(index, "run.py", args)

    @property
    def runnable(self) -> bool:
        return self.state in RUNNABLE


@dataclass
class Settings:
    """The settings (ENVIRONMENT): what the environment or run.sh set, else the defaults."""

    env: dict[str, str]
    preset: str = ""

    def __getattr__(self, name: str) -> str:  # JOBS_PER_GPU, SLURM_TIME, ...
        if name.isupper() and name in DEFAULTS:
            return self.env.get(name) or DEFAULTS[name]
        raise AttributeError(name)

    @property
    def SWEEP_NAME(self) -> str:  # noqa: N802 (the variable's name)
        return self.env.get("SWEEP_NAME") or self.preset or "sweep"

    @property
    def LOG_DIR(self) -> str:  # noqa: N802
        return self.env.get("LOG_DIR") or f"logs/{self.SWEEP_NAME}"

    def check(self) -> None:
        """Refuse bad values before any work."""
        for name in ("JOBS_PER_GPU", "CPU_JOBS"):
            value = getattr(self, name)
            if not (value == "auto" or POSITIVE.fullmatch(value)):
                raise BadSetting(f"{name} must be a positive integer or auto, got '{value}'")
        if not POSITIVE.fullmatch(self.CPU_JOB_MEM_GB):
            raise BadSetting(
                "CPU_JOB_MEM_GB must be a positive integer (GiB one CPU job needs), "
                f"got '{self.CPU_JOB_MEM_GB}'"
            )
        if not (self.STATUS_EVERY.isdecimal() and self.STATUS_EVERY_LOG.isdecimal()):
            raise Refused("STATUS_EVERY and STATUS_EVERY_LOG must be whole seconds (0 = off)")
        name = self.SWEEP_NAME
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name in (".", ".."):
            raise Refused(
                f"SWEEP_NAME must be a folder name (letters, digits, . _ -), got '{name}'"
            )


def _guard() -> Callable[[], None] | None:
    """What a child runs before exec: PR_SET_PDEATHSIG (Linux), so that the kernel sends it
    SIGTERM when the sweep dies, even by SIGKILL, and no job trains on as an orphan (it
    checkpoints and exits 75). None where there is no prctl (macOS): no orphan guard."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def guard() -> None:  # pragma: no cover (runs in the child, between fork and exec)
        prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the sweep died before the guard was set
            os.kill(os.getpid(), signal.SIGTERM)

    return guard


# ---- the machine: cores, memory, GPUs ----------------------------------------------------------


def cpu_cores(cgroup: Path) -> int:
    """The cores this process may use: its CPU affinity (taskset, a Slurm allocation), capped by a
    cgroup v2 CPU quota (a container's --cpus), which nproc does not see."""
    # nproc also obeys OMP_NUM_THREADS and OMP_THREAD_LIMIT: a cluster's OMP_NUM_THREADS=1 made
    # one slot of a 64-core node. Asked without them, it counts the affinity mask alone.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    try:
        cores = int(subprocess.run(["nproc"], env=env, capture_output=True, text=True).stdout)
    except (OSError, ValueError):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota.isdecimal() and POSITIVE.fullmatch(period):
            cores = min(cores, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(cores, 1)


def available_mib(cgroup: Path) -> int | None:
    """MiB new processes can still use: MemAvailable, capped by a cgroup v2 memory limit; None
    when /proc/meminfo is missing (not Linux)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+)", meminfo, re.M)
    if not found:
        return None
    kib = int(found[1])
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = (cgroup / "memory.current").read_text().strip()
        if limit.isdecimal() and used.isdecimal():
            kib = min(kib, (int(limit) - int(used)) // 1024)
    except OSError:
        pass
    return kib // 1024


def visible_gpus(env: dict[str, str]) -> list[str]:
    """The devices jobs may use: CUDA_VISIBLE_DEVICES's entries when it is set (jobs stay inside
    it), else what nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in env:
        visible = []
        for dev in env["CUDA_VISIBLE_DEVICES"].replace(",", " ").split():
            if not GPU_ID.fullmatch(dev):  # CUDA stops at the first invalid entry: -1 hides all
                break
            visible.append(dev)
        return visible
    if not shutil.which("nvidia-smi"):
        return []
    query = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True).stdout
    return out.split()


def choose_gpus(env: dict[str, str]) -> list[str]:
    """The GPUs of the sweep: GPUS, checked against the visible devices (BadSetting otherwise),
    else every visible one."""
    visible = visible_gpus(env)
    if "GPUS" not in env:
        # CUDA_VISIBLE_DEVICES=0 on a machine without a GPU (no nvidia-smi) names none: a CPU
        # sweep, a job per core, not one job at a time on a GPU slot that does not exist
        return visible if shutil.which("nvidia-smi") else []
    listed: list[str] = []
    for dev in env["GPUS"].replace(",", " ").split():
        if not GPU_ID.fullmatch(dev):
            raise BadSetting(
                f"GPUS: '{env['GPUS']}' is not a list of GPU indices or UUIDs, "
                'e.g. GPUS="0 1" or GPUS=0,2 (empty: CPU only)'
            )
        if dev not in visible:
            raise BadSetting(
                f"GPUS: GPU {dev} does not exist (visible: {' '.join(visible) or 'none'})"
            )
        if dev in listed:
            raise BadSetting(f"GPUS: GPU {dev} is listed twice (JOBS_PER_GPU shares a GPU)")
        listed.append(dev)
    return listed


def gpu_free_mib(gpus: list[str]) -> int | None:
    """The least free memory, in MiB, of the sweep's GPUs, from one nvidia-smi query."""
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"]
    out = subprocess.run(query, capture_output=True, text=True).stdout
    least = None
    for line in out.splitlines():
        parts = re.split(r"[,\s]+", line.strip(), maxsplit=2)
        if len(parts) == 3 and parts[2].isdecimal() and (parts[0] in gpus or parts[1] in gpus):
            least = int(parts[2]) if least is None else min(least, int(parts[2]))
    return least


def _json_int(text: str, key: str) -> int | None:
    """The first `"key": N` of a JSON file's text, read without parsing the file (a job may be
    writing it)."""
    found = re.search(rf'"{key}": *([0-9]+)', text)
    return int(found[1]) if found else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def recorded_threads(run_dir: str) -> tuple[int, int] | None:
    """(threads, cpus) that the run recorded when it started (run.py's config.json: torch_threads,
    job_cpus); None for a run that never started."""
    text = _read(Path(run_dir) / "config.json") if run_dir else ""
    threads = _json_int(text, "torch_threads")
    if threads is None:
        return None
    cpus = _json_int(text, "job_cpus")
    return threads, threads if cpus is None else cpus


def job_progress(run_dir: str) -> str:
    """'epoch 3/20' from a job's history.csv (epochs written) and config.json (epochs planned)."""
    rows = max(_read(Path(run_dir) / "history.csv").count("\n") - 1, 0)
    total = _json_int(_read(Path(run_dir) / "config.json"), "epochs")
    return f"epoch {rows}/{'?' if total is None else total}"


# ---- the sweep ---------------------------------------------------------------------------------


@dataclass
class Running:
    job: SweepJob
    slot: int
    proc: subprocess.Popen
    t0: int
    shared: bool = False  # another job ran on its GPU meanwhile


@dataclass
class Sweep:
    """A sweep's jobs, its slots and its queue."""

    settings: Settings
    jobs: list[SweepJob]
    quick: list[str] = field(default_factory=list)  # the preset's arguments
    extra: list[str] = field(default_factory=list)  # run.sh's arguments after `--`
    gpus: list[str] = field(default_factory=list)
    slots: list[str] = field(default_factory=list)  # per slot: its GPU, or "" on the CPU
    busy: list[bool] = field(default_factory=list)
    reason: str = ""  # why the slots are as many as they are
    threads: str = ""  # OMP_NUM_THREADS of a job that starts afresh
    job_cpus: int = 1  # cores of one slot (LAB_JOB_CPUS)
    gpu_width: int = 0  # JOBS_PER_GPU=auto: slots per GPU the cores and jobs allow
    gpu_measure: bool = False  # JOBS_PER_GPU=auto waits for a job's memory estimate
    gpu_open: int = 1 << 30  # slots a GPU may run at once (JOBS_PER_GPU=auto: gpu_fit's)
    gpu_why: str = ""
    stop_signal: int = 0
    running: dict[int, Running] = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)
    took: list[int] = field(default_factory=list)
    queue: list[SweepJob] = field(default_factory=list)
    guard: Callable[[], None] | None = None  # _guard(), made once
    follower_pid: int = 0
    folders: set[str] = field(default_factory=set)  # where jobs write: the follower mirrors them

    @property
    def python(self) -> str:
        return self.settings.PYTHON

    @property
    def cgroup(self) -> Path:
        return Path(self.settings.env.get("SWEEP_CGROUP") or "/sys/fs/cgroup")

    def argv(self, job: SweepJob) -> list[str]:
        """Job's complete arguments. A run.py job gets the sweep's results folder and the preset's
        arguments first, so that its own and those after `--` (last) win: argparse keeps the last
        value of a flag. A job of another script gets its own arguments only."""
        if job.script != "run.py":
            return list(job.own)
        head = ["--results-dir", f"results/{self.settings.SWEEP_NAME}", *self.quick]
        return [*head, *job.own, *self.extra]

    # ---- planning ------------------------------------------------------------------------------

    def plan(self) -> None:
        """Every job's run directory and state: one `SCRIPT --plan` call per script."""
        scripts: dict[str, list[SweepJob]] = {}
        for job in self.jobs:
            scripts.setdefault(job.script, []).append(job)
        for script, mine in scripts.items():
            if not Path(script).is_file():
                raise Refused(f"job {mine[0].index}: {script} not found in {os.getcwd()}")
            data = b"".join(
                b"".join(w.encode("utf-8", "surrogateescape") + b"\0" for w in [str(len(a)), *a])
                for a in map(self.argv, mine)
            )
            out = subprocess.run(
                [self.python, script, "--plan"], input=data, stdout=subprocess.PIPE
            ).stdout
            fields = [f.decode("utf-8", "surrogateescape") for f in out.split(b"\0")[:-1]]
            if len(fields) != 3 * len(mine):
                raise Refused(
                    f"{script} --plan answered {len(fields)} fields for {len(mine)} jobs "
                    f"(is {script} current, built on labrun's jobs.py?)"
                )
            for k, job in enumerate(mine):
                job.state, job.dir, job.note = fields[3 * k : 3 * k + 3]
        seen: dict[str, int] = {}
        for job in self.jobs:  # in job order: of two equal jobs, the first one runs
            if job.dir:  # a waiting job's is the folder it will write in (plan.py)
                self.folders.add(job.dir if job.state == "waiting" else str(Path(job.dir).parent))
            job.name = job.dir.rsplit("/", 1)[-1]
            if job.state == "invalid":
                job.name = f"job-{job.index}"
                job.note = f"{job.script} rejected the arguments: {job.note}"
            elif job.state == "waiting":
                job.name, job.dir = f"job-{job.index}", ""
            elif job.dir in seen:
                job.state, job.note = "duplicate", f"same run as job {seen[job.dir]}"
            else:
                seen[job.dir] = job.index

    def wait_for_stopping(self, wait_s: int) -> None:
        """Jobs whose holder is stopping (a run.py told to stop, e.g. the orphans of a sweep
        killed a moment ago, checkpointing) are free in a few seconds: plan again every second
        until they are, for at most wait_s seconds; any still stopping then runs elsewhere."""
        waited = 0
        while True:
            stopping = sum(job.state == "stopping" for job in self.jobs)
            if not (stopping and waited < wait_s):
                break
            if waited == 0:
                log(f"waiting up to {wait_s}s for {stopping} job(s) still checkpointing")
            time.sleep(1)
            waited += 1
            self.plan()
        for job in self.jobs:
            if job.state == "stopping":
                job.state = "running"

    def print_plan(self) -> None:
        """One line per job with its state, then its command line; then the counts."""
        count: dict[str, int] = {}
        for job in self.jobs:
            note = f"  ({job.note})" if job.note else ""
            print(f"{job.state:<11} {job.name}{note}")
            print(f"            {shlex.join([job.script, *self.argv(job)])}")  # as typed
            count[job.state] = count.get(job.state, 0) + 1
        line = (
            f"{len(self.jobs)} jobs: {count.get('done', 0)} done, {count.get('pending', 0)} "
            f"pending, {count.get('interrupted', 0)} interrupted, {count.get('failed', 0)} failed"
        )
        for state in (
            "running",
            "stopping",
            "queued",
            "waiting",
            "invalid",
            "refused",
            "duplicate",
        ):
            if count.get(state):
                shown = "running elsewhere" if state == "running" else state
                line += f", {count[state]} {shown}"
        print(line, flush=True)

    # ---- slots ---------------------------------------------------------------------------------

    def size_slots(self) -> None:
        """The slots, each job's share of the cores and why. The share follows from all the
        sweep's jobs, never from the jobs left, so a job that a re-run of an interrupted sweep
        starts computes with the threads it would have had in the uninterrupted sweep."""
        cores = cpu_cores(self.cgroup)
        jobs = [job for job in self.jobs if job.state not in ("duplicate", "invalid")]
        if self.gpus:
            self.gpu_slots(cores, len(jobs))
        else:
            self.cpu_slots(cores, len(jobs), sum(job.runnable for job in jobs))

    def cpu_slots(self, cores: int, jobs: int, left: int) -> None:
        """Without a GPU: CPU_JOBS=auto runs one job per core (the demo's sweep on 2 cores: 78 s,
        against 94 s for one job at a time with both cores' threads; the lab template's
        benchmarks/RESULTS.md, "Jobs at a time"), but no more than the sweep has jobs or than the
        cores hold at a thread count the user set. Each job's share of the cores follows from
        that alone: the free memory (CPU_JOB_MEM_GB per job) and the jobs left only take slots
        away, so that the same job computes with the same threads whatever else the machine
        runs."""
        env, setting = self.settings.env, self.settings.CPU_JOBS
        omp = env.get("OMP_NUM_THREADS", "")
        if setting == "auto":
            width, reason = cores, f"{cores} core(s)"
            if jobs < width:
                width, reason = jobs, f"{jobs} job(s)"
            if POSITIVE.fullmatch(omp) and cores // int(omp) < width:
                width, reason = cores // int(omp), f"{cores} core(s) / OMP_NUM_THREADS"
            width, reason = max(width, 1), f"CPU_JOBS=auto: {reason}"
        else:
            width, reason = int(setting), f"CPU_JOBS={setting}"
        # Never more threads than cores: oversubscribed, the same sweep took 3.8x as long.
        self.job_cpus = max(cores // width, 1)
        self.threads = omp or str(self.job_cpus)
        slots = width
        if setting == "auto":
            mib, per_job = available_mib(self.cgroup), int(self.settings.CPU_JOB_MEM_GB) * 1024
            if mib is not None and mib // per_job < slots:
                slots = max(mib // per_job, 1)
                reason += (
                    f"; {mib // 1024} GiB free / CPU_JOB_MEM_GB={self.settings.CPU_JOB_MEM_GB}"
                )
            if 0 < left < slots:
                slots, reason = left, reason + f"; {left} job(s) left"
        self.slots, self.busy, self.reason = [""] * slots, [False] * slots, reason

    def gpu_slots(self, cores: int, jobs: int) -> None:
        """Slots on the GPUs: JOBS_PER_GPU per GPU, or for auto one per 2 of the GPU's cores (a
        job's main process and one loader worker) and per job, as many of those as the GPU's free
        memory holds (gpu_fit). Each slot gets an equal share of the cores."""
        n_gpus, setting = len(self.gpus), self.settings.JOBS_PER_GPU
        if setting == "auto":
            width, why = cores // n_gpus // 2, f"{cores} core(s)"
            per_gpu = -(-jobs // n_gpus)
            if per_gpu < width:
                width, why = per_gpu, f"{jobs} job(s)"
            width = max(width, 1)
            self.gpu_why = f"JOBS_PER_GPU=auto: {why} -> {width} per GPU"
        else:
            width, self.gpu_why = int(setting), f"JOBS_PER_GPU={setting}"
        self.job_cpus = max(cores // (n_gpus * width), 1)
        self.threads = self.settings.env.get("OMP_NUM_THREADS") or str(self.job_cpus)
        self.gpu_width, self.slots, self.busy = width, [], []
        if setting == "auto" and width > 1:
            self.gpu_fit()
        else:
            self.add_gpu_slots(width)
            self.reason = self.gpu_why + MPS

    def add_gpu_slots(self, per_gpu: int) -> None:
        """Slots up to `per_gpu` a GPU, in turns over the GPUs: the queue fills them in order."""
        for _ in range(max(map(self.slots.count, self.gpus)), per_gpu):
            for dev in self.gpus:
                self.slots.append(dev)
                self.busy.append(False)

    def measured_peak_mib(self) -> int | None:
        """The largest peak GPU memory, in MiB, that a finished job of the sweep recorded
        (metrics.json: peak_mem_bytes on a CUDA device)."""
        peak = 0
        for job in self.jobs:
            text = _read(Path(job.dir) / "metrics.json") if job.dir else ""
            if re.search(r'"device": *"cuda', text):
                peak = max(peak, _json_int(text, "peak_mem_bytes") or 0)
        return -(-peak // 2**20) if peak > 0 else None

    def estimated_mib(self) -> int | None:
        """The largest memory estimate, in MiB, that a started job's preflight wrote to its
        run.log before training (preflight.check_memory: `memory: training needs about ...`)."""
        found = [
            float(n) * UNITS[unit]
            for job in self.jobs
            if job.dir and job.state != "duplicate"
            for n, unit in ESTIMATE.findall(_read(Path(job.dir) / "run.log"))
        ]
        return -(-int(max(found)) // 2**20) if found else None

    def gpu_fit(self) -> None:
        """JOBS_PER_GPU=auto: open as many of the gpu_width slots per GPU as 90 % of the GPU's
        free memory holds, besides the jobs running there, per job: 1.25 x the largest peak a
        finished job of the sweep measured or, before one has, 2 x the largest estimate its
        jobs' preflight made (a lower bound: allocator slack, workspaces and compilation are not
        in it), plus the CUDA context (SWEEP_CUDA_CONTEXT_MIB, an estimate). Until a job has
        estimated, one per GPU: the first job's estimate comes before its training."""
        peak, estimate = self.measured_peak_mib(), self.estimated_mib()
        self.gpu_measure = peak is None and estimate is None
        if self.gpu_measure:
            self.reason = f"{self.gpu_why}, 1 until a job has estimated its memory{MPS}"
            self.gpu_open = 1
            self.add_gpu_slots(1)
            return
        free = gpu_free_mib(self.gpus)
        if free is None:
            self.reason = f"{self.gpu_why}, 1: free GPU memory unknown (no nvidia-smi){MPS}"
            self.gpu_open = 1
            self.add_gpu_slots(1)
            return
        context = int(self.settings.env.get("SWEEP_CUDA_CONTEXT_MIB") or 1024)
        if peak is not None:
            need, basis = peak * 5 // 4, f"1.25 x a measured peak of {peak} MiB"
        else:
            need, basis = estimate * 2, f"2 x an estimate of {estimate} MiB"
        devices = [self.slots[e.slot] for e in self.running.values()]
        running = max((devices.count(dev) for dev in self.gpus), default=0)
        fit = min(max(running + free * 9 // 10 // (need + context), 1), self.gpu_width)
        beside = f" besides {running} running" if running else ""
        self.reason = (
            f"{self.gpu_why}, {fit} in 90 % of {free} MiB free{beside} at {basis} + "
            f"{context} MiB context per job{MPS}"
        )
        self.gpu_open = fit
        self.add_gpu_slots(fit)

    def refit(self) -> None:
        """JOBS_PER_GPU=auto: fit the slots again (an estimate or a peak arrived), and say so
        when they change."""
        before = self.describe_slots()
        self.gpu_fit()
        if self.describe_slots() != before:
            log(f"slots now: {self.describe_slots()}")

    def may_start(self, slot: int) -> bool:
        """Whether `slot` may take the queue's next job: one of the slots its GPU keeps open
        (gpu_open), and never beside a job that runs alone (re-queued after it ran out of GPU
        memory beside others), which itself waits for its GPU to empty."""
        dev = self.slots[slot]
        if not dev:
            return True
        if self.slots[:slot].count(dev) >= self.gpu_open:
            return False
        beside = [e.job for e in self.running.values() if self.slots[e.slot] == dev]
        if self.queue and self.queue[0].alone:
            return not beside
        return not any(job.alone for job in beside)

    def retry_alone(self, entry: Running) -> None:
        """A job that failed out of GPU memory (its log's last lines say so: CUDA's OOM, or the
        preflight's refusal) while another job shared its GPU goes back to the queue's head, to
        run alone: the memory was its neighbours' as much as its own."""
        job = entry.job
        if not (entry.shared and job.result == "failed" and not job.alone):
            return
        tail = _read(Path(self.settings.LOG_DIR) / f"{job.name}.log")[-4000:]
        if not OUT_OF_MEMORY.search(tail.rpartition("\n=== ")[2]):  # this attempt's lines
            return
        job.result, job.alone = "", True
        self.queue.insert(0, job)
        log(f"requeued {job.name}  (out of GPU memory beside other jobs: it runs alone next)")

    def describe_slots(self) -> str:
        """'2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s))' or '4 slot(s) on GPU(s)
        0 0 1 1, 4 thread(s) each (JOBS_PER_GPU=2; ...)'."""
        if not self.slots or not self.slots[0]:
            return f"{len(self.slots)} CPU slot(s), {self.threads} thread(s) each ({self.reason})"
        slots = [d for k, d in enumerate(self.slots) if self.slots[:k].count(d) < self.gpu_open]
        return (
            f"{len(slots)} slot(s) on GPU(s) {' '.join(slots)}, {self.threads} "
            f"thread(s) each ({self.reason})"
        )

    # ---- running -------------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame=None) -> None:
        """The first signal asks every running job to checkpoint and stop (SIGTERM to its main
        process); every later one kills their process groups outright. Either way the queue goes
        on to reap them, mark them and print the summary."""
        name = signal.Signals(signum).name
        if self.stop_signal:
            err(f"{name} again: killing all jobs")
            for pid in self.running:
                _kill(-pid, signal.SIGKILL)
            # and the follower, which may wait on a silent tracking server: the sweep ends now
            # (what it did not mirror, `tracking sync` or the next sweep does)
            if self.follower_pid:
                _kill(self.follower_pid, signal.SIGKILL)
            return
        self.stop_signal = signum
        err(
            f"got {name}: stopping {len(self.running)} running job(s) "
            "(they checkpoint; again to kill)"
        )
        for pid in self.running:
            _kill(pid, signal.SIGTERM)

    def launch(self, job: SweepJob, slot: int, follower_fd: int | None) -> None:
        """Start job in the background, in a session (process group) of its own: stopping it
        reaches its children too, and Ctrl-C in the terminal reaches the sweep only, which then
        stops every job the same way."""
        dev, how = self.slots[slot], ""
        argv = self.argv(job)
        # A job that started before (interrupted, failed) keeps its threads: its numbers depend
        # on them.
        recorded = recorded_threads(job.dir)
        if recorded:
            threads, cpus = map(str, recorded)
            how = ", as when it started"
        else:
            threads, cpus = self.threads, str(self.job_cpus)
        log_file = Path(self.settings.LOG_DIR) / f"{job.name}.log"
        env = self.slot_env(slot, threads, cpus)
        header = (
            f"=== {time.strftime('%F %T')}  CUDA_VISIBLE_DEVICES={dev} OMP_NUM_THREADS="
            f"{threads} LAB_JOB_CPUS={cpus}  {self.python} {job.script} {' '.join(argv)}"
        )
        try:  # never through a link planted at the log's name
            out = open_append(log_file)
        except OSError as exc:
            job.result = "failed"
            log(f"FAILED   {job.name}  (not started: its log: {exc})")
            return
        with out:
            out.write(f"{header}\n")
            out.flush()
            proc = subprocess.Popen(
                [self.python, job.script, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self.guard,
                pass_fds=() if follower_fd is None else (follower_fd,),
            )
        self.running[proc.pid] = Running(job, slot, proc, int(time.time()))
        beside = [e for e in self.running.values() if dev and self.slots[e.slot] == dev]
        for entry in beside if len(beside) > 1 else ():  # retry_alone's "shared"
            entry.shared = True
        self.groups.append(proc.pid)
        self.busy[slot] = True
        where = f"GPU {dev}" if dev else "CPU"
        log(f"start    {job.name}  ({where}, slot {slot}, {threads} thread(s){how})")
        if self.stop_signal:  # a signal that arrived while this job was being started missed it
            _kill(proc.pid, signal.SIGTERM)

    def slot_env(self, slot: int, threads: str | None = None, cpus: str | None = None) -> dict:
        """The environment of a job in `slot` (threads, cpus: a resumed job's recorded ones)."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.slots[slot])
        env["OMP_NUM_THREADS"] = threads or self.threads
        env["LAB_JOB_CPUS"] = cpus or str(self.job_cpus)
        return env

    def finish(self, pid: int, rc: int) -> None:
        """Record how job `pid` ended and free its slot."""
        entry = self.running.pop(pid)
        job, took = entry.job, int(time.time()) - entry.t0
        self.busy[entry.slot] = False
        _kill(-pid, signal.SIGTERM)  # children the job left behind (loader workers) go with it
        run_dir = Path(job.dir)
        if rc == 0 and job.dir and (run_dir / "metrics.json").is_file():
            if finished_elsewhere(run_dir, pid):
                job.result = "skipped"
                log(f"skipped  {job.name}  (finished meanwhile by another process)")
            else:
                job.result = "done"
                self.took.append(took)
                log(f"done     {job.name}  ({took}s)")
        elif rc == EXIT_BUSY:
            job.result = "elsewhere"
            log(f"skipped  {job.name}  (running elsewhere: another process holds it; see its log)")
        elif rc == EXIT_INTERRUPTED or self.stop_signal:
            # Stopped by us: exit 75, or killed by the signal before its handlers were up.
            job.result = "interrupted"
            mark_interrupted(job.dir)
            log(f"stopped  {job.name}  (exit {rc}; re-run run.sh to resume)")
        else:
            job.result = "failed"
            said = "0 but no metrics.json" if rc == 0 else rc
            log(
                f"FAILED   {job.name}  (exit {said}, {took}s)  "
                f"log: {self.settings.LOG_DIR}/{job.name}.log"
            )

    def print_status(self) -> None:
        """One line: jobs done / running / pending, each running job's epoch, an ETA from the
        jobs that finished so far in this sweep (mean duration x jobs left / slots)."""
        left = len(self.queue)
        done = sum(job.result in ("done", "skipped") for job in self.jobs)
        eta = "after the first job finishes"
        if self.took:
            t = sum(self.took) * (left + len(self.running)) // len(self.took) // len(self.slots)
            eta = f"~{t // 3600}h{t % 3600 // 60}m"
        log(f"sweep: {done} done, {len(self.running)} running, {left} pending; ETA {eta}")
        for entry in self.running.values():
            log(f"  running  {entry.job.name} {job_progress(entry.job.dir)}")

    def replan(self) -> None:
        """Plan again (after a job ended, or before the queue ends) and queue the jobs that can
        run now: those waiting for inputs that have finished meanwhile, and, once each, those
        running elsewhere whose holder has let go of the claim since (it stopped: exit 75, or
        died); one finished elsewhere meanwhile is skipped."""
        self.plan()
        for job in self.jobs:
            if job.result == "waiting" and job.runnable:
                job.result = ""
                self.queue.append(job)
                log(f"ready    {job.name}  (its inputs have finished)")
            elif job.result == "elsewhere":
                if job.state == "done":
                    job.result = "skipped"
                    log(f"skipped  {job.name}  (finished meanwhile by another process)")
                elif job.runnable and not job.taken:
                    job.result, job.taken = "", True
                    self.queue.append(job)
                    log(f"taking   {job.name}  (its holder let go: {job.state})")

    def others_pending(self) -> bool:
        """A job waits for inputs or runs elsewhere: planning again may free it."""
        return any(job.result in ("waiting", "elsewhere") for job in self.jobs)

    def run_queue(self) -> bool:
        """Run every pending job through the dynamic queue (and each waiting job once its inputs
        are done); print the summary. True if every job is done."""
        settings = self.settings
        for job in self.jobs:
            if job.runnable:
                self.queue.append(job)
            else:
                job.result = {
                    "done": "skipped",
                    "duplicate": "duplicate",
                    "running": "elsewhere",
                    "stopping": "elsewhere",
                    "waiting": "waiting",
                }.get(job.state, "failed")
        # The jobs that share this node's memory: run.py's --data-mode auto divides its budget
        # by it (JOBS_PER_GPU=auto may open more slots once a job has measured its memory).
        slots = len(self.gpus) * self.gpu_width if self.gpus else len(self.slots)
        os.environ["LAB_JOBS_PER_NODE"] = os.environ.get("LAB_JOBS_PER_NODE") or str(slots)
        try:  # the jobs' logs go into a folder of ours only
            own_dir(Path(settings.LOG_DIR))
        except OSError as exc:
            raise Refused(f"LOG_DIR: {exc}") from None
        self.guard = _guard()
        follower, follower_fd = self.start_follower()
        self.follower_pid = follower.pid  # a second signal kills it too (a silent server)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        # Every signal (a job ended: SIGCHLD; a stop: INT, TERM, HUP, USR1) writes a byte to wake_w,
        # which wakes the select below: no polling, no race with a child that ends meanwhile.
        old_wakeup_fd = signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # USR1 too: Slurm's --signal and run.py (labrun.stopping) take it for "stop".
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(signum, self.on_signal)
        # Status lines: every STATUS_EVERY s on a terminal, every STATUS_EVERY_LOG s into a file.
        every = int(settings.STATUS_EVERY if sys.stdout.isatty() else settings.STATUS_EVERY_LOG)
        next_status = None
        if self.queue:
            waiting = sum(job.result == "waiting" for job in self.jobs)  # inputs not done yet
            later = f", {waiting} waiting for their inputs" * bool(waiting)
            rest = len(self.jobs) - len(self.queue) - waiting
            log(
                f"{len(self.queue)} job(s) to run{later}, {rest} done or skipped; "
                f"{self.describe_slots()}; logs in {settings.LOG_DIR}/"
            )
            next_status = time.monotonic() + every if every else None
        planned = False
        while True:
            if not self.stop_signal:
                for slot in range(len(self.slots)):
                    # Jobs finished meanwhile by another process (planned long ago) need no
                    # interpreter.
                    while self.queue and _finished(self.queue[0]):
                        job = self.queue.pop(0)
                        job.result = "skipped"
                        log(f"skipped  {job.name}  (finished meanwhile by another process)")
                    if not self.busy[slot] and self.queue and self.may_start(slot):
                        self.launch(self.queue.pop(0), slot, follower_fd)
                        planned = False
            if not self.running:
                # Nothing runs here any more: one last look at the jobs held elsewhere.
                if not self.stop_signal and not planned and self.others_pending():
                    self.replan()
                    planned = True
                    if self.queue:
                        continue
                break
            timeout = None if next_status is None else max(next_status - time.monotonic(), 0)
            if self.gpu_measure:  # JOBS_PER_GPU=auto: look for the first job's estimate
                timeout = min(timeout or ESTIMATE_POLL_S, ESTIMATE_POLL_S)
            select.select([wake_r], [], [], timeout)
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            if next_status is not None and time.monotonic() >= next_status:
                if self.stop_signal:
                    next_status = None
                else:
                    self.print_status()
                    next_status = time.monotonic() + every
            if self.gpu_measure and not self.stop_signal:
                self.refit()
            for pid in list(self.running):
                entry = self.running[pid]
                rc = entry.proc.poll()
                if rc is None:
                    continue
                self.finish(pid, 128 - rc if rc < 0 else rc)  # killed by signal N: 128+N
                if not self.stop_signal:
                    self.retry_alone(entry)
                    if self.gpus and self.settings.JOBS_PER_GPU == "auto" and self.gpu_width > 1:
                        self.refit()  # a measured peak refines the fit
                    if self.others_pending():
                        self.replan()
                        planned = True
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(old_wakeup_fd)
        os.close(wake_r)
        os.close(wake_w)
        self.reap_groups()
        self.stop_follower(follower, follower_fd)
        return self.summarize()

    def reap_groups(self) -> None:
        """After the queue: give leftover processes of every job's group 10 s, then kill them."""
        for _ in range(100):
            if not any(_alive(-pg) for pg in self.groups):
                return
            time.sleep(0.1)
        for pg in self.groups:
            _kill(-pg, signal.SIGKILL)

    # ---- the MLflow follower (labrun/tracking.py's `follow`) ------------------------------------
    # Jobs do not talk to MLflow (LAB_TRACKING_FOLLOWER=1): one follower per sweep mirrors each run
    # directory into MLflow once its job has ended, and mirrors what is left when its stdin closes
    # (stop_follower). Killed with the sweep, it loses nothing: the next sweep's follower, or
    # `python -m labrun.tracking sync`, mirrors the rest. Its stdin is a pipe whose write end jobs
    # inherit too: it closes once every job is gone.

    def start_follower(self) -> tuple[subprocess.Popen, int]:
        os.environ["LAB_TRACKING_FOLLOWER"] = "1"
        read_end, write_end = os.pipe()
        name = self.settings.SWEEP_NAME
        roots = sorted({str(Path(f"results/{name}").resolve()), *self.folders})  # analyze.py's too
        with open_append(Path(self.settings.LOG_DIR) / "mlflow-follower.out") as out:
            follower = subprocess.Popen(
                [self.python, "-m", "labrun.tracking", "follow", *roots],
                stdin=read_end,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=self.guard,
            )
        os.close(read_end)
        return follower, write_end

    def stop_follower(self, follower: subprocess.Popen, write_end: int) -> None:
        os.close(write_end)
        if follower.wait() != 0:
            name = self.settings.SWEEP_NAME
            err(
                f"MLflow follower failed ({self.settings.LOG_DIR}/mlflow-follower.out); "
                f"python -m labrun.tracking sync results/{name} mirrors what it missed"
            )

    def summarize(self) -> bool:
        """Print the counts and the failures; True iff every job is done."""
        if any(job.result == "elsewhere" for job in self.jobs):
            # Jobs another process was running may have finished meanwhile: ask once more.
            self.plan()
            for job in self.jobs:
                if job.result == "elsewhere":
                    if job.state == "done":
                        job.result = "skipped"
                    elif job.state == "interrupted":  # its holder stopped: a re-run resumes it
                        job.result = "interrupted"
                    elif job.state in ("pending", "failed"):  # not started here
                        job.result = ""
        n: dict[str, int] = {}
        failures = []
        for job in self.jobs:
            kind = job.result if job.result in (
                "done", "skipped", "duplicate", "interrupted", "elsewhere", "waiting", "failed"
            ) else "left"  # fmt: skip
            n[kind] = n.get(kind, 0) + 1
            if kind != "failed":
                continue
            if job.state in ("invalid", "refused"):
                argv = " ".join([job.script, *self.argv(job)])
                failures.append(f"job {job.index} ({argv}): {job.note}")
            else:
                failures.append(f"{job.name}  log: {self.settings.LOG_DIR}/{job.name}.log")
        get = lambda kind: n.get(kind, 0)  # noqa: E731
        line = (
            f"sweep summary: {get('done') + get('skipped')} done ({get('done')} ran now, "
            f"{get('skipped')} skipped: already done), {get('failed')} failed, "
            f"{get('interrupted')} interrupted, {get('left')} not started"
        )
        if get("elsewhere"):
            line += f", {get('elsewhere')} running elsewhere"
        if get("waiting"):
            line += f", {get('waiting')} waiting for unfinished inputs"
        if get("duplicate"):
            line += f" ({get('duplicate')} duplicate job(s) ignored)"
        print("---")
        print(line)
        for failure in failures:
            print(f"  failed: {failure}")
        for job in self.jobs:
            if job.result == "waiting":
                print(f"  waiting: job {job.index}: {job.note}")
        unfinished = get("interrupted") + get("left") + get("elsewhere") + get("waiting")
        if unfinished:
            print(
                "re-run run.sh to finish the rest (interrupted jobs resume from their checkpoints)."
            )
        sys.stdout.flush()
        return get("failed") + unfinished == 0

    # ---- Slurm ---------------------------------------------------------------------------------

    def mark_queued_in_slurm(self) -> None:
        """Mark jobs still queued or running in an earlier array of this project as "queued", so
        that submitting again does not run them twice. Earlier submissions are SLURM_LOG_DIR/*/,
        each with job_id (the array) and tasks.tsv (task id TAB run directory)."""
        if not shutil.which("squeue"):
            return
        submit_dir_of = {}
        for f in Path(self.settings.SLURM_LOG_DIR).glob("*/job_id"):
            lines = _read(f).split()
            if lines:
                submit_dir_of[lines[0]] = f.parent
        if not submit_dir_of:
            return
        user = pwd.getpwuid(os.getuid()).pw_name
        # One line per array task still in the queue (-r: pending tasks one by one).
        squeue = ["squeue", "-h", "-r", "-u", user, "-o", "%F %K %T"]
        out = subprocess.run(squeue, capture_output=True, text=True).stdout
        queued = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 3 or parts[0] not in submit_dir_of or not parts[1].isdecimal():
                continue
            array, task, state = parts[:3]
            for row in _read(submit_dir_of[array] / "tasks.tsv").splitlines():
                number, _, run_dir = row.partition("\t")
                if number == task and run_dir:
                    queued[run_dir] = f"{array}_{task} {state}"
                    break
        for job in self.jobs:
            if job.runnable and job.dir in queued:
                job.state = "queued"
                job.note = f"Slurm task {queued[job.dir]}, from an earlier run.sh --slurm"

    def init_tracking(self, job: SweepJob) -> None:
        """Create the MLflow database and experiment once, before a Slurm array's tasks start in
        parallel: they log to MLflow live. (A local sweep's jobs do not touch MLflow: its follower
        creates the database, under tracking.py's schema lock, while the first jobs train.)"""
        cmd = [self.python, job.script, *self.argv(job), "--init-tracking"]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            raise Refused(
                f"could not create the MLflow database ({job.script} --init-tracking failed)"
            )

    def submit_slurm(self, dry_run: bool) -> None:
        """Submit the pending jobs as one Slurm job array (slurm_task.sh runs one task)."""
        s = self.settings
        pending = [job for job in self.jobs if job.runnable]
        for job in self.jobs:
            if job.state == "invalid":
                err(f"not submitted, {job.note}")
            if job.state == "refused":
                err(f"not submitted, {job.name}: {job.note}")
        if not pending:
            print(f"nothing to submit: all {len(self.jobs)} jobs are done, queued or running.")
            return
        # One job on several GPUs (torchrun): GPUS_PER_JOB replaces SLURM_GRES's count, per node.
        job_gpus, job_nodes, gres = s.GPUS_PER_JOB, s.NODES_PER_JOB, s.SLURM_GRES
        if not (POSITIVE.fullmatch(job_gpus) and POSITIVE.fullmatch(job_nodes)):
            raise Refused(
                f"GPUS_PER_JOB={job_gpus}, NODES_PER_JOB={job_nodes}: expected whole numbers >= 1"
            )
        if int(job_gpus) > 1:
            gres = re.sub(r":[0-9][^:]*$", "", gres) + f":{job_gpus}"
        cwd = os.getcwd()
        submit = Path(cwd) / s.SLURM_LOG_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        # --requeue: preempted tasks go back to the queue. B:USR1@N: N s before the time limit,
        # the task script (only it: B:) gets USR1; it tells run.py, which checkpoints, and
        # requeues.
        cmd = [
            "sbatch", "--parsable", f"--job-name={s.SWEEP_JOB_NAME or Path(cwd).name}",
            f"--array=0-{len(pending) - 1}%{s.SLURM_MAX_PARALLEL}", f"--gres={gres}",
            f"--cpus-per-task={s.SLURM_CPUS}", f"--mem={s.SLURM_MEM}", f"--time={s.SLURM_TIME}",
            "--requeue", f"--signal=B:USR1@{s.SLURM_SIGNAL_SECS}", "--open-mode=append",
            f"--output={submit}/%A_%a.out", f"--chdir={cwd}",
        ]  # fmt: skip
        if s.SLURM_PARTITION:
            cmd.append(f"--partition={s.SLURM_PARTITION}")
        # Several GPUs: one torchrun per node (slurm_task.sh), each starting one process per GPU.
        multi = int(job_gpus) > 1 or int(job_nodes) > 1
        if multi:
            cmd += [f"--nodes={job_nodes}", "--ntasks-per-node=1"]
        cmd += [*s.SLURM_EXTRA.split(), str(TASK_SCRIPT), str(submit)]
        if dry_run:
            print(f"would submit {len(pending)} job(s): {' '.join(cmd)}")
            if multi:
                launch = subprocess.run(
                    ["bash", str(TASK_SCRIPT), "--launch", job_gpus, job_nodes],
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                print(f"  each job: {launch} run.py ARGS")
            return
        if not shutil.which("sbatch"):
            raise Refused("--slurm: sbatch not found (run this on a Slurm login node)")
        self.init_tracking(pending[0])
        (submit / "args").mkdir(parents=True, exist_ok=True)
        # The interpreter the tasks use: PYTHON as resolved here, so the tasks get the same venv.
        python = shutil.which(self.python)
        if python is None:
            raise Refused(f"PYTHON={self.python} not found")
        (submit / "python").write_text(f"{python}\n")
        if multi:
            (submit / "torchrun").write_text(f"{job_gpus} {job_nodes}\n")
        tasks = []
        for n, job in enumerate(pending):
            # One file per array task: its arguments, NUL-separated (any character is safe), and
            # its script when it is not run.py.
            words = [w.encode("utf-8", "surrogateescape") + b"\0" for w in self.argv(job)]
            (submit / "args" / str(n)).write_bytes(b"".join(words))
            if job.script != "run.py":
                (submit / "script").mkdir(exist_ok=True)
                (submit / "script" / str(n)).write_text(f"{job.script}\n")
            tasks.append(f"{n}\t{job.dir}\n")
        (submit / "tasks.tsv").write_text("".join(tasks))
        sbatch = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if sbatch.returncode != 0:
            raise Refused("sbatch failed")
        job_id = sbatch.stdout.strip().split(";")[0]
        (submit / "job_id").write_text(f"{job_id}\n")
        print(
            f"submitted {len(pending)} job(s) as Slurm array {job_id} "
            f"(at most {s.SLURM_MAX_PARALLEL} at a time)"
        )
        print(f"  watch:  squeue -j {job_id}        cancel: scancel {job_id}")
        print(f"  logs:   {submit}/{job_id}_<task>.out   (task -> run: {submit}/tasks.tsv)")


def _finished(job: SweepJob) -> bool:
    return bool(job.dir) and (Path(job.dir) / "metrics.json").is_file()


def _kill(pid: int, signum: int) -> None:
    """Signal a process (pid > 0) or a process group (-pgid); one already gone is no error."""
    if abs(pid) <= 1:  # 0, 1 and -1 mean this group, init, every process: never a job's
        raise ValueError(f"refusing to signal pid {pid}")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mark_interrupted(run_dir: str) -> None:
    """A job killed before it could write its own status leaves "running": say what happened.
    Only in a directory of ours, by a temporary file of a fresh name moved into place: a link
    planted in a run directory is never written through."""
    if not run_dir or read_status(Path(run_dir)) != "running":
        return
    try:
        write_status(own_dir(Path(run_dir)), "interrupted")
    except OSError as exc:
        err(f"could not mark {run_dir} interrupted: {exc}")


def finished_elsewhere(run_dir: Path, pid: int) -> bool:
    """True if job `pid` found its run already finished by another process (another sweep, a Slurm
    task) instead of training it. A job writes its pid into .lock when it claims the run; if that
    is still its claim and metrics.json is older, it only found the run done."""
    lock = run_dir / ".lock"
    lines = _read(lock).splitlines()
    if not lines or not lines[0].startswith(f"pid={pid} "):
        return False
    try:
        return (run_dir / "metrics.json").stat().st_mtime_ns <= lock.stat().st_mtime_ns
    except OSError:
        return False


def usage(script: str) -> str:
    """run.sh's header comment (its usage text: line 2 to the first blank line), then the
    settings."""
    lines = _read(Path(script)).splitlines()[1:]
    header = []
    for line in lines:
        if not line:
            break
        header.append(re.sub(r"^# ?", "", line))
    return "\n".join(header) + "\n" + ENVIRONMENT


def main(argv: list[str] | None = None, stdin: BinaryIO | None = None) -> int:
    """`python -m labrun.sweep RUN_SH [run.sh's arguments]`, the job list on stdin."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("error: usage: python -m labrun.sweep RUN_SH [ARGS] < JOB_LIST", file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    # Until the queue installs its handlers, a signal ends the sweep as it would end a shell.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(sys.stdout, "reconfigure"):  # each line out at once, in order with the jobs'
        sys.stdout.reconfigure(line_buffering=True)
    try:
        return _main(script, args, stdin or sys.stdin.buffer)
    except Refused as exc:
        err(str(exc))
        return 2
    except BadSetting as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ForeignFile as exc:  # a link or another user's file where the sweep writes its own
        err(str(exc))
        return 2


def _main(script: str, args: list[str], stdin: BinaryIO) -> int:
    env = dict(os.environ)
    settings = Settings(env, env.get("PRESET", ""))
    dry_run = slurm = False
    extra: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--dry-run":
            dry_run = True
        elif arg == "--slurm":
            slurm = True
        elif arg == "--quick":
            settings.preset = "quick"
        elif arg in ("-h", "--help"):
            print(usage(script), end="")
            return 0
        elif arg == "--":
            extra = args[i + 1 :]
            break
        else:
            print(usage(script), end="", file=sys.stderr)
            raise Refused(f"unknown option: {arg}")
    quick, lines = read_job_list(stdin)
    if settings.preset not in ("", "quick"):
        raise Refused(f"PRESET must be quick or empty, got '{settings.preset}'")
    if settings.preset == "quick":
        print(
            f"run.sh: quick preset: {' '.join(quick)} first on every job, "
            f"results in results/{settings.SWEEP_NAME}/"
        )
    else:
        quick = []
    settings.check()
    if not shutil.which(settings.PYTHON):
        raise Refused(
            f"PYTHON={settings.PYTHON} not found (activate the project's venv, or set PYTHON)"
        )
    if not Path("run.py").is_file():
        raise Refused(f"run.py not found in {os.getcwd()}")
    jobs = [SweepJob.from_line(i, line) for i, line in enumerate(lines)]
    sweep = Sweep(settings, jobs, quick=quick, extra=extra)
    # A job of another script may name a run by run.py's arguments (`job analyze.py "--seed 0"
    # ...`): config.run_of finds the directory this sweep gives that line, from this variable.
    both = sweep.argv(SweepJob(0, "run.py", []))  # the preset's arguments, then those after --
    os.environ["LAB_SWEEP_RUN_ARGS"] = json.dumps([both[: len(both) - len(extra)], extra])
    if not slurm:
        sweep.gpus = choose_gpus(env)  # bad GPUS: refused before any work
    if not jobs:
        raise Refused("the sweep has no jobs")
    sweep.plan()
    if not dry_run:
        sweep.wait_for_stopping(int(env.get("SWEEP_STOPPING_WAIT_S") or 30))
    if slurm:
        sweep.mark_queued_in_slurm()
        if dry_run:
            sweep.print_plan()
        sweep.submit_slurm(dry_run)
        return 0
    sweep.size_slots()
    if dry_run:
        sweep.print_plan()
        print(f"would run on {sweep.describe_slots()}")
        return 0
    ok = sweep.run_queue()
    if sweep.stop_signal:
        return 128 + sweep.stop_signal
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
