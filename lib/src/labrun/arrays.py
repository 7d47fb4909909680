"""The built-in array datasets' data: digits (offline), synthetic, CIFAR-10 (downloaded).

Each function returns `(train, test)`, every split `(uint8 images (N, C, H, W), int64 labels)`,
decoded once into an .npz in --data-dir (written atomically, under a lock: the jobs of a sweep
that start together decode it once). datasets.py registers them; data.load_dataset carves val.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import shutil
import tarfile
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .dataversion import file_lock as _lock
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


DIGITS_CACHE = "digits_32px.npz"  # the decoded arrays below; rename it when they change


def load_digits_arrays(data_dir: Path) -> tuple:
    """scikit-learn's 1797 handwritten digits (ships with the package: works offline), read
    without importing scikit-learn (2.6 s); later jobs read 5.5 MB of cached arrays."""
    try:
        return _cached(Path(data_dir) / DIGITS_CACHE, _decode_digits)
    except OSError:  # a read-only or full data dir: decode in memory
        return _pairs(_decode_digits())


def _decode_digits() -> dict[str, np.ndarray]:
    rows = _read_digits_csv()  # 64 intensities 0..16 and the label, per row
    labels = rows[:, -1].astype(np.int64)
    # 8x8 intensities 0..16 -> 32x32 uint8, grey repeated to 3 channels to look like CIFAR.
    small = torch.from_numpy(rows[:, :-1].reshape(-1, 1, 8, 8)).float() * (255 / 16)
    big = F.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)
    images = big.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    test_idx = stratified_test_rows(labels, TEST_FRACTION, TEST_SPLIT_SEED)
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return {
        "train_images": images.numpy()[train_idx],
        "train_labels": labels[train_idx],
        "test_images": images.numpy()[test_idx],
        "test_labels": labels[test_idx],
    }


def _read_digits_csv() -> np.ndarray:
    """sklearn/datasets/data/digits.csv.gz, what sklearn.datasets.load_digits reads, found
    without importing scikit-learn (find_spec of a top-level package only locates it)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits dataset ships with scikit-learn: install it")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


def stratified_test_rows(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """The rows, sorted, that scikit-learn's `train_test_split(rows, test_size=test_fraction,
    stratify=labels, random_state=seed)` puts in test: the same draws from the same legacy
    RandomState stream (its StratifiedShuffleSplit and _approximate_mode), so digits keeps the
    split (and test set) it always had. The draws that only order the result are left out."""
    n_test = math.ceil(test_fraction * len(labels))
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_train = _approximate_mode(counts, len(labels) - n_test, rng)
    n_tested = _approximate_mode(counts - n_train, n_test, rng)
    test = [
        rows.take(rng.permutation(count), mode="clip")[train : train + tested]
        for rows, count, train, tested in zip(by_class, counts, n_train, n_tested, strict=True)
    ]
    return np.sort(np.concatenate(test))


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng) -> np.ndarray:
    """scikit-learn's: draws per class in proportion, floored; the left-over draws go to the
    largest remainders, ties broken by `rng`."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def load_synthetic_arrays(data_dir: Path, size: int, task: str = "classification") -> tuple:
    """Learnable CIFAR-shaped data: one smooth random pattern per class, shifted, plus noise:
    `size` training and size // 5 test images from a fixed seed, so every job of a sweep reads
    identical bytes; targets as `task` takes them (synthetic_targets)."""
    if size < SYNTHETIC_CLASSES:
        raise ValueError(f"--synthetic-size must be >= {SYNTHETIC_CLASSES}, got {size}")
    pairs = _cached(Path(data_dir) / f"synthetic_{size}.npz", lambda: _generate_synthetic(size))
    return tuple((images, synthetic_targets(labels, task)) for images, labels in pairs)


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


def _generate_synthetic(n_train: int) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    shape = CIFAR10_SHAPE
    # Low-frequency prototypes (8x8 noise upsampled): classes differ in colour and layout.
    prototypes = F.interpolate(
        torch.rand(SYNTHETIC_CLASSES, 3, 8, 8, generator=gen), size=shape[1:], mode="bicubic"
    )
    arrays = {}
    for split, n in (("train", n_train), ("test", max(n_train // 5, 1))):
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


def load_cifar10_arrays(data_dir: Path) -> tuple:
    """CIFAR-10 from the official tarball: downloaded once, md5-checked, cached as .npz."""
    return _cached(Path(data_dir) / CIFAR10_CACHE, lambda: _fetch_cifar10(Path(data_dir)))


def _fetch_cifar10(data_dir: Path) -> dict[str, np.ndarray]:
    """The tarball downloaded once (written atomically: a killed download leaves nothing),
    md5-checked (a corrupt one is deleted, never cached) and read as arrays."""
    tarball = data_dir / CIFAR10_TARBALL
    if not tarball.exists():
        print(f"downloading {CIFAR10_URL} -> {tarball}", flush=True)
        try:
            with (
                atomic_path(tarball) as tmp,
                open(tmp, "wb") as out,
                urllib.request.urlopen(CIFAR10_URL, timeout=60) as response,
            ):
                shutil.copyfileobj(response, out, 1 << 20)
        except OSError as e:  # URLError, timeouts, a full disk
            raise ValueError(
                f"could not download {CIFAR10_URL} ({e}); on an offline machine, copy the file "
                f"to {tarball}"
            ) from e
    with open(tarball, "rb") as f:
        md5 = hashlib.file_digest(f, "md5").hexdigest()
    try:  # a file of other sizes fails its reshape: never cached
        if md5 != CIFAR10_MD5:
            raise ValueError(f"corrupt or partial: md5 {md5}, expected {CIFAR10_MD5}")
        return _extract_cifar10(tarball)
    # Past the md5, only a tarball other than CIFAR-10's (CIFAR10_MD5 pointed at it) fails:
    # not a tarball, a member missing (KeyError) or a folder (pickle.load(None)), other sizes
    except (tarfile.TarError, KeyError, TypeError, ValueError) as e:
        tarball.unlink()
        raise ValueError(
            f"{tarball} could not be read as CIFAR-10 ({e}); deleted it, run again"
        ) from e


def _extract_cifar10(tarball: Path) -> dict[str, np.ndarray]:
    arrays = {}
    names = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    with tarfile.open(tarball, "r:gz") as tar:
        for split, batches in names.items():
            images, labels = [], []
            for name in batches:
                # Our own md5-verified download, so unpickling it is safe.
                member = tar.extractfile(f"cifar-10-batches-py/{name}")  # None: a folder
                batch = pickle.load(member, encoding="bytes")
                images.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, *CIFAR10_SHAPE))
                labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
            arrays[f"{split}_images"] = np.concatenate(images)
            arrays[f"{split}_labels"] = np.concatenate(labels)
    return arrays


def _cached(path: Path, make) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The (train, test) arrays cached in the .npz `path`, made by `make()` the first time (as
    the module's docstring says)."""
    with _lock(path):
        if not path.exists():
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, **make())  # uncompressed: loading 180 MB of CIFAR takes ~0.1 s
    try:
        with np.load(path) as f:
            return _pairs(f)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cached dataset {path} is unreadable ({e}); delete it and rerun") from e


def _pairs(arrays) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    return tuple((arrays[f"{s}_images"], arrays[f"{s}_labels"]) for s in ("train", "test"))
