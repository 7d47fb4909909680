"""Prove the GPU claims on the machine at hand: `python -m {{ cookiecutter.package_name }}.gpucheck`.

Trains the default model for a few hundred steps on synthetic data and reports, with exit status
0 (every check passed) or 1 (one failed):
  sync        no host sync inside the training step (`torch.cuda.set_sync_debug_mode("error")`
              around the steps: any blocking device->host copy raises)
  recompiles  none across train, eval, checkpoint (state_dict + torch.save) and resume
              (load_state_dict) after the first step (torch._dynamo counters, and
              `error_on_recompile`)
  layout      every conv activation is channels_last
  resume      exact: with --deterministic, k steps + checkpoint + resume in a fresh Trainer + k
              steps gives bitwise the weights of 2k straight steps (the data loader included)
  precision   the chosen autocast dtype and why (hardware.choose_precision)
  speed       samples/s of the job (run.py in a subprocess), of the plain loop and of the
              pure-compute step; achieved TFLOP/s of the job against this device's measured
              matmul peak in the same precision (MFU)
Without CUDA it says so and exits 0 without claiming anything. `--device cpu` runs the same
checks on the CPU (no sync check there): a way to test this script without a GPU.
The lab template's benchmarks/bench_train.py imports the measuring functions below
(`plain_loop_rate`, `ceiling_rate`, `job_rate`, `train_flops_per_sample`, `matmul_peak`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m {{ cookiecutter.package_name }}.gpucheck", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: the checks this script exists for; cpu: a dry run of the code",
    )
    p.add_argument("--steps", type=int, default=300, help="timed steps of each speed measurement")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="default: the device's rule (hardware.default_batch_size)",
    )
    p.add_argument("--width", type=int, default=64, help="model width (run.py's --width)")
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="on",
        help="compile policy checked (on: the mode a long run gets)",
    )
    p.add_argument("--skip-job", action="store_true", help="do not run run.py (speed of the job)")
    return p.parse_args(argv)


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
    compile_flag: str = "auto",
    deterministic: bool = False,
    grad_accum: int = 1,
):
    """The job's model and Trainer with the job's own policy choices (hardware.py)."""
    import torch

    from . import hardware, train
    from .model import build_model

    model = build_model(10, width).to(device, memory_format=torch.channels_last)
    lr = hardware.default_lr(batch_size)
    optimizer = train.build_optimizer(model, lr, 5e-4, device)
    scheduler = train.build_scheduler(optimizer, lr, total_steps)
    dtype, _ = hardware.choose_precision(device, "auto")
    mode, _ = hardware.choose_compile(device, compile_flag, total_steps, deterministic)
    return train.Trainer(
        model,
        optimizer,
        scheduler,
        device=device,
        dtype=dtype,
        grad_accum=grad_accum,
        compile_mode=mode,
    )


def warm_up(trainer, batch) -> float:
    """The explicit compile warm-up; returns its seconds (0 when eager)."""
    from .hardware import timed

    now = timed(trainer.device)
    start = now()
    trainer.warm_up(*batch)
    return now() - start


def ceiling_rate(trainer, batches: list, steps: int, warmup: int) -> float:
    """samples/s of the job's step alone, on batches already on the device."""
    for i in range(warmup):
        trainer.step([batches[i % len(batches)]], i + 1)
    synchronize(trainer.device)
    start = time.perf_counter()
    for i in range(steps):
        trainer.step([batches[i % len(batches)]], warmup + i + 1)
    synchronize(trainer.device)
    return steps * batches[0][1].shape[0] / (time.perf_counter() - start)


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
    from .model import build_model

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
    model = build_model(10, width).to(device)
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

    from .model import build_model

    model = build_model(10, width).to(device)
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
# Checks


