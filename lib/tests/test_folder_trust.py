"""Image folders you can trust: the data's version in the run's identity, images decoded as
they are, a scan that neither guesses nor hangs, memory that fits, small data refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DEADLINE, ROOT, RUN_PY, cli_command, read_metrics
from image_folders import CLASSES, make_folder, make_image
from PIL import Image

from labrun import config, data, dataversion
from labrun.data import load_dataset
from labrun.imagefolder import decode_image


def load(folder, data_dir, **kwargs):
    return load_dataset("folder", data_dir, data_path=folder, **kwargs)


def folder_run_dir(folder: Path, data_dir: Path, *extra: str) -> Path:
    """run.py's run directory for a folder run, computed as --print-run-dir does (no torch)."""
    argv = ["--dataset", "folder", "--data-path", str(folder), "--data-dir", str(data_dir)]
    args, parser = config.parse_args([*argv, "--results-dir", "/r", *extra])
    return config.run_dir(args, parser)


def truncated_jpeg(path: Path, size=(64, 64)) -> None:
    """A JPEG cut short: its header reads (Image.open works), decoding it fails."""
    make_image(path, size, "RGB", seed=7, label=0)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])


# ---- 1. the version of a folder is part of the run ------------------------------------------


def test_a_grown_or_shrunk_folder_is_another_run_directory(tmp_path):
    folder = make_folder(tmp_path / "imgs", {"train": 3, "test": 1}, size=(8, 8))
    cache = tmp_path / "cache"
    first = folder_run_dir(folder, cache)
    assert folder_run_dir(folder, cache) == first  # unchanged: the same run
    make_image(folder / "train" / CLASSES[0] / "new.png", (8, 8), "RGB", 99, 0)
    grown = folder_run_dir(folder, cache)
    assert grown != first
    for name in ("new.png", "0.png"):
        (folder / "train" / CLASSES[0] / name).unlink()
    shrunk = folder_run_dir(folder, cache)
    assert shrunk not in (first, grown)
    # Hidden files are not data: they change nothing.
    (folder / "train" / ".DS_Store").write_bytes(b"\0")
    assert folder_run_dir(folder, cache) == shrunk
    # Array datasets keep their released names (test_train_units pins them).
    args, parser = config.parse_args(["--results-dir", "/r"])
    assert args.data_version is None and config.run_dir(args, parser).name == "digits-07ad383c"


def test_the_version_check_stats_directories_only_until_one_changes(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "imgs", {"train": 2}, size=(8, 8))
    cache = tmp_path / "cache"
    version = dataversion.data_version(folder, cache)
    walks = []
    real_walk = dataversion._walk
    monkeypatch.setattr(dataversion, "_walk", lambda root: walks.append(root) or real_walk(root))
    assert dataversion.data_version(folder, cache) == version
    assert walks == []  # cached: no file was listed or opened
    # A file rewritten in place keeps its directory's stamp: not seen (README says so) ...
    edited = folder / "train" / CLASSES[1] / "0.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(edited)
    os.utime(edited, ns=(1, 1))
    assert dataversion.data_version(folder, cache) == version and walks == []
    # ... until its folder is touched, as the README tells the user to do.
    os.utime(edited.parent)
    assert dataversion.data_version(folder, cache) != version and len(walks) == 1


