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
        ("    data = run.data()\n", "    data = run.data()\n    dataa.info\n"),  # before run.log
        ("            run.tick()", "            run.tikc()"),  # in the loop: run.log is open
    ],
    ids=["in-build", "in-the-loop"],
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
