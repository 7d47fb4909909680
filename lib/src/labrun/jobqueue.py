"""run.sh's queue on this machine (without --slurm): each job started on a free slot in a
session of its own, how it ended (its status; re-queued to run alone after it ran out of GPU
memory beside others), the status lines, the stop on INT/TERM/HUP, and the MLflow follower.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .runs import (
    EXIT_BUSY,
    EXIT_INTERRUPTED,
    ForeignFile,
    open_append,
    owner_name,
    read_status,
    write_status,
)
from .slots import Slots
from .sweepjobs import Sweep, SweepJob, err, json_int, log, text_or_empty

ESTIMATE_POLL_S = 0.5  # how often JOBS_PER_GPU=auto looks for the first job's estimate
# A job that ran out of GPU memory: CUDA's OOM (run.py's line or a traceback), or the preflight's
# refusal of a GPU whose free memory its neighbours held.
OUT_OF_MEMORY = re.compile(r"out of memory|memory on cuda[^\n]* is free", re.I)
# How a job that the queue does not run ends, by its planned state (the summary's words).
NOT_RUN = {"done": "skipped", "duplicate": "duplicate", "running": "elsewhere",
           "stopping": "elsewhere", "waiting": "waiting"}  # fmt: skip


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


def recorded_threads(run_dir: str) -> tuple[int, int] | None:
    """(threads, cpus) the run recorded in config.json when it started; None if it never did."""
    text = text_or_empty(Path(run_dir) / "config.json") if run_dir else ""
    threads = json_int(text, "torch_threads")
    if threads is None:
        return None
    cpus = json_int(text, "job_cpus")
    return threads, threads if cpus is None else cpus


def job_progress(run_dir: str) -> str:
    """'epoch 3/20' from a job's history.csv (epochs written) and config.json (epochs planned)."""
    rows = max(text_or_empty(Path(run_dir) / "history.csv").count("\n") - 1, 0)
    total = json_int(text_or_empty(Path(run_dir) / "config.json"), "epochs")
    return f"epoch {rows}/{'?' if total is None else total}"


@dataclass
class Running:
    job: SweepJob
    slot: int
    proc: subprocess.Popen
    t0: int
    shared: bool = False  # another job ran on its GPU meanwhile


