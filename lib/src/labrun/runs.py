"""One run's directory: file names, atomic writes, status, log (README, "What a run writes").

Imports no torch: plot.py, analysis.py and the sweep read the same names. Every file except the
append-only run.log is written to a temporary file in the same directory and moved into place with
os.replace, so a reader (or a crash) never sees half a file. Files get the permissions the umask
allows (as `open()` would), so colleagues sharing the results folder can read them.

Nothing is written through a link someone planted: os.replace puts a new file in place of
whatever name was there, and the files written in place (run.log, the status fallback) are opened
with O_NOFOLLOW and must be a regular file of ours with one link. Files read back to decide
something (metrics.json, status, tracking.json) count only if they are regular files owned by the
run directory's owner (`read_trusted`); a job trains only in a run directory whose every entry is
its user's (`check_ownership`). docs/design.md, "Sharing a results folder", says what that buys.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import logging
import math
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CONFIG = "config.json"
STATUS = "status"
HISTORY = "history.csv"
CHECKPOINT = "checkpoint.pt"
BEST_MODEL = "best_model.pt"
METRICS = "metrics.json"
LOG = "run.log"
LOCK = ".lock"  # held (flock) by the process training this directory: see claim.py
TRACKING = "tracking.json"  # the MLflow run this directory mirrors: see mirror.py
# What a run writes through atomic_path: its temps are this process's own (remove_stale_temps).
RUN_FILES = (CONFIG, STATUS, HISTORY, CHECKPOINT, BEST_MODEL, METRICS, TRACKING)
PROBE = "probe"  # ensure_writable's space probe: `.probe.<random>.tmp`
# How a job's process ends (README, "Exit codes"): finished (or already), failed, bad input,
# running elsewhere (another process holds the directory), interrupted (re-run to resume), forced
# (a second signal: no checkpoint).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_INTERRUPTED, EXIT_FORCED = 0, 1, 2, 73, 75, 130


class RunFailed(RuntimeError):
    """The run cannot give a result (e.g. its monitored metric was never finite, or the method
    returned before job.finish): status failed, exit 1, this message as the one `error:` line."""


# refused: run.py will not continue this run as it is (its checkpoint cannot be loaded); the
# sweep does not re-run it, and `run.py ... --fresh` starts it over.
STATUSES = ("running", "interrupted", "failed", "finished", "refused")
# history.csv's columns as classification writes them (and every run before tasks did); another
# task writes train_loss, train_<metric>..., val_loss, val_<metric>... in their place.
HISTORY_FIELDS = (
    "epoch",
    "step",
    "lr",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "epoch_time_s",
    "samples_per_sec",
)


TEMP_SUFFIX = ".tmp"
# Errors that mean "the disk cannot take this write", as opposed to a bug in the caller.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


_UMASK = os.umask(0o022)  # os.umask can only be read by setting it: done once, at import
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() would give a new file


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; move it into place only if the block succeeds
    (chmod-ed first: mkstemp's 0600 would hide it from the group sharing a results folder)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class ForeignFile(OSError):
    """A run directory (or a file in it) belongs to another user, or is not a plain file."""

    def __str__(self) -> str:
        return str(self.strerror)


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def check_ownership(run_dir: Path) -> None:
    """Raise ForeignFile unless `run_dir` (claimed, so it exists) and every entry in it belong to
    this process's user: a job never resumes from, appends to or "finishes" with files someone
    else put there (a checkpoint, a metrics.json, a link to a file of yours elsewhere)."""
    run_dir, me = Path(run_dir), os.geteuid()
    for path in [run_dir, *run_dir.iterdir()]:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode) and path != run_dir:  # a link to the directory: see owner
            raise ForeignFile(
                errno.ELOOP,
                f"{path} is a symbolic link: a run directory holds plain files only (nothing "
                "is written through a link); remove it, or use another --results-dir",
            )
        if (owner := info.st_uid) != me:
            what = "the run directory" if path == run_dir else path.name
            raise ForeignFile(
                errno.EPERM,
                f"{path} ({what}) belongs to {owner_name(owner)}, not to you "
                f"({owner_name(me)}): a run directory is written by one user only. Use your "
                "own --results-dir, or have its owner remove or finish it (docs/design.md, "
                "'Sharing a results folder')",
            )


def open_own(path: Path, flags: int, owner: int | None = None) -> int:
    """os.open without following a symlink (ELOOP) or blocking on a FIFO; ForeignFile unless a
    regular file owned by `owner` (default: this process's user) with one link (no hard link)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        owner = os.geteuid() if owner is None else owner
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_nlink != 1:
            raise ForeignFile(
                errno.EPERM,
                f"{path} is not a plain file of {owner_name(owner)} (owner "
                f"{owner_name(st.st_uid)}, {st.st_nlink} link(s)): not used",
            )
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_append(path: Path):
    """`path` opened for appending text (created if missing), as open_own allows."""
    try:
        fd = open_own(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ForeignFile(errno.ELOOP, f"{path} is a symbolic link: not written through") from None
    return os.fdopen(fd, "a", encoding="utf-8")


def size_text(nbytes: float) -> str:
    """`2.5 GiB`, `40.0 MiB`, `19.5 KiB`: a small size never reads `0.0 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def read_trusted(path: Path, max_bytes: int = 1 << 20) -> str:
    """The text of `path` if it is a regular file (not a link) owned by its directory's owner;
    OSError otherwise (ForeignFile for a foreign file or a hard link, ELOOP for a symbolic link)."""
    fd = open_own(path, os.O_RDONLY, owner=path.parent.stat().st_uid)
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes).decode("utf-8")


def remove_stale_temps(run_dir: Path, older_than_s: float = 60.0) -> list[str]:
    """Delete temporary files a killed writer (kill -9, power loss) left behind; return names.
    Called under the run directory's claim, so a temp of the run's own files has no live writer
    and goes whatever its age; any other may be another tool's: it goes after `older_than_s`."""
    removed, now = [], time.time()
    for path in Path(run_dir).glob(f".*{TEMP_SUFFIX}"):
        target = path.name.removeprefix(".").removesuffix(TEMP_SUFFIX).rpartition(".")[0]
        with contextlib.suppress(OSError):
            if target in (*RUN_FILES, PROBE) or now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed.append(path.name)
    return removed


def is_disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def seconds_from_env(name: str, default: float, *, zero: bool = False) -> float:
    """The environment's `name` as a finite number of seconds > 0 (>= 0 with `zero`), `default`
    when unset; ValueError with one line otherwise (NaN and inf too)."""
    text = os.environ.get(name, "").strip()
    with contextlib.suppress(ValueError):
        value = float(text or default)
        if (value >= 0 if zero else value > 0) and value < math.inf:  # NaN is neither
            return value
    raise ValueError(f"{name}={text!r}: expected a number of seconds {'>=' if zero else '>'} 0")


def first_line(exc: BaseException) -> str:
    """An error's message's first line (or its type's name), cut to 300 characters."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: dict) -> None:
    """`obj` as strict JSON: a NaN or infinite float becomes null (Python's NaN, Infinity are
    not JSON; jq, JavaScript and most readers refuse them)."""
    text = json.dumps(_finite_or_none(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
    atomic_write_text(path, text + "\n")


def _finite_or_none(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_status(run_dir: Path) -> str | None:
    """One of STATUSES, or None (missing, unreadable, foreign, or not a status word)."""
    try:
        status = read_trusted(Path(run_dir) / STATUS, max_bytes=64).strip()
    except (OSError, ValueError):
        return None
    return status if status in STATUSES else None


def write_status(run_dir: Path, status: str) -> None:
    """`status`: one of STATUSES (every caller passes one as a literal)."""
    atomic_write_text(Path(run_dir) / STATUS, status + "\n")


def try_write_status(run_dir: Path, status: str) -> None:
    """write_status for fault paths: never raises (the disk may be the fault). Without room
    for a temporary copy, the tiny file is written in place."""
    try:
        write_status(run_dir, status)
    except OSError:
        with contextlib.suppress(OSError):  # still not written: the ending goes on without
            fd = open_own(Path(run_dir) / STATUS, os.O_WRONLY | os.O_CREAT)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.truncate()
                f.write(status + "\n")


def read_metrics(run_dir: Path) -> dict | None:
    """metrics.json if it parses to a non-empty JSON object, else None."""
    try:
        metrics = json.loads(read_trusted(Path(run_dir) / METRICS))
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) and metrics else None


def is_done(run_dir: Path) -> bool:
    """A run is done iff metrics.json (written once, last) parses: an empty or truncated one is
    not, and the run resumes from its checkpoint and writes it again."""
    return read_metrics(run_dir) is not None


def write_history(run_dir: Path, rows: list[dict]) -> None:
    """history.csv: every column of every row (the task's, then any added later, in the order
    they first appear: a value added in code survives a resume), empty where a row has none."""
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for row in rows for k in row)) or list(HISTORY_FIELDS)
    writer = csv.DictWriter(buf, fieldnames=fields, restval="", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
    atomic_write_text(Path(run_dir) / HISTORY, buf.getvalue())


def ensure_writable(directory: Path, need_bytes: int = 0) -> None:
    """OSError unless we can write to `directory` and `need_bytes` fit there. The probe
    allocates them for real (posix_fallocate), not statvfs: quotas and nearly full disks are
    caught before any work rather than at the first checkpoint."""
    try:
        probe = {"prefix": f".{PROBE}.", "suffix": TEMP_SUFFIX}
        with tempfile.NamedTemporaryFile(dir=directory, **probe) as f:
            if need_bytes:
                os.posix_fallocate(f.fileno(), 0, need_bytes)
    except OSError as exc:
        if is_disk_error(exc):
            raise OSError(
                exc.errno,
                f"{directory} has no room for this run: it needs about "
                f"{need_bytes / 2**20:.0f} MiB for its checkpoints "
                f"({exc.strerror})",
            ) from exc
        raise OSError(exc.errno, f"cannot write to {directory}: {exc.strerror or exc}") from exc


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete the files of a run directory (for --fresh); return their names. The claim's lock
    file stays: this process holds it, and a new file would let a second process claim it."""
    removed = sorted(path for path in Path(run_dir).iterdir() if path.name != LOCK)
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [path.name for path in removed]


# What counts as the code of a project: its Python and configuration files, not its tests,
# docs or outputs (a README edit must not make every finished run "made by other code").
CODE_SUFFIXES = frozenset({".py", ".toml", ".cfg", ".yaml", ".yml"})
CODE_SKIP_DIRS = frozenset(
    {"tests", "docs", "results", "data", "figures", "logs", "wheels", "venv", "env", "__pycache__"}
)


def _is_code(relative: str) -> bool:
    parts = Path(relative).parts
    return Path(relative).suffix in CODE_SUFFIXES and not any(
        part.startswith(".") or part in CODE_SKIP_DIRS for part in parts[:-1]
    )


def code_version(root: Path) -> dict[str, str]:
    """Which code makes a run (config.json `code`, MLflow tags; never its identity): the git
    commit, a hash of the uncommitted diff, a hash of the project's code on disk (`project`:
    the same code gives the same hash whatever was committed), labrun's version and source."""
    from . import __version__

    commit = _git_lines(root, "rev-parse", "HEAD", z=False)
    files = _git_lines(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if files is None:  # not in git: the files under root, skipped folders left unwalked
        files = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if _is_code(os.path.join(d, "x.py"))]
            files += [os.path.relpath(os.path.join(folder, name), root) for name in names]
    diff = _git_lines(root, "diff", "HEAD", "--binary", "--", ".", z=False)
    return {
        "git_commit": commit[0] if commit else "unknown",
        "git_diff": "none" if diff == [] else _content_hash(diff) if diff else "unknown",
        "project": _files_hash(root, [name for name in files if _is_code(name)]),
        "labrun_version": __version__,
        "labrun": labrun_hash(),
    }


def labrun_hash() -> str:
    """A hash of labrun's own source files."""
    library = Path(__file__).parent
    return _files_hash(library, [p.name for p in library.glob("*.py")])


def other_code_line(run_dir: Path, root: Path, prefix: str) -> str | None:
    """`PREFIX: RUN was made by other code (...)` when other code than `root`'s made `run_dir`
    (a skip's note, a resume's warning), else None (also for a run before code versions)."""
    try:
        before = json.loads(read_trusted(Path(run_dir) / CONFIG)).get("code")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(before, dict):
        return None
    now = code_version(root)
    changed = [
        f"{key} {before.get(key)} -> {now[key]}"
        for key in ("project", "labrun")
        if before.get(key) != now[key]
    ]
    if not changed:
        return None
    commit = str(before.get("git_commit", "unknown"))[:12]
    return (
        f"{prefix}: {run_dir} was made by other code (commit {commit}, {'; '.join(changed)}): "
        "its numbers are that code's; --fresh retrains it with this code"
    )


def _git_lines(root: Path, *command: str, z: bool = True) -> list[str] | None:
    git = ["git", "-C", str(root), *command]
    try:
        out = subprocess.run(git, capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.decode("utf-8", "surrogateescape")
    return [line for line in text.split("\0" if z else "\n") if line]


def _content_hash(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()[:12]


def _files_hash(root: Path, names: list[str]) -> str:
    h = hashlib.sha256()
    for name in sorted(set(names)):
        try:
            content = hashlib.sha256((root / name).read_bytes()).hexdigest()
        except OSError:  # deleted (still in git's index), or unreadable
            content = "missing"
        h.update(f"{name}\0{content}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:12]


class NoFollowFileHandler(logging.FileHandler):
    """logging.FileHandler that appends only to a plain file of ours (open_append)."""

    def _open(self):
        return open_append(self.baseFilename)


def setup_logging(run_dir: Path, name: str) -> logging.Logger:
    """Log lines to stderr and appended to <run_dir>/run.log (a resumed run keeps one log)."""
    logger = logging.getLogger(f"run.{name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    close_logging(logger)  # a second main() in one process (tests) starts clean
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    for handler in (logging.StreamHandler(sys.stderr), NoFollowFileHandler(Path(run_dir) / LOG)):
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def close_logging(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        # A full disk fails the flush in close(): the log's last line is lost, and the run's
        # own ending (its error line and exit code) must not be replaced by that OSError.
        with contextlib.suppress(OSError):
            handler.close()
