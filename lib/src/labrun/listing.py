"""The child process of registry.py: imports the registering modules and prints, as JSON, what
each registered (`python -m labrun.listing`, run by registry._list_in_child with LABRUN_LISTING
set). Its own module, so that the registries it imports never import it back."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
import textwrap

from . import datasets, models, tasks
from .registry import DECORATORS, REQUIRED, Entry, _modules


def main() -> None:
    """The child of _list_in_child: the listing as JSON on stdout, or one `error:` line."""
    try:
        listed = collect()
    except Exception as exc:  # noqa: BLE001 (any import failure is the user's to read)
        print(f"error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        sys.exit(2)
    json.dump(listed, sys.stdout)


def collect() -> dict:
    """Import the library's registries (their modules register the built-ins) and every module
    of the project's package that names a register function; {decorator: {name: Entry as
    JSON}} of what each registered."""
    registries = (models.MODELS, datasets.DATASETS, tasks.TASKS)
    listed: dict = {registry.decorator: {} for registry in registries}

    def take(module_of) -> None:  # what was registered since the last call
        for registry in registries:
            for name, entry in registry.items():
                if name not in listed[registry.decorator]:
                    listed[registry.decorator][name] = describe(entry, module_of(entry))

    take(lambda entry: entry.build.__module__)  # built-ins
    for module, path in _modules():
        if any(d in path.read_text(encoding="utf-8") for d in DECORATORS):
            importlib.import_module(module)
            take(lambda entry, module=module: module)
    return listed


def describe(entry: Entry, module: str) -> dict:
    """`entry` as a listing stores it (JSON; registry._entry reads it back): no function."""
    params, unused = _parameters(entry.build, entry.where)
    return {**vars(entry), "build": None, "module": module, "params": params, "unused": unused}


def _parameters(fn, where: str) -> tuple[dict, list]:
    """{name: repr of its literal default (or of REQUIRED)} of a function's parameters, and those
    its body never names, sorted (none when it has no source, e.g. a lambda's)."""
    params = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = REQUIRED if param.default is param.empty else param.default
        try:  # a literal, so that the listing can hold it (and --model-args type by it)
            ast.literal_eval(repr(default))
        except (ValueError, SyntaxError):
            raise ValueError(
                f"{where}: the default of {param.name!r} must be a literal, got {default!r}"
            ) from None
        params[param.name] = repr(default)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    try:
        source = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
        node = next(n for n in ast.walk(source) if isinstance(n, functions))
    except (OSError, TypeError, SyntaxError, StopIteration):
        return params, []
    body = node.body if isinstance(node.body, list) else [node.body]
    named = {n.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    return params, sorted(set(params) - named)


if __name__ == "__main__":
    main()
