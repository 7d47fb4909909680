"""Shared helpers of the template's self-tests: the option matrix and a renderer."""

import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
CONFIG = json.loads((TEMPLATE / "cookiecutter.json").read_text())
BIN = Path(sys.executable).parent  # ruff, shellcheck, cruft live beside the interpreter


def prompted(config: dict = CONFIG) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def option_matrix(config: dict = CONFIG) -> list[dict]:
    """Renders that cover every option value, derived from cookiecutter.json.

    Switches (JSON booleans) decide which files exist, so they interact: their full product is
    rendered. Choice lists only change text, so they are cycled across those renders, adding
    renders until every choice value has appeared at least once.
    """
    options = prompted(config)
    switches = {k: [True, False] for k, v in options.items() if isinstance(v, bool)}
    choices = {k: v for k, v in options.items() if isinstance(v, list)}
    combos = itertools.product(*switches.values())
    product = [dict(zip(switches, values, strict=True)) for values in combos]
    n = max([len(product), *(len(v) for v in choices.values())])
    return [
        {**product[i % len(product)], **{k: v[i % len(v)] for k, v in choices.items()}}
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def template_copy(tmp_path_factory) -> Path:
    """The template outside git, so no render gets a .cruft.json that depends on the checkout."""
    copy = tmp_path_factory.mktemp("template") / "template"
    shutil.copytree(
        TEMPLATE, copy,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.pyc",
                                      ".pytest_cache", ".ruff_cache"),
    )
    return copy


@pytest.fixture
def bake(template_copy, tmp_path):
    """Render the template with some answers into a fresh directory; return the project."""

    def _bake(output_dir: Path | None = None, **answers) -> Path:
        output_dir = output_dir or tmp_path / "out"
        project = cookiecutter(
            str(template_copy), no_input=True, extra_context=answers, output_dir=str(output_dir)
        )
        return Path(project)

    return _bake


# Skips of the generated project's own suite (CUDA tests without a GPU, the Slurm test without a
# cluster), collected by test_generated_project.py and listed at the end of the run, so that
# `scripts/test.sh` says what the nested suite did not test, and why.
GENERATED_SKIPS: dict[str, list[tuple[int, str]]] = {}


def record_generated_skips(render: str, lines: list[tuple[int, str]]) -> None:
    """lines: (tests skipped, "location: reason") per `SKIPPED [N] ...` line of pytest -rs."""
    GENERATED_SKIPS[render] = lines


def pytest_terminal_summary(terminalreporter):
    if not GENERATED_SKIPS:
        return
    terminalreporter.section("skipped in the generated project's suite")
    for render, lines in GENERATED_SKIPS.items():
        total = sum(n for n, _ in lines)
        terminalreporter.write_line(f"{render}: {total} skipped ({len(lines)} locations)")
        for n, line in lines:
            terminalreporter.write_line(f"  [{n}] {line}")
