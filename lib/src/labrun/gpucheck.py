"""Prove the GPU claims on the machine at hand: `python -m labrun.gpucheck`.

Builds run.py's jobs in this process with run.py's own functions (build_data, make_model,
train.build_trainer, warm_up with its compile decision, train_epoch) and run.py's defaults, then
checks each claim against a stated threshold. Exit status 0: no check FAILed (checks that cannot
run here say "not checked" and why); 1: at least one FAIL.
  torch build  a machine whose nvidia-smi lists GPUs runs a CUDA build of torch that sees them
  precision    the autocast dtype's matmul peak is >= PRECISION_MIN_GAIN x fp32's (CUDA)
  compile      run.py's decision for the default run (logged with its numbers); where it
               compiles: no fallback to eager, and compiled forward + backward <= eager's
  feed         the job's loop (run.train_epoch, the real loader) reaches >= FEED_MIN of the
               step's ceiling (the same steps on batches already on the device): once for
               the default run, once for a streamed image folder at 224 px with ResNet-18
               (JPEGs written to a temp folder; DataLoader workers, pinned memory)
  plain        the job is >= PLAIN_MIN x the textbook loop (CUDA: its syncs cost there)
  sync         no host sync inside the step and the loader's batches, under
               `torch.cuda.set_sync_debug_mode("error")`: run.py's defaults, --ema, --clip-grad,
               --grad-accum and fp16 autocast + GradScaler (CUDA)
  recompiles   none across train, eval, checkpoint and resume after the warm-up
  layout       every conv activation is channels_last
  resume       exact: with --deterministic, k steps + checkpoint + resume + k steps gives
               bitwise the weights of 2k straight steps
  ddp          with several GPUs: the step on 1 and on all of them (torchrun + DDP, --batch-size
               per GPU), weak-scaling efficiency >= distributed.SCALING_MIN
`--device cpu` runs what can run on a CPU (feed, recompiles, layout, resume): a dry run of this
script, not a GPU claim. Checks are functions in CHECKS (each returns its Result lines): a new
claim (the DDP case: distributed.py) appends its own.
The lab template's benchmarks/bench_train.py imports the measuring functions below
(`plain_loop_rate`, `ceiling_rate`, `job_rate`, `train_flops_per_sample`, `matmul_peak`).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Thresholds: each check FAILs below (or above) its own.
FEED_MIN = 0.9  # job / ceiling: the loader and the loop cost at most 10 % of the step's rate
PLAIN_MIN = 1.0  # job / textbook loop: the job's design must not be slower than the naive loop
PRECISION_MIN_GAIN = 1.3  # autocast matmul / fp32 (TF32) matmul: the low precision must pay
COMPILED_MAX_RATIO = 1.0  # compiled / eager forward + backward: a compile must not slow it
INSTALL_CUDA = (
    "pip install torch --index-url https://download.pytorch.org/whl/cu128   "
    "(or: uv sync --extra cu128 --extra dev; README, Install)"
)
PASS, FAIL, NOT_CHECKED, INFO = "PASS", "FAIL", "not checked", "info"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python -m {__package__}.gpucheck", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: the checks this script exists for; cpu: a dry run of what runs on a CPU",
    )
    p.add_argument("--steps", type=int, default=100, help="timed steps of each speed measurement")
    p.add_argument(
        "--synthetic-size",
        type=int,
        default=50_000,
        help="images of the default job's synthetic data (50000: CIFAR-10's 7,020 steps)",
    )
    p.add_argument(
        "--mode",
        choices=("run", "default", "max-autotune", "eager"),
        default="run",
        help="compile mode of the checked step: run = what run.py decides for the default run",
    )
    p.add_argument("--width", type=int, default=64, help="model width (run.py's --width)")
    p.add_argument("--batch-size", type=int, default=128, help="run.py's --batch-size")
    p.add_argument("--stream-size", type=int, default=224, help="streamed case: image size (px)")
    p.add_argument("--stream-model", default="resnet18", help="streamed case: run.py's --model")
    p.add_argument(
        "--skip", nargs="*", default=[], help="names of checks to leave out (e.g. stream plain)"
    )
    return p.parse_args(argv)


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, NOT_CHECKED or INFO
    detail: str


@dataclass
class Context:
    """What every check gets: this script's options, the device, a work folder, the log."""

    options: argparse.Namespace
    device: object
    work: Path
    log: logging.Logger
    lines: list[str] = field(default_factory=list)  # run.py's log lines (compile decisions)
    mode: str | None = None  # the compile mode of the default job, for the other checks


