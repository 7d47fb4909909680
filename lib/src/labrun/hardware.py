"""Device, precision, kernel and compile policy: what this machine can do and what a run uses.

Every decision that depends on the hardware rather than on the experiment, each returned with
the reason run.py logs. Precision: bf16 autocast only where the hardware computes in bf16 (CUDA
compute capability >= 8.0, or a CPU with native bf16), fp16 + GradScaler on older GPUs;
`torch.cuda.is_bf16_supported()` is not used: it also counts emulated bf16 (V100/T4), which has
no tensor cores. No speed figure is claimed here: the lab template's benchmarks/RESULTS.md
measures them (`bench_train.py`, `python -m <package>.gpucheck`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .checkpoint import rng_state, set_rng_state
from .runs import labrun_hash, write_json

# Compile rule (--compile auto, hardware.choose_compile): compile only where the eager time it
# saves clearly exceeds what compiling costs. The eager time is measured (forward + backward of a
# real batch, times the micro-batches left); each candidate mode's compile time (cold, or warm:
# the inductor cache already holds this model) and its compiled/eager time ratio come from this
# model's last compiles on this machine (CompileRecord, kept in the inductor cache folder). Until
# one exists, the priors below stand in: what this lab measured, named where it was measured.
# A margin over 1x for the estimate's error: the priors are GPU measurements, not guesses.
PAYBACK = 1.25  # compile when the estimated saving is at least 1.25 x the compile time
# mode: (cold compile s, warm-cache compile s, compiled/eager time of forward + backward)
CUDA_PRIORS = {
    # H100, default CNN (shared notes, gpu.md): 17-18 s cold; slower than eager at batch 128
    # and 512 (9.2 vs 5.0 ms), 0.89x at 1024: no saving expected until this machine measures one
    "default": (18.0, 4.0, 1.0),
    # H200 (gpu.md, 2026-11-28), default CNN at batch 128: the hand-written loop's step 2.1 ms
    # compiled (15 s cold) vs 6.2 ms eager: 0.34x. So the default job (20 epochs of CIFAR-10's
    # size, 7,020 steps of ~5.2 ms eager forward + backward) compiles on a machine's first job.
    "reduce-overhead": (15.0, 4.0, 0.34),
    # Not measured here: reduce-overhead's CUDA graphs plus a search over kernels (minutes)
    "max-autotune": (300.0, 30.0, 0.3),
    "max-autotune-no-cudagraphs": (300.0, 30.0, 0.9),  # the same search, no graphs
}
# The GPU warm-cache costs above are not measured: they assume the CPU's cold/warm ratio.
# 2-core AMD EPYC (ecosystem-facts 5): 15.7 s cold, 2.9-3.3 s warm, ~15 % faster than eager
CPU_PRIORS = {"default": (16.0, 3.1, 0.87)}
# CUDA graphs replay one captured forward/backward; the no-graphs mode with the same kernels
# where graphs cannot be used (graphs_blocked) or there is no GPU.
WITHOUT_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
INDUCTOR_CACHE_ENV = "LAB_INDUCTOR_CACHE_DIR"  # a lab-wide cache folder, shared by projects
RECORDS = "lab_compile_costs"  # sub-folder of the inductor cache: one JSON per model and machine
EAGER = "eager"  # a CompileRecord's entry for the eager step (its training steps' time)
LOOP_MIN_STEPS = 20  # a first epoch this long times the training step (CompileRecord.save_step)
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: first GPUs with bf16 tensor cores


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """True where oneDNN runs bf16 natively (AVX512-BF16 / AMX), not by conversion."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def choose_precision(device: torch.device, amp: str) -> tuple[torch.dtype | None, str]:
    """(autocast dtype or None for fp32, why). `amp` is run.py's --amp: auto, on or off."""
    if amp == "off":
        return None, "fp32 (--amp off)"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        cc = f"compute capability {capability[0]}.{capability[1]}"
        if capability >= BF16_MIN_CAPABILITY:
            return torch.bfloat16, f"bf16 autocast ({cc} >= 8.0: bf16 tensor cores)"
        return torch.float16, (
            f"fp16 autocast + GradScaler ({cc} < 8.0: no bf16 tensor cores; "
            "fp16 needs loss scaling)"
        )
    if amp == "auto":
        return None, "fp32 (--amp auto keeps the CPU in fp32; --amp on for native bf16)"
    if cpu_has_native_bf16():
        return torch.bfloat16, "bf16 autocast (--amp on, the CPU has native bf16)"
    return None, "fp32 (--amp on ignored: this CPU has no native bf16, only a slow emulation)"


