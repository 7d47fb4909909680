"""Load a dataset: the registered source -> checked splits -> (decoded cache) -> described.

    data = load_dataset("digits", "data")               # .splits {"train","val","test"}, .info
    loader = Loader(data.splits["train"], 128, train=True, device=device)  # loaders.py

The data layer, by what changes together (no module imports one that imports it back):
- datasets.py   the registry: DatasetSplits, one function per dataset (arrays.py: the array
                datasets' downloads and .npz caches; imagefolder.py: the folder scan);
- imagefolder.py, imagecache.py, gpudecode.py   how an image file becomes pixels, the decoded
                cache, and streamed JPEGs decoded on the GPU;
- loaders.py, augment.py   batches on the device: the loaders, augmentation and normalisation;
- data.py       this file: load_dataset, the split carving, the memory budget, the batch check.

Arrays are held as the dataset gives them (float64 as float32): uint8 images take 4x less
memory and host->device transfer than float32, and are normalised on the device (augment.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from .arrays import TEST_FRACTION, TEST_SPLIT_SEED
from .augment import (
    LAYOUTS,
    Augmentation,
    Normalization,
    channel_last,
    choose_augmentation,
    describe,
    spatial_sizes,
)
from .datasets import DATASETS, DataOptions, DatasetSplits, ImageFiles
from .dataversion import data_version as files_version
from .dataversion import forget
from .imagecache import cache_path, decode_cached
from .imagefolder import UnreadableImage
from .loaders import FileSplit, Split, own_normalization
from .runs import size_text
from .tasks import check_targets

# Array datasets resized by --image-size must take at most this fraction of the available
# memory (the rest is for the model, the workers and everyone else on the node).
MEMORY_FRACTION = 0.25
# A training split must give at least this many optimizer steps per epoch (check_batch_size).
MIN_STEPS_PER_EPOCH = 4
HELD_AS = {np.dtype(bool): torch.uint8, np.dtype(np.float64): torch.float32}  # arrays held as
EMPTY_SPLIT = "the split is empty; give it samples, or leave it out (None: carved from train)"


@dataclass
class DatasetInfo:
    """What the model and config.json need to know about a dataset."""

    num_classes: int
    channels: int
    image_size: tuple[int, int]
    class_names: list[str]
    # Arrays: a hash of their content, recorded in config.json so a resume on other data is
    # refused (dataversion.changed_data). Files: None (their version is in the run's identity).
    content: str | None = None
    split_sizes: dict[str, int] = field(default_factory=dict)  # images per split after carving
    # One sample's shape as the dataset gives it ((C, H, W), (C, L), (L,), (T, F)), how its
    # axes are read (augment.LAYOUTS), the stored dtype; image_size holds the spatial sizes.
    input_shape: tuple[int, ...] = ()
    layout: str = "NCHW"
    dtype: str = "uint8"
    normalization: Normalization | None = None  # None: uint8 images' constants
    augmentation: Augmentation = field(default_factory=Augmentation)  # of the training split
    source: str = ""  # image files: memory, disk cache or stream, and why (data._image_source)

    def as_config(self) -> dict:
        described = {
            "num_classes": self.num_classes,
            "channels": self.channels,
            "image_size": list(self.image_size),
            "class_names": list(self.class_names),
            "split_sizes": dict(self.split_sizes),
            "input_shape": list(self.input_shape),
            "input": self.describe(),
        }
        if self.content is not None:
            described["data_content"] = self.content
        return described

    def describe(self) -> dict:
        """What the data layer did with the inputs: run.log's `data:` lines, config.json."""
        fixed = "per channel, fixed constants of uint8 images (CIFAR-10's)"
        described = {
            "data": describe(self.input_shape, self.layout, self.dtype),
            "normalization": fixed if self.normalization is None else self.normalization.why,
            "augmentation": self.augmentation.why,
        }
        if self.source:
            described["images from"] = self.source
        return described


@dataclass
class LoadedDataset:
    splits: dict[str, Split | FileSplit]
    info: DatasetInfo
    mode: str  # "memory" or "stream"
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Datasets


