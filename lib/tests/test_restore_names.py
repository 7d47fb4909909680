"""run.py names what it gives run.restore (issue 46): a student's `opt=` instead of `optimizer=`
must not turn a number silently wrong. labrun finds each object by what it is, not by its
keyword: history's lr is the optimizer's, patience counts from the schedule's peak."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

from conftest import ROOT, RUN_PY, TINY, run_dir_of


def test_renamed_restore_keywords_keep_the_lr_column(tmp_path, env, data_dir):
    source = RUN_PY.read_text()
    line = "run.restore(model=model, optimizer=opt, scheduler=sched, scaler=scaler, ema=ema)"
    assert line in source, "run.py changed: point this test at its restore line"
    renamed = "run.restore(model=model, opt=opt, sched=sched, scaler=scaler, ema=ema)"
    script = ROOT / f"run_renamed_{tmp_path.name}.py"  # in the project, as run.py is
    script.write_text(source.replace(line, renamed))
    try:
        cmd = [sys.executable, str(script), *TINY, "--epochs", "2", "--tracking", "off"]
        cmd += ["--data-dir", str(data_dir), "--results-dir", str(tmp_path)]
        done = subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True, timeout=600)
    finally:
        script.unlink()
    assert done.returncode == 0, done.stderr
    with open(run_dir_of(tmp_path) / "history.csv", newline="") as f:
        lrs = [float(row["lr"]) for row in csv.DictReader(f)]
    assert len(lrs) == 2 and all(math.isfinite(lr) and lr > 0 for lr in lrs), lrs
    assert lrs[0] != lrs[1]  # the one-cycle schedule moved it: the optimizer's own value
