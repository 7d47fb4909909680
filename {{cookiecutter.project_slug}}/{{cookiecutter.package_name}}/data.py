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
  folders that do not fit in RAM. Image folders that fit are decoded once into a uint8 .npy in
  --data-dir, memory-mapped: the jobs of a sweep decode them once and share one copy in RAM.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import signal
import tarfile
import threading
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .datasets import DATASETS, DataOptions, DatasetSplits, ImageFiles
from .dataversion import data_version as files_version
from .dataversion import file_lock as _lock
from .dataversion import forget
from .imagefolder import UnreadableImage, decode_image
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
# A training split must give at least this many optimizer steps per epoch (check_batch_size).
MIN_STEPS_PER_EPOCH = 4

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
    """One split in memory: uint8 images (N, C, H, W) and int64 labels (N,), on the CPU.

    Images are stored channels_last (NHWC memory), the layout the loaders gather from. `rows`,
    when set, makes the split `images[rows]` without copying them: the splits of one decoded
    cache (decode_cached) are rows of one memory-mapped array, shared by every job on the node.
    """

    images: torch.Tensor
    labels: torch.Tensor
    rows: torch.Tensor | None = None

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
    value_ranges: dict | None = None  # images of more than 8 bits (DatasetSplits.value_ranges)

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
    # Arrays: a hash of their content, recorded in config.json so a resume on other data is
    # refused (dataversion.changed_data). Files: None (their version is in the run's identity).
    content: str | None = None
    split_sizes: dict[str, int] = field(default_factory=dict)  # images per split after carving

    def as_config(self) -> dict:
        described = {
            "num_classes": self.num_classes,
            "channels": self.channels,
            "image_size": list(self.image_size),
            "class_names": list(self.class_names),
            "split_sizes": dict(self.split_sizes),
        }
        if self.content is not None:
            described["data_content"] = self.content
        return described


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
    data_version: str | None = None,
    task: str = "classification",
) -> LoadedDataset:
    """Load the registered dataset `name` as {"train", "val", "test"} splits and describe it.

    A missing test split is carved out of train with a fixed seed; a missing val split with
    `seed` (pass the same value to every run you compare, so all validate on the same images).
    `mode`: "memory", "stream" (only for datasets of files) or "auto" (memory when the decoded
    images take at most MEMORY_FRACTION of the available RAM). `data_version`: the version of
    `data_path` (dataversion.data_version; computed when None). Raises ValueError with a
    one-line message for every bad input.
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
    if data_path is not None and data_version is None:
        data_version = files_version(Path(data_path), data_dir)
    options = DataOptions(
        data_dir=data_dir,
        data_path=Path(data_path) if data_path else None,
        image_size=image_size,
        synthetic_size=synthetic_size,
        data_version=data_version,
        task=task,
    )
    with _data_dir_errors(data_dir):
        raw = entry.load(options)
    if not isinstance(raw, DatasetSplits) or raw.train is None:
        raise ValueError(f"dataset {name!r}: its function must return DatasetSplits(train=...)")
    content = None if data_path is not None else content_hash(raw)
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
    class_ids = not labels.is_floating_point()  # else float targets: regression, multi-hot
    if class_ids:
        num_classes = len(raw.class_names) if raw.class_names else int(labels.max()) + 1
    else:  # the model's output width: one per target column
        num_classes = labels[0].numel() if labels.ndim > 1 else 1
    class_names = (
        [str(c) for c in raw.class_names]
        if raw.class_names
        else [str(i) for i in range(num_classes)]
    )
    for where, split in splits.items():
        if class_ids:
            _check_labels(split, f"{name}/{where}", num_classes)
    present = set(labels.unique().tolist()) if class_ids and labels.ndim == 1 else set()
    missing_in_train = present - set(splits["train"].labels.unique().tolist())
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
        try:
            with _data_dir_errors(data_dir):
                splits = {
                    k: decode_cached(s, data_dir, workers) if isinstance(s, FileSplit) else s
                    for k, s in splits.items()
                }
        except UnreadableImage as e:  # checked by the scan, so it changed since: rewritten
            forget(data_path, data_dir)  # in place; the next start fingerprints every file
            raise ValueError(
                f"{e}; it changed after its folder was checked (rewritten in place); re-run: "
                "the folder is fingerprinted again, the file skipped and listed"
            ) from e
    if "test" not in splits:  # a fixed carve: the test set never depends on --seed
        splits["train"], splits["test"] = _carve(splits["train"], TEST_FRACTION, TEST_SPLIT_SEED)
    if "val" not in splits:
        splits["train"], splits["val"] = _carve(splits["train"], val_fraction, seed)
    if len(splits["train"]) == 0 or len(splits["test"]) == 0:
        raise ValueError(f"dataset {name!r}: too few images to split into train and test")
    sizes = {k: len(splits[k]) for k in ("train", "val", "test")}
    info = DatasetInfo(name, num_classes, channels, (height, width), class_names, content, sizes)
    return LoadedDataset(splits, info, mode, list(raw.notes))


@contextlib.contextmanager
def _data_dir_errors(data_dir: Path) -> Iterator[None]:
    """A cache or list that cannot be written to --data-dir is a one-line error naming it."""
    try:
        yield
    except OSError as e:
        where = str(e.filename or "")
        if not where.startswith(str(data_dir)):
            raise
        raise ValueError(f"--data-dir: cannot write to {data_dir}: {e.strerror}") from e


def content_hash(raw: DatasetSplits) -> str:
    """`arrays:<16 hex>`: sha256 over the array splits' shapes and bytes (files: their version
    is dataversion.data_version instead)."""
    h = hashlib.sha256()
    for name in ("train", "val", "test"):
        split = getattr(raw, name)
        if split is None or isinstance(split, ImageFiles):
            continue
        for array in split:
            array = np.ascontiguousarray(array)
            h.update(f"{name}{array.dtype}{array.shape}".encode())
            h.update(memoryview(array).cast("B"))
    return "arrays:" + h.hexdigest()[:16]


def _as_split(raw, described: DatasetSplits, image_size, where: str) -> Split | FileSplit:
    """A dataset function's split (arrays or ImageFiles) as a Split or FileSplit, checked."""
    if isinstance(raw, ImageFiles):
        if described.channels is None or described.image_size is None:
            raise ValueError(f"{where}: ImageFiles need DatasetSplits(channels=, image_size=)")
        labels = torch.as_tensor(np.asarray(raw.labels, dtype=np.int64))
        if len(labels) != len(raw.paths):
            raise ValueError(f"{where}: {len(raw.paths)} files but {len(labels)} labels")
        size = tuple(image_size or described.image_size)
        shape = (described.channels, *size)
        return FileSplit(list(raw.paths), labels, shape, described.value_ranges)
    try:
        images, labels = raw
    except (TypeError, ValueError):
        raise ValueError(f"{where}: a split must be (images, labels) or ImageFiles") from None
    images = torch.as_tensor(np.asarray(images))
    labels = torch.as_tensor(np.asarray(labels))  # class ids -> int64, targets -> float32
    labels = labels.float() if labels.is_floating_point() else labels.long()
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(
            f"{where}: expected uint8 images of shape (N, C, H, W), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if labels.ndim == 0 or len(labels) != len(images):
        raise ValueError(f"{where}: expected {len(images)} labels, got {tuple(labels.shape)}")
    if image_size is not None and tuple(images.shape[2:]) != tuple(image_size):
        need = len(images) * images.shape[1] * image_size[0] * image_size[1]
        available = available_ram_bytes()
        if available is not None and need > MEMORY_FRACTION * available:
            h, w = image_size
            raise ValueError(
                f"--image-size: {len(images)} images of {where} at {h}x{w} take "
                f"{need / 2**30:.1f} GiB, more than {MEMORY_FRACTION:g} of the "
                f"{available / 2**30:.1f} GiB this job may use; choose a smaller --image-size"
            )
        images = _resize(images, image_size)
    # channels_last once here: the loaders gather NHWC batches from it without another copy.
    return Split(images.contiguous(memory_format=torch.channels_last), labels)


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
            [split.paths[i] for i in index.tolist()],
            split.labels[index],
            split.image_shape,
            split.value_ranges,
        )
    if split.rows is not None:  # rows of a shared cache: select, never copy the images
        return Split(split.images, split.labels[index], split.rows[index])
    nhwc = split.images.permute(0, 2, 3, 1).index_select(0, index)
    return Split(nhwc.permute(0, 3, 1, 2), split.labels[index])


