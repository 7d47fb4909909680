"""Projects can be updated from a newer template with cruft (works with cookiecutter 2.7)."""

import json
import shutil
import subprocess

import pytest

from conftest import BIN

GIT = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.org"]


def git(*args, cwd):
    subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def template_repo(template_copy, tmp_path):
    repo = tmp_path / "template"
    shutil.copytree(template_copy, repo)
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "v1", cwd=repo)
    return repo


def commit_template_change(repo):
    gitignore = repo / "{{cookiecutter.project_slug}}" / ".gitignore"
    gitignore.write_text(gitignore.read_text() + "# added by template v2\nwandb/\n")
    git("commit", "-qam", "v2", cwd=repo)


def user_project(project):
    git("init", "-q", "-b", "main", cwd=project)
    (project / "README.md").write_text((project / "README.md").read_text() + "\nMy notes.\n")
    git("add", "-A", cwd=project)
    git("commit", "-qm", "my project", cwd=project)


@pytest.mark.parametrize("maker", ["cruft create", "cookiecutter"])
def test_update_from_a_newer_template_keeps_user_edits(template_repo, tmp_path, maker):
    out = tmp_path / "projects"
    if maker == "cruft create":
        subprocess.run([BIN / "cruft", "create", "--no-input", "--output-dir", str(out),
                        str(template_repo)], check=True, capture_output=True)
    else:  # plain cookiecutter: the post-gen hook records .cruft.json itself
        subprocess.run([BIN / "cookiecutter", "--no-input", "-o", str(out), str(template_repo)],
                       check=True, capture_output=True)
    project = out / "lab_project"
    state = json.loads((project / ".cruft.json").read_text())
    assert state["context"]["cookiecutter"]["package_name"] == "lab_project"
    user_project(project)

    commit_template_change(template_repo)
    check = subprocess.run([BIN / "cruft", "check"], cwd=project, capture_output=True, text=True)
    assert check.returncode != 0  # out of date
    subprocess.run([BIN / "cruft", "update", "-y"], cwd=project, check=True, capture_output=True)
    assert "wandb/" in (project / ".gitignore").read_text()  # the template change arrived
    assert "My notes." in (project / "README.md").read_text()  # the user's edit stayed
    assert subprocess.run([BIN / "cruft", "check"], cwd=project).returncode == 0


@pytest.mark.parametrize("named_as", ["template", "."])
def test_relative_template_path_is_recorded_absolute(template_repo, tmp_path, named_as):
    """`cookiecutter ../template` and the demo's `cookiecutter . -o build/demo`: the post-gen hook
    runs inside the new project, so a relative template path must not be resolved there."""
    cwd = template_repo if named_as == "." else template_repo.parent
    out = tmp_path / "projects"
    result = subprocess.run([BIN / "cookiecutter", "--no-input", "-o", str(out), named_as],
                            cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "not a clean git checkout" not in result.stdout  # it is one: no false note
    state = json.loads((out / "lab_project" / ".cruft.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=template_repo, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert (state["template"], state["commit"]) == (str(template_repo), head)
    check = subprocess.run([BIN / "cruft", "check"], cwd=out / "lab_project",
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr  # up to date, no traceback


def test_a_dirty_template_says_why_there_is_no_cruft_json(template_repo, tmp_path):
    readme = template_repo / "README.md"
    readme.write_text(readme.read_text() + "uncommitted\n")
    result = subprocess.run([BIN / "cookiecutter", "--no-input", "-o", str(tmp_path / "p"),
                             str(template_repo)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "uncommitted changes" in result.stdout
    assert not (tmp_path / "p" / "lab_project" / ".cruft.json").exists()
