"""Data you can trust (issue 29): no planted or damaged cache, non-finite target, hard-linked leak
or made-up metric behind a reported number."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import mlflow_run, read_metrics, run_dir_of
from image_folders import make_folder

from labrun import imagecache
from labrun.data import load_dataset
from labrun.loaders import FileSplit


def cache_names(folder: Path, scratch: Path) -> dict[int, str]:
    """{images: decoded-<key>} of the folder's caches, computed as anyone who can read the
    folder can: by decoding it into a folder of their own (the key ignores --data-dir)."""
    load_dataset("folder", scratch, data_path=folder, mode="memory", workers=0)
    return {
        len(np.load(p, mmap_mode="r")): p.stem
        for p in scratch.glob("decoded-*.npy")
        if not p.name.endswith(".partial.npy")
    }


def test_planted_links_in_the_data_dir_are_never_written_through_nor_trained_on(
    main_in_process, tmp_path
):
    """The two-step attack of issue 29: plant links at the cache's names, then a job runs."""
    folder = make_folder(tmp_path / "f", {"train": 20, "test": 6}, size=(16, 16))
    names = cache_names(folder, tmp_path / "attacker")
    train, test = names[60], names[18]
    data_dir = tmp_path / "shared-data"
    data_dir.mkdir()
    victim1, victim2 = tmp_path / "victim1.txt", tmp_path / "victim2.txt"
    victim1.write_text("a colleague's notes\n")
    victim2.write_text("another file of theirs\n")
    zeros = tmp_path / "zeros.npy"
    np.save(zeros, np.zeros((18, 16, 16, 3), np.uint8))
    (data_dir / f"{train}.partial.npy").symlink_to(victim1)
    (data_dir / f"{train}.npy").symlink_to(victim2)
    (data_dir / f"{test}.npy").symlink_to(zeros)

    results = tmp_path / "results"
    args = ["--dataset", "folder", "--data-path", str(folder), "--data-dir", str(data_dir)]
    run = ("--epochs", "4", "--batch-size", "8", "--workers", "0", "--results-dir", str(results))
    code = main_in_process(*args, *run)
    assert code == 0
    assert victim1.read_text() == "a colleague's notes\n"
    assert victim2.read_text() == "another file of theirs\n"
    assert np.load(zeros).sum() == 0
    for name in (f"{test}.npy", f"{train}.npy"):
        assert not (data_dir / name).is_symlink() and (data_dir / name).stat().st_uid == os.getuid()
    assert np.load(data_dir / f"{test}.npy").sum() != 0  # the real pixels, decoded again
    log = (run_dir_of(results) / "run.log").read_text()
    assert f"{test}.npy is a symbolic link" in log and f"{train}.npy is a symbolic link" in log
    assert read_metrics(run_dir_of(results))["test_acc"] > 0.8  # the zeros gave 0.44


