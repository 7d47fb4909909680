"""Misfits refused before training (exit 2, one `error:` line naming the flags, no run directory
left), a full disk as the disk message, a killed writer's temps, a labrun other than the pin.
Each case runs the rendered project's run.py in a real process."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    PACKAGE,
    ROOT,
    TINY,
    cli_command,
    load_run_py,
    run_dir_of,
    wait_while_running,
)

GiB = 2**30


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_refused(result, *names: str) -> str:
    """Exit 2, one `error:` line holding every one of `names`, no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [line] = error_lines(result.stderr)
    for name in names:
        assert name in line, line
    return line


def assert_nothing_left(results: Path) -> None:
    assert not results.exists() or not any(results.iterdir()), list(results.rglob("*"))


# ---- models too big for the memory: refused before they are allocated --------------------------
@pytest.mark.parametrize("width", ["4000", "100000000"])
def test_a_model_too_big_for_the_memory_is_refused_before_it_is_allocated(
    width, env, data_dir, tmp_path
):
    """--width 4000 grew to 19.5 GB until the OOM killer ended it (or a neighbour's job), and
    --width 100000000 died in the allocator. Here under an address-space limit of 6 GiB (so a
    regression fails in the allocator, not on the machine): refused, and the job never held
    more than the interpreter, torch and the data (its peak RSS, from the kernel)."""
    results = tmp_path / "results"
    # after TINY's --width 8: the last one counts
    cmd = cli_command("--width", width, "--tracking", "off", results_dir=results,
                      data_dir=data_dir)  # fmt: skip

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * GiB, 6 * GiB))

    with open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=limit_memory, text=True)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        result = SimpleNamespace(returncode=proc.returncode, stderr=err.read())
    line = assert_refused(result, f"--width {width}", "host memory", "choose a smaller --width")
    assert usage.ru_maxrss * 1024 < 2 * GiB, (usage.ru_maxrss, line)
    assert_nothing_left(results)


def _preflight_args(width: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    args = SimpleNamespace(model="cnn", width=width, model_args={}, ema=0.0, batch_size=128)
    info = SimpleNamespace(num_classes=10, channels=3, image_size=(32, 32), input_shape=(3, 32, 32))
    return args, info


def test_on_cuda_the_model_is_held_against_the_gpus_free_memory_and_the_host_keeps_a_copy(
    monkeypatch,
):
    """The CUDA branch, with the device's queries patched (no GPU here): parameters, gradients,
    AdamW state and activations go to the GPU's free memory, the best weights to the host's."""
    import torch

    from labrun import data, preflight
    from labrun.config import UsageError

    args, info = _preflight_args(64)
    make_model = load_run_py().make_model  # what labrun checks is what run.py trains
    gpu = torch.device("cuda", 0)
    free = {"gpu": 16 * 2**20, "host": 1 << 40}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["gpu"], 80 * GiB))
    monkeypatch.setattr(data, "available_ram_bytes", lambda: free["host"])
    with pytest.raises(UsageError, match=r"of memory on cuda:0 .* but 16.0 MiB is free"):
        preflight.check_memory(args, info, gpu, torch.bfloat16, make_model, micro_batch=128)
    free.update(gpu=80 * GiB, host=64 * 2**20)  # a small host: only the best weights live there
    assert "training needs about" in preflight.check_memory(
        args, info, gpu, torch.bfloat16, make_model, micro_batch=128
    )
    with pytest.raises(UsageError, match=r"of host memory .* but 64.0 MiB is free"):
        preflight.check_memory(args, info, torch.device("cpu"), None, make_model, micro_batch=128)


def test_the_estimate_counts_what_training_holds():
    """Parameters once, gradients + two AdamW moments three times, activations at the autocast
    width (2 bytes under bf16/fp16)."""
    import torch

    from labrun import preflight
    from labrun.models import create_model

    with torch.device("meta"):
        model = create_model("cnn", num_classes=10, channels=3, image_size=(32, 32), width=16)
    fp32 = preflight.estimate(model, (8, 3, 32, 32), ema=True, half=False)
    half = preflight.estimate(model, (8, 3, 32, 32), ema=True, half=True)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert fp32.parameters == fp32.ema == fp32.best == weights
    assert fp32.training == 3 * sum(p.numel() * 4 for p in model.parameters())
    assert fp32.activations > 0 and half.activations * 2 == fp32.activations


# ---- a model that does not fit the data or the task ------------------------------------------
@pytest.mark.parametrize(
    "args, names",
    [
        (("--model", "cnn1d"), ("--model cnn1d", "conv1d", "choose another --model")),
        (("--task", "regression"), ("--task regression", "choose another --model, --task")),
    ],
)
def test_a_model_or_task_that_does_not_fit_the_data_is_refused(args, names, run_cli, tmp_path):
    """Before: a torch traceback, a `failed` run directory (and a FAILED MLflow run)."""
    results = tmp_path / "results"
    result = run_cli(*args, "--epochs", "1", results_dir=results)
    assert_refused(result, *names)
    assert_nothing_left(results)


