"""Datasets and loaders.

Images are held as uint8 (4x less memory and host->device transfer than float32). Conversion to
float, normalisation and the train augmentation (random crop with 1/8-of-the-side padding +
horizontal flip) run on the training device, in whole batches, drawing from that device's torch
RNG, so the RNG state saved in a checkpoint makes a resumed epoch exact.

    data = load_dataset("digits", "data")               # .splits {"train","val","test"}, .info
    loader = build_loader(data.splits["train"], 128, train=True, device=device)
    for epoch in range(epochs):
        loader.set_epoch(epoch)                         # shuffle order = f(seed, epoch)
        for x, y in loader: ...                         # float32, channels_last, on device

Datasets come from the registry in datasets.py. Two data paths, chosen by `load_dataset(mode=)`:
- memory: the decoded uint8 split in RAM (`Split`), read by a DataLoader over the array or, when
  it fits, kept whole on the device (`DeviceResidentLoader`, the fastest: nothing crosses the bus);
- stream: image files decoded batch by batch in DataLoader worker processes (`FileSplit`), for
  folders that do not fit in RAM. Image folders that fit are decoded once and cached as a uint8
  .npy in --data-dir, so the jobs of a sweep decode them once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import signal
import tarfile
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .datasets import DATASETS, DataOptions, DatasetSplits, ImageFiles
from .imagefolder import decode_image
from .runs import atomic_path

# Module constants so tests can point them at a local tarball.
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_TARBALL = "cifar-10-python.tar.gz"
CIFAR10_CACHE = "cifar10.npz"
CIFAR10_SHAPE = (3, 32, 32)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

TEST_FRACTION = 0.2  # of train, for datasets that come without a test split
TEST_SPLIT_SEED = 0  # fixed: the test set must not change with the run's seed
SYNTHETIC_SEED = 1234  # fixed: every job of a sweep trains on the same synthetic data
SYNTHETIC_CLASSES = 10
DATA_MODES = ("auto", "memory", "stream")
# auto keeps a dataset in RAM when its decoded uint8 images take at most this fraction of the
# available memory (the rest is for the model, the workers and everyone else on the node).
MEMORY_FRACTION = 0.25

# CIFAR-10 channel statistics, used for every 3-channel dataset (their mean for 1 channel):
# BatchNorm right after the first conv absorbs any remaining offset, and one constant keeps
# train, val and test scaled alike.
MEAN = (0.4914 * 255, 0.4822 * 255, 0.4465 * 255)
STD = (0.2470 * 255, 0.2435 * 255, 0.2616 * 255)


def channel_stats(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if channels == 3:
        return MEAN, STD
    return (sum(MEAN) / 3,) * channels, (sum(STD) / 3,) * channels


def crop_padding(height: int, width: int) -> int:
    """Padding of the random-crop augmentation: 4 px at 32x32, 1/8 of the shorter side."""
    return max(1, min(height, width) // 8)


@dataclass
class Split:
    """One split in memory: uint8 images (N, C, H, W) and int64 labels (N,), on the CPU."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])


@dataclass
class FileSplit:
    """One split streamed from disk: image paths, int64 labels, and the decoded shape."""

    paths: Sequence[str]
    labels: torch.Tensor
    image_shape: tuple[int, int, int]  # (C, H, W) after conversion and resizing

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class DatasetInfo:
    """What the model and config.json need to know about a dataset."""

    name: str
    num_classes: int
    channels: int
    image_size: tuple[int, int]
    class_names: list[str]

    def as_config(self) -> dict:
        return {
            "num_classes": self.num_classes,
            "channels": self.channels,
            "image_size": list(self.image_size),
            "class_names": list(self.class_names),
        }


@dataclass
class LoadedDataset:
    splits: dict[str, Split | FileSplit]
    info: DatasetInfo
    mode: str  # "memory" or "stream"
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Datasets


