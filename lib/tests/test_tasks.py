"""Tasks (PKG/tasks.py): classification's numbers are the released code's; regression and
multilabel run offline end to end with their own names everywhere; the metric sums equal a direct
computation; --monitor picks the metric and its direction; runs written before tasks still load
and plot as classification.

`released_run/` is a run directory as the code before tasks wrote it (the lab template's main
at aafe20f: config.json, metrics.json, history.csv, status), from the command of
`test_classification_numbers_are_the_released_codes`. A change that moves classification's
numbers on purpose (a new EMA rule, say) writes it anew with that command.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import plot
import pytest
import torch
import torch.nn.functional as F
from conftest import LIB, PACKAGE, ROOT, mlflow_run, read_metrics, run_dir_of, temp_files

from labrun.analysis import aggregate, load_runs
from labrun.arrays import synthetic_targets
from labrun.data import Split
from labrun.loaders import Loader
from labrun.stopping import EarlyStopping
from labrun.tasks import ap_bins, create_task
from labrun.train import TrainSums

RELEASED = Path(__file__).with_name("released_run")
REFERENCE = (  # with the tiny settings of conftest.TINY
    *("--dataset", "synthetic", "--synthetic-size", "1200", "--epochs", "3", "--seed", "3"),
    *("--label-smoothing", "0.1", "--ema", "0.5", "--grad-accum", "2", "--tracking", "off"),
)
TIMING = ("epoch_time_s", "samples_per_sec")
CPU = torch.device("cpu")


def task(name: str, **args):
    return create_task(name, argparse.Namespace(**{"label_smoothing": 0.0, **args}))


def history(run_dir: Path) -> list[dict[str, str]]:
    header, *rows = (run_dir / "history.csv").read_text().splitlines()
    return [dict(zip(header.split(","), row.split(","), strict=True)) for row in rows]


def test_classification_numbers_are_the_released_codes(main_in_process, tmp_path):
    """Same run directory name, the same history.csv columns and schedule (epoch, step, lr:
    exact arithmetic), and the same numbers within what another CPU's kernels change: they
    differ in the 5th digit at the first step and the difference compounds over 24 steps
    (measured: losses within 0.1 %, accuracies within 3 samples of 240). A changed loss,
    metric, schedule or data order moves them far more."""
    assert main_in_process(*REFERENCE, "--results-dir", str(tmp_path)) == 0
    run_dir = run_dir_of(tmp_path)
    assert run_dir.name == json.loads((RELEASED / "config.json").read_text())["run_name"]
    ours, theirs = history(run_dir), history(RELEASED)
    assert list(ours[0]) == list(theirs[0])  # the released header, column for column
    for a, b in zip(ours, theirs, strict=True):
        assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
        assert float(a["lr"]) == pytest.approx(float(b["lr"]), rel=1e-5)
        for key in a:
            if key.endswith("loss"):
                assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-2), key
            elif key.endswith("acc"):
                assert float(a[key]) == pytest.approx(float(b[key]), abs=0.03), key
    got, released = read_metrics(run_dir), json.loads((RELEASED / "metrics.json").read_text())
    for key in ("best_epoch", "steps", "stop_reason"):
        assert got[key] == released[key], key
    for key in ("best_val_acc", "test_acc"):
        assert got[key] == pytest.approx(released[key], abs=0.03), key
    assert got["test_loss"] == pytest.approx(released["test_loss"], rel=1e-2)
    assert got["task"] == "classification" and got["monitor"] == "val_acc"
    # The released run is the same experiment: beside this one (under another name, as a copied
    # run directory) it is a duplicate, its missing task and monitor taken at their defaults.
    shutil.copytree(RELEASED, tmp_path / "copy")
    runs, skipped = load_runs(tmp_path)
    assert [r.name for r in runs] == [run_dir.name]
    # another CPU's numbers (issue 37: compared, reported): the run at its own name is kept
    ((where, reason),) = skipped
    assert where == "copy" and reason.startswith(f"duplicate of {run_dir.name} with other numbers")


def test_classification_task_is_the_released_loss_and_count_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    logits, y = torch.randn(64, 10, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    # The released train.forward_and_sums, verbatim: log_softmax + gather, smoothing mixed in.
    log_probs = F.log_softmax(logits.float(), dim=1)
    plain = -log_probs.gather(1, y.unsqueeze(1)).squeeze(1)
    for smoothing in (0.0, 0.1):
        nll = (1 - smoothing) * plain - smoothing * log_probs.mean(1) if smoothing else plain
        classification = task("classification", label_smoothing=smoothing)
        assert torch.equal(classification.loss(logits, y), nll.mean())
        correct = (logits.argmax(1) == y).sum()
        assert classification.sums(logits, y).tolist() == [float(correct)]
        # val/test loss: the plain cross-entropy, whatever the smoothing (as released)
        assert torch.equal(classification.eval_loss(logits, y), plain.mean())


def run_task(main_in_process, results: Path, *args: str) -> tuple[Path, dict]:
    code = main_in_process(
        *("--dataset", "synthetic", "--synthetic-size", "500", "--epochs", "3"),
        *("--results-dir", str(results), *args),
    )
    assert code == 0
    run_dir = run_dir_of(results)
    assert not temp_files(run_dir)
    return run_dir, read_metrics(run_dir)


def test_regression_runs_offline_and_learns(main_in_process, tmp_path, mlflow_uri):
    run_dir, metrics = run_task(main_in_process, tmp_path, "--task", "regression")
    assert "task=regression" in run_dir.name
    assert metrics["task"] == "regression" and metrics["monitor"] == "val_mse"
    assert {"best_val_mse", "test_mse", "test_mae", "test_r2", "test_loss"} <= set(metrics)
    assert not any("acc" in key for key in metrics)
    assert metrics["test_r2"] > 0.2, metrics  # 0 = predicting the mean
    assert metrics["test_mse"] == pytest.approx(metrics["test_loss"], rel=1e-5)
    rows = history(run_dir)
    assert list(rows[0]) == [
        *("epoch", "step", "lr", "train_loss", "train_mse", "train_mae", "train_r2"),
        *("val_loss", "val_mse", "val_mae", "val_r2", "epoch_time_s", "samples_per_sec"),
    ]
    best = min(float(r["val_mse"]) for r in rows)
    assert f"{metrics['best_val_mse']:.6g}" == f"{best:.6g}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["task"] == "regression" and config["monitored"] == "val_mse"
    assert config["metric_directions"] == {"loss": "min", "mse": "min", "mae": "min", "r2": "max"}
    run = mlflow_run(mlflow_uri, metrics["mlflow_run_id"])  # MLflow: the same names
    assert run.data.metrics["test_r2"] == pytest.approx(metrics["test_r2"])
    assert "val_r2" in run.data.metrics and "val_acc" not in run.data.metrics
    (loaded,), _ = load_runs(tmp_path)
    assert aggregate([loaded]).monitor == "val_mse"
    del loaded.config["monitored"]  # as from MLflow, whose params are the experiment's only
    assert aggregate([loaded]).monitor == "val_mse"  # from the metric best_val_mse
    log = (run_dir / "run.log").read_text()
    assert "r2 " in log and "augmentation: crop + flip" in log  # image-level targets: augmented


def test_multilabel_runs_offline_and_learns(main_in_process, tmp_path):
    run_dir, metrics = run_task(main_in_process, tmp_path, "--task", "multilabel")
    assert metrics["task"] == "multilabel" and metrics["monitor"] == "val_map"
    assert {"best_val_map", "test_map", "test_f1", "test_loss"} <= set(metrics)
    # Chance AP is a label's share of positives; a learning model ranks far above it.
    prevalence = synthetic_targets(np.arange(10), "multilabel").mean(0)
    assert metrics["test_map"] > prevalence[prevalence > 0].mean() + 0.15, metrics
    assert 0 <= metrics["test_f1"] <= 1
    assert list(history(run_dir)[0])[3:9] == [
        *("train_loss", "train_f1", "train_map", "val_loss", "val_f1", "val_map")
    ]


def test_monitor_val_loss_keeps_the_lowest_and_stops_on_it(main_in_process, tmp_path):
    run_dir, metrics = run_task(
        main_in_process, tmp_path, "--monitor", "val_loss", "--patience", "1", "--lr", "0.05"
    )
    assert metrics["monitor"] == "val_loss" and "best_val_acc" not in metrics
    losses = [float(r["val_loss"]) for r in history(run_dir)]
    assert metrics["best_epoch"] == 1 + losses.index(min(losses))
    assert f"{metrics['best_val_loss']:.6g}" == f"{min(losses):.6g}"
    if metrics["stop_reason"] == "early_stopping":
        assert losses[-1] >= min(losses)


def test_early_stopping_direction():
    model = torch.nn.Linear(1, 1)
    lower = EarlyStopping(patience=2, mode="min")
    news = [lower.update(score, epoch, model) for epoch, score in enumerate([3, 2, 2.5, 1, 4, 5])]
    assert news == [True, True, False, True, False, False]
    assert lower.best_score == 1 and lower.best_epoch == 3 and lower.should_stop
    higher = EarlyStopping(patience=0)
    assert [higher.update(s, e, model) for e, s in enumerate([0.1, 0.3, 0.2])] == [1, 1, 0]
    assert not higher.update(math.nan, 3, model)  # NaN is never a new best


def test_unknown_monitor_is_one_error_line(main_in_process, tmp_path, capsys):
    code = main_in_process(
        "--task", "regression", "--monitor", "val_acc", "--results-dir", str(tmp_path)
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --monitor: 'val_acc'") and "val_r2" in err[0]
    assert not any(tmp_path.iterdir())  # nothing of the run is left


def in_batches(task_, outputs, targets, sizes):
    """The task's metrics from per-batch sums, as the training step and evaluate add them up."""
    total, start = None, 0
    for size in sizes:
        part = task_.sums(outputs[start : start + size], targets[start : start + size])
        total = part if total is None else total + part
        start += size
    assert start == len(outputs)
    return task_.finish(total.numpy(), len(outputs))


