"""labrun's sweep engine: the queue behind a project's run.sh.

run.sh holds the job list in shell (`job ARGS...` once per job) and ends with

    exec "${PYTHON}" -m labrun.sweep run.sh "$@" < <(printf '%s\\0' N_QUICK QUICK_ARGS... JOBS...)

where each job is its argument count then its arguments, NUL-terminated (read_job_list). Every
setting is an environment variable, listed with its default in ENVIRONMENT; `bash run.sh --help`
prints run.sh's header, then that list. Imports no torch and no mlflow: `--help` is instant.
This module holds the command (main) and step 4; sweepjobs.py the settings, the job list and
step 1; slots.py and jobqueue.py steps 2 and 3.

How it works:
  1. plan:  each job is one run.py invocation: `--results-dir results/SWEEP_NAME`, the preset's
            arguments (QUICK_ARGS with --quick), the job's own, then those after `--` (the last of
            a flag wins); `job SCRIPT.py ARGS...` one of another script built on labrun's jobs.py
            (e.g. analyze.py), as is. ONE call of `SCRIPT --plan` per script (its own parser, no
            torch) gives every job's run directory and state (plan.py lists them); stopping ones
            are waited for (SWEEP_STOPPING_WAIT_S), waiting ones planned again as jobs end.
  2. queue: JOBS_PER_GPU slots per GPU (gpu_slots); without a GPU CPU_JOBS slots (cpu_slots).
            Every job runs in its own session (process group) with CUDA_VISIBLE_DEVICES set to its
            slot's GPU and a parent-death signal (SIGTERM), so it is told to stop if the sweep
            dies, even by SIGKILL. When a job ends its slot takes the next pending job. Every job
            is a fresh `python run.py`: one process model for claims, signals and exit codes.
  3. stop:  the first INT/TERM/HUP sends SIGTERM to every running job (it checkpoints and exits
            75); any later one SIGKILLs their process groups. Either way the sweep reaps every
            job, marks a killed job's status "interrupted", prints the summary, then exits
            128+first signal.
  4. --slurm: the pending jobs as one sbatch array (slurm_task.sh, beside this file, runs one
            task); tasks still queued or running from an earlier array are not submitted again.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

from .jobqueue import Queue, own_dir
from .runs import ForeignFile
from .slots import Slots, choose_gpus
from .sweepjobs import (
    ENVIRONMENT,
    POSITIVE,
    BadSetting,
    Refused,
    Settings,
    Sweep,
    SweepJob,
    err,
    nul_join,
    read_job_list,
    text_or_empty,
)

TASK_SCRIPT = Path(__file__).resolve().with_name("slurm_task.sh")


# ---- Slurm (run.sh --slurm) ----------------------------------------------------------------------


def mark_queued_in_slurm(sweep: Sweep) -> None:
    """Mark jobs still queued or running in an earlier array of this project as "queued", so
    that submitting again does not run them twice. Earlier submissions are SLURM_LOG_DIR/*/,
    each with job_id (the array) and tasks.tsv (task id TAB run directory)."""
    if not shutil.which("squeue"):
        return
    submit_dir_of = {}
    for f in Path(sweep.settings.SLURM_LOG_DIR).glob("*/job_id"):
        lines = text_or_empty(f).split()
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
        for row in text_or_empty(submit_dir_of[array] / "tasks.tsv").splitlines():
            number, _, run_dir = row.partition("\t")
            if number == task and run_dir:
                queued[run_dir] = f"{array}_{task} {state}"
                break
    for job in sweep.jobs:
        if job.runnable and job.dir in queued:
            job.state = "queued"
            job.note = f"Slurm task {queued[job.dir]}, from an earlier run.sh --slurm"


def init_tracking(sweep: Sweep, job: SweepJob) -> None:
    """Create the MLflow database and experiment once, before a Slurm array's tasks start in
    parallel: they log to MLflow live. (A local sweep's jobs do not touch MLflow: its follower
    creates the database, under mirror.py's schema lock, while the first jobs train.)"""
    cmd = [sweep.python, job.script, *sweep.argv(job), "--init-tracking"]
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
        raise Refused(f"could not create the MLflow database ({job.script} --init-tracking failed)")


def submit_slurm(sweep: Sweep, dry_run: bool) -> None:
    """Submit the pending jobs as one Slurm job array (slurm_task.sh runs one task)."""
    s = sweep.settings
    pending = [job for job in sweep.jobs if job.runnable]
    for job in sweep.jobs:
        if job.state == "invalid":
            err(f"not submitted, {job.note}")
        if job.state == "refused":
            err(f"not submitted, {job.name}: {job.note}")
    if not pending:
        print(f"nothing to submit: all {len(sweep.jobs)} jobs are done, queued or running.")
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
    # --requeue: preempted tasks go back to the queue. B:USR1@N: N s before the time limit, the
    # task script alone (B:) gets USR1; it tells run.py to checkpoint, then requeues.
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
    init_tracking(sweep, pending[0])
    (submit / "args").mkdir(parents=True, exist_ok=True)
    # The interpreter the tasks use: PYTHON as resolved here, so the tasks get the same venv.
    python = shutil.which(sweep.python)
    if python is None:
        raise Refused(f"PYTHON={sweep.python} not found")
    (submit / "python").write_text(f"{python}\n")
    if multi:
        (submit / "torchrun").write_text(f"{job_gpus} {job_nodes}\n")
    tasks = []
    for n, job in enumerate(pending):
        # One file per array task: its arguments, NUL-separated (any character is safe), and
        # its script when it is not run.py.
        (submit / "args" / str(n)).write_bytes(nul_join(sweep.argv(job)))
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


def usage(script: str) -> str:
    """run.sh's header comment (its usage text: line 2 to the first blank line), then the
    settings."""
    lines = text_or_empty(Path(script)).splitlines()[1:]
    header = [re.sub(r"^# ?", "", line) for line in itertools.takewhile(bool, lines)]
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
    except (Refused, ForeignFile) as exc:  # ForeignFile: a link or another's file in its way
        err(str(exc))
        return 2
    except BadSetting as exc:
        print(f"error: {exc}", file=sys.stderr)
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
    slots = Slots(settings, jobs, [] if slurm else choose_gpus(env))  # bad GPUS: refused now
    if not jobs:
        raise Refused("the sweep has no jobs")
    sweep.plan()
    if not dry_run:
        sweep.wait_for_stopping(int(env.get("SWEEP_STOPPING_WAIT_S") or 30))
    if slurm:
        mark_queued_in_slurm(sweep)
        if dry_run:
            sweep.print_plan()
        submit_slurm(sweep, dry_run)
        return 0
    slots.size()
    if dry_run:
        sweep.print_plan()
        print(f"would run on {slots.describe()}")
        return 0
    try:  # the jobs' logs go into a folder of ours only
        own_dir(Path(settings.LOG_DIR))
    except OSError as exc:
        raise Refused(f"LOG_DIR: {exc}") from None
    queue = Queue(sweep, slots)
    ok = queue.run()
    if queue.stop_signal:
        return 128 + queue.stop_signal
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
