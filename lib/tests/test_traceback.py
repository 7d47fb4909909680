"""The student's traceback (issue 46): a mistake in the project's own code shows its line.

A typo in run.py is run as a student runs it: the `error:` line on stderr is followed by the
traceback's frames in the project's files (file, line, the line's text), before the run directory
exists as well as after; once run.log is open it holds the whole traceback."""

from __future__ import annotations

import pytest
from conftest import RUN_PY, run_dir_of, run_edited_run_py


@pytest.mark.parametrize(
    ("line", "typo"),
    [
        ("    model = make_model(args, data.info)\n", "    model = make_model(args, dataa.info)\n"),
        ("            job.tick()", "            job.tikc()"),  # in the loop: run.log is open
    ],
    ids=["in-build", "in-the-loop"],  # before run.log exists, and after
)
def test_a_typo_in_run_py_shows_its_line(line, typo, tmp_path, env, data_dir):
    done, script = run_edited_run_py(tmp_path, env, data_dir, line, typo, "--epochs", "1")
    mistake = typo.strip().splitlines()[-1]
    edited = RUN_PY.read_text().replace(line, typo, 1).splitlines()
    number = next(i for i, text in enumerate(edited, 1) if mistake in text)
    results = tmp_path / "results"
    assert done.returncode == 1, done.stderr
    error_line = next(text for text in done.stderr.splitlines() if text.startswith("error: "))
    assert "Error" in error_line and ("dataa" in error_line or "tikc" in error_line)
    frame = f'File "{script}", line {number}'
    after_error = done.stderr[done.stderr.index(error_line) :]
    assert frame in done.stderr and mistake in done.stderr, done.stderr
    if "tikc" in mistake:  # run.log was open: the whole traceback is there (and on stderr)
        log = (run_dir_of(results) / "run.log").read_text()
        assert frame in log and "Traceback (most recent call last)" in log
        assert "/labrun/" in log  # the whole traceback, the library's frames included
    else:  # no run.log yet: the project's frames stand under the error line, labrun's do not
        assert frame in after_error and "/labrun/" not in after_error


RESUME = "    progress = job.resume(\n"
COMPILE = "    compiled = job.compile(model, loss_fn, data.train, progress)\n"
STEP = "    step = make_step(built, compiled, args, env, loss_fn)\n"


@pytest.mark.parametrize(
    ("line", "misordered", "name"),
    [
        (RESUME, COMPILE + RESUME, "progress"),  # compiled before resume: no progress yet
        (COMPILE + STEP, STEP + COMPILE, "compiled"),  # the step before its compiled module
    ],
    ids=["compile-before-resume", "step-before-compile"],
)
def test_a_misordered_verb_is_a_name_error_at_the_students_line(
    line, misordered, name, tmp_path, env, data_dir
):
    """The order of the verbs is Python's: each takes what the one before returned, so a verb
    moved above what it needs fails at its own line, with the name it lacks."""
    done, script = run_edited_run_py(tmp_path, env, data_dir, line, misordered, "--epochs", "1")
    edited = RUN_PY.read_text().replace(line, misordered, 1).splitlines()
    first = misordered.splitlines()[0]
    number = next(i for i, text in enumerate(edited, 1) if text == first)
    assert done.returncode == 1, done.stderr
    error_line = next(text for text in done.stderr.splitlines() if text.startswith("error: "))
    assert error_line.startswith("error: UnboundLocalError: ") and f"'{name}'" in error_line
    assert f'File "{script}", line {number}' in done.stderr, done.stderr
