"""The decoded cache: decode once, never read half done, one decode for jobs that start
together (the data layer's imports, in one direction: test_imports.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEADLINE, ROOT
from image_folders import make_folder
from PIL import Image

from labrun import imagecache
from labrun.data import load_dataset
from labrun.imagefolder import UnreadableImage, decode_image
from labrun.loaders import FileSplit


def file_split(folder) -> FileSplit:
    paths = sorted(str(p) for p in folder.rglob("*.png"))
    return FileSplit(paths, torch.zeros(len(paths), dtype=torch.long), (3, 16, 16))


DECODE = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    import torch
    from labrun import imagecache
    from labrun.loaders import FileSplit

    folder, data_dir, processes, kill_after, ready, go, how = sys.argv[1:]
    stops = []
    signal.signal(signal.SIGTERM, lambda *_: stops.append("TERM"))  # as run.py's GracefulStop
    imagecache.CHUNK_IMAGES = 4
    paths = sorted(str(p) for p in __import__("pathlib").Path(folder).rglob("*.png"))
    split = FileSplit(paths, torch.zeros(len(paths), dtype=torch.long), (3, 16, 16))
    calls = []

    def progress(done, chunks):
        calls.append(done)
        if done == int(kill_after) and how == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a node failure would
        if done == int(kill_after) and how == "TERM":
            # As Slurm or Ctrl-C: every process of the group, from another process.
            subprocess.run(["kill", "-s", "TERM", "--", f"-{os.getpgid(0)}"])  # it gets one too
        time.sleep(0.02)  # a slower decode: the other job must find it in progress

    if ready != "-":  # start together with another job: both wait for the test's "go"
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
    out = imagecache.decode_cached(split, data_dir, version="v1", processes=int(processes),
                                   progress=progress)
    print(json.dumps({"calls": calls, "sum": int(out.images.sum()), "n": len(out), "stops": stops}))
""")


def decode(folder, data_dir, processes=1, kill_after=0, ready="-", go="-", wait=True, how="-"):
    command = [
        sys.executable,
        "-c",
        DECODE,
        str(folder),
        str(data_dir),
        str(processes),
        str(kill_after),
        str(ready),
        str(go),
        how,
    ]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: a group signal reaches it alone
    )
    if not wait:
        return proc
    try:
        out, err = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return "timeout", out.decode(), err.decode()
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow
def test_a_killed_decode_starts_over_and_is_never_read_half_done(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 10}, size=(20, 20))  # 30 images, 8 chunks
    data_dir = tmp_path / "cache"
    code, _, err = decode(folder, data_dir, processes=2, kill_after=3, how="KILL")
    assert code == -signal.SIGKILL, err
    assert len(list(data_dir.glob("decoded-*.partial.npy"))) == 1  # half done
    assert not list(data_dir.glob("decoded-*[0-9a-f].npy"))  # never the finished name

    code, out, err = decode(folder, data_dir, processes=1)
    assert code == 0, err
    again = json.loads(out)
    assert again["calls"] == list(range(1, 9))  # every chunk: the killed decode is not read
    assert [p.name.split(".", 1)[1] for p in data_dir.glob("decoded-*")] == ["npy"]

    code, out, err = decode(folder, tmp_path / "fresh", processes=2)  # never interrupted
    assert code == 0, err
    fresh = json.loads(out)
    assert (again["sum"], again["n"]) == (fresh["sum"], fresh["n"]) and fresh["sum"] > 0


@pytest.mark.slow
def test_a_group_sigterm_during_the_decode_is_left_to_the_main_process(tmp_path):
    """Slurm's TERM reaches every process of the job: the decoding processes leave it to the
    main process (run.py stops gracefully after the decode). Before, a decoding process died of
    it, its chunk was lost and the pool waited for it forever."""
    folder = make_folder(tmp_path / "f", {"train": 10}, size=(20, 20))  # 8 chunks
    code, out, err = decode(folder, tmp_path / "cache", processes=2, kill_after=2, how="TERM")
    assert code == 0, (code, err)
    done = json.loads(out)
    assert done["stops"] == ["TERM"] and done["calls"][-1] == 8 and done["n"] == 30


