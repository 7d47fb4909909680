"""Device, precision, kernel and compile policy: what this machine can do and what a run uses.

Owns every decision that depends on the hardware rather than on the experiment, each returned
with the reason that run.py logs:
- device:     `resolve_device` (auto = CUDA when present).
- precision:  `choose_precision`: bf16 autocast only where the hardware computes in bf16 (CUDA
              compute capability >= 8.0, or a CPU with native bf16); fp16 + GradScaler on older
              GPUs; fp32 otherwise. `torch.cuda.is_bf16_supported()` is not used: it also counts
              emulated bf16 (V100/T4), which has no tensor cores.
- compile:    `choose_compile` picks a torch.compile mode from the run's length (rule below).
- kernels:    `setup_backends`: cuDNN autotuning + TF32 for speed, or `--deterministic`.
- batch size: `default_batch_size` / `default_lr`: the device-aware defaults (rule below).
No speed figure is claimed here: the lab template's benchmarks/RESULTS.md measures them
(`bench_train.py`, `python -m <package>.gpucheck`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

# Compile rule (CUDA, --compile auto). Compilation is a one-time cost (compile_time_s in
# metrics.json measures it), paid back by faster steps only over enough steps, and the
# max-autotune search costs more up front than the default mode. The thresholds are a stated
# rule, not a measured break-even: gpucheck reports compile time and step times to set them.
COMPILE_MIN_STEPS = 500  # shorter runs (digits: 10 steps/epoch x 20 epochs) stay eager
AUTOTUNE_MIN_STEPS = 5000  # from here on: "max-autotune" (autotuned kernels + CUDA graphs)
# Batch-size rule: the CPU default (128) keeps a CPU step short; a GPU needs more work per
# launch, so on CUDA the default is CUDA_BATCH_SIZE where find_batch_size says it fits, and the
# LR grows with sqrt(batch ratio) (the usual rule for Adam-type optimizers, tuning.scale_lr).
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


def choose_compile(
    device: torch.device, flag: str, total_steps: int, deterministic: bool = False
) -> tuple[str | None, str]:
    """(torch.compile mode or None for eager, why), from --compile and the run's length.

    auto: eager on CPU, under --deterministic and for runs shorter than COMPILE_MIN_STEPS;
    "default" up to AUTOTUNE_MIN_STEPS; "max-autotune" (adds CUDA graphs) beyond.
    on: compiled whatever the length ("default" below AUTOTUNE_MIN_STEPS or on CPU).
    """
    if flag == "off":
        return None, "eager (--compile off)"
    if deterministic:
        # Inductor's generated kernels are not covered by torch's deterministic-algorithm list.
        return None, "eager (--deterministic)"
    if flag == "auto" and device.type != "cuda":
        return None, "eager (--compile auto: off on CPU; --compile on to compile)"
    if flag == "auto" and total_steps < COMPILE_MIN_STEPS:
        return None, f"eager ({total_steps} steps < {COMPILE_MIN_STEPS}: compiling would not pay)"
    if device.type == "cuda" and total_steps >= AUTOTUNE_MIN_STEPS:
        return "max-autotune", f"max-autotune + CUDA graphs ({total_steps} steps)"
    return "default", f"default mode ({total_steps} steps)"


def default_batch_size(device: torch.device) -> int:
    """The batch-size rule: BASE_BATCH_SIZE on CPU, CUDA_BATCH_SIZE on CUDA (where it fits)."""
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
    # below are process-wide.
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
