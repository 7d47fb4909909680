"""Shared test helpers for labrun: a real project to run, and run.py run as a user would.

The library is tested through the template's default project, committed in tests/project (the
render itself: scripts/refresh_lib_fixture.py in the template writes it, and the template's tests
fail when it is stale), so lib/ is tested alone. Tests write into the project (results, .cache),
so each test process works in its own copy, outside any git repository as a fresh render is;
$LABRUN_TEST_PROJECT, when set, names another project to test instead, used in place. Every
test runs on CPU with tiny settings (digits, width 8, a few epochs). The MLflow database is
created once per session and shared; each test gets its own results directory.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Tiny models run fastest on one thread, and two threads on a loaded 2-core machine are many
# times slower (OpenMP workers wait for a busy core): every test job uses one.
os.environ["OMP_NUM_THREADS"] = "1"

LIB = Path(__file__).resolve().parent.parent
FIXTURE = LIB / "tests" / "project"  # the committed project; never written by a test
# pytest must not collect the project's own tests (nor load its conftest) as labrun's.
collect_ignore = ["project"]


def _project_copy() -> Path:
    """This process's private copy of the fixture project (named as the render names it)."""
    if os.environ.get("LABRUN_TEST_PROJECT"):
        return Path(os.environ["LABRUN_TEST_PROJECT"]).resolve()
    out = Path(tempfile.mkdtemp(prefix="labrun-project-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    copy = out / "lab_project"
    shutil.copytree(FIXTURE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


ROOT = _project_copy()
RUN_PY = ROOT / "run.py"
PACKAGE = "lab_project"
# In-process callers (run.py's main(), the registries) find this project like run.py would.
os.environ["LABRUN_PROJECT"] = str(ROOT)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# How long a test waits for an event (a file, a log line, a process's end): only a hang reaches
# it. A shorter wait fails on a loaded machine (2 cores, other tests and sweeps beside it).
DEADLINE = 600.0

# Small and fast on 2 CPU cores, yet well above chance on digits after a few epochs.
TINY = ["--device", "cpu", "--width", "8", "--batch-size", "64", "--lr", "0.01"]
TINY += ["--progress", "off"]


@pytest.fixture(autouse=True)
def _inductor_cache_left_as_found():
    """A compile in this process (main_in_process, capture_step) points TORCHINDUCTOR_CACHE_DIR
    at its project's cache (hardware.use_inductor_cache writes the environment): put it back, or
    every later test's subprocess would inherit it, in whatever order xdist runs them."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def project() -> Path:
    """The project's root (run.py, run.sh, plot.py, the package): this process's copy."""
    return ROOT


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """A private sqlite DB, created once (as run.sh does before fanning out)."""
    from labrun import mirror

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:  # in-process: mlflow is imported once anyway
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        mirror.init()
    return uri


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def env(mlflow_uri, monkeypatch) -> dict:
    """Environment for subprocesses; also set in-process (for tests that call main())."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    return {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def run_cli(env, data_dir):
    """run_cli(*args, results_dir=..., extra_env=None) -> CompletedProcess (text, captured)."""

    def run(*args: str, results_dir: Path, extra_env: dict | None = None, timeout: float = 300):
        cmd = cli_command(*args, results_dir=results_dir, data_dir=data_dir)
        return subprocess.run(
            cmd,
            env={**env, **(extra_env or {})},
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def main_in_process(env, data_dir):
    """Call run.main() in this process (torch is imported once, so quick checks stay quick)."""
    import signal

    from labrun.stopping import STOP_SIGNALS

    run = load_run_py()
    # run.py's stop handlers stay installed until the process exits; this process lives on.
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def call(*args: str) -> int:
        try:
            return run.main([*TINY, "--data-dir", str(data_dir), *args])
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    return call


def cli_command(*args: str, results_dir: Path, data_dir: Path) -> list[str]:
    """`python run.py` with the tiny settings, a private data and results folder, then `args`."""
    return [
        sys.executable,
        str(RUN_PY),
        *TINY,
        "--data-dir",
        str(data_dir),
        "--results-dir",
        str(results_dir),
        *args,
    ]


def popen_cli(*args: str, results_dir: Path, data_dir: Path, env: dict) -> subprocess.Popen:
    cmd = cli_command(*args, results_dir=results_dir, data_dir=data_dir)
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def run_dir_of(results_dir: Path) -> Path:
    """The single run directory under `results_dir`."""
    dirs = [p for p in results_dir.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def mlflow_run(uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id)


def load_run_py():
    """Import the project's run.py as a module (to call main() in-process)."""
    spec = importlib.util.spec_from_file_location("run_under_test", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def temp_files(directory: Path) -> list[Path]:
    """Leftovers of an interrupted atomic write (there must be none)."""
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        help="also run the slow end-to-end tests (real signals, sweeps, Slurm)",
    )


def pytest_collection_modifyitems(config, items):
    """Slow tests run only with --runslow or when `-m` names them (pytest -m slow)."""
    if config.getoption("--runslow") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (or -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def wait_while_running(predicate, proc, timeout: float = DEADLINE) -> None:
    """Poll `predicate` until true; fail if `proc` ends first or nothing happens in time."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no progress in time"
        time.sleep(0.02)


def signal_self_after(monkeypatch, step_to_stop: int, *signums: int, pause: float = 0.0) -> None:
    """Real signals (default SIGTERM) to this process right after optimizer step `step_to_stop`
    of run.py's loop (counted from 1), before the loop looks for a stop."""
    import signal
    import time

    from labrun.session import TrainingJob

    original = TrainingJob.tick

    def tick(self):
        if self.progress.step + 1 == step_to_stop:  # the step just done, not yet counted
            for signum in signums or (signal.SIGTERM,):
                os.kill(os.getpid(), signum)
                time.sleep(pause)
        return original(self)

    monkeypatch.setattr(TrainingJob, "tick", tick)


def capture_step(monkeypatch, data_dir, results_dir, *args: str, model=None, amp_dtype="auto"):
    """run.py's build() and make_step() for these flags, training nothing
    (labrun.tools.tuning.capture_step): data, model, eval_model, optimizer, scheduler, sums,
    stopper, step, compiled, args, env, loss_fn. `model` replaces --model's network (any
    module: the step is called with the test's own batches); `amp_dtype` replaces the autocast
    dtype hardware.choose_precision would pick (fp16 turns the GradScaler on, also on CPU)."""
    from labrun import hardware
    from labrun.tools.tuning import capture_step as capture

    module = load_run_py()
    if model is not None:
        monkeypatch.setattr(module, "make_model", lambda args, info: model)
    if amp_dtype != "auto":
        monkeypatch.setattr(hardware, "choose_precision", lambda device, amp: (amp_dtype, "test"))
    argv = [*TINY, "--data-dir", str(data_dir), "--results-dir", str(results_dir)]
    return capture(module, [*argv, "--tracking", "off", *args])


def wait_for_handler(proc, signum: int, timeout: float = DEADLINE) -> None:
    """Wait until `proc` has installed a handler for `signum` (its SigCgt mask in /proc): a signal
    sent earlier meets Python's default action (death by that signal), which no job can change,
    and a fixed sleep races the interpreter's start-up on a loaded machine."""
    import time

    deadline = time.monotonic() + timeout
    bit = 1 << (signum - 1)
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no handler for signal {signum} in time"
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            status = ""
        caught = next(
            (line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), "0"
        )
        if int(caught, 16) & bit:
            return
        time.sleep(0.01)


def run_edited_run_py(tmp_path: Path, env: dict, data_dir: Path, line: str, edit: str, *args):
    """run.py with `line` replaced by `edit` (a student's edit), run as `python run.py` from the
    project with the tiny settings, `--tracking off`, `args` and results in tmp_path/results:
    (the CompletedProcess, the edited script's path; the script itself is gone by then)."""
    source = RUN_PY.read_text()
    assert line in source, "run.py changed: point this test at another line"
    script = ROOT / f"run_edited_{tmp_path.name}.py"  # in the project, as run.py is
    script.write_text(source.replace(line, edit, 1))
    try:
        cmd = cli_command(*args, "--tracking", "off", results_dir=tmp_path / "results",
                          data_dir=data_dir)  # fmt: skip
        cmd[1] = str(script)
        done = subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True,
                              timeout=DEADLINE)  # fmt: skip
    finally:
        script.unlink()
    return done, script
