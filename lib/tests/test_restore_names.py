"""run.py names what it gives job.resume (issue 46): a student's `opt=` instead of `optimizer=`
must not turn a number silently wrong. labrun reads none of those objects back by keyword: it
checkpoints each by its state_dict; history's lr is what run.py reads from its optimizer."""

from __future__ import annotations

import csv
import math

from conftest import run_dir_of, run_edited_run_py


def test_renamed_resume_keywords_keep_the_lr_column(tmp_path, env, data_dir):
    line = "model=model, optimizer=built.optimizer,"
    renamed = "model=model, opt=built.optimizer,"
    done, _ = run_edited_run_py(tmp_path, env, data_dir, line, renamed, "--epochs", "2")
    assert done.returncode == 0, done.stderr
    with open(run_dir_of(tmp_path / "results") / "history.csv", newline="") as f:
        lrs = [float(row["lr"]) for row in csv.DictReader(f)]
    assert len(lrs) == 2 and all(math.isfinite(lr) and lr > 0 for lr in lrs), lrs
    assert lrs[0] != lrs[1]  # the one-cycle schedule moved it: the optimizer's own value