# --------------------------------------------------------------------------------------------
# run.py's jobs, built in this process with run.py's own functions


def run_module():
    """run.py itself (imported from the project root): the code path under test."""
    spec = importlib.util.spec_from_file_location("run_checked", PROJECT_ROOT / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Job:
    run: types.ModuleType
    args: argparse.Namespace
    data: object  # run.Data
    state: object  # state.TrainingState
    eager_s: float  # forward + backward of one micro-batch, before the warm-up
    compiled_s: float | None  # the same after it, where it compiled

    @property
    def trainer(self):
        return self.state.trainer


def build_job(ctx: Context, *flags: str, dtype=None, mode: str | None = "run") -> Job:
    """One run.py job as run.train() builds it, up to and including the warm-up: the same
    config, data, model, Trainer and compile decision (mode "run"; or a forced mode, compiled
    by the same Trainer.warm_up on run.py's peeked batch). `dtype` forces an autocast dtype."""
    import torch

    from .config import parse_args as run_args
    from .hardware import choose_precision, setup_backends, timed
    from .state import TrainingState
    from .stopping import EarlyStopping
    from .tasks import create_task
    from .train import build_trainer, seed_everything

    run = run_module()
    args, _ = run_args(
        [
            *("--device", ctx.device.type, "--tracking", "off", "--progress", "off"),
            *("--results-dir", str(ctx.work / "results"), "--data-dir", str(ctx.work / "data")),
            *("--width", str(ctx.options.width), "--batch-size", str(ctx.options.batch_size)),
            *flags,
        ]
    )
    device = ctx.device
    chosen, _ = choose_precision(device, args.amp)
    setup_backends(device, args.deterministic)
    task = create_task(args.task, args, args.monitor)
    data = run.build_data(args, device, task)
    seed_everything(args.seed)
    model = run.make_model(args, data.info).to(device, memory_format=torch.channels_last)
    trainer = build_trainer(
        model,
        args,
        device=device,
        dtype=dtype or chosen,
        compile_mode=None,
        total_steps=run.total_steps(args, data.steps_per_epoch),
        log=ctx.log,
        task=task,
    )
    state = TrainingState(trainer, EarlyStopping(args.patience), device=device, config_hash="-")
    now = timed(device)
    x, y = run.peek_batch(data.loaders["train"], 0, device)
    eager_s = trainer.time_forward_backward(x, y, now)
    if mode == "run":
        run.warm_up(state, data, args, ctx.log)
    elif mode not in (None, "eager"):
        trainer.compile(mode)
        trainer.warm_up(x, y)
    compiled_s = trainer.time_forward_backward(x, y, now) if trainer.compiled else None
    return Job(run, args, data, state, eager_s, compiled_s)


def job_and_ceiling(job: Job, steps: int, warmup: int = 5) -> tuple[float, float]:
    """samples/s of run.py's loop (train_epoch over the real loader) and of the same Trainer's
    steps on batches already on the device (the ceiling the loader must not pull down)."""
    run, args, p = job.run, job.args, job.state.progress
    loader, per_epoch = job.data.loaders["train"], job.data.steps_per_epoch
    steps = min(steps, per_epoch - warmup)
    if steps < 1:
        raise ValueError(f"{per_epoch} steps per epoch: too few for {warmup} + 1 steps")
    from .distributed import Dist  # one process: gpucheck's jobs are not under torchrun

    never = types.SimpleNamespace(requested=None)
    args.max_steps = warmup  # untimed: cuDNN autotuning, allocator growth, worker start
    run.train_epoch(job.state, loader, per_epoch, args, never, Dist())
    args.max_steps = warmup + steps
    seconds = run.train_epoch(job.state, loader, per_epoch, args, never, Dist())
    samples = steps * args.batch_size * args.grad_accum
    loader.set_epoch(0)
    batches = [b for _, b in zip(range(8), loader, strict=False)]
    ceiling = ceiling_rate(job.trainer, batches, steps, warmup, p.step)
    return samples / seconds, ceiling


# --------------------------------------------------------------------------------------------
# Measuring functions (shared with the template's benchmarks/bench_train.py)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_split(n: int, seed: int = 0):
    """n random CIFAR-shaped uint8 images with labels: speed does not depend on content."""
    import torch

    from .data import Split

    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen)
    return Split(images, torch.randint(0, 10, (n,), generator=gen))