def load_dataset(name: str, data_dir: str | os.PathLike, **options) -> LoadedDataset:
    """Load the registered dataset `name` as {"train", "val", "test"} splits and describe it.

    `options`: datasets.DataOptions' fields (keywords). `mode` (datasets of files): "memory"
    (decoded once into the memory-mapped cache in `data_dir`), "stream" (decoded every epoch by
    the loader's workers) or "auto" (the cache, unless the address-space limit or the disk
    cannot hold it: then stream, and `info.source` says why; RAM is no limit, the page cache
    keeps what fits). Raises ValueError with a one-line message for every bad input.
    """
    # --val-fraction, --data-mode and --data-path were checked by run.py's parser (config.py)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    data_dir = Path(data_dir)
    options = DataOptions(data_dir, **options)
    data_path, data_version = options.data_path, options.data_version
    if data_path:  # data_version: a ValueError if it does not exist
        data_path = Path(data_path)
        data_version = data_version or files_version(data_path, data_dir)
        options = replace(options, data_path=data_path, data_version=data_version)
    with _data_dir_errors(data_dir):
        raw = DATASETS[name].build(options)
    if not isinstance(raw, DatasetSplits) or raw.train is None:
        raise ValueError(f"dataset {name!r}: its function must return DatasetSplits(train=...)")
    splits = {
        s: _as_split(getattr(raw, s), raw, options.image_size, f"{name}/{s}")
        for s in ("train", "val", "test")
        if getattr(raw, s) is not None
    }
    shapes = {(split.image_shape, split.layout, split.dtype) for split in splits.values()}
    if len(shapes) > 1:
        found = sorted(describe(*shape) for shape in shapes)
        raise ValueError(f"dataset {name!r}: splits differ in shape or dtype: {found}")
    ((input_shape, layout, dtype),) = shapes
    channels = input_shape[-1] if layout == "NTF" else input_shape[0]
    labels = torch.cat([split.labels for split in splits.values()])
    class_ids = not labels.is_floating_point()  # else float targets: regression, multi-hot
    if class_ids:
        num_classes = len(raw.class_names) if raw.class_names else int(labels.max()) + 1
    else:  # the model's output width: one per target column
        num_classes = labels[0].numel() if labels.ndim > 1 else 1
    # ids outside 0..num_classes-1, a multilabel split without a label, a train split of 1 class
    check_targets(splits, options.task, name, num_classes if class_ids else None)
    class_names = [str(c) for c in raw.class_names or range(num_classes)]
    files = [s for s in splits.values() if isinstance(s, FileSplit)]
    if not files and options.mode == "stream":
        raise ValueError(
            f"--data-mode: dataset {name!r} is held in memory as arrays; "
            "streaming needs a dataset of image files (e.g. folder)"
        )
    notes = list(raw.notes)
    mode, source = _image_source(files, options) if files else ("memory", "")
    if files and mode == "memory":  # decoded before carving: the cache never depends on --seed
        processes = None if options.workers is None else max(1, options.workers)
        found = all(cache_path(f, data_dir, data_version).exists() for f in files)
        try:
            with _data_dir_errors(data_dir):
                for key, split in splits.items():  # (each key replaced: the dict keeps its size)
                    if isinstance(split, FileSplit):
                        splits[key] = decode_cached(
                            split, data_dir, version=data_version, processes=processes, notes=notes
                        )
        except UnreadableImage as e:  # checked by the scan, so it changed since: rewritten
            # in place; the next start fingerprints every file
            raise ValueError(f"{e}; {forget(data_path, data_dir)}") from e
        # run.log: whether this start paid for the decode (the later ones never do); a cache
        # found but not used (a note of decode_cached's after the dataset's) was decoded again
        found = found and len(notes) == len(raw.notes)
        source += "; found, decoded by an earlier start" if found else "; decoded by this start"
    if "test" not in splits:  # a fixed carve: the test set never depends on --seed
        splits["train"], splits["test"] = _carve(splits["train"], TEST_FRACTION, TEST_SPLIT_SEED)
    if "val" not in splits:
        splits["train"], splits["val"] = _carve(splits["train"], options.val_fraction, options.seed)
    if len(splits["train"]) == 0 or len(splits["test"]) == 0:
        raise ValueError(f"dataset {name!r}: too few images to split into train and test")
    if not raw.normalize:
        normalization = Normalization(None, None, "none (the dataset declares normalize=False)")
    else:  # the training split's: val and test are scaled as the model saw train
        normalization = own_normalization(splits["train"], "the training split")
    for split in splits.values():
        split.normalization = normalization
    augmentation = choose_augmentation(
        input_shape, layout, dtype, options.augment, raw.augment, options.spatial_targets,
        crop=options.crop, crop_scale=options.crop_scale, crop_ratio=options.crop_ratio,
    )  # fmt: skip
    info = DatasetInfo(
        num_classes,
        channels,
        spatial_sizes(input_shape, layout),
        class_names,
        None if data_path is not None else content_hash(raw),  # arrays: of the splits checked
        {k: len(splits[k]) for k in ("train", "val", "test")},
        input_shape=input_shape,
        layout=layout,
        dtype=str(dtype).removeprefix("torch."),
        normalization=normalization,
        augmentation=augmentation,
        source=source,
    )
    return LoadedDataset(splits, info, mode, notes)


