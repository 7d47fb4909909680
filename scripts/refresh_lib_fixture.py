"""Write lib/tests/project, the project labrun's own tests run, from a fresh default render.

labrun is built, tested and released alone (lib/), so its tests cannot render the template: they
run this committed copy of the template's default project (cookiecutter --no-input) instead.
The copy is the render, never a hand-edited fork: this script writes it, and the template test
tests/test_lib_fixture.py fails (naming this script) when it differs from a fresh render. Run it
after any change to the project template, cookiecutter.json, the hooks or lib's version (the
render pins labrun==<version>; the local part that names lib's code is left out).

Left out of the copy: what no lib test reads (README, LICENSE, CI and pre-commit files, the
update record .cruft.json, the labrun wheel the hook builds, the project's own tests but the
two that test_first_week.py runs in a copy of the project), and caches (__pycache__, .git).

Usage: .venv/bin/python scripts/refresh_lib_fixture.py [--check] [--fixture DIR]
"""

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
FIXTURE = TEMPLATE / "lib" / "tests" / "project"
# Paths of the render (relative, POSIX) that no lib test reads.
DROPPED = {"README.md", "LICENSE", ".cruft.json", ".github", ".pre-commit-config.yaml", "wheels"}
DROPPED |= {"constraints.txt"}
TESTS_KEPT = {"conftest.py", "test_model.py"}  # tests/: what test_first_week.py runs
CACHES = {"__pycache__", ".git", ".pytest_cache", ".ruff_cache"}


def kept(relative: Path) -> bool:
    """Whether a path of the render belongs in the fixture."""
    parts = relative.parts
    if parts[0] in DROPPED or CACHES.intersection(parts):
        return False
    return not (parts[0] == "tests" and len(parts) > 1 and parts[1] not in TESTS_KEPT)


def render(out: Path) -> Path:
    """The template's default project rendered under `out`, as `cookiecutter --no-input` makes
    it (no user config file: its default answers would change the render)."""
    done = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "--default-config",
         "--output-dir", str(out), str(TEMPLATE)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"error: cookiecutter could not render {TEMPLATE}: {last}")
    (project,) = [p for p in out.iterdir() if p.is_dir()]
    # The pin's local part names lib's code (labrun==0.1.0+g<hash>, the hook's code_version):
    # the fixture pins the release, which every build of it satisfies, so that a change to the
    # library alone leaves the fixture as it is.
    pyproject = project / "pyproject.toml"
    pyproject.write_text(
        re.sub(r'"labrun==([^"+]*)\+[^"]*"', r'"labrun==\1"', pyproject.read_text())
    )
    return project


def files(root: Path, keep=kept) -> dict[str, Path]:
    """The files under `root` that `keep` keeps, caches left out: relative POSIX path -> path."""
    found = {}
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in CACHES)
        for name in names:
            path = Path(folder, name)
            relative = path.relative_to(root)
            if keep(relative):
                found[relative.as_posix()] = path
    return found


def differences(render_dir: Path, fixture: Path) -> list[str]:
    """How `fixture` differs from the render: one line per file missing, extra or changed (a
    file the fixture leaves out, such as README.md, is extra there too)."""
    want = files(render_dir)
    have = files(fixture, keep=lambda relative: True) if fixture.is_dir() else {}
    lines = [f"missing: {name}" for name in sorted(want.keys() - have.keys())]
    lines += [f"extra: {name}" for name in sorted(have.keys() - want.keys())]
    for name in sorted(want.keys() & have.keys()):
        if not filecmp.cmp(want[name], have[name], shallow=False):
            lines.append(f"changed: {name}")
        elif os.access(want[name], os.X_OK) != os.access(have[name], os.X_OK):
            lines.append(f"executable bit differs: {name}")
    return lines


def write(render_dir: Path, fixture: Path) -> None:
    """Replace `fixture` with the render's kept files (modes kept: run.sh stays executable)."""
    if fixture.exists():
        shutil.rmtree(fixture)
    for name, path in files(render_dir).items():
        (fixture / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, fixture / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 and list the differences if the fixture is not a fresh render",
    )
    parser.add_argument(
        "--fixture",
        type=Path,
        default=FIXTURE,
        metavar="DIR",
        help=f"the fixture folder (default: {FIXTURE.relative_to(TEMPLATE)})",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lib-fixture-") as tmp:
        project = render(Path(tmp))
        if args.check:
            found = differences(project, args.fixture)
            for line in found:
                print(f"  {line}")
            if found:
                print(
                    f"error: {args.fixture} is not the template's default render; "
                    "run: python scripts/refresh_lib_fixture.py",
                    file=sys.stderr,
                )
                return 1
            print(f"{args.fixture}: the template's default render")
            return 0
        write(project, args.fixture)
    print(f"wrote {args.fixture} from the template's default render")
    return 0


if __name__ == "__main__":
    sys.exit(main())