@pytest.mark.slow
def test_interrupted_folder_run_then_more_images_starts_a_new_run(env, tmp_path):
    """The issue's case: today the re-run resumes on other splits and dies at the scheduler
    ("Tried to step 401 times") on every retry."""
    folder = make_folder(tmp_path / "imgs", {"train": 40, "test": 4}, size=(8, 8))
    data_dir, results = tmp_path / "data", tmp_path / "results"
    args = ("--dataset", "folder", "--data-path", str(folder), "--epochs", "3")
    args += ("--batch-size", "8", "--patience", "0", "--workers", "0")
    env = {**env, "LAB_TRACKING": "off"}
    run = subprocess.Popen(
        cli_command(*args, "--max-steps", "30", results_dir=results, data_dir=data_dir),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + DEADLINE
    while not any("steps/epoch" in p.read_text() for p in results.glob("*/run.log")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    run.terminate()
    assert run.wait(timeout=DEADLINE) == 75, run.communicate()
    (old,) = results.iterdir()
    before = {p.name: p.stat().st_mtime_ns for p in old.iterdir()}
    for i in range(30):  # the folder grows by a quarter
        make_image(
            folder / "train" / CLASSES[i % 3] / f"more{i}.png", (8, 8), "RGB", 500 + i, i % 3
        )
    again = subprocess.run(
        cli_command(*args, "--max-steps", "30", results_dir=results, data_dir=data_dir),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    new = next(p for p in results.iterdir() if p != old)
    assert read_metrics(new)["steps"] == 30
    assert {p.name: p.stat().st_mtime_ns for p in old.iterdir()} == before  # untouched
    versions = {json.loads((d / "config.json").read_text())["data_version"] for d in (old, new)}
    assert len(versions) == 2


@pytest.mark.slow
def test_array_data_changed_under_a_run_is_refused_at_resume(main_in_process, tmp_path, capsys):
    results, data_dir = tmp_path / "results", tmp_path / "data"
    args = ("--dataset", "synthetic", "--synthetic-size", "400", "--data-dir", str(data_dir))
    args += ("--results-dir", str(results), "--max-steps", "2", "--tracking", "off")
    assert main_in_process(*args, "--epochs", "1") == 0
    (run_dir,) = results.iterdir()
    (run_dir / "metrics.json").unlink()  # as if stopped before the end: it would resume
    cache = data_dir / "synthetic_400.npz"
    with np.load(cache) as f:
        arrays = dict(f)
    arrays["train_images"][0] ^= 1  # one pixel of other data
    with open(cache, "wb") as f:
        np.savez(f, **arrays)
    capsys.readouterr()
    assert main_in_process(*args, "--epochs", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --dataset synthetic: its data changed") and "--fresh" in err
    assert (run_dir / "status").read_text() == "refused\n"  # the planner: refused, not re-run
    assert "its data changed" in (run_dir / "run.log").read_text()
    assert main_in_process(*args, "--epochs", "1", "--fresh") == 0


# ---- 2. images decoded as they are ------------------------------------------------------------


def test_a_12_bit_image_in_16_bits_spans_the_full_range(tmp_path):
    ramp = np.tile(np.arange(4096, dtype=np.uint16), (8, 1))[:, ::8]  # 8 x 512, 0..4088
    folder = tmp_path / "micro"
    for split, label in (("train", "a"), ("train", "b"), ("test", "a"), ("test", "b")):
        (folder / split / label).mkdir(parents=True)
        Image.fromarray(ramp).save(folder / split / label / "0.png")
        Image.fromarray(ramp[:, ::-1].copy()).save(folder / split / label / "1.png")
    loaded = load(folder, tmp_path / "cache", mode="memory", workers=0, val_fraction=0)
    assert loaded.info.channels == 1
    pixels = loaded.splits["test"].images.numpy()
    assert pixels.min() == 0 and pixels.max() == 255
    assert (pixels == 255).mean() < 0.01  # today: 94 % clipped at 255
    assert len(np.unique(pixels)) > 200  # the ramp's levels survive


def test_float_images_are_scaled_by_their_range(tmp_path):
    path = tmp_path / "f.tif"
    Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), "F").save(path)
    pixels = decode_image(str(path), (8, 8), 1, {"float": (0.0, 1.0)})
    assert pixels.min() == 0 and pixels.max() == 255


def test_exif_orientation_is_applied(tmp_path):
    stored = np.zeros((16, 32, 3), np.uint8)  # 32 wide, 16 high: left half red, right blue
    stored[:, :16, 0] = stored[:, 16:, 2] = 255
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display", as phones write it
    path = tmp_path / "phone.jpg"
    image.save(path, exif=exif, quality=95)
    pixels = decode_image(str(path), (32, 16), 3).astype(int)  # (height, width) as shown
    assert pixels[:12, :, 0].mean() > 200 and pixels[:12, :, 2].mean() < 50  # red on top
    assert pixels[20:, :, 2].mean() > 200 and pixels[20:, :, 0].mean() < 50  # blue below


def test_transparent_pixels_show_the_stated_background(tmp_path):
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 1] = 255  # green hidden under alpha 0: garbage a plain convert("RGB") shows
    rgba[:4, :, 3] = 255  # the top half opaque green
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    pixels = decode_image(str(tmp_path / "a.png"), (8, 8), 3)
    assert (pixels[:4] == (0, 255, 0)).all()
    assert (pixels[4:] == (255, 255, 255)).all()  # white, as image viewers show it
    palette = Image.fromarray(rgba, "RGBA").convert("P")  # palette + transparency
    palette.save(tmp_path / "p.png", transparency=palette.getpixel((0, 7)))
    assert (decode_image(str(tmp_path / "p.png"), (8, 8), 3)[4:] == 255).all()


def test_the_aspect_ratio_is_kept_by_a_center_crop(tmp_path):
    wide = np.zeros((16, 32, 3), np.uint8)  # 32 x 16: red | green (16 px) | blue
    wide[:, :8, 0] = wide[:, 8:24, 1] = wide[:, 24:, 2] = 255
    Image.fromarray(wide).save(tmp_path / "wide.png")
    pixels = decode_image(str(tmp_path / "wide.png"), (8, 8), 3).astype(int)
    # The center only (the filter blends in a little of its neighbours at the crop's edges);
    # squashed, the outer columns would be red and blue.
    assert pixels[..., 1].min() >= 200 and pixels[..., [0, 2]].max() <= 40


def test_a_truncated_jpeg_is_found_by_the_scan_and_listed(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 34, "test": 1}, size=(8, 8))
    truncated_jpeg(folder / "train" / CLASSES[0] / "cut.jpg")
    loaded = load(folder, tmp_path / "cache", mode="stream")
    assert not any(p.endswith("cut.jpg") for s in loaded.splits.values() for p in s.paths)
    assert any("skipped 1 unreadable" in note for note in loaded.notes)
    listing = next((tmp_path / "cache").glob("unreadable-images-*.txt")).read_text()
    assert "cut.jpg" in listing and "truncated" in listing