def _image_source(files: list[FileSplit], options: DataOptions) -> tuple[str, str]:
    """The mode that serves the image files ("memory": the decoded cache; "stream") and which
    of memory / disk cache / stream it is, and why (run.log's `images from:` line): the decoded
    cache is memory-mapped, so where it exceeds the RAM this job may use it is read back from
    disk every epoch (the page cache keeps what fits), still without a decode."""
    mode, version = options.mode, options.data_version
    why_not = _why_not_cached(files, options.data_dir, version) if mode == "auto" else None
    if mode == "stream" or why_not:
        if mode == "stream":
            why = "--data-mode stream; memory or auto decode once, and later epochs only gather"
        else:
            why = f"--data-mode auto: {why_not}"
        return "stream", f"stream: decoded every epoch by the loader's workers ({why})"
    need, ram = decoded_bytes(files), available_ram_bytes()
    _, height, width = files[0].image_shape  # the training size: no resize left per epoch
    decoded = (
        f"decoded once at {height}x{width} into {size_text(need)} in --data-dir, memory-mapped"
    )
    if need > ram:
        return "memory", (
            f"disk cache: {decoded}; more than the {size_text(ram)} of RAM this job may use, "
            f"so read back from disk every epoch (--data-mode {mode})"
        )
    fits = f"fits the {size_text(ram)} of RAM this job may use"
    return "memory", f"memory: {decoded} ({fits}); gathered every epoch (--data-mode {mode})"


@contextlib.contextmanager
def _data_dir_errors(data_dir: Path) -> Iterator[None]:
    """A cache or list that cannot be written to --data-dir is a one-line error naming it."""
    try:
        yield
    except OSError as e:
        if not str(e.filename or "").startswith(str(data_dir)):
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
        if len(labels) == 0:
            raise ValueError(f"{where}: {EMPTY_SPLIT}")
        shape = (described.channels, *(image_size or described.image_size))
        return FileSplit(list(raw.paths), labels, shape, described.value_ranges)
    try:
        images, labels = raw
    except (TypeError, ValueError):
        raise ValueError(f"{where}: a split must be (images, labels) or ImageFiles") from None
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim and len(images) == 0:
        raise ValueError(f"{where}: {EMPTY_SPLIT}")
    if labels.dtype.kind not in "biuf":  # names, objects: torch would fail with a traceback
        first = labels.flat[0] if labels.size else None
        raise ValueError(
            f"{where}: labels must be numbers (class ids 0..K-1, or float targets), got "
            f"{labels.dtype} such as {first!r}; map them to ids (and the names to "
            "DatasetSplits(class_names=...))"
        )
    # bool as uint8; float64 as float32: no model computes in float64, and half the memory
    images = torch.as_tensor(images, dtype=HELD_AS.get(images.dtype))
    # class ids (bool, int, uint) -> int64, targets (float) -> float32
    labels = torch.as_tensor(labels, dtype=torch.float if labels.dtype.kind == "f" else torch.long)
    layout = described.layout or LAYOUTS.get(images.ndim)
    if images.is_complex() or images.ndim < 2 or layout is None or len(layout) != images.ndim:
        raise ValueError(
            f"{where}: expected inputs (N, ...) of a real dtype read as "
            f"{' / '.join(sorted({*LAYOUTS.values(), 'NTF'}))}, got {images.dtype} "
            f"{tuple(images.shape)}" + (f" as {layout}" if described.layout else "")
        )
    if labels.ndim == 0 or len(labels) != len(images):
        raise ValueError(f"{where}: expected {len(images)} labels, got {tuple(labels.shape)}")
    for values, what in ((images, "input"), (labels, "target")):
        if values.is_floating_point():
            refuse_non_finite(values, where, what)
    if image_size is not None and tuple(images.shape[2:]) != tuple(image_size):
        if layout != "NCHW":
            raise ValueError(
                f"--image-size: resizes images (N, C, H, W); {where} holds "
                f"{describe(tuple(images.shape[1:]), layout, images.dtype)}"
            )
        need = math.prod((*images.shape[:2], *image_size)) * images.element_size()
        available = available_ram_bytes()
        if need > MEMORY_FRACTION * available:
            h, w = image_size
            raise ValueError(
                f"--image-size: {len(images)} images of {where} at {h}x{w} take "
                f"{need / 2**30:.1f} GiB, more than {MEMORY_FRACTION:g} of the "
                f"{available / 2**30:.1f} GiB this job may use; choose a smaller --image-size"
            )
        images = _resize(images, image_size)
    # Channel-last memory once here (channels_last for images): the loaders gather
    # (N, *spatial, C) batches from it without another copy.
    order = channel_last(layout, images.ndim)
    return Split(_in_layout(images.permute(order).contiguous(), order), labels, layout=layout)


