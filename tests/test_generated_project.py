"""The generated project's own test suite, run in a subprocess on CPU, as a user would.

The project's tests check its own code (a run end to end, exact resume, the optimizer edits, the
models, the figures, run.sh --dry-run); the machinery's are labrun's (lib/tests). Which renders:
every switch on and every switch off (every switch value is tested; the license changes only
LICENSE and one pyproject.toml line, checked in test_render.py), and a default render after its
owner edited it as the README says (a new job list, a new model, SGD with a --momentum flag),
started under nohup, whose ignored SIGHUP its processes inherit.

The nested suite's output streams to the terminal while it runs (no minutes of silence), and its
skips with their reasons are listed at the end of the outer run (conftest.py's summary).
"""

import os
import re
import subprocess
import sys

from owner_edits import sgd_edit

from conftest import BIN, record_generated_skips

# `-rs` lines: "SKIPPED [N] tests/x.py:81: reason", N tests skipped at that location.
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] (.*)$")
SKIP_TOTAL = re.compile(r"^=+ .*\b(\d+) skipped\b.* =+$", re.M)


def run_project_tests(project, *args, capsys, label, nohup=False):
    """Run the project's pytest, its lines streamed live (-v: one line per test with the
    percentage done) past pytest's capture; `nohup`: as `nohup pytest` starts it, with SIGHUP
    ignored (inherited by every process it starts). Returns (returncode, output)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's tests isolate MLflow themselves
    env["PYTHONUNBUFFERED"] = "1"  # each test's line arrives as it finishes, not in blocks
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    if nohup:
        command = ["nohup", *command]
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


def test_default_project_passes_its_suite(bake, capsys):
    project = bake()
    returncode, output = run_project_tests(project, "-v", "-rs", capsys=capsys,
                                           label="every switch on")
    record_generated_skips("every switch on", skipped(output))
    assert returncode == 0, output[-6000:]


def test_project_without_options_passes_its_suite(bake, capsys):
    """Without Slurm and CI files the suite still passes: nothing refers to removed files."""
    project = bake(use_slurm=False, use_github_actions=False)
    returncode, output = run_project_tests(project, "-v", "-rs", capsys=capsys,
                                           label="every switch off")
    record_generated_skips("every switch off", skipped(output))
    assert returncode == 0, output[-6000:]


# The owner's edits, as the README invites them: the job list rewritten (sweeping the new
# flag), a model added, the optimizer swapped for SGD with a --momentum flag.
JOBS = """define_jobs() {
  local width
  for width in 8 16; do
    job --model mlp --width "${width}" --lr 3e-3 --momentum 0.8 --seed 4
  done
}
"""
MLP = """

@register_model("mlp", help="a two-layer perceptron on the flattened input")
def mlp(num_classes: int, input_shape: tuple, width: int):
    import math

    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
        nn.Linear(width, num_classes),
    )
"""


def test_project_edited_by_its_owner_passes_its_suite_under_nohup(bake, capsys):
    project = bake()
    run_sh = project / "run.sh"
    text = run_sh.read_text()
    start, end = text.index("define_jobs() {"), text.index("\n}\n", text.index("define_jobs() {"))
    run_sh.write_text(text[:start] + JOBS + text[end + 3:])
    model = next(project.glob("*/model.py"))
    model.write_text(model.read_text() + MLP)
    sgd_edit(project)
    returncode, output = run_project_tests(project, "-v", "-rs", capsys=capsys, nohup=True,
                                           label="edited by its owner, under nohup")
    assert returncode == 0, output[-6000:]
    # The sweep follows the new list: two jobs of the new model, both pending.
    dry = subprocess.run(["bash", "run.sh", "--dry-run"], cwd=project, capture_output=True,
                         text=True, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.count("model=mlp") == dry.stdout.count("momentum=0.8") == 2, dry.stdout


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