def build_trainer(
    device,
    *,
    batch_size: int,
    total_steps: int,
    width: int = 64,
    compile_mode: str | None = None,
    grad_accum: int = 1,
):
    """A default-model Trainer with run.py's optimizer, schedule and precision (for the
    benchmarks and the resume check; the other checks build whole jobs: build_job)."""
    import torch

    from . import hardware, train
    from .models import create_model

    model = create_model("cnn", num_classes=10, channels=3, image_size=(32, 32), width=width)
    model = model.to(device, memory_format=torch.channels_last)
    lr = hardware.default_lr(batch_size)
    optimizer = train.build_optimizer(model, lr, 5e-4, device)
    scheduler = train.build_scheduler(optimizer, lr, total_steps)
    dtype, _ = hardware.choose_precision(device, "auto")
    return train.Trainer(
        model,
        optimizer,
        scheduler,
        device=device,
        dtype=dtype,
        grad_accum=grad_accum,
        compile_mode=compile_mode,
    )


def warm_up(trainer, batch) -> float:
    """The explicit compile warm-up; returns its seconds (0 when eager)."""
    from .hardware import timed

    now = timed(trainer.device)
    start = now()
    trainer.warm_up(*batch)
    return now() - start


def ceiling_rate(trainer, batches: list, steps: int, warmup: int, first: int = 0) -> float:
    """samples/s of `steps` optimizer steps alone, on batches already on the device."""
    n = trainer.grad_accum

    def step(i: int) -> None:
        trainer.step([batches[(i * n + k) % len(batches)] for k in range(n)], first + i + 1)

    for i in range(warmup):
        step(i)
    synchronize(trainer.device)
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    synchronize(trainer.device)
    return steps * n * batches[0][1].shape[0] / (time.perf_counter() - start)


def plain_loop_rate(
    split, device, *, batch_size: int, steps: int, warmup: int, tracking_dir: Path, width: int = 64
) -> float:
    """The textbook loop: fp32, NCHW, a per-sample Dataset that converts and augments on the CPU
    (num_workers=0), `loss.item()` and a synchronous `mlflow.log_metric` every step, no
    compile."""
    import mlflow
    import torch
    import torch.nn.functional as F

    from .augment import MEAN, STD
    from .models import create_model

    class PerSampleDataset(torch.utils.data.Dataset):
        def __init__(self, images, labels):
            self.images, self.labels = images, labels
            self.mean = torch.tensor(MEAN).view(3, 1, 1) / 255
            self.std = torch.tensor(STD).view(3, 1, 1) / 255

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            image = self.images[i].float() / 255  # "ToTensor"
            image = F.pad(image, (4, 4, 4, 4))  # "RandomCrop(32, padding=4)"
            dy, dx = torch.randint(0, 9, (2,)).tolist()
            image = image[:, dy : dy + 32, dx : dx + 32]
            if torch.rand(()) < 0.5:  # "RandomHorizontalFlip"
                image = image.flip(2)
            return (image - self.mean) / self.std, self.labels[i]  # "Normalize"

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        PerSampleDataset(split.images, split.labels),
        batch_size=batch_size,
        shuffle=True,
        num_workers=0,
        drop_last=True,
    )
    model = create_model("cnn", num_classes=10, channels=3, image_size=(32, 32), width=width)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=5e-4)
    mlflow.set_tracking_uri(f"sqlite:///{tracking_dir / 'plain.db'}")
    mlflow.set_experiment("bench-plain")

    def batches():
        while True:
            yield from loader

    start = time.perf_counter()
    with mlflow.start_run():
        for step, (x, y) in enumerate(batches()):
            if step == warmup:
                synchronize(device)
                start = time.perf_counter()
            elif step == warmup + steps:
                break
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mlflow.log_metric("train_loss", loss.item(), step=step)  # sync + a DB write
        synchronize(device)
    return steps * batch_size / (time.perf_counter() - start)


