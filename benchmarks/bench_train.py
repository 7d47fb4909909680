"""Training throughput: the generated job vs a naive loop vs the pure-compute ceiling, and the
achieved FLOP/s against the device's measured matmul peak.

One invocation measures, on the same model (`build_model()`), the same synthetic data, batch size
and number of timed steps:
  (a) job      the generated `run.py --dataset synthetic --max-steps N` in a subprocess; its own
               `metrics.json` `samples_per_sec` (step loop only: compile warm-up, eval,
               checkpoints and start-up excluded)
  (b) plain    the textbook loop: fp32, NCHW, DataLoader with num_workers=0 over a Dataset that
               converts and augments one sample at a time, `loss.item()` and a synchronous
               `mlflow.log_metric` every step, no compile
  (c) ceiling  the job's own training step (run.py's `step`, reached with
               labrun.tools.tuning.capture_step: same precision, layout and compile choice) on
               batches already on the device: nothing but compute
(a) and (b) come from labrun's `gpucheck` and `reference` tools (`job_rate`, `plain_loop_rate`),
the code `python -m labrun.gpucheck` runs on a GPU. (b) and (c) run in this
process after `--warmup` untimed steps; the device is synchronised before the clock stops. Each
variant runs `--repeats` times, interleaved, and the best run is reported (the least disturbed by
other load on the machine). Achieved GFLOP/s = samples/s x training FLOPs per sample
(FlopCounterMode: convolutions and matmuls); peak = best time of a large square matmul in the
step's precision, measured here.

Usage (template repo root, an environment with the project's dependencies + cookiecutter):
    python benchmarks/bench_train.py --threads 1 --steps 10 --repeats 2   # CPU, shared machine
    python benchmarks/bench_train.py --device cuda --steps 300
Prints a markdown table for benchmarks/RESULTS.md and whether each target is met.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE_ROOT = Path(__file__).resolve().parent.parent
# Targets from the issue: job/plain speed-up and the job's distance from the ceiling.
TARGET_SPEEDUP = {"cpu": 1.5, "cuda": 3.0}
TARGET_OF_CEILING = 0.90


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device to train on")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per variant")
    p.add_argument("--batch-size", type=int, default=0,
                   help="batch size of every variant (0: the device's recommendation, "
                        "tools.tuning.recommended_batch_size: 128 CPU / 512 CUDA)")
    p.add_argument("--width", type=int, default=64, help="model width (run.py --width)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="compile policy of (a); (c) compiles in mode default with 'on' and "
                        "stays eager otherwise (auto: run.py's measured decision in (a))")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before (b) and (c) (the job excludes compile itself)")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant; the best is kept")
    p.add_argument("--synthetic-size", type=int, default=10_000,
                   help="training images of the synthetic dataset")
    p.add_argument("--job-args", default="",
                   help="extra run.py arguments for (a), e.g. '--compile on'")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads for all three (0: torch's default). 1 gives stable "
                        "ratios on a machine whose cores other processes share")
    p.add_argument("--keep", action="store_true", help="keep the rendered project (path printed)")
    return p.parse_args(argv)


def render_project(out_dir: Path) -> Path:
    """Render the template with its defaults; the hooks' messages are kept off our stdout."""
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE_ROOT),
         "-o", str(out_dir)],
        check=True, capture_output=True,
    )
    (project,) = [p for p in out_dir.iterdir() if p.is_dir()]
    return project