@dataclass(frozen=True)
class CompileCost:
    """What compiling in one mode costs and gives, for one model on one machine."""

    compile_s: float  # what this run's compile would cost (warm when the cache should hold it)
    ratio: float  # compiled / eager seconds of forward + backward
    source: str  # "prior" or "measured <UTC time>" (of the ratio)
    cache: str = "cold"  # "cold": nothing compiled yet; "warm": this mode compiled here before


def prior_costs(device: torch.device) -> dict[str, CompileCost]:
    priors = CUDA_PRIORS if device.type == "cuda" else CPU_PRIORS
    return {mode: CompileCost(cold, ratio, "prior") for mode, (cold, _, ratio) in priors.items()}


def graphs_blocked(device: torch.device, micro_batches: int, ddp: bool, dtype) -> str | None:
    """Why this run cannot use CUDA graphs, or None when it can."""
    if device.type != "cuda":
        return "CUDA graphs need a GPU"
    if micro_batches > 1:
        # A replay writes its gradients into the graph's memory, which the next replay reuses:
        # accumulating into .grad across micro-batches would add overwritten buffers.
        return f"--grad-accum {micro_batches} accumulates gradients between replays"
    if ddp:  # DDP's all-reduce hooks inside a replayed backward: not proven on a GPU here
        return "DistributedDataParallel's gradient hooks are not proven under graphs here"
    if dtype == torch.float16:  # GradScaler's skipped steps: not proven on a GPU here
        return "fp16's GradScaler is not proven under graphs here"
    return None


def choose_compile(
    device: torch.device,
    flag: str,
    steps: int,
    deterministic: bool = False,
    micro_batches: int = 1,
    blocked: str | None = None,
    *,
    measure: Callable[[], tuple[float, dict[str, CompileCost]]],
) -> tuple[str | None, str]:
    """(torch.compile mode or None for eager, why), from --compile and the measured work:
    `measure()` gives the eager seconds of one micro-batch's forward + backward and each mode's
    CompileCost, and is called only where a choice is left (the compile rule above)."""
    if flag == "off":
        return None, "eager (--compile off)"
    if deterministic:
        # Inductor's generated kernels are not covered by torch's deterministic-algorithm list.
        return None, "eager (--deterministic)"
    if flag in CUDA_PRIORS:  # a mode name
        if blocked and flag in WITHOUT_GRAPHS:
            mode = WITHOUT_GRAPHS[flag]
            return mode, f"{mode} (--compile {flag} without CUDA graphs: {blocked})"
        return flag, f"{flag} (--compile {flag})"
    if flag == "auto" and device.type != "cuda":
        return None, "eager (--compile auto: off on CPU; --compile on to compile)"
    step_s, costs = measure()  # every mode: measured, or its prior
    eager_s = steps * micro_batches * step_s
    work = (
        f"{steps} steps x {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} x "
        f"{1e3 * step_s:.1f} ms = {eager_s:.1f} s eager"
    )
    skipped = {m: f"no CUDA graphs: {blocked}" for m in WITHOUT_GRAPHS if blocked and m in costs}
    for mode, cost in costs.items():
        if cost.ratio >= 1 and cost.source != "prior":  # a prior of 1.0 is "no saving known"
            skipped[mode] = f"measured slower ({cost.ratio:.2f}x eager time, {cost.source})"

    def saving(mode: str) -> float:
        return eager_s * (1 - costs[mode].ratio)

    candidates = [m for m in costs if m not in skipped]
    lines = [
        f"{m} saves ~{saving(m):.1f} s ({100 * (1 - costs[m].ratio):.0f} %, {costs[m].source}) "
        f"for ~{costs[m].compile_s:.0f} s ({costs[m].cache})"
        for m in candidates
    ] + [f"{m}: {why}" for m, why in skipped.items()]
    estimates = "; ".join(lines)
    if not candidates:
        return None, f"eager: {work}; every mode was measured slower: {estimates}"
    mode = max(candidates, key=lambda m: saving(m) - costs[m].compile_s)  # net of compiling
    if flag == "on":
        return mode, f"{mode} (--compile on): {work}; {estimates}"
    if saving(mode) >= PAYBACK * costs[mode].compile_s:
        return mode, f"{mode}: {work}; {estimates} ({mode}: >= {PAYBACK:g} x: pays)"
    return None, f"eager: {work}; {estimates} (best, {mode}: < {PAYBACK:g} x: would not pay)"


