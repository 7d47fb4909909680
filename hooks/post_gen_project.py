"""Finish the generated project: executable scripts, excluded options removed, next steps.

Rendered by Jinja before it runs, but the answers reach it only as data (one JSON document inside a
Python string literal, see rendered_context); the functions take plain arguments so the template's
tests import and call them on a directory of their own.
"""

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

EXECUTABLES = ("run.sh",)
# Files that exist only for an option; removed when the option is off. Slurm's task script and
# its tests are labrun's (labrun/slurm_task.sh): use_slurm shapes the README only.
SLURM_FILES = ()
GITHUB_ACTIONS_FILES = (".github",)


def make_executable(project: Path) -> None:
    for name in EXECUTABLES:
        path = project / name
        if path.exists():
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def remove_excluded(project: Path, use_slurm: bool, use_github_actions: bool) -> list[str]:
    """Delete the files of options that are off; return what was removed."""
    excluded = []
    if not use_slurm:
        excluded += SLURM_FILES
    if not use_github_actions:
        excluded += GITHUB_ACTIONS_FILES
    removed = []
    for name in excluded:
        path = project / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def template_commit(repo_dir: Path) -> str | None:
    """The commit the template was rendered from, or None if it is not a clean git checkout."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo_dir), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo_dir), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    # A dirty template has no commit that reproduces it, so cruft could not diff against it.
    return None if dirty else commit


def template_url(template: str, repo_dir: Path) -> str:
    """A location cruft can clone: abbreviations (gh:owner/repo) expanded, local paths absolute."""
    from cookiecutter.config import BUILTIN_ABBREVIATIONS
    from cookiecutter.repository import expand_abbreviations, is_repo_url

    url = expand_abbreviations(template, BUILTIN_ABBREVIATIONS)
    return url if is_repo_url(url) else str(repo_dir.resolve())


def write_cruft_state(project: Path, context: dict, repo_dir: Path) -> bool:
    """Record the answers and the template commit in .cruft.json, as `cruft create` would,
    so that a project made with plain cookiecutter can be updated with `cruft update`."""
    commit = template_commit(repo_dir)
    if commit is None:
        return False
    state = {
        "template": template_url(context["_template"], repo_dir),
        "commit": commit,
        "checkout": context.get("_checkout"),
        "context": {"cookiecutter": {**context, "_commit": commit}},
        "directory": None,
    }
    (project / ".cruft.json").write_text(json.dumps(state, indent=2) + "\n")
    return True


# SOURCE_DATE_EPOCH: the wheel's time stamps (2020-01-01), so the same library gives the same
# bytes and an unchanged library makes no diff in a project's `cruft update`.
WHEEL_EPOCH = "1577836800"
LIB_FILES = ("pyproject.toml", "README.md")  # beside src/: the metadata the wheel carries


def library_files(lib_dir: Path) -> list[Path]:
    """What the wheel is built from: the metadata files and the package's code (no caches)."""
    code = [p for p in sorted((lib_dir / "src").rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts and p.suffix in (".py", ".sh")]  # fmt: skip
    return [lib_dir / name for name in LIB_FILES if (lib_dir / name).is_file()] + code


def code_version(lib_dir: Path) -> str:
    """The release in lib/pyproject.toml with a local part naming the code: `0.1.0+g<12 hex>`,
    a hash of library_files, so every change of the library is a new version that pip installs
    over the old one (the same version with other code would be skipped as already there)."""
    release = tomllib.loads((lib_dir / "pyproject.toml").read_text(encoding="utf-8"))
    digest = hashlib.sha256()
    for path in library_files(lib_dir):
        digest.update(path.relative_to(lib_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return f"{release['project']['version']}+g{digest.hexdigest()[:12]}"


def build_wheel(lib_dir: Path, out_dir: Path) -> Path:
    """The library's wheel, versioned by its code (code_version), built by pip's standard build
    (setuptools, full metadata) from a copy of lib/ (the template checkout is left as it was):
    without build isolation where this Python has setuptools >= 77 (no network needed), else in
    pip's isolated build environment. The project installs it with
    `pip install wheels/labrun-*.whl -e .` until the lab publishes it."""
    version = code_version(lib_dir)
    name = f"labrun-{version}-py3-none-any.whl"
    # The same version is the same code: a wheel built before is taken as it is (renders of
    # one checkout, the template's tests, build it once: pip takes seconds).
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lab-template"
    if (cache / name).is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cache / name, out_dir / name)
        return out_dir / name
    os.umask(0o022)  # the wheel keeps its files' modes: the same whatever the user's umask
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "lib"
        for path in library_files(lib_dir):
            target = copy / path.relative_to(lib_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
        pyproject = copy / "pyproject.toml"
        text = re.sub(r'^version = ".*"$', f'version = "{version}"',
                      pyproject.read_text(encoding="utf-8"), count=1, flags=re.M)  # fmt: skip
        pyproject.write_text(text, encoding="utf-8")
        try:
            setuptools = importlib.metadata.version("setuptools")
        except importlib.metadata.PackageNotFoundError:
            setuptools = "0"
        isolation = ["--no-build-isolation"] if int(setuptools.split(".")[0]) >= 77 else []
        out_dir.mkdir(parents=True, exist_ok=True)
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--quiet",
             "--wheel-dir", str(out_dir), str(copy)],
            capture_output=True, text=True, env={**os.environ, "SOURCE_DATE_EPOCH": WHEEL_EPOCH},
        )  # fmt: skip
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"error: building labrun's wheel from {lib_dir} failed: {last}")
    with contextlib.suppress(OSError):  # a cache that cannot be written is no cache
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f".{name}.{os.getpid()}"
        shutil.copyfile(out_dir / name, partial)
        partial.replace(cache / name)  # whole or not at all: another render may read it
    return out_dir / name


