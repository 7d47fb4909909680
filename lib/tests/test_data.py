"""Built-in datasets (digits offline, synthetic cache, CIFAR-10 download path) and the loaders."""

import hashlib
import io
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from conftest import ROOT

from labrun import arrays, augment
from labrun.augment import random_crop_flip
from labrun.data import FileSplit, Split, load_dataset
from labrun.loaders import Loader

NUM_CLASSES = 10  # of every built-in dataset


def check_splits(splits, sizes):
    assert set(splits) == {"train", "val", "test"}
    for name, split in splits.items():
        assert split.images.dtype == torch.uint8
        assert split.images.shape == (sizes[name], 3, 32, 32)
        assert split.labels.dtype == torch.int64
        assert split.labels.shape == (sizes[name],)
        assert split.labels.min() >= 0 and split.labels.max() < NUM_CLASSES


def test_digits_loads_offline_with_fixed_splits(tmp_path):
    loaded = load_dataset("digits", tmp_path)
    splits = loaded.splits
    described = loaded.info.as_config()
    # The arrays' content hash: config.json records it, a resume on other data is refused.
    assert described.pop("data_content") == load_dataset("digits", tmp_path).info.content
    assert described == {
        "num_classes": 10,
        "channels": 3,
        "image_size": [32, 32],
        "class_names": [str(d) for d in range(10)],
        "split_sizes": {"train": 1293, "val": 144, "test": 360},
        "input_shape": [3, 32, 32],
        "input": {  # what the data layer does with them, also in run.log
            "data": "uint8 images (N, 3, 32, 32)",
            "normalization": "per channel, fixed constants of uint8 images (CIFAR-10's)",
            "augmentation": "crop + flip (random, padding 4; auto: uint8 images)",
        },
    }
    # 1797 images: stratified 80/20 -> 1437 train pool / 360 test; 10 % of the pool is val.
    check_splits(splits, {"train": 1293, "val": 144, "test": 360})
    again = load_dataset("digits", tmp_path).splits
    assert torch.equal(splits["val"].labels, again["val"].labels)
    other_seed = load_dataset("digits", tmp_path, seed=1).splits
    assert not torch.equal(splits["val"].images, other_seed["val"].images)
    assert torch.equal(splits["test"].images, other_seed["test"].images)
    # Decoded once into the data dir (no lock file left); a file where the data dir should be
    # (or a read-only one) decodes in memory instead, to the same arrays.
    assert [p.name for p in tmp_path.iterdir()] == [arrays.DIGITS_CACHE]
    uncached = load_dataset("digits", tmp_path / "digits_32px.npz" / "not_a_dir").splits
    for name, split in splits.items():
        assert torch.equal(split.images, uncached[name].images)
        assert torch.equal(split.labels, uncached[name].labels)


