"""Prove the GPU claims on the machine at hand: `python -m labrun.gpucheck` (from a project).

Every job it judges is the project's own `run.py`, run as a user runs it (a subprocess, or
torchrun for the DDP checks), on run.py's defaults plus the flags the check names; the verdicts
come from what run.py leaves behind (metrics.json, history.csv, run.log) and from torch's own
logs of it (TORCH_LOGS=recompiles). Each check states its threshold; exit status 0: no check
FAILed (checks that cannot run here say "not checked" and why); 1: at least one FAIL.
  torch build  a machine whose nvidia-smi lists GPUs runs a CUDA build of torch that sees them
  precision    the autocast dtype's matmul peak is >= PRECISION_MIN_GAIN x fp32's (CUDA)
  decision     run.py's compile decision for the default run, as run.log states it (info)
  ceiling      the default job is >= CEILING_MIN x reference.best_practice_rate (same model,
               batch, data and precision)
  plain        the default job is >= PLAIN_MIN x reference.naive_rate (CPU too)
  textbook     the job against reference.plain_loop_rate (info)
  feed         streamed from the host, the job reaches >= FEED_MIN of the same job with the
               data on the GPU; a folder of JPEGs streamed through workers >= FEED_MIN of the
               same images decoded in memory
  sync         no host sync inside run.py's training step (torch's sync debug mode, CUDA)
  recompiles   --compile on trains, evaluates, checkpoints and resumes without one recompile
  ddp compile  the same on 2 processes under torchrun (DDP around the compiled module)
  graphs       --compile reduce-overhead replays CUDA graphs (TORCH_LOGS=cudagraphs) for the
               forward and the backward, and its losses are the eager job's within ACCUM_RTOL
  accum        --compile on with --grad-accum 2 learns the eager run's losses (CUDA)
  layout       the memory layout run.py trains in (channels_last on CUDA: every conv output)
  resume       --deterministic, stopped after epoch 1 and resumed: the straight run's numbers
  ddp          run.py on 1 and on every GPU (batch per GPU fixed): efficiency >= SCALING_MIN
`--device cpu` runs what can run on a CPU: a dry run of this script, not a GPU claim. Checks are
functions in CHECKS (each returns its Result lines). The benchmarks import `job_rate` (run.py
itself, timed) and tools/reference.py's loops; the matmul peak is hardware's
`measure_matmul_flops`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..project import current

# Thresholds: each check FAILs below (or above) its own.
FEED_MIN = 0.9  # job / ceiling: the loader and the loop cost at most 10 % of the step's rate
PLAIN_MIN = 1.0  # job / naive loop: the job's design must not be slower than a student's loop
CEILING_MIN = 0.9  # job / hand-written best-practice loop: the machinery costs at most 10 %
PRECISION_MIN_GAIN = 1.3  # autocast matmul / fp32 (TF32) matmul: the low precision must pay
ACCUM_RTOL = 0.05  # compiled vs eager training loss with --grad-accum 2 (float reordering only)
INSTALL_CUDA = (
    "pip install torch --index-url https://download.pytorch.org/whl/cu128   "
    "(or: uv sync --extra cu128 --extra dev; README, Install)"
)
PASS, FAIL, NOT_CHECKED, INFO = "PASS", "FAIL", "not checked", "info"
RECOMPILE = re.compile(r"^.*Recompiling function.*$", re.MULTILINE)
GRAPH_BREAK = re.compile(r"Graph break", re.IGNORECASE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m labrun.gpucheck", description=__doc__.splitlines()[0]
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
        help="images of the default job's synthetic data (50000: CIFAR-10's size)",
    )
    p.add_argument("--width", type=int, default=64, help="model width (run.py's --width)")
    p.add_argument("--batch-size", type=int, default=128, help="run.py's --batch-size")
    p.add_argument("--stream-size", type=int, default=224, help="streamed case: image size (px)")
    p.add_argument("--stream-model", default="resnet18", help="streamed case: run.py's --model")
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="names of checks to leave out (e.g. stream plain recompiles ddp-compile)",
    )
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds any one run.py job may take"
    )
    return p.parse_args(argv)


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, NOT_CHECKED or INFO
    detail: str


def judged(name: str, ok: bool, detail: str) -> Result:
    return Result(name, PASS if ok else FAIL, detail)


@dataclass
class Context:
    options: argparse.Namespace
    device: object
    work: Path
    log: logging.Logger
    root: Path = field(default_factory=lambda: current().root)  # whose run.py is checked
    runs: int = 0  # jobs started: each gets its own results folder


# --------------------------------------------------------------------------------------------
# run.py's jobs, run as a user runs them


@dataclass
class JobResult:
    code: int
    run_dir: Path | None
    stderr: str

    @property
    def metrics(self) -> dict:
        return json.loads((self.run_dir / "metrics.json").read_text())

    @property
    def log(self) -> str:
        path = self.run_dir / "run.log" if self.run_dir else None
        return path.read_text() if path and path.exists() else ""

    def history(self) -> list[dict]:
        with open(self.run_dir / "history.csv") as f:
            return list(csv.DictReader(f))

    def line(self, prefix: str) -> str:
        """run.log's last line whose message starts with `prefix` ('' if none)."""
        found = re.findall(rf"(?m)\b{re.escape(prefix)}.*$", self.log)
        return found[-1] if found else ""

    def failure(self) -> str:
        lines = [x for x in self.stderr.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error:")]
        return (errors or lines or [f"exit {self.code}"])[-1][:300]


def run_job(
    ctx: Context,
    *flags: str,
    nproc: int = 1,
    env: dict | None = None,
    results: Path | None = None,
    stop_after_epoch: int = 0,
) -> JobResult:
    """run.py with this check's size options and `flags` (torchrun with `nproc` > 1);
    `stop_after_epoch`: SIGTERM once history.csv holds that many epochs."""
    options = ctx.options
    if results is None:
        ctx.runs += 1
        results = ctx.work / f"results{ctx.runs}"
    args = job_args(ctx, results, *flags)
    launcher = []
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    # A job that dies of a signal (once: -11, a streamed 224-px CPU dry run under load) prints
    # its Python stack: the next one names where it happened.
    environ = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    plan = subprocess.run(
        [sys.executable, "run.py", *args, "--print-run-dir"],
        cwd=ctx.root,
        env=environ,
        capture_output=True,
        text=True,
    )
    run_dir = Path(plan.stdout.strip()) if plan.returncode == 0 else None
    proc = subprocess.Popen(
        [sys.executable, *launcher, "run.py", *args],
        cwd=ctx.root,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a stop or a timeout reaches torchrun and its workers
    )
    try:
        if stop_after_epoch and run_dir is not None:
            while proc.poll() is None and _epochs_done(run_dir) < stop_after_epoch:
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=options.timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        err += f"\nerror: gpucheck stopped the job after {options.timeout:.0f} s"
    return JobResult(proc.returncode, run_dir, err + plan.stderr)


def job_args(ctx: Context, results: Path, *flags: str) -> list[str]:
    return [
        *("--device", ctx.device.type, "--tracking", "off", "--progress", "off"),
        *("--width", str(ctx.options.width), "--batch-size", str(ctx.options.batch_size)),
        *("--data-dir", str(ctx.work / "data"), "--results-dir", str(results)),
        *flags,
    ]


def _epochs_done(run_dir: Path) -> int:
    try:
        return max(len((run_dir / "history.csv").read_text().splitlines()) - 1, 0)
    except OSError:
        return 0


def failed(name: str, job: JobResult) -> Result:
    return Result(name, FAIL, f"run.py exited {job.code}: {job.failure()}")


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
    options = argparse.Namespace(width=width, batch_size=batch_size, timeout=3600)
    ctx = Context(options, device, Path(data_dir).parent, logging.getLogger(__name__))
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{Path(results_dir) / 'mlflow.db'}"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op pool size at start-up
    flags = ("--dataset", "synthetic", "--synthetic-size", str(synthetic_size))
    flags += ("--max-steps", str(steps), "--epochs", "1000", "--data-dir", str(data_dir))
    job = run_job(ctx, *flags, *extra_args, env=env, results=Path(results_dir))
    if job.code != 0:
        raise RuntimeError(f"run.py failed ({job.code}):\n{job.stderr[-2000:]}")
    metrics = job.metrics
    if metrics["steps"] != steps:
        raise RuntimeError(f"run.py ran {metrics['steps']} steps, expected {steps}")
    return metrics


# --------------------------------------------------------------------------------------------
# Checks: each takes the Context and returns its Result lines


def check_torch_build(ctx: Context) -> list[Result]:
    import torch

    gpus = nvidia_smi_gpus()
    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    listed = f"nvidia-smi lists {len(gpus)} GPU(s) but {build}"
    if gpus and torch.version.cuda is None:
        why = f"{listed} is a CPU build: install the CUDA build: {INSTALL_CUDA}"
        return [Result("torch build", FAIL, why)]
    if gpus and not torch.cuda.is_available():
        why = f"{listed} sees none (driver older than the build's CUDA, or CUDA_VISIBLE_DEVICES "
        why += "hides them)"
        return [Result("torch build", FAIL, why)]
    if ctx.device.type != "cuda":
        return [Result("torch build", NOT_CHECKED, f"--device cpu ({build})")]
    if not torch.cuda.is_available():
        return [Result("torch build", NOT_CHECKED, f"no CUDA ({build}, no GPU in nvidia-smi)")]
    return [Result("torch build", PASS, f"{build}: {torch.cuda.get_device_name(ctx.device)}")]


def nvidia_smi_gpus() -> list[str]:
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
    from ..hardware import choose_precision, measure_matmul_flops

    dtype, why = choose_precision(ctx.device, "auto")
    if ctx.device.type != "cuda":
        return [Result("precision", NOT_CHECKED, f"no CUDA ({why})")]
    gain = measure_matmul_flops(ctx.device, dtype) / measure_matmul_flops(ctx.device, None)
    detail = f"{why}; its matmul is {gain:.2f}x fp32's (threshold {PRECISION_MIN_GAIN}x)"
    return [judged("precision", gain >= PRECISION_MIN_GAIN, detail)]


def speed_flags(ctx: Context, steps: int) -> tuple[str, ...]:
    size = ("--dataset", "synthetic", "--synthetic-size", str(ctx.options.synthetic_size))
    return (*size, "--max-steps", str(steps), "--epochs", "1000")


def check_default_job(ctx: Context) -> list[Result]:
    import torch

    from .reference import plain_loop_rate, synthetic_split, train_flops_per_sample

    options, device = ctx.options, ctx.device
    job = run_job(ctx, *speed_flags(ctx, options.steps))
    if job.code != 0:
        return [failed("default job", job)]
    rate = job.metrics["samples_per_sec"]
    results = [Result("decision", INFO, f"run.py's {job.line('compile: ') or 'compile: ?'}")]
    if layout := job.line("layout: "):
        results.append(Result("layout choice", INFO, f"run.py's {layout}"))
    split = synthetic_split(max(options.synthetic_size, 8 * options.batch_size))
    if "ceiling" not in options.skip or "plain" not in options.skip:
        results += reference_results(ctx, rate, split)
    if "textbook" not in options.skip:
        textbook = plain_loop_rate(
            split,
            device,
            batch_size=options.batch_size,
            steps=min(options.steps, 100),
            warmup=5,
            tracking_dir=ctx.work,
            width=options.width,
        )
        results.append(
            Result("textbook", INFO, f"job {rate:.0f} vs {textbook:.0f} samples/s = "
                   f"{rate / textbook:.2f}x")
        )  # fmt: skip
    if device.type != "cuda":
        results.append(Result("feed", NOT_CHECKED, "no CUDA: the data already is where it is used"))
    else:
        resident = run_job(ctx, *speed_flags(ctx, options.steps), "--gpu-resident", "on")
        streamed = run_job(ctx, *speed_flags(ctx, options.steps), "--gpu-resident", "off")
        if resident.code or streamed.code:
            results.append(failed("feed", resident if resident.code else streamed))
        else:
            ceiling = resident.metrics["samples_per_sec"]
            results.append(feed_result("feed", streamed.metrics["samples_per_sec"], ceiling))
    from ..hardware import choose_precision, measure_matmul_flops

    dtype, _ = choose_precision(device, "auto")
    flops = train_flops_per_sample(options.width, device)
    peak = measure_matmul_flops(device, dtype)
    results.append(
        Result(
            "MFU",
            INFO,
            f"{rate * flops / 1e12:.3f} TFLOP/s of the job ({flops / 1e9:.2f} GFLOP/sample)"
            f" vs measured matmul peak {peak / 1e12:.1f} TFLOP/s ({dtype or torch.float32}): "
            f"{100 * rate * flops / peak:.1f} %",
        )
    )
    return results


def reference_results(ctx: Context, rate: float, split) -> list[Result]:
    import torch

    from ..hardware import choose_precision
    from . import reference

    options, device = ctx.options, ctx.device
    dtype, _ = choose_precision(device, "auto")
    images, labels = split.images.to(device), split.labels.to(device)
    common = dict(batch_size=options.batch_size, steps=min(options.steps, 200), warmup=10)
    results = []
    if "ceiling" not in options.skip:
        mode = "reduce-overhead" if device.type == "cuda" else None
        torch.manual_seed(0)
        best = reference.best_practice_rate(
            reference.default_model(options.width).to(device), images, labels, dtype=dtype,
            compile_mode=mode, **common,
        )  # fmt: skip
        results.append(reference_result("ceiling", rate, best, CEILING_MIN, mode))
    if "plain" not in options.skip:
        torch.manual_seed(0)
        naive = reference.naive_rate(reference.default_model(options.width).to(device), images,
                                     labels, **common)  # fmt: skip
        results.append(reference_result("plain", rate, naive, PLAIN_MIN, None))
    return results


def reference_result(name: str, job: float, loop: float, threshold: float, mode) -> Result:
    what = {"ceiling": "the best-practice loop", "plain": "the naive loop"}[name]
    if mode:
        what += f" (torch.compile {mode})"
    detail = f"job {job:.0f} vs {what} {loop:.0f} samples/s = {job / loop:.2f}x "
    return judged(name, job >= threshold * loop, detail + f"(threshold {threshold}x)")


def feed_result(name: str, job: float, ceiling: float) -> Result:
    share = job / ceiling
    detail = f"job {job:.0f} of the step's {ceiling:.0f} samples/s = {100 * share:.0f} % "
    return judged(name, share >= FEED_MIN, detail + f"(threshold {100 * FEED_MIN:.0f} %)")


def check_streamed_folder(ctx: Context) -> list[Result]:
    """JPEGs of 500x375 in a temp folder. Each job is run.py's own (a subprocess): no loader of
    this process is reused once its workers are gone."""
    options = ctx.options
    if "stream" in options.skip:
        return []
    steps = max(options.steps // 2, 5)
    per_class = -(-(steps + 2) * options.batch_size // 3) + 1
    folder = write_jpegs(ctx.work / "jpegs", per_class)
    flags = (
        *("--dataset", "folder", "--data-path", str(folder)),
        *("--image-size", str(options.stream_size), "--model", options.stream_model),
        *("--val-fraction", "0.01", "--max-steps", str(steps), "--epochs", "1000"),
    )
    name = f"feed stream {options.stream_size}px"
    streamed = run_job(ctx, *flags, "--data-mode", "stream")
    memory = run_job(ctx, *flags, "--data-mode", "memory")
    if streamed.code or memory.code:
        return [failed(name, streamed if streamed.code else memory)]
    result = feed_result(
        name, streamed.metrics["samples_per_sec"], memory.metrics["samples_per_sec"]
    )
    result.detail += f"; {options.stream_model}, streamed vs decoded in memory"
    result.detail += f"; streamed job's {streamed.line('loader: ')}"  # the decode path, its wait
    return [result]


def write_jpegs(root: Path, per_class: int, size=(500, 375), classes: int = 3) -> Path:
    """root/train/<class>/<i>.jpg and root/test/<class>/0.jpg: smooth random photos-like JPEGs
    (8x8 noise upscaled: sizes on disk like a photo's, not like incompressible noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        for split, count in (("train", per_class), ("test", 2)):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                image = Image.fromarray(small, "RGB").resize(size, Image.Resampling.BICUBIC)
                image.save(folder / f"{i}.jpg", quality=90)
    return root


def recompile_result(name: str, job: JobResult, what: str) -> Result:
    if job.code != 0:
        return failed(name, job)
    text = job.stderr + job.log
    recompiles = RECOMPILE.findall(text)
    breaks = len(GRAPH_BREAK.findall(text))
    if not job.line("compiled") and "compile" not in job.line("compile: "):
        return Result(name, NOT_CHECKED, "run.py did not compile")
    detail = f"{len(recompiles)} recompiles across {what} (threshold 0); {breaks} graph breaks"
    if recompiles:
        detail += f": {recompiles[0].strip()[:160]}"
    return judged(name, not recompiles, detail)


COMPILE_LOGS = {"TORCH_LOGS": "recompiles,graph_breaks"}


def small_flags(ctx: Context, epochs: int = 2) -> tuple[str, ...]:
    size = str(max(40 * ctx.options.batch_size, 400))
    return ("--dataset", "synthetic", "--synthetic-size", size, "--epochs", str(epochs))


def check_recompiles(ctx: Context) -> list[Result]:
    if "recompiles" in ctx.options.skip:
        return []
    results, flags = ctx.work / "recompiles", (*small_flags(ctx), "--compile", "on")
    first = run_job(ctx, *flags, env=COMPILE_LOGS, results=results, stop_after_epoch=1)
    if first.code not in (0, 75):
        return [failed("recompiles", first)]
    resumed = run_job(ctx, *flags, env=COMPILE_LOGS, results=results)  # from the checkpoint
    both = JobResult(resumed.code, resumed.run_dir, first.stderr + resumed.stderr)
    return [recompile_result("recompiles", both, "train, evaluation, checkpoint, resume")]


def check_ddp_compile(ctx: Context) -> list[Result]:
    import torch

    if "ddp-compile" in ctx.options.skip:
        return []
    if ctx.device.type == "cuda" and torch.cuda.device_count() < 2:
        return [Result("ddp compile", NOT_CHECKED, "1 GPU: needs 2")]
    job = run_job(ctx, *small_flags(ctx), "--compile", "on", nproc=2, env=COMPILE_LOGS)
    return [recompile_result("ddp compile", job, "2 ranks' training and evaluation")]


# torch's cudagraphs log (inductor's scheduler and cudagraph_trees, torch 2.11-2.13)
PARTITIONS = re.compile(r"Created (\d+) graph partitions: (\d+) cudagraphable, (\d+) non-cud")
RECORDED = re.compile(r"Recording function=\S+, mode=(\w+)")
RECORDED_BEFORE = re.compile(r"Recording function \d+ of graph recording id")  # no mode named
RERECORDED = re.compile(r"Re-recording function=\S+, mode=\w+, reason=(.*)$", re.MULTILINE)
SKIPPED = re.compile(r"skipping cudagraphs due to (.*)$", re.MULTILINE)
REASON = re.compile(r"reason=([a-zA-Z -]+),")


def check_graphs(ctx: Context) -> list[Result]:
    if "graphs" in ctx.options.skip:
        return []
    if ctx.device.type != "cuda":
        return [Result("graphs", NOT_CHECKED, "skipped: no GPU (CUDA graphs need one)")]
    flags = (*small_flags(ctx, 1), "--seed", "3")  # one epoch: measure.sh's lease is short
    job = run_job(ctx, *flags, "--compile", "reduce-overhead", env={"TORCH_LOGS": "cudagraphs"})
    eager = run_job(ctx, *flags, "--compile", "off")  # the same steps' numbers, eager
    if job.code or eager.code:
        return [failed("graphs", job if job.code else eager)]
    numbers = accumulation_result(job, eager, name="graphs = eager", what="reduce-overhead")
    return [graphs_result(job.stderr + job.log), numbers]


def graphs_result(text: str) -> Result:
    """The `graphs` verdict from a run's TORCH_LOGS=cudagraphs output."""
    partitions = [tuple(map(int, found)) for found in PARTITIONS.findall(text)]
    graphable = sum(p[1] for p in partitions)
    outside = sum(p[2] for p in partitions)
    recorded, unnamed = RECORDED.findall(text), len(RECORDED_BEFORE.findall(text))
    modes = {mode.lower() for mode in recorded}
    if unnamed >= 2 and not recorded:  # an older torch's log: forward and backward, unnamed
        modes = {"forward", "backward"}
    detail = (
        f"{len(recorded) + unnamed} CUDA graphs recorded ({', '.join(sorted(modes)) or 'none'}); "
        f"partitions: {graphable} cudagraphable, {outside} not (threshold 0)"
    )
    problems = []
    if outside:
        reasons = sorted(set(REASON.findall(text)))
        problems.append(f"non-cudagraphable nodes ({', '.join(reasons) or 'reason not logged'})")
    if skipped := SKIPPED.findall(text):
        problems.append(f"{len(skipped)} graphs skipped: {skipped[0].strip()[:120]}")
    if rerecorded := RERECORDED.findall(text):
        problems.append(f"{len(rerecorded)} re-recordings: {rerecorded[0].strip()[:120]}")
    if not {"forward", "backward"} <= modes:
        problems.append(
            "no graph recorded for "
            + " and ".join(m for m in ("forward", "backward") if m not in modes)
        )
    if problems:
        return Result("graphs", FAIL, f"{detail}; {'; '.join(problems)}")
    return Result("graphs", PASS, detail)


def check_accumulation(ctx: Context) -> list[Result]:
    """CUDA graphs must not overwrite the accumulated gradients."""
    if ctx.device.type != "cuda":
        return [Result("accum", NOT_CHECKED, "no CUDA (no CUDA graphs)")]
    flags = (*small_flags(ctx, 2), "--grad-accum", "2", "--seed", "3")
    compiled = run_job(ctx, *flags, "--compile", "on")
    eager = run_job(ctx, *flags, "--compile", "off")
    if compiled.code or eager.code:
        return [failed("accum", compiled if compiled.code else eager)]
    return [accumulation_result(compiled, eager)]


def accumulation_result(
    compiled: JobResult, eager: JobResult, name: str = "accum", what: str = "--grad-accum 2"
) -> Result:
    a = [float(r["train_loss"]) for r in compiled.history()]
    b = [float(r["train_loss"]) for r in eager.history()]
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
    mode = compiled.line("compile: ") or "compile: ?"
    detail = f"{what}, run.py's {mode[:80]}: train loss {a[-1]:.4g} vs eager {b[-1]:.4g}, "
    detail += f"largest difference {100 * worst:.1f} % (threshold {100 * ACCUM_RTOL:.0f} %)"
    return judged(name, worst <= ACCUM_RTOL, detail)


def check_sync(ctx: Context) -> list[Result]:
    if ctx.device.type != "cuda":
        return [Result("sync", NOT_CHECKED, "no CUDA")]
    import torch

    from ..jobs import EXIT_OK

    run = run_module(ctx.root)
    args = job_args(ctx, ctx.work / "sync", *speed_flags(ctx, 20))
    seen = sync_points(lambda: run.main(args), torch, EXIT_OK)
    return [sync_result(seen)]


def sync_points(call: Callable[[], int], torch, ok: int) -> list[str]:
    """The stack of each synchronizing CUDA call `call()` makes inside run.py's step."""
    import traceback
    import warnings

    found: list[str] = []
    show = warnings.showwarning

    def record(message, *args, **kwargs):
        if "synchroniz" in str(message):
            stack = traceback.extract_stack()
            if any(Path(f.filename).name == "run.py" and "step" in f.name for f in stack):
                found.append(str(message).splitlines()[0])

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            code = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = show
    if code != ok:
        found.append(f"run.py exited {code}")
    return found


def sync_result(found: list[str]) -> Result:
    if found:
        return Result("sync", FAIL, f"{len(found)} host syncs in the step: {found[0][:160]}")
    return Result("sync", PASS, "0 host syncs inside run.py's step (threshold 0)")


def check_layout(ctx: Context) -> list[Result]:
    import torch
    from torch import nn

    from .reference import default_model

    if ctx.device.type != "cuda":
        return [Result("layout", NOT_CHECKED, "CPU: measured per machine (run.log's layout)")]
    model = default_model(ctx.options.width).to(ctx.device, memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32, device=ctx.device).contiguous(memory_format=torch.channels_last)
    outputs = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x)
    for hook in hooks:
        hook.remove()
    good = sum(o.is_contiguous(memory_format=torch.channels_last) for o in outputs)
    detail = f"{good}/{len(outputs)} conv outputs channels_last"
    return [judged("layout", good == len(outputs), detail)]


def check_resume(ctx: Context) -> list[Result]:
    flags = (*small_flags(ctx, 2), "--deterministic", "--checkpoint-every", "0")
    straight = run_job(ctx, *flags)
    results = ctx.work / "resumed"
    stopped = run_job(ctx, *flags, results=results, stop_after_epoch=1)
    if straight.code:
        return [failed("resume", straight)]
    if stopped.code not in (0, 75):
        return [failed("resume", stopped)]
    resumed = run_job(ctx, *flags, results=results)
    if resumed.code:
        return [failed("resume", resumed)]
    return [resume_result(straight, resumed, interrupted=stopped.code == 75)]


def resume_result(straight: JobResult, resumed: JobResult, *, interrupted: bool) -> Result:
    timing = ("epoch_time_s", "samples_per_sec")
    a = [{k: v for k, v in r.items() if k not in timing} for r in straight.history()]
    b = [{k: v for k, v in r.items() if k not in timing} for r in resumed.history()]
    how = "stopped after epoch 1 and resumed" if interrupted else "ended before the stop"
    detail = f"{len(a)} epochs straight vs {how}: " + ("equal histories" if a == b else "differ")
    return judged("resume", a == b, detail)


def check_ddp(ctx: Context) -> list[Result]:
    import torch

    from .ddpscaling import check_scaling

    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if gpus < 2:
        return [Result("ddp", NOT_CHECKED, f"{gpus} GPU(s): needs 2 or more")]
    ok, detail = check_scaling(
        "cuda", gpus, batch=ctx.options.batch_size, steps=ctx.options.steps, width=ctx.options.width
    )
    return [judged("ddp", ok, detail)]


def run_module(root: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_checked", root / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The checks, in order. A new claim appends its function.
CHECKS: list[Callable[[Context], list[Result]]] = [
    check_torch_build,
    check_precision,
    check_default_job,
    check_sync,
    check_streamed_folder,
    check_recompiles,
    check_ddp_compile,
    check_graphs,
    check_accumulation,
    check_layout,
    check_resume,
    check_ddp,
]


def main(argv=None) -> int:
    options = parse_args(argv)
    import torch

    device = torch.device(options.device)
    cuda_missing = device.type == "cuda" and not torch.cuda.is_available()
    log = logging.getLogger("labrun.gpucheck")
    with tempfile.TemporaryDirectory(prefix="gpucheck_") as work:
        ctx = Context(options, device, Path(work), log)
        print(f"gpucheck on {options.device}, torch {torch.__version__}, {ctx.root / 'run.py'}")
        results: list[Result] = []
        for check in CHECKS:
            name = check.__name__.removeprefix("check_").replace("_", " ")
            if cuda_missing and check is not check_torch_build:
                results.append(Result(name, NOT_CHECKED, "no CUDA"))
                continue
            print(f"  running {check.__name__} ...", file=sys.stderr, flush=True)
            try:
                results.extend(check(ctx))
            except Exception as exc:  # a check that breaks is a FAIL of its own, not a crash
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                results.append(Result(name, FAIL, f"{type(exc).__name__}: {first}"))
    print()
    column = max(len(r.name) for r in results)
    for r in results:
        print(r.name.ljust(column), r.status.ljust(len(NOT_CHECKED)), r.detail, sep="  ")
    failed_ = [r.name for r in results if r.status == FAIL]
    unchecked = [r.name for r in results if r.status == NOT_CHECKED]
    if failed_:
        print(f"FAILED: {', '.join(failed_)}")
    else:
        print("no check failed" + f"; not checked here: {', '.join(unchecked)}" * bool(unchecked))
    return 1 if failed_ else 0


if __name__ == "__main__":
    sys.exit(main())
