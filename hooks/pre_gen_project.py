"""Refuse answers that would break the generated project, before anything is written.

The checks run twice. First while cookiecutter computes the answers (lab_template_jinja.py loads
this file and calls check_answers), before any folder exists, so a refusal leaves nothing on disk.
Then here, as the pre-generation hook, on the final answers, in case an answers file skipped the
first check. Cookiecutter renders this file with Jinja before running it, but the answers reach it
only as data: Jinja writes them as one JSON document inside a Python string literal (`tojson`
twice), so no answer can end the literal and become code. Unrendered it is still valid Python,
so the template's tests import it and call the checks directly.
"""

import json
import keyword
import re
import sys
import unicodedata

# Top-level names inside the generated project: a package with one of them would hide it.
PROJECT_NAMES = frozenset(
    {"run", "plot", "tests", "test", "conftest", "benchmarks", "scripts", "results", "data",
     "figures", "logs", "docs"}
)
SLUG_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
EMAIL_PATTERN = re.compile(r"^[^@\s\"'<>(),;:\\\[\]]+@[^@\s\"'<>(),;:\\\[\]]+\.[A-Za-z0-9-]+$")
TEXT_FIELDS = ("project_name", "project_slug", "package_name", "author", "email", "description")
# Longest answer per field: a folder name over 255 bytes cannot be created at all, and a title or
# description longer than this is a paragraph, not a name. The package name stands in import lines
# and strings of the generated code, which must stay within its lint's 100 columns (the template's
# tests render it at this limit and run ruff).
MAX_LENGTH = {
    "project_name": 80, "project_slug": 80, "package_name": 30,
    "author": 200, "email": 254, "description": 500,
}
# Bidirectional overrides reorder what a reader sees ("Trojan source"): refused like controls.
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def check_text(field: str, value) -> str | None:
    """Return why ``value`` cannot be the answer to the free-text ``field``, or None."""
    if not isinstance(value, str):
        return f"{field}: expected text, got {type(value).__name__}"
    limit = MAX_LENGTH.get(field, 500)
    if len(value) > limit:
        why = " (it must fit in import lines of 100 columns)" if field == "package_name" else ""
        return f"{field}: {len(value)} characters, the limit is {limit}{why}; type a shorter one"
    for char in value:
        category = unicodedata.category(char)
        if category in ("Cc", "Cs", "Zl", "Zp") or char in BIDI_CONTROLS:
            return (
                f"{field}: contains the control character U+{ord(char):04X}; "
                "answers are one line of printable text"
            )
    return None


def check_slug(slug: str) -> str | None:
    """Return why ``slug`` cannot be the project directory, or None if it can."""
    if not slug:
        return "the project name has no letters or digits; type a name such as 'Vision Lab'"
    if not SLUG_PATTERN.match(slug):
        return (
            f"project_slug {slug!r} is not a plain directory name; "
            "use lowercase letters, digits, '_' or '-', e.g. 'vision_lab'"
        )
    return None


def check_package_name(name: str, shadowed: frozenset = frozenset()) -> str | None:
    """Return why ``name`` cannot be the project's Python package, or None if it can.

    ``shadowed`` holds the top-level modules of the project's dependency closure
    (hooks/shadowed_modules.txt).
    """
    suggestion = re.sub(r"\W", "_", name.lower()).strip("_")[:30] or "my_project"
    if not suggestion.isascii():
        suggestion = "my_project"
    if suggestion[0].isdigit():
        suggestion = "lab_" + suggestion
    if not name.isascii() or not name.isidentifier():
        return (
            f"package_name {name!r} is not an importable ASCII identifier; "
            f"type package_name={suggestion!r} instead"
        )
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"package_name {name!r} is a Python keyword; type package_name='{name}_lab' instead"
    if name in sys.stdlib_module_names or name in PROJECT_NAMES or name in shadowed:
        return (
            f"package_name {name!r} would shadow the module {name!r} that the project imports; "
            f"type package_name='{name}_lab' instead"
        )
    return None


def check_email(email: str) -> str | None:
    if not EMAIL_PATTERN.match(email):
        return f"email {email!r} is not an address like 'you@example.org'"
    return None


def check_answers(answers: dict, shadowed: frozenset = frozenset()) -> str | None:
    """The first reason the answers cannot make a working project, or None if they can."""
    for field in TEXT_FIELDS:
        error = check_text(field, answers.get(field, ""))
        if error:
            return error
    for field in ("use_slurm", "use_github_actions"):
        if field in answers and not isinstance(answers[field], bool):
            return f"{field}: {answers[field]!r} is not yes or no"
    if not re.fullmatch(r"[A-Za-z0-9.-]+", str(answers.get("license", "MIT"))):
        return f"license {answers['license']!r} is not one of the offered licenses"
    return (
        check_slug(answers["project_slug"])
        or check_package_name(answers["package_name"], shadowed)
        or check_email(answers["email"])
    )


def rendered_answers() -> tuple[dict, frozenset]:
    """The answers and the shadow list as data (only valid after Jinja rendered this file)."""
    answers = json.loads({{ cookiecutter | tojson | tojson }})  # noqa: F821 (Jinja fills it)
    shadowed = json.loads({{ shadowed_modules | tojson | tojson }})  # noqa: F821
    return answers, frozenset(shadowed)


def main() -> int:
    answers, shadowed = rendered_answers()
    error = check_answers(answers, shadowed)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
