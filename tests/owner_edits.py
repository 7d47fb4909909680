"""The project README's edits of run.py ("The method's flags", "Another optimizer"), made to a
rendered project as the README words them: its code blocks, taken from the README itself, replace
the Config fields, the statements and the line the README names."""

import ast
import re
from pathlib import Path

SECTION = "### Another optimizer"


def optimizer_blocks(project: Path) -> list[str]:
    """The ```python blocks of the README's "Another optimizer" section, in order: SGD's Config
    lines, SGD's opt/sched, LBFGS's Config line, LBFGS's opt/sched, layout and closure step."""
    readme = (project / "README.md").read_text()
    start = readme.index(SECTION)
    section = readme[start : readme.index("\n## ", start)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 6, blocks
    return blocks


def replace_fields(text: str, names: tuple[str, ...], block: str) -> str:
    """The Config lines `name: ... = flag(...)` of `names` replaced by `block` (at the first)."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines)
             if re.match(rf"    ({'|'.join(names)}): \w+ = ", line)]  # fmt: skip
    assert len(found) == len(names), (names, found)
    for i in reversed(found[1:]):
        del lines[i]
    lines[found[0]] = block
    return "".join(lines)


def replace_statements(text: str, names: tuple[str, ...], block: str) -> str:
    """The statements of build() that assign `names` (consecutive) replaced by `block`."""
    tree = ast.parse(text)
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    spans = [(s.lineno, s.end_lineno) for s in build.body if isinstance(s, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id in names for t in s.targets)]  # fmt: skip
    assert len(spans) == len(names), spans
    lines = text.splitlines(keepends=True)
    first, last = spans[0][0], spans[-1][1]
    # the comments between the statements go with them: they described the old ones
    return "".join(lines[: first - 1]) + block + "".join(lines[last:])


def replace_line(text: str, start: str, block: str) -> str:
    """The one line that starts (after its indent) with `start` replaced by `block`."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.strip().startswith(start)]
    assert len(found) == 1, (start, found)
    lines[found[0]] = block
    return "".join(lines)


def sgd_edit(project: Path) -> None:
    config, optimizer, *_ = optimizer_blocks(project)
    run_py = project / "run.py"
    text = replace_fields(run_py.read_text(), ("lr", "warm_up"), config)
    run_py.write_text(replace_statements(text, ("opt", "sched"), optimizer))


def lbfgs_edit(project: Path) -> None:
    *_, config, optimizer, layout, step = optimizer_blocks(project)
    run_py = project / "run.py"
    text = replace_fields(run_py.read_text(), ("lr", "weight_decay", "warm_up"), config)
    text = replace_statements(text, ("opt", "sched"), optimizer)
    text = replace_line(text, "layout = data.layout", layout)
    run_py.write_text(replace_line(text, "scaler.step(opt)", step))
