"""What the compile decision costs, and what the project's inductor cache saves, on this machine.

(1) decision: run.py's warm_up, before compiling, peeks a real batch from the loader
    (train.peek_batch) and times forward + backward on it (hardware.time_forward_backward: one
    untimed pass + 3 timed ones). That is what --compile on (and auto on CUDA) pays before it
    decides; compared with one optimizer step of the same job. --compile auto on CPU decides
    without measuring: hardware.choose_compile's own time is reported too.
(2) cache: `run.py --compile on` twice in the same rendered project, each a fresh process with
    --fresh: the first compiles into the project's empty .cache/inductor, the second reads it.
    compile_time_s from metrics.json (the warm-up pass: compile + one forward + backward).

Usage (template repo root, an environment with the project's dependencies + cookiecutter):
    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py --repeats 5
Prints markdown rows for benchmarks/RESULTS.md ("Compile decision and inductor cache").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import device_name, import_package, render_project  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="measurements of (1); median and best")
    p.add_argument("--batch-size", type=int, default=128, help="run.py's --batch-size")
    p.add_argument("--width", type=int, default=64, help="run.py's --width")
    p.add_argument("--skip-cache", action="store_true", help="only (1)")
    return p.parse_args(argv)


def decision_overhead(project: Path, pkg, args) -> dict:
    """What `--compile auto` adds before the first step (a batch peeked, eager forward+backward
    timed on it), against one optimizer step of the project's own run.py, on the same batch size."""
    import importlib.util

    import torch
    from labrun.hardware import time_forward_backward
    from labrun.tools.tuning import capture_step

    spec = importlib.util.spec_from_file_location("run_bench", project / "run.py")
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)
    work = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    argv = ["--dataset", "synthetic", "--synthetic-size", "4000", "--device", "cpu"]
    argv += ["--batch-size", str(args.batch_size), "--width", str(args.width)]
    argv += ["--data-dir", str(work / "data"), "--results-dir", str(work / "r")]
    argv += ["--tracking", "off", "--progress", "off"]
    captured = capture_step(run_py, argv)  # run.py's build() and make_step(): model, step
    device = torch.device("cpu")
    now = pkg.hardware.timed(device)
    decide, choose, steps = [], [], []
    for _ in range(args.repeats):
        start = now()
        x, y = captured.batch()
        time_forward_backward(captured.model, x, y, captured.loss_fn, None, now)
        decide.append(now() - start)
        start = time.perf_counter()
        pkg.hardware.choose_compile(device, "auto", 7020, measure=None)
        choose.append(time.perf_counter() - start)
    batches = iter(captured.data.train)
    captured.step([next(batches)])  # untimed
    for _ in range(args.repeats):
        start = now()
        captured.step([next(batches)])
        steps.append(now() - start)
    return {"decide": decide, "choose": choose, "step": steps}


def cache_effect(project: Path) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.pop("LAB_INDUCTOR_CACHE_DIR", None)
    env["LAB_TRACKING"] = "off"
    command = [
        sys.executable, "run.py", "--dataset", "synthetic", "--synthetic-size", "2000",
        "--device", "cpu", "--compile", "on", "--max-steps", "2", "--epochs", "1",
        "--width", "16", "--batch-size", "32", "--progress", "off", "--fresh",
    ]
    seconds = []
    for _ in range(2):
        subprocess.run(command, cwd=project, env=env, check=True, capture_output=True)
        out = subprocess.run([*command, "--print-run-dir"], cwd=project, env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        seconds.append(json.loads((Path(out) / "metrics.json").read_text())["compile_time_s"])
    assert (project / ".cache" / "inductor").is_dir(), "the project's cache was not used"
    return seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    project = render_project(work)
    pkg, package = import_package(project)
    for module in ("config", "train", "hardware"):
        __import__(f"{package}.{module}")
    load = os.getloadavg()[0]
    m = decision_overhead(project, pkg, args)
    ms = {k: (1e3 * statistics.median(v), 1e3 * min(v)) for k, v in m.items()}
    machine = device_name(torch.device("cpu"))
    print(f"machine: {machine}; torch {torch.__version__}; load avg {load:.1f}")
    print(f"| what (CPU, batch {args.batch_size}, width {args.width}, 32x32x3) | median ms | "
          "best ms | repeats |")
    print("|---|---:|---:|---:|")
    rows = (("decision before compiling (peek + 4 forward+backward)", "decide", ".1f"),
            ("one optimizer step of the same job", "step", ".1f"),
            ("choose_compile, --compile auto on CPU", "choose", ".4f"))
    for what, key, fmt in rows:
        median, best = ms[key]
        print(f"| {what} | {median:{fmt}} | {best:{fmt}} | {args.repeats} |")
    if not args.skip_cache:
        cold, warm = cache_effect(project)
        print(f"| compile_time_s, empty project cache / second job, same cache | {cold:.1f} s | "
              f"{warm:.1f} s | 1 each |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