# ---- 3. nothing hangs -------------------------------------------------------------------------

HANG_SCRIPT = textwrap.dedent("""
    import sys, torch
    from labrun.data import FileSplit
    from labrun.loaders import Loader

    paths = sys.argv[1:]
    split = FileSplit(paths, torch.zeros(len(paths)).long(), (3, 16, 16))
    loader = Loader(split, 2, train=True, device="cpu", workers=2)
    kept = []
    try:
        for _ in loader:
            pass
    except Exception as exc:  # as run.py does: one line, the exception kept past the loop
        kept.append(exc)
        print("error:", str(exc).splitlines()[0], flush=True)
    sys.exit(2)
""")


@pytest.mark.slow
def test_a_decode_error_in_a_worker_names_the_file_and_the_process_exits(tmp_path):
    paths = []
    for i in range(8):
        make_image(tmp_path / f"{i}.jpg", (16, 16), "RGB", i, 0)
        paths.append(str(tmp_path / f"{i}.jpg"))
    truncated_jpeg(tmp_path / "5.jpg")
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG_SCRIPT, *paths],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=DEADLINE)  # today: never exits (workers ignore TERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err
    assert out.startswith(f"error: cannot decode {tmp_path / '5.jpg'}"), out


@pytest.mark.slow
def test_a_file_cut_short_after_the_scan_ends_a_streamed_run_cleanly(env, tmp_path):
    """A streamed run with 2 workers meets a JPEG rewritten in place (not seen by the cheap
    version check): one `error:` line naming it, exit 2 within seconds, the lock free."""
    folder = make_folder(tmp_path / "imgs", {"train": 34, "test": 2}, extensions=(".jpg",))
    data_dir, results = tmp_path / "data", tmp_path / "results"
    args = ("--dataset", "folder", "--data-path", str(folder), "--data-mode", "stream")
    args += ("--workers", "2", "--epochs", "1", "--batch-size", "8", "--tracking", "off")
    env = {**env, "LAB_TRACKING": "off"}

    def run(*extra):
        started = time.monotonic()
        done = subprocess.run(
            cli_command(*args, *extra, results_dir=results, data_dir=data_dir),
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=DEADLINE,  # today: killed here, still holding .lock
        )
        return done, time.monotonic() - started

    first, _ = run()
    assert first.returncode == 0, first.stderr
    victim = folder / "train" / CLASSES[1] / "3.jpg"
    whole = victim.read_bytes()
    with open(victim, "r+b") as f:  # in place: the directory's mtime stays
        f.truncate(len(whole) // 2)
    broken, seconds = run("--seed", "1")
    assert broken.returncode == 2, broken.stderr
    assert seconds < 60
    (line,) = [ln for ln in broken.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: cannot decode {victim}")
    again, _ = run("--seed", "1")  # the lock is free, and the folder is fingerprinted again
    assert again.returncode == 0, again.stderr
    assert any("skipped 1 unreadable" in p.read_text() for p in results.glob("*/run.log"))


# ---- 4. the scan --------------------------------------------------------------------------------


def test_hidden_files_are_ignored_and_other_files_named(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 2, "test": 1}, size=(8, 8))
    (folder / "train" / ".ipynb_checkpoints").mkdir()
    make_image(folder / "train" / ".ipynb_checkpoints" / "x.png", (8, 8), "RGB", 1, 0)
    (folder / "train" / CLASSES[0] / "._0.png").write_bytes(b"\0\5\26\7 macOS metadata")
    (folder / "train" / ".DS_Store").write_bytes(b"\0")
    (folder / "train" / CLASSES[1] / "notes.txt").write_text("hello")
    loaded = load(folder, tmp_path / "cache", mode="stream")
    assert loaded.info.class_names == list(CLASSES)
    assert len(loaded.splits["train"]) + len(loaded.splits["val"]) == 6
    (note,) = loaded.notes  # nothing unreadable; the text file named, not dropped silently
    assert note.startswith("ignored 1 file(s) that are not images (.txt: 1)")


def test_tiff_webp_gif_and_bmp_are_read(tmp_path):
    extensions = (".png", ".tif", ".webp", ".gif", ".bmp")
    folder = make_folder(tmp_path / "f", {"train": 5, "test": 5}, extensions=extensions)
    loaded = load(folder, tmp_path / "cache", mode="memory", workers=0, val_fraction=0)
    assert len(loaded.splits["train"]) == len(loaded.splits["test"]) == 15
    assert not loaded.notes


def test_a_class_folder_linked_to_another_class_is_refused(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 2, "test": 1}, size=(8, 8))
    (folder / "train" / "zebra").symlink_to(folder / "train" / CLASSES[0])
    with pytest.raises(ValueError, match=f"the same image as one in train/{CLASSES[0]} ") as info:
        load(folder, tmp_path / "cache", mode="stream")
    assert "\n" not in str(info.value)
    (folder / "train" / "zebra").unlink()
    (folder / "test" / CLASSES[1] / "dup.png").symlink_to(folder / "train" / CLASSES[1] / "0.png")
    with pytest.raises(ValueError, match="same image as one in train/dog"):
        load(folder, tmp_path / "cache", mode="stream")


