"""labrun, the library every project pins: the wheel the generation hook builds is complete,
deterministic and installs offline into a bare environment; the project pins the library's
version exactly; a `cruft update` to a newer library bumps the pin and the wheel together."""

import hashlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from conftest import TEMPLATE

LIB = TEMPLATE / "lib"


def library_version() -> str:
    return tomllib.loads((LIB / "pyproject.toml").read_text())["project"]["version"]


def test_the_library_version_is_one_number_in_two_places():
    import labrun

    assert labrun.__version__ == library_version()


def test_the_project_pins_the_library_exactly(bake):
    project = bake()
    dependencies = tomllib.loads((project / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    assert f"labrun=={library_version()}" in dependencies
    assert (project / "wheels" / f"labrun-{library_version()}-py3-none-any.whl").is_file()


def test_the_wheel_holds_every_module_and_is_the_same_bytes_each_render(bake, tmp_path):
    first = next((bake(output_dir=tmp_path / "a") / "wheels").glob("*.whl"))
    second = next((bake(output_dir=tmp_path / "b") / "wheels").glob("*.whl"))
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(
        second.read_bytes()
    ).digest()  # no time stamps: an unchanged library is no diff in a cruft update
    names = set(zipfile.ZipFile(first).namelist())
    sources = {
        f"labrun/{p.relative_to(LIB / 'src' / 'labrun').as_posix()}"
        for p in (LIB / "src" / "labrun").rglob("*")
        if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
    }
    assert sources and sources <= names


def test_the_wheel_installs_offline_into_a_bare_environment(bake, tmp_path):
    """pip takes the wheel as it is (hashes in RECORD, metadata) and the library imports from
    the new environment, not from the template's editable install."""
    wheel = next((bake() / "wheels").glob("*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The bare environment has no pip of its own: this one installs into it, without the
    # dependencies (torch is not needed to import labrun) and without any index.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        check=True,
    )  # fmt: skip
    shown = subprocess.run(
        [str(python), "-c", "import labrun; print(labrun.__version__, labrun.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    assert shown[0] == library_version()
    assert Path(shown[1]).is_relative_to(venv)
