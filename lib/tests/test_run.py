"""run.py end to end on CPU: a real (tiny) training job, --max-steps, bad input, failures."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import (
    DEADLINE,
    ROOT,
    RUN_PY,
    cli_command,
    mlflow_run,
    read_metrics,
    run_dir_of,
    temp_files,
)

RUN_FILES = (
    "config.json",
    "status",
    "history.csv",
    "checkpoint.pt",
    "best_model.pt",
    "metrics.json",
    "run.log",
)
METRIC_KEYS = (
    "best_val_acc",
    "test_acc",
    "test_loss",
    "best_epoch",
    "epochs_run",
    "steps",
    "wall_time_s",
    "train_time_s",
    "compile_time_s",
    "samples_per_sec",
    "peak_mem_bytes",
    "device",
    "stop_reason",
    "mlflow_run_id",
)


@pytest.mark.parametrize("flag", ["--help", "--print-run-dir"])
def test_cheap_flags_import_neither_torch_nor_mlflow(flag):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['run.py', '{flag}']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'mlflow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if flag == "--print-run-dir":
        assert result.stdout.strip().startswith(str(ROOT / "results" / "trials" / "digits"))


def test_print_run_dir_is_stable_and_ignores_execution_flags(tmp_path):
    def run_dir(*args):
        cmd = [
            sys.executable,
            str(RUN_PY),
            "--results-dir",
            str(tmp_path),
            "--print-run-dir",
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    base = run_dir("--lr", "0.01")
    assert base == run_dir("--lr", "0.01", "--device", "cpu", "--workers", "0", "--amp", "off")
    assert base != run_dir("--lr", "0.02")
    assert "lr=0.01" in base and base.startswith(str(tmp_path / "digits_"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, mlflow_uri, data_dir):
    """One tiny digits run, a real process as a user starts it, shared by the checks below."""
    import os

    results = tmp_path_factory.mktemp("results")
    cmd = cli_command("--epochs", "3", results_dir=results, data_dir=data_dir)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return run_dir_of(results), result, cmd, env


def test_digits_run_learns_and_writes_every_file(finished_run, mlflow_uri):
    run_dir, result, _, _ = finished_run
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), name
    assert not temp_files(run_dir)
    assert (run_dir / "status").read_text() == "finished\n"
    metrics = read_metrics(run_dir)
    assert set(METRIC_KEYS) <= set(metrics)
    assert metrics["test_acc"] > 0.3, metrics  # chance is 0.1
    assert math.isfinite(metrics["test_loss"]) and metrics["epochs_run"] == 3
    assert 1 <= metrics["best_epoch"] <= 3 and metrics["device"] == "cpu"
    history = (run_dir / "history.csv").read_text().splitlines()
    assert history[0] == (
        "epoch,step,lr,train_loss,train_acc,val_loss,val_acc,epoch_time_s,samples_per_sec"
    )
    assert len(history) == 4 and all(math.isfinite(float(v)) for v in history[-1].split(","))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["run_name"] == run_dir.name and "lr" in config["experiment_keys"]
    assert "device" not in config["experiment_keys"]
    run = mlflow_run(mlflow_uri, metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_acc"] == pytest.approx(metrics["test_acc"])
    assert run.data.params["lr"] == "0.01" and "git_commit" in run.data.tags
    assert "epoch 3/3" in (run_dir / "run.log").read_text()


def test_finished_run_is_not_retrained(finished_run):
    run_dir, _, cmd, env = finished_run
    before = (run_dir / "metrics.json").stat().st_mtime_ns
    result = subprocess.run(
        cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE
    )
    assert result.returncode == 0 and "already finished" in result.stdout
    assert (run_dir / "metrics.json").stat().st_mtime_ns == before


@pytest.mark.slow  # two runs; test_step.py checks the EMA's warm-up arithmetic in milliseconds
def test_ema_of_a_short_run_is_as_good_as_its_weights(main_in_process, tmp_path):
    """The issue's case: a short digits run (60 steps) with --ema 0.999. Without a warm-up the
    EMA is mostly the random initialisation and tests near chance (0.13 against 0.79)."""
    args = ("--epochs", "3", "--patience", "0", "--tracking", "off")
    assert main_in_process(*args, "--results-dir", str(tmp_path / "plain")) == 0
    assert main_in_process(*args, "--ema", "0.999", "--results-dir", str(tmp_path / "ema")) == 0
    plain = read_metrics(run_dir_of(tmp_path / "plain"))["test_acc"]
    ema = read_metrics(run_dir_of(tmp_path / "ema"))["test_acc"]
    assert plain > 0.3 and ema > plain - 0.1, (plain, ema)


@pytest.mark.slow  # two runs; test_train_units.py checks EarlyStopping's start in milliseconds
def test_min_epochs_holds_early_stopping_back(main_in_process, tmp_path, monkeypatch):
    """Validation accuracy that only falls after epoch 1 (scripted): patience 1 stops the run at
    epoch 2; with --min-epochs 3 only epoch 4 counts, and the run ends on its last epoch, which
    is not "early_stopping"."""
    from labrun import train

    real_evaluate, calls = train.evaluate, []

    def falling(model, loader, loss_fn, env):
        values = real_evaluate(model, loader, loss_fn, env)  # {loss, acc}: the task's names
        calls.append(1)
        return {**values, "acc": 0.5 - 0.1 * len(calls)}

    monkeypatch.setattr(train, "evaluate", falling)
    args = ("--epochs", "4", "--batch-size", "256", "--patience", "1", "--tracking", "off")
    for extra, epochs_run, reason in (
        ((), 2, "early_stopping"),
        (("--min-epochs", "3"), 4, "max_epochs"),
    ):
        calls.clear()
        out = tmp_path / (extra[-1] if extra else "none")
        assert main_in_process(*args, *extra, "--results-dir", str(out)) == 0
        metrics = read_metrics(run_dir_of(out))
        assert (metrics["epochs_run"], metrics["stop_reason"]) == (epochs_run, reason), extra
        assert metrics["best_epoch"] == 1


def test_max_steps_stops_at_exactly_n_steps(main_in_process, tmp_path):
    assert main_in_process("--max-steps", "7", "--epochs", "5", "--results-dir", str(tmp_path)) == 0
    metrics = read_metrics(run_dir_of(tmp_path))
    assert metrics["steps"] == 7 and metrics["stop_reason"] == "max_steps"
    assert metrics["epochs_run"] == 1  # 20 steps per epoch: stopped inside the first one


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "5000"], "larger than the training set"),
        (["--val-fraction", "0"], "validation split is empty"),
        (["--dataset", "synthetic", "--synthetic-size", "100"], "unreadable"),
    ],
)
def test_bad_input_is_one_clear_error_and_writes_nothing(
    main_in_process, tmp_path, data_dir, capsys, args, message
):
    if "synthetic" in args:  # a corrupt cached download
        (data_dir / "synthetic_100.npz").write_bytes(b"not a zip file")
    results = tmp_path / "results"
    assert main_in_process(*args, "--results-dir", str(results)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err.lower(), err
    assert not results.exists() or not any(results.iterdir())


def test_unwritable_results_dir(main_in_process, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main_in_process("--results-dir", str(blocker / "results")) == 2
    assert capsys.readouterr().err.startswith("error: --results-dir: cannot write to")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_uses_its_gpus_precision_and_compiles(run_cli, tmp_path):
    result = run_cli("--device", "cuda", "--epochs", "2", "--compile", "on", results_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = run_dir_of(tmp_path)
    metrics = read_metrics(run_dir)
    assert metrics["device"].startswith("cuda") and metrics["test_acc"] > 0.3
    assert metrics["compile_time_s"] > 0 and metrics["peak_mem_bytes"] > 0
    log = (run_dir / "run.log").read_text()
    bf16 = torch.cuda.get_device_capability()[0] >= 8
    assert ("precision: bf16 autocast" if bf16 else "precision: fp16 autocast + GradScaler") in log
    assert "compiled (" in log  # logged only after compiling succeeded (no eager fallback)


@pytest.mark.parametrize("args", [["--dataset", "mnist"], ["--batch-size", "0"]])
def test_bad_command_line_exits_2(args, tmp_path):
    cmd = [sys.executable, str(RUN_PY), "--results-dir", str(tmp_path), *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 2 and "error:" in result.stderr
    assert not any(tmp_path.iterdir())


def test_exception_marks_run_failed_without_partial_files(
    main_in_process, tmp_path, monkeypatch, mlflow_uri, capsys
):
    from mlflow.tracking import MlflowClient

    from labrun import train

    def broken_evaluate(*args, **kwargs):
        raise RuntimeError("boom in evaluation")

    monkeypatch.setattr(train, "evaluate", broken_evaluate)
    results = tmp_path / "results"
    assert main_in_process("--epochs", "2", "--results-dir", str(results)) == 1
    assert "error: RuntimeError: boom in evaluation" in capsys.readouterr().err
    run_dir = run_dir_of(results)
    assert (run_dir / "status").read_text() == "failed\n"
    assert not (run_dir / "metrics.json").exists() and not temp_files(run_dir)
    client = MlflowClient(tracking_uri=mlflow_uri)
    [run] = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.run_dir = '{run_dir}'",
    )
    assert run.info.status == "FAILED" and "boom" in run.data.tags["error"]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["traceback.txt"]


def test_a_job_writing_to_a_file_prints_progress_lines_inside_its_epochs(env, data_dir, tmp_path):
    """As under nohup (stdout and stderr a file, no bar): a line every --log-every seconds with
    the step, the pace and the epoch's ETA, in the log file and in run.log."""
    out = tmp_path / "nohup.out"
    cmd = cli_command("--epochs", "1", "--tracking", "off", "--log-every", "0.001",
                      results_dir=tmp_path / "results", data_dir=data_dir)  # fmt: skip
    with out.open("w") as log:
        done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=300)  # fmt: skip
    text = out.read_text()
    assert done.returncode == 0, text[-3000:]
    lines = [line for line in text.splitlines() if " steps/s " in line]
    assert len(lines) >= 2 and all("samples/s" in line and "ETA" in line for line in lines)
    assert "epoch 1/1 step " in lines[0]
    assert lines[0].split(" | ")[0] in (run_dir_of(tmp_path / "results") / "run.log").read_text()