def pin_library(project: Path, version: str) -> None:
    """The project's pyproject.toml pins the wheel it carries, local part included."""
    pyproject = project / "pyproject.toml"
    text = re.sub(r'"labrun==[^"]*"', f'"labrun=={version}"', pyproject.read_text(), count=1)
    pyproject.write_text(text)


def write_constraints(template: Path, project: Path) -> None:
    """constraints.txt: the versions the template was tested with (its own constraints.txt, its
    comments left out), for the README's `pip install -c constraints.txt ...`: the resolver
    takes them at once instead of backtracking through releases."""
    lines = [line for line in (template / "constraints.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]  # fmt: skip
    header = [
        "# The versions the lab template tested this project with (README, Install:",
        "# pip install -c constraints.txt ...). Raise one here to upgrade it.",
    ]
    (project / "constraints.txt").write_text("\n".join(header + lines) + "\n")


def next_steps(slug: str) -> str:
    return "\n".join(
        [
            f"Created {slug}/. Next (README.md, 'Install' and 'First steps'):",
            f"  cd {slug}",
            "  python -m venv .venv && source .venv/bin/activate",
            "  pip install -c constraints.txt wheels/labrun-*.whl -e '.[dev]'  # PyPI alone",
            "  git init && git add -A && git commit -m 'Start from the lab template'",
            "  pre-commit install           # the lint on every commit (offline)",
            "  bash run.sh --quick          # the sweep small and short, into results/quick/",
            "  bash run.sh && python plot.py  # the real sweep, then the figures",
        ]
    )


def rendered_context() -> tuple[dict, Path]:
    """The answers, and the template directory this hook was rendered in (absolute: cookiecutter
    renders hooks inside the template directory, whatever path named it). Valid only after Jinja
    rendered this file: `tojson` twice makes a Python string literal of a JSON document."""
    context = json.loads({{ cookiecutter | tojson | tojson }})  # noqa: F821 (Jinja fills it)
    render_dir = json.loads({{ render_dir | tojson | tojson }})  # noqa: F821
    return context, Path(render_dir)


def template_dir(repo_dir: str, render_dir: Path) -> Path:
    """Where the template is: cookiecutter's _repo_dir is relative to the directory it was started
    in (unknown here, where the working directory is the new project), so a relative one is taken
    from the directory the hook was rendered in, which is the template itself."""
    path = Path(repo_dir)
    if path.is_absolute():
        return path
    return render_dir


def main() -> int:
    project = Path.cwd()
    context, render_dir = rendered_context()
    make_executable(project)
    lib_dir = render_dir / "lib"
    if (lib_dir / "pyproject.toml").is_file():
        wheel = build_wheel(lib_dir, project / "wheels")
        pin_library(project, wheel.name.split("-")[1])
    if (render_dir / "constraints.txt").is_file():
        write_constraints(render_dir, project)
    else:
        print(f"note: no library at {lib_dir}; install labrun from the package index")
    remove_excluded(
        project,
        use_slurm=context["use_slurm"] is True,
        use_github_actions=context["use_github_actions"] is True,
    )
    # cruft renders without _repo_dir and writes .cruft.json itself; plain cookiecutter has it.
    repo_dir = context.get("_repo_dir")
    if repo_dir and not write_cruft_state(project, context, template_dir(repo_dir, render_dir)):
        print("note: the template is not a clean git checkout (no commit, or uncommitted changes),")
        print("      so no .cruft.json was written; link the project later with")
        print("      `cruft link <template url>` to get updates.")
    print(next_steps(context["project_slug"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
