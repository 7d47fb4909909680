"""The `folder` dataset: scanning, one-line errors, memory and stream paths, resume, workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEADLINE, ROOT, RUN_PY, cli_command, read_metrics, run_dir_of
from image_folders import CLASSES, make_folder

from labrun import data, gpudecode, loaders
from labrun.data import FileSplit, Split, load_dataset
from labrun.loaders import Loader


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory):
    """PNG and JPEG, grey, RGB and RGBA, two image sizes; train and test, no val."""
    return make_folder(
        tmp_path_factory.mktemp("mixed"),
        {"train": 8, "test": 2},
        mixed=True,
        modes=("RGB", "L", "RGBA"),
        extensions=(".png", ".jpg"),
    )


def load(folder, data_dir, **kwargs):
    return load_dataset("folder", data_dir, data_path=folder, **kwargs)


def test_mixed_folder_loads_in_memory_resized_and_converted(mixed_folder, tmp_path):
    loaded = load(mixed_folder, tmp_path, image_size=(12, 12), mode="memory", workers=0)
    assert loaded.mode == "memory"
    assert loaded.info.as_config() == {
        "num_classes": 3,
        "channels": 3,
        "image_size": [12, 12],
        "class_names": list(CLASSES),
        "split_sizes": {"train": 22, "val": 2, "test": 6},  # recorded in config.json
        "input_shape": [3, 12, 12],
        "input": loaded.info.describe(),  # dtype and shape, normalisation, augmentation
    }
    splits = loaded.splits
    assert {k: len(v) for k, v in splits.items()} == {"train": 22, "val": 2, "test": 6}
    for split in splits.values():
        assert isinstance(split, Split) and split.images.dtype == torch.uint8
        assert split.images.shape[1:] == (3, 12, 12)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npy")  # decoded cache


def test_mixed_sizes_need_image_size(mixed_folder, tmp_path):
    with pytest.raises(ValueError, match="--image-size: the images have 2 different sizes"):
        load(mixed_folder, tmp_path)


def test_grey_folder_has_one_channel_and_its_native_size(tmp_path):
    folder = make_folder(
        tmp_path / "grey", {"train": 4, "val": 1, "test": 1}, size=(10, 6), modes=("L",)
    )
    loaded = load(folder, tmp_path / "cache", mode="stream")
    assert (loaded.info.channels, loaded.info.image_size) == (1, (6, 10))  # (height, width)
    assert {k: len(v) for k, v in loaded.splits.items()} == {"train": 12, "val": 3, "test": 3}
    x, _ = next(iter(Loader(loaded.splits["train"], 4, train=True, device="cpu", workers=0)))
    assert x.shape == (4, 1, 6, 10)


def test_memory_and_stream_give_the_same_batches(mixed_folder, tmp_path):
    memory = load(mixed_folder, tmp_path, image_size=(12, 12), mode="memory", workers=0)
    stream = load(mixed_folder, tmp_path, image_size=(12, 12), mode="stream")
    assert isinstance(stream.splits["train"], FileSplit)
    for name in ("train", "val", "test"):
        batches = []
        for loaded in (memory, stream):
            loader = Loader(
                loaded.splits[name], 5, train=name == "train", device="cpu", workers=0, seed=3
            )
            torch.manual_seed(0)  # the augmentation's RNG, as a run would have it
            batches.append(list(loader))
        for (x_mem, y_mem), (x_str, y_str) in zip(*batches, strict=True):
            assert torch.equal(y_mem, y_str)
            assert torch.equal(x_mem, x_str)  # same pixels, same crops and flips


def test_stream_resume_with_restored_rng_is_exact(mixed_folder, tmp_path):
    split = load(mixed_folder, tmp_path, image_size=(12, 12), mode="stream").splits["train"]
    loader = Loader(split, 4, train=True, device="cpu", workers=1)
    loader.set_epoch(2)
    batches = iter(loader)
    next(batches), next(batches)
    rng_state = torch.get_rng_state()  # what a checkpoint after batch 2 holds
    rest = list(batches)
    torch.set_rng_state(rng_state)
    loader.set_epoch(2, skip_batches=2)
    resumed = list(loader)
    assert len(rest) == len(resumed) == len(loader) - 2
    for (x, y), (x2, y2) in zip(rest, resumed, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_test_split_never_depends_on_seed(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 10})  # no test/: carved from train
    first = load(folder, tmp_path, mode="stream", seed=0).splits
    other = load(folder, tmp_path, mode="stream", seed=1).splits
    assert first["test"].paths == other["test"].paths
    assert first["val"].paths != other["val"].paths
    assert not set(first["test"].paths) & set(first["train"].paths)


def test_decoded_cache_is_reused_and_follows_the_files(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "f", {"train": 3, "test": 1})
    first = load(folder, tmp_path / "cache", mode="memory", workers=0).splits

    def must_not_decode(*args):
        raise AssertionError("the second load must read the decoded cache")

    with monkeypatch.context() as patched:
        patched.setattr(gpudecode, "decode_image", must_not_decode)  # every batch reader
        again = load(folder, tmp_path / "cache", mode="memory", workers=0).splits
    assert torch.equal(first["train"].images, again["train"].images)
    edited = folder / "train" / CLASSES[0] / "0.png"
    from PIL import Image

    Image.new("RGB", (16, 16), (255, 0, 0)).save(edited)
    os.utime(edited, ns=(1, 1))  # a new mtime even on coarse-grained file systems
    # The cache is keyed by the folder's version; a file rewritten in place reaches it as the
    # README says (dataversion.py): touch a folder above it.
    os.utime(folder / "train")
    changed = load(folder, tmp_path / "cache", mode="memory", workers=0).splits
    assert not torch.equal(first["train"].images, changed["train"].images)
    assert not list((tmp_path / "cache").glob("*.lock"))


def test_unreadable_images_are_skipped_and_listed_up_to_one_percent(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 34, "test": 1}, size=(8, 8))  # 105 images
    (folder / "train" / CLASSES[1] / "broken.png").write_bytes(b"not a png")
    loaded = load(folder, tmp_path / "cache", mode="stream")
    assert len(loaded.splits["train"]) + len(loaded.splits["val"]) == 102
    (note,) = loaded.notes
    assert note.startswith("skipped 1 unreadable image(s) of 106")
    listing = next((tmp_path / "cache").glob("unreadable-images-*.txt"))
    assert "broken.png" in listing.read_text()
    (folder / "train" / CLASSES[2] / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(ValueError, match=r"2 of 107 images are unreadable \(more than 1%"):
        load(folder, tmp_path / "cache", mode="stream")


@pytest.mark.parametrize(
    "layout, message",
    [
        ("no_train", "train is not a folder"),
        ("no_classes", "has no class folders"),
        ("empty_class", "has no images"),
        ("test_only_class", "class 'owl' is in test/ but not in train/"),
        ("not_images", "has no images"),
    ],
)
def test_folder_errors_are_one_line(tmp_path, layout, message):
    root = tmp_path / "f"
    if layout != "no_train":
        (root / "train").mkdir(parents=True)
    if layout in ("empty_class", "test_only_class", "not_images"):
        make_folder(root, {"train": 1, "test": 1}, size=(8, 8))
    if layout == "empty_class":
        (root / "train" / "zebra").mkdir()
    if layout == "test_only_class":
        (root / "test" / "owl").mkdir()
        (root / "test" / CLASSES[0] / "0.png").rename(root / "test" / "owl" / "0.png")
    if layout == "not_images":
        (root / "train" / "notes").mkdir()
        (root / "train" / "notes" / "readme.txt").write_text("hello")
    root.mkdir(exist_ok=True)
    with pytest.raises(ValueError, match=message) as info:
        load(root, tmp_path / "cache", mode="stream")
    assert "\n" not in str(info.value)


def test_arrays_cannot_be_streamed(tmp_path):
    with pytest.raises(ValueError, match="--data-mode: dataset 'digits' is held in memory"):
        load_dataset("digits", tmp_path, mode="stream")


WORKER_SCRIPT = textwrap.dedent("""
    import signal, sys
    import torch
    from labrun.data import Split
    from labrun.loaders import Loader

    stops = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # the main decides
        signal.signal(sig, lambda signum, frame: stops.append(signum))
    split = Split(torch.zeros(4096, 3, 8, 8, dtype=torch.uint8), torch.zeros(4096).long())
    loader = Loader(split, 4, train=True, device="cpu", workers=2)
    while not stops:
        for step, _ in enumerate(loader):
            if step == 10:
                print("workers running", flush=True)
            if stops:
                break
    print("stopped cleanly by", stops, flush=True)
    sys.exit(75)
