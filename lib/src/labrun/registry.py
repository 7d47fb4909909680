"""Registries of models, datasets and tasks registered in the library or anywhere in the project's
package (project.py), listed without importing torch in the asking process.

`--help` and the sweep's planning need every name, its help and a model function's parameters,
but must not wait for torch, which the registering modules import. So the registrations are
listed once by running them, in a child process (listing.py: it imports every module of the
package that names a register function), and kept in `<project>/.cache/registry.json` with a
hash of those modules' sources (lib/README.md, "Models: the registry"). A run that asks for a
name imports the module that registered it (`Registry`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import project
from .dataversion import read_json_cache
from .runs import _files_hash, atomic_write_text

LIBRARY_DIR = Path(__file__).resolve().parent
DECORATORS = ("register_model", "register_dataset", "register_task")
# The library's modules whose code makes the listing (the built-ins, the register functions).
LISTING_INPUTS = ("datasets.py", "tasks.py", "models.py", "registry.py", "listing.py")
CACHE = Path(".cache") / "registry.json"  # under the project's root (.gitignore: .cache/)
# Set in the child that lists: there the listing is empty (labrun.config, imported by the
# registering modules, asks for it at import), never listed again in a grandchild.
LISTING_ENV = "LABRUN_LISTING"
FIRST = ("model.py", "data.py")  # the project's modules imported first when listing


REQUIRED = "<required>"  # Entry.params: a parameter without a default


@dataclass(frozen=True)
class Entry:
    """One registration: a model's or task's builder or a dataset's loader (`build`), and what a
    run needs to know of it. A listing (listing.py) holds it without `build` (None), with the
    module that registered it and the function's parameters."""

    name: str
    help: str = ""
    build: Callable | None = None
    needs_data_path: bool = False  # datasets: refused without --data-path
    where: str = ""  # file:line, for error messages
    module: str = ""  # dotted and absolute: "labrun.datasets", "lab_project.models.unet"
    # The function's parameters in order: name -> its literal default (REQUIRED: none). A model
    # function's parameters that the data does not give are its own size arguments
    # (models.model_arguments); `unused` are those its body never names (ignored, not shown).
    params: dict = field(default_factory=dict)
    unused: frozenset = frozenset()


class Registry(dict):
    """name -> entry, filled by the register functions as modules are imported. `name in
    registry` (ask so before `registry[name]`) imports the module that registers it first."""

    def __init__(self, decorator: str) -> None:
        super().__init__()
        self.decorator = decorator

    def __contains__(self, name) -> bool:
        listed = declarations(self.decorator).get(name)
        if not super().__contains__(name) and listed is not None:
            importlib.import_module(listed.module)
        return super().__contains__(name)

    def register(self, name: str, *, help: str = "", **keywords):
        """register_model/_dataset/_task(name, help=...): a decorator that registers `fn` as
        `name` (Entry's other fields by keyword); a name registered twice is an error naming
        both places."""

        def add(fn):  # `where`: file:line, of the function a functools.partial wraps
            target = inspect.unwrap(getattr(fn, "func", fn))
            code = getattr(target, "__code__", None)
            where = repr(target) if code is None else f"{code.co_filename}:{code.co_firstlineno}"
            if dict.__contains__(self, name):
                raise ValueError(
                    f"{where}: @{self.decorator}({name!r}) is also at {dict.get(self, name).where}"
                )
            self[name] = Entry(name, help, fn, where=where, **keywords)
            return fn

        return add


def _modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of the project's package (none without one), model.py
    and data.py first, then by path; hidden files and folders and __pycache__ left out."""
    here = project.current()
    if not here.package or not (package_dir := here.root / here.package).is_dir():
        return []
    found = []
    for path in sorted(package_dir.rglob("*.py"), key=lambda p: (p.name not in FIRST, p)):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if not any(part.startswith(".") or part == "__pycache__" for part in parts):
            found.append((".".join((here.package, *(p for p in parts if p != "__init__"))), path))
    return found


def _fingerprint() -> str:
    """A hash of the texts the listing depends on: the project's modules and the library's own,
    by their absolute paths (an entry's `where` names them), as a run's code version hashes
    files (runs._files_hash)."""
    sources = [path for _, path in _modules()] + [LIBRARY_DIR / name for name in LISTING_INPUTS]
    return _files_hash(Path("/"), [str(path) for path in sources])


@functools.cache
def _listing() -> dict[str, dict[str, dict]]:
    """{decorator: {name: Entry as listing.describe stored it}}: from the cache while the sources
    hash the same, else listed again in a child process and cached."""
    if os.environ.get(LISTING_ENV):
        return {decorator: {} for decorator in DECORATORS}
    fingerprint = _fingerprint()
    root = project.current().root
    # Outside a project (no pyproject.toml found), nothing is written into the working folder.
    cache = root / CACHE if (root / "pyproject.toml").is_file() else None
    listed = (cache and read_json_cache(cache)) or {}
    if listed.get("fingerprint") != fingerprint:
        listed = {"fingerprint": fingerprint, **_list_in_child()}
        with contextlib.suppress(OSError):  # a read-only project lists every time
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(cache, json.dumps(listed))  # atomic: jobs may list at once
    return listed


def _entry(stored: dict) -> Entry:
    """An Entry as listing.describe stored it in JSON: the defaults as their repr."""
    params = {k: ast.literal_eval(v) for k, v in stored["params"].items()}
    return Entry(**{**stored, "params": params, "unused": frozenset(stored["unused"])})


def _list_in_child() -> dict:
    """`collect()` in a child process (it imports torch), in this project and with this
    labrun; ValueError with the child's message when a module cannot be imported or registers
    a name twice."""
    root = project.current().root
    paths = [str(root), str(LIBRARY_DIR.parent), *sys.path]
    env = {**os.environ, "LABRUN_PROJECT": str(root), "PYTHONPATH": os.pathsep.join(paths)}
    env[LISTING_ENV] = "1"
    child = [sys.executable, "-m", "labrun.listing"]
    done = subprocess.run(child, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise ValueError(f"listing the registered names: {lines[-1].removeprefix('error: ')}")
    return json.loads(done.stdout)


@functools.cache
def declarations(decorator: str) -> dict[str, Entry]:
    """{name: Entry (listed: no `build`)} of every registration by `decorator` in the library
    and the project's package. A name registered twice is an error naming both places."""
    return {name: _entry(e) for name, e in _listing()[decorator].items()}
