"""Refuse names that would break the generated project, before anything is written.

Cookiecutter renders this file with Jinja before running it; unrendered it is still
valid Python, so the template's tests import it and call the checks directly.
"""

import keyword
import re
import sys

# Modules the generated project imports (directly or through its tests and scripts):
# a package with one of these names would shadow it.
PROJECT_IMPORTS = frozenset(
    {
        "torch", "mlflow", "numpy", "matplotlib", "sklearn", "tqdm", "pandas",
        "pytest", "setuptools", "pip", "cruft", "cookiecutter",
        # top-level names inside the generated project itself
        "run", "plot", "tests", "test", "benchmarks", "scripts", "results", "data",
        "figures",
    }
)
SLUG_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


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


def check_package_name(name: str) -> str | None:
    """Return why ``name`` cannot be the project's Python package, or None if it can."""
    suggestion = re.sub(r"\W", "_", name.lower()).strip("_") or "my_project"
    if suggestion[0].isdigit():
        suggestion = "lab_" + suggestion
    if not name.isascii() or not name.isidentifier():
        return (
            f"package_name {name!r} is not an importable ASCII identifier; "
            f"type package_name={suggestion!r} instead"
        )
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"package_name {name!r} is a Python keyword; type package_name='{name}_lab' instead"
    if name in sys.stdlib_module_names or name in PROJECT_IMPORTS:
        return (
            f"package_name {name!r} would shadow the module {name!r} that the project imports; "
            f"type package_name='{name}_lab' instead"
        )
    return None


def main() -> int:
    slug = "{{ cookiecutter.project_slug }}"
    package_name = "{{ cookiecutter.package_name }}"
    error = check_slug(slug) or check_package_name(package_name)
    if error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