def test_the_unreadable_list_and_locks_never_follow_a_link(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 34, "test": 1}, size=(8, 8))
    (folder / "train" / CLASSES[1] / "broken.png").write_bytes(b"not a png")
    cache = tmp_path / "cache"
    load(folder, cache, mode="stream")
    (listing,) = cache.glob("unreadable-images-*.txt")
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA mine\n")
    listing.unlink()
    listing.symlink_to(victim)  # planted in a shared data folder
    make_image(folder / "train" / CLASSES[2] / "new.png", (8, 8), "RGB", 1, 2)  # a new version
    load(folder, cache, mode="stream")
    assert victim.read_text() == "ssh-ed25519 AAAA mine\n"
    assert not listing.is_symlink() and "broken.png" in listing.read_text()
    planted = cache / "synthetic_100.npz.lock"
    planted.symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(ValueError, match="--data-dir"):
        load_dataset("synthetic", cache, synthetic_size=100)
    assert not (tmp_path / "created-through-the-link").exists()


def test_notes_reach_run_log_and_split_sizes_config_json(main_in_process, tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 34, "test": 2}, size=(8, 8))
    (folder / "train" / CLASSES[0] / "empty.png").write_bytes(b"")  # zero bytes
    results = tmp_path / "results"
    args = ("--dataset", "folder", "--data-path", str(folder), "--results-dir", str(results))
    assert main_in_process(*args, "--max-steps", "1", "--batch-size", "8", "--tracking", "off") == 0
    (run_dir,) = results.iterdir()
    log = (run_dir / "run.log").read_text()
    assert "skipped 1 unreadable image(s) of 109" in log
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["split_sizes"] == {"train": 92, "val": 10, "test": 6}
    assert cfg["data_version"].startswith("files:")
    assert "'train': 92" in log


