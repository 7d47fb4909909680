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


@pytest.mark.parametrize("name", ["lab_project", "vision3d", "my_net_2", "_private"])
def test_good_package_names_pass(name):
    assert pre_gen.check_package_name(name) is None


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
        ("test", "shadow"),
        ("math", "shadow"),
        ("json", "shadow"),
        ("run", "shadow"),  # would hide run.py from `import run` in the project's tests
    ],
)
def test_bad_package_names_say_what_to_type(name, why):
    message = pre_gen.check_package_name(name)
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
    assert not out.exists() or not any(out.iterdir())


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
    ours = [line for line in result.stderr.splitlines() if line.startswith("ERROR: package_name")]
    assert ours == [
        "ERROR: package_name 'torch' would shadow the module 'torch' that the project imports; "
        "type package_name='torch_lab' instead"
    ]
    assert not any((tmp_path / "out").iterdir())


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
    for name in ("scripts/slurm_task.sh", "tests/test_slurm.py", ".github/workflows/ci.yml",
                 "run.sh", "scripts/sweep_lib.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("#!/usr/bin/env bash\n")
    removed = post_gen.remove_excluded(tmp_path, use_slurm=False, use_github_actions=False)
    assert sorted(removed) == [".github", "scripts/slurm_task.sh", "tests/test_slurm.py"]
    assert (tmp_path / "run.sh").exists() and (tmp_path / "scripts/sweep_lib.sh").exists()
    post_gen.make_executable(tmp_path)
    assert (tmp_path / "run.sh").stat().st_mode & 0o111


def test_post_gen_prints_the_next_three_commands():
    lines = post_gen.next_steps("vision_lab").splitlines()
    assert len(lines) == 4 and lines[1].strip().startswith("cd vision_lab")