def test_regression_sums_equal_sklearn():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    gen = torch.Generator().manual_seed(0)
    y = torch.randn(200, 3, generator=gen) * torch.tensor([1.0, 10.0, 0.1]) + 50
    outputs = y + torch.randn(200, 3, generator=gen) * 0.5
    got = in_batches(task("regression"), outputs, y, [64, 64, 64, 8])
    a, b = y.double().numpy(), outputs.double().numpy()
    assert got["mse"] == pytest.approx(mean_squared_error(a, b), rel=1e-12)
    assert got["mae"] == pytest.approx(mean_absolute_error(a, b), rel=1e-12)
    assert got["r2"] == pytest.approx(r2_score(a, b), rel=1e-9)  # mean 50 >> std 0.1: no loss


def multilabel_data(n=500, labels=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, labels, generator=gen) < 0.3).float()
    y[:, -1] = 0  # a label without positives: no AP, F1 0 (sklearn's zero_division=0)
    logits = 2 * (y - 0.5) + 1.5 * torch.randn(n, labels, generator=gen)
    return logits, y


def test_multilabel_f1_and_map_equal_sklearn():
    from sklearn.metrics import average_precision_score, f1_score

    logits, y = multilabel_data()
    got = in_batches(task("multilabel"), logits, y, [128, 128, 128, 116])
    scores = torch.sigmoid(logits).numpy()
    truth = y.numpy().astype(int)
    f1 = f1_score(truth, (scores >= 0.5).astype(int), average="macro", zero_division=0)
    assert got["f1"] == pytest.approx(f1, abs=1e-12)
    # The histogram's AP is sklearn's AP of the logits replaced by their bins, exactly ...
    binned = ap_bins(logits).numpy()
    present = truth.sum(0) > 0
    exact_binned = np.mean([average_precision_score(truth[:, k], binned[:, k])
                            for k in np.flatnonzero(present)])  # fmt: skip
    assert got["map"] == pytest.approx(exact_binned, abs=1e-12)
    # ... and close to the AP of the logits (ties inside a bin only; 500 samples: one tie
    # moves it by ~1e-3; on 4000 x 20 within 1e-3: test_trust.py).
    exact = np.mean([average_precision_score(truth[:, k], scores[:, k])
                     for k in np.flatnonzero(present)])  # fmt: skip
    assert abs(got["map"] - exact) < 2e-3


