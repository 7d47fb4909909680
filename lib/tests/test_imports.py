"""The shape of labrun's imports and names, read from its sources (ast): no import circle; the
core never imports the optional tools (labrun/tools/) nor the results side (analysis, figures)
nor the sweep engine (sweep.py: run.sh's queue); a public class or function name means one thing.

Module level = what runs when the module is imported (class bodies, `if` and `try` blocks
included; `if TYPE_CHECKING:` and `if __name__ == "__main__":` are not); an import inside a
function runs when the function is called (lazy)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import labrun

PACKAGE = Path(labrun.__file__).parent
TOOLS = "tools"  # labrun/tools/: gpucheck, tuning, similarity, reference
# Not the core, yet not tools: what reads finished runs (plot.py, analyze.py) and the sweep
# engine: run.sh's queue (sweep, sweepjobs, slots, jobqueue), its query of every job's state
# (`SCRIPT --plan`) and its MLflow follower (with `tracking sync`, which mirrors finished runs). No
# single run needs them: a job imports plan only when run.sh asks `--plan`.
SIDE = {"analysis", "ckaresults", "figures", "plan", "follower"}
SIDE |= {"sweep", "sweepjobs", "slots", "jobqueue"}
# The core's lazy imports of the side, each where a flag asks for it: run.py's --profile
# (session.py: its memory history from the start); run.sh's `SCRIPT --plan` (jobs.py);
# `python -m labrun.gpucheck`, the command every project's README gives (gpucheck.py runs
# labrun.tools.gpucheck and nothing else); `python -m labrun.tracking sync` (follower.py).
LAZY_ALLOWED = {
    ("session", "tools.tuning"),
    ("jobs", "plan"),
    ("gpucheck", "tools.gpucheck"),
    ("tracking", "follower"),
}
# Verbs that the module's name qualifies where they are called (`checkpoint.save`,
# `figures.save`, `jobs.main`): one per module, never imported bare.
QUALIFIED = {"main", "build_parser", "parse_args", "save", "describe"}


def module_names() -> set[str]:
    """labrun's modules, dotted from the package: "session", "tools.tuning"; packages by their
    name ("tools" for tools/__init__.py)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        names.add(_dotted(parts))
    return names


def _dotted(parts: tuple[str, ...]) -> str:
    """("tools", "tuning") -> "tools.tuning"; a package by its name; labrun's own __init__."""
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


MODULES = module_names()


def _runs_at_import(test: ast.expr) -> bool:
    """False for the blocks that an import of the module does not run."""
    text = ast.unparse(test)
    return text not in ("TYPE_CHECKING", "typing.TYPE_CHECKING", "__name__ == '__main__'")


def _imports(node: ast.AST, package: list[str], top: bool, found: set[tuple[str, bool]]) -> None:
    """Add (labrun module, at module level) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                if alias.name.split(".")[0] == PACKAGE.name:
                    found.add((alias.name.removeprefix(PACKAGE.name).lstrip("."), top))
        elif isinstance(child, ast.ImportFrom):
            module = child.module or ""
            if child.level:  # relative: from the module's own package, up level - 1
                base = package[: len(package) - child.level + 1]
            elif module.split(".")[0] == PACKAGE.name:
                base, module = [], module.removeprefix(PACKAGE.name).lstrip(".")
            else:
                continue
            stem = ".".join([*base, *module.split(".")] if module else base)
            for alias in child.names:  # `from . import reference`: the name is a module
                sub = f"{stem}.{alias.name}" if stem else alias.name
                found.add((sub if sub in MODULES else stem or "__init__", top))
        else:  # a function's body runs when called; some `if` blocks never at import
            lazy = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) or (
                isinstance(child, ast.If) and not _runs_at_import(child.test)
            )
            _imports(child, package, top and not lazy, found)


def public_names() -> dict[str, list[str]]:
    """{public top-level class or function name: the modules that define it}."""
    kinds = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _dotted(path.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, kinds) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(module)
    return found


def package_imports(level: str = "any") -> dict[str, set[str]]:
    """{module: the labrun modules it imports}: at module level ("module"), or anywhere
    ("any": lazy imports too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        package = list(parts[:-1])
        name = _dotted(parts)
        found: set[tuple[str, bool]] = set()
        _imports(ast.parse(path.read_text(encoding="utf-8")), package, True, found)
        graph[name] = {m for m, top in found if top or level == "any"} - {name}
    return graph


def is_core(module: str) -> bool:
    return module.split(".")[0] not in {TOOLS, *SIDE}


def test_the_graph_reads_relative_and_absolute_imports():
    """The reader itself, on imports this package has: if it missed them, every test below
    would pass on an empty graph."""
    anywhere, top = package_imports("any"), package_imports("module")
    assert "tools.reference" in anywhere["tools.gpucheck"]  # from . import reference (lazy)
    assert "augment" in top["tools.reference"]  # from ..augment import MEAN, STD
    assert "tools.tuning" in anywhere["session"] - top["session"]  # lazy, for --profile
    assert "tools.gpucheck" in anywhere["gpucheck"] - top["gpucheck"]  # under __main__
    assert {"tools", "tools.gpucheck", "session", "jobs"} <= set(top)


def test_no_import_circle_among_labruns_modules():
    """No circle at module level (where one makes imports depend on their order), nor with the
    lazy imports counted: the only arrows that may run back up are LAZY_ALLOWED's, from the core
    to what a flag asks for, which then may import the core."""
    for level in ("module", "any"):
        graph = package_imports(level)
        for module, imported in LAZY_ALLOWED:
            graph[module].discard(imported)
        try:
            graphlib.TopologicalSorter(graph).prepare()
        except graphlib.CycleError as e:
            pytest.fail(f"import circle ({level} level): {' -> '.join(e.args[1])}")


def test_the_core_never_imports_a_tool_nor_the_results_side():
    module_level = package_imports("module")
    anywhere = package_imports("any")
    core = sorted(m for m in module_level if is_core(m))
    assert {"session", "jobs", "runs", "tracking", "data"} <= set(core)
    wrong = [
        f"{m} imports {i} at module level"
        for m in core
        for i in sorted(module_level[m])
        if not is_core(i)
    ]
    wrong += [
        f"{m} imports {i} (lazily) without a flag asking for it: name it in LAZY_ALLOWED"
        for m in core
        for i in sorted(anywhere[m] - module_level[m])
        if not is_core(i) and (m, i) not in LAZY_ALLOWED
    ]
    assert not wrong, "\n".join(wrong)


def test_a_public_name_means_one_thing():
    """Two `Run` (the run's context, a finished run's numbers), two `lifecycle`, two
    `code_version` meaning different things were found here (issue 35); `Run` went (issue 46):
    a training job is a TrainingJob, a job of any script a jobs.Job."""
    names = public_names()
    assert "Run" not in names and names["RunResult"] == ["analysis"]
    assert names["TrainingJob"] == ["session"] and names["Job"] == ["jobs"]
    twice = {n: m for n, m in names.items() if len(m) > 1 and n not in QUALIFIED}
    assert not twice, f"defined in more than one module: {twice}"