def refuse_non_finite(values: torch.Tensor, where: str, what: str) -> None:
    """Refuse NaN or inf inputs or targets (`what`; ValueError naming the first row of the
    user's data): every loss would be NaN, which reads as a learning rate that diverged. In
    chunks: a non-contiguous array is copied a chunk at a time, never whole."""
    chunks = values.split(1024)
    bad = torch.cat([~torch.isfinite(chunk.reshape(len(chunk), -1)).all(1) for chunk in chunks])
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        found = values[row].reshape(-1)
        raise ValueError(
            f"{where}: {what} row {row} holds {found[~torch.isfinite(found)][0].item()} "
            f"({int(bad.sum())} row(s) with a non-finite {what}: every loss NaN); fix or drop them"
        )


def _in_layout(stored: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Channel-last `stored` (permuted by `order`) viewed back in the dataset's layout."""
    return stored.permute([order.index(axis) for axis in range(len(order))])


def _resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 images stay uint8; any other dtype is resized as float32."""
    dtype = torch.uint8 if images.dtype == torch.uint8 else torch.float32
    out = torch.empty(len(images), images.shape[1], *size, dtype=dtype)
    # In chunks: float temporaries stay small.
    for chunk, resized in zip(images.split(1024), out.split(1024), strict=True):
        scaled = F.interpolate(chunk.float(), size=size, mode="bilinear", antialias=True)
        resized.copy_(scaled.round().clamp_(0, 255) if dtype == torch.uint8 else scaled)
    return out


def _carve(split: Split | FileSplit, fraction: float, seed: int):
    """Split off `fraction` of `split` (a pure function of `seed`) -> (rest, carved)."""
    n_out = round(len(split) * fraction)
    order = torch.from_numpy(np.random.default_rng([seed, 0xDA7A]).permutation(len(split)))
    # Sorted indices keep each part in the original order: cheaper gathers, stable files.
    out_idx, keep_idx = order[:n_out].sort().values, order[n_out:].sort().values
    return subset(split, keep_idx), subset(split, out_idx)


def subset(split: Split | FileSplit, index: torch.Tensor) -> Split | FileSplit:
    """The rows `index` of `split`, which keeps its layout and normalisation."""
    if isinstance(split, FileSplit):
        paths = [split.paths[i] for i in index.tolist()]
        return replace(split, paths=paths, labels=split.labels[index])
    if split.rows is not None:  # rows of a shared cache: select, never copy the images
        return replace(split, labels=split.labels[index], rows=split.rows[index])
    order = channel_last(split.layout, split.images.ndim)
    stored = split.images.permute(order).index_select(0, index)
    return replace(split, images=_in_layout(stored, order), labels=split.labels[index])


def available_ram_bytes() -> int:
    """Memory this job may still use: the least of MemAvailable, the cgroup v2 headroom
    (memory.max - memory.current, of this cgroup and its parents: Slurm's --mem, a container's
    limit), Slurm's SLURM_MEM_PER_NODE / SLURM_MEM_PER_CPU (less this process's RSS) and
    RLIMIT_AS; divided among the LAB_JOBS_PER_NODE jobs that share it (run.sh exports its slot
    count)."""
    env = os.environ
    limits = [psutil.virtual_memory().available, _cgroup_headroom(), _rlimit_headroom()]
    with contextlib.suppress(ValueError):  # Slurm's values are in MB
        cpus = int(env.get("SLURM_CPUS_ON_NODE") or env.get("SLURM_CPUS_PER_TASK") or 1)
        per_cpu = int(env.get("SLURM_MEM_PER_CPU") or 0) * cpus
        slurm = int(env.get("SLURM_MEM_PER_NODE") or 0) or per_cpu
        if slurm > 0:
            limits.append(max((slurm << 20) - psutil.Process().memory_info().rss, 0))
    jobs = env.get("LAB_JOBS_PER_NODE", "")  # psutil's MemAvailable: always a number
    return min(x for x in limits if x is not None) // max(1, int(jobs) if jobs.isdecimal() else 1)


def _cgroup_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """Least (memory.max - memory.current) over this process's cgroup v2 and its ancestors."""
    try:
        with open("/proc/self/cgroup") as f:
            own = Path(root + next(line[3:].strip() for line in f if line.startswith("0::")))
    except (OSError, StopIteration):
        return None
    rooms = []
    for group in (own, *(p for p in own.parents if p.is_relative_to(root))):
        with contextlib.suppress(OSError, ValueError):
            limit = (group / "memory.max").read_text().strip()
            if limit != "max":
                rooms.append(max(int(limit) - int((group / "memory.current").read_text()), 0))
    return min(rooms, default=None)


