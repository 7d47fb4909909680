"""Apply `ruff format` (and ruff's import sorting) to the Python files of the project template.

The files under {{cookiecutter.project_slug}}/ are not Python until rendered
(`from {{ cookiecutter.package_name }} import x`), so ruff cannot format them in place. This
script renders the template with a placeholder package name and slug of 11 characters (the length
of the default 'lab_project', so lines wrap as in the default project), formats the rendered
files, maps the placeholders back to the template expressions and writes the files back. It then
renders again and checks that the result is what ruff formatted.

Usage: .venv/bin/python scripts/format_project_template.py [--check]
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
PROJECT_TEMPLATE = TEMPLATE / "{{cookiecutter.project_slug}}"
PACKAGE, SLUG = "zzpackagezz", "zzslugzzzzz"
# Rendered text -> template expression, for every place an answer reaches a Python file.
REVERSE = [
    (f'DEFAULT_EXPERIMENT = "{SLUG}"',
     "DEFAULT_EXPERIMENT = {{ cookiecutter.project_slug | py_string }}"),
    (PACKAGE, "{{ cookiecutter.package_name }}"),
]
SKIP = {"__init__.py"}  # holds the docstring made of answers; three lines, nothing to format
RUFF = Path(sys.executable).parent / "ruff"


def render(out: Path) -> Path:
    copy = out / "template"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "__pycache__", ".pytest_cache", ".ruff_cache"))
    project = cookiecutter(str(copy), no_input=True, output_dir=str(out / "render"),
                           extra_context={"project_slug": SLUG, "package_name": PACKAGE})
    return Path(project)


def template_path(rendered: Path, project: Path) -> Path:
    relative = rendered.relative_to(project)
    parts = ["{{cookiecutter.package_name}}" if p == PACKAGE else p for p in relative.parts]
    return PROJECT_TEMPLATE.joinpath(*parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which files would change")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = render(Path(tmp))
        sources = [p for p in project.rglob("*.py") if p.name not in SKIP]
        # Imports sorted as the project's own lint wants them (labrun is a third-party import
        # there, the project's package first-party), then formatted.
        subprocess.run([RUFF, "check", "--quiet", "--select", "I", "--fix", "--no-cache",
                        *sources], cwd=project, check=False)
        subprocess.run([RUFF, "format", "--quiet", *sources], cwd=project, check=True)
        changed = []
        for source in sources:
            text = source.read_text()
            for rendered, expression in REVERSE:
                text = text.replace(rendered, expression)
            target = template_path(source, project)
            if target.read_text() != text:
                changed.append(target.relative_to(TEMPLATE))
                if not args.check:
                    target.write_text(text)
        print("\n".join(map(str, changed)) or "nothing to format")
        if args.check:
            return 1 if changed else 0
        again = render(Path(tmp) / "again")
        check = subprocess.run([RUFF, "format", "--check", "--quiet", "."], cwd=again)
        return check.returncode


if __name__ == "__main__":
    sys.exit(main())
