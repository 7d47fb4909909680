"""LR range test, batch-size search and profiler on a tiny model, CPU only."""

import csv
import json
import math
from collections import Counter

import pytest
import torch
from lab_project.model import build_model
from torch import nn

from labrun.data import Split
from labrun.loaders import Loader
from labrun.tools.tuning import (
    find_batch_size,
    find_lr,
    profile_training,
    scale_lr,
    suggest_lr,
)


@pytest.fixture(scope="module")
def loader():
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(128) % 10
    # Learnable: brightness encodes the class.
    images = (
        labels.view(-1, 1, 1, 1) * 25 + torch.randint(0, 20, (128, 3, 32, 32), generator=gen)
    ).to(torch.uint8)
    return Loader(Split(images, labels), 16, train=True, device="cpu")


def tiny_model():
    return build_model(width=8)


def test_find_lr_suggests_and_restores(loader, tmp_path):
    torch.manual_seed(0)  # the same curve whichever tests ran before in this process
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the run's own
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()  # some state of the run's, which the range test must put back
    optimizer.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    lr = find_lr(
        model,
        loader,
        nn.CrossEntropyLoss(),
        optimizer,
        device="cpu",
        out_dir=tmp_path,
        steps=20,
        start_lr=1e-4,
        end_lr=10,
    )
    assert math.isfinite(lr) and 1e-4 <= lr <= 10
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert optimizer.param_groups[0]["lr"] == 0.1
    after = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, momentum, strict=True))
    assert (tmp_path / "lr_find.png").stat().st_size > 0
    with open(tmp_path / "lr_find.csv") as f:
        rows = list(csv.DictReader(f))
    assert 1 <= len(rows) <= 20 and set(rows[0]) == {"step", "lr", "loss", "smoothed_loss"}


def test_suggest_lr_rule():
    lrs = [10.0 ** (e / 2) for e in range(-12, 1)]  # 1e-6 .. 1, 13 points
    # EMA start-up noise first (ignored), then a plateau, the steepest fall at 1e-3, the
    # minimum at 1e-2, then divergence.
    smoothed = [3.0, 2.0, 2.4, 2.3, 2.3, 2.3, 1.6, 0.9, 0.7, 0.8, 2.0, 5.0, 9.0]
    assert suggest_lr(lrs, smoothed) == pytest.approx(1e-3)
    # The minimum comes too early for a slope: its LR / 10, but never below the first LR tried.
    assert suggest_lr(lrs[:8], [3, 3, 3, 3, 3, 0.5, 5.0, 9.0]) == pytest.approx(10**-3.5 / 10)
    assert suggest_lr(lrs[:5], [1.0, 0.5, 5.0, 9.0, 9.0]) == lrs[0]


def test_find_batch_size_on_cpu_is_a_capped_power_of_two(capsys):
    size = find_batch_size(tiny_model, device="cpu", start=4, max_batch=20)
    assert size == 16  # the largest power of two <= 20; 4, 8 and 16 each ran one step
    assert "no out-of-memory test on the CPU" in capsys.readouterr().out


def test_scale_lr():
    assert scale_lr(0.1, 128, 512) == pytest.approx(0.4)
    assert scale_lr(0.1, 128, 512, rule="sqrt") == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown LR scaling rule"):
        scale_lr(0.1, 128, 512, rule="cubic")


def test_profile_covers_whole_optimizer_steps_of_a_short_run(
    loader, tmp_path, monkeypatch, data_dir
):
    from conftest import capture_step

    # run.py's step, with a 2-step run: its one-cycle schedule alone would refuse the 5 steps
    # profiled below.
    run_py = capture_step(
        monkeypatch, data_dir, tmp_path / "r", "--grad-accum", "2", "--max-steps", "2",
        model=tiny_model(),
    )  # fmt: skip
    table = profile_training(
        run_py.step,
        loader,
        device="cpu",
        grad_accum=2,
        scheduler=run_py.scheduler,
        out_dir=tmp_path,
        steps=3,
        warmup=2,
    )
    assert "convolution" in table  # the top-10 table names the expensive ops
    per_step = table.splitlines()[0]  # issue 33.3: what a step launches, counted
    assert per_step.startswith("per step: ") and " aten ops, " in per_step
    assert int(per_step.split()[2]) > 20  # 2 micro-batches of forward + backward, AdamW
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = Counter(e.get("name", "") for e in events if e.get("ph") == "X")
    assert sum(n.startswith("optimizer_step_") for n in names) == 3
    assert sum(c for n, c in names.items() if n.startswith("Optimizer.step#")) == 3
    assert names["aten::log_softmax"] == 6  # 2 micro-batches in each of the 3 steps