def job_rate(
    device,
    *,
    batch_size: int,
    steps: int,
    synthetic_size: int,
    data_dir: Path,
    results_dir: Path,
    extra_args: tuple[str, ...] = (),
    threads: int = 0,
    width: int = 64,
) -> dict:
    """run.py itself in a subprocess; its metrics.json (samples_per_sec: the step loop only)."""
    command = [
        sys.executable,
        "run.py",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        str(synthetic_size),
        "--max-steps",
        str(steps),
        "--epochs",
        "1000",
        "--batch-size",
        str(batch_size),
        "--width",
        str(width),
        "--device",
        device.type,
        "--data-dir",
        str(data_dir),
        "--results-dir",
        str(results_dir),
        "--progress",
        "off",
        "--fresh",
        *extra_args,
    ]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{results_dir / 'mlflow.db'}"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op pool size at start-up
    run_dir = subprocess.run(
        [*command, "--print-run-dir"],
        cwd=PROJECT_ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    done = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"run.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    if metrics["steps"] != steps:
        raise RuntimeError(f"run.py ran {metrics['steps']} steps, expected {steps}")
    return metrics


def train_flops_per_sample(width: int, device) -> float:
    """FLOPs of one training step (forward + backward) per sample, counted by torch's
    FlopCounterMode (matmuls and convolutions; elementwise ops are not counted)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from .models import create_model

    model = create_model("cnn", num_classes=10, channels=3, image_size=(32, 32), width=width)
    model = model.to(device)
    x = torch.randn(2, 3, 32, 32, device=device)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 2


def matmul_peak(device, dtype, size: int | None = None, repeats: int = 10) -> float:
    """Measured FLOP/s of a large square matmul in `dtype` (fp32 when None): the practical peak
    of this device, the denominator of MFU."""
    import torch

    size = size or (8192 if device.type == "cuda" else 1024)
    dtype = dtype or torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up (kernel selection, allocator)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# --------------------------------------------------------------------------------------------
# Checks: each takes the Context and returns its Result lines


def check_torch_build(ctx: Context) -> list[Result]:
    import torch

    gpus = nvidia_smi_gpus()
    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    if gpus and torch.version.cuda is None:
        return [
            Result(
                "torch build",
                FAIL,
                f"nvidia-smi lists {len(gpus)} GPU(s) but {build} is a CPU build: "
                f"install the CUDA build: {INSTALL_CUDA}",
            )
        ]
    if gpus and not torch.cuda.is_available():
        return [
            Result(
                "torch build",
                FAIL,
                f"nvidia-smi lists {len(gpus)} GPU(s) but {build} sees none "
                "(driver older than the build's CUDA, or CUDA_VISIBLE_DEVICES hides them)",
            )
        ]
    if ctx.device.type != "cuda":
        return [Result("torch build", NOT_CHECKED, f"--device cpu ({build})")]
    if not torch.cuda.is_available():
        return [Result("torch build", NOT_CHECKED, f"no CUDA ({build}, no GPU in nvidia-smi)")]
    return [Result("torch build", PASS, f"{build}: {torch.cuda.get_device_name(ctx.device)}")]


def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (none where it is missing or fails)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in listed.splitlines() if line.startswith("GPU ")]


def check_precision(ctx: Context) -> list[Result]:
    from .hardware import choose_precision

    dtype, why = choose_precision(ctx.device, "auto")
    if ctx.device.type != "cuda":
        return [Result("precision", NOT_CHECKED, f"no CUDA ({why})")]
    gain = matmul_peak(ctx.device, dtype) / matmul_peak(ctx.device, None)
    ok = gain >= PRECISION_MIN_GAIN
    return [
        Result(
            "precision",
            PASS if ok else FAIL,
            f"{why}; its matmul is {gain:.2f}x fp32's (threshold {PRECISION_MIN_GAIN}x)",
        )
    ]


def check_default_job(ctx: Context) -> list[Result]:
    """run.py's defaults on CIFAR-sized synthetic data: compile decision, feed, plain, sync,
    recompiles, layout, MFU."""
    import torch

    options, device = ctx.options, ctx.device
    flags = ("--dataset", "synthetic", "--synthetic-size", str(options.synthetic_size))
    job = build_job(ctx, *flags, mode=options.mode)
    trainer = job.trainer
    ctx.mode = trainer.compile_mode
    decision = next((line for line in reversed(ctx.lines) if line.startswith("compile: ")), "")
    if options.mode == "run":
        results = [Result("decision", INFO, f"run.py's {decision}")]
        wanted = not decision.startswith("compile: eager")
    else:
        results = [Result("decision", INFO, f"forced: --mode {options.mode}")]
        wanted = options.mode != "eager"
    if wanted and not trainer.compiled:
        results.append(Result("compile", FAIL, "compiling fell back to eager (see the log)"))
    elif trainer.compiled:
        ratio = job.compiled_s / job.eager_s
        results.append(
            Result(
                "compile",
                PASS if ratio <= COMPILED_MAX_RATIO else FAIL,
                f"{ctx.mode}: forward + backward {1e3 * job.compiled_s:.2f} ms vs eager "
                f"{1e3 * job.eager_s:.2f} ms = {ratio:.2f}x (threshold <= {COMPILED_MAX_RATIO})",
            )
        )
    else:
        results.append(Result("compile", NOT_CHECKED, "eager: nothing compiled"))
    job_rate_, ceiling = job_and_ceiling(job, options.steps)
    results.append(feed_result("feed", job_rate_, ceiling))
    if "plain" in options.skip:
        pass
    elif device.type != "cuda":
        results.append(Result("plain", NOT_CHECKED, "no CUDA (the plain loop's syncs cost there)"))
    else:
        plain = plain_loop_rate(
            job.data.splits["train"],
            device,
            batch_size=job.args.batch_size,
            steps=min(options.steps, 100),
            warmup=5,
            tracking_dir=ctx.work,
            width=options.width,
        )
        results.append(
            Result(
                "plain",
                PASS if job_rate_ >= PLAIN_MIN * plain else FAIL,
                f"job {job_rate_:.0f} vs textbook loop {plain:.0f} samples/s = "
                f"{job_rate_ / plain:.2f}x (threshold {PLAIN_MIN}x)",
            )
        )
    results.append(sync_result("sync", job, options.steps))
    results.append(check_no_recompiles(job))
    batch = job.run.peek_batch(job.data.loaders["train"], 0, device)
    ok, detail = check_channels_last(trainer, batch)
    results.append(Result("layout", PASS if ok else FAIL, detail))
    flops = train_flops_per_sample(options.width, device)
    dtype = trainer.dtype or torch.float32
    peak = matmul_peak(device, trainer.dtype)
    results.append(
        Result(
            "MFU",
            INFO,
            f"{job_rate_ * flops / 1e12:.3f} TFLOP/s of the job ({flops / 1e9:.2f} GFLOP/sample)"
            f" vs measured matmul peak {peak / 1e12:.1f} TFLOP/s ({dtype}): "
            f"{100 * job_rate_ * flops / peak:.1f} %",
        )
    )
    return results


def feed_result(name: str, job: float, ceiling: float) -> Result:
    share = job / ceiling
    return Result(
        name,
        PASS if share >= FEED_MIN else FAIL,
        f"job {job:.0f} of the step's {ceiling:.0f} samples/s = {100 * share:.0f} % "
        f"(threshold {100 * FEED_MIN:.0f} %)",
    )


def sync_result(name: str, job: Job, steps: int) -> Result:
    """`steps` optimizer steps of run.py's Trainer on the loader's batches, with any blocking
    device->host operation an error. The epoch's first batch is taken before (an epoch start
    may copy its order to the device once); the rest come from the loader under the check."""
    import torch

    if job.trainer.device.type != "cuda":
        return Result(name, NOT_CHECKED, "no CUDA")
    trainer, n = job.trainer, job.args.grad_accum
    loader = job.data.loaders["train"]
    loader.set_epoch(0)
    batches = iter(loader)
    first = next(batches)
    steps = min(steps, len(loader) // n - 1)
    synchronize(trainer.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.step([first, *(next(batches) for _ in range(n - 1))], 10_000)
        for i in range(steps - 1):
            trainer.step([next(batches) for _ in range(n)], 10_001 + i)
    except RuntimeError as exc:
        return Result(name, FAIL, f"host sync: {str(exc).splitlines()[0]}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
        getattr(batches, "close", lambda: None)()
    return Result(name, PASS, f"{steps} steps, 0 host syncs (threshold 0)")


def check_sync_variants(ctx: Context) -> list[Result]:
    """The sync check under the flags that add work to the step, in the default job's mode."""
    import torch

    variants = {
        "sync --ema": ("--ema", "0.999"),
        "sync --clip-grad": ("--clip-grad", "1.0"),
        "sync --grad-accum": ("--grad-accum", "2"),
        "sync fp16": (),
    }
    if ctx.device.type != "cuda":
        return [Result(name, NOT_CHECKED, "no CUDA") for name in variants]
    size = ("--dataset", "synthetic", "--synthetic-size", str(40 * ctx.options.batch_size))
    results = []
    for name, flags in variants.items():
        dtype = torch.float16 if name == "sync fp16" else None
        job = build_job(ctx, *size, *flags, dtype=dtype, mode=ctx.mode)
        results.append(sync_result(name, job, 20))
    return results