def check_no_sync(trainer, batches: list, steps: int) -> tuple[bool, str]:
    import torch

    if trainer.device.type != "cuda":
        return True, "n/a on CPU"
    synchronize(trainer.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(steps):
            trainer.step([batches[i % len(batches)]], 1000 + i)
    except RuntimeError as exc:
        return False, f"host sync inside the step: {str(exc).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return True, f"{steps} steps under set_sync_debug_mode('error')"


def check_no_recompiles(trainer, batches: list, eval_loader) -> tuple[bool, str]:
    import torch
    import torch._dynamo

    from .train import evaluate

    if not trainer.compiled:
        return True, "n/a: eager"
    counters = torch._dynamo.utils.counters
    graphs_before = counters["stats"]["unique_graphs"]
    torch._dynamo.config.error_on_recompile = True
    try:
        trainer.step([batches[0]], 2000)
        evaluate(trainer.model, eval_loader, device=trainer.device, dtype=trainer.dtype)
        buffer = io.BytesIO()
        torch.save(trainer.state_dict(), buffer)  # checkpoint
        buffer.seek(0)
        trainer.load_state_dict(torch.load(buffer, weights_only=True))  # resume
        for i in range(3):
            trainer.step([batches[(i + 1) % len(batches)]], 2001 + i)
        synchronize(trainer.device)
    except Exception as exc:  # RecompileError, or what recompiling broke
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        torch._dynamo.config.error_on_recompile = False
    new_graphs = counters["stats"]["unique_graphs"] - graphs_before
    return new_graphs == 0, f"{new_graphs} new graphs across train, eval, checkpoint, resume"


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
        trainer = build_trainer(
            device,
            batch_size=batch_size,
            total_steps=steps,
            width=width,
            compile_flag="off",
            deterministic=True,
        )
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
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpucheck: no CUDA device visible (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}): nothing checked"
        )
        return 0
    from . import hardware
    from .data import build_loader

    device = torch.device(args.device)
    hardware.setup_backends(device, deterministic=False)
    batch_size = args.batch_size or hardware.default_batch_size(device)
    dtype, precision_why = hardware.choose_precision(device, "auto")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"gpucheck on {name}, torch {torch.__version__}, batch {batch_size}, "
        f"width {args.width}, {args.steps} timed steps"
    )
    results: list[tuple[str, bool, str]] = [("precision", True, precision_why)]

    split = synthetic_split(max(20 * batch_size, 4096))
    loader = build_loader(split, batch_size, train=True, device=device, seed=0)
    eval_loader = build_loader(
        synthetic_split(2 * batch_size, seed=1), batch_size, train=False, device=device, seed=0
    )
    batches = [b for _, b in zip(range(8), loader, strict=False)]
    total = 10 * args.steps
    trainer = build_trainer(
        device,
        batch_size=batch_size,
        total_steps=total,
        width=args.width,
        compile_flag=args.compile,
    )
    compile_s = warm_up(trainer, batches[0])
    mode, compile_why = hardware.choose_compile(device, args.compile, total)
    fell_back = mode is not None and not trainer.compiled
    results.append(
        (
            "compile",
            not fell_back,
            f"{compile_why}; warm-up {compile_s:.1f} s"
            + (" (compiling FAILED: eager)" if fell_back else ""),
        )
    )
    ceiling = ceiling_rate(trainer, batches, args.steps, warmup=5)
    results.append(("sync", *check_no_sync(trainer, batches, min(args.steps, 50))))
    results.append(("recompiles", *check_no_recompiles(trainer, batches, eval_loader)))
    results.append(("layout", *check_channels_last(trainer, batches[0])))

    with tempfile.TemporaryDirectory(prefix="gpucheck_") as work:
        work = Path(work)
        plain = plain_loop_rate(
            split,
            device,
            batch_size=batch_size,
            steps=min(args.steps, 100),
            warmup=5,
            tracking_dir=work,
            width=args.width,
        )
        job = None
        if not args.skip_job:
            metrics = job_rate(
                device,
                batch_size=batch_size,
                steps=args.steps,
                synthetic_size=len(split),
                data_dir=work / "data",
                results_dir=work / "results",
                width=args.width,
                extra_args=("--compile", args.compile),
            )
            job = metrics["samples_per_sec"]
    flops = train_flops_per_sample(args.width, device)
    peak = matmul_peak(device, dtype)
    rate = job or ceiling
    mfu = rate * flops / peak
    ratios = (
        f"job {job:.0f}, plain {plain:.0f}, ceiling {ceiling:.0f} samples/s; job/plain "
        f"{job / plain:.2f}x, job/ceiling {100 * job / ceiling:.0f} %"
        if job
        else f"job skipped, plain {plain:.0f}, ceiling {ceiling:.0f} samples/s"
    )
    results.append(("speed", True, ratios))
    results.append(
        (
            "MFU",
            True,
            f"{rate * flops / 1e12:.2f} TFLOP/s of {'job' if job else 'ceiling'} "
            f"({flops / 1e9:.2f} GFLOP/sample) vs measured matmul peak "
            f"{peak / 1e12:.1f} TFLOP/s ({dtype or torch.float32}): MFU {100 * mfu:.1f} %",
        )
    )
    # Last: it switches the process to deterministic kernels.
    results.append(
        (
            "resume",
            *check_exact_resume(device, split, batch_size=min(batch_size, 64), width=args.width),
        )
    )

    column = max(len(n) for n, _, _ in results)
    for check, ok, detail in results:
        print(check.ljust(column), "PASS" if ok else "FAIL", detail, sep="  ")
    failed = [n for n, ok, _ in results if not ok]
    print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
