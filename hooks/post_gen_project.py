"""Finish the generated project: executable scripts, excluded options removed, next steps.

Rendered by Jinja before it runs, but the answers reach it only as data (one JSON document inside a
Python string literal, see rendered_context); the functions take plain arguments so the template's
tests import and call them on a directory of their own.
"""

import base64
import hashlib
import json
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
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


# A fixed time stamp for every file of the wheel: the same library gives the same bytes, so an
# unchanged library makes no diff in a project's `cruft update`.
WHEEL_DATE = (2020, 1, 1, 0, 0, 0)


def build_wheel(lib_dir: Path, out_dir: Path) -> Path:
    """A pure-Python wheel of the library (lib/) in out_dir, written directly (a wheel is a zip
    with three metadata files): no build backend and no network needed while rendering. The
    project installs it with `pip install wheels/labrun-*.whl -e .` until the lab publishes it
    (a file named on the command line, not --find-links, which would replace pip's configured
    find-links, where a machine may keep its torch build)."""
    meta = tomllib.loads((lib_dir / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name, version = meta["name"], meta["version"]
    dist_info = f"{name}-{version}.dist-info"
    files = {}
    package_dir = lib_dir / "src" / name
    for path in sorted(package_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".sh"):
            files[f"{name}/{path.relative_to(package_dir).as_posix()}"] = path.read_bytes()
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        f"Summary: {meta.get('description', '')}",
        f"Requires-Python: {meta.get('requires-python', '>=3.11')}",
        *(f"Requires-Dist: {dep}" for dep in meta.get("dependencies", [])),
    ]
    files[f"{dist_info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: lab-template\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    scripts = meta.get("scripts", {})
    if scripts:
        lines = ["[console_scripts]", *(f"{k} = {v}" for k, v in scripts.items())]
        files[f"{dist_info}/entry_points.txt"] = ("\n".join(lines) + "\n").encode()
    record = []
    for arcname, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{arcname},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for arcname, data in files.items():
            info = zipfile.ZipInfo(arcname, date_time=WHEEL_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return wheel


def next_steps(slug: str) -> str:
    return "\n".join(
        [
            f"Created {slug}/. Next (README.md, 'Install' and 'First steps'):",
            f"  cd {slug}",
            "  pip install torch --index-url https://download.pytorch.org/whl/cpu  # CPU build",
            "  pip install wheels/labrun-*.whl -e '.[dev]'   # the lab's library, then the project",
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
        build_wheel(lib_dir, project / "wheels")
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