def use_inductor_cache(project_root: Path) -> tuple[Path, str]:
    """One inductor cache for every job of the project: TORCHINDUCTOR_CACHE_DIR as the user set
    it, else $LAB_INDUCTOR_CACHE_DIR (a lab-wide folder), else <project>/.cache/inductor; torch's
    /tmp of whichever node runs the job would have every job on another node compile anew.

    Call it before the first torch.compile: inductor reads `cache_dir()` lazily, at the first
    compile, then memoises it (torch 2.13). `import torch._dynamo` already writes torch's
    default, /tmp/torchinductor_<user>, into the environment: that value counts as not set.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and Path(current).resolve() != Path(default_cache_dir()).resolve():
        return Path(current), "TORCHINDUCTOR_CACHE_DIR"
    lab = os.environ.get(INDUCTOR_CACHE_ENV)
    path = (Path(lab).expanduser() if lab else project_root / ".cache" / "inductor").resolve()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path, INDUCTOR_CACHE_ENV if lab else "the project's folder"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    capability = torch.backends.cpu.get_cpu_capability()
    return f"cpu {platform.machine()} {capability}, {torch.get_num_threads()} threads"


def labrun_source() -> str:
    """labrun's version and a hash of its source, as runs.code_version records them."""
    return f"{__version__}+{labrun_hash()}"


def machine_key(device: torch.device) -> dict:
    """What any measurement on this machine depends on: the device, torch and labrun (a record
    measured under a defect since fixed, CUDA graphs that never replayed: "measured slower",
    must not outlive that labrun)."""
    return {"device": device_name(device), "torch": torch.__version__, "labrun": labrun_source()}


def model_key(model, x: torch.Tensor, dtype, device) -> dict:
    """What a measurement of `model`'s step depends on."""
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "input": [list(x.shape), str(x.dtype), list(x.stride())],
        "autocast": str(dtype),
        **machine_key(device),
    }


def record_path(cache_dir: Path, key: dict) -> Path:
    from .config import short_hash

    return Path(cache_dir) / RECORDS / f"{short_hash(key, digits=16)}.json"


def read_record(cache_dir: Path, key: dict) -> dict | None:
    """The values write_record kept for `key` beside the compile records, or None."""
    try:
        seen = json.loads(record_path(cache_dir, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return seen if isinstance(seen, dict) and seen.get("key") == key else None


def write_record(cache_dir: Path, key: dict, **values) -> None:
    """Keep `values` (numbers a machine measures once) for `key`, with the UTC time."""
    path = record_path(cache_dir, key)
    with contextlib.suppress(OSError):  # a read-only folder keeps nothing
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"key": key, **values, "when": utc_now()})


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())  # as run.log quotes it


