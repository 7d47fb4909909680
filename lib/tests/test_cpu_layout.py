"""28.9: the CPU's memory layout is chosen by measurement, per machine, never by vendor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labrun import hardware


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip


def test_the_faster_layout_on_this_cpu_wins_and_is_recorded(tmp_path, monkeypatch):
    model, x, y = small_cnn(), torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    cpu = torch.device("cpu")
    # A CPU where oneDNN's channels_last kernels are slower (issue 28.9's Xeon: 0.89x a plain
    # NCHW loop): the probe measures it, the vendor does not enter.
    timings = {torch.channels_last: 0.012, torch.contiguous_format: 0.010}
    probed = []

    def step_s(model, x, y, loss_fn, dtype, layout):
        probed.append(layout)
        return timings[layout]

    monkeypatch.setattr(hardware, "_layout_step_s", step_s)
    layout, why = hardware.choose_memory_format(
        model, x, y, F.cross_entropy, dtype=None, device=cpu, cache_dir=tmp_path
    )
    assert layout == torch.contiguous_format and why.startswith("NCHW on this CPU"), why
    assert "10.0 ms vs 12.0 ms channels_last (measured now; NCHW when >= 10 % faster)" in why
    assert len(probed) == 2 * hardware.LAYOUT_ROUNDS
    # The next job on this machine reads the record: no probe, the same choice, said where.
    again, why = hardware.choose_memory_format(
        model, x, y, F.cross_entropy, dtype=None, device=cpu, cache_dir=tmp_path
    )
    assert again == layout and len(probed) == 2 * hardware.LAYOUT_ROUNDS and "recorded" in why
    # Another machine (here: a near tie, which keeps the loaders' layout) measures for itself.
    timings = {torch.channels_last: 0.0105, torch.contiguous_format: 0.010}
    monkeypatch.setattr(hardware, "_cpu_model_name", lambda: "another CPU")
    other, why = hardware.choose_memory_format(
        model, x, y, F.cross_entropy, dtype=None, device=cpu, cache_dir=tmp_path
    )
    assert other == torch.channels_last and "measured now" in why


def test_the_probe_leaves_the_model_and_the_random_stream_alone(tmp_path):
    model, x, y = small_cnn(), torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    layout, why = hardware.choose_memory_format(
        model, x, y, F.cross_entropy, dtype=None, device=torch.device("cpu"), cache_dir=None
    )
    assert torch.equal(torch.rand(3), expected)  # dropout in the probe drew nothing of ours
    assert layout in (torch.channels_last, torch.contiguous_format) and "measured now" in why
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert hardware.choose_memory_format(
        model, x, y, F.cross_entropy, dtype=None, device=torch.device("cuda"), cache_dir=None
    ) == (torch.channels_last, "channels_last (tensor cores)")


def test_run_log_states_the_layout_run_py_trains_in(main_in_process, tmp_path):
    assert (
        main_in_process("--epochs", "1", "--tracking", "off", "--results-dir", str(tmp_path)) == 0
    )
    [log] = tmp_path.glob("*/run.log")
    [line] = [x for x in log.read_text().splitlines() if " layout: " in x]
    assert " on this CPU: forward + backward " in line and "ms" in line, line