# ---- labels and inputs -------------------------------------------------------------------------
DATASET_FILE = """
import os

import numpy as np
from labrun.datasets import DatasetSplits, register_dataset


@register_dataset("spoiled", help="three classes of noise, spoiled as $SPOIL says")
def spoiled(options):
    rng = np.random.default_rng(0)
    images = rng.random((400, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 3, 400)
    test = None
    spoil = os.environ["SPOIL"]
    if spoil == "float labels":
        labels = labels + 0.5
    elif spoil == "string labels":
        labels = np.array(["cat", "dog", "emu"])[labels]
    elif spoil == "a label out of range":
        labels[7] = 3
    elif spoil == "an empty test split":
        test = (images[:0], labels[:0])
    elif spoil == "a NaN input":
        images[5, 0, 2, 2] = np.nan
    elif spoil == "an infinite input":
        images[9, 0, 0, 0] = -np.inf
    return DatasetSplits(train=(images, labels), test=test, class_names=["a", "b", "c"])
"""


def project_with_dataset(dest: Path, text: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("run.py", "pyproject.toml", PACKAGE):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, dest / name)
    (dest / PACKAGE / "spoiled_data.py").write_text(text)
    return dest


@pytest.fixture(scope="module")
def spoiled_project(tmp_path_factory) -> Path:
    return project_with_dataset(tmp_path_factory.mktemp("spoiled"), DATASET_FILE)