class CompileRecord:
    """The measured compile costs of one model_key: a small JSON file in the inductor cache folder
    shared by the project's jobs (a lost update between two jobs only costs a re-measurement)."""

    def __init__(self, cache_dir: Path, model, x: torch.Tensor, dtype, device) -> None:
        self.cache_dir, self.key = Path(cache_dir), model_key(model, x, dtype, device)
        self.path = record_path(cache_dir, self.key)

    def read(self) -> dict:
        """Each mode's numbers; {} when none are recorded (the priors stand in)."""
        seen = read_record(self.cache_dir, self.key)
        return seen["modes"] if seen and isinstance(seen.get("modes"), dict) else {}

    def costs(self, device: torch.device) -> dict[str, CompileCost]:
        """Each mode's cost: the warm-cache compile cost once this mode compiled here, else the
        cold one; its ratio from the training steps' own times where jobs ran both eager and in
        this mode, else from the compile's passes."""
        priors = CUDA_PRIORS if device.type == "cuda" else CPU_PRIORS
        costs = prior_costs(device)
        modes = self.read()
        eager_loop_s = modes.get(EAGER, {}).get("loop_step_s")
        for mode, seen in modes.items():
            if mode in costs and seen.get("eager_step_s"):  # save() writes all three, > 0
                warm_s = seen.get("warm_compile_s", priors[mode][1])
                ratio = seen["compiled_step_s"] / seen["eager_step_s"]
                source = f"measured {seen['when']}"
                if eager_loop_s and seen.get("loop_step_s"):
                    ratio = seen["loop_step_s"] / eager_loop_s
                    source = f"measured {seen['loop_when']}, training steps"
                costs[mode] = CompileCost(warm_s, ratio, source, "warm")
        return costs

    def eager_step_s(self) -> float | None:
        """The eager forward + backward recorded here by an earlier job, if any."""
        return next((m["eager_step_s"] for m in self.read().values() if "eager_step_s" in m), None)

    def save(self, mode: str, *, compile_s: float, warm: bool, eager_step_s, compiled_step_s):
        modes = self.read()
        seen = modes.setdefault(mode, {})
        seen[("warm_" if warm else "cold_") + "compile_s"] = round(compile_s, 3)
        seen.update(eager_step_s=eager_step_s, compiled_step_s=compiled_step_s, when=utc_now())
        write_record(self.cache_dir, self.key, modes=modes)

    def save_step(self, mode: str | None, step_s: float) -> None:
        """The training loop's mean step time in `mode` (None: eager), from a run's first
        epoch: what a mode is judged on once eager's is known too (the warm-up's passes record
        CUDA graphs rather than replay them)."""
        modes = self.read()
        modes.setdefault(mode or EAGER, {}).update(loop_step_s=step_s, loop_when=utc_now())
        write_record(self.cache_dir, self.key, modes=modes)


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's and AOTAutograd's caches so far in this process: a compile
    between two counts with hits and no miss was warm."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return (
        inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
        inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"],
    )


@contextlib.contextmanager
def put_back(module, device: torch.device):
    """Undo what trial passes change: buffers (BatchNorm statistics), gradients, RNG."""
    buffers = [b.detach().clone() for b in module.buffers()]
    rng = rng_state(device)  # Python, numpy, torch and this GPU's generators
    try:
        yield
    finally:
        with torch.no_grad():
            for live, saved in zip(module.buffers(), buffers, strict=True):
                live.copy_(saved)
        module.zero_grad(set_to_none=True)
        set_rng_state(rng, device)


def forward_backward(module, x, y, loss_fn, dtype) -> None:
    """One micro-batch's forward (under autocast) and backward: what torch.compile speeds up.
    Starts from no gradients and marks a new step for CUDA graphs (reduce-overhead): a replay
    reuses the memory of the last one's outputs and gradients, which then must be dead."""
    module.zero_grad(set_to_none=True)
    torch.compiler.cudagraph_mark_step_begin()  # a counter: nothing runs where no graph exists
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        outputs = module(x)
    loss_fn(outputs, y).backward()


def time_forward_backward(module, x, y, loss_fn, dtype, now, repeats: int = 3) -> float:
    """Seconds of one forward + backward of `module` (`fastest`), put back as it was. `module`
    is what the step calls (compiled, in DDP): the passes compile it and, under torchrun, are
    collective (every rank calls this)."""
    with put_back(module, x.device):
        return fastest(lambda: forward_backward(module, x, y, loss_fn, dtype), now, repeats)