def _rlimit_headroom() -> int | None:
    import resource

    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return None
    return max(limit - psutil.Process().memory_info().vms, 0)


def decoded_bytes(splits) -> int:
    """Bytes of the splits' inputs as stored (image files: decoded, uint8) and their labels."""
    return sum(
        len(s) * (math.prod(s.image_shape) * s.dtype.itemsize + s.labels[:1].nbytes) for s in splits
    )


def _why_not_cached(files: list[FileSplit], data_dir: Path, version: str | None) -> str | None:
    """Why the decoded cache cannot serve these splits (None: it can). RAM is no limit: the
    cache is memory-mapped, and the page cache keeps what fits of it."""
    headroom = _rlimit_headroom()  # a mapping takes address space, which RLIMIT_AS limits
    need = decoded_bytes(files)
    if headroom is not None and need > headroom // 2:
        return (
            f"its decoded cache ({need / 2**30:.1f} GiB) does not fit the address-space "
            f"limit (ulimit -v: {headroom / 2**30:.1f} GiB left)"
        )
    # The disk, before a decode that would fail when it fills (--data-mode memory: that error).
    to_write = decoded_bytes(f for f in files if not cache_path(f, data_dir, version).exists())
    free = shutil.disk_usage(next(p for p in (data_dir, *data_dir.parents) if p.exists())).free
    if to_write > free:
        return f"its decoded cache needs {size_text(to_write)}, --data-dir has {size_text(free)}"
    return None


def check_batch_size(train_images: int, batch_size: int, grad_accum: int = 1) -> None:
    """Refuse a batch that leaves fewer than MIN_STEPS_PER_EPOCH optimizer steps per epoch:
    training drops the ragged last batch (~130 images at batch 128: one step an epoch). The
    refusal names the largest batch that works; changing it quietly would change the experiment.
    """
    effective = batch_size * grad_accum
    if effective * MIN_STEPS_PER_EPOCH <= train_images:
        return
    largest = train_images // (MIN_STEPS_PER_EPOCH * grad_accum)
    hint = f"use --batch-size {largest} or less" if largest else "the training set is too small"
    part = "larger than" if effective > train_images else f"more than 1/{MIN_STEPS_PER_EPOCH} of"
    raise ValueError(
        f"--batch-size: {batch_size} x --grad-accum {grad_accum} is {part} the training set "
        f"({train_images} images): {train_images // effective} optimizer step(s) per epoch, "
        f"{train_images % effective} images left out of every epoch; {hint}"
    )
