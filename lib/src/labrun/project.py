"""Which project this process works for: its root folder, its package and its MLflow experiment.

A project declares itself in its pyproject.toml (the template writes it):

    [tool.labrun]
    package = "lab_project"       # where @register_model / @register_dataset / @register_task live
    experiment = "lab_project"    # the default MLflow experiment

The root is found without configuration: $LABRUN_PROJECT if set, else the folder of the script
that started Python (run.py, plot.py, analyze.py), else the working directory or the nearest of
its parents that has such a pyproject.toml. Outside any project the working directory is the root,
with no package (the library's built-ins only) and the experiment "labrun".
"""

from __future__ import annotations

import functools
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Project:
    root: Path
    package: str | None
    experiment: str


def _pyproject(folder: Path) -> dict:
    """folder/pyproject.toml, or {} where there is none or it does not parse."""
    try:
        with open(folder / "pyproject.toml", "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


@functools.cache
def current() -> Project:
    if os.environ.get("LABRUN_PROJECT"):
        folders = [Path(os.environ["LABRUN_PROJECT"]).resolve()]
    else:  # the script's folder first, then the working directory and its parents
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        folders, cwd = [Path(script).resolve().parent] if script else [], Path.cwd().resolve()
        folders += [cwd, *cwd.parents]
    for folder in folders:
        table = _pyproject(folder).get("tool", {}).get("labrun")  # [tool.labrun]
        if isinstance(table, dict):
            package = table.get("package")
            return Project(folder, package, str(table.get("experiment") or package or "labrun"))
    return Project(Path.cwd().resolve(), None, "labrun")


def version_warning(root: Path, installed: str) -> str | None:
    """Why the installed labrun is not the one `root`'s pyproject.toml pins (`labrun==X`: a
    project's numbers are those of its pinned machinery), or None. The local part (`+g<hash>`)
    counts where both have one: a release pin takes any build of it, as pip does."""
    needs = _pyproject(root).get("project", {}).get("dependencies", [])
    for requirement in needs if isinstance(needs, list) else []:
        name, pin, version = str(requirement).partition(";")[0].partition("==")
        version, want, have = version.strip(), version.strip(), installed
        if "+" not in want or "+" not in have:  # a release: its public part alone
            want, have = want.split("+")[0], have.split("+")[0]
        if pin and name.strip().lower() == "labrun" and want != have:
            wheel = root / "wheels" / f"labrun-{version}-py3-none-any.whl"
            install = (
                f"pip install {wheel}" if wheel.is_file() else f"pip install labrun=={version}"
            )
            return (
                f"labrun {installed} is installed but {root / 'pyproject.toml'} pins "
                f"labrun=={version}: {install}, or raise the pin (README, 'Update')"
            )
    return None