def test_classification_sums_equal_a_direct_count():
    gen = torch.Generator().manual_seed(0)
    logits, y = torch.randn(100, 7, generator=gen), torch.randint(0, 7, (100,), generator=gen)
    got = in_batches(task("classification"), logits, y, [32, 32, 32, 4])
    assert got["acc"] == (logits.argmax(1) == y).sum().item() / 100


def test_spatial_targets_turn_crop_and_flip_off():
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    split = Split(images, torch.randint(0, 2, (8, 16, 16)))  # a mask per image
    still = Loader(split, 8, train=True, device="cpu", augment=False, workers=0)
    plain = Loader(split, 8, train=False, device="cpu", workers=0)
    (x, y), (x0, y0) = next(iter(still)), next(iter(plain))
    order = still.batch_indices()[0]  # train order is shuffled: compare image by image
    assert torch.equal(x, x0[order]) and torch.equal(y, y0[order])  # targets pass unchanged
    moving = Loader(split, 8, train=True, device="cpu", workers=0)
    assert not torch.equal(next(iter(moving))[0], x0[moving.batch_indices()[0]])


def test_runs_written_before_tasks_load_and_plot_as_classification(tmp_path, capsys):
    results = tmp_path / "results"
    config = json.loads((RELEASED / "config.json").read_text())
    shutil.copytree(RELEASED, results / config["run_name"])
    runs, skipped = load_runs(results)
    assert not skipped and "task" not in runs[0].config
    table = aggregate(runs)
    assert table.monitor == "val_acc" and table.metrics[:3] == [
        "best_val_acc", "test_acc", "test_loss"
    ]  # fmt: skip
    out = tmp_path / "figures"
    assert plot.main(["--results", str(results), "--out", str(out), "--formats", "png"]) == 0
    assert (out / "learning_curves.png").is_file()
    assert "test accuracy" in (out / "aggregate.tex").read_text()  # the default: test metrics
    assert plot.main(["--results", str(results), "--out", str(out), "--curve", "val_r2"]) == 2
    assert "error: --curve: val_r2 is not a history column" in capsys.readouterr().err


