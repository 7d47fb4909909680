"""The hostile-answers matrix: answers no template should trust, given as `--no-input key=value`
answers are (cookiecutter's extra_context). For each: no code ran, and the result is either a
clean refusal (one error line, nothing on disk) or a project whose pyproject.toml parses, whose
Python files compile, whose package imports and (one render per kind) whose tests collect.

Every payload that could run code touches the canary file; the canary must never exist. The
counts are written in the template README's testing section, and a test keeps them true.
"""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter

from conftest import TEMPLATE

# Short, so that payloads carrying it stay under the length limits and test the escaping.
CANARY = Path("/tmp/lab-canary")
TOUCH = f"open('{CANARY}','w')"
TOUCH_DQ = TOUCH.replace("'", '"')

# (kind, value). Each value is given to project_name, author and description at once (the
# fields that reach Python, TOML, Markdown and the license), so one render covers every file.
TEXT_VALUES = [
    ("quotes", 'Bob "The Builder"'),
    ("quotes", "O'Brien's lab"),
    ("quotes", "a `backtick` lab"),
    ("quotes", "it's ''' here"),
    ("quotes", 'a """ b'),
    ("quotes", f'x"; {TOUCH_DQ}; y="'),
    ("quotes", f"x'; {TOUCH}; y='"),
    ("quotes", f'"""; {TOUCH_DQ}; """'),
    ("quotes", f"'''; {TOUCH}; '''"),
    ("backslashes", "back\\slash"),
    ("backslashes", "ends with a backslash\\"),
    ("backslashes", "\\N{BULLET} and \\u0041 and \\x41 and \\n"),
    ("backslashes", '\\"; ' + TOUCH_DQ + '; x = \\"'),
    ("template", "{{ 7 * 6 }} lab"),
    ("template", "{{ cycler.__init__.__globals__.os.system('touch " + str(CANARY) + "') }}"),
    ("template", "{{ lipsum.__globals__['os'].popen('touch " + str(CANARY) + "') }}"),
    ("template", "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}"),
    ("template", "{{ '{0.__class__}'.format(1) }}"),
    ("template", "{{ 'a' * 1000000000 }}"),
    ("template", "{{ range(1000000000) | list }}"),
    ("template", "{{ 10**64**64**64**64 }}"),
    ("template", "{{ 'a' | center(1000000000) }}"),
    ("template", "{{ lipsum(1000000) }}"),
    ("template", "{% raw %}{{ kept as text }}{% endraw %}"),
    ("template", "{# a comment #}lab"),
    ("shell", f"$(touch {CANARY})"),
    ("shell", f"`touch {CANARY}`"),
    ("shell", f"lab; touch {CANARY} && echo | cat > /dev/null"),
    ("shell", "${HOME} & $PATH * ? ~ ! #"),
    ("markup", "<script>alert(1)</script>"),
    ("markup", "# not a heading [link](javascript:alert(1)) *bold* _it_ | a | b |"),
    ("markup", '"] hacked = true [x'),
    ("unicode", "Résumé Net"),
    ("unicode", "研究プロジェクト"),
    ("unicode", "🧪 Lab 🔬"),
    ("unicode", "مشروع البحث"),
    ("unicode", "zero\u200bwidth"),
    ("unicode", "e\u0301 combining"),
    ("control", "two\nlines"),
    ("control", "carriage\rreturn"),
    ("control", "a\ttab"),
    ("control", "nul\x00byte"),
    ("control", "escape \x1b[31m red"),
    ("control", "bidi \u202e override"),
    ("control", "line\u2028separator"),
    ("control", "lone \ud800 surrogate"),
    ("long", "n" * 80),
    ("long", "n" * 81),
    ("long", "n" * 300),
]
# Answers for one field only: the identifiers and the e-mail address have their own rules.
FIELD_VALUES = [
    ("long", {"description": "d" * 500}),
    ("long", {"description": "d" * 501}),
    ("long", {"author": "a" * 201}),
    ("identifier", {"package_name": f"x; {TOUCH}"}),
    ("identifier", {"package_name": "scipy"}),
    ("identifier", {"package_name": "sqlalchemy"}),
    ("identifier", {"package_name": "p" * 65}),
    ("identifier", {"project_slug": "../escape"}),
    ("identifier", {"project_slug": "/abs/path"}),
    ("identifier", {"project_slug": "s" * 300}),
    ("identifier", {"project_slug": "{{ cookiecutter.__class__ }}"}),
    ("email", {"email": 'a"b@example.org'}),
    ("email", {"email": "bob@example.org>, evil <x@y.z"}),
    ("email", {"email": "no-at-sign"}),
    ("email", {"email": "bob@exämple.org"}),
    ("email", {"license": "../../etc/passwd"}),
]
CASES = [(kind, {"project_name": v, "author": v, "description": v}) for kind, v in TEXT_VALUES]
CASES += FIELD_VALUES
IDS = [f"{i:02d}-{kind}" for i, (kind, _) in enumerate(CASES)]
README_LINE = re.compile(
    r"hostile-answers matrix: (\d+) tried, (\d+) refused, (\d+) rendered and importable, "
    r"(\d+) ran code"
)


