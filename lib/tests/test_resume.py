"""Interruption and resume, faults, and the tools (--find-lr, --find-batch-size, --profile)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import signal
from pathlib import Path

import pytest
from conftest import (
    DEADLINE,
    mlflow_run,
    popen_cli,
    read_metrics,
    run_dir_of,
    signal_self_after,
    temp_files,
    wait_while_running,
)

# Everything that has state to restore: EMA, accumulation, clipping, the one-cycle schedule.
STATEFUL = (
    "--patience",
    "0",
    "--ema",
    "0.9",
    "--grad-accum",
    "2",
    "--batch-size",
    "32",
    "--clip-grad",
    "1.0",
)
RESUME_ARGS = ("--epochs", "3", "--deterministic", *STATEFUL)
TIMINGS = {
    "wall_time_s",
    "train_time_s",
    "compile_time_s",
    "samples_per_sec",
    "peak_mem_bytes",
    "mlflow_run_id",
}


@pytest.mark.slow  # three real processes; the in-process test below checks the same in seconds
def test_sigterm_then_rerun_gives_the_same_final_metrics(
    run_cli, env, data_dir, tmp_path, mlflow_uri
):
    reference = run_cli(*RESUME_ARGS, results_dir=tmp_path / "straight")
    assert reference.returncode == 0, reference.stderr
    expected = read_metrics(run_dir_of(tmp_path / "straight"))

    results = tmp_path / "stopped"
    proc = popen_cli(*RESUME_ARGS, results_dir=results, data_dir=data_dir, env=env)
    # Stop as soon as training starts: the signal lands inside the first epoch (its first steps
    # take seconds while oneDNN warms up), so the resume starts mid-epoch, the hardest case.
    wait_while_running(
        lambda: any("steps/epoch" in p.read_text() for p in results.glob("*/run.log")), proc
    )
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 75, err
    run_dir = run_dir_of(results)
    assert (run_dir / "status").read_text() == "interrupted\n"
    assert (run_dir / "checkpoint.pt").exists() and not (run_dir / "metrics.json").exists()
    assert "SIGTERM received" in (run_dir / "run.log").read_text()

    resumed = run_cli(*RESUME_ARGS, results_dir=results)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    got = read_metrics(run_dir)
    assert {k: v for k, v in got.items() if k not in TIMINGS} == {
        k: v for k, v in expected.items() if k not in TIMINGS
    }
    assert (run_dir / "history.csv").read_text().count("\n") == 4  # header + 3 epochs, no repeats
    run = mlflow_run(mlflow_uri, got["mlflow_run_id"])
    assert run.info.status == "FINISHED"  # the same MLflow run, continued


QUICK_RESUME = ("--epochs", "2", "--max-steps", "25", *STATEFUL)


def test_stopped_mid_epoch_then_resumed_equals_straight(
    main_in_process, tmp_path, monkeypatch, mlflow_uri
):
    """EMA, accumulation, clipping and the schedule resume exactly from the middle of an epoch
    (20 optimizer steps per epoch here: the stop lands at step 7 of epoch 1)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main_in_process(*QUICK_RESUME, "--results-dir", str(straight)) == 0
    with monkeypatch.context() as m:
        signal_self_after(m, 7)
        assert main_in_process(*QUICK_RESUME, "--results-dir", str(stopped)) == 75
    run_dir = run_dir_of(stopped)
    assert (run_dir / "status").read_text() == "interrupted\n"
    assert "SIGTERM received" in (run_dir / "run.log").read_text()
    assert main_in_process(*QUICK_RESUME, "--results-dir", str(stopped)) == 0
    got, expected = read_metrics(run_dir), read_metrics(run_dir_of(straight))
    assert {k: v for k, v in got.items() if k not in TIMINGS} == {
        k: v for k, v in expected.items() if k not in TIMINGS
    }

    def learning(run: Path) -> list[list[str]]:  # history without its timing columns
        return [row.split(",")[:7] for row in (run / "history.csv").read_text().splitlines()]

    assert learning(run_dir) == learning(run_dir_of(straight)) and len(learning(run_dir)) == 3
    # Epoch 1 ran 7 steps before the stop and 13 after: its time and rate cover all 20, so the
    # history's times add up to train_time_s and each row's rate x time is its epoch's samples.
    rows = list(csv.DictReader((run_dir / "history.csv").open()))
    times = [float(r["epoch_time_s"]) for r in rows]
    assert sum(times) == pytest.approx(got["train_time_s"], rel=1e-4)
    samples = [float(r["samples_per_sec"]) * t for r, t in zip(rows, times, strict=True)]
    assert samples == pytest.approx([20 * 64, 5 * 64], rel=1e-4)  # steps x (2 x 32)
    assert got["samples_per_sec"] * got["train_time_s"] == pytest.approx(25 * 64)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert run_id == got["mlflow_run_id"]  # one MLflow run, continued across the resume
    assert mlflow_run(mlflow_uri, run_id).info.status == "FINISHED"