def fastest(work: Callable[[], object], now: Callable[[], float], repeats: int) -> float:
    """Seconds of the fastest of `repeats` timed calls of `work`, after one untimed call (memory
    allocation, cuDNN's and cuBLAS's choices of kernels); `now` waits for the device (`timed`)."""
    work()
    seconds = []
    for _ in range(repeats):
        start = now()
        work()
        seconds.append(now() - start)
    return min(seconds)


def decide_compile(
    model, loss_fn, batch, args, env, *, steps: int, project_root: Path, log
) -> tuple[str | None, float, CompileRecord | None]:
    """(torch.compile mode or None, eager seconds of forward + backward, its CompileRecord):
    choose_compile on `model`'s eager time on the real batch `batch()`, or the one an earlier
    job recorded for this model, input and machine, for run.py's --compile, --grad-accum and
    --deterministic (`args`) in the run's precision and ranks (`env`, compile_model's). Run it on
    one rank and share the mode."""
    device, dtype, micro_batches = next(model.parameters()).device, env.amp_dtype, args.grad_accum
    record, eager_s = None, 0.0

    def measure() -> tuple[float, dict[str, CompileCost]]:
        nonlocal record, eager_s
        cache, source = use_inductor_cache(project_root)  # before anything compiles
        log.info("inductor cache: %s (%s)", cache, source)
        x, y = batch()
        record = CompileRecord(cache, model, x, dtype, device)
        eager_s = record.eager_step_s() or time_forward_backward(
            model, x, y, loss_fn, dtype, timed(device)
        )
        return eager_s, record.costs(device)

    blocked = graphs_blocked(device, micro_batches, env.dist.active, dtype)
    mode, why = choose_compile(
        device, args.compile, steps, args.deterministic, micro_batches, blocked, measure=measure
    )
    if mode in CUDA_PRIORS and record is None:  # a forced mode: its costs are still recorded
        measure()
    log.info("compile: %s", why)
    return mode, eager_s, record


def setup_backends(device: torch.device, deterministic: bool) -> str:
    """Fast kernels, or bitwise-reproducible ones with --deterministic; returns what was set."""
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")  # also matmul.allow_tf32 = False
        # warn_only=False: an op without a deterministic kernel raises instead of silently
        # breaking reproducibility. The default model and loss use only covered ops (amax
        # pooling, a gather-based cross-entropy, see tasks.cross_entropy).
        torch.use_deterministic_algorithms(True, warn_only=False)
        return (
            "deterministic: deterministic kernels (ops without one raise), cudnn.benchmark "
            "off, TF32 off (matmul and cuDNN), compile off. Still not reproducible: runs on "
            "another GPU model, driver, torch version or thread count"
        )
    # Undo a --deterministic run earlier in this process (a notebook, the tests): the switches
    # below are process-wide. Only if one was: the call imports torch._inductor.
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv once
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere+
        torch.backends.cudnn.allow_tf32 = True
        return "fast kernels: cudnn.benchmark on, TF32 on"
    return "CPU kernels (nothing to set)"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def timed(device: torch.device) -> Callable[[], float]:
    """A clock that waits for the device first, so timings measure work, not kernel launches."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # note: sync point, only where a clock is read
        return time.perf_counter()

    return now


def choose_gpu_resident(flag: str, device: torch.device, splits: dict) -> bool:
    """--gpu-resident on, or auto where the splits as stored take at most a quarter of the
    GPU's free memory (the rest is for the model); never off CUDA."""
    from .data import decoded_bytes

    if device.type != "cuda" or flag == "off":
        return False
    return flag == "on" or decoded_bytes(splits.values()) <= torch.cuda.mem_get_info(device)[0] / 4


# ---- speed you can see: MFU and the share of the step the GPU was busy (issue 33.4) ------------
PEAK_MATMUL_SIZE = 8192  # square matmuls big enough to reach a GPU's tensor-core peak
PEAK_REPEATS = 10
BUSY_FIRST, BUSY_STEPS = 5, 10  # profile steps 5..14 of the first epoch: after cuDNN's search
LAUNCH_BOUND = 0.5  # a GPU busy less than half the step waits on the host's kernel launches


