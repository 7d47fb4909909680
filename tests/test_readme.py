"""The README's two commands are the ones CI runs, word for word."""

import re

from conftest import TEMPLATE

README = (TEMPLATE / "README.md").read_text()


def readme_commands() -> list[str]:
    """The commands in the README's set-up block (the first ```bash block)."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_gives_exactly_two_commands():
    assert len(readme_commands()) == 2


def test_ci_runs_the_readme_test_command_exactly():
    ci_lines = [line.strip() for line in (TEMPLATE / ".ci" / "run").read_text().splitlines()]
    demo, tests = readme_commands()
    assert tests in ci_lines
    assert demo in ci_lines


def test_readme_options_table_lists_every_option():
    import json

    options = json.loads((TEMPLATE / "cookiecutter.json").read_text())
    for key in options:
        if not key.startswith("_"):
            assert f"`{key}`" in README, f"{key} missing from the README's options table"


def test_project_readme_shows_the_optimizer_edits_its_tests_make(bake):
    """README "Another optimizer" shows SGD and LBFGS as edits of run.py; the project's
    tests/test_run.py makes exactly those edits and trains with them: the same text."""
    import ast

    project = bake()
    readme = (project / "README.md").read_text()
    tree = ast.parse((project / "tests" / "test_run.py").read_text())
    snippets = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("SGD", "LBFGS", "LBFGS_STEP")
    }  # fmt: skip
    assert len(snippets) == 3
    for name, text in snippets.items():
        assert text in readme, f"README lacks the {name} edit as tests/test_run.py makes it"
    run_py = (project / "run.py").read_text()
    assert "scaler.step(opt)  # fp16: skipped if a gradient overflowed" in run_py