IMPORTS = """import torch.nn.functional as F

from labrun.tasks import Task, cross_entropy, register_task, summed
"""


def test_readme_segmentation_task_works_as_written(tmp_path):
    """labrun's README, its own task: the code, in tasks.py of a copy of the project, is in
    --help, and its mean IoU (from sums over two batches) is the directly computed one."""
    readme = (LIB / "README.md").read_text()
    code = re.search(r'```python\n(@register_task\("segmentation".*?)```', readme, re.DOTALL)[1]
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("results", "data", "figures", "*.db",
                                                              ".git", "__pycache__"))  # fmt: skip
    package = copy / PACKAGE
    with open(package / "tasks.py", "a") as f:
        f.write(IMPORTS + "\n\n" + code)  # a module of the project's package, as README says
    check = """
import argparse, numpy as np, torch, torch.nn.functional as F
from labrun.tasks import create_task
task = create_task("segmentation", argparse.Namespace())
gen = torch.Generator().manual_seed(0)
logits = torch.randn(6, 3, 8, 8, generator=gen)
masks = torch.randint(0, 3, (6, 8, 8), generator=gen)
masks[masks == 2] = 1  # class 2 in no mask: counted only where predicted
total = task.sums(logits[:4], masks[:4]) + task.sums(logits[4:], masks[4:])
got = task.finish(total.numpy(), 6)["miou"]
pred, true = logits.argmax(1).numpy(), masks.numpy()
ious = [((pred == k) & (true == k)).sum() / ((pred == k) | (true == k)).sum() for k in range(3)
        if ((pred == k) | (true == k)).any()]
assert abs(got - np.mean(ious)) < 1e-12, (got, ious)
torch.testing.assert_close(task.loss(logits, masks), F.cross_entropy(logits, masks))
assert task.spatial_targets and task.monitor == "val_miou"
print("ok")
"""
    here = {**os.environ, "LABRUN_PROJECT": str(copy)}  # the copy, not conftest's project
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=copy, env=here, capture_output=True, text=True
    )
    assert result.stdout.strip() == "ok", result.stderr
    helped = subprocess.run([sys.executable, "run.py", "--help"], cwd=copy, env=here,
                            capture_output=True, text=True)  # fmt: skip
    assert "--task {classification,regression,multilabel,segmentation}" in helped.stdout


def test_task_sums_resume_exactly_mid_epoch():
    """The epoch's running sums (train.TrainSums) go through a checkpoint unchanged."""
    logits, y = multilabel_data(n=32, labels=4)
    batches = [(logits[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    multilabel = task("multilabel")
    loss = torch.tensor(0.25)
    straight = TrainSums(multilabel, CPU)
    for outputs, targets in batches:
        straight.add(loss, outputs, targets)
    first = TrainSums(multilabel, CPU)
    for outputs, targets in batches[:2]:
        first.add(loss, outputs, targets)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # mid-epoch: the sums are in the checkpoint
    buffer.seek(0)
    resumed = TrainSums(multilabel, CPU)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for outputs, targets in batches[2:]:
        resumed.add(loss, outputs, targets)
    assert straight.take() == resumed.take()


def test_a_checkpoint_from_before_tasks_resumes_its_running_sums():
    """The released Trainer saved {loss_sum, correct, seen}; its count becomes the sums."""
    sums = TrainSums(task("classification"), CPU)
    sums.load_state_dict({"loss_sum": torch.tensor(6.5), "correct": torch.tensor(3), "seen": 4})
    assert sums.take() == ({"loss": 6.5 / 4, "acc": 3 / 4}, 4)
