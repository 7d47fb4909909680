"""The decoded cache: a split of image files decoded once, by every core, memory-mapped.

    split = decode_cached(file_split, data_dir, version=data_version, notes=notes)  # loaders.Split

The images are decoded (imagefolder.decode_image: oriented, converted, resized to the training
resolution) into `<data_dir>/decoded-<key>.npy`, uint8 (N, H, W, C), and read back memory-mapped:
the jobs of a project (and the ranks of a DDP job) on one machine share its pages in the page
cache, and a cache larger than RAM still works (the page cache holds what fits). It stores no
crop margin: random crops pad with zeros on the device (augment.DeviceTransform).

`key` hashes the dataset's version, the split's files, the decoded shape and value ranges:
another version of the folder or another --image-size is another cache. Chunks of CHUNK_IMAGES
images are decoded in order by the streaming loader's workers into `decoded-<key>.partial.npy`,
one checksum per chunk appended after the pixels (np.load reads past them), and the finished
file renamed into place, under a file lock: jobs that start together decode once. Delete the
files `decoded-*` in --data-dir to free the space.

Trust (README, "Use your own data"): anyone who can read the folder can compute the key, so the
partial file is created anew (O_EXCL) and the cache opened without following a link; one that
is a link, another user's or hard-linked is not used (named in `notes`, decoded again), nor is
one whose checksums fail when a job first maps it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .dataversion import file_lock
from .loaders import FileSplit, Loader, Split, available_cpus
from .runs import ForeignFile, open_own, size_text

CHUNK_IMAGES = 256  # images per task of a decoding process (and per checksum)
# In the key: change it when the layout of the file or the decoded pixels change (v2: the
# resize is torch's, imagefolder.cover_resize; v3: an RGB or grey image's transparent colour,
# PNG tRNS, shows white as every other transparency does; v4: the checksums after the pixels).
FORMAT = "nhwc-uint8-v4"


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
    progress: Callable[[int, int], None] | None = None,
    notes: list[str] | None = None,
) -> Split:
    """`split` decoded once into its cache, memory-mapped. `processes`: decoding processes
    (None: every core this process may use); `progress(done, chunks)` after every chunk (None:
    a bar on stderr); `notes` gets one line per cache not used. Raises UnreadableImage, ValueError
    for a cache that cannot be written, RuntimeError when a decoding process is killed (the OOM
    killer, most often: a failure of the machine, not bad input; run.py: exit 1, not 2)."""
    cache = cache_path(split, data_dir, version)
    c, h, w = split.image_shape
    shape = (len(split), h, w, c)
    with file_lock(cache):
        images, why = _map_verified(cache, shape)
        if images is None:
            if why is not None and notes is not None:  # never trained on: decoded again
                notes.append(f"decoded cache {cache} {why}: not used, decoded again")
            _decode(split, cache, shape, processes or available_cpus(), progress)
            images, why = _map_verified(cache, shape)
            if images is None:
                raise ValueError(f"decoded cache {cache} {why} right after its decode; delete it")
    nchw = torch.from_numpy(images).permute(0, 3, 1, 2)  # channels_last: no copy
    return Split(nchw, split.labels, torch.arange(len(split)))


def _digest(rows: np.ndarray) -> bytes:
    # sha256: hardware-accelerated on x86 (SHA-NI) and ARMv8, 2x blake2b's speed there.
    return hashlib.sha256(np.ascontiguousarray(rows).data).digest()[:16]  # 16 bytes: enough


def _map_verified(cache: Path, shape) -> tuple[np.ndarray | None, str | None]:
    """(the cache mapped copy-on-write, None) when it is ours and every chunk matches its
    checksum; (None, why not) otherwise; (None, None) when there is no cache."""
    try:
        with os.fdopen(open_own(cache, os.O_RDONLY), "rb") as f:  # no link followed
            np.lib.format.read_magic(f)
            found, fortran, dtype = np.lib.format.read_array_header_1_0(f)  # as _decode wrote
            if (tuple(found), fortran, dtype) != (shape, False, np.uint8):
                raise ValueError(f"holds {dtype} {tuple(found)}, not uint8 {shape}")
            # Copy-on-write ("c"): pages are read from the shared page cache; a write (none is
            # made) would stay private instead of faulting on a read-only mapping. A short
            # file fails to map (ValueError).
            start = f.tell()
            images = np.memmap(f, dtype=np.uint8, mode="c", shape=shape, offset=start)
            f.seek(start + images.nbytes)
            sums = f.read()
    except FileNotFoundError:
        return None, None
    except ForeignFile:  # open_own takes only a plain file of ours with one link
        return None, "is another user's, hard-linked or not a plain file"
    except (OSError, ValueError) as e:  # open_own follows no link: ELOOP
        link = isinstance(e, OSError) and e.errno == errno.ELOOP
        return None, "is a symbolic link" if link else f"is unreadable ({e})"
    chunks = [images[i : i + CHUNK_IMAGES] for i in range(0, len(images), CHUNK_IMAGES)]
    # hashlib releases the GIL on large buffers: the chunks are checked on every core.
    with ThreadPoolExecutor(available_cpus()) as pool:
        if b"".join(pool.map(_digest, chunks)) != sums:
            return None, "does not match its checksums: damaged"
    return images, None


def _decode(split: FileSplit, cache: Path, shape, processes: int, progress) -> None:
    from tqdm import tqdm  # here: --help never needs it

    partial = cache.with_name(cache.stem + ".partial.npy")
    # The streaming loader's workers decode the chunks, in order (processes <= 1: this one);
    # as in training, a group SIGINT/SIGTERM (Ctrl-C, Slurm) is left to this process, and a
    # worker that dies (the OOM killer) is an error (RuntimeError), never a wait for its chunk.
    workers = processes if processes > 1 else 0
    loader = Loader(split, CHUNK_IMAGES, train=False, device="cpu", workers=workers, augment=False)
    # tqdm: rewritten in place on a terminal, a line now and then (10 s) in a log.
    bar = tqdm(
        desc=f"decoding once into {cache} ({max(1, workers)} process(es))",
        total=len(split),
        unit="img",
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
        disable=progress is not None,
    )
    try:
        partial.unlink(missing_ok=True)  # a killed decode's (or a planted link: not its target)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(partial, flags, 0o666), "wb") as f:
            header = {"descr": "|u1", "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(f, header)
            sums = []
            for done, (images, _) in enumerate(loader.raw_batches(), 1):
                rows = images.numpy()  # uint8 (N, H, W, C), contiguous
                f.write(rows.data)  # buffered: a short write (ulimit -f) is retried, raises
                sums.append(_digest(rows))
                bar.update(len(rows))
                if progress is not None:
                    progress(done, len(loader))
            f.write(b"".join(sums))
        os.replace(partial, cache)  # replaces a name planted there, never writes through it
    except OSError as e:  # a full disk, ulimit -f, another user's file in the way
        raise ValueError(
            f"--data-dir: cannot write the decoded cache {cache} ({size_text(math.prod(shape))})"
            f": {e.strerror}; free space (or raise ulimit -f), or use --data-mode stream"
        ) from e
    finally:
        loader.close()  # its workers end now, whatever happened
        bar.close()
        with contextlib.suppress(OSError):  # an unreadable image, a failure: nothing left
            os.unlink(partial)
