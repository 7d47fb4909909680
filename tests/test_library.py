"""labrun, the library every project pins: the wheel the generation hook builds (pip's standard
build) is complete, carries its metadata and extras, is the same bytes for the same code and
installs offline into a bare environment; its version names its code, the project pins it
exactly, and a library change reaches a project by the README's install command."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

from conftest import TEMPLATE

LIB = TEMPLATE / "lib"


def load_post_gen():
    spec = importlib.util.spec_from_file_location(
        "post_gen", TEMPLATE / "hooks" / "post_gen_project.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


post_gen = load_post_gen()


def the_wheel(project: Path) -> Path:
    (wheel,) = (project / "wheels").glob("labrun-*.whl")
    return wheel


def metadata(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(name).decode())
    return {key: message.get_all(key) for key in set(message.keys())}


def test_the_version_names_the_code(tmp_path):
    """A change anywhere in the library's code or metadata is a new version (release + local
    part); the same code is the same version."""
    lib = tmp_path / "lib"
    shutil.copytree(LIB, lib, ignore=shutil.ignore_patterns("__pycache__", "tests", "*.egg-info"))
    before = post_gen.code_version(lib)
    assert before == post_gen.code_version(LIB)
    release = before.split("+")[0]
    assert before.startswith(f"{release}+g") and len(before.split("+g")[1]) == 12
    with open(lib / "src" / "labrun" / "runs.py", "a") as f:
        f.write("# a change of the library\n")
    assert post_gen.code_version(lib) not in (before, release)


def test_the_project_pins_the_wheel_it_carries_exactly(bake):
    project = bake()
    version = post_gen.code_version(LIB)
    dependencies = post_gen.tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert f"labrun=={version}" in dependencies["dependencies"]
    assert the_wheel(project).name == f"labrun-{version}-py3-none-any.whl"


def test_the_wheel_has_full_metadata_and_its_extras(bake):
    """Built by setuptools through pip: license, readme and every extra (lib/README.md tells
    users to install labrun[gpu-decode])."""
    meta = metadata(the_wheel(bake()))
    assert meta["Metadata-Version"][0] >= "2.4" and meta["License-Expression"] == ["MIT"]
    assert set(meta["Provides-Extra"]) == {"gpu-decode", "test"}
    assert any(r.startswith("torchvision") and 'extra == "gpu-decode"' in r
               for r in meta["Requires-Dist"])  # fmt: skip
    assert meta["Description-Content-Type"] == ["text/markdown"]


def test_the_wheel_holds_every_module_and_is_the_same_bytes_each_build(bake, tmp_path, monkeypatch):
    built = []
    for name, umask in (("a", 0o022), ("b", 0o002)):  # each built anew (no cache), any umask
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache-{name}"))
        previous = os.umask(umask)
        try:
            built.append(the_wheel(bake(output_dir=tmp_path / name)))
        finally:
            os.umask(previous)
    assert (tmp_path / "cache-b" / "lab-template" / built[1].name).is_file()
    first, second = built
    assert (
        hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest()
    )  # SOURCE_DATE_EPOCH: an unchanged library is no diff in a cruft update
    names = set(zipfile.ZipFile(first).namelist())
    sources = {
        f"labrun/{p.relative_to(LIB / 'src' / 'labrun').as_posix()}"
        for p in (LIB / "src" / "labrun").rglob("*")
        if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
    }
    assert sources and sources <= names


def without_pythonpath() -> dict:
    """This environment without the template's own library on PYTHONPATH or as the project."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LABRUN_PROJECT")}


