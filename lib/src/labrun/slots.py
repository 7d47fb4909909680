"""The sweep's slots (run.sh without --slurm): the machine's capacity (cores, memory, GPUs,
CUDA_VISIBLE_DEVICES) and how many jobs it runs at once, each on which GPU with how many threads.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .sweepjobs import POSITIVE, BadSetting, Settings, SweepJob, json_int, text_or_empty

# CUDA MPS would run the slots' kernels side by side; not measured to help yet (no GPU at hand
# when this was written), so it stays off.
MPS = "; CUDA MPS off (not measured to help)"
GPU_ID = re.compile(r"[0-9]+|(GPU|MIG)-[A-Za-z0-9/-]+")
# A job's preflight estimate in its run.log (preflight.check_memory, runs.size_text's units).
ESTIMATE = re.compile(r"memory: training needs about ([0-9.]+) (GiB|MiB|KiB|bytes)")
UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}


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


def available_mib(cgroup: Path) -> int:
    """MiB new processes can still use: MemAvailable, capped by a cgroup v2 memory limit."""
    import psutil

    kib = psutil.virtual_memory().available // 1024
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


def measured_peak_mib(jobs: list[SweepJob]) -> int | None:
    """The largest peak GPU memory, in MiB, that a finished job of the sweep recorded."""
    peak = 0
    for job in jobs:
        text = text_or_empty(Path(job.dir) / "metrics.json") if job.dir else ""
        if re.search(r'"device": *"cuda', text):
            peak = max(peak, json_int(text, "peak_mem_bytes") or 0)
    return -(-peak // 2**20) if peak > 0 else None


def estimated_mib(jobs: list[SweepJob]) -> int | None:
    """The largest memory estimate, in MiB, that a started job's preflight wrote to run.log."""
    found = [
        float(n) * UNITS[unit]
        for job in jobs
        if job.dir and job.state != "duplicate"
        for n, unit in ESTIMATE.findall(text_or_empty(Path(job.dir) / "run.log"))
    ]
    return -(-int(max(found)) // 2**20) if found else None


# ---- the slots ---------------------------------------------------------------------------------


@dataclass
class Slots:
    """Per slot its GPU ("" on the CPU) and whether a job holds it; each job's share of the cores
    and why the slots are as many as they are."""

    settings: Settings
    jobs: list[SweepJob]  # the sweep's: how many, and the memory they estimated or measured
    gpus: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # per slot: its GPU, or "" on the CPU
    busy: list[bool] = field(default_factory=list)
    reason: str = ""  # why the slots are as many as they are
    threads: str = ""  # OMP_NUM_THREADS of a job that starts afresh
    job_cpus: int = 1  # cores of one slot (LAB_JOB_CPUS)
    gpu_width: int = 0  # JOBS_PER_GPU=auto: slots per GPU the cores and jobs allow
    gpu_measure: bool = False  # JOBS_PER_GPU=auto waits for a job's memory estimate
    gpu_open: int = 1 << 30  # slots a GPU may run at once (JOBS_PER_GPU=auto: gpu_fit's)
    gpu_why: str = ""

    @property
    def cgroup(self) -> Path:
        return Path(self.settings.env.get("SWEEP_CGROUP") or "/sys/fs/cgroup")

    def size(self) -> None:
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
        against 94 s for one job at a time with both cores' threads; benchmarks/RESULTS.md), at
        most one per job or per OMP_NUM_THREADS cores. The free memory and the jobs left only
        take slots away: the same job computes with the same threads whatever the machine runs."""
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
        self.devices, self.busy, self.reason = [""] * slots, [False] * slots, reason

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
        self.gpu_width, self.devices, self.busy = width, [], []
        if setting == "auto" and width > 1:
            self.gpu_fit(running=[])
        else:
            self.add_gpu_slots(width)
            self.reason = self.gpu_why + MPS

    def add_gpu_slots(self, per_gpu: int) -> None:
        """Slots up to `per_gpu` a GPU, in turns over the GPUs: the queue fills them in order."""
        for _ in range(max(map(self.devices.count, self.gpus)), per_gpu):
            for dev in self.gpus:
                self.devices.append(dev)
                self.busy.append(False)

    def gpu_fit(self, running: list[int]) -> None:
        """JOBS_PER_GPU=auto: open as many of the gpu_width slots per GPU as 90 % of its free
        memory holds besides the jobs running there (slots `running`). A preflight estimate is a
        lower bound (allocator slack, workspaces and compilation are not in it): doubled. Until a
        job has estimated, one per GPU."""
        peak, estimate = measured_peak_mib(self.jobs), estimated_mib(self.jobs)
        self.gpu_measure = peak is None and estimate is None
        free = None if self.gpu_measure else gpu_free_mib(self.gpus)
        if free is None:
            why = " until a job has estimated its memory" if self.gpu_measure else (
                ": free GPU memory unknown (no nvidia-smi)"
            )  # fmt: skip
            self.reason = f"{self.gpu_why}, 1{why}{MPS}"
            self.gpu_open = 1
            self.add_gpu_slots(1)
            return
        context = int(self.settings.env.get("SWEEP_CUDA_CONTEXT_MIB") or 1024)
        if peak is not None:
            need, basis = peak * 5 // 4, f"1.25 x a measured peak of {peak} MiB"
        else:
            need, basis = estimate * 2, f"2 x an estimate of {estimate} MiB"
        devices = [self.devices[slot] for slot in running]
        running_here = max((devices.count(dev) for dev in self.gpus), default=0)
        fit = min(max(running_here + free * 9 // 10 // (need + context), 1), self.gpu_width)
        beside = f" besides {running_here} running" if running_here else ""
        self.reason = (
            f"{self.gpu_why}, {fit} in 90 % of {free} MiB free{beside} at {basis} + "
            f"{context} MiB context per job{MPS}"
        )
        self.gpu_open = fit
        self.add_gpu_slots(fit)

    def is_open(self, slot: int) -> bool:
        """Whether `slot` is one of the slots its GPU keeps open (gpu_open); a CPU slot is."""
        dev = self.devices[slot]
        return not dev or self.devices[:slot].count(dev) < self.gpu_open

    def describe(self) -> str:
        """'2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s))' or '4 slot(s) on GPU(s)
        0 0 1 1, 4 thread(s) each (JOBS_PER_GPU=2; ...)'."""
        if not self.devices or not self.devices[0]:
            return f"{len(self.devices)} CPU slot(s), {self.threads} thread(s) each ({self.reason})"
        slots = [dev for k, dev in enumerate(self.devices) if self.is_open(k)]
        return (
            f"{len(slots)} slot(s) on GPU(s) {' '.join(slots)}, {self.threads} "
            f"thread(s) each ({self.reason})"
        )

    def env(self, slot: int, threads: str | None = None, cpus: str | None = None) -> dict:
        """The environment of a job in `slot` (threads, cpus: a resumed job's recorded ones)."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.devices[slot])
        env["OMP_NUM_THREADS"] = threads or self.threads
        env["LAB_JOB_CPUS"] = cpus or str(self.job_cpus)
        return env
