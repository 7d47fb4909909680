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
