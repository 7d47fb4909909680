"""The decoded cache: a split of image files decoded once, by every core, memory-mapped.

    split = decode_cached(file_split, data_dir, version=data_version)   # -> loaders.Split

The images are decoded (imagefolder.decode_image: oriented, converted, resized to the training
resolution) into `<data_dir>/decoded-<key>.npy`, uint8 (N, H, W, C), and read back memory-mapped:
the jobs of a project (and the ranks of a DDP job) on one machine share its pages in the page
cache, and a cache larger than RAM still works (the page cache holds what fits). It stores no
crop margin: random crops pad with zeros on the device (augment.DeviceTransform).

`key` hashes the dataset's fingerprint (dataversion.data_version), the split's files, the
decoded shape and value ranges: another version of the folder or another --image-size is
another cache. Decoding is split into chunks of CHUNK_IMAGES images decoded by a pool of
processes, each writing its rows in place into `decoded-<key>.partial.npy`; a chunk counts as
done once its byte in `decoded-<key>.chunks` is set, after its rows are flushed. A killed decode
resumes at the next start with the chunks not done; the finished file is renamed into place.
All of it under a file lock: jobs that start together decode once, the others wait and read.
Delete the files `decoded-*` in --data-dir to free the space; the next start decodes again.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import torch

from .dataversion import file_lock
from .imagefolder import UnreadableImage, decode_image
from .loaders import FileSplit, Split, available_cpus, worker_init, workers_started_safely

CHUNK_IMAGES = 256  # images per task of a decoding process (and per done-marker)
PROGRESS_EVERY_S = 10.0  # the progress line, when not on a terminal: at most this often
FORMAT = "nhwc-uint8-v1"  # in the key: change it when the layout of the file changes

Progress = Callable[[int, int], None]  # (chunks done, chunks in all), after every chunk


def cache_path(split: FileSplit, data_dir: Path, version: str | None = None) -> Path:
    """Where `split`'s decoded cache lives (it may not exist yet)."""
    if version is None:  # files not versioned by the caller: their sizes and mtimes
        version = repr([(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in split.paths])
    layout = (FORMAT, split.image_shape, sorted((split.value_ranges or {}).items()))
    key = hashlib.sha256(repr((version, list(split.paths), layout)).encode()).hexdigest()[:16]
    return Path(data_dir) / f"decoded-{key}.npy"


def decode_cached(
    split: FileSplit,
    data_dir: Path,
    *,
    version: str | None = None,
    processes: int | None = None,
    progress: Progress | None = None,
) -> Split:
    """`split` decoded once into its cache (see the module's docstring), memory-mapped.

    `processes`: decoding processes (None: every core this process may use). `progress`:
    called after every chunk (None: a progress line on stderr). Raises UnreadableImage naming
    a file that does not decode, ValueError (one line) for a cache that cannot be written.
    """
    cache = cache_path(split, data_dir, version)
    c, h, w = split.image_shape
    shape = (len(split), h, w, c)
    with file_lock(cache):
        if not cache.exists():
            _decode(split, cache, shape, processes or available_cpus(), progress)
        try:
            # Copy-on-write ("c"): pages are read from the shared page cache; a write (none is
            # made) would stay private instead of faulting on a read-only mapping.
            images = np.load(cache, mmap_mode="c")
        except (OSError, ValueError) as e:
            raise ValueError(f"decoded cache {cache} is unreadable ({e}); delete it") from e
    if images.shape != shape:
        raise ValueError(f"decoded cache {cache} has shape {images.shape}; delete it and rerun")
    nchw = torch.from_numpy(images).permute(0, 3, 1, 2)  # channels_last: no copy
    return Split(nchw, split.labels, torch.arange(len(split)))


def cache_fits(split: FileSplit, data_dir: Path, version: str | None = None) -> str | None:
    """Why `split`'s cache cannot be used here (None: it can): disk space, address space."""
    cache = cache_path(split, data_dir, version)
    if cache.exists():
        return None
    c, h, w = split.image_shape
    need = len(split) * c * h * w
    free = shutil.disk_usage(_existing_parent(cache)).free
    partial = _partial(cache)
    if partial.exists():  # a decode to resume: its space is already taken
        free += partial.stat().st_size
    if need > free:
        return f"its decoded cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _partial(cache: Path) -> Path:
    return cache.with_name(cache.stem + ".partial.npy")


def _decode(split: FileSplit, cache: Path, shape, processes: int, progress) -> None:
    partial, marks_path = _partial(cache), cache.with_suffix(".chunks")
    chunks = -(-len(split) // CHUNK_IMAGES)
    marks = _resumable_marks(partial, marks_path, shape, chunks)
    if marks is None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _allocate(partial, shape)
        marks = bytearray(chunks)
        marks_path.write_bytes(marks)
    todo = [i for i in range(chunks) if not marks[i]]
    report = progress or _ProgressLine(len(split), cache, processes, chunks - len(todo))
    paths, decoded = list(split.paths), (split.image_shape, split.value_ranges)
    tasks = [
        (str(partial), i, paths[i * CHUNK_IMAGES : (i + 1) * CHUNK_IMAGES], decoded) for i in todo
    ]
    with open(marks_path, "r+b") as marks_file:
        for i, unreadable in _run(tasks, min(processes, len(tasks))):
            if unreadable is not None:  # the folder changed since its scan: the next start
                partial.unlink()  # scans a new version, whose cache has another key
                marks_path.unlink()
                raise UnreadableImage(*unreadable)
            # The chunk's rows are flushed (by its process) before its mark is set.
            os.pwrite(marks_file.fileno(), b"\1", i)
            marks[i] = 1
            report(sum(marks), chunks)
    os.replace(partial, cache)
    marks_path.unlink()


def _resumable_marks(partial: Path, marks_path: Path, shape, chunks: int) -> bytearray | None:
    """The done-markers of an interrupted decode of this cache, or None (start afresh)."""
    try:
        marks = bytearray(marks_path.read_bytes())
        same = np.load(partial, mmap_mode="r").shape == shape
    except (OSError, ValueError):
        return None
    return marks if same and len(marks) == chunks else None


def _allocate(path: Path, shape) -> None:
    """The .npy file at its full size, its blocks reserved: a full disk fails here, with a
    message, not later as SIGBUS in a process writing through the mapping."""
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
    del images
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as e:
            if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: the file system cannot reserve
                path.unlink(missing_ok=True)
                need = np.prod(shape) / 2**30
                raise ValueError(
                    f"--data-dir: cannot write the decoded cache {path} ({need:.1f} GiB): "
                    f"{e.strerror}; free space, or use --data-mode stream"
                ) from e


def _run(tasks, processes: int):
    """(chunk, None or (path, reason)) for every task, in the order they finish."""
    if processes <= 1:
        yield from map(_decode_chunk, tasks)
        return
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    # As the loader's workers: a group SIGINT/SIGTERM (Ctrl-C, Slurm) is left to the main
    # process, and the main process's own TERM or its death ends them. A process that dies
    # anyway (the OOM killer) breaks the pool: an error, never a wait for its lost chunk.
    with workers_started_safely():  # the processes start (fork) at the first submit
        pool = ProcessPoolExecutor(
            processes, mp_context=context, initializer=worker_init, initargs=(0,)
        )
        futures = [pool.submit(_decode_chunk, task) for task in tasks]
    try:
        for future in as_completed(futures):
            yield future.result()
    except BrokenProcessPool as e:
        raise ValueError(
            "a process decoding images died (killed, out of memory?); run again: the decode "
            "resumes with the chunks not done"
        ) from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _decode_chunk(task) -> tuple[int, tuple[str, str] | None]:
    path, chunk, paths, ((channels, height, width), value_ranges) = task
    images = np.load(path, mmap_mode="r+")
    start = chunk * CHUNK_IMAGES
    for row, file in enumerate(paths, start):
        try:
            images[row] = decode_image(file, (height, width), channels, value_ranges)
        except UnreadableImage as e:  # to the main process as a value: it names the file
            return chunk, (e.path, e.reason)
    images.flush()
    return chunk, None


class _ProgressLine:
    """`decoding N images into CACHE (P processes): 37% (..., ... img/s)` on stderr: rewritten
    in place on a terminal, a new line at most every PROGRESS_EVERY_S in a log file."""

    def __init__(self, images: int, cache: Path, processes: int, done: int):
        self.images, self.start, self.last = images, time.monotonic(), 0.0
        self.first_done = done
        self.tty = sys.stderr.isatty()
        resumed = f", resuming after {done} chunk(s) done" if done else ""
        print(
            f"decoding {images} images once into {cache} "
            f"({processes} process{'es' if processes > 1 else ''}{resumed})",
            file=sys.stderr,
            flush=True,
        )

    def __call__(self, done: int, chunks: int) -> None:
        now = time.monotonic()
        if done < chunks and now - self.last < (0.5 if self.tty else PROGRESS_EVERY_S):
            return
        self.last = now
        images = min(done * CHUNK_IMAGES, self.images)
        rate = (done - self.first_done) * CHUNK_IMAGES / max(now - self.start, 1e-9)
        line = f"decoded {images}/{self.images} images ({100 * done // chunks}%, {rate:.0f} img/s)"
        end = "\n" if done == chunks or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)