@pytest.mark.parametrize(
    "spoil, said",
    [
        ("float labels", "needs integer class ids; the train split's labels are floats (such as"),
        ("string labels", "labels must be numbers (class ids 0..K-1, or float targets), got <U3"),
        ("a label out of range", "labels outside 0..2"),
        ("an empty test split", "spoiled/test: the split is empty"),
        ("a NaN input", "spoiled/train: input row 5 holds nan"),
        ("an infinite input", "spoiled/train: input row 9 holds -inf"),
    ],
)
def test_labels_and_inputs_that_cannot_train_are_refused(spoil, said, spoiled_project, env,
                                                         data_dir, tmp_path):  # fmt: skip
    """Before: float labels trained as one class, string labels and an empty split left a
    .lock-only directory after a traceback, NaN inputs read as an LR that diverged."""
    results = tmp_path / "results"
    cmd = [sys.executable, "run.py", *TINY, "--dataset", "spoiled", "--epochs", "1",
           "--batch-size", "16", "--tracking", "off", "--data-dir", str(data_dir),
           "--results-dir", str(results)]  # fmt: skip
    own_env = {k: v for k, v in env.items() if k != "LABRUN_PROJECT"}
    result = subprocess.run(cmd, cwd=spoiled_project, env={**own_env, "SPOIL": spoil},
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert_refused(result, said)
    assert_nothing_left(results)


# ---- a full disk -------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MiB tmpfs (root only; skipped where mount is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Take all but `leave` bytes of `disk`'s free space."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.truncate(0)
        chunk = b"\1" * (1 << 20)
        todo = free - leave
        while todo > 0:
            todo -= f.write(chunk[: min(len(chunk), todo)])


def test_auto_streams_a_folder_whose_decoded_cache_the_disk_cannot_hold(small_disk, tmp_path):
    """--data-mode auto looks at --data-dir's free space before a decode that would fill it: it
    streams and says why; --data-mode memory insists, and fails in one line, no file left."""
    from image_folders import make_folder

    from labrun.data import load_dataset

    folder = make_folder(tmp_path / "f", {"train": 6, "test": 2}, size=(64, 64))
    data_dir = small_disk / "data"
    data_dir.mkdir()
    fill(small_disk, leave=96 * 1024)  # the decoded cache: 16 images x 64x64x3 = 192 KiB
    streamed = load_dataset("folder", data_dir, data_path=folder, mode="auto", workers=0)
    # run.log's `images from:` line says why
    assert streamed.info.source.startswith("stream"), streamed.info.source
    assert "--data-dir has" in streamed.info.source, streamed.info.source
    with pytest.raises(ValueError, match="^--data-dir: cannot write the decoded cache .*No space"):
        load_dataset("folder", data_dir, data_path=folder, mode="memory", workers=0)
    assert not list(data_dir.glob("decoded-*"))


@pytest.mark.slow  # training until the disk is filled under it
def test_a_disk_that_fills_inside_torch_save_is_the_disk_message(small_disk, env, data_dir):
    """Before: `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`."""
    results = small_disk / "results"
    cmd = cli_command("--width", "32", "--epochs", "200", "--tracking", "off",
                      results_dir=results, data_dir=data_dir)  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    # epoch 1's best_model.pt written (it follows the epoch's line): no write races the filler
    wait_while_running(
        lambda: any("best so far" in p.read_text() for p in results.glob("*/run.log")),
        proc,
        timeout=600,
    )
    fill(small_disk, leave=256 * 1024)  # room for history.csv and run.log, not for weights
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    [line] = error_lines(err)  # (run.log, echoed above it, keeps the traceback)
    assert line.startswith("error: No space left on device writing "), line
    assert line.split()[7].endswith(".pt:"), line  # best_model.pt or checkpoint.pt
    assert "its last complete checkpoint is kept (free space, then re-run to resume)" in line
    assert (run_dir_of(results) / "status").read_text() == "failed\n"


@pytest.mark.slow  # two runs
def test_a_re_run_needs_room_only_for_what_it_adds(small_disk, run_cli):
    """The space check counted the checkpoint and best_model.pt a re-run replaces as new: a
    run that had room to resume was refused."""
    results = small_disk / "results"
    first = run_cli("--width", "32", "--epochs", "1", "--tracking", "off", results_dir=results)
    assert first.returncode == 0, first.stderr
    run_dir = run_dir_of(results)
    (run_dir / "metrics.json").unlink()  # lost: the re-run finishes it again
    weights = (run_dir / "best_model.pt").stat().st_size
    kept = weights + (run_dir / "checkpoint.pt").stat().st_size
    # a first run's need (session.room_needed), and what a re-run adds to the files it has
    whole, added = 9 * weights, 9 * weights - kept
    fill(small_disk, leave=(whole + added) // 2)
    again = run_cli("--width", "32", "--epochs", "1", "--tracking", "off", results_dir=results)
    assert again.returncode == 0, again.stderr
    assert (run_dir / "metrics.json").exists()


# ---- a killed writer's temps -------------------------------------------------------------------
def test_a_killed_writers_temps_go_at_the_next_claim_whatever_their_age(run_cli, tmp_path):
    """A half-written checkpoint (kill -9 inside torch.save) stayed forever when the re-run that
    finished the directory came within 60 s; another tool's temp still gets its 60 s."""
    results = tmp_path / "results"
    first = run_cli("--epochs", "1", "--tracking", "off", results_dir=results)
    assert first.returncode == 0, first.stderr
    run_dir = run_dir_of(results)
    (run_dir / "metrics.json").unlink()
    half_written = run_dir / ".checkpoint.pt.k9w2x1ab.tmp"  # atomic_path's name for it
    half_written.write_bytes(b"\0" * (1 << 20))
    others = run_dir / ".notes.txt.tmp"
    others.write_text("another tool's, just now")
    again = run_cli("--epochs", "1", "--tracking", "off", results_dir=results)
    assert again.returncode == 0, again.stderr
    assert not half_written.exists()
    assert others.exists()


# ---- the labrun a project pins -----------------------------------------------------------------
def test_a_labrun_other_than_the_pin_is_one_warning_line(env, data_dir, tmp_path):
    import labrun

    project = project_with_dataset(tmp_path / "project", "")
    pyproject = project / "pyproject.toml"
    pinned = f'"labrun=={labrun.__version__}"'
    assert pinned in pyproject.read_text()
    cmd = [sys.executable, "run.py", *TINY, "--epochs", "1", "--tracking", "off",
           "--data-dir", str(data_dir), "--results-dir", str(tmp_path / "results")]  # fmt: skip
    own_env = {k: v for k, v in env.items() if k != "LABRUN_PROJECT"}

    def warnings() -> list[str]:
        result = subprocess.run(cmd, cwd=project, env=own_env, capture_output=True, text=True,
                                timeout=600)  # fmt: skip
        assert result.returncode == 0, result.stderr
        return [line for line in result.stderr.splitlines() if line.startswith("warning:")]

    assert warnings() == []  # the pinned version: silence
    pyproject.write_text(pyproject.read_text().replace(pinned, '"labrun==0.0.9"'))
    shutil.rmtree(tmp_path / "results")
    [line] = warnings()
    assert line == (
        f"warning: labrun {labrun.__version__} is installed but {pyproject} pins "
        "labrun==0.0.9: pip install labrun==0.0.9, or raise the pin (README, 'Update')"
    )


def test_a_pin_with_the_code_in_its_version_names_the_projects_wheel(tmp_path):
    """The template pins its wheel's version, local part included (`+g<hash>`: the library's
    code): another build of the release is a warning whose hint installs the project's wheel;
    an editable install (no local part) or a release pin (none either) match any build."""
    from labrun.project import version_warning

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["labrun==0.1.0+g0123456789ab"]\n')
    assert version_warning(tmp_path, "0.1.0+g0123456789ab") is None
    assert version_warning(tmp_path, "0.1.0") is None
    wheel = tmp_path / "wheels" / "labrun-0.1.0+g0123456789ab-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    assert version_warning(tmp_path, "0.1.0+gba9876543210") == (
        f"labrun 0.1.0+gba9876543210 is installed but {pyproject} pins "
        f"labrun==0.1.0+g0123456789ab: pip install {wheel}, or raise the pin (README, 'Update')"
    )
    pyproject.write_text('[project]\ndependencies = ["labrun==0.1.0"]\n')
    assert version_warning(tmp_path, "0.1.0+gba9876543210") is None
    assert "pip install labrun==0.1.0," in version_warning(tmp_path, "0.2.0")