def test_a_job_with_digits_cached_does_not_import_sklearn(tmp_path):
    """Importing scikit-learn was a third of a job's start-up (the lab template's
    benchmarks/RESULTS.md, "Start-up")."""
    load_dataset("digits", tmp_path)
    code = (
        "import sys\n"
        "from labrun.data import load_dataset\n"
        f"load_dataset('digits', {str(tmp_path)!r})\n"
        "print('sklearn' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def test_unknown_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_dataset("mnist", tmp_path)


def test_synthetic_is_deterministic_and_cached(tmp_path, monkeypatch):
    first = load_dataset("synthetic", tmp_path, synthetic_size=500).splits
    check_splits(first, {"train": 450, "val": 50, "test": 100})
    assert (tmp_path / "synthetic_500.npz").exists()

    def must_not_generate(*args):
        raise AssertionError("the second load must read the cache")

    monkeypatch.setattr(arrays, "_generate_synthetic", must_not_generate)
    second = load_dataset("synthetic", tmp_path, synthetic_size=500).splits
    for name in first:
        assert torch.equal(first[name].images, second[name].images)
        assert torch.equal(first[name].labels, second[name].labels)
    monkeypatch.undo()
    fresh_dir = load_dataset("synthetic", tmp_path / "elsewhere", synthetic_size=500).splits
    assert torch.equal(first["train"].images, fresh_dir["train"].images)


def fake_cifar_tarball(path, n_per_batch=20, n_test=10, corrupt_shape=False):
    """A tiny tarball in the official layout: pickled dicts in cifar-10-batches-py/."""
    rng = np.random.default_rng(0)

    def batch(n):
        pixels = 3 * 32 * 32 - (1 if corrupt_shape else 0)
        return {
            b"data": rng.integers(0, 256, (n, pixels), dtype=np.uint8),
            b"labels": rng.integers(0, 10, n).tolist(),
        }

    with tarfile.open(path, "w:gz") as tar:
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        for name in names:
            payload = pickle.dumps(batch(n_test if name == "test_batch" else n_per_batch))
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return hashlib.md5(path.read_bytes()).hexdigest()


def point_cifar_at(monkeypatch, tarball, md5):
    monkeypatch.setattr(arrays, "CIFAR10_URL", tarball.as_uri())
    monkeypatch.setattr(arrays, "CIFAR10_MD5", md5)


def test_cifar10_download_verifies_and_caches(tmp_path, monkeypatch):
    served = tmp_path / "served.tar.gz"
    point_cifar_at(monkeypatch, served, fake_cifar_tarball(served))
    data_dir = tmp_path / "data"
    loaded = load_dataset("cifar10", data_dir)
    splits = loaded.splits
    assert loaded.info.class_names[0] == "airplane"
    check_splits(splits, {"train": 90, "val": 10, "test": 10})
    assert (data_dir / arrays.CIFAR10_CACHE).exists()
    assert not list(data_dir.glob("*.part"))

    served.unlink()  # a second load must need neither the network nor the tarball
    (data_dir / arrays.CIFAR10_TARBALL).unlink()
    again = load_dataset("cifar10", data_dir).splits
    assert torch.equal(splits["train"].images, again["train"].images)


def test_cifar10_checksum_mismatch_leaves_nothing(tmp_path, monkeypatch):
    served = tmp_path / "served.tar.gz"
    fake_cifar_tarball(served)
    point_cifar_at(monkeypatch, served, "0" * 32)
    data_dir = tmp_path / "data"
    with pytest.raises(ValueError, match="corrupt or partial"):
        load_dataset("cifar10", data_dir)
    assert list(data_dir.iterdir()) == []  # not even the lock file


def test_cifar10_unreadable_tarball_is_deleted(tmp_path, monkeypatch):
    served = tmp_path / "served.tar.gz"
    served.write_bytes(b"this is not a tarball")
    point_cifar_at(monkeypatch, served, hashlib.md5(served.read_bytes()).hexdigest())
    data_dir = tmp_path / "data"
    with pytest.raises(ValueError, match="could not be read as CIFAR-10"):
        load_dataset("cifar10", data_dir)
    assert not (data_dir / arrays.CIFAR10_CACHE).exists()
    assert not (data_dir / arrays.CIFAR10_TARBALL).exists()


def test_cifar10_bad_sizes_never_cached(tmp_path, monkeypatch):
    served = tmp_path / "served.tar.gz"
    point_cifar_at(monkeypatch, served, fake_cifar_tarball(served, corrupt_shape=True))
    with pytest.raises(ValueError, match="CIFAR-10"):
        load_dataset("cifar10", tmp_path / "data")
    assert not (tmp_path / "data" / arrays.CIFAR10_CACHE).exists()


def test_cifar10_unreachable_url_is_a_clear_error(tmp_path, monkeypatch):
    point_cifar_at(monkeypatch, tmp_path / "missing.tar.gz", "0" * 32)
    with pytest.raises(ValueError, match="could not download"):
        load_dataset("cifar10", tmp_path / "data")
    assert not list((tmp_path / "data").glob("*.part"))


@pytest.fixture(scope="module")
def small_split():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (100, 3, 32, 32), dtype=torch.uint8, generator=gen)
    return Split(images, torch.arange(100) % NUM_CLASSES)


@pytest.mark.parametrize("gpu_resident", [False, True])
def test_loader_batches(small_split, gpu_resident):
    loader = Loader(small_split, 32, train=True, device="cpu", gpu_resident=gpu_resident)
    assert len(loader) == 3  # 100 // 32, the ragged batch dropped
    batches = list(loader)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == (32, 3, 32, 32) and x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert y.dtype == torch.int64 and y.shape == (32,)
    seen = torch.cat([y for _, y in batches])
    assert len(set(seen.tolist())) == NUM_CLASSES  # labels travel with their images

    evaluation = Loader(small_split, 32, train=False, device="cpu", gpu_resident=gpu_resident)
    assert len(evaluation) == 4  # every sample scored
    x, _ = next(iter(evaluation))
    expected = (small_split.images[:32].float() - torch.tensor(augment.MEAN).view(1, 3, 1, 1)) / (
        torch.tensor(augment.STD).view(1, 3, 1, 1)
    )
    torch.testing.assert_close(x, expected)  # no augmentation, in order, normalised


@pytest.mark.parametrize("gpu_resident", [False, True])
def test_shuffle_is_a_function_of_seed_and_epoch(small_split, gpu_resident):
    def epoch_labels(seed, epoch, skip=0):
        loader = Loader(
            small_split, 10, train=True, device="cpu", seed=seed, gpu_resident=gpu_resident
        )
        loader.set_epoch(epoch, skip_batches=skip)
        return [y for _, y in loader]

    assert all(map(torch.equal, epoch_labels(0, 3), epoch_labels(0, 3)))
    assert not torch.equal(torch.cat(epoch_labels(0, 3)), torch.cat(epoch_labels(0, 4)))
    assert not torch.equal(torch.cat(epoch_labels(0, 3)), torch.cat(epoch_labels(1, 3)))
    full, resumed = epoch_labels(0, 3), epoch_labels(0, 3, skip=4)
    assert len(resumed) == len(full) - 4
    assert all(map(torch.equal, full[4:], resumed))