def load_run_py(project: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_bench", project / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{model}, {cores} cores ({capability}), {torch.get_num_threads()} torch threads"


def import_package(project: Path):
    """labrun as the rendered project uses it (its models and datasets found through
    LABRUN_PROJECT), with the modules the benchmarks call imported: (labrun, "labrun")."""
    import importlib

    os.environ["LABRUN_PROJECT"] = str(project)
    sys.path.insert(0, str(project))
    for module in ("config", "data", "loaders", "hardware", "train", "models", "tools.gpucheck",
                   "tools.reference", "tools.tuning"):
        importlib.import_module(f"labrun.{module}")
    return importlib.import_module("labrun"), "labrun"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    project = render_project(work)
    pkg, package = import_package(project)
    data_dir, results_dir = work / "data", work / "results"
    results_dir.mkdir()
    # Same cached file for all three: the job reads what this process generated.
    splits = pkg.data.load_dataset("synthetic", data_dir, synthetic_size=args.synthetic_size).splits
    split = splits["train"]

    check, reference = pkg.tools.gpucheck, pkg.tools.reference
    if not args.batch_size:
        args.batch_size = pkg.tools.tuning.recommended_batch_size(device)
    loader = pkg.loaders.Loader(split, args.batch_size, train=True, device=device)
    batches = [batch for _, batch in zip(range(8), loader, strict=False)]

    def job() -> float:
        metrics = check.job_rate(
            device, batch_size=args.batch_size, steps=args.steps,
            synthetic_size=args.synthetic_size, data_dir=data_dir, results_dir=results_dir,
            extra_args=("--compile", args.compile, *shlex.split(args.job_args)),
            threads=args.threads, width=args.width)
        return metrics["samples_per_sec"]

    run_py = load_run_py(project)
    ceiling_argv = [
        "--dataset", "synthetic", "--synthetic-size", str(args.synthetic_size),
        "--device", device.type, "--batch-size", str(args.batch_size), "--width", str(args.width),
        "--compile", "on" if args.compile == "on" else "off", "--tracking", "off",
        "--data-dir", str(data_dir), "--results-dir", str(results_dir / "ceiling"),
    ]  # fmt: skip

    def ceiling() -> float:
        """The job's own step (run.py's, via capture_step: same precision, layout and compile
        choice) on batches already on the device: nothing but compute."""
        from labrun.tools.reference import timed_rate
        from labrun.tools.tuning import capture_step

        torch.manual_seed(0)
        captured = capture_step(run_py, ceiling_argv)
        return timed_rate(lambda i: captured.step([batches[i % len(batches)]]),
                          warmup=args.warmup, steps=args.steps, batch_size=args.batch_size,
                          device=device)

    runners = {
        "job": job,
        "plain": lambda: reference.plain_loop_rate(split, device, batch_size=args.batch_size,
                                                   steps=args.steps, warmup=args.warmup,
                                                   tracking_dir=results_dir, width=args.width),
        "ceiling": ceiling,
    }
    dtype, _ = pkg.hardware.choose_precision(device, "auto")
    peaks: list[float] = []  # measured in every round too: the machine's load changes
    runs: dict[str, list[float]] = {name: [] for name in runners}
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats):
        for name, runner in runners.items():
            runs[name].append(runner())
            print(f"  repeat {repeat + 1}/{args.repeats} {name:8s} {runs[name][-1]:8.1f} samples/s",
                  file=sys.stderr, flush=True)
        peaks.append(pkg.hardware.measure_matmul_flops(device, dtype))
    best = {name: max(values) for name, values in runs.items()}
    flops_per_sample = reference.train_flops_per_sample(args.width, device)
    peak = max(peaks)

    speedup = best["job"] / best["plain"]
    of_ceiling = best["job"] / best["ceiling"]
    target = TARGET_SPEEDUP[device.type]
    labels = {"job": "(a) generated job", "plain": "(b) plain loop", "ceiling": "(c) ceiling"}
    lines = [
        f"- device: {device_name(device)}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, "
        f"{datetime.date.today().isoformat()}",
        f"- batch {args.batch_size}, {args.steps} timed steps, {args.warmup} warm-up steps for "
        f"(b)/(c), best of {args.repeats}, synthetic data ({args.synthetic_size} images)",
        f"- command: `python benchmarks/bench_train.py {' '.join(argv or sys.argv[1:])}`".rstrip(),
        f"- load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
        f"(other processes on the machine share its cores)",
        f"- training FLOPs per sample {flops_per_sample / 1e9:.3f} G (FlopCounterMode); measured "
        f"matmul peak ({dtype or torch.float32}, best of each round's 10) {peak / 1e9:.1f} GFLOP/s "
        f"(rounds: {', '.join(f'{p / 1e9:.1f}' for p in peaks)})",
        "",
        "| variant | samples/s | ms/step | vs plain | % of ceiling | GFLOP/s | % of peak "
        "| all runs (samples/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in ("job", "plain", "ceiling"):
        rate = best[name]
        lines.append(
            f"| {labels[name]} | {rate:.1f} | {1000 * args.batch_size / rate:.1f} | "
            f"{rate / best['plain']:.2f}x | {100 * rate / best['ceiling']:.1f} % | "
            f"{rate * flops_per_sample / 1e9:.1f} | {100 * rate * flops_per_sample / peak:.1f} % | "
            f"{', '.join(f'{v:.1f}' for v in runs[name])} |"
        )
    # The job runs the ceiling's step plus a data pipeline, so it cannot be clearly faster than
    # it: if it is, the machine's load changed between runs and no verdict is possible.
    valid = of_ceiling <= 1 / TARGET_OF_CEILING

    def verdict(ok: bool) -> str:
        return ("met" if ok else "NOT met") if valid else "not assessable (see warning)"

    lines += [
        "",
        f"- job vs plain: {speedup:.2f}x, target >= {target}x: {verdict(speedup >= target)}",
        f"- job vs ceiling: {100 * of_ceiling:.1f} %, target >= {100 * TARGET_OF_CEILING:.0f} %: "
        f"{verdict(of_ceiling >= TARGET_OF_CEILING)}",
    ]
    if not valid:
        excess = 100 * of_ceiling - 100
        lines.append(f"- WARNING: the job beat its own compute ceiling by {excess:.0f} %: the "
                     "machine's load changed between runs; these numbers are not valid, rerun "
                     "on a quiet machine (or with --threads 1)")
    print("\n".join(lines))
    if args.keep:
        print(f"\nrendered project kept in {project}", file=sys.stderr)
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