def test_an_unwritable_data_dir_names_the_flag(main_in_process, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = ("--dataset", "synthetic", "--synthetic-size", "100", "--data-dir", str(blocker / "d"))
    assert main_in_process(*args, "--results-dir", str(tmp_path / "r")) == 2
    assert capsys.readouterr().err.startswith("error: --data-dir: cannot write to")


def test_an_image_size_that_cannot_fit_is_refused_before_allocating(data_dir, monkeypatch):
    monkeypatch.setenv("LAB_JOBS_PER_NODE", str(10**9))  # a budget of a few bytes
    with pytest.raises(ValueError, match=r"--image-size: \d+ images of digits/train at 64x64"):
        load_dataset("digits", data_dir, image_size=(64, 64))


# ---- 5. memory ----------------------------------------------------------------------------------


def test_the_memory_budget_counts_the_jobs_cgroup_and_slurm(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_JOBS_PER_NODE", raising=False)
    for name in ("SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU"):
        monkeypatch.delenv(name, raising=False)
    alone = data.available_ram_bytes()
    monkeypatch.setenv("LAB_JOBS_PER_NODE", "4")  # run.sh's slots on this node
    assert data.available_ram_bytes() <= alone // 4 * 1.05
    monkeypatch.setenv("LAB_JOBS_PER_NODE", "1")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "64")  # --mem=64M
    assert data.available_ram_bytes() <= 64 << 20
    with open("/proc/self/cgroup") as f:
        own = next(line[3:].strip() for line in f if line.startswith("0::"))
    group = Path(str(tmp_path) + own)
    group.mkdir(parents=True, exist_ok=True)
    (group / "memory.max").write_text(f"{3 << 30}\n")
    (group / "memory.current").write_text(f"{1 << 30}\n")
    assert data._cgroup_headroom(str(tmp_path)) == 2 << 30


RSS_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    from labrun.data import decoded_bytes, load_dataset
    from labrun.loaders import Loader

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    folder, cache = sys.argv[1:]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loaded = load_dataset("folder", cache, data_path=folder, mode="memory", workers=0)
    for name, split in loaded.splits.items():  # small batches: their temporaries stay small
        for _ in Loader(split, 4, train=name == "train", device="cpu", workers=0):
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": peak - base, "decoded": decoded_bytes(loaded.splits.values())}))
""")


@pytest.mark.slow
def test_a_folder_in_memory_takes_one_copy(tmp_path):
    """Peak RSS per byte of decoded images, loading and iterating a folder in memory, <= 1.2:
    measured as the growth between a folder and one 25 times larger (the interpreter's fixed
    costs cancel). It fails on the old loader: an unpadded copy beside a padded one, and the
    carved copies of the cache."""
    runs = {}
    for name, per_class in (("small", 8), ("large", 200)):
        folder = make_folder(tmp_path / name, {"train": per_class}, size=(192, 192))
        for what in ("first decode", "from the cache"):
            done = subprocess.run(
                [sys.executable, "-c", RSS_SCRIPT, str(folder), str(tmp_path / "cache")],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr
            runs[name, what] = json.loads(done.stdout)
    for what in ("first decode", "from the cache"):
        large, small = runs["large", what], runs["small", what]
        per_byte = (large["growth"] - small["growth"]) / (large["decoded"] - small["decoded"])
        assert per_byte <= 1.2, (what, per_byte, runs)


# ---- 6. small data ------------------------------------------------------------------------------


def test_a_batch_too_large_for_the_training_split_is_refused_with_one_that_works(
    main_in_process, tmp_path, capsys
):
    results = tmp_path / "results"
    args = ("--dataset", "synthetic", "--synthetic-size", "200", "--batch-size", "128")
    assert main_in_process(*args, "--results-dir", str(results)) == 2  # 180 images: 1 step
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: --batch-size: 128 x --grad-accum 1 is more than 1/4")
    assert err.endswith("use --batch-size 45 or less")
    assert not results.exists() or not any(results.iterdir())


def test_print_run_dir_of_a_folder_imports_no_torch(tmp_path):
    folder = make_folder(tmp_path / "f", {"train": 1}, size=(8, 8))
    code = (
        "import sys, runpy; sys.argv = ['run.py', '--dataset', 'folder', '--data-path', "
        f"{str(folder)!r}, '--data-dir', {str(tmp_path / 'c')!r}, '--print-run-dir'];"
        "\ntry:\n    runpy.run_path(" + repr(str(RUN_PY)) + ", run_name='__main__')\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(ROOT / "results" / "trials" / "folder_"))
