"""Datasets and loaders.

Every dataset is held as uint8 (N, 3, 32, 32) tensors: 4x less memory and 4x less host->device
transfer than float32. Conversion to float, normalisation and the train augmentation (random crop
with 4-pixel padding + horizontal flip) run on the training device, in whole batches, drawing from
that device's torch RNG, so the RNG state saved in a checkpoint makes a resumed epoch exact.

    splits = load_dataset("digits", "data")            # {"train", "val", "test"} -> Split
    loader = build_loader(splits["train"], 128, train=True, device=device)
    for epoch in range(epochs):
        loader.set_epoch(epoch)                         # shuffle order = f(seed, epoch)
        for x, y in loader: ...                         # float32, channels_last, on device

Two loaders sit behind `build_loader`: a torch DataLoader over the in-RAM array (batched indexing,
the uint8 batch copied with non_blocking) and a device-resident one (the whole dataset on the
device, batches gathered there; the fastest for datasets that fit, such as CIFAR-10 on a GPU).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import tarfile
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .runs import atomic_path

DATASETS = ("digits", "cifar10", "synthetic")
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)

# Module constants so tests can point them at a local tarball.
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_TARBALL = "cifar-10-python.tar.gz"
CIFAR10_CACHE = "cifar10.npz"

DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: the test set must not change with the run's seed
SYNTHETIC_SEED = 1234  # fixed: every job of a sweep trains on the same synthetic data

# CIFAR-10 channel statistics, used for every dataset: BatchNorm right after the first conv
# absorbs any remaining offset, and one constant keeps train, val and test scaled alike.
MEAN = (0.4914 * 255, 0.4822 * 255, 0.4465 * 255)
STD = (0.2470 * 255, 0.2435 * 255, 0.2616 * 255)
CROP_PADDING = 4


@dataclass
class Split:
    """One split: uint8 images (N, 3, 32, 32) and int64 labels (N,), on the CPU."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


# --------------------------------------------------------------------------------------------
# Datasets


def load_dataset(
    name: str,
    data_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.1,
    seed: int = 0,
    synthetic_size: int = 10_000,
) -> dict[str, Split]:
    """Load `name` as {"train", "val", "test"} splits; `val` is carved out of the training set.

    The carve is a pure function of `seed` (pass the same value to every run you compare, so
    all of them validate on the same images). Raises ValueError for an unknown dataset, a
    corrupt download or arrays of the wrong size.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    data_dir = Path(data_dir)
    if name == "digits":
        train, test = _load_digits()
    elif name == "cifar10":
        train, test = _load_cifar10(data_dir)
    else:
        train, test = _load_synthetic(data_dir, synthetic_size)
    for split_name, split in (("train", train), ("test", test)):
        _check_split(split, f"{name}/{split_name}")
    train, val = _carve_val(train, val_fraction, seed)
    return {"train": train, "val": val, "test": test}


def _check_split(split: Split, where: str) -> None:
    images, labels = split.images, split.labels
    if images.dtype != torch.uint8 or images.ndim != 4 or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(
            f"{where}: expected uint8 images of shape (N, 3, 32, 32), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if labels.dtype != torch.int64 or labels.shape != (len(images),):
        raise ValueError(f"{where}: expected {len(images)} int64 labels, got {tuple(labels.shape)}")
    if len(labels) == 0 or labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise ValueError(f"{where}: empty split or labels outside 0..{NUM_CLASSES - 1}")


def _carve_val(train: Split, val_fraction: float, seed: int) -> tuple[Split, Split]:
    n_val = round(len(train) * val_fraction)
    order = torch.from_numpy(np.random.default_rng([seed, 0xDA7A]).permutation(len(train)))
    # Sorted indices keep each part in the original order: cheaper gathers, stable files.
    val_idx, train_idx = order[:n_val].sort().values, order[n_val:].sort().values
    return (
        Split(train.images[train_idx], train.labels[train_idx]),
        Split(train.images[val_idx], train.labels[val_idx]),
    )


def _load_digits() -> tuple[Split, Split]:
    """scikit-learn's 1797 handwritten digits (ships with the package: works offline)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    # 8x8 intensities 0..16 -> 32x32 uint8, grey repeated to 3 channels to look like CIFAR.
    small = torch.from_numpy(digits.images).float().unsqueeze(1) * (255 / 16)
    big = F.interpolate(small, size=IMAGE_SHAPE[1:], mode="bilinear", align_corners=False)
    images = big.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = torch.from_numpy(digits.target).long()
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)),
        test_size=DIGITS_TEST_FRACTION,
        stratify=digits.target,
        random_state=DIGITS_SPLIT_SEED,
    )
    train_idx, test_idx = torch.from_numpy(np.sort(train_idx)), torch.from_numpy(np.sort(test_idx))
    return Split(images[train_idx], labels[train_idx]), Split(images[test_idx], labels[test_idx])