def flops_per_sample(model, x, y, loss_fn, dtype) -> float:
    """FLOPs of one training sample's forward + backward (torch.utils.flop_counter on a real
    batch, the optimizer not counted: the convention of MFU). Puts back what it touched."""
    from torch.utils.flop_counter import FlopCounterMode

    with put_back(model, x.device), FlopCounterMode(display=False) as counter:
        forward_backward(model, x, y, loss_fn, dtype)
    return counter.get_total_flops() / len(x)


def matmul_peak(cache_dir: Path, device: torch.device, dtype) -> tuple[float, str]:
    """(FLOP/s, "measured now" or "recorded <when>"): measure_matmul_flops once per GPU model,
    precision, torch and labrun, kept beside the compile records."""
    key = {"matmul_peak": str(dtype), **machine_key(device)}
    if (seen := read_record(cache_dir, key)) and isinstance(seen.get("flops"), float):
        return seen["flops"], f"recorded {seen['when']}"
    flops = float(measure_matmul_flops(device, dtype))
    write_record(cache_dir, key, flops=flops)
    return flops, "measured now"


def measure_matmul_flops(device: torch.device, dtype) -> float:
    """FLOP/s of the best of PEAK_REPEATS square matmuls in `dtype` (fp32 when None): a measured
    peak, not the data sheet's, so MFU says how far a job is from what this GPU does. A CPU gets
    1024-square ones: 8192 would take seconds each."""
    n = PEAK_MATMUL_SIZE if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype or torch.float32) for _ in range(2))
    return 2 * n**3 / fastest(lambda: torch.mm(a, b), timed(device), PEAK_REPEATS)


class GpuBusy:
    """The share of the step the GPU was busy: CUDA kernel time (torch.profiler) over the wall
    time of BUSY_STEPS steps of the first epoch; `at(step)` before each, `close(steps)` after."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.share, self.step_s = device, None, None
        self._profile = self._started = None

    def at(self, step: int) -> None:
        if step == BUSY_FIRST:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CUDA])
            self._profile.start()
            self._started = timed(self.device)()
        elif step == BUSY_FIRST + BUSY_STEPS:
            self.close(step)

    def close(self, steps: int) -> None:
        if self._profile is None:
            return
        wall = timed(self.device)() - self._started
        self._profile.stop()
        busy_us = sum(e.self_device_time_total for e in kernels(self._profile.events()))
        self._profile = None
        self.share = min(1.0, busy_us / 1e6 / wall)
        self.step_s = wall / (steps - BUSY_FIRST)


def kernels(events) -> list:
    """The GPU's work among a profile's events: device events that are not annotations (the
    profiler's `optimizer_step_N`, torch.compile's regions span a step on the GPU's timeline)."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def busy_line(share: float, step_s: float, batch_size: int) -> str:
    """run.log's line on the GPU's busy share; under LAUNCH_BOUND, what a larger batch gives.
    The estimate: the host's launches take the same time at any batch size, the GPU's work
    grows with it, so a step of k x the batch takes max(step, k x busy) (a floor: larger
    kernels also run more efficiently)."""
    busy_s = share * step_s
    line = f"GPU busy {100 * share:.0f} % of the step ({1e3 * busy_s:.2f} of {1e3 * step_s:.2f} ms)"
    if share >= LAUNCH_BOUND:
        return line
    k = 2 ** math.ceil(math.log2(step_s / max(busy_s, 1e-12)))
    estimate = k * batch_size / max(step_s, k * busy_s)
    return (
        f"{line}: under {100 * LAUNCH_BOUND:.0f} %, the step waits on kernel launches; "
        f"--batch-size {k * batch_size} would give >= {estimate:,.0f} samples/s (now "
        f"{batch_size / step_s:,.0f}) where it fits (--find-batch-size), or --compile "
        "reduce-overhead (CUDA graphs: one launch per step)"
    )
