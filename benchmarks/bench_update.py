"""What a template update costs a project: `cruft update` from one template commit to another.

A project is created with `cruft create` at FROM (default: the previous release, before the
library), given four small edits as a lab member would make them (the learning rates of the
sweep, a model width default in the README's way, a line in the README, a new file), committed,
then updated with `cruft update --skip-apply-ask` to TO (default: HEAD of this checkout). Prints
the files the update touched, the lines added and removed (git diff --numstat against the edited
project), and the files left with conflicts (cruft's .rej files or conflict markers).

Usage: python benchmarks/bench_update.py [--from COMMIT] [--to COMMIT]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
PREVIOUS_RELEASE = "bd5183e"  # the last landing before the library (issue 27)
BIN = Path(sys.executable).parent


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def edit_like_a_member(project: Path) -> None:
    """Small edits, the kind issue 27 counted: a sweep grid, a README line, a file of one's own,
    a line in the model file, and (a release with a Config) a flag of one's own in run.py."""
    run_sh = project / "run.sh"
    text = run_sh.read_text()
    # The sweep's grid as the release wrote it: a readonly array, later a local one.
    text = text.replace("readonly LRS=(1e-3 3e-3 1e-2)", "readonly LRS=(3e-4 1e-3)")
    run_sh.write_text(text.replace("lrs=(1e-3 3e-3 1e-2)", "lrs=(3e-4 1e-3)"))
    # A hyperparameter of one's own, where a release with a Config takes it (README, "The
    # method's flags"): one line after the last field.
    run_py = project / "run.py"
    text = run_py.read_text()
    own = '    momentum: float = flag(0.9, "SGD momentum (our optimizer)", at_least=0, below=1)'
    last_field = re.compile(r"(?m)^(    ema: float = flag\(.*\))$")
    run_py.write_text(last_field.sub(lambda m: f"{m[1]}\n{own}", text))
    readme = project / "README.md"
    readme.write_text(readme.read_text() + "\nNotes of the cell-atlas group.\n")
    (project / "notes.md").write_text("# What we tried\n")
    model = next(project.glob("*/model.py"))
    model.write_text(model.read_text() + "\n# our models go below\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="start", default=PREVIOUS_RELEASE,
                        help="template commit the project is made from")
    parser.add_argument("--to", default="HEAD", help="template commit to update to")
    args = parser.parse_args(argv)
    to = git("rev-parse", args.to, cwd=TEMPLATE).strip()
    with tempfile.TemporaryDirectory(prefix="bench_update_") as tmp:
        work = Path(tmp)
        # cruft clones the template; a bare copy of this checkout holds both commits.
        template = work / "template.git"
        git("clone", "--quiet", "--bare", str(TEMPLATE), str(template), cwd=work)
        subprocess.run(
            [BIN / "cruft", "create", "--no-input", "--checkout", args.start, str(template)],
            cwd=work, check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        project = work / "lab_project"
        git("init", "--quiet", cwd=project)
        git("add", "-A", cwd=project)
        git("-c", "user.name=bench", "-c", "user.email=b@example.org", "commit", "--quiet",
            "-m", "start", cwd=project)  # fmt: skip
        edit_like_a_member(project)
        git("add", "-A", cwd=project)
        git("-c", "user.name=bench", "-c", "user.email=b@example.org", "commit", "--quiet",
            "-m", "four edits", cwd=project)  # fmt: skip
        update = subprocess.run(
            [BIN / "cruft", "update", "--skip-apply-ask", "--checkout", to],
            cwd=project, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        git("add", "-A", cwd=project)
        numstat = git("diff", "--cached", "--numstat", "HEAD", cwd=project).splitlines()
        added = sum(int(a) for a, _, _ in (line.split("\t") for line in numstat) if a != "-")
        removed = sum(int(r) for _, r, _ in (line.split("\t") for line in numstat) if r != "-")
        conflicts = sorted(
            str(p.relative_to(project)) for p in project.rglob("*")
            if p.is_file() and ".git" not in p.parts
            and (p.suffix == ".rej" or (p.suffix in (".py", ".sh", ".md", ".toml")
                                        and "<<<<<<<" in p.read_text(errors="replace")))
        )  # fmt: skip
        print(json.dumps({
            "from": args.start, "to": to[:8], "cruft_exit": update.returncode,
            "files_changed": len(numstat), "lines_added": added, "lines_removed": removed,
            "conflicts": conflicts,
        }, indent=2))  # fmt: skip
        if update.returncode != 0:
            print(update.stdout[-2000:] + update.stderr[-2000:], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
