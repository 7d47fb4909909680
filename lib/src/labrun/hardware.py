"""Device, precision, kernel and compile policy: what this machine can do and what a run uses.

Owns every decision that depends on the hardware rather than on the experiment, each returned
with the reason that run.py logs:
- device:     `resolve_device` (auto = CUDA when present).
- precision:  `choose_precision`: bf16 autocast only where the hardware computes in bf16 (CUDA
              compute capability >= 8.0, or a CPU with native bf16); fp16 + GradScaler on older
              GPUs; fp32 otherwise. `torch.cuda.is_bf16_supported()` is not used: it also counts
              emulated bf16 (V100/T4), which has no tensor cores.
- compile:    `decide_compile` / `choose_compile`: eager, "default" or "max-autotune" from the
              measured eager time of the steps left and the compile time recorded for this
              model on this machine (rule below); `use_inductor_cache`: one cache per project.
- kernels:    `setup_backends`: cuDNN autotuning + TF32 for speed, or `--deterministic`.
- batch size: `recommended_batch_size` / `default_lr`: what --find-batch-size recommends per
              device; the default --batch-size is 128 everywhere (rule below).
No speed figure is claimed here: the lab template's benchmarks/RESULTS.md measures them
(`bench_train.py`, `python -m <package>.gpucheck`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Compile rule (--compile auto, hardware.choose_compile): compile only where the eager time it
# saves clearly exceeds what compiling costs. The eager time is measured (forward + backward of a
# real batch, times the micro-batches left); the compile time and the compiled/eager time ratio
# come from this model's last compile on this machine (CompileRecord, kept in the inductor cache
# folder). Until one exists, the PRIOR_COSTS below stand in: assumptions on the expensive side,
# not measurements (gpucheck and every compiled run replace them with this machine's numbers).
PAYBACK = 2.0  # compile when the estimated saving is at least twice the compile time
PRIOR_COSTS = {  # mode: (compile seconds, compiled/eager time of forward + backward)
    "default": (60.0, 0.8),
    "max-autotune": (600.0, 0.7),  # autotuned kernels + CUDA graphs: long search up front
    "max-autotune-no-cudagraphs": (600.0, 0.75),  # the same kernels, no CUDA graphs
}
# CUDA graphs replay one captured forward/backward; with --grad-accum > 1 the micro-steps
# accumulate into .grad between replays and alternate DDP's no_sync, and a replay overwrites the
# outputs of the one before: cudagraph trees then re-record or fall back, slower than no graphs.
CUDA_GRAPH_MODES = {"max-autotune": "max-autotune-no-cudagraphs"}
CPU_MODES = ("default",)  # max-autotune's CUDA graphs and Triton autotuning need a GPU
INDUCTOR_CACHE_ENV = "LAB_INDUCTOR_CACHE_DIR"  # a lab-wide cache folder, shared by projects
RECORDS = "lab_compile_costs"  # sub-folder of the inductor cache: one JSON per model and machine
# Batch-size rule: one default batch size, 128, on every device: the batch size is part of the
# run's identity (it changes the numbers), so a default that followed the device would put the
# same command into different run directories on a laptop and on a GPU node, and a sweep's
# results would stop being comparable. A GPU usually wants more work per launch: CUDA_BATCH_SIZE
# is the *recommendation* `--find-batch-size` prints (capped by what fits, LR scaled by
# sqrt(batch ratio), the usual rule for Adam-type optimizers); you pass it explicitly.
BASE_BATCH_SIZE, BASE_LR = 128, 3e-3
CUDA_BATCH_SIZE = 512
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

    compile_s: float
    ratio: float  # compiled / eager seconds of forward + backward
    source: str  # "prior" (PRIOR_COSTS) or "measured <UTC time>"


def prior_costs() -> dict[str, CompileCost]:
    return {mode: CompileCost(c, r, "prior") for mode, (c, r) in PRIOR_COSTS.items()}


def choose_compile(
    device: torch.device,
    flag: str,
    steps: int,
    deterministic: bool = False,
    *,
    micro_batches: int = 1,
    measure: Callable[[], tuple[float, dict[str, CompileCost]]] | None = None,
) -> tuple[str | None, str]:
    """(torch.compile mode or None for eager, why), from --compile and the measured work.

    off, --deterministic, and auto on CPU: eager, nothing measured. Otherwise `measure()` gives
    the eager seconds of one micro-batch's forward + backward and each mode's CompileCost; the
    eager time of the run is steps x micro_batches x that, and each mode would save
    (1 - ratio) of it. auto compiles in the mode that saves the most net of its compile time,
    if that saving is at least PAYBACK x the compile time; on always compiles, in that mode.
    """
    if flag == "off":
        return None, "eager (--compile off)"
    if deterministic:
        # Inductor's generated kernels are not covered by torch's deterministic-algorithm list.
        return None, "eager (--deterministic)"
    if flag == "auto" and device.type != "cuda":
        return None, "eager (--compile auto: off on CPU; --compile on to compile)"
    if measure is None:
        raise ValueError("choose_compile: --compile on/auto on CUDA needs `measure`")
    step_s, costs = measure()
    costs = {**prior_costs(), **costs}
    modes = CPU_MODES if device.type != "cuda" else ("default", "max-autotune")
    graphs_note = ""
    if micro_batches > 1 and device.type == "cuda":
        modes = tuple(CUDA_GRAPH_MODES.get(m, m) for m in modes)
        graphs_note = (
            f"; max-autotune-no-cudagraphs in place of max-autotune: CUDA graphs replay one "
            f"captured step, and --grad-accum {micro_batches} accumulates gradients between "
            "replays (cudagraph trees would re-record or fall back)"
        )
    eager_s = steps * micro_batches * step_s
    work = (
        f"{steps} steps x {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} x "
        f"{1e3 * step_s:.1f} ms = {eager_s:.1f} s eager"
    )

    def net_saving(mode: str) -> float:
        return eager_s * (1 - costs[mode].ratio) - costs[mode].compile_s

    mode = max(modes, key=net_saving)
    cost = costs[mode]
    saving = eager_s * (1 - cost.ratio)
    estimate = (
        f"{mode} would save ~{saving:.1f} s ({100 * (1 - cost.ratio):.0f} %, {cost.source}) "
        f"for a compile of ~{cost.compile_s:.0f} s ({cost.source})"
    )
    if cost.source == "prior":
        estimate += "; prior: no compile of this model recorded on this machine yet"
    if flag == "on":
        return mode, f"{mode} (--compile on): {work}; {estimate}{graphs_note}"
    if saving >= PAYBACK * cost.compile_s:
        return mode, f"{mode}: {work}; {estimate} (>= {PAYBACK:g} x: pays){graphs_note}"
    return None, f"eager: {work}; {estimate} (< {PAYBACK:g} x: would not pay)"


def use_inductor_cache(project_root: Path) -> tuple[Path, str]:
    """One inductor cache for every job of the project: TORCHINDUCTOR_CACHE_DIR as the user set
    it, else $LAB_INDUCTOR_CACHE_DIR (a lab-wide folder), else <project>/.cache/inductor.

    When torch reads it (torch 2.13): inductor's caches (FX graphs, autotuning, Triton kernels)
    call `cache_dir()` (torch/_inductor/runtime/cache_dir_utils.py) lazily, at the first
    compile, some then memoised: so this runs before the first torch.compile of the process.
    But `import torch._dynamo` already calls it (for DynamoCache, used only under
    TORCH_CACHING_PRECOMPILE=1) and writes torch's default, /tmp/torchinductor_<user>, into the
    environment: a value equal to that default therefore counts as not set by the user. Without
    this, the cache is /tmp of whichever node runs the job, and every job and resume on another
    node compiles from scratch.
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


