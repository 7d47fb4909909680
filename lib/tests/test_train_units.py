"""Unit tests of the training pieces: early stopping, the LR peak, run.py's optimizer, checkpoints,
run identity and atomic files. No training run. The step itself (EMA, GradScaler, accumulation,
compile fallback, state) is in test_step.py, the device policy in test_hardware.py."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
from conftest import capture_step, load_run_py
from torch import nn

from labrun import checkpoint, config, runs
from labrun.distributed import Dist
from labrun.stopping import EarlyStopping, NonFiniteLoss, check_finite
from labrun.tasks import create_task
from labrun.train import Env, evaluate, lr_peak_step, peak_epoch

CPU = torch.device("cpu")


def _model_with_weight(value: float) -> nn.Linear:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_early_stopping_keeps_and_restores_the_best_weights():
    # Scripted validation accuracies: best at epoch 3, then 3 epochs without improvement.
    scores = [0.50, 0.60, 0.80, 0.70, 0.80, 0.75, 0.90]
    stopper, model, stopped_at = EarlyStopping(patience=3), _model_with_weight(0.0), None
    for epoch, score in enumerate(scores, start=1):
        with torch.no_grad():
            model.weight.fill_(float(epoch))  # the weights "are" the epoch number
        stopper.update(score, epoch, model)
        if stopper.should_stop:
            stopped_at = epoch
            break
    assert stopped_at == 6 and stopper.best_epoch == 3 and stopper.best_score == 0.80
    stopper.restore(model)
    assert model.weight.item() == 3.0  # a tie (0.80 at epoch 5) does not replace the best


def test_early_stopping_state_round_trips_and_patience_zero_never_stops():
    stopper, model = EarlyStopping(patience=0), _model_with_weight(1.0)
    for epoch in range(1, 20):
        stopper.update(0.5 if epoch == 1 else 0.1, epoch, model)
    assert not stopper.should_stop and stopper.bad_epochs == 18
    copy = EarlyStopping(patience=5)
    copy.load_state_dict(stopper.state_dict())
    assert (copy.patience, copy.best_epoch, copy.bad_epochs) == (0, 1, 18)


def test_early_stopping_counts_no_epoch_up_to_its_start():
    """Falling scores from epoch 2: with patience 2 counted from epoch 3 on, the run stops at
    epoch 5, not at epoch 3 (while the LR still climbs)."""
    stopper, model = EarlyStopping(patience=2, start_epoch=3), _model_with_weight(0.0)
    stopped = []
    for epoch, score in enumerate([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], start=1):
        stopper.update(score, epoch, model)
        stopped.append(stopper.should_stop)
    assert stopped.index(True) + 1 == 5 and stopper.best_epoch == 1


@pytest.mark.parametrize(("total", "per_epoch"), [(200, 10), (80, 20), (1000, 7), (5, 5)])
def test_patience_starts_after_the_lr_peak_and_beta1_cycles_as_documented(total, per_epoch):
    run_py, model = load_run_py(), nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(run_py.param_groups(model, 0.0), lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(  # as run.py builds it
        optimizer,
        max_lr=0.01,
        total_steps=total,
        pct_start=run_py.Config().warm_up,
        anneal_strategy="cos",
        cycle_momentum=True,
        base_momentum=0.85,
        max_momentum=0.95,
    )
    peak = lr_peak_step(scheduler)  # what Run reads from run.py's scheduler, before stepping it
    assert lr_peak_step(None) == 0.0  # no schedule (LBFGS): only --min-epochs holds patience
    lrs, beta1 = [], []
    for _ in range(total):
        lrs.append(scheduler.get_last_lr()[0])
        beta1.append(optimizer.param_groups[0]["betas"][0])
        optimizer.step()
        scheduler.step()
    peak_step = max(range(total), key=lrs.__getitem__)  # LR of step peak_step + 1 is the max
    # The epoch at whose end the peak is passed: epochs up to it never count against patience.
    assert (
        (peak_epoch(peak, per_epoch) - 1) * per_epoch
        <= peak_step
        < max(peak_epoch(peak, per_epoch) * per_epoch, 1)
    )
    # --lr's help: AdamW's beta1 cycles 0.95 -> 0.85 (at the LR peak) -> 0.95.
    if total > 10:
        assert beta1[0] == pytest.approx(0.95) and beta1[-1] == pytest.approx(0.95, abs=1e-3)
        assert beta1[peak_step] == pytest.approx(0.85)


def test_stop_reason_is_early_stopping_only_if_patience_ended_the_run_early():
    import argparse

    from labrun.session import Progress, stop_reason

    stopper, model = EarlyStopping(patience=1), _model_with_weight(0.0)
    stopper.update(0.5, 1, model)
    stopper.update(0.4, 2, model)  # patience ran out at epoch 2
    assert stopper.should_stop
    args = argparse.Namespace(epochs=5, max_steps=0)
    assert stop_reason(Progress(epoch=2, step=20), args, stopper) == "early_stopping"
    args.epochs = 2  # ... on the last epoch: the run ended there anyway
    assert stop_reason(Progress(epoch=2, step=20), args, stopper) == "max_epochs"
    args.epochs, args.max_steps = 5, 20  # ... on the last step
    assert stop_reason(Progress(epoch=2, step=20), args, stopper) == "max_steps"


def test_check_finite_names_the_steps():
    check_finite(1.5, 1, 1, 10)
    for bad in (math.nan, math.inf):
        with pytest.raises(NonFiniteLoss, match="epoch 3, between optimizer steps 21 and 30"):
            check_finite(bad, 3, 21, 30)


def test_evaluate_is_inference_only_and_restores_train_mode():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).train()
    batches = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(2)]
    before = model[1].running_mean.clone()
    task = create_task("classification", argparse.Namespace(label_smoothing=0.0))
    env = Env(CPU, None, task, Dist())
    metrics = evaluate(model, batches, task.eval_loss, env)
    assert model.training and torch.equal(before, model[1].running_mean)
    assert math.isfinite(metrics["loss"]) and 0 <= metrics["acc"] <= 1


def test_fused_adamw_and_no_decay_on_norms(monkeypatch, data_dir, tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
    run_py = capture_step(monkeypatch, data_dir, tmp_path, "--weight-decay", "0.05", model=model)
    optimizer = run_py.optimizer
    # Fused on the CPU too (torch >= 2.4): unfused, its per-tensor loop was 322 of the default
    # step's 495 aten ops (test_step.py holds the step to its budget).
    assert optimizer.defaults["fused"]
    decays = sorted(g["weight_decay"] for g in optimizer.param_groups)
    assert decays == [0.0, 0.05] and len(optimizer.param_groups[1]["params"]) == 2


def test_checkpoint_round_trip_and_refusals(tmp_path):
    path = tmp_path / "checkpoint.pt"
    model = _model_with_weight(2.0)
    checkpoint.save(
        path,
        {"model": model.state_dict(), "rng": checkpoint.rng_state(CPU), "config_hash": "abcd1234"},
    )
    expected = torch.rand(3)  # drawn right after the state was captured
    state = checkpoint.load(path, config_hash="abcd1234")
    assert checkpoint.set_rng_state(state["rng"], CPU) is None
    torch.testing.assert_close(torch.rand(3), expected)
    with pytest.raises(checkpoint.CheckpointError, match="another configuration"):
        checkpoint.load(path, config_hash="ffff0000")
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model"):
        checkpoint.load_model_state(nn.Linear(2, 2), state["model"], "checkpoint.pt")
    path.write_bytes(path.read_bytes()[:100])  # truncated, as after a crash without atomicity
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or unreadable"):
        checkpoint.load(path, config_hash="abcd1234")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp files left


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "metrics.json"
    runs.write_json(target, {"a": 1})
    with pytest.raises(RuntimeError), runs.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert runs.read_json(target) == {"a": 1} and len(list(tmp_path.iterdir())) == 1


def test_run_identity():
    parser = config.build_parser()
    base, _ = config.parse_args(["--lr", "0.01", "--seed", "2"])
    same = parser.parse_args(
        [
            "--lr",
            "0.01",
            "--seed",
            "2",
            "--device",
            "cpu",
            "--amp",
            "off",
            "--deterministic",
            "--results-dir",
            "/elsewhere",
        ]
    )
    assert config.short_hash(config.identity_args(base)) == config.short_hash(
        config.identity_args(same)
    )
    assert config.short_hash(config.identity_args(base)) != config.short_hash(
        config.identity_args(parser.parse_args(["--lr", "0.02"]))
    )
    name = config.run_dir(base, parser).name
    assert name.startswith("digits_lr=0.01_seed=2-") and len(name.rsplit("-", 1)[1]) == 8
    assert {"device", "results_dir", "find_lr"} <= config.execution_keys()
    assert not {"lr", "seed", "data_path"} & config.execution_keys()


def test_updates_keep_existing_run_directories(monkeypatch):
    """Run names of the first release, pinned: a new flag at its default must not move them
    (only config.FIRST_RELEASE_KEYS are hashed at any value), or every finished run would be
    trained again after an update."""
    released = {
        (): "digits-07ad383c",
        ("--lr", "0.01", "--seed", "1"): "digits_lr=0.01_seed=1-4c5ba385",
        ("--dataset", "synthetic", "--ema", "0.9"): "synthetic_ema=0.9-f23144b4",
    }
    for argv, name in released.items():
        args, parser = config.parse_args([*argv, "--results-dir", "/r"])
        assert config.run_dir(args, parser).name == name, argv
    # A flag added since joins the hash only once it leaves its default (None here).
    args, _ = config.parse_args([])
    before = config.short_hash(config.identity_args(args))
    args.newflag = None
    assert config.short_hash(config.identity_args(args)) == before
    args.newflag = "other"
    assert config.short_hash(config.identity_args(args)) != before


def test_flags_now_in_run_pys_config_keep_their_run_names():
    """--lr, --weight-decay, --clip-grad and --ema moved from labrun to run.py's Config: mixed
    with labrun's flags, a command line names the same directory as the release before did
    (names computed with that release)."""
    released = {
        ("--clip-grad", "1", "--seed", "2", "--label-smoothing", "0.1", "--lr", "0.02",
         "--batch-size", "32"): "digits_batch_size=32_lr=0.02_seed=2_clip_grad=1_"
        "label_smoothing=0.1-a304a79d",
        ("--ema", "0.99", "--weight-decay", "0", "--patience", "3", "--grad-accum", "2"):
            "digits_weight_decay=0_patience=3_grad_accum=2_ema=0.99-39f9f381",
        ("--model", "cnn1d", "--dataset", "signals", "--lr", "0.1", "--clip-grad", "0.5",
         "--epochs", "4"): "signals_model=cnn1d_epochs=4_lr=0.1_clip_grad=0.5-81abad26",
    }  # fmt: skip
    for argv, name in released.items():
        args, parser = config.parse_args([*argv, "--results-dir", "/r"])
        assert config.run_dir(args, parser).name == name, argv


def test_a_config_field_is_a_typed_flag_in_the_identity_unless_execution(monkeypatch, capsys):
    """One line of run.py's Config: a flag with its help, bounds, identity and config.json."""
    run_py = load_run_py()

    @dataclasses.dataclass
    class Config(run_py.Config):
        momentum: float = config.flag(0.9, "SGD momentum, 5% less is ok", at_least=0, below=1)
        sample_every: int = config.flag(50, "steps between samples drawn", execution=True, above=0)
        nesterov: bool = config.flag(False, "Nesterov's momentum")

    monkeypatch.setattr(config, "_config", Config)
    help_text = " ".join(config.build_parser().format_help().split())
    assert "--momentum MOMENTUM SGD momentum, 5% less is ok (default: 0.9)" in help_text
    args, parser = config.parse_args(["--results-dir", "/r"])
    assert config.run_dir(args, parser).name == "digits-07ad383c"  # all at their defaults
    args, parser = config.parse_args(["--momentum", "0.5", "--nesterov", "--results-dir", "/r"])
    assert config.run_dir(args, parser).name.startswith("digits_momentum=0.5_nesterov=True-")
    resolved = config.resolved_config(args, parser)
    assert resolved["momentum"] == 0.5 and "momentum" in resolved["experiment_keys"]
    same, _ = config.parse_args(["--momentum", "0.5", "--nesterov", "--sample-every", "7"])
    assert config.short_hash(config.identity_args(same)) == config.short_hash(
        config.identity_args(args)
    )  # execution-only
    assert "sample_every" not in config.resolved_config(same, parser)["experiment_keys"]
    for argv, message in (
        (["--momentum", "1"], "--momentum: must be in [0, 1), got 1"),
        (["--sample-every", "0"], "--sample-every: must be positive, got 0"),
    ):
        with pytest.raises(SystemExit) as exited:
            config.parse_args(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: {message}")  # fmt: skip


def test_history_file_has_the_documented_header(tmp_path):
    row = dict.fromkeys(runs.HISTORY_FIELDS, 1.0)
    runs.write_history(tmp_path, [row, row])
    lines = (tmp_path / "history.csv").read_text().splitlines()
    assert lines[0].split(",") == list(runs.HISTORY_FIELDS) and len(lines) == 3


def test_metrics_json_holds_null_and_a_reason_never_nan():
    from labrun.session import finite_or_null

    assert finite_or_null({"a": 1.0, "b": "x"}) == {"a": 1.0, "b": "x"}
    cleaned = finite_or_null({"test_loss": math.nan, "best_val_r2": -math.inf, "steps": 3})
    assert cleaned["test_loss"] is None and cleaned["best_val_r2"] is None
    assert cleaned["null_reasons"] == {
        "test_loss": "nan (not finite)",
        "best_val_r2": "-inf (not finite)",
    }
    import json

    json.dumps(cleaned, allow_nan=False)  # strict JSON


def test_a_monitored_metric_never_finite_fails_the_run_in_one_line(
    main_in_process, tmp_path, monkeypatch, capsys
):
    """Issue 29.3: no epoch gave a finite val_acc, so there are no best weights to test."""
    from labrun import session

    real = session.TrainingJob.end_epoch

    def end_epoch(self, sums, val, *, lr):
        return real(self, sums, {**val, "acc": math.nan}, lr=lr)

    monkeypatch.setattr(session.TrainingJob, "end_epoch", end_epoch)
    assert (
        main_in_process("--epochs", "2", "--tracking", "off", "--results-dir", str(tmp_path)) == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: val_acc was never finite in 2 epoch(s): no best weights to test (try a lower "
        "--lr or --clip-grad)"
    )
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "status").read_text() == "failed\n" and not (
        run_dir / "metrics.json"
    ).exists()


@pytest.mark.parametrize(
    ("text", "zero", "expected"),
    [("", False, 120.0), (" 5 ", False, 5.0), ("0", True, 0.0), ("0", False, None),
     ("-1", True, None), ("nan", True, None), ("inf", False, None), ("abc", True, None)],
)  # fmt: skip
def test_seconds_from_the_environment_are_finite_and_positive_or_refused(
    monkeypatch, text, zero, expected
):
    """LAB_STOP_GRACE_S (0 allowed: a second signal forces) and LAB_DIST_TIMEOUT_S (> 0)."""
    monkeypatch.setenv("SECONDS_TEST", text)
    if expected is None:
        with pytest.raises(ValueError, match=f"^SECONDS_TEST={text!r}: expected a number of sec"):
            runs.seconds_from_env("SECONDS_TEST", 120.0, zero=zero)
    else:
        assert runs.seconds_from_env("SECONDS_TEST", 120.0, zero=zero) == expected
