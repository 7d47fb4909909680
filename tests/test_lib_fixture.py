"""labrun's tests run lib/tests/project, a committed copy of the default render (so lib/ is
tested alone): it must be the render itself, never a fork edited by hand or left behind by a
template change."""

import shutil
import subprocess
import sys

from conftest import TEMPLATE

SCRIPT = TEMPLATE / "scripts" / "refresh_lib_fixture.py"
FIXTURE = TEMPLATE / "lib" / "tests" / "project"


def check(fixture=FIXTURE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--fixture", str(fixture)],
        capture_output=True, text=True, cwd=TEMPLATE,
    )  # fmt: skip


def test_lib_fixture_is_the_default_render():
    result = check()
    assert result.returncode == 0, (
        "lib/tests/project differs from a fresh default render; refresh it with "
        f"`python scripts/refresh_lib_fixture.py` and commit it:\n{result.stdout}{result.stderr}"
    )


def test_a_hand_edit_or_a_stray_file_is_found(tmp_path):
    fixture = tmp_path / "project"
    shutil.copytree(FIXTURE, fixture, ignore=shutil.ignore_patterns("__pycache__"))
    with open(fixture / "run.py", "a") as f:
        f.write("# edited by hand\n")
    (fixture / "README.md").write_text("the render's, but left out of the fixture\n")
    (fixture / "notes.txt").write_text("not in the render\n")
    (fixture / "run.sh").chmod(0o644)
    (fixture / "pyproject.toml").unlink()
    result = check(fixture)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "  missing: pyproject.toml",
        "  extra: README.md",
        "  extra: notes.txt",
        "  changed: run.py",
        "  executable bit differs: run.sh",
    ]
    [error] = result.stderr.splitlines()
    assert error.startswith("error: ") and "scripts/refresh_lib_fixture.py" in error
