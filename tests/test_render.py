"""Render the option matrix derived from cookiecutter.json and check every render."""

import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from conftest import BIN, CONFIG, TEMPLATE, option_matrix, prompted

MATRIX = option_matrix()

# The release with a local part naming the library's code (the post-generation hook's).
_spec = importlib.util.spec_from_file_location("hook", TEMPLATE / "hooks" / "post_gen_project.py")
_hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hook)
LIBRARY_VERSION = _hook.code_version(TEMPLATE / "lib")
# The method only: the machinery is the library (labrun), pinned and shipped as a wheel.
PACKAGE_FILES = ["__init__.py", "model.py", "data.py"]
BASE_FILES = [
    ".gitignore", ".pre-commit-config.yaml", "LICENSE", "README.md", "pyproject.toml",
    "run.py", "run.sh", "plot.py", "analyze.py", "constraints.txt",
    f"wheels/labrun-{LIBRARY_VERSION}-py3-none-any.whl",
    "tests/conftest.py", "tests/test_run.py", "tests/test_model.py", "tests/test_sweep.py",
    "tests/test_plot.py",
]
# The Slurm task ships with the library: the option changes the README only.
SLURM_FILES: list[str] = []
GITHUB_ACTIONS_FILES = [".github/workflows/ci.yml", ".github/workflows/cruft-update.yml"]
LEFTOVER_JINJA = re.compile(r"\{\{|\}\}|\{%|%\}|\{#")


def expected_files(answers: dict, package: str) -> set[str]:
    files = set(BASE_FILES) | {f"{package}/{name}" for name in PACKAGE_FILES}
    if answers["use_slurm"]:
        files |= set(SLURM_FILES)
    if answers["use_github_actions"]:
        files |= set(GITHUB_ACTIONS_FILES)
    return files


def rendered_files(project: Path) -> set[str]:
    return {
        str(p.relative_to(project)) for p in project.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_matrix_covers_every_option_value():
    """The meta-test: a value no render uses is a value nothing tests."""
    for key, default in prompted(CONFIG).items():
        values = [True, False] if isinstance(default, bool) else default
        if not isinstance(values, list):
            continue  # free text: exercised by the naming tests
        used = {answers[key] for answers in MATRIX}
        assert used == set(values), f"{key}: {set(values) - used} never rendered"


def test_matrix_renders_every_switch_combination():
    switches = [k for k, v in prompted(CONFIG).items() if isinstance(v, bool)]
    combos = {tuple(a[k] for k in switches) for a in MATRIX}
    assert len(combos) == 2 ** len(switches)


@pytest.fixture(scope="module", params=MATRIX, ids=lambda a: "-".join(map(str, a.values())))
def render(request, template_copy, tmp_path_factory):
    from cookiecutter.main import cookiecutter

    answers = request.param
    out = tmp_path_factory.mktemp("render")
    project = Path(cookiecutter(str(template_copy), no_input=True, extra_context=answers,
                                output_dir=str(out)))
    return answers, project


def test_exactly_the_expected_files(render):
    answers, project = render
    assert rendered_files(project) == expected_files(answers, "lab_project")


def test_no_template_syntax_left(render):
    _, project = render
    for path in project.rglob("*"):
        if path.is_file() and path.name != "LICENSE" and path.suffix != ".whl":
            text = path.read_text()
            # The shell scripts are copied unrendered: bash's ${#array[@]} is legal there.
            pattern = re.compile(r"\{\{|\{%") if path.suffix == ".sh" else LEFTOVER_JINJA
            assert not pattern.search(text), f"template syntax left in {path.relative_to(project)}"


def test_license_matches_the_choice(render):
    answers, project = render
    text = (project / "LICENSE").read_text()
    first_words = {
        "MIT": "MIT License", "BSD-3-Clause": "BSD 3-Clause License",
        "Apache-2.0": "Apache License", "GPL-3.0-only": "GNU GENERAL PUBLIC LICENSE",
        "Proprietary": "All rights reserved",
    }
    assert first_words[answers["license"]] in text
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    if answers["license"] == "Proprietary":
        assert "license" not in pyproject
    else:
        assert pyproject["license"] == answers["license"]


def test_ruff_is_clean(render):
    _, project = render
    result = subprocess.run([BIN / "ruff", "check", "--no-cache", "."], cwd=project,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_parse_and_pass_shellcheck(render):
    _, project = render
    scripts = sorted(project.rglob("*.sh"))
    assert project / "run.sh" in scripts
    for script in scripts:
        subprocess.run(["bash", "-n", script], check=True)
        assert script.stat().st_mode & 0o100, f"{script.name} is not executable"
    result = subprocess.run([BIN / "shellcheck", "-x", *map(str, scripts)], cwd=project,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflow_is_valid_yaml(render):
    answers, project = render
    if not answers["use_github_actions"]:
        pytest.skip("no workflow in this render")
    import yaml  # installed with mlflow

    for name in GITHUB_ACTIONS_FILES:
        workflow = yaml.safe_load((project / name).read_text())
        assert "jobs" in workflow, name


def test_template_repo_scripts_pass_shellcheck():
    scripts = sorted(map(str, [*TEMPLATE.glob("scripts/*.sh"), *TEMPLATE.glob(".ci/*.sh"),
                               TEMPLATE / ".ci" / "run"]))
    result = subprocess.run([BIN / "shellcheck", "-x", *scripts], cwd=TEMPLATE,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_template_repo_python_is_ruff_clean():
    """Hooks, tests and benchmarks of the template itself (the project template is linted per
    render above, since it is not Python until rendered)."""
    result = subprocess.run([BIN / "ruff", "check", "--no-cache", "hooks", "tests", "benchmarks",
                             "scripts", "lab_template_jinja.py"],
                            cwd=TEMPLATE, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def project_line_counts(project: Path) -> tuple[int, int]:
    """(lines of code, lines of tests) a lab member owns: Python and shell outside tests/, and
    the Python of tests/ (the counts README's "Code shape" and benchmarks/RESULTS.md give)."""

    def lines(paths) -> int:
        return sum(len(p.read_text().splitlines()) for p in paths)

    files = [p for p in project.rglob("*") if p.is_file() and p.suffix in (".py", ".sh")]
    tests = [p for p in files if p.relative_to(project).parts[0] == "tests"]
    return lines(set(files) - set(tests)), lines(tests)


def test_the_default_project_stays_a_method_a_member_can_own(bake):
    """Issue 27's budget: the project holds the method, the library the machinery."""
    code, tests = project_line_counts(bake())
    assert code <= 1500, f"{code} lines of code in a default render (budget 1,500)"
    assert tests <= 600, f"{tests} lines of tests in a default render (budget 600)"


def test_the_library_is_lint_clean():
    lib = TEMPLATE / "lib"
    result = subprocess.run([BIN / "ruff", "check", "--no-cache", "."], cwd=lib,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    scripts = sorted(map(str, (lib / "src" / "labrun").glob("*.sh")))
    if scripts:
        result = subprocess.run([BIN / "shellcheck", "-x", *scripts], cwd=lib,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
