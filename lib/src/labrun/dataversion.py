"""The version of the user's data (`--data-path`): part of the run's identity. Imports no torch.

A dataset of files is versioned by a fingerprint: sha256 over every file's relative path, size
and modification time (hidden files and folders, whose names start with ".", are left out, as
the folder scan leaves them out). run.py, `--print-run-dir` and the sweep's planner compute it
for every job, so it must stay cheap for a million files: the full fingerprint is computed once
and cached in --data-dir together with the modification times of every directory it walked; a
later check only stats those directories (no listing, no file) and reuses the cached fingerprint
while none changed. Adding, removing or renaming a file changes its directory's mtime.

Not seen by the cheap check (README, "Use your own data"): a file rewritten in place, keeping
its name (its directory's mtime stays). After such an edit, `touch DIR/train` (any folder
above the edited file) or delete --data-dir/data-version-*.json: the next start recomputes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_PREFIX = "data-version-"
VERSION_PREFIX = "files:"
CHECK_PREFIX = "image-check-"  # imagefolder.py's cached check of every image, per version


def data_version(root: Path, cache_dir: Path) -> str:
    """`files:<16 hex>` for the file or folder `root`; ValueError (one line) if it is missing
    or unreadable."""
    try:
        if not root.is_dir():  # a file, or missing: stat raises
            st = root.stat()
            return _digest([(root.name, st.st_size, st.st_mtime_ns)])
        cache = cache_file(root, cache_dir)
        cached = read_json_cache(cache) or {}  # a cache of this folder, as written below?
        stamps = cached.get("dirs") if cached.get("root") == str(root) else None
        valid = isinstance(stamps, dict) and str(cached.get("version")).startswith(VERSION_PREFIX)
        with contextlib.suppress(OSError):  # a directory went away: changed
            if valid and all(_dir_stamp(os.path.join(root, d)) == s for d, s in stamps.items()):
                return cached["version"]
        dirs, files = _walk(root)
        version = _digest(files)
    except OSError as e:
        raise ValueError(f"--data-path: cannot read {e.filename or root}: {e.strerror}") from e
    from .runs import atomic_write_text  # a temp file renamed over the name: never a link

    # A read-only or full --data-dir only costs the next start the full walk again.
    with contextlib.suppress(OSError), file_lock(cache):
        cached = {"root": str(root), "version": version, "dirs": dirs}
        atomic_write_text(cache, json.dumps(cached) + "\n")
    return version


def changed_since(before: dict, now: dict, run_dir: Path) -> str | None:
    """One line when config.json `before` recorded other array data than `now` describes: array
    datasets keep their run name across versions, so their content hash is compared at a resume."""
    old, new = before.get("data_content"), now.get("data_content")
    if old is None or new is None or old == new:
        return None
    return (
        f"--dataset {now.get('dataset')}: its data changed since {run_dir} started "
        f"(content {old} -> {new}); resuming would train on two datasets: --fresh retrains "
        "it on the current data, or restore the data it began with"
    )


def forget(root: Path | None, cache_dir: Path) -> str:
    """Drop the cached fingerprint of `root` and the cached check of its images, for a file that
    fails to decode although the cheap check saw no change (rewritten in place): the next start
    checks every image again and skips the file instead of refusing at every start. Returns the
    hint for the `error:` line."""
    if root is not None:  # None: a dataset of yours that gave image files without --data-path
        # Every version's check of a folder of this name: a check is only a cache, made again.
        checks = Path(cache_dir).glob(f"{CHECK_PREFIX}{Path(root).name}-*.json")
        for path in [cache_file(Path(root), cache_dir), *checks]:
            with contextlib.suppress(OSError):
                path.unlink()
    return (
        "it changed after its folder was checked (rewritten in place); re-run: the folder is "
        "fingerprinted again (a new data version, a new run directory), the file skipped and listed"
    )


def cache_file(root: Path, cache_dir: Path, prefix: str = CACHE_PREFIX, suffix=".json") -> Path:
    """The file of `cache_dir` that belongs to the folder `root` (its cached fingerprint, or
    imagefolder.py's list of its unreadable images): named by it and a hash of its full path."""
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{prefix}{root.name}-{key}{suffix}"


def _dir_stamp(path: str) -> list[int]:
    # ctime too: unlike mtime it cannot be set back (touch -d, rsync -t on a directory).
    st = os.stat(path)
    return [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _walk(root: Path) -> tuple[dict[str, list[int]], list[tuple[str, int, int]]]:
    """Every non-hidden directory (stamped before it is listed: a file added meanwhile changes
    the stamp, so the next check sees it) and every non-hidden file, links followed once."""
    dirs: dict[str, list[int]] = {}
    files: list[tuple[str, int, int]] = []
    seen: set[tuple[int, int]] = set()
    pending = [""]
    while pending:
        rel = pending.pop()
        path = os.path.join(root, rel) if rel else str(root)
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in seen:  # a link back up the tree (or to a sibling)
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[rel or "."] = _dir_stamp(path)
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith("."):  # .DS_Store, ._x.png, .ipynb_checkpoints, .git
                    continue
                child = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir():
                    pending.append(child)
                elif entry.is_file():
                    fst = entry.stat()
                    files.append((child, fst.st_size, fst.st_mtime_ns))
    return dirs, files


def _digest(files: list[tuple[str, int, int]]) -> str:
    h = hashlib.sha256()
    for rel, size, mtime in sorted(files):
        h.update(f"{rel}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return VERSION_PREFIX + h.hexdigest()[:16]


def read_json_cache(path: Path) -> dict | None:
    """A JSON object read without following a link; None otherwise (the cache is made again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path`.lock: the jobs of a sweep starting at once build a cache
    once, the others wait and read it. filelock (>= 3.20.3) refuses a link planted at the lock's
    name. The lock file is deleted before it is released, so nothing is left behind; a waiter
    that then gets the deleted file sees it has no link left and tries again on a new one."""
    from filelock import FileLock  # here: --help and --print-run-dir never need it

    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with FileLock(lock_path):
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # already gone; or Windows, which deletes it itself
                os.unlink(lock_path)
