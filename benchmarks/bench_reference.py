"""The job against the hand-written references (issue 33.5), on this machine's device.

    .venv/bin/python benchmarks/bench_reference.py --threads 1 --steps 30 --repeats 2  # CPU
    .venv/bin/python benchmarks/bench_reference.py --device cuda --steps 300           # a GPU

On the same model (the default, --width), batch, synthetic CIFAR-shaped data and precision:
  job            the generated run.py (a subprocess, --tracking off): its metrics.json
                 samples_per_sec (the step loop only: start-up, compile, eval excluded)
  best practice  labrun.tools.reference.best_practice_rate: data and crop + flip on the device,
                 channels_last, fused AdamW, no host sync; on CUDA also with torch.compile
                 reduce-overhead (CUDA graphs)
  naive          labrun.tools.reference.naive_rate: fp32, eager, data on the device, loss.item()
  textbook       reference.plain_loop_rate: per-sample augmentation on the CPU, MLflow per step
Interleaved, --repeats rounds, the best of each reported (the least disturbed by other load).
Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per variant")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch starts its pool
    import torch
    from labrun.hardware import choose_precision, device_name
    from labrun.tools import gpucheck, reference

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype, _ = choose_precision(device, "auto")
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o",
                        tmp], check=True, capture_output=True)  # fmt: skip
        project = Path(tmp) / "lab_project"
        os.environ["LABRUN_PROJECT"] = str(project)  # the project's models, as run.py finds them
        sys.path.insert(0, str(project))
        split = reference.synthetic_split(10_000)
        images, labels = split.images.to(device), split.labels.to(device)
        common = dict(batch_size=args.batch_size, steps=args.steps, warmup=5)
        modes = [None, "reduce-overhead"] if device.type == "cuda" else [None]
        for i in range(args.repeats):
            metrics = gpucheck.job_rate(
                device, batch_size=args.batch_size, steps=args.steps, synthetic_size=10_000,
                data_dir=Path(tmp) / "data", results_dir=Path(tmp) / f"r{i}",
                extra_args=("--tracking", "off", "--progress", "off"), threads=args.threads,
                width=args.width,
            )  # fmt: skip
            rates.setdefault("job (run.py)", []).append(metrics["samples_per_sec"])
            for mode in modes:
                torch.manual_seed(0)
                name = "best practice" + (f", torch.compile {mode}" if mode else ", eager")
                rates.setdefault(name, []).append(reference.best_practice_rate(
                    reference.default_model(args.width).to(device), images, labels,
                    dtype=dtype, compile_mode=mode, **common))  # fmt: skip
            torch.manual_seed(0)
            naive = reference.default_model(args.width).to(device)
            rates.setdefault("naive, data on the device", []).append(
                reference.naive_rate(naive, images, labels, **common))  # fmt: skip
            rates.setdefault("textbook (per-sample CPU augmentation, MLflow)", []).append(
                reference.plain_loop_rate(split, device, tracking_dir=Path(tmp),
                                          width=args.width, **common))  # fmt: skip
    job = max(rates["job (run.py)"])
    print(f"- {device_name(device)} ({platform.processor() or platform.machine()}); torch "
          f"{torch.__version__}; precision {dtype or 'fp32'}; batch {args.batch_size}, width "
          f"{args.width}, {args.steps} steps; {time.strftime('%Y-%m-%d')}; load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print("\n| variant | samples/s (best) | all | job / variant |\n|---|---:|---|---:|")
    for name, values in rates.items():
        listed = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {max(values):.0f} | {listed} | {job / max(values):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
