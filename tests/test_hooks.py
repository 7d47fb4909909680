"""The hooks' checks, called directly, and their effect through a real render."""

import importlib.util
import subprocess
import sys

import pytest
from cookiecutter.exceptions import FailedHookException

from conftest import TEMPLATE


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, TEMPLATE / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pre_gen = load_hook("pre_gen_project")
post_gen = load_hook("post_gen_project")
sys.path.insert(0, str(TEMPLATE / "scripts"))
import shadowed_modules  # noqa: E402  (the script that writes hooks/shadowed_modules.txt)

SHADOWED = frozenset(shadowed_modules.stored_modules())


@pytest.mark.parametrize("name", ["lab_project", "vision3d", "my_net_2", "_private"])
def test_good_package_names_pass(name):
    assert pre_gen.check_package_name(name, SHADOWED) is None


def test_shadow_list_holds_every_module_of_the_installed_dependency_closure():
    """Fails when a dependency (or one of its dependencies) adds a top-level module: a package
    of that name would shadow it. Refresh with `python scripts/shadowed_modules.py --update`."""
    computed = shadowed_modules.closure_modules(shadowed_modules.project_requirements())
    assert {"torch", "mlflow", "numpy", "scipy", "sqlalchemy", "sklearn"} <= computed
    missing = computed - SHADOWED
    assert not missing, f"run scripts/shadowed_modules.py --update; new modules: {sorted(missing)}"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("project_name", "two\nlines", "U+000A"),
        ("author", "tab\there", "U+0009"),
        ("description", "bidi \u202e", "U+202E"),
        ("project_name", "x" * 81, "limit is 80"),
        ("description", "x" * 501, "limit is 500"),
    ],
)
def test_text_with_controls_or_too_long_is_refused(field, value, why):
    message = pre_gen.check_text(field, value)
    assert message is not None and why in message and message.startswith(field)


def test_ordinary_text_passes():
    for value in ['Bob "The Builder"', "O'Brien", "back\\slash", "Résumé 🧪", "x" * 80]:
        assert pre_gen.check_text("project_name", value) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("my-net", "not an importable"),
        ("3d_vision", "not an importable"),
        ("résumé", "not an importable"),
        ("my net", "not an importable"),
        ("", "not an importable"),
        ("class", "keyword"),
        ("match", "keyword"),  # a soft keyword: importable, but a trap in a match statement
        ("torch", "shadow"),
        ("mlflow", "shadow"),
        ("scipy", "shadow"),  # imported by scikit-learn, a dependency of a dependency
        ("sqlalchemy", "shadow"),  # imported by mlflow's tracking store
        ("test", "shadow"),
        ("math", "shadow"),
        ("json", "shadow"),
        ("run", "shadow"),  # would hide run.py from `import run` in the project's tests
    ],
)
def test_bad_package_names_say_what_to_type(name, why):
    message = pre_gen.check_package_name(name, SHADOWED)
    assert message is not None and why in message
    assert "instead" in message  # every refusal suggests a name that works


@pytest.mark.parametrize("slug", ["", "Bad Slug", "-dash", "semi;colon"])
def test_bad_slugs_are_refused(slug):
    assert pre_gen.check_slug(slug) is not None


# The must-fail list: each is refused by the pre-generation hook and leaves nothing on disk.
MUST_FAIL = [
    {"package_name": "torch"},
    {"package_name": "mlflow"},
    {"package_name": "test"},
    {"package_name": "math"},
    {"package_name": "class"},
    {"package_name": "my-net"},
    {"package_name": "2fast"},
    {"package_name": "naïve"},
    {"project_name": "!!!"},
    {"project_slug": "has space"},
]


@pytest.mark.parametrize("answers", MUST_FAIL, ids=lambda a: "=".join(*a.items()))
def test_must_fail_inputs_leave_nothing_behind(bake, tmp_path, answers):
    out = tmp_path / "out"
    with pytest.raises(FailedHookException):
        bake(out, **answers)
    assert not out.exists()  # refused while the answers were computed: no folder was made


