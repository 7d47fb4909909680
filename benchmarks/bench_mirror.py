"""Benchmark: what a live job's MLflow tracking costs per epoch as its history grows.

    .venv/bin/python benchmarks/bench_mirror.py --epochs 300      # markdown to stdout

In this process: a run directory with a 7-column history.csv, a `labrun.tracking.Tracker` on a
fresh sqlite store (as `python run.py` makes one), and `Tracker.log_history()` after each epoch's
row is written, as the job calls it. Reports the time of that call at a few epochs (median of the
neighbouring ten) and in all: a cost that grows with the epoch is a cost that grows with the
square of a run's length.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

COLUMNS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "epoch_time_s")
COLUMNS += ("samples_per_sec",)  # a history.csv of run.py's columns


def write_history(run_dir: Path, epochs: int) -> None:
    rows = [",".join(("epoch", "step", *COLUMNS))]
    rows += [",".join([str(e), str(10 * e)] + [f"{1 / (e + i):.6g}" for i, _ in enumerate(COLUMNS)])
             for e in range(1, epochs + 1)]  # fmt: skip
    (run_dir / "history.csv").write_text("\n".join(rows) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=300, help="epochs of the simulated run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        from labrun import tracking

        run_dir = Path(tmp) / "results" / "bench-0123abcd"
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text('{"lr": 0.1, "experiment_keys": ["lr"]}')
        (run_dir / "status").write_text("running\n")
        write_history(run_dir, 1)
        log = logging.getLogger("bench")
        tracker = tracking.Tracker(run_dir, enabled=True, experiment="bench",
                                   log=log, params={"lr": "0.1"}, system_metrics=False)  # fmt: skip
        seconds = []
        for epoch in range(2, args.epochs + 1):
            write_history(run_dir, epoch)
            start = time.perf_counter()
            tracker.log_history()
            seconds.append(time.perf_counter() - start)
        tracker.end("FINISHED")
    print(f"- {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"Python {sys.version.split()[0]}; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("\n| epoch | log_history (ms, median of 10) |\n|---:|---:|")
    for at in (10, 50, 100, 200, 300, 500, 1000):
        if at <= len(seconds) + 1:  # seconds[0] is epoch 2's
            print(f"| {at} | {1000 * statistics.median(seconds[max(0, at - 11) : at - 1]):.1f} |")
    print(f"\nall {len(seconds)} epochs: {sum(seconds):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
