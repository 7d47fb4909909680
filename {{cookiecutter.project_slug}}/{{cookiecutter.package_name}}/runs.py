"""One run's directory: file names, atomic writes, status, history, log (docs/design.md).

Imports no torch: plot.py, analysis.py and the sweep read the same names. Every file except the
append-only run.log is written to a temporary file in the same directory and moved into place with
os.replace, so a reader (or a crash) never sees half a file.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

CONFIG = "config.json"
STATUS = "status"
HISTORY = "history.csv"
CHECKPOINT = "checkpoint.pt"
BEST_MODEL = "best_model.pt"
METRICS = "metrics.json"
LOG = "run.log"
TRACEBACK = "traceback.txt"
STATUSES = ("running", "interrupted", "failed", "finished")
HISTORY_FIELDS = (
    "epoch", "step", "lr", "train_loss", "train_acc", "val_loss", "val_acc", "epoch_time_s",
    "samples_per_sec",
)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; move it into place only if the block succeeds."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_status(run_dir: Path, status: str) -> None:
    assert status in STATUSES, status
    atomic_write_text(Path(run_dir) / STATUS, status + "\n")


def read_status(run_dir: Path) -> str | None:
    try:
        return (Path(run_dir) / STATUS).read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def is_done(run_dir: Path) -> bool:
    """A run is done iff metrics.json exists (written once, last)."""
    return (Path(run_dir) / METRICS).is_file()


def write_history(run_dir: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=HISTORY_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row[k]) for k in HISTORY_FIELDS})
    atomic_write_text(Path(run_dir) / HISTORY, buf.getvalue())


def _fmt(value: object) -> object:
    return f"{value:.6g}" if isinstance(value, float) else value


def read_history(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / HISTORY, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def ensure_writable(directory: Path) -> None:
    """Create `directory` and prove we can write there; raise OSError with a readable message."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe."):
            pass
    except OSError as exc:
        raise OSError(f"cannot write to {directory}: {exc.strerror or exc}") from exc


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete the files of a run directory (for --fresh); return their names. Nothing is moved."""
    removed = []
    for path in sorted(Path(run_dir).iterdir()):
        if path.name == ".lock":  # the live claim (claim.py): deleting it would let a 2nd run in
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the repository holding `root`, or (None, None) outside git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        porcelain = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return commit, bool(porcelain.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def setup_logging(run_dir: Path, name: str) -> logging.Logger:
    """Log lines to stderr and appended to <run_dir>/run.log (a resumed run keeps one log)."""
    logger = logging.getLogger(f"run.{name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):  # a second main() in one process (tests) starts clean
        logger.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(Path(run_dir) / LOG)):
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def close_logging(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
