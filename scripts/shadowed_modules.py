"""Top-level modules of the generated project's whole dependency closure.

A package_name equal to one of these would shadow a module some dependency imports (the project
renders, then `run.py` dies with "No module named 'scipy.sparse'"). The pre-generation check reads
the list from hooks/shadowed_modules.txt; this script computes it from the installed packages of
the environment it runs in (the template's .venv, where the generated project's dependencies are
installed), starting from the generated pyproject.toml's dependencies and its `dev` extra.

Usage: python scripts/shadowed_modules.py            print the computed names
       python scripts/shadowed_modules.py --update   add them to hooks/shadowed_modules.txt

--update keeps names already stored, so lists computed on several machines (a CUDA build of torch
brings `triton` and `nvidia`) accumulate. tests/test_hooks.py fails when the installed closure has
a module the stored list lacks.
"""

import argparse
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

TEMPLATE = Path(__file__).resolve().parents[1]
STORED = TEMPLATE / "hooks" / "shadowed_modules.txt"
PROJECT_PYPROJECT = TEMPLATE / "{{cookiecutter.project_slug}}" / "pyproject.toml"
HEADER = (
    "# Top-level modules of the generated project's dependency closure: a package_name equal to\n"
    "# one of them is refused. Written by scripts/shadowed_modules.py --update; do not edit.\n"
)


def project_requirements(pyproject: Path = PROJECT_PYPROJECT) -> list[Requirement]:
    """The generated project's runtime and `dev` requirements, read from its unrendered
    pyproject.toml (the dependency lines hold no template syntax)."""
    text = pyproject.read_text()
    requirements = []
    for block in ("dependencies", "dev"):
        match = re.search(rf"^{block} = \[(.*?)\]", text, re.S | re.M)
        if match:
            requirements += [Requirement(r) for r in re.findall(r'"([^"]+)"', match.group(1))]
    return requirements


def top_level_modules(dist: metadata.Distribution) -> set[str]:
    """Importable top-level names a distribution installs: top_level.txt where the wheel has it,
    otherwise the first component of every module or package path in its RECORD."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return {name.strip() for name in listed.split() if name.strip()}
    names = set()
    for path in dist.files or []:
        first = path.parts[0]
        if first.endswith((".dist-info", ".data", ".egg-info")) or first in ("..", "__pycache__"):
            continue
        if len(path.parts) == 1:
            if path.suffix not in (".py", ".so", ".pyd") or first.endswith(".pth"):
                continue
            first = first.split(".")[0]
        if first.isidentifier():
            names.add(first)
    return names


def closure_modules(roots: list[Requirement]) -> set[str]:
    """Walk the requirement graph through the installed distributions (markers evaluated for
    this machine, extras followed), collecting every top-level module name."""
    seen: set[tuple[str, frozenset]] = set()
    modules: set[str] = set()
    pending = [(r, frozenset(r.extras)) for r in roots]
    while pending:
        requirement, extras = pending.pop()
        key = (re.sub(r"[-_.]+", "-", requirement.name).lower(), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (another platform's dependency): nothing to import
        modules |= top_level_modules(dist)
        for text in dist.requires or []:
            child = Requirement(text)
            environments = [{"extra": e} for e in extras] or [{"extra": ""}]
            if child.marker is None or any(child.marker.evaluate(env) for env in environments):
                pending.append((child, frozenset(child.extras)))
    return {m for m in modules if not m.startswith("_")}


def stored_modules(path: Path = STORED) -> set[str]:
    lines = path.read_text().splitlines() if path.exists() else []
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="add the names to the stored list")
    args = parser.parse_args()
    computed = closure_modules(project_requirements())
    if not args.update:
        print("\n".join(sorted(computed)))
        return 0
    names = computed | stored_modules()
    STORED.write_text(HEADER + "\n".join(sorted(names)) + "\n")
    print(f"{STORED.relative_to(TEMPLATE)}: {len(names)} names", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
