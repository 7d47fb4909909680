"""One job on two processes (torchrun + DDP, gloo on CPU): what a step costs against one process.

Renders the template, then times the default model's training step (run.py's step, random
images already in memory, no data loading, in the precision run.py picks) with labrun's
`tools.ddpscaling.measure_step`, the function `gpucheck`'s DDP check runs:
  one, B      one process, the global batch B
  two, B/2    torchrun, 2 processes, B/2 each: the same run (`--batch-size B`) on two processes
  one, B/2    one process, B/2: the work one rank of the 2-process run does
Overhead per step = two(B/2) - one(B/2): the gradient all-reduce, the buffer broadcast and the
two processes sharing the machine. Each setting runs `--repeats` times, interleaved; the best
(least disturbed) is reported. Every process uses one thread (OMP_NUM_THREADS=1).

Usage (template repo root, an environment with the project's dependencies + cookiecutter):
    python benchmarks/bench_ddp.py --steps 20 --repeats 3
Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64, help="global batch B")
    p.add_argument("--width", type=int, default=16, help="model width")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per setting")
    return p.parse_args(argv)


def render(out_dir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE_ROOT), "-o", out_dir],
        check=True,
        capture_output=True,
    )
    return next(p for p in out_dir.iterdir() if p.is_dir())


def step_ms(project: Path, nproc: int, batch: int, args, work: Path) -> float:
    out = work / f"{nproc}-{batch}.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [
        sys.executable,
        *(launcher if nproc > 1 else []),
        "-m",
        "labrun.tools.ddpscaling",  # measure_step: run.py's step (precision, layout), no data
        "cpu",
        str(batch),
        str(args.steps),
        str(args.width),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LABRUN_PROJECT": str(project)}
    subprocess.run(cmd, cwd=project, env=env, check=True, capture_output=True)
    return 1000 * json.loads(out.read_text())["step_s"]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    b = args.batch_size
    settings = {"one, B": (1, b), "two, B/2": (2, b // 2), "one, B/2": (1, b // 2)}
    best = {name: float("inf") for name in settings}
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as work:
        project = render(Path(work))
        for _ in range(args.repeats):
            for name, (nproc, batch) in settings.items():
                best[name] = min(best[name], step_ms(project, nproc, batch, args, Path(work)))
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}, "
        f"python {platform.python_version()}; model cnn width {args.width}, B = {b}, "
        f"{args.steps} timed steps, best of {args.repeats}\n"
    )
    print("| setting | processes x batch | ms per step |")
    print("|---|---|---|")
    for name, (nproc, batch) in settings.items():
        print(f"| {name} | {nproc} x {batch} | {best[name]:.1f} |")
    overhead = best["two, B/2"] - best["one, B/2"]
    print(
        f"\noverhead per step of the second process: {overhead:.1f} ms "
        f"({100 * overhead / best['one, B/2']:.0f} % of one rank's step); "
        f"the same run (B) on two processes: {best['one, B'] / best['two, B/2']:.2f}x "
        "the speed of one"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