class CompileRecord:
    """The measured compile costs of one model, input and precision on one machine and torch
    version: a small JSON file in the inductor cache folder, shared by the project's jobs (the
    last compile's numbers win; a lost update between two concurrent jobs only costs a
    re-measurement)."""

    def __init__(self, cache_dir: Path, model, x: torch.Tensor, dtype, device) -> None:
        self.key = {
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "parameters": sum(p.numel() for p in model.parameters()),
            "input": [list(x.shape), str(x.dtype), list(x.stride())],
            "autocast": str(dtype),
            "device": device_name(device),
            "torch": torch.__version__,
        }
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(cache_dir) / RECORDS / f"{digest}.json"

    def read(self) -> dict:
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # none yet, or unreadable: the priors stand in
            return {}
        return record.get("modes", {}) if record.get("key") == self.key else {}

    def costs(self) -> dict[str, CompileCost]:
        costs = prior_costs()
        for mode, seen in self.read().items():
            if mode in costs and seen.get("eager_step_s"):
                ratio = seen["compiled_step_s"] / seen["eager_step_s"]
                costs[mode] = CompileCost(seen["compile_s"], ratio, f"measured {seen['when']}")
        return costs

    def save(self, mode: str, *, compile_s: float, eager_step_s: float, compiled_step_s: float):
        from .runs import write_json

        modes = self.read()
        modes[mode] = {
            "compile_s": round(compile_s, 3),
            "eager_step_s": eager_step_s,
            "compiled_step_s": compiled_step_s,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, {"key": self.key, "modes": modes})
        except OSError:  # a read-only cache folder: the next job measures again
            pass