def load_dataset(
    name: str,
    data_dir: str | os.PathLike,
    *,
    data_path: str | os.PathLike | None = None,
    image_size: tuple[int, int] | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    synthetic_size: int = 10_000,
    mode: str = "auto",
    workers: int | None = None,
) -> LoadedDataset:
    """Load the registered dataset `name` as {"train", "val", "test"} splits and describe it.

    A missing test split is carved out of train with a fixed seed; a missing val split with
    `seed` (pass the same value to every run you compare, so all validate on the same images).
    `mode`: "memory", "stream" (only for datasets of files) or "auto" (memory when the decoded
    images take at most MEMORY_FRACTION of the available RAM). Raises ValueError with a one-line
    message for every bad input.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if mode not in DATA_MODES:
        raise ValueError(f"--data-mode: choose one of {', '.join(DATA_MODES)}, got {mode!r}")
    entry = DATASETS[name]
    if entry.needs_data_path and data_path is None:
        raise ValueError(f"--data-path: dataset {name!r} needs --data-path")
    if data_path is not None and not Path(data_path).exists():
        raise ValueError(f"--data-path: {data_path} does not exist")
    data_dir = Path(data_dir)
    options = DataOptions(
        data_dir=data_dir,
        data_path=Path(data_path) if data_path else None,
        image_size=image_size,
        synthetic_size=synthetic_size,
    )
    raw = entry.load(options)
    if not isinstance(raw, DatasetSplits) or raw.train is None:
        raise ValueError(f"dataset {name!r}: its function must return DatasetSplits(train=...)")
    splits = {
        s: _as_split(getattr(raw, s), raw, image_size, f"{name}/{s}")
        for s in ("train", "val", "test")
        if getattr(raw, s) is not None
    }
    shapes = {split.image_shape for split in splits.values()}
    if len(shapes) > 1:
        raise ValueError(f"dataset {name!r}: splits differ in image shape {sorted(shapes)}")
    ((channels, height, width),) = shapes
    if len(splits["train"]) == 0:
        raise ValueError(f"dataset {name!r}: the training split is empty")
    labels = torch.cat([split.labels for split in splits.values()])
    num_classes = len(raw.class_names) if raw.class_names else int(labels.max()) + 1
    class_names = (
        [str(c) for c in raw.class_names]
        if raw.class_names
        else [str(i) for i in range(num_classes)]
    )
    for where, split in splits.items():
        _check_labels(split, f"{name}/{where}", num_classes)
    missing_in_train = set(labels.unique().tolist()) - set(splits["train"].labels.unique().tolist())
    if missing_in_train:
        raise ValueError(
            f"dataset {name!r}: class(es) {sorted(missing_in_train)} appear in "
            "val/test but not in train"
        )
    streamable = any(isinstance(s, FileSplit) for s in splits.values())
    if not streamable and mode == "stream":
        raise ValueError(
            f"--data-mode: dataset {name!r} is held in memory as arrays; "
            "streaming needs a dataset of image files (e.g. folder)"
        )
    if streamable and mode == "auto":
        mode = "memory" if fits_in_ram(splits.values()) else "stream"
    if not streamable:
        mode = "memory"
    elif mode == "memory":  # decoded before carving: the cache never depends on --seed
        splits = {
            k: decode_cached(s, data_dir, workers) if isinstance(s, FileSplit) else s
            for k, s in splits.items()
        }
    if "test" not in splits:  # a fixed carve: the test set never depends on --seed
        splits["train"], splits["test"] = _carve(splits["train"], TEST_FRACTION, TEST_SPLIT_SEED)
    if "val" not in splits:
        splits["train"], splits["val"] = _carve(splits["train"], val_fraction, seed)
    if len(splits["train"]) == 0 or len(splits["test"]) == 0:
        raise ValueError(f"dataset {name!r}: too few images to split into train and test")
    info = DatasetInfo(name, num_classes, channels, (height, width), class_names)
    return LoadedDataset(splits, info, mode, list(raw.notes))


def _as_split(raw, described: DatasetSplits, image_size, where: str) -> Split | FileSplit:
    """A dataset function's split (arrays or ImageFiles) as a Split or FileSplit, checked."""
    if isinstance(raw, ImageFiles):
        if described.channels is None or described.image_size is None:
            raise ValueError(f"{where}: ImageFiles need DatasetSplits(channels=, image_size=)")
        labels = torch.as_tensor(np.asarray(raw.labels, dtype=np.int64))
        if len(labels) != len(raw.paths):
            raise ValueError(f"{where}: {len(raw.paths)} files but {len(labels)} labels")
        size = tuple(image_size or described.image_size)
        return FileSplit(list(raw.paths), labels, (described.channels, *size))
    try:
        images, labels = raw
    except (TypeError, ValueError):
        raise ValueError(f"{where}: a split must be (images, labels) or ImageFiles") from None
    images = torch.as_tensor(np.asarray(images))
    labels = torch.as_tensor(np.asarray(labels)).long()
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(
            f"{where}: expected uint8 images of shape (N, C, H, W), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if labels.shape != (len(images),):
        raise ValueError(f"{where}: expected {len(images)} labels, got {tuple(labels.shape)}")
    if image_size is not None and tuple(images.shape[2:]) != tuple(image_size):
        images = _resize(images, image_size)
    return Split(images.contiguous(), labels)


def _resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(len(images), images.shape[1], *size, dtype=torch.uint8)
    for start in range(0, len(images), 1024):  # in chunks: float temporaries stay small
        chunk = images[start : start + 1024].float()
        resized = F.interpolate(chunk, size=size, mode="bilinear", antialias=True)
        out[start : start + 1024] = resized.round().clamp_(0, 255).to(torch.uint8)
    return out


def _check_labels(split: Split | FileSplit, where: str, num_classes: int) -> None:
    if len(split) and (split.labels.min() < 0 or split.labels.max() >= num_classes):
        raise ValueError(f"{where}: labels outside 0..{num_classes - 1}")


def _carve(split: Split | FileSplit, fraction: float, seed: int):
    """Split off `fraction` of `split` (a pure function of `seed`) -> (rest, carved)."""
    n_out = round(len(split) * fraction)
    order = torch.from_numpy(np.random.default_rng([seed, 0xDA7A]).permutation(len(split)))
    # Sorted indices keep each part in the original order: cheaper gathers, stable files.
    out_idx, keep_idx = order[:n_out].sort().values, order[n_out:].sort().values
    return _subset(split, keep_idx), _subset(split, out_idx)


def _subset(split: Split | FileSplit, index: torch.Tensor) -> Split | FileSplit:
    if isinstance(split, FileSplit):
        return FileSplit(
            [split.paths[i] for i in index.tolist()], split.labels[index], split.image_shape
        )
    return Split(split.images[index], split.labels[index])


def available_ram_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, capped by RLIMIT_AS if one is set."""
    available = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    try:
        import resource

        limit, _ = resource.getrlimit(resource.RLIMIT_AS)
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            headroom = max(limit - used, 0)
            available = headroom if available is None else min(available, headroom)
    except (ImportError, OSError, ValueError):
        pass
    return available


def decoded_bytes(splits) -> int:
    """uint8 bytes of the splits once decoded, labels included."""
    total = 0
    for split in splits:
        c, h, w = split.image_shape
        total += len(split) * (c * h * w + 8)
    return total


def fits_in_ram(splits, max_fraction: float = MEMORY_FRACTION) -> bool:
    available = available_ram_bytes()
    return available is not None and decoded_bytes(splits) <= max_fraction * available


DIGITS_CACHE = "digits_32px.npz"  # the decoded arrays below; rename it when they change
DIGITS_CLASSES = [str(d) for d in range(10)]


def load_digits_arrays(data_dir: Path | None = None) -> DatasetSplits:
    """scikit-learn's 1797 handwritten digits (ships with the package: works offline).

    Decoded once into `data_dir`/DIGITS_CACHE: later jobs read 5.5 MB of arrays instead of
    importing scikit-learn, which took a job's start-up from 5.7 to 3.8 s (the lab template's
    benchmarks/RESULTS.md, "Start-up"). Without a writable `data_dir` every call decodes.
    """
    if data_dir is not None:
        cache = Path(data_dir) / DIGITS_CACHE
        try:
            with _lock(cache):
                if not cache.exists():
                    _save_npz(cache, **_decode_digits())
        except OSError:  # a read-only or full data dir: decode in memory, as without one
            pass
        else:
            train, test = _read_npz(cache)
            return DatasetSplits(train=train, test=test, class_names=DIGITS_CLASSES)
    arrays = _decode_digits()
    return DatasetSplits(
        train=(arrays["train_images"], arrays["train_labels"]),
        test=(arrays["test_images"], arrays["test_labels"]),
        class_names=DIGITS_CLASSES,
    )


def _decode_digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    # 8x8 intensities 0..16 -> 32x32 uint8, grey repeated to 3 channels to look like CIFAR.
    small = torch.from_numpy(digits.images).float().unsqueeze(1) * (255 / 16)
    big = F.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)
    images = big.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = digits.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)),
        test_size=TEST_FRACTION,
        stratify=digits.target,
        random_state=TEST_SPLIT_SEED,
    )
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    return {
        "train_images": images.numpy()[train_idx],
        "train_labels": labels[train_idx],
        "test_images": images.numpy()[test_idx],
        "test_labels": labels[test_idx],
    }


def load_synthetic_arrays(data_dir: Path, size: int) -> DatasetSplits:
    """Learnable CIFAR-shaped data: one smooth random pattern per class, shifted, plus noise.

    `size` training images and size // 5 test images (CIFAR's 5:1), generated from a fixed seed
    and cached, so every job of a benchmark or sweep reads identical bytes.
    """
    if size < SYNTHETIC_CLASSES:
        raise ValueError(f"--synthetic-size must be >= {SYNTHETIC_CLASSES}, got {size}")
    cache = Path(data_dir) / f"synthetic_{size}.npz"
    with _lock(cache):
        if not cache.exists():
            _save_npz(cache, **_generate_synthetic(size, size // 5))
    train, test = _read_npz(cache)
    return DatasetSplits(train=train, test=test)


def _generate_synthetic(n_train: int, n_test: int) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    shape = CIFAR10_SHAPE
    # Low-frequency prototypes (8x8 noise upsampled): classes differ in colour and layout.
    prototypes = F.interpolate(
        torch.rand(SYNTHETIC_CLASSES, 3, 8, 8, generator=gen), size=shape[1:], mode="bicubic"
    )
    arrays = {}
    for split, n in (("train", n_train), ("test", max(n_test, 1))):
        labels = torch.randint(SYNTHETIC_CLASSES, (n,), generator=gen)
        images = torch.empty(n, *shape, dtype=torch.uint8)
        for start in range(0, n, 4096):  # in chunks: float temporaries stay small
            y = labels[start : start + 4096]
            # Each image: its class prototype circularly shifted by up to 4 px, plus noise.
            dy, dx = torch.randint(-4, 5, (2, len(y), 1), generator=gen)
            rows = (torch.arange(32) + dy) % 32
            cols = (torch.arange(32) + dx) % 32
            x = prototypes[y.view(-1, 1, 1), :, rows.unsqueeze(2), cols.unsqueeze(1)]
            x = x.permute(0, 3, 1, 2) + 0.35 * torch.randn(len(y), *shape, generator=gen)
            images[start : start + 4096] = (x * 255).round().clamp(0, 255).to(torch.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images.numpy(), labels.numpy()
    return arrays


def load_cifar10_arrays(data_dir: Path) -> DatasetSplits:
    """CIFAR-10 from the official tarball: downloaded once, md5-checked, cached as .npz."""
    data_dir = Path(data_dir)
    cache = data_dir / CIFAR10_CACHE
    tarball = data_dir / CIFAR10_TARBALL
    with _lock(cache):
        if not cache.exists():
            if not tarball.exists():
                _download(CIFAR10_URL, tarball, CIFAR10_MD5)
            elif _md5(tarball) != CIFAR10_MD5:
                tarball.unlink()
                raise ValueError(
                    f"{tarball} is corrupt (md5 mismatch); deleted it, run again to re-download"
                )
            try:
                arrays = _extract_cifar10(tarball)
                for split in ("train", "test"):  # validate before caching, never after
                    images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
                    if images.shape[1:] != CIFAR10_SHAPE or len(labels) != len(images):
                        raise ValueError(f"cifar10/{split}: shape {images.shape}")
                    if labels.min() < 0 or labels.max() >= len(CIFAR10_CLASSES):
                        raise ValueError(f"cifar10/{split}: labels outside 0..9")
            except (tarfile.TarError, KeyError, EOFError, pickle.UnpicklingError, ValueError) as e:
                tarball.unlink()
                raise ValueError(
                    f"{tarball} could not be read as CIFAR-10 ({e}); deleted it, run again"
                ) from e
            _save_npz(cache, **arrays)
    train, test = _read_npz(cache)
    return DatasetSplits(train=train, test=test, class_names=list(CIFAR10_CLASSES))


def _download(url: str, dest: Path, md5: str) -> None:
    """Stream `url` into a temp file next to `dest`; rename it to `dest` only if the md5 matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {url} -> {dest}", flush=True)
    digest = hashlib.md5()
    with atomic_path(dest) as tmp:  # whatever happens (error, Ctrl-C), the partial file goes
        try:
            with open(tmp, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as e:  # URLError, timeouts, a full disk
            raise ValueError(
                f"could not download {url} ({e}); on an offline machine, copy the file to {dest}"
            ) from e
        if digest.hexdigest() != md5:
            raise ValueError(
                f"download of {url} is corrupt or partial (md5 {digest.hexdigest()}, expected "
                f"{md5}); deleted it, run again to retry"
            )


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _extract_cifar10(tarball: Path) -> dict[str, np.ndarray]:
    def batches(tar: tarfile.TarFile, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        images, labels = [], []
        for name in names:
            member = tar.extractfile(f"cifar-10-batches-py/{name}")
            if member is None:
                raise KeyError(f"cifar-10-batches-py/{name} is not a file")
            # Our own md5-verified download, so unpickling it is safe.
            batch = pickle.load(io.BytesIO(member.read()), encoding="bytes")
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, *CIFAR10_SHAPE))
            labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
        return np.concatenate(images), np.concatenate(labels)

    with tarfile.open(tarball, "r:gz") as tar:
        train_images, train_labels = batches(tar, [f"data_batch_{i}" for i in range(1, 6)])
        test_images, test_labels = batches(tar, ["test_batch"])
    return {
        "train_images": train_images,
        "train_labels": train_labels,
        "test_images": test_images,
        "test_labels": test_labels,
    }


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write atomically (temp file + rename): a killed job never leaves a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)  # uncompressed: loading 180 MB of CIFAR takes ~0.1 s


