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
