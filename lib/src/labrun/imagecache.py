"""The decoded cache: a split of image files decoded once, by every core, memory-mapped.

    split = decode_cached(file_split, data_dir, version=data_version, notes=notes)  # loaders.Split

The images are decoded (imagefolder.decode_image: oriented, converted, resized to the training
resolution) into `<data_dir>/decoded-<key>.npy`, uint8 (N, H, W, C), and read back memory-mapped:
the jobs of a project (and the ranks of a DDP job) on one machine share its pages in the page
cache, and a cache larger than RAM still works (the page cache holds what fits). It stores no
crop margin: random crops pad with zeros on the device (augment.DeviceTransform).

`key` hashes the dataset's fingerprint (dataversion.data_version), the split's files, the
decoded shape and value ranges: another version of the folder or another --image-size is
another cache. Decoding is split into chunks of CHUNK_IMAGES images decoded by a pool of
processes, each writing its rows in place into `decoded-<key>.partial.npy`; a chunk counts as
done once its checksum is in `decoded-<key>.chunks`, after its rows are flushed. A killed decode
resumes at the next start with the chunks not done; the finished file is renamed into place and
the checksums become `decoded-<key>.sums`. All of it under a file lock: jobs that start together
decode once, the others wait and read. Delete the files `decoded-*` in --data-dir to free the
space; the next start decodes again.

Trust (README, "Use your own data"): the key can be computed by anyone who can read the folder,
so every file of the cache is created under a private random name (O_EXCL, no link followed) and
renamed into place, and opened without following a link; one that is a link, another user's or
hard-linked is not used (removed, named in `notes`, and decoded again). Every job checks the
checksum of every chunk when it first maps the cache: a damaged cache (zeroed or random pixels)
is decoded again, with a note, never trained on.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import math
import multiprocessing
import os
import resource
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import torch

from .augment import one_cpu_thread
from .dataversion import file_lock
from .imagefolder import UnreadableImage, decode_image
from .loaders import FileSplit, Split, available_cpus, worker_init, workers_started_safely
from .runs import atomic_path, open_own, size_text

CHUNK_IMAGES = 256  # images per task of a decoding process (and per checksum)
PROGRESS_EVERY_S = 10.0  # the progress line, when not on a terminal: at most this often
# In the key: change it when the layout of the file or the decoded pixels change (v2: the
# resize is torch's, imagefolder.cover_resize; v3: an RGB or grey image's transparent colour,
# PNG tRNS, shows white as every other transparency does).
FORMAT = "nhwc-uint8-v3"
DIGEST_BYTES = 16  # sha256 per chunk, cut; all zeros in the .chunks file: the chunk is not done

Progress = Callable[[int, int], None]  # (chunks done, chunks in all), after every chunk


class DecodeWorkerDied(RuntimeError):
    """A decoding process died (the OOM killer, most often): a failure of the machine, not bad
    input (run.py: exit 1, not 2); the decode resumes with the chunks not done."""


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
    notes: list[str] | None = None,
) -> Split:
    """`split` decoded once into its cache (see the module's docstring), memory-mapped.

    `processes`: decoding processes (None: every core this process may use). `progress`:
    called after every chunk (None: a progress bar on stderr). `notes`: gets one line per
    cache file not used (a link, another user's, damaged), for run.log. Raises UnreadableImage
    naming a file that does not decode, ValueError (one line) for a cache that cannot be
    written, DecodeWorkerDied when a decoding process is killed.
    """
    notes = [] if notes is None else notes
    cache = cache_path(split, data_dir, version)
    c, h, w = split.image_shape
    shape = (len(split), h, w, c)
    with file_lock(cache):
        images, why = _map_verified(cache, shape)
        if images is None:
            if why is not None:  # never trained on: removed (the name only) and decoded again
                notes.append(f"decoded cache {cache} {why}: not used, decoded again")
                for path in (cache, _sums(cache)):
                    _discard(path, why)
            _decode(split, cache, shape, processes or available_cpus(), progress, notes)
            images, why = _map_verified(cache, shape)
            if images is None:
                raise ValueError(f"decoded cache {cache} {why} right after its decode; delete it")
    nchw = torch.from_numpy(images).permute(0, 3, 1, 2)  # channels_last: no copy
    return Split(nchw, split.labels, torch.arange(len(split)))


def cache_fits(split: FileSplit, data_dir: Path, version: str | None = None) -> str | None:
    """Why `split`'s cache cannot be used here (None: it can): disk space, file-size limit."""
    cache = cache_path(split, data_dir, version)
    if cache.exists() and _untrusted(cache) is None:
        return None
    need = len(split) * math.prod(split.image_shape)
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY and need > limit:
        return f"its decoded cache ({size_text(need)}) is larger than {_fsize_limit()}"
    parent = cache.parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    partial = _partial(cache)
    if partial.exists() and _untrusted(partial) is None:  # a decode to resume: space taken
        free += partial.stat().st_size
    if need > free:
        return f"its decoded cache needs {size_text(need)}, {size_text(free)} free"
    return None


def _fsize_limit() -> str:
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return f"the file-size limit (ulimit -f: {size_text(limit)})"


def _partial(cache: Path) -> Path:
    return cache.with_name(cache.stem + ".partial.npy")


def _sums(cache: Path) -> Path:
    return cache.with_suffix(".sums")


def _digest(rows: np.ndarray) -> bytes:
    # sha256: hardware-accelerated on x86 (SHA-NI) and ARMv8, 2x blake2b's speed there.
    return hashlib.sha256(np.ascontiguousarray(rows).data).digest()[:DIGEST_BYTES]


def _read(path: Path) -> bytes:
    with os.fdopen(open_own(path, os.O_RDONLY), "rb") as f:
        return f.read()


def _map(path: Path, shape, mode: str) -> np.memmap:
    """The uint8 array of `shape` in our .npy file at `path` (open_own: no link followed),
    mapped; OSError if the file is not ours, ValueError if it holds anything else."""
    with os.fdopen(open_own(path, os.O_RDWR if mode == "r+" else os.O_RDONLY), "rb") as f:
        np.lib.format.read_magic(f)
        found, fortran, dtype = np.lib.format.read_array_header_1_0(f)  # what _decode writes
        if (tuple(found), fortran, dtype) != (tuple(shape), False, np.uint8):
            raise ValueError(f"holds {dtype} {tuple(found)}, not uint8 {tuple(shape)}")
        # A short file fails to map (ValueError); the mapping keeps its own reference to the
        # file, which may be closed after this.
        return np.memmap(f, dtype=np.uint8, mode=mode, shape=tuple(shape), offset=f.tell())


def _map_verified(cache: Path, shape) -> tuple[np.ndarray | None, str | None]:
    """(the cache mapped copy-on-write, None) when it is ours and every chunk matches its
    checksum; (None, why not) otherwise; (None, None) when there is no cache."""
    try:
        # Copy-on-write ("c"): pages are read from the shared page cache; a write (none is
        # made) would stay private instead of faulting on a read-only mapping.
        images = _map(cache, shape, "c")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, _untrusted(cache) or f"is unreadable ({e})"
    try:
        sums = _read(_sums(cache))
    except OSError as e:
        why = _untrusted(_sums(cache)) or f"cannot be read ({e.strerror})"
        return None, f"has checksums {_sums(cache).name} that {why}"
    chunks = -(-len(images) // CHUNK_IMAGES)  # sums of another size: chunks that do not match

    def damaged(i: int) -> bool:
        rows = images[i * CHUNK_IMAGES : (i + 1) * CHUNK_IMAGES]
        return _digest(rows) != sums[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]

    # hashlib releases the GIL on large buffers: the chunks are checked on every core.
    with ThreadPoolExecutor(available_cpus()) as pool:
        bad = [i for i, wrong in enumerate(pool.map(damaged, range(chunks))) if wrong]
    if bad:
        first = bad[0] * CHUNK_IMAGES
        return None, (
            f"does not match its checksums in {len(bad)} of {chunks} chunk(s) (first: images "
            f"{first}-{min(first + CHUNK_IMAGES, len(images)) - 1}): damaged"
        )
    return images, None


def _discard(path: Path, why: str | None) -> None:
    """Remove the name `path` (a link is removed, never its target); ValueError if we may not."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(
            f"--data-dir: {path} {why or 'is not usable'} and cannot be removed ({e.strerror}); "
            "remove it, or use another --data-dir"
        ) from e


def _create(path: Path, head: bytes, size: int) -> None:
    """`path` of `size` bytes starting with `head`, its blocks reserved: a full disk fails here,
    not later as SIGBUS in a process writing through the mapping. Made under a private random
    name (mkstemp: O_EXCL; opened again without following a link) and renamed into place:
    nothing planted at `path` is ever written through."""
    with atomic_path(path) as tmp:
        fd = open_own(tmp, os.O_RDWR)
        try:
            os.write(fd, head)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # cannot reserve: sparse
                    raise
                os.ftruncate(fd, size)
        finally:
            os.close(fd)


def _allocate(partial: Path, shape) -> None:
    """The .npy file of `shape` at `partial`, its blocks reserved; ValueError (one line) if
    the disk or the file-size limit cannot hold it."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": "|u1", "fortran_order": False, "shape": shape}
    )
    try:
        _create(partial, head.getvalue(), len(head.getvalue()) + math.prod(shape))
    except OSError as e:
        why, fix = e.strerror, "free space"
        if e.errno == errno.EFBIG:
            why, fix = f"larger than {_fsize_limit()}", "raise the limit"
        raise ValueError(
            f"--data-dir: cannot write the decoded cache {partial} "
            f"({size_text(math.prod(shape))}): {why}; {fix}, or use --data-mode stream"
        ) from e


def _decode(split: FileSplit, cache: Path, shape, processes: int, progress, notes) -> None:
    partial, marks_path = _partial(cache), cache.with_suffix(".chunks")
    chunks = -(-len(split) // CHUNK_IMAGES)
    try:  # the checksums of an interrupted decode of this cache: it resumes
        marks = _read(marks_path)
        _map(partial, shape, "r")
        if len(marks) != chunks * DIGEST_BYTES:
            raise ValueError(f"{marks_path} holds {len(marks)} bytes")
    except (OSError, ValueError):  # none, a link, not ours, another shape: start afresh
        for path in (partial, marks_path):
            why = _untrusted(path)
            if why is not None:
                notes.append(f"decoded cache file {path} {why}: removed")
            _discard(path, why)
        _allocate(partial, shape)
        _create(marks_path, b"", chunks * DIGEST_BYTES)  # zeros: no chunk done
        marks = bytes(chunks * DIGEST_BYTES)
    todo = [i for i in range(chunks) if not any(marks[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES])]
    done, bar = chunks - len(todo), None
    if progress is None:  # tqdm: rewritten in place on a terminal, a line now and then in a log
        from tqdm import tqdm

        bar = tqdm(
            desc=f"decoding once into {cache} ({processes} process(es))",
            total=len(split),
            initial=min(done * CHUNK_IMAGES, len(split)),
            unit="img",
            mininterval=0.5 if sys.stderr.isatty() else PROGRESS_EVERY_S,
        )
        progress = functools.partial(_advance, bar, len(split))
    paths, decoded = list(split.paths), (split.image_shape, split.value_ranges)
    tasks = [
        (str(partial), shape, i, paths[i * CHUNK_IMAGES : (i + 1) * CHUNK_IMAGES], decoded)
        for i in todo
    ]
    marks_fd = open_own(marks_path, os.O_RDWR)
    try:
        for i, unreadable, digest in _run(tasks, min(processes, len(tasks))):
            if unreadable is not None:  # the folder changed since its scan: the next start
                partial.unlink()  # scans a new version, whose cache has another key
                marks_path.unlink()
                raise UnreadableImage(*unreadable)
            # The chunk's rows are flushed (by its process) before its checksum is written.
            os.pwrite(marks_fd, digest, i * DIGEST_BYTES)
            done += 1
            progress(done, chunks)
        os.fsync(marks_fd)
    finally:
        os.close(marks_fd)
        if bar is not None:
            bar.close()
    os.replace(marks_path, _sums(cache))  # the checksums first: a cache never lacks them
    os.replace(partial, cache)


def _untrusted(path: Path) -> str | None:
    """Why the file at `path` must not be used (a link, another user's, hard-linked), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if os.path.islink(path):
        return "is a symbolic link (a cache file is never read or written through a link)"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return None


def _advance(bar, images: int, done: int, _chunks: int) -> None:
    bar.update(min(done * CHUNK_IMAGES, images) - bar.n)


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
        raise DecodeWorkerDied(
            "a process decoding images died (killed: out of memory?); give the job more "
            "memory or fewer --workers, or use --data-mode stream, and run again: the decode "
            "resumes with the chunks not done"
        ) from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _decode_chunk(task) -> tuple[int, tuple[str, str] | None, bytes | None]:
    """(chunk, None or (path, reason), checksum of its rows once flushed)."""
    path, shape, chunk, paths, ((channels, height, width), value_ranges) = task
    images = _map(Path(path), shape, "r+")
    start = chunk * CHUNK_IMAGES
    # One thread per process (the pool has one process per core; processes=1 decodes here).
    with one_cpu_thread(torch.device("cpu")):
        for row, file in enumerate(paths, start):
            try:
                images[row] = decode_image(file, (height, width), channels, value_ranges)
            except UnreadableImage as e:  # to the main process as a value: it names the file
                return chunk, (e.path, e.reason), None
    images.flush()
    return chunk, None, _digest(images[start : start + len(paths)])