@pytest.mark.parametrize("train", [True, False])
def test_a_resident_loader_gives_the_batches_of_a_copying_one(small_split, train):
    """The GPU-resident path (whole split on the device, a gather per batch) is the copying
    loader's batches exactly: order, augmentation, a torchrun shard, peek and a resumed epoch."""

    def batches(gpu_resident: bool, skip: int = 0):
        torch.manual_seed(7)  # the augmentation's draws
        loader = Loader(
            small_split, 12, train=train, device="cpu", seed=3, shard=(1, 3),
            gpu_resident=gpu_resident,
        )  # fmt: skip
        loader.set_epoch(2, skip_batches=skip)
        return [loader.peek(), *loader]

    for skip in (0, 2):
        copied, resident = batches(False, skip), batches(True, skip)
        assert len(copied) == len(resident) > 2
        for (x, y), (rx, ry) in zip(copied, resident, strict=True):
            assert x.shape[0] == 4 or not train  # rank 1's third of a batch of 12 (eval: the
            # last batch of 4 gives it 1)
            torch.testing.assert_close(rx, x, rtol=0, atol=0)
            assert torch.equal(ry, y)


def test_resume_with_restored_rng_is_exact(small_split):
    loader = Loader(small_split, 10, train=True, device="cpu")
    loader.set_epoch(2)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    rng_state = torch.get_rng_state()  # what a checkpoint after batch 4 would hold
    rest = [x for x, _ in batches]

    torch.set_rng_state(rng_state)
    loader.set_epoch(2, skip_batches=4)
    resumed = [x for x, _ in loader]
    assert all(map(torch.equal, rest, resumed))


def test_next_iteration_without_set_epoch_moves_on(small_split):
    loader = Loader(small_split, 10, train=True, device="cpu")
    first = torch.cat([y for _, y in loader])
    second = torch.cat([y for _, y in loader])
    assert not torch.equal(first, second)
    assert loader.epoch == 1


def test_random_crop_flip():
    images = torch.randint(0, 256, (64, 32, 32, 3), dtype=torch.uint8)
    out = random_crop_flip(torch.nn.functional.pad(images, (0, 0, 4, 4, 4, 4)), (4, 4))
    assert out.shape == images.shape and out.dtype == torch.uint8
    flipped = 0
    for original, augmented in zip(images, out, strict=True):
        # Every output is a shifted (and maybe mirrored) window of the zero-padded input.
        padded = torch.nn.functional.pad(original, (0, 0, 4, 4, 4, 4))
        windows = [padded[dy : dy + 32, dx : dx + 32] for dy in range(9) for dx in range(9)]
        assert any(torch.equal(augmented, w) or torch.equal(augmented, w.flip(1)) for w in windows)
        flipped += not any(torch.equal(augmented, w) for w in windows)
    assert 10 < flipped < 54  # about half


def test_the_cpu_and_device_crops_cut_the_same_pixels():
    """The CPU cuts one slice per image, other devices gather in one call: same pixels, so a
    run's numbers do not depend on which one ran (and the CPU path's speed-up changed none)."""
    padded = torch.randint(0, 256, (40, 24, 30, 3), dtype=torch.uint8)
    dy, dx, flip = (
        torch.randint(0, 9, (40,)),
        torch.randint(0, 9, (40,)),
        torch.randint(0, 2, (40,)),
    )
    sliced = augment.crop_flip_slices(padded, dy, dx, flip, (16, 22))
    gathered = augment.crop_flip_gather(padded, dy, dx, flip, (16, 22))
    assert torch.equal(sliced, gathered) and 0 < int(flip.sum()) < 40


def test_dataloader_workers(small_split):
    loader = Loader(small_split, 25, train=True, device="cpu", workers=1)
    assert sum(len(y) for _, y in loader) == 100