@pytest.mark.parametrize("stop_after", [20, 25])  # epoch 1's last step; the run's last step
def test_stopped_at_the_last_step_of_an_epoch_resumes_into_its_validation(
    main_in_process, tmp_path, monkeypatch, stop_after
):
    """run.tick() honours a stop after any step, the last of an epoch or of the run included:
    the checkpoint then holds a trained epoch not yet validated, and the resumed run validates
    it (no step repeated, none skipped) and ends as the straight run did."""
    args = (*QUICK_RESUME, "--tracking", "off")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main_in_process(*args, "--results-dir", str(straight)) == 0
    with monkeypatch.context() as m:
        signal_self_after(m, stop_after)
        assert main_in_process(*args, "--results-dir", str(stopped)) == 75
    run_dir = run_dir_of(stopped)
    history = run_dir / "history.csv"  # the stopped epoch has no row yet
    assert (history.exists() and len(list(csv.DictReader(history.open())))) == (stop_after > 20)
    assert main_in_process(*args, "--results-dir", str(stopped)) == 0
    got, expected = read_metrics(run_dir), read_metrics(run_dir_of(straight))
    assert {k: v for k, v in got.items() if k not in TIMINGS} == {
        k: v for k, v in expected.items() if k not in TIMINGS
    }
    assert [r.split(",")[:7] for r in (run_dir / "history.csv").read_text().splitlines()] == [
        r.split(",")[:7] for r in (run_dir_of(straight) / "history.csv").read_text().splitlines()
    ]


def test_nan_loss_fails_clearly_and_keeps_the_last_good_checkpoint(
    main_in_process, tmp_path, monkeypatch, mlflow_uri, capsys
):
    import torch

    from labrun.train import TrainSums

    original, calls = TrainSums.add, {"n": 0}

    def diverges_at_step_25(self, loss, outputs, targets):  # epoch 2 (20 steps each)
        calls["n"] += 1
        original(self, loss * (float("nan") if calls["n"] == 25 else 1.0), outputs, targets)

    monkeypatch.setattr(TrainSums, "add", diverges_at_step_25)
    assert (
        main_in_process("--epochs", "2", "--checkpoint-every", "0", "--results-dir", str(tmp_path))
        == 1
    )
    err = capsys.readouterr().err
    assert "error: NonFiniteLoss: non-finite training loss" in err
    assert "epoch 2, between optimizer steps 21 and 40" in err
    run_dir = run_dir_of(tmp_path)
    assert (run_dir / "status").read_text() == "failed\n"
    assert not (run_dir / "metrics.json").exists() and not temp_files(run_dir)
    progress = torch.load(run_dir / "checkpoint.pt", weights_only=True)["progress"]
    assert progress["epoch"] == 1 and progress["step"] == 20  # the last good one
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert mlflow_run(mlflow_uri, run_id).info.status == "FAILED"


