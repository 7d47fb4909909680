"""Finish the generated project: executable scripts, excluded options removed, next steps.

Rendered by Jinja before it runs; the functions take plain arguments so the template's
tests import and call them on a directory of their own.
"""

import shutil
import stat
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


def next_steps(slug: str) -> str:
    return "\n".join(
        [
            f"Created {slug}/. Next:",
            f"  cd {slug} && python -m pip install -e '.[dev]'",
            "  bash run.sh --dry-run        # list the sweep's jobs",
            "  bash run.sh && python plot.py  # run it, then make the figures",
        ]
    )


def main() -> int:
    project = Path.cwd()
    make_executable(project)
    remove_excluded(
        project,
        use_slurm="{{ cookiecutter.use_slurm }}" == "True",
        use_github_actions="{{ cookiecutter.use_github_actions }}" == "True",
    )
    print(next_steps("{{ cookiecutter.project_slug }}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
