"""run.py end to end on CPU: a tiny run, exact resume, --help without torch. Nothing here reads
run.py's text: edit its optimizer, loss or Config and these still test what it does."""

import argparse
import json
import os
import signal
import subprocess
import sys

import pandas as pd
import torch
from conftest import ROOT, RUN_PY, load_run_py
from labrun.train import TrainSums

EPOCHS = ("--epochs", "3")
TIMES = ("epoch_time_s", "samples_per_sec")  # measured, not computed: never compared


def history(run_dir) -> pd.DataFrame:
    return pd.read_csv(run_dir / "history.csv").drop(columns=list(TIMES))


def test_help_imports_neither_torch_nor_mlflow():
    code = (
        "import runpy, sys\nsys.argv = ['run.py', '--help']\n"
        f"try:\n    runpy.run_path({str(RUN_PY)!r}, run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'mlflow') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--epochs" in done.stdout and done.stdout.strip().endswith("[]")


def test_tiny_run_learns_and_writes_every_file(train):
    code, out = train(*EPOCHS)
    assert code == 0
    assert (out / "status").read_text().strip() == "finished"
    metrics = json.loads((out / "metrics.json").read_text())  # strict JSON: no NaN
    assert metrics["epochs_run"] == 3 and metrics["stop_reason"] == "max_epochs"
    rows = history(out)
    assert list(rows.epoch) == [1, 2, 3]
    # Learned, whatever the optimizer (README, "Another optimizer"): well above chance (digits'
    # 10 classes: 0.1). Not the train loss epoch by epoch: a one-cycle peak or a line search
    # may raise it for an epoch on the way down.
    assert metrics["best_val_acc"] > 0.3 and metrics["test_acc"] > 0.3
    best = torch.load(out / "best_model.pt", weights_only=True)  # a plain state_dict
    config = argparse.Namespace(**json.loads((out / "config.json").read_text()))
    config.image_size = tuple(config.image_size)
    load_run_py().make_model(config, config).load_state_dict(best)  # strict: every key fits
    assert "finished" in (out / "run.log").read_text()
    assert train(*EPOCHS) == (0, out)  # done: skipped, not trained again


def test_resume_mid_epoch_continues_exactly(train, monkeypatch):
    _, whole = train(*EPOCHS, results="whole")
    add, calls = TrainSums.add, []

    def add_then_stop(self, *args):  # a stop signal in the middle of epoch 2
        calls.append(1)
        if len(calls) == 30:
            os.kill(os.getpid(), signal.SIGUSR1)
        return add(self, *args)

    monkeypatch.setattr(TrainSums, "add", add_then_stop)
    code, parts = train(*EPOCHS, results="parts")
    assert code == 75 and (parts / "status").read_text().strip() == "interrupted"
    assert len(history(parts)) == 1
    monkeypatch.setattr(TrainSums, "add", add)
    assert train(*EPOCHS, results="parts") == (0, parts)
    pd.testing.assert_frame_equal(history(parts), history(whole), rtol=1e-4)