def test_bad_checkpoints_are_refused_and_fresh_starts_over(main_in_process, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main_in_process("--epochs", "1", "--max-steps", "2", "--results-dir", str(a)) == 0
    assert (
        main_in_process(
            "--epochs", "2", "--max-steps", "2", "--print-run-dir", "--results-dir", str(b)
        )
        == 0
    )
    target = Path(capsys.readouterr().out.strip().splitlines()[-1])
    target.mkdir(parents=True)
    shutil.copy(run_dir_of(a) / "checkpoint.pt", target / "checkpoint.pt")
    args = ("--epochs", "2", "--max-steps", "2", "--results-dir", str(b))
    assert main_in_process(*args) == 2
    assert "belongs to another configuration" in capsys.readouterr().err
    (target / "checkpoint.pt").write_bytes(b"garbage")
    assert main_in_process(*args) == 2
    assert "corrupt or unreadable" in capsys.readouterr().err
    assert main_in_process(*args, "--fresh") == 0
    assert "--fresh: deleting checkpoint.pt" in capsys.readouterr().out
    assert read_metrics(target)["steps"] == 2


def test_a_best_model_newer_than_the_checkpoint_is_put_back(main_in_process, tmp_path):
    """SIGKILL between a new best_model.pt and the checkpoint that knows it (checkpoints come
    every --checkpoint-every seconds, best_model.pt at every new best): the resumed run must
    keep the checkpoint's best, not weights of an epoch it has not reached again."""
    import torch

    args = ("--epochs", "3", "--batch-size", "256", "--patience", "0", "--checkpoint-every", "0")
    args = (*args, "--tracking", "off", "--results-dir", str(tmp_path))
    with pytest.MonkeyPatch.context() as m:
        signal_self_after(m, 6)  # the first step of epoch 2 (5 steps of 256 an epoch)
        assert main_in_process(*args) == 75
    run_dir = run_dir_of(tmp_path)
    epoch_1 = {n: (run_dir / n).read_bytes() for n in ("checkpoint.pt", "best_model.pt")}
    assert main_in_process(*args) == 0
    assert read_metrics(run_dir)["best_epoch"] > 1  # best_model.pt now holds a later epoch
    # What the kill leaves: the epoch-1 checkpoint beside the later best_model.pt.
    (run_dir / "checkpoint.pt").write_bytes(epoch_1["checkpoint.pt"])
    (run_dir / "metrics.json").unlink()
    (run_dir / "status").write_text("running\n")
    with pytest.MonkeyPatch.context() as m:
        signal_self_after(m, 7)
        assert main_in_process(*args) == 75
    best = torch.load(run_dir / "best_model.pt", weights_only=True)
    expected = torch.load(io.BytesIO(epoch_1["best_model.pt"]), weights_only=True)
    assert all(torch.equal(best[k], expected[k]) for k in expected)


PRECISION_RESUME = ("--epochs", "1", "--max-steps", "12", "--checkpoint-every", "0")


@pytest.mark.parametrize(("before", "after"), [("fp32", "fp16"), ("fp16", "fp32")])
def test_a_resume_under_another_precision_continues_and_says_so(
    main_in_process, tmp_path, monkeypatch, before, after
):
    """A requeue onto another GPU generation: bf16/fp32 <-> fp16 + GradScaler. Before, a
    GradScaler that had to load the empty state of a disabled one raised (a traceback on every
    retry), and the other way round the scaler's state vanished without a word."""
    import torch

    from labrun import hardware

    dtypes = {"fp32": None, "fp16": torch.float16}  # CPU autocast runs fp16 too
    args = (*PRECISION_RESUME, "--results-dir", str(tmp_path))
    with monkeypatch.context() as m:  # as tests/test_hardware.py decides CUDA precision
        m.setattr(hardware, "choose_precision", lambda device, amp: (dtypes[before], before))
        signal_self_after(m, 5)
        assert main_in_process(*args) == 75
    run_dir = run_dir_of(tmp_path)
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)["trainer"]
    assert saved["precision"] == {"autocast": before, "grad_scaler": before == "fp16"}
    assert bool(saved["scaler"]) == (before == "fp16")
    monkeypatch.setattr(hardware, "choose_precision", lambda device, amp: (dtypes[after], after))
    assert main_in_process(*args) == 0
    log = (run_dir / "run.log").read_text()
    assert f"checkpoint was written under {before}, this run continues under {after}" in log
    expected = "a new GradScaler starts" if after == "fp16" else "GradScaler state is dropped"
    assert expected in log
    metrics = read_metrics(run_dir)
    assert metrics["steps"] == 12 and metrics["test_acc"] > 0.1
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)["trainer"]
    assert saved["precision"] == {"autocast": after, "grad_scaler": after == "fp16"}


def test_a_checkpoint_that_fails_to_load_is_refused_once_and_for_good(
    main_in_process, tmp_path, capsys
):
    """Any exception while loading is one `error: cannot resume:` line and exit 2; the status
    says "refused", so the sweep's planner stops promising a resume; --fresh starts over."""
    import torch

    from labrun import plan

    args = ("--epochs", "1", "--max-steps", "2", "--results-dir", str(tmp_path))
    assert main_in_process(*args) == 0
    run_dir = run_dir_of(tmp_path)
    # What a checkpoint from another machine's torch may hold: an RNG state of another size.
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    state["rng"]["torch"] = state["rng"]["torch"][:100]
    torch.save(state, run_dir / "checkpoint.pt")
    (run_dir / "metrics.json").unlink()
    (run_dir / "status").write_text("interrupted\n")
    capsys.readouterr()
    assert main_in_process(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot resume: ") and "--fresh" in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert (run_dir / "status").read_text() == "refused\n"
    state, note = plan.job_state(run_dir)
    assert state == "refused" and "--fresh" in note and "resumes" not in note
    assert main_in_process(*args, "--fresh") == 0
    assert plan.job_state(run_dir)[0] == "done"


def test_tools_report_and_exit_without_training(main_in_process, tmp_path, capsys):
    # All three in one invocation, as a user may.
    assert (
        main_in_process(
            "--find-lr", "--find-batch-size", "--profile", "--results-dir", str(tmp_path)
        )
        == 0
    )
    out = capsys.readouterr().out
    for expected in ("suggested --lr", "largest batch size that fits", "Self CPU"):
        assert expected in out
    run_dir = run_dir_of(tmp_path)
    assert (run_dir / "lr_find.csv").is_file() and (run_dir / "trace.json").is_file()
    assert not (run_dir / "metrics.json").exists() and not (run_dir / "checkpoint.pt").exists()