@dataclass
class Queue:
    """The sweep's jobs on its slots: those still to start, in order, and those running."""

    sweep: Sweep
    slots: Slots
    stop_signal: int = 0
    running: dict[int, Running] = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)
    took: list[int] = field(default_factory=list)
    queue: list[SweepJob] = field(default_factory=list)
    guard: Callable[[], None] | None = None  # _guard(), made once
    follower_pid: int = 0

    def refit(self) -> None:
        """JOBS_PER_GPU=auto: fit the slots again, and say so when they change."""
        before = self.slots.describe()
        self.slots.gpu_fit([entry.slot for entry in self.running.values()])
        if self.slots.describe() != before:
            log(f"slots now: {self.slots.describe()}")

    def may_start(self, slot: int) -> bool:
        """Whether `slot` may take the queue's next job: one of the slots its GPU keeps open
        (gpu_open), and never beside a job that runs alone (re-queued after it ran out of GPU
        memory beside others), which itself waits for its GPU to empty."""
        dev = self.slots.devices[slot]
        if not dev:
            return True
        if not self.slots.is_open(slot):
            return False
        beside = [e.job for e in self.running.values() if self.slots.devices[e.slot] == dev]
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
        tail = text_or_empty(Path(self.sweep.settings.LOG_DIR) / f"{job.name}.log")[-4000:]
        if not OUT_OF_MEMORY.search(tail.rpartition("\n=== ")[2]):  # this attempt's lines
            return
        job.result, job.alone = "", True
        self.queue.insert(0, job)
        log(f"requeued {job.name}  (out of GPU memory beside other jobs: it runs alone next)")

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
        """Start job in a session of its own: a stop reaches its children too, and Ctrl-C in the
        terminal reaches the sweep only, which then stops every job the same way."""
        dev, how = self.slots.devices[slot], ""
        argv = self.sweep.argv(job)
        # A job that started before (interrupted, failed) keeps its threads: its numbers depend
        # on them.
        recorded = recorded_threads(job.dir)
        if recorded:
            threads, cpus = map(str, recorded)
            how = ", as when it started"
        else:
            threads, cpus = self.slots.threads, str(self.slots.job_cpus)
        log_file = Path(self.sweep.settings.LOG_DIR) / f"{job.name}.log"
        env = self.slots.env(slot, threads, cpus)
        header = (
            f"=== {time.strftime('%F %T')}  CUDA_VISIBLE_DEVICES={dev} OMP_NUM_THREADS="
            f"{threads} LAB_JOB_CPUS={cpus}  {self.sweep.python} {job.script} {' '.join(argv)}"
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
                [self.sweep.python, job.script, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self.guard,
                pass_fds=() if follower_fd is None else (follower_fd,),
            )
        self.running[proc.pid] = Running(job, slot, proc, int(time.time()))
        beside = [e for e in self.running.values() if dev and self.slots.devices[e.slot] == dev]
        for entry in beside if len(beside) > 1 else ():  # retry_alone's "shared"
            entry.shared = True
        self.groups.append(proc.pid)
        self.slots.busy[slot] = True
        where = f"GPU {dev}" if dev else "CPU"
        log(f"start    {job.name}  ({where}, slot {slot}, {threads} thread(s){how})")
        if self.stop_signal:  # a signal that arrived while this job was being started missed it
            _kill(proc.pid, signal.SIGTERM)

    def finish(self, pid: int, rc: int) -> None:
        """Record how job `pid` ended and free its slot."""
        entry = self.running.pop(pid)
        job, took = entry.job, int(time.time()) - entry.t0
        self.slots.busy[entry.slot] = False
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
                f"log: {self.sweep.settings.LOG_DIR}/{job.name}.log"
            )

    def print_status(self) -> None:
        """Jobs done / running / pending with an ETA, then each running job's epoch."""
        left = len(self.queue)
        done = sum(job.result in ("done", "skipped") for job in self.sweep.jobs)
        eta = "after the first job finishes"
        if self.took:
            t = sum(self.took) * (left + len(self.running)) // len(self.took)
            t //= len(self.slots.devices)
            eta = f"~{t // 3600}h{t % 3600 // 60}m"
        log(f"sweep: {done} done, {len(self.running)} running, {left} pending; ETA {eta}")
        for entry in self.running.values():
            log(f"  running  {entry.job.name} {job_progress(entry.job.dir)}")

    def run(self) -> bool:
        """Run every pending job (and each waiting one once its inputs are done); print the
        summary. True if every job is done."""
        settings, slots = self.sweep.settings, self.slots
        for job in self.sweep.jobs:
            if job.runnable:
                self.queue.append(job)
            else:
                job.result = NOT_RUN.get(job.state, "failed")
        # The jobs that share this node's memory: run.py's --data-mode auto divides its budget
        # by it (JOBS_PER_GPU=auto may open more slots once a job has measured its memory).
        per_node = len(slots.gpus) * slots.gpu_width if slots.gpus else len(slots.devices)
        os.environ["LAB_JOBS_PER_NODE"] = os.environ.get("LAB_JOBS_PER_NODE") or str(per_node)
        self.guard = _guard()
        follower, follower_fd = start_follower(self.sweep, self.guard)
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
            waiting = sum(job.result == "waiting" for job in self.sweep.jobs)  # inputs not done
            later = f", {waiting} waiting for their inputs" * bool(waiting)
            rest = len(self.sweep.jobs) - len(self.queue) - waiting
            log(
                f"{len(self.queue)} job(s) to run{later}, {rest} done or skipped; "
                f"{slots.describe()}; logs in {settings.LOG_DIR}/"
            )
            next_status = time.monotonic() + every if every else None
        planned = False
        while True:
            if not self.stop_signal:
                for slot in range(len(slots.devices)):
                    # Jobs finished meanwhile by another process (planned long ago) need no
                    # interpreter.
                    while self.queue and _finished(self.queue[0]):
                        job = self.queue.pop(0)
                        job.result = "skipped"
                        log(f"skipped  {job.name}  (finished meanwhile by another process)")
                    if not slots.busy[slot] and self.queue and self.may_start(slot):
                        self.launch(self.queue.pop(0), slot, follower_fd)
                        planned = False
            if not self.running:
                # Nothing runs here any more: one last look at the jobs held elsewhere.
                if not self.stop_signal and not planned and self.sweep.others_pending():
                    self.queue += self.sweep.replan()
                    planned = True
                    if self.queue:
                        continue
                break
            timeout = None if next_status is None else max(next_status - time.monotonic(), 0)
            if slots.gpu_measure:  # JOBS_PER_GPU=auto: look for the first job's estimate
                timeout = min(timeout or ESTIMATE_POLL_S, ESTIMATE_POLL_S)
            select.select([wake_r], [], [], timeout)
            with contextlib.suppress(BlockingIOError):  # empty: all read
                while os.read(wake_r, 512):
                    pass
            if next_status is not None and time.monotonic() >= next_status:
                if self.stop_signal:
                    next_status = None
                else:
                    self.print_status()
                    next_status = time.monotonic() + every
            if slots.gpu_measure and not self.stop_signal:
                self.refit()
            for pid in list(self.running):
                entry = self.running[pid]
                rc = entry.proc.poll()
                if rc is None:
                    continue
                self.finish(pid, 128 - rc if rc < 0 else rc)  # killed by signal N: 128+N
                if not self.stop_signal:
                    self.retry_alone(entry)
                    if slots.gpus and settings.JOBS_PER_GPU == "auto" and slots.gpu_width > 1:
                        self.refit()  # a measured peak refines the fit
                    if self.sweep.others_pending():
                        self.queue += self.sweep.replan()
                        planned = True
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(old_wakeup_fd)
        os.close(wake_r)
        os.close(wake_w)
        self.reap_groups()
        stop_follower(self.sweep, follower, follower_fd)
        return self.sweep.summarize()

    def reap_groups(self) -> None:
        """After the queue: give leftover processes of every job's group 10 s, then kill them."""
        for _ in range(100):
            if not any(_alive(-pg) for pg in self.groups):
                return
            time.sleep(0.1)
        for pg in self.groups:
            _kill(-pg, signal.SIGKILL)


