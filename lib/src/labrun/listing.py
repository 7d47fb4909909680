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
from dataclasses import asdict, replace

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
    registries = {
        "register_model": models.MODELS,
        "register_dataset": datasets.DATASETS,
        "register_task": tasks.TASKS,
    }
    listed: dict = {d: {} for d in DECORATORS}

    def take(module_of) -> None:
        """Store what was registered since the last call, by the module module_of(entry)."""
        for decorator, registry in registries.items():
            for name, entry in registry.items():
                if name not in listed[decorator]:
                    stored = asdict(describe(entry, module_of(entry)))
                    stored["params"] = {k: repr(v) for k, v in stored["params"].items()}
                    stored["unused"] = sorted(stored["unused"])
                    listed[decorator][name] = stored

    take(lambda entry: entry.build.__module__)  # built-ins
    for module, path in _modules():
        if any(d in path.read_text(encoding="utf-8") for d in DECORATORS):
            importlib.import_module(module)
            take(lambda entry, module=module: module)
    return listed


def describe(entry: Entry, module: str) -> Entry:
    """`entry` as a listing holds it: no function, the module that registered it, and the
    function's parameters."""
    params, unused = _parameters(entry.build, entry.where)
    return replace(entry, build=None, module=module, params=params, unused=unused)


def _parameters(fn, where: str) -> tuple[dict, frozenset]:
    """{name: literal default or REQUIRED} of a function's parameters, and the ones its body
    never names (read from its source; none when it has no source, e.g. a lambda's)."""
    params = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = param.default
        if default is param.empty:
            params[param.name] = REQUIRED
            continue
        try:  # a literal, so that the listing can hold it (and --model-args type by it)
            ast.literal_eval(repr(default))
        except (ValueError, SyntaxError):
            raise ValueError(
                f"{where}: the default of {param.name!r} must be a literal, got {default!r}"
            ) from None
        params[param.name] = default
    try:
        source = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return params, frozenset()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    node = next((n for n in ast.walk(source) if isinstance(n, functions)), None)
    if node is None:
        return params, frozenset()
    body = node.body if isinstance(node.body, list) else [node.body]
    named = {n.id for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    return params, frozenset(params) - named


if __name__ == "__main__":
    main()
