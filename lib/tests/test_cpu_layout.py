"""The memory layout run.py trains in is a rule: channels_last for images (tensor cores on CUDA;
the loaders' own layout, so no copy per batch on a CPU), contiguous for other inputs."""

from __future__ import annotations


def layout_line(tmp_path, main_in_process, *argv) -> str:
    assert main_in_process(
        "--epochs", "1", "--tracking", "off", "--results-dir", str(tmp_path), *argv
    ) == 0  # fmt: skip
    [log] = tmp_path.glob("*/run.log")
    [line] = [x for x in log.read_text().splitlines() if " layout: " in x]
    return line


def test_images_train_channels_last(main_in_process, tmp_path):
    assert layout_line(tmp_path, main_in_process).endswith("layout: channels_last (images)")


def test_signals_train_contiguous(main_in_process, tmp_path):
    line = layout_line(tmp_path, main_in_process, "--dataset", "signals", "--model", "cnn1d")
    assert line.endswith("layout: contiguous (the inputs are not images)"), line