@pytest.mark.parametrize(
    ("project_name", "package"),
    [
        ("Résumé Net", "resume_net"),
        ("my project 2", "my_project_2"),
        ("3D vision", "lab_3d_vision"),
    ],
)
def test_awkward_names_become_importable_ascii_packages(bake, project_name, package):
    project = bake(project_name=project_name)
    assert (project / package / "__init__.py").is_file()
    assert package.isascii() and package.isidentifier()
    subprocess.run([sys.executable, "-c", f"import {package}"], cwd=project, check=True)


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", *args],
        cwd=cwd, capture_output=True, text=True,
    )


def test_cli_refuses_a_bad_name_with_one_clear_line(template_copy, tmp_path):
    result = run_cli(str(template_copy), "-o", "out", "package_name=torch", cwd=tmp_path)
    assert result.returncode != 0
    # Refused while the answers are computed: cookiecutter prints the one line and exits 1.
    assert result.stdout + result.stderr == (
        "error: package_name 'torch' would shadow the module 'torch' that the project imports; "
        "type package_name='torch_lab' instead\n"
    )
    assert not (tmp_path / "out").exists()


def test_pre_gen_hook_refuses_what_an_answers_file_let_through(tmp_path):
    """The hook repeats the checks on the final answers: an answers file can replace the check
    entry of cookiecutter.json (__answers_checked) with text and skip the first check."""
    answers = {"project_name": "x", "project_slug": "x", "package_name": "scipy",
               "author": "a", "email": "a@b.org", "description": "d", "license": "MIT",
               "use_slurm": True, "use_github_actions": True}
    assert "scipy" in pre_gen.check_answers(answers, SHADOWED)
    assert pre_gen.check_answers({**answers, "package_name": "vision"}, SHADOWED) is None


def test_cli_refuses_an_unknown_option_value(template_copy, tmp_path):
    result = run_cli(str(template_copy), "-o", "out", "license=WTFPL", cwd=tmp_path)
    assert result.returncode != 0
    assert "WTFPL provided for choice variable license" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_cli_refuses_an_existing_output_directory(template_copy, tmp_path):
    assert run_cli(str(template_copy), "-o", "out", cwd=tmp_path).returncode == 0
    marker = tmp_path / "out" / "lab_project" / "my_notes.txt"
    marker.write_text("keep me")
    result = run_cli(str(template_copy), "-o", "out", cwd=tmp_path)
    assert result.returncode != 0
    assert 'directory already exists' in result.stderr + result.stdout
    assert marker.read_text() == "keep me"


def test_post_gen_removes_what_options_exclude(tmp_path):
    # The Slurm task ships with the library (labrun/slurm_task.sh): use_slurm removes no file.
    for name in (".github/workflows/ci.yml", "run.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("#!/usr/bin/env bash\n")
    removed = post_gen.remove_excluded(tmp_path, use_slurm=False, use_github_actions=False)
    assert sorted(removed) == [".github"]
    assert (tmp_path / "run.sh").exists()
    post_gen.make_executable(tmp_path)
    assert (tmp_path / "run.sh").stat().st_mode & 0o111


def test_post_gen_prints_the_next_commands_of_the_readme_from_the_package_index_alone():
    lines = [line.strip() for line in post_gen.next_steps("vision_lab").splitlines()]
    assert lines[1] == "cd vision_lab"
    assert lines[2].startswith("python -m venv .venv")
    # The library's wheel by its file name (a --find-links would replace pip's configured one),
    # at the versions the template was tested with: no index but PyPI, no backtracking.
    assert lines[3].startswith("pip install -c constraints.txt wheels/labrun-*.whl -e '.[dev]'")
    # A git repository first: provenance records its commit, pre-commit needs one.
    assert lines[4].startswith("git init && git add -A && git commit")
    assert lines[5].startswith("pre-commit install") and lines[6].startswith("bash run.sh --quick")


def test_pre_gen_hook_runs_the_checks_on_rendered_answers(bake, tmp_path):
    """Through a real render: with the first check overridden by the answers, the hook refuses
    (so it reads the answers it was rendered with) and cookiecutter removes the project folder."""
    out = tmp_path / "out"
    with pytest.raises(FailedHookException):
        bake(out, __answers_checked="", package_name="scipy")
    assert not any(out.iterdir())  # the -o folder cookiecutter made stays, empty (README)
