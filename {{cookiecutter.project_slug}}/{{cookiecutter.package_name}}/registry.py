"""Names of registered functions, read from a module's source without importing it.

config.py builds `--model`'s choices from model.py's `@register_model("name", help="...")`
lines this way: model.py imports torch, which `--help` must not wait for.
"""

from __future__ import annotations

import ast
from pathlib import Path


def decorated_names(source: Path, decorator: str) -> dict[str, str]:
    """{name: help} of every `@decorator("name", help="...")` on a top-level function."""
    names = {}
    for node in ast.parse(Path(source).read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Name)
                and deco.func.id == decorator
                and deco.args
            ):
                continue
            try:
                name = ast.literal_eval(deco.args[0])
                help_text = next(
                    (ast.literal_eval(k.value) for k in deco.keywords if k.arg == "help"), ""
                )
            except ValueError as e:
                raise ValueError(
                    f"{source}:{deco.lineno}: @{decorator} needs string literals "
                    "(config.py reads them without importing the module)"
                ) from e
            names[name] = help_text
    return names