def check_streamed_folder(ctx: Context) -> list[Result]:
    """Image files streamed through run.py's loader (workers, pinned memory on CUDA) into
    ResNet-18 at 224 px: JPEGs of 500x375 written to a temp folder."""
    options = ctx.options
    if "stream" in options.skip:
        return []
    warmup, steps = 5, max(options.steps // 2, 5)
    per_class = -(-(warmup + steps + 2) * options.batch_size // 3) + 1
    folder = write_jpegs(ctx.work / "jpegs", per_class)
    flags = (
        *("--dataset", "folder", "--data-path", str(folder), "--data-mode", "stream"),
        *("--image-size", str(options.stream_size), "--model", options.stream_model),
        *("--val-fraction", "0.01"),
    )
    job = build_job(ctx, *flags, mode=ctx.mode)
    job_rate_, ceiling = job_and_ceiling(job, steps, warmup)
    workers = getattr(job.data.loaders["train"], "workers", "?")
    result = feed_result(f"feed stream {options.stream_size}px", job_rate_, ceiling)
    result.detail += f"; {options.stream_model}, {workers} workers"
    return [result]


def write_jpegs(root: Path, per_class: int, size=(500, 375), classes: int = 3) -> Path:
    """root/train/<class>/<i>.jpg and root/test/<class>/0.jpg: smooth random photos-like JPEGs
    (8x8 noise upscaled: sizes on disk like a photo's, not like incompressible noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        for split, count in (("train", per_class), ("test", 1)):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                image = Image.fromarray(small, "RGB").resize(size, Image.Resampling.BICUBIC)
                image.save(folder / f"{i}.jpg", quality=90)
    return root


def check_no_recompiles(job: Job) -> Result:
    import torch
    import torch._dynamo

    from .train import evaluate

    trainer = job.trainer
    if not trainer.compiled:
        return Result("recompiles", NOT_CHECKED, "eager (nothing compiled)")
    loader = job.data.loaders["train"]
    loader.set_epoch(0)
    batches = [b for _, b in zip(range(4 * trainer.grad_accum), loader, strict=False)]
    counters = torch._dynamo.utils.counters
    graphs_before = counters["stats"]["unique_graphs"]
    n = trainer.grad_accum
    torch._dynamo.config.error_on_recompile = True
    try:
        trainer.step(batches[:n], 20_000)
        evaluate(trainer.model, job.data.loaders["val"], device=trainer.device, dtype=trainer.dtype)
        buffer = io.BytesIO()
        torch.save(trainer.state_dict(), buffer)  # checkpoint
        buffer.seek(0)
        trainer.load_state_dict(torch.load(buffer, weights_only=True))  # resume
        for i in range(1, 4):
            trainer.step(batches[i * n : (i + 1) * n], 20_000 + i)
        synchronize(trainer.device)
    except Exception as exc:  # RecompileError, or what recompiling broke
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Result("recompiles", FAIL, f"{type(exc).__name__}: {text}")
    finally:
        torch._dynamo.config.error_on_recompile = False
    new = counters["stats"]["unique_graphs"] - graphs_before
    return Result(
        "recompiles",
        PASS if new == 0 else FAIL,
        f"{new} new graphs across train, eval, checkpoint, resume (threshold 0)",
    )


def check_resume(ctx: Context) -> list[Result]:
    from .hardware import setup_backends

    split = synthetic_split(16 * 64)
    try:
        ok, detail = check_exact_resume(ctx.device, split, batch_size=64, width=ctx.options.width)
    finally:
        setup_backends(ctx.device, deterministic=False)
    return [Result("resume", PASS if ok else FAIL, detail)]


# The checks, in order. A new claim appends its function (the DDP case: distributed.py).
def check_ddp(ctx: Context) -> list[Result]:
    """One job on every visible GPU: DDP's scaling (distributed.check_scaling)."""
    import torch

    from .distributed import check_scaling

    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if gpus < 2:
        return [Result("ddp", NOT_CHECKED, f"{gpus} GPU(s): needs 2 or more")]
    ok, detail = check_scaling(
        "cuda", gpus, batch=ctx.options.batch_size, steps=ctx.options.steps, width=ctx.options.width
    )
    return [Result("ddp", PASS if ok else FAIL, detail)]


CHECKS: list[Callable[[Context], list[Result]]] = [
    check_torch_build,
    check_precision,
    check_default_job,
    check_sync_variants,
    check_streamed_folder,
    check_resume,
    check_ddp,
]


def check_channels_last(trainer, batch) -> tuple[bool, str]:
    import torch
    from torch import nn

    outputs = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        for m in trainer.model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    try:
        with (
            torch.no_grad(),
            torch.autocast(
                trainer.device.type, dtype=trainer.dtype, enabled=trainer.dtype is not None
            ),
        ):
            trainer.model(batch[0])
    finally:
        for hook in hooks:
            hook.remove()
    good = sum(o.is_contiguous(memory_format=torch.channels_last) for o in outputs)
    return good == len(outputs), f"{good}/{len(outputs)} conv outputs channels_last"


def check_exact_resume(
    device, split, *, batch_size: int, width: int, steps: int = 6
) -> tuple[bool, str]:
    """run.py's resume path in miniature: Trainer.state_dict + checkpoint.rng_state + the
    loader's skip_batches, under --deterministic's backends."""
    import torch

    from . import checkpoint, hardware
    from .data import build_loader
    from .train import seed_everything

    statement = hardware.setup_backends(device, deterministic=True)
    half = steps // 2

    def fresh():
        seed_everything(0)
        trainer = build_trainer(device, batch_size=batch_size, total_steps=steps, width=width)
        loader = build_loader(split, batch_size, train=True, device=device, seed=0)
        return trainer, loader

    def run(trainer, loader, first: int, last: int):
        loader.set_epoch(0, skip_batches=first)
        for number, batch in zip(range(first + 1, last + 1), loader, strict=False):
            trainer.step([batch], number)

    straight, loader = fresh()
    run(straight, loader, 0, steps)
    first, loader = fresh()
    run(first, loader, 0, half)
    buffer = io.BytesIO()
    torch.save({"trainer": first.state_dict(), "rng": checkpoint.rng_state(device)}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed, loader = fresh()
    resumed.load_state_dict(state["trainer"])
    checkpoint.set_rng_state(state["rng"], device)
    run(resumed, loader, half, steps)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    same = all(torch.equal(a[k], b[k]) for k in a)
    return same, f"{steps} straight vs {half}+checkpoint+{steps - half}: " + (
        "bitwise equal" if same else "weights differ"
    ) + f" ({statement.split(':')[0]})"


def main(argv=None) -> int:
    options = parse_args(argv)
    import torch

    from .hardware import setup_backends

    device = torch.device(options.device)
    cuda_missing = device.type == "cuda" and not torch.cuda.is_available()
    if not cuda_missing:
        setup_backends(device, deterministic=False)  # run.py's fast kernels (TF32 on CUDA)
    log = logging.getLogger(f"{__package__}.gpucheck")
    log.setLevel(logging.INFO)
    log.propagate = False
    with tempfile.TemporaryDirectory(prefix="gpucheck_") as work:
        ctx = Context(options, device, Path(work), log)
        log.addHandler(_Lines(ctx.lines))
        print(f"gpucheck on {options.device}, torch {torch.__version__}, run.py's defaults")
        results: list[Result] = []
        for check in CHECKS:
            if cuda_missing and check is not check_torch_build:
                name = check.__name__.removeprefix("check_").replace("_", " ")
                results.append(Result(name, NOT_CHECKED, "no CUDA"))
                continue
            print(f"  running {check.__name__} ...", file=sys.stderr, flush=True)
            results.extend(check(ctx))
    print()
    column = max(len(r.name) for r in results)
    for r in results:
        print(r.name.ljust(column), r.status.ljust(len(NOT_CHECKED)), r.detail, sep="  ")
    failed = [r.name for r in results if r.status == FAIL]
    unchecked = [r.name for r in results if r.status == NOT_CHECKED]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    else:
        print(
            "no check failed" + (f"; not checked here: {', '.join(unchecked)}" if unchecked else "")
        )
    return 1 if failed else 0


class _Lines(logging.Handler):
    """Keeps run.py's log lines (the compile decision) for the report."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        print(f"  | {record.getMessage()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
