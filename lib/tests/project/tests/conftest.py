"""The project's tests: run.py's main() in this process (torch is imported once), on CPU with
tiny settings, each test in its own results folder; MLflow off. labrun's own tests cover the
machinery (run directory, signals, sweeps, MLflow): these check what this project's code does."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

# Tiny models run fastest on one thread; two on a loaded 2-core machine are many times slower.
os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "run.py"
# Small and fast on 2 CPU cores, yet well above chance on digits after a few epochs.
TINY = ["--device", "cpu", "--width", "8", "--batch-size", "64", "--lr", "0.01"]
TINY += ["--progress", "off", "--tracking", "off"]


def load_run_py(path: Path = RUN_PY, name: str = "run_under_test"):
    """Import a run.py (this project's, or an edited copy) as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def train(data_dir, tmp_path):
    """train(*args, module=None, results="results") -> (exit code, run directory)."""
    from labrun.stopping import STOP_SIGNALS

    # run.py's stop handlers stay installed until the process exits; this process lives on.
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def call(*args: str, module=None, results: str = "results"):
        module = module or load_run_py()
        folder = tmp_path / results
        argv = [*TINY, "--data-dir", str(data_dir), "--results-dir", str(folder), *args]
        try:
            code = module.main(argv)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        dirs = [p for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
        return code, (dirs[0] if len(dirs) == 1 else None)

    return call