def _read_npz(path: Path) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    try:
        with np.load(path) as f:
            return tuple((f[f"{s}_images"], f[f"{s}_labels"]) for s in ("train", "test"))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cached dataset {path} is unreadable ({e}); delete it and rerun") from e


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Hold an exclusive file lock on `path`.lock: the jobs of a sweep starting at once then
    download and build a cache once, the others wait and read it.

    The lock file is deleted before it is released, so nothing is left behind (even after a
    failed download). A waiter that then gets the lock on the deleted file sees that the name
    no longer points at its file and tries again on the new one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: the atomic renames alone keep the cache valid
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    while True:
        lock_file = open(lock_path, "a")  # noqa: SIM115 (closed below, in every path)
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                current = os.stat(lock_path)
            except FileNotFoundError:
                current = None
            if current is not None and current.st_ino == os.fstat(lock_file.fileno()).st_ino:
                try:
                    yield
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(lock_path)
                return
        finally:
            lock_file.close()  # closing releases the flock


def decode_cached(split: FileSplit, data_dir: Path, workers: int | None = None) -> Split:
    """Decode every image of `split` once into RAM, through a uint8 .npy cache in `data_dir`.

    The cache's name is a hash of the files (path, size, mtime) and the decoded shape: editing,
    adding or removing an image, or another --image-size, builds a new one. Written atomically
    under a lock, so the jobs of a sweep that start together decode the folder once.
    """
    stats = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in split.paths]
    key = hashlib.sha256(repr((stats, split.image_shape)).encode()).hexdigest()[:16]
    cache = Path(data_dir) / f"decoded-{key}.npy"
    with _lock(cache):
        if not cache.exists():
            c, h, w = split.image_shape
            images = np.empty((len(split), c, h, w), dtype=np.uint8)
            if workers is None:
                workers = default_workers(torch.device("cpu"), streaming=True)
            loader = torch.utils.data.DataLoader(
                _FileDataset(split.paths, split.labels, split.image_shape),
                batch_size=64,
                num_workers=workers,
                collate_fn=_whole_batch,
                worker_init_fn=_ignore_stop_signals,
            )
            start = 0
            with _workers_started_safely():
                batches = iter(loader)
            for batch, _ in batches:  # in order: no sampler shuffles here
                images[start : start + len(batch)] = batch.permute(0, 3, 1, 2).numpy()
                start += len(batch)
            cache.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(cache) as tmp, open(tmp, "wb") as f:
                np.save(f, images)
        try:
            images = np.load(cache)
        except (OSError, ValueError) as e:
            raise ValueError(f"decoded cache {cache} is unreadable ({e}); delete it") from e
    if images.shape != (len(split), *split.image_shape):
        raise ValueError(f"decoded cache {cache} has shape {images.shape}; delete it and rerun")
    return Split(torch.from_numpy(images), split.labels)


