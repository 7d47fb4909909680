"""Finish the generated project: executable scripts, excluded options removed, next steps.

Rendered by Jinja before it runs, but the answers reach it only as data (one JSON document inside a
Python string literal, see rendered_context); the functions take plain arguments so the template's
tests import and call them on a directory of their own.
"""

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

EXECUTABLES = ("run.sh", "scripts/sweep_lib.sh", "scripts/slurm_task.sh")
# Files that exist only for an option; removed when the option is off.
SLURM_FILES = ("scripts/slurm_task.sh", "tests/test_slurm.py")
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


def next_steps(slug: str) -> str:
    return "\n".join(
        [
            f"Created {slug}/. Next (README.md, 'Install' and 'First steps'):",
            f"  cd {slug}",
            "  pip install torch --index-url https://download.pytorch.org/whl/cpu  # CPU build",
            "  pip install -e '.[dev]'      # uv: uv pip install -r pyproject.toml --extra cpu ...",
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