@contextlib.contextmanager
def put_back(module, device: torch.device):
    """Undo what trial passes change: buffers (BatchNorm statistics), gradients, RNG."""
    buffers = [b.detach().clone() for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for live, saved in zip(module.buffers(), buffers, strict=True):
                live.copy_(saved)
        module.zero_grad(set_to_none=True)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def forward_backward(module, x, y, loss_fn, dtype) -> None:
    """One micro-batch's forward (under autocast) and backward: what torch.compile speeds up."""
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        outputs = module(x)
    loss_fn(outputs, y).backward()


def time_forward_backward(module, x, y, loss_fn, dtype, now, repeats: int = 3) -> float:
    """Seconds of one forward + backward of `module` (the best of `repeats` after one untimed
    pass: allocator growth, cuDNN autotuning); `now` waits for the device (`timed`). Puts back
    everything it touched. `module` is what the step calls (compiled, in DDP): the passes
    compile it and, under torchrun, are collective (every rank calls this)."""
    with put_back(module, x.device):
        forward_backward(module, x, y, loss_fn, dtype)
        best = float("inf")
        for _ in range(repeats):
            start = now()
            forward_backward(module, x, y, loss_fn, dtype)
            best = min(best, now() - start)
    return best


def decide_compile(
    model,
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn,
    dtype,
    steps: int,
    micro_batches: int,
    flag: str,
    deterministic: bool,
    project_root: Path,
    log,
) -> tuple[str | None, float, CompileRecord | None]:
    """(torch.compile mode or None, eager seconds of forward + backward, its CompileRecord):
    choose_compile on the eager time of `model` on the real batch `batch()` (called only when
    compiling is possible: never for auto on CPU, off or --deterministic). Logs the decision
    with its numbers. Run it on one rank and share the mode (torchrun: the same on all)."""
    device = next(model.parameters()).device
    now = timed(device)
    seen: dict = {"eager_s": 0.0, "record": None}

    def measure() -> tuple[float, dict[str, CompileCost]]:
        cache, source = use_inductor_cache(project_root)  # before anything compiles
        log.info("inductor cache: %s (%s)", cache, source)
        x, y = batch()
        seen["record"] = CompileRecord(cache, model, x, dtype, device)
        seen["eager_s"] = time_forward_backward(model, x, y, loss_fn, dtype, now)
        return seen["eager_s"], seen["record"].costs()

    mode, why = choose_compile(
        device, flag, steps, deterministic, micro_batches=micro_batches, measure=measure
    )
    log.info("compile: %s", why)
    return mode, seen["eager_s"], seen["record"]


def recommended_batch_size(device: torch.device) -> int:
    """The batch size --find-batch-size recommends (capped by what fits): BASE_BATCH_SIZE on
    CPU, CUDA_BATCH_SIZE on CUDA. Not a default: see the batch-size rule above."""
    return CUDA_BATCH_SIZE if device.type == "cuda" else BASE_BATCH_SIZE


def default_lr(batch_size: int) -> float:
    """BASE_LR at BASE_BATCH_SIZE, scaled by sqrt(batch_size / BASE_BATCH_SIZE)."""
    return BASE_LR * math.sqrt(batch_size / BASE_BATCH_SIZE)


def setup_backends(device: torch.device, deterministic: bool) -> str:
    """Fast kernels, or bitwise-reproducible ones with --deterministic; returns what was set."""
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
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
    """auto: keep the uint8 images on the GPU when they use under a quarter of free memory."""
    from .data import fits_on_device

    if flag != "auto" or device.type != "cuda":
        return flag == "on" and device.type == "cuda"
    return fits_on_device(splits, device)


# ---- the CPU's memory layout, chosen by measurement (issue 28.9) --------------------------------
LAYOUT_ROUNDS = 2  # interleaved rounds of the probe: the best of each layout counts
LAYOUT_STEPS = 2  # timed forward + backward passes per layout and round
# NCHW only when clearly faster: the loaders deliver channels_last (NCHW costs a copy per batch),
# and a near tie decided by timing noise would change a run's numbers between machines for nothing
LAYOUT_MARGIN = 1.1


def _layout_step_s(model, x, y, loss_fn, dtype, layout) -> float:
    """Best seconds of one forward + backward of a copy of `model` in `layout` (CPU)."""
    x = x.contiguous(memory_format=layout)
    model = model.to(memory_format=layout)
    best = float("inf")
    for step in range(LAYOUT_STEPS + 1):  # the first: oneDNN's primitive cache, allocations
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step:
            best = min(best, time.perf_counter() - started)
    return best


def choose_memory_format(
    model, x: torch.Tensor, y: torch.Tensor, loss_fn, *, dtype, device, cache_dir: Path | None
) -> tuple[torch.memory_format, str]:
    """channels_last or NCHW for this model's training step: channels_last on CUDA (tensor
    cores want it); on CPU measured, not assumed from the vendor: oneDNN's channels_last
    kernels beat NCHW on some x86 CPUs and lose on others (a Xeon trained at 0.89x a plain NCHW
    loop, an EPYC at 1.13x). A short probe on the real first batch times a copy of the model in
    both layouts (interleaved, best of LAYOUT_ROUNDS); the result is recorded per machine, model
    and input like the compile record, so later jobs on this machine skip the probe. The
    probe leaves the model, its gradients and the random streams as they were."""
    import copy

    if device.type != "cpu":
        return torch.channels_last, "channels_last (tensor cores)"
    if x.dim() != 4:
        return torch.contiguous_format, "NCHW (inputs are not images)"
    key = {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "input": list(x.shape),
        "autocast": str(dtype),
        "device": device_name(device),
        "cpu": _cpu_model_name(),
        "torch": torch.__version__,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / RECORDS / f"layout-{digest}.json" if cache_dir else None
    try:
        seen = json.loads(path.read_text(encoding="utf-8")) if path else {}
    except (OSError, ValueError):
        seen = {}
    if seen.get("key") == key:
        times, source = seen["step_s"], f"recorded {seen['when']} in {path}"
    else:
        rng = torch.get_rng_state()
        probe = copy.deepcopy(model).train()
        times = {"channels_last": float("inf"), "NCHW": float("inf")}
        for _ in range(LAYOUT_ROUNDS):
            for name, layout in (("NCHW", torch.contiguous_format), ("channels_last", None)):
                layout = layout or torch.channels_last
                step_s = _layout_step_s(probe, x, y, loss_fn, dtype, layout)
                times[name] = min(times[name], step_s)
        torch.set_rng_state(rng)  # dropout in the probe must not shift the run's stream
        source = "measured now"
        if path is not None:
            from .runs import write_json

            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, {"key": key, "step_s": times, "when": when})
            except OSError:  # a read-only cache folder: the next job measures again
                pass
    name = "NCHW" if times["channels_last"] > LAYOUT_MARGIN * times["NCHW"] else "channels_last"
    layout = torch.channels_last if name == "channels_last" else torch.contiguous_format
    other = "NCHW" if name == "channels_last" else "channels_last"
    return layout, (
        f"{name} on this CPU: forward + backward {1e3 * times[name]:.1f} ms vs "
        f"{1e3 * times[other]:.1f} ms {other} ({source}; NCHW when >= "
        f"{100 * (LAYOUT_MARGIN - 1):.0f} % faster)"
    )


def _cpu_model_name() -> str:
    """The CPU's marketing name (/proc/cpuinfo), e.g. 'AMD EPYC 9R14'; '' where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def layout_records_dir(project_root: Path) -> Path:
    """Where choose_memory_format keeps its records: the folder use_inductor_cache picks
    ($LAB_INDUCTOR_CACHE_DIR, else <project>/.cache/inductor), found without importing
    inductor (seconds, on a CPU run that never compiles)."""
    lab = os.environ.get(INDUCTOR_CACHE_ENV)
    return (Path(lab).expanduser() if lab else project_root / ".cache" / "inductor").resolve()