def test_the_loader_counts_the_loops_wait_for_batches_not_its_steps(small_split, monkeypatch):
    """run.log's `loader:` line: the time spent inside the loader's __next__ over the time the
    epochs took, on a fake clock: each batch takes 1 s to gather, each step 3 s."""
    from labrun import loaders

    now = [0.0]
    monkeypatch.setattr(loaders.time, "perf_counter", lambda: now[0])
    gather = loaders._ArrayDataset.__getitem__

    def slow_gather(self, index):
        now[0] += 1.0
        return gather(self, index)

    monkeypatch.setattr(loaders._ArrayDataset, "__getitem__", slow_gather)
    loader = Loader(small_split, 10, train=True, device="cpu", workers=0)
    for _ in loader:  # 10 batches
        now[0] += 3.0  # the step
    batches = iter(loader)
    next(batches)
    now[0] += 3.0
    batches.close()  # a run that ends within an epoch (--max-steps): its time counts till then
    assert loader.waited_s == 11.0 and loader.spanned_s == 44.0
    line = "loader: the loop waited 11.0 s of 44.0 s for batches (25 %; in memory, 0 worker(s))"
    assert loader.wait_line() == line


def test_gpu_resident_auto_takes_at_most_a_quarter_of_the_free_gpu_memory(small_split, monkeypatch):
    """--gpu-resident: auto keeps the splits on the GPU when they take at most a quarter of its
    free memory (torch.cuda.mem_get_info's, patched here: 1 GiB free of 80 GiB), so that the model
    has the rest; on without asking; never off CUDA."""
    from labrun.hardware import choose_gpu_resident

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    cuda = torch.device("cuda")

    def cifar_sized(n):  # n labels of 32x32 RGB images, without holding them
        return {"train": FileSplit([], torch.zeros(1, dtype=torch.long).expand(n), (3, 32, 32))}

    assert choose_gpu_resident("auto", cuda, {"train": small_split})
    assert choose_gpu_resident("auto", cuda, cifar_sized(80_000))  # 246 MB <= 256 MiB
    assert not choose_gpu_resident("auto", cuda, cifar_sized(90_000))  # 277 MB
    assert choose_gpu_resident("on", cuda, cifar_sized(90_000))
    assert not choose_gpu_resident("off", cuda, {"train": small_split})
    assert not choose_gpu_resident("on", torch.device("cpu"), {"train": small_split})


def test_random_resized_crop_cuts_a_part_and_resizes_it_back():
    """scale 1 and ratio 1 of a square image: the whole image, flipped half the time; a small
    scale: a part of a left-to-right ramp, stretched (fewer distinct columns' values)."""
    torch.manual_seed(0)
    ramp = torch.arange(16, dtype=torch.uint8).mul(16).view(1, 1, 16, 1).expand(64, 16, 16, 3)
    whole = augment.random_resized_crop(ramp, (1.0, 1.0), (1.0, 1.0))
    plain = ((whole - ramp.float()).abs() < 1e-3).flatten(1).all(1)
    mirrored = ((whole - ramp.flip(2).float()).abs() < 1e-3).flatten(1).all(1)
    assert bool((plain ^ mirrored).all()) and 10 < int(plain.sum()) < 54
    part = augment.random_resized_crop(ramp, (0.1, 0.1), (1.0, 1.0))
    assert part.shape == (64, 16, 16, 3) and part.dtype == torch.float32
    spans = part[:, 0, :, 0].amax(1) - part[:, 0, :, 0].amin(1)
    assert bool((spans < 0.5 * 240).all())  # ~a third of the ramp's width in each
    torch.manual_seed(1)
    again = augment.random_resized_crop(ramp, (0.1, 0.1), (1.0, 1.0))
    torch.manual_seed(1)
    assert torch.equal(again, augment.random_resized_crop(ramp, (0.1, 0.1), (1.0, 1.0)))


def test_crop_resized_is_an_option_for_images_only_and_says_so():
    from labrun.config import CROP_RATIO, CROP_SCALE

    chosen = augment.choose_augmentation(
        (3, 64, 64), "NCHW", torch.uint8, crop="resized", crop_scale=CROP_SCALE,
        crop_ratio=CROP_RATIO,
    )  # fmt: skip
    assert chosen.resized == (CROP_SCALE, CROP_RATIO) and chosen.flip
    assert chosen.why.startswith("random resized crop (area 0.08-1 of the image")
    assert "--crop resized" in chosen.why
    assert augment.choose_augmentation((3, 64, 64), "NCHW", torch.uint8).resized is None
    with pytest.raises(ValueError, match="--crop resized: crops images"):
        augment.choose_augmentation(
            (1, 40), "NCL", torch.float32, "on", crop="resized", crop_scale=CROP_SCALE,
            crop_ratio=CROP_RATIO,
        )  # fmt: skip


@pytest.mark.parametrize(
    "flag", [("--crop-scale", "0.5"), ("--crop-scale", "0,1"), ("--crop-ratio", "4/3,3/4")]
)
def test_bad_crop_ranges_are_one_error_line(flag):
    from labrun.config import parse_args

    with pytest.raises(SystemExit) as stopped:
        parse_args([*flag])
    assert stopped.value.code == 2
    assert parse_args(["--crop-ratio", "3/4,4/3"])[0].crop_ratio == (0.75, 4 / 3)