@pytest.mark.slow
def test_two_jobs_starting_together_decode_once(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 10}, size=(20, 20))
    data_dir, go = tmp_path / "cache", tmp_path / "go"
    ready = [tmp_path / "ready0", tmp_path / "ready1"]
    procs = [decode(folder, data_dir, 2, ready=r, go=go, wait=False) for r in ready]
    deadline = time.monotonic() + DEADLINE
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    assert sorted(len(r["calls"]) for r in results) == [0, 8]  # one decoded, one waited
    assert results[0]["sum"] == results[1]["sum"] > 0
    assert [p.name.split(".", 1)[1] for p in data_dir.glob("decoded-*")] == ["npy"]


def test_auto_decodes_a_folder_larger_than_the_ram_budget_into_the_cache(tmp_path, monkeypatch):
    """The cache is memory-mapped: RAM is no limit (the page cache keeps what fits). Before,
    auto streamed (decoded every epoch) any folder over 1/4 of the available memory."""
    folder = make_folder(tmp_path / "f", {"train": 4, "test": 1}, size=(16, 16))
    monkeypatch.setenv("LAB_JOBS_PER_NODE", str(10**9))  # a RAM budget of a few bytes
    loaded = load_dataset("folder", tmp_path / "cache", data_path=folder, mode="auto", workers=0)
    assert loaded.mode == "memory"
    assert len(list((tmp_path / "cache").glob("decoded-*.npy"))) == 2  # train and test
    stream = load_dataset("folder", tmp_path / "cache", data_path=folder, mode="stream")
    assert len(stream.splits["train"]) == len(loaded.splits["train"])


def test_the_cache_is_read_not_decoded_again(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 3}, size=(16, 16))
    split = file_split(folder)
    calls = []
    first = imagecache.decode_cached(split, tmp_path, version="v", progress=lambda *a: None)

    def count(done, chunks):
        calls.append(done)

    again = imagecache.decode_cached(split, tmp_path, version="v", progress=count)
    assert calls == [] and torch.equal(first.images, again.images)
    other = imagecache.decode_cached(split, tmp_path, version="v2", progress=count)
    assert calls == [1] and torch.equal(first.images, other.images)  # another version: decoded
    assert os.path.exists(imagecache.cache_path(split, tmp_path, "v2"))


@pytest.mark.parametrize("processes", [1, 2])
def test_a_file_that_no_longer_decodes_leaves_no_partial_cache(tmp_path, processes):
    """It ends the run (error: cannot decode FILE, from a decoding process too); the next start
    sees a new version of the folder, so a half-decoded file under the old key would only take
    disk space."""
    folder = make_folder(tmp_path / "f", {"train": 3}, size=(16, 16))
    split = file_split(folder)
    Path(split.paths[4]).write_bytes(b"not a png any more")
    with pytest.raises(UnreadableImage, match=f"cannot decode {split.paths[4]}: "):
        imagecache.decode_cached(split, tmp_path / "cache", version="v", processes=processes)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_every_source_size_decodes_to_the_target_size(tmp_path):
    """The crop box of a resize that covers the target must stay inside the image: computed in
    floats it overshot by a rounding error for e.g. a 98x98 JPEG resized to 64x64 (PIL: "box
    offset can't be negative"), and such images failed to decode (bench_data.py's folder)."""
    path = tmp_path / "x.jpg"
    for width in range(90, 111):
        for height in range(90, 111):
            Image.new("RGB", (width, height), (120, 30, 200)).save(path, quality=90)
            pixels = decode_image(str(path), (64, 64), 3)
            assert pixels.shape == (64, 64, 3), (width, height)


def test_an_upright_rgb_jpeg_is_decoded_without_a_copy_that_changes_nothing(tmp_path, monkeypatch):
    """exif_transpose copies even an upright image and convert("RGB") an RGB one (5.6 vs 3.7 ms
    per 500x375 image on one core): neither runs; the pixels are Pillow's resize within 2."""
    from PIL import ImageOps

    pixels = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    source = Image.fromarray(pixels).resize((120, 90), Image.Resampling.BICUBIC)
    source.save(tmp_path / "x.jpg", quality=95)
    with Image.open(tmp_path / "x.jpg") as image:  # what Pillow alone makes of it
        expected = np.asarray(
            image.resize((64, 48), Image.Resampling.BILINEAR, box=(0, 0, 120, 90)), dtype=int
        )

    def must_not_run(*args, **kwargs):
        raise AssertionError("a copy that changes nothing")

    monkeypatch.setattr(ImageOps, "exif_transpose", must_not_run)
    monkeypatch.setattr(Image.Image, "convert", must_not_run)
    decoded = decode_image(str(tmp_path / "x.jpg"), (48, 64), 3)
    assert decoded.shape == (48, 64, 3) and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - expected).max() <= 2