# --------------------------------------------------------------------------------------------
# Loaders


def available_cpus() -> int:
    """Cores this process may run on (a Slurm or taskset mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_workers(device: torch.device, *, streaming: bool = False) -> int:
    """DataLoader workers when --workers is not given.

    Streaming: decoding images is CPU work, so use the cores but leave one to the main process
    (at most 8: the lab's notes find the best count between 1 and 10). In memory on the CPU: 0,
    since a batch is a ~1 ms gather against ~270 ms for a training step on 2 cores, and a worker
    would take a core from the model. In memory on CUDA: a few workers gather and pin the next
    batches while the GPU computes.
    """
    cpus = available_cpus()
    if streaming:
        return max(1, min(8, cpus - 1))
    if device.type != "cuda":
        return 0
    return min(4, cpus // 2)


def _ignore_stop_signals(_worker_id: int) -> None:
    """worker_init_fn: workers ignore SIGINT/SIGTERM; the main process decides when they stop.

    Slurm and Ctrl-C signal the whole process group: a worker dying of it would turn a graceful
    stop (checkpoint, exit 75) into "DataLoader worker killed by signal" in the main process.
    Workers still exit when the main process shuts the loader down or dies (torch's watchdog).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Forked with the stop signals blocked (_workers_started_safely): one that arrived
    # meanwhile is pending, and is discarded now that it is ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _workers_started_safely() -> Iterator[None]:
    """Block SIGINT/SIGTERM while DataLoader workers are forked: a group signal landing between
    a worker's fork and its worker_init_fn would otherwise kill it (Slurm's TERM at an epoch's
    start, when CPU workers are started anew). Blocked in the main process only for the fork;
    a signal that came meanwhile reaches the stop handler when they are unblocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _fix_malloc_mmap_threshold(threshold: int = 4 << 20) -> None:
    """Serve every allocation above `threshold` by mmap, so it goes back to the OS when freed.

    glibc raises its mmap threshold after each large free (up to 32 MB), after which batch-sized
    buffers come from the heap and fragment it: streaming 256 px images in batches of 64, the
    main process's RSS grew from 301 to 871 MB in 40 batches; with a fixed threshold, from 302
    to 319 MB (the lab template's benchmarks/RESULTS.md, bench_data.py). Same as
    MALLOC_MMAP_THRESHOLD_=4194304.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3  # from glibc's malloc.h
        libc.mallopt(m_mmap_threshold, threshold)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to fix
        pass


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run a batch's data ops on one thread when they execute on the CPU.

    They are memory-bound and take ~1 ms on one core; spread over the intra-op pool each op
    waits at a barrier for every thread, which costs milliseconds per op as soon as the cores
    are shared (measured on 2 busy cores: 15-22 ms per batch with 2 threads, 1.3-2.8 with 1).
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Loader:
    """Iterable of `(x, y)` batches on `device`; `len()` is the number of batches per epoch.

    Training drops the ragged last batch (BatchNorm sees full batches, compiled graphs one
    shape); evaluation keeps it, so every sample is scored.
    """

    def __init__(
        self,
        split: Split | FileSplit,
        batch_size: int,
        *,
        train: bool,
        device,
        seed: int,
        shard: tuple[int, int] = (0, 1),
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.train = train
        self.seed = seed
        self.drop_last = train
        self.shard = shard  # (rank, world): this process takes the rank-th 1/world of each batch
        self.num_samples = len(split)
        self.epoch, self.skip_batches = 0, 0
        self._epoch_set = True
        channels, height, width = split.image_shape
        # Train batches are cropped out of zero-padded images (padded once when stored in
        # memory, per batch on the device when streamed).
        self.padding = crop_padding(height, width) if train else 0
        # (x - mean) / std = x * scale + shift, as full (1, C, H, W) channels_last tensors:
        # broadcasting (1, 3, 1, 1) over an innermost dim of 3 takes a ~20x slower path on CPU.
        mean, std = channel_stats(channels)
        scale = 1 / torch.tensor(std, device=self.device)
        shift = -torch.tensor(mean, device=self.device) * scale
        shape = (1, height, width, channels)
        self._scale = scale.expand(shape).contiguous().permute(0, 3, 1, 2)
        self._shift = shift.expand(shape).contiguous().permute(0, 3, 1, 2)
        self._pad_batches = False  # set by loaders whose stored images are not padded

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Fix the shuffle order for `epoch` and start it at batch `skip_batches` (for resume)."""
        self.epoch, self.skip_batches = epoch, skip_batches
        self._epoch_set = True

    def _next_epoch(self) -> None:
        # Iterating again without set_epoch() moves to the next epoch instead of repeating one.
        if not self._epoch_set:
            self.epoch, self.skip_batches = self.epoch + 1, 0
        self._epoch_set = False

    def batch_indices(self) -> list[torch.Tensor]:
        """This epoch's batches as index tensors: a pure function of (seed, epoch, skip)."""
        if self.train:
            order = torch.from_numpy(
                np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
            )
        else:
            order = torch.arange(self.num_samples)
        batches = list(order.split(self.batch_size))[: len(self)][self.skip_batches :]
        rank, world = self.shard
        if world > 1:  # torchrun: contiguous, disjoint shards of the same global batches
            batches = [b.tensor_split(world)[rank] for b in batches]
            batches = [b for b in batches if len(b)]  # an evaluation's short last batch
        return batches

    def _stored_images(self, split: Split) -> torch.Tensor:
        """The split as uint8 NHWC (padded once here for train loaders, not once per batch)."""
        images = split.images.permute(0, 2, 3, 1)
        if self.padding:
            p = self.padding
            return F.pad(images, (0, 0, p, p, p, p)).contiguous()
        return images.contiguous()

    def _to_model_input(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC batch on the device -> augmented, normalised float32, channels_last."""
        with _one_cpu_thread(self.device):
            if self.padding:
                if self._pad_batches:
                    p = self.padding
                    images = F.pad(images, (0, 0, p, p, p, p))
                images = random_crop_flip(images, self.padding)
            # NHWC memory viewed as NCHW is exactly the channels_last layout, no copy needed;
            # addcmul promotes uint8 to float32 and normalises in one call.
            return torch.addcmul(self._shift, images.permute(0, 3, 1, 2), self._scale)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError


def random_crop_flip(padded: torch.Tensor, padding: int) -> torch.Tensor:
    """Per-sample random crop and horizontal flip of a zero-padded uint8 NHWC batch.

    One index_select does both; offsets and flips come from the default RNG of the batch's
    device (so a checkpoint's RNG state replays them exactly).
    """
    n, hp, wp, c = padded.shape
    h, w = hp - 2 * padding, wp - 2 * padding
    dev = padded.device
    dy = torch.randint(0, 2 * padding + 1, (n,), device=dev)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=dev)
    flip = torch.randint(0, 2, (n,), device=dev)
    # Pixel offsets of one window, plain and mirrored; each sample adds its own start pixel.
    window = torch.arange(h, device=dev).view(h, 1) * wp + torch.arange(w, device=dev)
    windows = torch.stack([window, window.flip(1)])
    start = torch.arange(n, device=dev) * (hp * wp) + dy * wp + dx
    pixels = (windows[flip] + start.view(n, 1, 1)).view(-1)
    return padded.reshape(-1, c).index_select(0, pixels).view(n, h, w, c)


class _ArrayDataset(torch.utils.data.Dataset):
    """The whole split as uint8 NHWC in RAM: no per-sample work."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]):
        # The DataLoader asks for a whole batch at once: one gather instead of N small tensors.
        index = torch.as_tensor(indices)
        # index_select, not images[index]: the latter is ~300x slower for uint8 on CPU.
        with _one_cpu_thread(self.images.device):
            return self.images.index_select(0, index), self.labels.index_select(0, index)


class _FileDataset(torch.utils.data.Dataset):
    """Image files decoded on demand (in the worker processes): disk -> uint8 NHWC batch."""

    def __init__(self, paths: Sequence[str], labels: torch.Tensor, shape: tuple[int, int, int]):
        self.paths, self.labels, self.shape = paths, labels, shape

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]):
        channels, height, width = self.shape
        batch = np.empty((len(indices), height, width, channels), dtype=np.uint8)
        for row, i in enumerate(indices):
            batch[row] = decode_image(self.paths[i], (height, width), channels)
        return torch.from_numpy(batch), self.labels[torch.as_tensor(indices)]


class _EpochBatches(torch.utils.data.Sampler):
    """Batch sampler that yields the loader's current epoch (iterated in the main process)."""

    def __init__(self, loader: Loader):
        self.loader = loader

    def __iter__(self):
        return (b.tolist() for b in self.loader.batch_indices())

    def __len__(self) -> int:
        return len(self.loader) - self.loader.skip_batches


def _whole_batch(batch):
    return batch


class DataLoaderLoader(Loader):
    """torch DataLoader over the in-RAM array or the image files; the uint8 batch is moved to
    the device, then converted there."""

    def __init__(self, split: Split | FileSplit, batch_size: int, *, workers: int | None, **kwargs):
        super().__init__(split, batch_size, **kwargs)
        streaming = isinstance(split, FileSplit)
        self.workers = (
            default_workers(self.device, streaming=streaming) if workers is None else workers
        )
        if streaming:
            dataset = _FileDataset(split.paths, split.labels, split.image_shape)
            self._pad_batches = True
            _fix_malloc_mmap_threshold()
        else:
            dataset = _ArrayDataset(self._stored_images(split), split.labels)
        self._on_cuda = self.device.type == "cuda"
        background = self._on_cuda and self.workers > 0
        self._loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=_EpochBatches(self),
            collate_fn=_whole_batch,
            num_workers=self.workers,
            worker_init_fn=_ignore_stop_signals,
            # Pinned host memory makes the copy below truly asynchronous; only CUDA has it.
            pin_memory=self._on_cuda,
            # Workers survive between epochs (no re-fork of a process holding the dataset).
            persistent_workers=background,
            # Batches each worker prepares ahead, so the GPU never waits for a decode.
            prefetch_factor=4 if background else None,
            # Its own generator: otherwise each epoch's iterator draws its worker base seed from
            # the global torch RNG, shifting the augmentation stream a resumed run must replay.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def __iter__(self):
        self._next_epoch()
        with _workers_started_safely():
            batches = iter(self._loader)  # forks the workers (CPU: every epoch)
        for images, labels in batches:
            # uint8 crosses the bus (4x fewer bytes than float32); non_blocking lets the copy
            # overlap with the GPU still computing the previous step.
            images = images.to(self.device, non_blocking=self._on_cuda)
            labels = labels.to(self.device, non_blocking=self._on_cuda)
            yield self._to_model_input(images), labels


class DeviceResidentLoader(Loader):
    """The whole uint8 split lives on the device; batches are gathered there, nothing crosses
    the bus during training. 3-4.7 KB per 32x32 RGB image (train images are stored padded):
    CIFAR-10 takes ~250 MB."""

    def __init__(self, split: Split, batch_size: int, **kwargs):
        super().__init__(split, batch_size, **kwargs)
        self.images = self._stored_images(split).to(self.device)
        self.labels = split.labels.to(self.device)

    def __iter__(self):
        self._next_epoch()
        batches = self.batch_indices()
        if not batches:
            return
        # One copy of the epoch's order to the device, then every gather happens there.
        order = torch.cat(batches).to(self.device, non_blocking=True)
        for index in order.split([len(b) for b in batches]):
            with _one_cpu_thread(self.device):
                images = self.images.index_select(0, index)
                labels = self.labels.index_select(0, index)
            yield self._to_model_input(images), labels


def build_loader(
    split: Split | FileSplit,
    batch_size: int,
    *,
    train: bool,
    device,
    workers: int | None = None,
    gpu_resident: bool = False,
    seed: int = 0,
    shard: tuple[int, int] = (0, 1),
) -> Loader:
    """Return a loader of `(x, y)` on `device`: x float32 normalised channels_last, y int64.

    Train loaders shuffle (order = f(seed, epoch)), augment and drop the last partial batch.
    `gpu_resident=True` keeps an in-memory split whole on `device` (see `fits_on_device`);
    otherwise a DataLoader with `workers` processes (None: `default_workers`). A `FileSplit`
    is always streamed. `shard=(rank, world)`: this rank's contiguous 1/world of every batch.
    """
    common = dict(train=train, device=device, seed=seed, shard=shard)
    if gpu_resident and isinstance(split, Split):
        return DeviceResidentLoader(split, batch_size, **common)
    return DataLoaderLoader(split, batch_size, workers=workers, **common)


def fits_on_device(splits, device, *, max_fraction: float = 0.25) -> bool:
    """Whether the splits can be held whole on `device` (for `--gpu-resident auto`).

    `splits`: a mapping or iterable of splits, or of sample counts (counted as 32x32 RGB). The
    uint8 images, as stored for training (padded), must take at most `max_fraction` of the free
    memory: the GPU's on CUDA, the available RAM on the CPU (the rest is for the model).
    """
    device = torch.device(device)
    if isinstance(splits, Mapping):
        splits = splits.values()
    needed = 0
    for split in splits:
        count, (c, h, w) = (
            (split, CIFAR10_SHAPE) if isinstance(split, int) else (len(split), split.image_shape)
        )
        p = crop_padding(h, w)
        needed += count * (c * (h + 2 * p) * (w + 2 * p) + 8)  # padded pixels + int64 label
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return needed <= max_fraction * free
    if device.type == "cpu":
        available = available_ram_bytes()
        return available is not None and needed <= max_fraction * available
    return False
