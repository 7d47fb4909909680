"""The generated project's own test suite, run in a subprocess on CPU, as a user would.

Which renders: the switches (use_slurm, use_github_actions) decide which files and tests exist,
so the fast suite runs on a render with every switch on and one with every switch off: every
switch value is tested. The license choice changes only LICENSE and one pyproject.toml line
(checked per render in test_render.py), so it does not multiply the suite. The slow tests
(`--runslow`: real signals, sweeps, Slurm) run once, on the default render.

The nested suite's output streams to the terminal while it runs (no minutes of silence), and its
skips with their reasons are listed at the end of the outer run (conftest.py's summary).
"""

import os
import re
import shutil
import subprocess
import sys

from conftest import BIN, record_generated_skips

# `-rs` lines: "SKIPPED [N] tests/x.py:81: reason", N tests skipped at that location.
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] (.*)$")
SKIP_TOTAL = re.compile(r"^=+ .*\b(\d+) skipped\b.* =+$", re.M)


def cluster_is_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return states.returncode == 0 and "idle" in states.stdout


def run_project_tests(project, *args, capsys, label):
    """Run the project's pytest, its lines streamed live (-v: one line per test with the
    percentage done) past pytest's capture. Returns (returncode, output)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's tests isolate MLflow themselves
    env["PYTHONUNBUFFERED"] = "1"  # each test's line arrives as it finishes, not in blocks
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    lines = []
    with capsys.disabled():
        print(f"\n--- generated project ({label}): {' '.join(command[2:])} ---", flush=True)
        process = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            lines.append(line)
            print(f"    {line}", end="", flush=True)
        returncode = process.wait(timeout=1500)
        print(f"--- end of generated project ({label}): exit {returncode} ---", flush=True)
    return returncode, "".join(lines)


def skipped(output: str) -> list[tuple[int, str]]:
    """(how many tests, "location: reason") per `-rs` line of a pytest run's output."""
    return [(int(m.group(1)), m.group(2)) for line in output.splitlines()
            if (m := SKIP_LINE.match(line))]  # fmt: skip


def test_default_project_passes_its_whole_suite_including_slow_tests(bake, capsys):
    project = bake()
    returncode, output = run_project_tests(project, "-v", "-rs", "--runslow", capsys=capsys,
                                           label="every switch on, --runslow")
    record_generated_skips("every switch on, --runslow", skipped(output))
    assert returncode == 0, output[-6000:]
    assert not [s for _, s in skipped(output) if "slow:" in s]  # --runslow ran the slow tests
    if cluster_is_up():  # CI brings one up (.ci/slurm-up.sh): then the Slurm test must run
        assert not [s for _, s in skipped(output) if "test_slurm" in s], skipped(output)


def test_project_without_options_passes_its_fast_suite(bake, capsys):
    """Without Slurm and CI files the suite still passes: nothing refers to removed files."""
    project = bake(use_slurm=False, use_github_actions=False)
    returncode, output = run_project_tests(project, "-v", "-rs", capsys=capsys,
                                           label="every switch off, fast suite")
    record_generated_skips("every switch off, fast suite", skipped(output))
    assert returncode == 0, output[-6000:]
    assert "test_slurm.py" not in output


def test_skip_summary_counts_tests_as_pytest_does(tmp_path):
    """A skip line stands for N tests (a parametrized test skipped at one location): the
    summary adds up the N, and agrees with the "N skipped" of pytest's own last line."""
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_needs_a_gpu(i):\n    pytest.skip('needs a CUDA device')\n\n"
        "def test_needs_slurm():\n    pytest.skip('no cluster')\n\n"
        "def test_runs():\n    pass\n"
    )
    output = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                             "-p", "no:xdist", "test_some.py"], cwd=tmp_path,
                            capture_output=True, text=True).stdout  # fmt: skip
    lines = skipped(output)
    assert sum(n for n, _ in lines) == int(SKIP_TOTAL.search(output).group(1)) == 4
    assert len(lines) == 2