def render(template: Path, out: Path, answers: dict) -> tuple[str, Path | None, str]:
    """('refused', None, message) or ('rendered', project, '') for one set of answers."""
    try:
        project = cookiecutter(str(template), no_input=True, extra_context=answers,
                               output_dir=str(out))
    except FailedHookException as refusal:
        return "refused", None, str(refusal)
    except ValueError as refusal:  # cookiecutter's own refusal of a value no choice offers
        if "provided for choice variable" not in str(refusal):
            raise
        return "refused", None, f"error: {refusal}"
    return "rendered", Path(project), ""


@pytest.fixture(scope="module")
def outcomes(template_copy, tmp_path_factory):
    """Render every case once; the tests below read the outcomes."""
    CANARY.unlink(missing_ok=True)
    results = []
    for answers in (a for _, a in CASES):
        out = tmp_path_factory.mktemp("hostile")
        status, project, message = render(template_copy, out, answers)
        if project is not None:
            packages = [p.parent.name for p in project.glob("*/__init__.py")]
            package = project / packages[0]
            imported = subprocess.run(
                [sys.executable, "-c", f"import {package.name}; print({package.name}.__doc__)"],
                cwd=project, capture_output=True, text=True,
            )
        else:
            imported = None
        results.append({"status": status, "project": project, "message": message, "out": out,
                        "imported": imported, "canary": CANARY.exists()})
        CANARY.unlink(missing_ok=True)
    return results


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_no_code_runs_and_the_answer_is_refused_or_works(outcomes, index):
    result = outcomes[index]
    assert not result["canary"], "an answer ran code"
    if result["status"] == "refused":
        message = result["message"]
        assert message.startswith("error: ") and "\n" not in message, message
        assert not any(result["out"].iterdir()), "a refusal left files behind"
        return
    project = result["project"]
    tomllib.loads((project / "pyproject.toml").read_text())
    for source in project.rglob("*.py"):
        compile(source.read_text(), str(source), "exec")
    imported = result["imported"]
    assert imported.returncode == 0, imported.stderr


def test_text_reaches_the_files_as_typed(outcomes):
    """Escaping keeps the text: what was typed is what TOML and Python read back."""
    checked = 0
    for (_, answers), result in zip(CASES, outcomes, strict=True):
        if result["status"] != "rendered" or "{" in answers.get("author", "{"):
            continue  # Jinja syntax in an answer is rendered by cookiecutter by design
        project = tomllib.loads((result["project"] / "pyproject.toml").read_text())["project"]
        assert project["authors"][0]["name"] == answers["author"]
        assert project["description"] == answers["description"]
        assert answers["project_name"] in result["imported"].stdout
        checked += 1
    assert checked >= 15


def test_controls_bidi_and_overlong_answers_are_refused(outcomes):
    for (kind, _), result in zip(CASES, outcomes, strict=True):
        if kind == "control":
            assert result["status"] == "refused", result["message"]
    refused_long = [r for (k, a), r in zip(CASES, outcomes, strict=True)
                    if k == "long" and r["status"] == "refused"]
    assert len(refused_long) == 4  # 81 and 300 characters, description 501, author 201


@pytest.mark.parametrize("kind", ["quotes", "backslashes", "unicode", "markup"])
def test_one_render_per_kind_collects_its_tests(outcomes, kind):
    """Collecting imports every test module (and with them run.py, plot.py and the package):
    done once per kind, because one collection takes seconds."""
    rendered = [r for (k, _), r in zip(CASES, outcomes, strict=True)
                if k == kind and r["status"] == "rendered"]
    assert rendered, f"no {kind} answer rendered"
    # The hardest one: the last rendered answer of the kind (the injection attempts come last).
    project = rendered[-1]["project"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=project, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert not CANARY.exists()


def matrix_counts(outcomes) -> tuple[int, int, int, int]:
    refused = sum(r["status"] == "refused" for r in outcomes)
    importable = sum(r["status"] == "rendered" and r["imported"].returncode == 0 for r in outcomes)
    ran_code = sum(r["canary"] for r in outcomes)
    return len(outcomes), refused, importable, ran_code


def test_readme_states_the_matrix_counts(outcomes):
    stated = README_LINE.search((TEMPLATE / "README.md").read_text())
    assert stated, "the README's testing section lacks the hostile-answers matrix line"
    assert tuple(map(int, stated.groups())) == matrix_counts(outcomes)
