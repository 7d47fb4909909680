"""The dataset registry: one decorated function per dataset. Imports neither torch nor numpy.

`run.py --dataset NAME` calls the function registered as NAME, here or in any other module of
the package (registry.py). What a dataset function returns, how its inputs are normalised and
augmented, and what targets each task takes: lib/README.md, "Data" and "Tasks"; keep heavy
imports inside the function. A missing test split is carved out of train with a fixed seed (it
never changes with --seed), a missing val split with --seed and --val-fraction (data.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .registry import Entry, Registry


@dataclass(frozen=True)
class DataOptions:
    """What the command line says about the data: data.load_dataset's options. A dataset
    function reads what it needs (the first six); load_dataset the rest."""

    data_dir: Path  # --data-dir: downloads and caches
    data_path: Path | None = None  # --data-path: the user's own data
    image_size: tuple[int, int] | None = None  # --image-size as (height, width); None = native
    synthetic_size: int = 10_000  # --synthetic-size
    data_version: str | None = None  # dataversion.data_version(data_path): keys the scan's cache
    task: str = "classification"  # --task: the kind of targets a dataset may offer
    # A missing val split: carved out of train with --val-fraction and --seed (pass the same seed
    # to every run you compare, so all validate on the same samples).
    val_fraction: float = 0.1
    seed: int = 0
    mode: str = "auto"  # --data-mode of image files (data.load_dataset)
    workers: int | None = None  # processes that decode the cache (None: every core; 0, 1: this)
    # --augment (auto/on/off) and the task's spatial_targets decide the training augmentation
    # (DatasetInfo.augmentation: pass it to loaders.Loader); --crop, --crop-* the images' crop.
    augment: str = "auto"
    spatial_targets: bool = False
    crop: str = "pad"
    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] | None = None


@dataclass
class ImageFiles:
    """A split stored as image files: decoded (and resized) when read, never all at once."""

    paths: Sequence[str]
    labels: Sequence[int]


@dataclass
class DatasetSplits:
    """What a dataset function returns. `val` and `test` may be None (carved out of train).

    `channels` and `image_size` are needed only for `ImageFiles` splits (for arrays they are
    read off the shape); `class_names` defaults to "0", "1", ...
    """

    train: Any
    val: Any = None
    test: Any = None
    class_names: Sequence[str] | None = None
    channels: int | None = None
    image_size: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)  # logged once by run.py (e.g. skipped files)
    # ImageFiles of more than 8 bits: {"int": (low, high), "float": (low, high)} mapped onto
    # 0..255 (imagefolder.decode_image); None: each mode's own range.
    value_ranges: dict | None = None
    # Array splits: how to read their axes (None: by dimensions, 2 "NL", 3 "NCL", 4 "NCHW",
    # 5 "NCDHW"; or "NTF"), whether to normalise them, and augmentation (None: --augment decides).
    layout: str | None = None
    normalize: bool = True
    augment: bool | None = None


DATASETS: dict[str, Entry] = Registry("register_dataset")  # any module (registry.py)
# @register_dataset(name, help=..., needs_data_path=False) on `fn(options) -> DatasetSplits`
register_dataset = DATASETS.register


# --------------------------------------------------------------------------------------------
# Built-in datasets: thin entries; the work (download, caching, decoding) lives in arrays.py and
# imagefolder.py, imported only when a dataset is loaded (neither imports this module back).


@register_dataset("digits", help="scikit-learn's 1797 8x8 digits upscaled to 32x32 (offline)")
def digits(options: DataOptions) -> DatasetSplits:
    from .arrays import load_digits_arrays

    train, test = load_digits_arrays(options.data_dir)
    return DatasetSplits(train=train, test=test)  # class names: the ids "0".."9"


@register_dataset("cifar10", help="CIFAR-10, downloaded once into --data-dir")
def cifar10(options: DataOptions) -> DatasetSplits:
    from .arrays import CIFAR10_CLASSES, load_cifar10_arrays

    train, test = load_cifar10_arrays(options.data_dir)
    return DatasetSplits(train=train, test=test, class_names=list(CIFAR10_CLASSES))


@register_dataset(
    "synthetic",
    help="learnable 32x32 patterns, --synthetic-size images; targets for every built-in --task",
)
def synthetic(options: DataOptions) -> DatasetSplits:
    from .arrays import load_synthetic_arrays

    train, test = load_synthetic_arrays(options.data_dir, options.synthetic_size, options.task)
    return DatasetSplits(train=train, test=test)


@register_dataset(
    "folder",
    needs_data_path=True,
    help="--data-path DIR: DIR/train/<class>/*.png|jpg|tif|webp|..., optional val/, test/",
)
def folder(options: DataOptions) -> DatasetSplits:
    from .imagefolder import scan_image_folder

    found = scan_image_folder(
        options.data_path, options.image_size, options.data_dir, options.data_version
    )
    splits = {s: ImageFiles(*found.pop(s)) for s in ("train", "val", "test") if s in found}
    return DatasetSplits(**splits, **found)