""")


def test_workers_survive_a_process_group_signal(tmp_path):
    """Slurm (TERM, `scancel --full` USR1), Ctrl-C (INT) and a closed terminal (HUP) signal every
    process of the group: the workers must leave the stop to the main process."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=os.path.dirname(os.path.dirname(data.__file__)),
    )
    try:
        assert proc.stdout.readline() == "workers running\n", proc.stderr.read()
        for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.killpg(proc.pid, sig)  # the whole group: main process and both workers
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert "stopped cleanly" in out and "killed by signal" not in err


def _sleep_as_a_worker(ready) -> None:
    loaders.worker_init(0)
    ready.set()
    time.sleep(60)


def test_a_worker_outlives_every_stop_signal_but_its_parents_term():
    """A closed terminal (HUP), `scancel --full` (USR1) and Ctrl-C (INT) reach the workers too:
    each must leave the stop to the main process (their default action would kill the worker,
    and the run would fail instead of checkpointing); the parent's own TERM still ends it."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    worker = fork.Process(target=_sleep_as_a_worker, args=(ready,))
    worker.start()
    try:
        assert ready.wait(30)
        for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGINT):
            os.kill(worker.pid, sig)
        time.sleep(0.5)
        assert worker.is_alive()
        os.kill(worker.pid, signal.SIGTERM)  # sent by its parent: the worker's end
        worker.join(30)
        assert worker.exitcode == 128 + signal.SIGTERM
    finally:
        if worker.is_alive():
            worker.kill()


def test_resize_of_arrays_keeps_uint8(tmp_path):
    loaded = load_dataset("digits", tmp_path, image_size=(16, 16))
    assert loaded.info.image_size == (16, 16)
    images = loaded.splits["train"].images
    assert images.shape[1:] == (3, 16, 16) and images.dtype == torch.uint8
    assert np.ptp(images.numpy()) > 200  # still the full intensity range, not blurred to grey


@pytest.mark.slow
def test_run_trains_on_a_folder_the_same_on_both_paths(
    main_in_process, mixed_folder, tmp_path, monkeypatch
):
    monkeypatch.setenv("LAB_TRACKING", "off")
    common = [
        "--dataset",
        "folder",
        "--data-path",
        str(mixed_folder),
        "--image-size",
        "12",
        "--epochs",
        "2",
        "--batch-size",
        "4",  # 22 training images: at least 4 steps per epoch (data.check_batch_size)
        "--workers",
        "0",
    ]
    finished = {}
    for mode in ("memory", "stream"):
        results = tmp_path / mode
        assert main_in_process(*common, "--data-mode", mode, "--results-dir", str(results)) == 0
        (run_dir,) = results.iterdir()
        assert run_dir.name.startswith(f"folder_data_path={mixed_folder.name}_image_size=12x12")
        config = json.loads((run_dir / "config.json").read_text())
        assert config["class_names"] == list(CLASSES) and config["image_size"] == [12, 12]
        assert config["data_path"] == str(mixed_folder.resolve())
        finished[mode] = read_metrics(run_dir)
        log = (run_dir / "run.log").read_text()
        assert (" decode: on the CPU (Pillow" in log) == (mode == "stream")
        assert re.search(r" loader: the loop waited [\d.]+ s of [\d.]+ s for batches \(\d+ %", log)
    for key in ("best_val_acc", "test_acc", "test_loss", "steps"):
        assert finished["memory"][key] == finished["stream"][key], key


@pytest.mark.slow
def test_streamed_run_stopped_by_a_group_sigterm_resumes_exactly(env, data_dir, tmp_path):
    """SIGTERM to the whole process group (as Slurm sends it) mid-epoch, with 2 workers."""
    folder = make_folder(tmp_path / "imgs", {"train": 40, "test": 4}, size=(12, 12))
    args = (
        "--dataset",
        "folder",
        "--data-path",
        str(folder),
        "--data-mode",
        "stream",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--patience",
        "0",
        "--deterministic",
    )
    env = {**env, "LAB_TRACKING": "off"}

    def start(results):  # its own process group, as a Slurm job step is
        return subprocess.Popen(
            cli_command(*args, results_dir=results, data_dir=data_dir),
            env=env,
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    straight = start(tmp_path / "straight")
    assert straight.wait(timeout=300) == 0, straight.communicate()
    expected = read_metrics(run_dir_of(tmp_path / "straight"))

    results = tmp_path / "stopped"
    cmd = start(results)
    deadline = time.monotonic() + DEADLINE
    while not any("steps/epoch" in p.read_text() for p in results.glob("*/run.log")):
        assert cmd.poll() is None and time.monotonic() < deadline, cmd.communicate()
        time.sleep(0.02)
    os.killpg(cmd.pid, signal.SIGTERM)
    _, err = cmd.communicate(timeout=DEADLINE)
    assert cmd.returncode == 75, err
    assert "killed by signal" not in err
    resumed = start(results)
    assert resumed.wait(timeout=300) == 0, resumed.communicate()
    got = read_metrics(run_dir_of(results))
    for key in ("best_val_acc", "test_acc", "test_loss", "steps"):
        assert got[key] == expected[key], key


def test_data_path_is_part_of_the_run_identity(tmp_path):
    """Two folders never share a run directory; one folder named two ways is one run."""
    first, second = tmp_path / "a" / "imgs", tmp_path / "b" / "imgs"
    first.mkdir(parents=True)
    second.mkdir(parents=True)

    def run_dir(data_path, cwd=ROOT):
        done = subprocess.run(
            [
                sys.executable,
                str(RUN_PY),
                "--dataset",
                "folder",
                "--data-path",
                str(data_path),
                "--data-dir",
                str(tmp_path / "cache"),
                "--print-run-dir",
            ],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert done.returncode == 0, done.stderr
        return Path(done.stdout.strip()).name

    assert run_dir(first) != run_dir(second)
    assert run_dir(first) == run_dir("imgs", cwd=tmp_path / "a")  # relative = absolute
    assert run_dir(first).startswith("folder_data_path=imgs-")
    missing = subprocess.run(
        [sys.executable, str(RUN_PY), "--dataset", "folder"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert missing.returncode == 2
    assert "--data-path" in missing.stderr.splitlines()[-1] and "Traceback" not in missing.stderr


def test_streaming_workers_follow_the_cores_this_process_may_use():
    cpus = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cpus)})  # as under `taskset -c 0` or a 1-core Slurm job
        assert loaders.default_workers(torch.device("cpu"), streaming=True) == 1
        assert loaders.default_workers(torch.device("cpu")) == 0  # in RAM: no workers on the CPU
    finally:
        os.sched_setaffinity(0, cpus)
    expected = max(1, len(cpus) - 1)  # one core left to the main process
    assert loaders.default_workers(torch.device("cpu"), streaming=True) == expected


def test_peek_reads_the_first_batch_in_this_process(mixed_folder, tmp_path, monkeypatch):
    """The compile probe's batch: the epoch's first, as iterating gives it, read without
    starting a worker (their prefetched batches were thrown away inside the first timed epoch,
    halving a short streamed run's rate)."""
    split = load(mixed_folder, tmp_path, image_size=(12, 12), mode="stream").splits["train"]
    loader = Loader(split, 4, train=True, device="cpu", workers=2)
    loader.set_epoch(1)
    torch.manual_seed(0)
    first = next(iter(loader))
    with monkeypatch.context() as patched:

        def no_workers(*args, **kwargs):
            raise AssertionError("a peek must start no worker")

        patched.setattr(torch.utils.data.DataLoader, "__iter__", no_workers)
        loader.set_epoch(1)
        torch.manual_seed(0)
        peeked = loader.peek()
    assert torch.equal(peeked[0], first[0]) and torch.equal(peeked[1], first[1])


def test_streaming_workers_use_every_core_the_job_may_use_but_one(monkeypatch):
    """Not a fixed 8: a 16-core box's job gets 15, a sweep slot its share (available_cpus)."""
    monkeypatch.setattr(loaders, "available_cpus", lambda: 16)
    assert loaders.default_workers(torch.device("cuda"), streaming=True) == 15
    monkeypatch.setattr(loaders, "available_cpus", lambda: 1)
    assert loaders.default_workers(torch.device("cpu"), streaming=True) == 1


def test_the_decode_note_names_the_path_and_its_workers(mixed_folder, tmp_path, monkeypatch):
    """run.log's `decode:` line (a streamed run): who decodes, and how many workers."""
    split = load(mixed_folder, tmp_path, image_size=(12, 12), mode="stream").splits["train"]
    monkeypatch.setattr(loaders, "available_cpus", lambda: 2)
    default = Loader(split, 4, train=True, device="cpu")
    assert default.decoder.startswith("on the CPU (Pillow")
    assert default.decoder.endswith("; 1 loader worker(s) of the 2 core(s) this job may use")
    assert default.how == "streamed, decoded on the CPU (Pillow), 1 worker(s)"
    given = Loader(split, 4, train=True, device="cpu", workers=2)
    assert given.decoder.endswith("; 2 loader worker(s) (--workers)")


def test_run_log_says_memory_disk_cache_or_stream_and_why(mixed_folder, tmp_path, monkeypatch):
    def source(**kwargs):
        loaded = load(mixed_folder, tmp_path, image_size=(12, 12), workers=0, **kwargs)
        return loaded.mode, loaded.info.describe()["images from"]

    mode, why = source()
    assert mode == "memory" and why.startswith("memory: decoded once at 12x12 into")
    assert "fits" in why and why.endswith("; decoded by this start")
    monkeypatch.setattr(data, "available_ram_bytes", lambda: 1000)  # less than the cache
    mode, why = source()
    assert mode == "memory" and why.startswith("disk cache: ") and "1000 bytes of RAM" in why
    assert why.endswith("; found, decoded by an earlier start")  # the next start's is free
    for cache in tmp_path.glob("decoded-*.npy"):  # damaged: not used, decoded again
        cache.write_bytes(cache.read_bytes()[:-1] + b"x")
    assert source()[1].endswith("; decoded by this start")
    mode, why = source(mode="stream")
    assert mode == "stream" and why.startswith("stream: ") and "--data-mode stream" in why
    monkeypatch.setattr(data, "_rlimit_headroom", lambda: 1000)
    mode, why = source()
    assert mode == "stream" and "--data-mode auto: its decoded cache" in why
    assert "does not fit the address-space limit (ulimit -v" in why