def available_ram_bytes() -> int | None:
    """Memory this job may still use: the least of MemAvailable, the cgroup v2 headroom
    (memory.max - memory.current, of this cgroup and its parents: Slurm's --mem, a container's
    limit), Slurm's SLURM_MEM_PER_NODE / SLURM_MEM_PER_CPU and RLIMIT_AS; divided among the
    LAB_JOBS_PER_NODE jobs that share it (run.sh exports its slot count)."""
    limits = [_meminfo_available(), _cgroup_headroom(), _slurm_memory(), _rlimit_headroom()]
    known = [limit for limit in limits if limit is not None]
    if not known:
        return None
    return min(known) // jobs_per_node()


def jobs_per_node() -> int:
    try:
        return max(1, int(os.environ.get("LAB_JOBS_PER_NODE", "1")))
    except ValueError:
        return 1


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """Least (memory.max - memory.current) over this process's cgroup v2 and its ancestors."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line[3:].strip() for line in f if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    headroom = None
    group = Path(root + path)
    while True:
        with contextlib.suppress(OSError, ValueError):
            limit = (group / "memory.max").read_text().strip()
            if limit != "max":
                used = int((group / "memory.current").read_text())
                room = max(int(limit) - used, 0)
                headroom = room if headroom is None else min(headroom, room)
        if group == Path(root) or group.parent == group:
            return headroom
        group = group.parent


def _slurm_memory() -> int | None:
    """The job's memory per node in bytes from Slurm's environment (MB there), less what this
    process already uses."""
    env = os.environ
    with contextlib.suppress(ValueError):
        if env.get("SLURM_MEM_PER_NODE"):
            total = int(env["SLURM_MEM_PER_NODE"]) << 20
        elif env.get("SLURM_MEM_PER_CPU"):
            cpus = int(env.get("SLURM_CPUS_ON_NODE") or env.get("SLURM_CPUS_PER_TASK") or 1)
            total = (int(env["SLURM_MEM_PER_CPU"]) << 20) * cpus
        else:
            return None
        return max(total - _rss_bytes(), 0) if total > 0 else None
    return None


def _rss_bytes() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def _rlimit_headroom() -> int | None:
    try:
        import resource

        limit, _ = resource.getrlimit(resource.RLIMIT_AS)
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        return max(limit - used, 0)
    except (ImportError, OSError, ValueError):
        return None


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


def check_batch_size(train_images: int, batch_size: int, grad_accum: int = 1) -> None:
    """Refuse a batch that leaves fewer than MIN_STEPS_PER_EPOCH optimizer steps per epoch.

    Training drops the ragged last batch: ~130 images at the default batch of 128 made one
    step per epoch and never trained on the rest. Refused with the largest batch that works
    (changing it quietly would change the experiment its run directory names).
    """
    effective = batch_size * grad_accum
    if effective * MIN_STEPS_PER_EPOCH <= train_images:
        return
    largest = train_images // (MIN_STEPS_PER_EPOCH * grad_accum)
    what = f"--batch-size: {batch_size} x --grad-accum {grad_accum} is"
    if effective > train_images:
        what += f" larger than the training set ({train_images} images): not one step per epoch"
    else:
        what += (
            f" more than 1/{MIN_STEPS_PER_EPOCH} of the training set ({train_images} images): "
            f"{train_images // effective} optimizer step(s) per epoch and "
            f"{train_images % effective} images left out of every epoch"
        )
    hint = f"use --batch-size {largest} or less" if largest else "the training set is too small"
    raise ValueError(f"{what}; {hint}")


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


def load_synthetic_arrays(data_dir: Path, size: int, task: str = "classification") -> DatasetSplits:
    """Learnable CIFAR-shaped data: one smooth random pattern per class, shifted, plus noise.

    `size` training images and size // 5 test images (CIFAR's 5:1), generated from a fixed seed
    and cached, so every job of a benchmark or sweep reads identical bytes. The targets follow
    `task` (`synthetic_targets`); any other task gets the class ids.
    """
    if size < SYNTHETIC_CLASSES:
        raise ValueError(f"--synthetic-size must be >= {SYNTHETIC_CLASSES}, got {size}")
    cache = Path(data_dir) / f"synthetic_{size}.npz"
    with _lock(cache):
        if not cache.exists():
            _save_npz(cache, **_generate_synthetic(size, size // 5))
    (x_train, y_train), (x_test, y_test) = _read_npz(cache)
    return DatasetSplits(
        train=(x_train, synthetic_targets(y_train, task)),
        test=(x_test, synthetic_targets(y_test, task)),
    )


def synthetic_targets(labels: np.ndarray, task: str) -> np.ndarray:
    """The class ids as `task`'s targets, each a fixed function of the class (so learnable):
    regression: 4 standard-normal numbers per class, float32 (N, 4); multilabel: 5 labels,
    each on for a class with probability 0.4, float32 multi-hot (N, 5); else the ids."""
    rng = np.random.default_rng([SYNTHETIC_SEED, 21])
    if task == "regression":
        table = rng.standard_normal((SYNTHETIC_CLASSES, 4))
    elif task == "multilabel":
        table = rng.random((SYNTHETIC_CLASSES, 5)) < 0.4
    else:
        return labels
    return table.astype(np.float32)[labels]


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


def decode_cached(split: FileSplit, data_dir: Path, workers: int | None = None) -> Split:
    """Decode every image of `split` once, through a uint8 .npy cache in `data_dir`.

    The cache's name is a hash of the files (path, size, mtime), the decoded shape and value
    ranges: editing, adding or removing an image, or another --image-size, builds a new one.
    Decoded straight into the file (never a second copy in RAM), written atomically under a
    lock (the jobs of a sweep that start together decode the folder once), and read back
    memory-mapped: the jobs on one machine share its pages in the page cache. Stored NHWC.
    """
    stats = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in split.paths]
    layout = ("nhwc", split.image_shape, sorted((split.value_ranges or {}).items()))
    key = hashlib.sha256(repr((stats, layout)).encode()).hexdigest()[:16]
    cache = Path(data_dir) / f"decoded-{key}.npy"
    c, h, w = split.image_shape
    with _lock(cache):
        if not cache.exists():
            with atomic_path(cache) as tmp:
                images = np.lib.format.open_memmap(
                    tmp, mode="w+", dtype=np.uint8, shape=(len(split), h, w, c)
                )
                loader = DataLoaderLoader(
                    split, 64, workers=workers, train=False, device="cpu", seed=0
                )
                start = 0
                for batch, _ in loader.raw_batches():  # in order: evaluation never shuffles
                    images[start : start + len(batch)] = batch.numpy()
                    start += len(batch)
                images.flush()
                del images
        try:
            # Copy-on-write ("c"): pages are read from the shared page cache; a write (none is
            # made) would stay private instead of faulting on a read-only mapping.
            images = np.load(cache, mmap_mode="c")
        except (OSError, ValueError) as e:
            raise ValueError(f"decoded cache {cache} is unreadable ({e}); delete it") from e
    if images.shape != (len(split), h, w, c):
        raise ValueError(f"decoded cache {cache} has shape {images.shape}; delete it and rerun")
    nchw = torch.from_numpy(images).permute(0, 3, 1, 2)  # channels_last: no copy
    return Split(nchw, split.labels, torch.arange(len(split)))


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


def _worker_init(_worker_id: int) -> None:
    """worker_init_fn: workers leave stop signals to the main process, but not their own end.

    Slurm and Ctrl-C signal the whole process group: a worker dying of it would turn a graceful
    stop (checkpoint, exit 75) into "DataLoader worker killed by signal" in the main process.
    So SIGINT and SIGTERM stay blocked here (they were blocked for the fork, by
    _workers_started_safely) and one thread takes them: a SIGTERM sent by the parent itself
    (how multiprocessing's exit handler and torch's shutdown end workers) or any SIGTERM once
    the parent is gone ends the worker as SIGTERM's default action would. Workers that ignored
    every SIGTERM kept run.py alive at exit after an error, holding its .lock, forever.
    PR_SET_PDEATHSIG sends that SIGTERM when the parent dies.
    """
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(128 + signal.SIGTERM)

    def take_stop_signals() -> None:
        while True:
            info = signal.sigwaitinfo(_STOP_SIGNALS)
            if info.si_signo == signal.SIGTERM and (
                info.si_pid == parent or os.getppid() != parent
            ):
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=take_stop_signals, name="stop-signals", daemon=True).start()


def _set_parent_death_signal(signum: int) -> None:
    try:
        import ctypes

        pr_set_pdeathsig = 1  # from linux/prctl.h
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signum))
    except (OSError, AttributeError):  # not Linux: torch's watchdog still ends orphans
        pass


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
        augment: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.train = train
        self.seed = seed
        self.drop_last = train
        self.num_samples = len(split)
        self.epoch, self.skip_batches = 0, 0
        self._epoch_set = True
        channels, height, width = split.image_shape
        # Train batches are cropped out of zero-padded images, padded per batch on the device:
        # a padded copy of the stored split would double the memory it takes. augment=False (a
        # task with per-pixel targets, which crop and flip would not move): no crop, no flip.
        self.padding = crop_padding(height, width) if train and augment else 0
        # (x - mean) / std = x * scale + shift, as full (1, C, H, W) channels_last tensors:
        # broadcasting (1, 3, 1, 1) over an innermost dim of 3 takes a ~20x slower path on CPU.
        mean, std = channel_stats(channels)
        scale = 1 / torch.tensor(std, device=self.device)
        shift = -torch.tensor(mean, device=self.device) * scale
        shape = (1, height, width, channels)
        self._scale = scale.expand(shape).contiguous().permute(0, 3, 1, 2)
        self._shift = shift.expand(shape).contiguous().permute(0, 3, 1, 2)

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
        batches = list(order.split(self.batch_size))[: len(self)]
        return batches[self.skip_batches :]

    @staticmethod
    def _stored_images(split: Split) -> torch.Tensor:
        """The split's stored images as uint8 NHWC: a view, no copy (Split keeps NHWC memory)."""
        return split.images.permute(0, 2, 3, 1).contiguous()

    def _to_model_input(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC batch on the device -> augmented, normalised float32, channels_last."""
        with _one_cpu_thread(self.device):
            if self.padding:
                p = self.padding
                images = random_crop_flip(F.pad(images, (0, 0, p, p, p, p)), p)
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

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor | None):
        self.images, self.labels, self.rows = images, labels, rows

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]):
        # The DataLoader asks for a whole batch at once: one gather instead of N small tensors.
        index = torch.as_tensor(indices)
        rows = index if self.rows is None else self.rows.index_select(0, index)
        # index_select, not images[index]: the latter is ~300x slower for uint8 on CPU.
        with _one_cpu_thread(self.images.device):
            return self.images.index_select(0, rows), self.labels.index_select(0, index)


class _FileDataset(torch.utils.data.Dataset):
    """Image files decoded on demand (in the worker processes): disk -> uint8 NHWC batch."""

    def __init__(self, split: FileSplit):
        self.paths, self.labels, self.shape = split.paths, split.labels, split.image_shape
        self.ranges = split.value_ranges

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]):
        channels, height, width = self.shape
        batch = np.empty((len(indices), height, width, channels), dtype=np.uint8)
        for row, i in enumerate(indices):
            try:
                batch[row] = decode_image(self.paths[i], (height, width), channels, self.ranges)
            except UnreadableImage as e:  # to the main process as a value: it names the file
                return _Unreadable(e.path, e.reason), None
        return torch.from_numpy(batch), self.labels[torch.as_tensor(indices)]


@dataclass
class _Unreadable:
    """A batch that could not be decoded (raised as UnreadableImage by the main process)."""

    path: str
    reason: str


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
        _fix_malloc_mmap_threshold()  # batch-sized buffers, freed, must not fragment the heap
        if streaming:
            dataset = _FileDataset(split)
        else:
            dataset = _ArrayDataset(self._stored_images(split), split.labels, split.rows)
        self._on_cuda = self.device.type == "cuda"
        background = self._on_cuda and self.workers > 0
        self._loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=_EpochBatches(self),
            collate_fn=_whole_batch,
            num_workers=self.workers,
            worker_init_fn=_worker_init,
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
        for images, labels in self.raw_batches():
            # uint8 crosses the bus (4x fewer bytes than float32); non_blocking lets the copy
            # overlap with the GPU still computing the previous step.
            images = images.to(self.device, non_blocking=self._on_cuda)
            labels = labels.to(self.device, non_blocking=self._on_cuda)
            yield self._to_model_input(images), labels

    def raw_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This epoch's batches as the workers give them: uint8 NHWC and labels, on the CPU.

        An image that fails to decode raises UnreadableImage (naming it). On any error the
        workers are shut down here, at once: a live iterator kept alive by the exception's
        traceback would otherwise outlive main() with its workers.
        """
        self._next_epoch()
        with _workers_started_safely():
            batches = iter(self._loader)  # forks the workers (CPU: every epoch)
        try:
            for images, labels in batches:
                if isinstance(images, _Unreadable):
                    raise UnreadableImage(images.path, images.reason)
                yield images, labels
        except Exception:
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
                self._loader._iterator = None  # persistent workers: a fresh set next epoch
            raise


class DeviceResidentLoader(Loader):
    """The whole uint8 split lives on the device; batches are gathered there, nothing crosses
    the bus during training. 3 KB per 32x32 RGB image: CIFAR-10 takes ~180 MB."""

    def __init__(self, split: Split, batch_size: int, **kwargs):
        super().__init__(split, batch_size, **kwargs)
        images = self._stored_images(split)
        if split.rows is not None:
            images = images.index_select(0, split.rows)
        self.images = images.to(self.device)
        self.labels = split.labels.to(self.device)

    def __iter__(self):
        self._next_epoch()
        batches = self.batch_indices()
        if not batches:
            return
        # One copy of the epoch's order to the device, then every gather happens there.
        order = torch.cat(batches).to(self.device, non_blocking=True)
        for index in order.split(self.batch_size):
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
    augment: bool = True,
) -> Loader:
    """Return a loader of `(x, y)` on `device`: x float32 normalised channels_last, y the labels.

    Train loaders shuffle (order = f(seed, epoch)), augment (random crop + flip, unless
    `augment=False`) and drop the last partial batch. `y` is the split's labels as they are.
    `gpu_resident=True` keeps an in-memory split whole on `device` (see `fits_on_device`);
    otherwise a DataLoader with `workers` processes (None: `default_workers`). A `FileSplit`
    is always streamed.
    """
    common = dict(train=train, device=device, seed=seed, augment=augment)
    if gpu_resident and isinstance(split, Split):
        return DeviceResidentLoader(split, batch_size, **common)
    return DataLoaderLoader(split, batch_size, workers=workers, **common)


def fits_on_device(splits, device, *, max_fraction: float = 0.25) -> bool:
    """Whether the splits can be held whole on `device` (for `--gpu-resident auto`).

    `splits`: a mapping or iterable of splits, or of sample counts (counted as 32x32 RGB). The
    uint8 images, as stored (unpadded: crops pad per batch), must take at most `max_fraction` of
    the free
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
        needed += count * (c * h * w + 8)  # pixels + int64 label
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return needed <= max_fraction * free
    if device.type == "cpu":
        available = available_ram_bytes()
        return available is not None and needed <= max_fraction * available
    return False