# ---- the MLflow follower (follower.py's `follow`): its stdin is a pipe whose write end the jobs
# inherit too, so it closes once every job is gone.


def start_follower(sweep: Sweep, guard: Callable[[], None] | None) -> tuple[subprocess.Popen, int]:
    os.environ["LAB_TRACKING_FOLLOWER"] = "1"
    read_end, write_end = os.pipe()
    name = sweep.settings.SWEEP_NAME
    roots = sorted({str(Path(f"results/{name}").resolve()), *sweep.folders})  # analyze.py's too
    with open_append(Path(sweep.settings.LOG_DIR) / "mlflow-follower.out") as out:
        follower = subprocess.Popen(
            [sweep.python, "-m", "labrun.tracking", "follow", *roots],
            stdin=read_end,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=guard,
        )
    os.close(read_end)
    return follower, write_end


def stop_follower(sweep: Sweep, follower: subprocess.Popen, write_end: int) -> None:
    os.close(write_end)
    if follower.wait() != 0:
        name = sweep.settings.SWEEP_NAME
        err(
            f"MLflow follower failed ({sweep.settings.LOG_DIR}/mlflow-follower.out); "
            f"python -m labrun.tracking sync results/{name} mirrors what it missed"
        )


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
        with contextlib.suppress(PermissionError):  # another user's process: alive
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def own_dir(path: Path) -> Path:
    """`path` made if missing (with its parents); ForeignFile unless a directory of this user."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ForeignFile(
            errno.EPERM,
            f"{path} is not a directory of {owner_name(os.geteuid())} (owner "
            f"{owner_name(info.st_uid)}{', a link' if stat.S_ISLNK(info.st_mode) else ''}): "
            "nothing is written there",
        )
    return path


def mark_interrupted(run_dir: str) -> None:
    """A job killed before it could write its own status leaves "running": say what happened
    (in a directory of ours only, by runs.write_status: never through a link)."""
    if not run_dir or read_status(Path(run_dir)) != "running":
        return
    try:
        write_status(own_dir(Path(run_dir)), "interrupted")
    except OSError as exc:
        err(f"could not mark {run_dir} interrupted: {exc}")


def finished_elsewhere(run_dir: Path, pid: int) -> bool:
    """Whether job `pid` found its run finished by another process instead of training it: .lock
    still holds its claim (its pid) and metrics.json is older than that claim."""
    lock = run_dir / ".lock"
    lines = text_or_empty(lock).splitlines()
    if not lines or not lines[0].startswith(f"pid={pid} "):
        return False
    try:
        return (run_dir / "metrics.json").stat().st_mtime_ns <= lock.stat().st_mtime_ns
    except OSError:
        return False
