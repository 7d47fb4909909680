"""Registries of models, datasets and tasks declared in the library or anywhere in the project's
package (project.py), read without importing them.

A model or dataset of your own may live in any module of the project's package: model.py,
data.py, a new file (`mymodels.py`) or a folder (`models/unet.py`, no `__init__.py`
needed). config.py builds `--model`'s and `--dataset`'s choices and help from the
`@register_model("name", help="...")` and `@register_dataset(...)` lines of every module, read
from their source (the modules import torch, which `--help` must not wait for): write the name
and the help as plain string literals (and a model function's parameter defaults: models.py).
When a run asks for a name, the module that declares it is imported then (`Registry`), so its
decorator registers the function.
"""

from __future__ import annotations

import ast
import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path

from . import project

LIBRARY_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Declared:
    """One `@decorator("name", ...)` line: where it is and its literal arguments."""

    name: str
    help: str
    module: str  # dotted and absolute: "labrun.datasets", "lab_project.models.unet"
    where: str  # file:line, for error messages
    keywords: dict = field(default_factory=dict)  # the other literal keywords (needs_data_path)
    # The function's parameters in order: name -> its literal default (REQUIRED: none). A model
    # function's parameters that the data does not give are its own size arguments
    # (models.model_arguments); `unused` are those its body never names (ignored, not shown).
    params: dict = field(default_factory=dict)
    unused: frozenset = frozenset()


REQUIRED = "<required>"  # Declared.params: a parameter without a default


def decorated_names(source: Path, decorator: str) -> dict[str, str]:
    """{name: help} of every `@decorator("name", help="...")` on a top-level function."""
    return {d.name: d.help for d in _declared_in(Path(source), decorator, module="")}


def _declared_in(source: Path, decorator: str, module: str) -> list[Declared]:
    found = []
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
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
            where = f"{source}:{deco.lineno}"
            try:
                name = ast.literal_eval(deco.args[0])
                keywords = {k.arg: ast.literal_eval(k.value) for k in deco.keywords}
            except ValueError as e:
                raise ValueError(
                    f"{where}: @{decorator} needs literal arguments "
                    "(config.py reads them without importing the module)"
                ) from e
            help_text = str(keywords.pop("help", ""))
            params, unused = _parameters(node, where)
            found.append(Declared(name, help_text, module, where, keywords, params, unused))
    return found


def _parameters(node: ast.FunctionDef, where: str) -> tuple[dict, frozenset]:
    """{name: literal default or REQUIRED} of a function's parameters, and the ones its body
    never names."""
    positional = node.args.posonlyargs + node.args.args
    defaults = [REQUIRED] * (len(positional) - len(node.args.defaults)) + node.args.defaults
    pairs = list(zip(positional, defaults, strict=True))
    pairs += zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)
    params = {}
    for arg, default in pairs:
        if default is None or default == REQUIRED:
            params[arg.arg] = REQUIRED
            continue
        try:
            params[arg.arg] = ast.literal_eval(default)
        except ValueError:
            raise ValueError(
                f"{where}: the default of {arg.arg!r} must be a literal "
                "(config.py reads it without importing the module)"
            ) from None
    named = {n.id for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    return params, frozenset(params) - named


def packages() -> list[tuple[str, Path]]:
    """(import name, folder) of the packages searched: the library's, then the project's."""
    found = [(__package__, LIBRARY_DIR)]
    here = project.current()
    if here.package and here.package_dir.is_dir():
        found.append((here.package, here.package_dir))
    return found


@functools.cache
def declarations(decorator: str) -> dict[str, Declared]:
    """{name: Declared} of every `@decorator(...)` in every module of the library and of the
    project's package (sorted by path; model.py and data.py first). A name declared twice is an
    error naming both."""
    found: dict[str, Declared] = {}
    for package, package_dir in packages():
        modules = sorted(
            (p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts),
            key=lambda p: (p.name not in ("model.py", "data.py"), p.relative_to(package_dir)),
        )
        for path in modules:
            parts = path.relative_to(package_dir).with_suffix("").parts
            if any(part.startswith(".") for part in parts):
                continue
            module = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            for d in _declared_in(path, decorator, module):
                if d.name in found:
                    raise ValueError(
                        f"{d.where}: @{decorator}({d.name!r}) is also at {found[d.name].where}"
                    )
                found[d.name] = d
    return found


class Registry(dict):
    """name -> entry, filled by the decorator as modules are imported. Asking for a name that
    another module of the package declares (`name in registry`, `registry[name]`) imports that
    module first, so a model in `models/unet.py` is found like one in model.py."""

    def __init__(self, decorator: str) -> None:
        super().__init__()
        self.decorator = decorator

    def _import_declaring(self, name) -> None:
        declared = declarations(self.decorator).get(name)
        if declared is not None:
            importlib.import_module(declared.module)

    def __contains__(self, name) -> bool:
        if not super().__contains__(name):
            self._import_declaring(name)
        return super().__contains__(name)

    def __missing__(self, name):
        self._import_declaring(name)
        if super().__contains__(name):
            return super().__getitem__(name)
        raise KeyError(name)

    def add(self, name: str, entry) -> None:
        """What the decorator calls: a name registered twice is an error."""
        if super().__contains__(name):
            raise ValueError(f"{self.decorator}: {name!r} is registered twice")
        self[name] = entry