def _load_synthetic(data_dir: Path, size: int) -> tuple[Split, Split]:
    """Learnable CIFAR-shaped data: one smooth random pattern per class, shifted, plus noise.

    `size` training images and size // 5 test images (CIFAR's 5:1), generated from a fixed seed
    and cached, so every job of a benchmark or sweep reads identical bytes.
    """
    if size < NUM_CLASSES:
        raise ValueError(f"synthetic_size must be >= {NUM_CLASSES}, got {size}")
    cache = data_dir / f"synthetic_{size}.npz"
    with _lock(cache):
        if not cache.exists():
            _save_npz(cache, **_generate_synthetic(size, size // 5))
    return _read_npz(cache)


def _generate_synthetic(n_train: int, n_test: int) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    # Low-frequency prototypes (8x8 noise upsampled): classes differ in colour and layout.
    prototypes = F.interpolate(
        torch.rand(NUM_CLASSES, 3, 8, 8, generator=gen), size=IMAGE_SHAPE[1:], mode="bicubic"
    )
    arrays = {}
    for split, n in (("train", n_train), ("test", max(n_test, 1))):
        labels = torch.randint(NUM_CLASSES, (n,), generator=gen)
        images = torch.empty(n, *IMAGE_SHAPE, dtype=torch.uint8)
        for start in range(0, n, 4096):  # in chunks: float temporaries stay small
            y = labels[start : start + 4096]
            # Each image: its class prototype circularly shifted by up to 4 px, plus noise.
            dy, dx = torch.randint(-4, 5, (2, len(y), 1), generator=gen)
            rows = (torch.arange(32) + dy) % 32
            cols = (torch.arange(32) + dx) % 32
            x = prototypes[y.view(-1, 1, 1), :, rows.unsqueeze(2), cols.unsqueeze(1)]
            x = x.permute(0, 3, 1, 2) + 0.35 * torch.randn(len(y), *IMAGE_SHAPE, generator=gen)
            images[start : start + 4096] = (x * 255).round().clamp(0, 255).to(torch.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images.numpy(), labels.numpy()
    return arrays


def _load_cifar10(data_dir: Path) -> tuple[Split, Split]:
    """CIFAR-10 from the official tarball: downloaded once, md5-checked, cached as .npz."""
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
                    images = torch.from_numpy(arrays[f"{split}_images"])
                    labels = torch.from_numpy(arrays[f"{split}_labels"])
                    _check_split(Split(images, labels), f"cifar10/{split}")
            except (tarfile.TarError, KeyError, EOFError, pickle.UnpicklingError, ValueError) as e:
                tarball.unlink()
                raise ValueError(
                    f"{tarball} could not be read as CIFAR-10 ({e}); deleted it, run again"
                ) from e
            _save_npz(cache, **arrays)
    return _read_npz(cache)


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
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, *IMAGE_SHAPE))
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


def _read_npz(path: Path) -> tuple[Split, Split]:
    try:
        with np.load(path) as f:
            splits = tuple(
                Split(torch.from_numpy(f[f"{s}_images"]), torch.from_numpy(f[f"{s}_labels"]))
                for s in ("train", "test")
            )
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cached dataset {path} is unreadable ({e}); delete it and rerun") from e
    return splits  # type: ignore[return-value]


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Hold an exclusive file lock on `path`.lock: the jobs of a sweep starting at once then
    download and build a cache once, the others wait and read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: the atomic renames alone keep the cache valid
        yield
        return
    with open(path.with_name(path.name + ".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# Loaders


def default_workers(device: torch.device) -> int:
    """DataLoader workers when not given: 0 on CPU, a few on CUDA.

    On CPU the data is already uint8 in RAM and a batch costs ~1 ms (gather, crop, convert)
    against ~270 ms for a training step on 2 cores: a worker could hide at most that 1 ms, and
    it takes a core from the model. On CUDA a few workers gather and pin the next batches while
    the GPU computes.
    """
    if device.type != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(4, (cpus or 1) // 2)


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
    """Iterable of `(x, y)` batches on `device`; `len()` is the number of batches per epoch."""

    def __init__(self, split: Split, batch_size: int, *, train: bool, device, seed: int,
                 drop_last: bool | None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.train = train
        self.seed = seed
        # Training drops the ragged last batch: BatchNorm sees full batches and compiled
        # graphs see one shape. Evaluation keeps it, so every sample is scored.
        self.drop_last = train if drop_last is None else drop_last
        self.num_samples = len(split)
        self.epoch, self.skip_batches = 0, 0
        self._epoch_set = True
        # Train batches are cropped out of images stored with their padding already added.
        self.padding = CROP_PADDING if train else 0
        # (x - mean) / std = x * scale + shift, as full (1, 3, 32, 32) channels_last tensors:
        # broadcasting (1, 3, 1, 1) over an innermost dim of 3 takes a ~20x slower path on CPU.
        scale = 1 / torch.tensor(STD, device=self.device)
        shift = -torch.tensor(MEAN, device=self.device) * scale
        shape = (1, IMAGE_SHAPE[1], IMAGE_SHAPE[2], 3)
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
            order = torch.from_numpy(np.random.default_rng([self.seed, self.epoch]).permutation(
                self.num_samples))
        else:
            order = torch.arange(self.num_samples)
        batches = list(order.split(self.batch_size))[: len(self)]
        return batches[self.skip_batches :]

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
    return padded.view(-1, c).index_select(0, pixels).view(n, h, w, c)


class _ArrayDataset(torch.utils.data.Dataset):
    """The whole split as uint8 NHWC in RAM ("disk -> RAM in the Dataset"): no per-sample work."""

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
    """torch DataLoader over the in-RAM array; the uint8 batch is moved, then converted."""

    def __init__(self, split: Split, batch_size: int, *, workers: int | None, **kwargs):
        super().__init__(split, batch_size, **kwargs)
        self.workers = default_workers(self.device) if workers is None else workers
        on_cuda = self.device.type == "cuda"
        self._loader = torch.utils.data.DataLoader(
            _ArrayDataset(self._stored_images(split), split.labels),
            batch_sampler=_EpochBatches(self),
            collate_fn=_whole_batch,
            num_workers=self.workers,
            # Pinned host memory makes the copy below truly asynchronous; only CUDA has it.
            pin_memory=on_cuda,
            # Workers survive between epochs (no re-fork of a process holding the dataset).
            persistent_workers=on_cuda and self.workers > 0,
            # Its own generator: otherwise each epoch's iterator draws its worker base seed from
            # the global torch RNG, shifting the augmentation stream a resumed run must replay.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def __iter__(self):
        self._next_epoch()
        for images, labels in self._loader:
            # uint8 crosses the bus (4x fewer bytes than float32); non_blocking lets the copy
            # overlap with the GPU still computing the previous step.
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            yield self._to_model_input(images), labels


class DeviceResidentLoader(Loader):
    """The whole uint8 split lives on the device; batches are gathered there, nothing crosses
    the bus during training. 3-4.7 KB per image (train images are stored padded): CIFAR-10
    takes ~250 MB."""

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
        for index in order.split(self.batch_size):
            with _one_cpu_thread(self.device):
                images = self.images.index_select(0, index)
                labels = self.labels.index_select(0, index)
            yield self._to_model_input(images), labels


def build_loader(
    split: Split,
    batch_size: int,
    *,
    train: bool,
    device,
    workers: int | None = None,
    gpu_resident: bool = False,
    seed: int = 0,
    drop_last: bool | None = None,
) -> Loader:
    """Return a loader of `(x, y)` on `device`: x float32 normalised channels_last, y int64.

    Train loaders shuffle (order = f(seed, epoch)), augment and drop the last partial batch.
    `gpu_resident=True` keeps the whole split on `device` (see `fits_on_device`); otherwise a
    DataLoader with `workers` processes (None: `default_workers(device)`).
    """
    common = dict(train=train, device=device, seed=seed, drop_last=drop_last)
    if gpu_resident:
        return DeviceResidentLoader(split, batch_size, **common)
    return DataLoaderLoader(split, batch_size, workers=workers, **common)


def fits_on_device(split_sizes, device, *, max_fraction: float = 0.25) -> bool:
    """Whether the splits can live on `device` (for `--gpu-resident auto`).

    `split_sizes`: a mapping or iterable of `Split`s, or of sample counts. On CUDA the uint8
    images must take at most `max_fraction` of the free memory (the rest is for the model);
    on the CPU the data is in RAM already, so the answer is True.
    """
    device = torch.device(device)
    if isinstance(split_sizes, Mapping):
        split_sizes = split_sizes.values()
    samples = sum(s if isinstance(s, int) else len(s) for s in split_sizes)
    padded_pixels = 3 * (IMAGE_SHAPE[1] + 2 * CROP_PADDING) * (IMAGE_SHAPE[2] + 2 * CROP_PADDING)
    needed = samples * (padded_pixels + 8)  # uint8 pixels as stored for training + int64 label
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return needed <= max_fraction * free
    return False
