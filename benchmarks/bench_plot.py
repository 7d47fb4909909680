"""Benchmark: `python plot.py` end to end on a large synthetic sweep (target: < 5 s on 2 cores).

    .venv/bin/python benchmarks/bench_plot.py             # 4 lrs x 5 widths x 10 seeds x 50 epochs
    .venv/bin/python benchmarks/bench_plot.py --profile   # + cProfile of plot.main, top 25

Renders the template into a temporary directory, writes 200 finished runs that follow
docs/design.md (config.json, metrics.json, history.csv, status) into results/sweep (where run.sh
puts a sweep and plot.py looks by default), then times `python plot.py` in a
fresh subprocess -- interpreter start, imports, loading, aggregation, 3 figures as PDF + PNG and
the tables -- `--repeat` times after one untimed warm-up run (which fills the OS file cache and
writes __pycache__). Prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TEMPLATE = Path(__file__).resolve().parents[1]
LRS = (1e-3, 3e-3, 1e-2, 3e-2)
WIDTHS = (16, 32, 64, 128, 256)
HEADER = "epoch,step,lr,train_loss,train_acc,val_loss,val_acc,epoch_time_s,samples_per_sec"


def render(out: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out)))


def write_sweep(results: Path, seeds: int, epochs: int) -> int:
    """len(LRS) x len(WIDTHS) x seeds finished runs with plausible, noisy curves."""
    rng = np.random.default_rng(0)
    keys = ["dataset", "epochs", "lr", "seed", "width"]
    n = 0
    for lr in LRS:
        for width in WIDTHS:
            for seed in range(seeds):
                name = f"digits_lr={lr:g}_width={width}_seed={seed}-{n:08x}"
                path = results / name
                path.mkdir(parents=True)
                config = {"dataset": "digits", "epochs": epochs, "lr": lr, "seed": seed,
                          "width": width, "device": "cuda", "run_name": name,
                          "experiment_keys": keys}  # fmt: skip
                ceiling = 0.97 - 0.02 * abs(np.log10(lr) + 2) - 8 / width
                e = np.arange(1, epochs + 1)
                val = ceiling * (1 - np.exp(-e / 5)) + rng.normal(0, 0.005, epochs)
                speed = 2e4 * 64 / width * (1 + rng.normal(0, 0.02, epochs))
                rows = [HEADER] + [
                    f"{i},{i * 100},{lr},{1 - v:.5f},{v:.5f},{1 - v:.5f},{v:.5f},{1e4 / s:.4f},"
                    f"{s:.1f}"
                    for i, v, s in zip(e, val, speed, strict=True)
                ]
                metrics = {
                    "best_val_acc": float(val.max()), "test_acc": float(val[-1] - 0.01),
                    "test_loss": float(1 - val[-1]), "best_epoch": int(val.argmax() + 1),
                    "epochs_run": epochs, "steps": epochs * 100,
                    "wall_time_s": float((1e4 / speed).sum() + 5), "train_time_s": 0.0,
                    "compile_time_s": 5.0, "samples_per_sec": float(speed.mean()),
                    "peak_mem_bytes": width * 10**7, "device": "cuda", "stop_reason": "max_epochs",
                    "mlflow_run_id": None,
                }  # fmt: skip
                (path / "config.json").write_text(json.dumps(config))
                (path / "history.csv").write_text("\n".join(rows) + "\n")
                (path / "metrics.json").write_text(json.dumps(metrics))
                (path / "status").write_text("finished\n")
                n += 1
    return n


def machine() -> dict[str, str]:
    import matplotlib

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "matplotlib": matplotlib.__version__,
        "numpy": np.__version__,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10, help="seeds per configuration (20 configs)")
    p.add_argument("--epochs", type=int, default=50, help="epochs per run (rows of history.csv)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of plot.py")
    p.add_argument("--profile", action="store_true", help="also cProfile plot.main in-process")
    p.add_argument("--keep", action="store_true", help="keep the temporary project (and say where)")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench_plot_"))
    project = render(tmp)
    n = write_sweep(project / "results" / "sweep", args.seeds, args.epochs)  # plot.py default
    cmd = [sys.executable, "plot.py"]
    subprocess.run(cmd, cwd=project, check=True, capture_output=True)  # warm-up, untimed
    times = []
    load_before = os.getloadavg()[0]
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=project, check=True, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
    figures = sorted(f.name for f in (project / "figures").iterdir())
    # Other processes on the machine slow plot.py down: say how busy it was (1-min average).
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"

    info = machine()
    grid = f"{len(LRS)} lr x {len(WIDTHS)} width x {args.seeds} seeds"
    print(f"`python plot.py` on {n} runs x {args.epochs} epochs ({grid}), {args.repeat} runs:\n")
    print("| runs | epochs | best (s) | median (s) | all (s) | CPU | cores | Python | matplotlib "
          "| numpy |")  # fmt: skip
    print("|---:|---:|---:|---:|---|---|---:|---|---|---|")
    print(f"| {n} | {args.epochs} | {min(times):.2f} | {statistics.median(times):.2f} | "
          f"{', '.join(f'{t:.2f}' for t in times)} | {info['cpu']} | {info['cores']} | "
          f"{info['python']} | {info['matplotlib']} | {info['numpy']} |")  # fmt: skip
    print(f"\nplot.py said: {proc.stdout.strip()}")
    print(f"files: {', '.join(figures)}")
    print(f"os: {info['os']}, numpy {info['numpy']}, load average during the runs: {load}")

    if args.profile:
        import cProfile
        import pstats

        sys.path.insert(0, str(project))
        os.chdir(project)
        import plot  # the rendered project's plot.py

        prof = cProfile.Profile()
        prof.runcall(plot.main, [])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    if args.keep:
        print(f"kept {project}")
    else:
        import shutil

        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