def test_a_cache_file_of_another_user_is_not_used(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    folder = make_folder(tmp_path / "f", {"train": 3}, size=(16, 16))
    split = split_of(folder)
    first = imagecache.decode_cached(split, tmp_path, version="v", processes=1).images.clone()
    cache = imagecache.cache_path(split, tmp_path, "v")
    os.chown(cache, 65534, 65534)
    notes: list[str] = []
    again = imagecache.decode_cached(split, tmp_path, version="v", processes=1, notes=notes)
    assert notes == [f"decoded cache {cache} is another user's, hard-linked or not a plain file: "
                     "not used, decoded again"]  # fmt: skip
    assert torch.equal(first, again.images) and cache.stat().st_uid == os.geteuid()


def test_a_hard_linked_cache_is_not_used(tmp_path):
    """A hard link at the cache's name could be someone's file (nlink > 1): decoded again."""
    split = split_of(make_folder(tmp_path / "f", {"train": 3}, size=(16, 16)))
    imagecache.decode_cached(split, tmp_path, version="v", processes=1)
    cache = imagecache.cache_path(split, tmp_path, "v")
    os.link(cache, tmp_path / "theirs.npy")
    notes: list[str] = []
    imagecache.decode_cached(split, tmp_path, version="v", processes=1, notes=notes)
    assert notes == [f"decoded cache {cache} is another user's, hard-linked or not a plain file: "
                     "not used, decoded again"]  # fmt: skip
    assert cache.stat().st_nlink == 1


def split_of(folder: Path) -> FileSplit:
    paths = sorted(str(p) for p in folder.rglob("*.png"))
    return FileSplit(paths, torch.zeros(len(paths), dtype=torch.long), (3, 16, 16))


@pytest.mark.parametrize("damage", ["zeros", "random"])
def test_a_damaged_cache_is_found_by_its_checksums_and_decoded_again(tmp_path, damage):
    folder = make_folder(tmp_path / "f", {"train": 120}, size=(16, 16))  # 360 images: 2 chunks
    split = split_of(folder)
    first = imagecache.decode_cached(split, tmp_path, version="v", processes=1).images.clone()
    cache = imagecache.cache_path(split, tmp_path, "v")
    pixels = np.load(cache, mmap_mode="r+")
    rng = np.random.default_rng(0)
    pixels[300:] = 0 if damage == "zeros" else rng.integers(0, 256, pixels[300:].shape)
    pixels.flush()
    del pixels
    notes: list[str] = []
    again = imagecache.decode_cached(split, tmp_path, version="v", processes=1, notes=notes)
    assert notes == [f"decoded cache {cache} does not match its checksums: damaged: not used, "
                     "decoded again"]  # fmt: skip
    assert torch.equal(first, again.images)
    assert imagecache.decode_cached(split, tmp_path, version="v", notes=notes)  # no new note
    assert len(notes) == 1


def test_a_file_size_limit_too_small_for_the_cache_is_one_line(tmp_path):
    import resource
    import subprocess
    import sys

    folder = make_folder(tmp_path / "f", {"train": 8, "test": 2}, size=(32, 32))
    code = (
        "import resource, sys\n"
        "from labrun.data import load_dataset\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))\n"
        f"d = load_dataset('folder', {str(tmp_path / 'c')!r}, data_path={str(folder)!r}, "
        "mode=sys.argv[1], workers=0)\n"
    )
    for mode in ("auto", "memory"):
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        assert run.returncode == 1
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("ValueError: --data-dir: cannot write the decoded cache")
        assert "File too large; free space (or raise ulimit -f)" in last
        assert not list((tmp_path / "c").glob("decoded-*"))  # no partial file left
    assert resource.getrlimit(resource.RLIMIT_FSIZE)  # this process: untouched


def test_small_sizes_are_never_0_0_gib():
    from labrun.runs import size_text

    assert size_text(3 * 2**20) == "3.0 MiB" and size_text(20000) == "19.5 KiB"
    assert size_text(2.5 * 2**30) == "2.5 GiB" and size_text(1000) == "1000 bytes"


def killed_by_the_oom_killer(*args):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_decoder_killed_by_the_oom_killer_is_not_bad_input(tmp_path, monkeypatch):
    from labrun import gpudecode

    folder = make_folder(tmp_path / "f", {"train": 4}, size=(16, 16))
    monkeypatch.setattr(gpudecode, "decode_image", killed_by_the_oom_killer)  # in the workers
    monkeypatch.setattr(imagecache, "CHUNK_IMAGES", 4)
    with pytest.raises(RuntimeError, match="DataLoader worker .* (killed|exited)") as raised:
        imagecache.decode_cached(split_of(folder), tmp_path, version="v", processes=2)
    assert not isinstance(raised.value, ValueError)  # run.py: exit 1, not 2 (bad input)


@pytest.mark.parametrize(
    ("task", "damage", "message"),
    [
        ("regression", "nan", "synthetic/test: target row 7 holds nan (1 row(s)"),
        ("regression", "inf", "synthetic/test: target row 7 holds inf (1 row(s)"),
        ("multilabel", "none", "dataset 'synthetic': the test split has no positive label"),
    ],
)
def test_targets_no_metric_can_trust_are_refused_when_the_data_loads(
    main_in_process, tmp_path, monkeypatch, capsys, task, damage, message
):
    from labrun import arrays

    original = arrays.load_synthetic_arrays

    def damaged(*a, **k):
        train, (x_test, y_test) = original(*a, **k)
        y_test = y_test.copy()
        if damage == "none":
            y_test[:] = 0
        else:
            y_test[7, 1] = float(damage)
        return train, (x_test, y_test)

    monkeypatch.setattr(arrays, "load_synthetic_arrays", damaged)
    args = ("--dataset", "synthetic", "--synthetic-size", "200", "--task", task)
    assert main_in_process(*args, "--results-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


@pytest.mark.parametrize(("scale", "noise"), [(12, 3), (40, 8), (3, 1.5), (1, 2), (0.01, 0.02)])
def test_multilabel_map_is_sklearns_for_confident_moderate_and_noisy_models(scale, noise):
    """4000 x 20 labels, 5% of them against the model: mAP within 1e-3 of sklearn's on the
    logits. Binned on sigmoid scores in [0, 1] a confident model read 0.72 for an AP of 0.87."""
    from sklearn.metrics import average_precision_score

    from labrun.tasks import multilabel_metrics, multilabel_sums

    rng = np.random.default_rng(0)
    truth = rng.random((4000, 20)) < 0.3
    flipped = truth ^ (rng.random(truth.shape) < 0.05)
    logits = (2 * flipped - 1) * scale + rng.normal(0, noise, truth.shape)
    exact = np.mean([average_precision_score(truth[:, k], logits[:, k]) for k in range(20)])
    logits, y = torch.tensor(logits, dtype=torch.float32), torch.tensor(truth, dtype=torch.float32)
    sums = sum(multilabel_sums(logits[i : i + 512], y[i : i + 512]) for i in range(0, 4000, 512))
    assert multilabel_metrics(sums.numpy(), 4000)["map"] == pytest.approx(exact, abs=1e-3)


@pytest.mark.parametrize("where", ["dog/x.png", "../test/cat/x.png"])
@pytest.mark.parametrize("link", [os.link, os.symlink])
def test_one_file_in_two_classes_or_splits_is_refused_whether_hard_or_symbolic_link(
    tmp_path, where, link
):
    from labrun.imagefolder import scan_image_folder

    folder = make_folder(tmp_path / "f", {"train": 3, "test": 2}, size=(8, 8))
    original = folder / "train" / "cat" / "0.png"
    copy = (folder / "train" / where).resolve()
    link(original, copy)
    with pytest.raises(ValueError, match=r"--data-path: .* is the same (file|image) as"):
        scan_image_folder(folder, None, tmp_path / "cache", "v")


def damage_in_place(path: Path) -> None:
    """Garbage in the middle of the file, its size and modification time kept: the folder's
    cheap fingerprint (names, sizes, mtimes, directory stamps) cannot see it."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(b"\xff" * 16)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_file_damaged_in_place_is_skipped_and_listed_at_the_next_run(
    main_in_process, tmp_path, capsys
):
    """Issue 29: the re-run promised by the refusal refused again, run after run."""
    folder = make_folder(tmp_path / "f", {"train": 34, "test": 4}, size=(8, 8))  # 102 + 12
    data_dir, results = tmp_path / "data", tmp_path / "results"
    args = ("--dataset", "folder", "--data-path", str(folder), "--data-dir", str(data_dir))
    args += ("--workers", "0", "--batch-size", "8", "--epochs", "1", "--results-dir", str(results))
    assert main_in_process(*args) == 0  # the images checked and cached
    damage_in_place(folder / "train" / "dog" / "5.png")
    capsys.readouterr()
    assert main_in_process(*args, "--image-size", "12") == 2  # decoded again: found now
    err = capsys.readouterr().err
    assert "cannot decode" in err and "dog/5.png" in err
    for _ in range(2):  # the next runs: skipped and listed, trained
        assert main_in_process(*args, "--image-size", "12") == 0
    (listing,) = data_dir.glob("unreadable-images-*.txt")
    assert listing.read_text().startswith(str(folder / "train" / "dog" / "5.png"))
    logs = [p / "run.log" for p in results.iterdir() if "image_size" in p.name]
    assert "skipped 1 unreadable image(s) of 114" in logs[0].read_text()


def test_history_keeps_a_column_added_by_a_resumed_run(tmp_path):
    from labrun import runs
    from labrun.analysis import read_history

    before = {"epoch": 1, "step": 4, "train_loss": 0.5, "val_loss": 0.6}  # from the checkpoint
    after = {"epoch": 2, "step": 8, "train_loss": 0.4, "grad_norm": 1.5, "val_loss": 0.5}
    runs.write_history(tmp_path, [before, after])
    header = (tmp_path / "history.csv").read_text().splitlines()[0]
    assert header == "epoch,step,train_loss,val_loss,grad_norm"
    columns = read_history((tmp_path / "history.csv").read_text())
    assert np.isnan(columns["grad_norm"][0]) and columns["grad_norm"][1] == 1.5


def test_json_files_never_hold_nan_or_infinity(tmp_path):
    from labrun import runs

    runs.write_json(tmp_path / "m.json", {"test_r2": float("nan"), "best": [float("inf"), 1.0]})
    text = (tmp_path / "m.json").read_text()

    def refuse(constant):
        raise ValueError(constant)

    assert json.loads(text, parse_constant=refuse) == {"test_r2": None, "best": [None, 1.0]}


def test_a_flag_added_with_a_default_never_moves_a_run_without_a_second_edit(monkeypatch):
    """The first release's run names stay; a new flag (only added to the parser) joins the
    hash only when set to something else than its default."""
    from labrun import config

    released = {
        (): "digits-07ad383c",
        ("--lr", "0.01", "--seed", "1"): "digits_lr=0.01_seed=1-4c5ba385",
        ("--dataset", "synthetic", "--ema", "0.9"): "synthetic_ema=0.9-f23144b4",
    }
    build = config.build_parser

    def with_a_new_flag():
        parser = build()
        parser.add_argument("--mixup", type=float, default=0.0, help="a flag added later")
        return parser

    monkeypatch.setattr(config, "build_parser", with_a_new_flag)
    for argv, name in released.items():
        args, parser = config.parse_args([*argv, "--results-dir", "/r"])
        assert config.run_dir(args, parser).name == name, argv
    args, parser = config.parse_args(["--mixup", "0.2", "--results-dir", "/r"])
    assert config.run_dir(args, parser).name.startswith("digits_mixup=0.2-")
    assert config.short_hash(config.identity_args(args)) != "07ad383c"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--data-path", "."), "--data-path: --dataset digits reads no files of yours"),
        (("--task", "regression", "--label-smoothing", "0.1"), "--label-smoothing: --task regr"),
    ],
)
def test_flags_the_run_would_ignore_are_refused(argv, message, capsys):
    from labrun import config

    with pytest.raises(SystemExit) as exited:
        config.parse_args(list(argv))
    assert exited.value.code == 2 and capsys.readouterr().err.startswith(f"error: {message}")


def test_an_image_size_the_model_cannot_take_is_refused_before_decoding(
    main_in_process, tmp_path, capsys
):
    folder = make_folder(tmp_path / "f", {"train": 4}, size=(16, 16))
    args = ("--dataset", "folder", "--data-path", str(folder), "--data-dir", str(tmp_path / "d"))
    assert main_in_process(*args, "--image-size", "4", "--results-dir", str(tmp_path / "r")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model cnn: ") and err.strip().endswith("got 4x4")
    assert len(err.strip().splitlines()) == 1
    assert not list((tmp_path / "d").glob("decoded-*"))


def test_classification_with_one_class_is_refused(main_in_process, tmp_path, capsys):
    folder = tmp_path / "f"
    make_folder(folder, {"train": 6}, size=(16, 16))
    for name in ("dog", "eel"):
        for path in (folder / "train" / name).iterdir():
            path.unlink()
        (folder / "train" / name).rmdir()
    args = ("--dataset", "folder", "--data-path", str(folder), "--data-dir", str(tmp_path / "d"))
    assert main_in_process(*args, "--batch-size", "1", "--results-dir", str(tmp_path / "r")) == 2
    assert "--task classification needs at least 2 classes" in capsys.readouterr().err


def test_the_code_version_follows_the_code_not_the_commits_nor_the_readme(tmp_path):
    import subprocess

    from labrun.runs import code_version

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "model.py").write_text("WIDTH = 8\n")
    (tmp_path / "README.md").write_text("# lab\n")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "x", "--allow-empty")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    clean = code_version(tmp_path)
    assert clean["git_diff"] == "none" and len(clean["git_commit"]) == 40
    (tmp_path / "README.md").write_text("# lab, described\n")
    assert code_version(tmp_path)["project"] == clean["project"]  # a README edit: same code
    (tmp_path / "model.py").write_text("WIDTH = 16\n")
    edited = code_version(tmp_path)
    assert edited["project"] != clean["project"] and edited["git_diff"] not in ("none", "unknown")
    (tmp_path / "losses.py").write_text("# new, not yet added\n")
    assert code_version(tmp_path)["project"] != edited["project"]  # untracked code counts
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "second")
    committed = code_version(tmp_path)
    assert committed["project"] == code_version(tmp_path)["project"] != clean["project"]
    assert committed["git_diff"] == "none" and committed["git_commit"] != clean["git_commit"]


def test_a_skip_or_a_resume_under_other_code_says_so(
    main_in_process, tmp_path, monkeypatch, capsys, mlflow_uri
):
    from labrun import runs

    args = ("--epochs", "1", "--results-dir", str(tmp_path), "--tracking", "on")
    assert main_in_process(*args) == 0
    run_dir = run_dir_of(tmp_path)
    recorded = json.loads((run_dir / "config.json").read_text())["code"]
    assert set(recorded) == {"git_commit", "git_diff", "project", "labrun_version", "labrun"}
    tags = mlflow_run(mlflow_uri, read_metrics(run_dir)["mlflow_run_id"]).data.tags
    assert tags["code_project"] == recorded["project"] and tags["labrun_source"]
    capsys.readouterr()
    assert main_in_process(*args) == 0  # skipped, same code: one line
    assert capsys.readouterr().out.strip().splitlines() == [
        f"already finished: {run_dir} (metrics.json exists; --fresh starts over)"
    ]
    real = runs.code_version
    monkeypatch.setattr(runs, "code_version", lambda root: {**real(root), "project": "0ther"})
    assert main_in_process(*args) == 0
    note = capsys.readouterr().out.strip().splitlines()[1]
    assert note == (
        f"note: {run_dir} was made by other code (commit {recorded['git_commit'][:12]}, "
        f"project {recorded['project']} -> 0ther): its numbers are that code's; --fresh "
        "retrains it with this code"
    )
    (run_dir / "metrics.json").unlink()  # as if interrupted after its last checkpoint
    assert main_in_process(*args) == 0
    assert "resuming under other code: " in (run_dir / "run.log").read_text()
