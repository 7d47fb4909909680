"""run.py end to end on CPU: a tiny run, exact resume, optimizer swaps, --help without torch."""

import argparse
import json
import os
import signal
import subprocess
import sys

import pandas as pd
import torch
from conftest import ROOT, RUN_PY, load_run_py
from labrun.state import TrainSums

EPOCHS = ("--epochs", "3")
TIMES = ("epoch_time_s", "samples_per_sec")  # measured, not computed: never compared

# The README's optimizer swaps ("Another optimizer"): exact text replacements in run.py.
ADAMW = """    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, fused=True)
    # One-cycle (Smith & Topin): the LR climbs over the first 15 % of the steps to --lr, then
    # anneals (cosine) to ~0 at the last one; AdamW's beta1 cycles 0.95 -> 0.85 -> 0.95.
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=args.lr,
        total_steps=max(run.total_steps, 1),
        pct_start=WARM_UP_FRACTION,
        anneal_strategy="cos",
        cycle_momentum=True,
        base_momentum=0.85,
        max_momentum=0.95,
    )
"""
SGD = """    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(run.total_steps // 3, 1), gamma=0.1)
"""
LBFGS = """    opt = torch.optim.LBFGS(model.parameters(), lr=args.lr, max_iter=5)  # one group
    sched = None  # LBFGS finds its step length by itself
"""
SCALER_STEP = """        scaler.step(opt)  # fp16: skipped if a gradient overflowed (inf or NaN)
"""
LBFGS_STEP = """        def closure():  # LBFGS evaluates the loss again and again (its line search)
            opt.zero_grad(set_to_none=True)
            return forward_backward(micro_batches, sums=False)

        opt.step(closure)
"""
# The tests' convex problem: softmax regression on the pixels (any optimizer must solve it).
LINEAR = """

def make_model(args, info):
    import torch

    pixels = info.channels * info.image_size[0] * info.image_size[1]
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(pixels, info.num_classes))
"""


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
    assert rows.train_loss.iloc[-1] < rows.train_loss.iloc[0]
    assert metrics["test_loss"] < rows.train_loss.iloc[0]
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


def edited_run_py(tmp_path, *replacements):
    """A copy of run.py with the README's text replacements made (each exactly once)."""
    text = RUN_PY.read_text()
    for before, after in replacements:
        assert text.count(before) == 1, before
        text = text.replace(before, after)
    path = tmp_path / "run_edited.py"
    path.write_text(text + LINEAR)  # after __main__: it replaces make_model for main()
    return load_run_py(path, "run_edited")


def test_sgd_edit(train, tmp_path):
    module = edited_run_py(tmp_path, (ADAMW, SGD))
    code, out = train(*EPOCHS, module=module)
    assert code == 0
    assert history(out).train_loss.iloc[-1] < history(out).train_loss.iloc[0]


def test_lbfgs_edit(train, tmp_path):
    module = edited_run_py(tmp_path, (ADAMW, LBFGS), (SCALER_STEP, LBFGS_STEP))
    code, out = train(*EPOCHS, "--lr", "0.5", "--batch-size", "256", module=module)
    assert code == 0
    rows = history(out)
    assert rows.train_loss.iloc[-1] < rows.train_loss.iloc[0]
    assert rows.val_loss.iloc[-1] < rows.val_loss.iloc[0]
    if "val_acc" in rows:  # classification: well above chance (1 / classes)
        assert rows.val_acc.iloc[-1] > 0.5