def bare_venv(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    return folder / "bin" / "python"


def test_the_wheel_installs_offline_into_a_bare_environment(bake, tmp_path):
    """pip takes the wheel as it is (hashes in RECORD, metadata) and the library imports from
    the new environment, not from the template's editable install, with the version its
    metadata holds."""
    wheel = the_wheel(bake())
    python = bare_venv(tmp_path / "venv")
    # The bare environment has no pip of its own: this one installs into it, without the
    # dependencies (torch is not needed to import labrun) and without any index.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        check=True,
    )  # fmt: skip
    shown = subprocess.run(
        [str(python), "-c", "import labrun; print(labrun.__version__, labrun.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=without_pythonpath(),
    ).stdout.split()  # fmt: skip
    assert shown[0] == post_gen.code_version(LIB)
    assert Path(shown[1]).is_relative_to(tmp_path / "venv")


def lend_dependencies(python: Path) -> None:
    """The template's environment's packages (torch, mlflow...), visible to the environment of
    `python` through a .pth: pip there finds them installed."""
    (site,) = python.parent.parent.glob("lib/python3*/site-packages")
    (site / "lent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def test_the_extra_named_in_lib_readme_installs_without_a_warning(bake, tmp_path):
    """`pip install "labrun[gpu-decode] @ file:..."` as lib/README.md says: the extra exists
    (no "does not provide the extra") and brings its torchvision (here a stand-in wheel)."""
    wheel = the_wheel(bake())
    python = bare_venv(tmp_path / "venv")
    lend_dependencies(python)
    stand_in = tmp_path / "links"
    stand_in.mkdir()
    info = "torchvision-0.20.0.dist-info"
    with zipfile.ZipFile(stand_in / "torchvision-0.20.0-py3-none-any.whl", "w") as archive:
        files = {
            f"{info}/METADATA": "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.20.0\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        }
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--find-links", str(stand_in), f"labrun[gpu-decode] @ {wheel.as_uri()}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "does not provide the extra" not in done.stdout + done.stderr
    assert "torchvision-0.20.0" in done.stdout


def test_lib_and_a_render_build_with_the_lowest_setuptools_the_floor_allows(bake, tmp_path):
    """`requires = ["setuptools>=77"]`: license = "MIT" (an SPDX expression) needs 77; both
    build with exactly that version (from the package index, or pip's cache)."""
    floor = "77.0.3"
    for pyproject in (LIB / "pyproject.toml", TEMPLATE / "{{cookiecutter.project_slug}}" /
                      "pyproject.toml"):  # fmt: skip
        assert 'requires = ["setuptools>=77"]' in pyproject.read_text()
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", f"setuptools=={floor}"], check=True)
    project = bake()
    for source in (LIB, project):
        copy = tmp_path / source.name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("tests", "wheels"))
        done = subprocess.run(
            [python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "--wheel-dir", str(tmp_path / "built"), str(copy)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((tmp_path / "built").glob("*.whl"))) == 2


def readme_install(project: Path) -> str:
    """The README's first install command (pip's)."""
    return next(line.split("#")[0].strip() for line in
                (project / "README.md").read_text().splitlines()
                if line.startswith("pip install ") and "wheels/labrun-" in line)  # fmt: skip


def test_a_library_change_reaches_the_project_by_the_readmes_install(template_copy, tmp_path):
    """Render, install by the README's command, run a job; change labrun's code (not its
    version), render again (as `cruft update` does: the new wheel replaces the old one), run
    the same command in the same environment: the job runs the new code, and run.log and
    config.json record the version that ran."""
    template = tmp_path / "template"
    shutil.copytree(template_copy, template)
    out = tmp_path / "out"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The template's environment lends the dependencies (torch, mlflow, the dev tools) through a
    # .pth: the README's command finds them installed and installs the library and the project.
    lend_dependencies(venv / "bin" / "python")
    env = without_pythonpath()
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1")
    job = ["python", "run.py", "--device", "cpu", "--width", "8", "--epochs", "1",
           "--max-steps", "2", "--tracking", "off", "--progress", "off"]  # fmt: skip

    def render_install_and_run(results: str) -> tuple[Path, str]:
        from cookiecutter.main import cookiecutter

        shutil.rmtree(out / "lab_project" / "wheels", ignore_errors=True)
        project = Path(cookiecutter(str(template), no_input=True, output_dir=str(out),
                                    overwrite_if_exists=True))  # fmt: skip
        installed = subprocess.run(["bash", "-c", readme_install(project)], cwd=project, env=env,
                                   capture_output=True, text=True)  # fmt: skip
        assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
        ran = subprocess.run([*job, "--results-dir", results], cwd=project, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert "warning: labrun" not in ran.stderr  # the pinned library ran
        (run_dir,) = (project / results).iterdir()
        return run_dir, the_wheel(project).name.split("-")[1]

    first_dir, first = render_install_and_run("results/first")
    assert f"| labrun {first} |" in (first_dir / "run.log").read_text()
    with open(template / "lib" / "src" / "labrun" / "__init__.py", "a") as f:
        f.write("CHANGED = 'a change of the library'\n")
    second_dir, second = render_install_and_run("results/second")
    assert second != first and second.split("+")[0] == first.split("+")[0]
    assert f"| labrun {second} |" in (second_dir / "run.log").read_text()
    config = json.loads((second_dir / "config.json").read_text())
    assert second in json.dumps(config)
    shown = subprocess.run(["python", "-c", "import labrun; print(labrun.CHANGED)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert shown.stdout.strip() == "a change of the library", shown.stderr
