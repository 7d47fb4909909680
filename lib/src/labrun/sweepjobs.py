"""A sweep's settings and jobs: run.sh's settings (ENVIRONMENT, read by Settings) and job list
(read_job_list), each job's run directory and state from `SCRIPT --plan` (Sweep.plan), what its
files say while it runs, and how the jobs ended (Sweep.summarize). Imports no torch and no
mlflow: `run.sh --help` is instant.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

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
RUNNABLE = ("pending", "interrupted", "failed")
POSITIVE = re.compile(r"[1-9][0-9]*")


class Refused(Exception):
    """Bad settings or a sweep that cannot start: `run.sh: MESSAGE` on stderr, exit 2."""


class BadSetting(Exception):
    """A bad slot setting (GPUS, JOBS_PER_GPU, ...): `error: MESSAGE` on stderr, exit 2."""


def err(message: str) -> None:
    print(f"run.sh: {message}", file=sys.stderr, flush=True)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def text_or_empty(path: Path) -> str:
    """The text of `path`; "" when it is missing or unreadable (not there yet, half-written)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def json_int(text: str, key: str) -> int | None:
    """The first `"key": N` of a JSON file's text, read without parsing the file (a job may be
    writing it)."""
    found = re.search(rf'"{key}": *([0-9]+)', text)
    return int(found[1]) if found else None


def read_lists(stream: BinaryIO) -> list[list[str]]:
    """`COUNT\\0ARG\\0...` per list, as run.sh and `SCRIPT --plan` read them; ValueError else."""
    words = [w.decode("utf-8", "surrogateescape") for w in stream.read().split(b"\0")[:-1]]
    lists: list[list[str]] = []
    i = 0
    while i < len(words):
        count = int(words[i])
        if count < 0 or i + 1 + count > len(words):
            raise ValueError(f"list {len(lists)} is shorter than its count")
        lists.append(words[i + 1 : i + 1 + count])
        i += 1 + count
    return lists


def nul_join(words: list[str]) -> bytes:
    """Each word NUL-terminated: any character is safe in it."""
    return b"".join(w.encode("utf-8", "surrogateescape") + b"\0" for w in words)


def read_job_list(stream: BinaryIO) -> tuple[list[str], list[list[str]]]:
    """(QUICK_ARGS, each job's arguments) from run.sh's list: the preset's, then each job's."""
    try:
        lists = read_lists(stream)
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


@dataclass
class Sweep:
    """A sweep's jobs: their arguments, their plan (planned again as jobs end) and how they
    ended."""

    settings: Settings
    jobs: list[SweepJob]
    quick: list[str] = field(default_factory=list)  # the preset's arguments
    extra: list[str] = field(default_factory=list)  # run.sh's arguments after `--`
    folders: set[str] = field(default_factory=set)  # where jobs write: the follower mirrors them

    @property
    def python(self) -> str:
        return self.settings.PYTHON

    def argv(self, job: SweepJob) -> list[str]:
        """Job's complete arguments: a run.py job's own come after the sweep's results folder and
        the preset's, and before those after `--`: argparse keeps a flag's last value."""
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
            data = b"".join(nul_join([str(len(a)), *a]) for a in map(self.argv, mine))
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
        """Jobs whose holder is stopping (checkpointing, e.g. the orphans of a sweep killed a
        moment ago) are free in a few seconds: plan again every second, for at most wait_s."""
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
        count = Counter(job.state for job in self.jobs)
        for job in self.jobs:
            note = f"  ({job.note})" if job.note else ""
            print(f"{job.state:<11} {job.name}{note}")
            print(f"            {shlex.join([job.script, *self.argv(job)])}")  # as typed
        line = (
            f"{len(self.jobs)} jobs: {count['done']} done, {count['pending']} pending, "
            f"{count['interrupted']} interrupted, {count['failed']} failed"
        )
        others = ("running", "stopping", "queued", "waiting", "invalid", "refused", "duplicate")
        for state in others:
            if count[state]:
                shown = "running elsewhere" if state == "running" else state
                line += f", {count[state]} {shown}"
        print(line, flush=True)

    def replan(self) -> list[SweepJob]:
        """Plan again; the jobs that can run now: those whose inputs have finished meanwhile and,
        once each, those whose holder elsewhere has let go of the claim since."""
        self.plan()
        ready = []
        for job in self.jobs:
            if job.result == "waiting" and job.runnable:
                job.result = ""
                ready.append(job)
                log(f"ready    {job.name}  (its inputs have finished)")
            elif job.result == "elsewhere":
                if job.state == "done":
                    job.result = "skipped"
                    log(f"skipped  {job.name}  (finished meanwhile by another process)")
                elif job.runnable and not job.taken:
                    job.result, job.taken = "", True
                    ready.append(job)
                    log(f"taking   {job.name}  (its holder let go: {job.state})")
        return ready

    def others_pending(self) -> bool:
        """A job waits for inputs or runs elsewhere: planning again may free it."""
        return any(job.result in ("waiting", "elsewhere") for job in self.jobs)

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
        n: Counter[str] = Counter()
        failures = []
        for job in self.jobs:
            kind = job.result if job.result in (
                "done", "skipped", "duplicate", "interrupted", "elsewhere", "waiting", "failed"
            ) else "left"  # fmt: skip
            n[kind] += 1
            if kind != "failed":
                continue
            if job.state in ("invalid", "refused"):
                argv = " ".join([job.script, *self.argv(job)])
                failures.append(f"job {job.index} ({argv}): {job.note}")
            else:
                failures.append(f"{job.name}  log: {self.settings.LOG_DIR}/{job.name}.log")
        line = (
            f"sweep summary: {n['done'] + n['skipped']} done ({n['done']} ran now, "
            f"{n['skipped']} skipped: already done), {n['failed']} failed, "
            f"{n['interrupted']} interrupted, {n['left']} not started"
        )
        if n["elsewhere"]:
            line += f", {n['elsewhere']} running elsewhere"
        if n["waiting"]:
            line += f", {n['waiting']} waiting for unfinished inputs"
        if n["duplicate"]:
            line += f" ({n['duplicate']} duplicate job(s) ignored)"
        print("---")
        print(line)
        for failure in failures:
            print(f"  failed: {failure}")
        for job in self.jobs:
            if job.result == "waiting":
                print(f"  waiting: job {job.index}: {job.note}")
        unfinished = n["interrupted"] + n["left"] + n["elsewhere"] + n["waiting"]
        if unfinished:
            print(
                "re-run run.sh to finish the rest (interrupted jobs resume from their checkpoints)."
            )
        sys.stdout.flush()
        return n["failed"] + unfinished == 0
