"""Loaders: a split in RAM or on disk -> batches of the model's input on the training device.

    loader = Loader(split, 128, train=True, device=device)
    for epoch in range(epochs):
        loader.set_epoch(epoch)                         # shuffle order = f(seed, epoch)
        for x, y in loader: ...                         # float32, channels_last, on device

A split is a `Split` (arrays of any dtype and shape in RAM, or uint8 images memory-mapped from
the decoded cache) or a `FileSplit` (image files, decoded batch by batch in DataLoader worker
processes). Workers only gather (or decode) channel-last batches in the stored dtype (uint8
images cross the bus as uint8: 4x fewer bytes); augment.DeviceTransform turns them into the
model's input on the device. The order of an epoch is a pure function of (seed, epoch), so a
resumed run replays it exactly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import gpudecode
from .augment import (
    LAYOUTS,
    Augmentation,
    DeviceTransform,
    Normalization,
    channel_last,
    choose_augmentation,
    one_cpu_thread,
)
from .imagefolder import UnreadableImage


@dataclass
class Split:
    """One split in memory, on the CPU: inputs `images` (uint8 images (N, C, H, W), or any
    numeric array read as `layout`), stored channel-last (the order the loaders gather from),
    and targets `labels` (N, ...). `rows`: the split is `images[rows]`, uncopied (the splits of
    one memory-mapped decoded cache). `normalization`: the training split's; None: uint8
    images' constants, other data this split's own statistics."""

    images: torch.Tensor
    labels: torch.Tensor
    rows: torch.Tensor | None = None
    layout: str | None = None
    normalization: Normalization | None = None

    def __post_init__(self):
        if self.layout is None:
            self.layout = LAYOUTS.get(self.images.ndim, "NC")

    def __len__(self) -> int:
        return len(self.labels)

    def channel_last(self) -> torch.Tensor:
        """The stored inputs as (N, *spatial, C): a view, no copy (how Split keeps memory)."""
        return self.images.permute(channel_last(self.layout, self.images.ndim))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.images.dtype


@dataclass
class FileSplit:
    """One split streamed from disk: image paths, int64 labels, and the decoded shape."""

    paths: Sequence[str]
    labels: torch.Tensor
    image_shape: tuple[int, int, int]  # (C, H, W) after conversion and resizing
    value_ranges: dict | None = None  # images of more than 8 bits (DatasetSplits.value_ranges)
    layout = "NCHW"
    dtype = torch.uint8  # decoded
    normalization = None  # uint8 images: the fixed constants

    def __len__(self) -> int:
        return len(self.labels)


def available_cpus() -> int:
    """Cores this process may run on (a Slurm or taskset mask, not the machine's count); in a
    sweep, its slot's share of them (LAB_JOB_CPUS, set by run.sh), so the slots' loader workers
    never outnumber the cores."""
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
    cpus = len(affinity(0)) if affinity else os.cpu_count() or 1
    share = os.environ.get("LAB_JOB_CPUS", "")
    return min(cpus, int(share)) if share.isdecimal() and int(share) > 0 else cpus


def default_workers(device: torch.device, *, streaming: bool = False) -> int:
    """DataLoader workers when --workers is not given. Streaming: every core this job may use
    but the main process's (a cap of 8 left half of a 16-core GPU box idle while the GPU
    waited: 1,808 img/s streamed vs 8,181 in memory, ResNet-18 at 224 px, H100). In memory on
    the CPU: 0 (a batch is a ~1 ms gather against a ~270 ms step on 2 cores: a worker would take
    a core from the model). In memory on CUDA: a few, gathering and pinning ahead of the GPU."""
    if streaming:
        return max(1, available_cpus() - 1)
    return min(4, available_cpus() // 2) if device.type == "cuda" else 0


def worker_init(_worker_id: int) -> None:
    """worker_init_fn: workers leave stop signals to the main process, but not their own end.

    Slurm and Ctrl-C signal the whole process group: a worker dying of it would turn a graceful
    stop (exit 75) into "DataLoader worker killed by signal". So the stop signals stay blocked
    (since raw_batches forked it) and one thread takes them: a SIGTERM from the parent itself
    (how multiprocessing and torch end workers) or any once the parent is gone (PR_SET_PDEATHSIG
    sends one) ends the worker. Workers that ignored every SIGTERM kept run.py alive at exit
    after an error, holding its .lock, forever.
    """
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    # PR_SET_PDEATHSIG (1, linux/prctl.h); not Linux: torch's watchdog still ends orphans.
    _libc("prctl", 1, int(signal.SIGTERM))
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


def _libc(function: str, *args: int) -> None:
    """Call a glibc function; nothing where there is none (macOS, musl)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        getattr(ctypes.CDLL("libc.so.6"), function)(*args)


# Every stop signal of stopping.STOP_SIGNALS: a closed terminal's SIGHUP and `scancel --full`'s
# USR1 reach the whole group too, and their default action would kill a worker.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1}


def own_normalization(split: Split | FileSplit, whose: str = "this split") -> Normalization | None:
    """None for uint8 images (their constants); else per channel (the last stored axis) mean
    and std of `split` itself: data.load_dataset gives the training split's to every split."""
    if split.layout == "NCHW" and split.dtype == torch.uint8:  # image files too
        return None
    # `rows` are only set on uint8 images (the decoded cache), answered above
    values = split.channel_last().flatten(0, -2)  # (N * spatial, C)
    sums = torch.zeros(2, values.shape[1], dtype=torch.float64)  # of x and of x^2, per channel
    for rows in values.split(1 << 16):  # in chunks: float64 temporaries stay small
        chunk = rows.double()
        sums += torch.stack([chunk.sum(0), chunk.square().sum(0)])
    mean, squares = sums / max(len(values), 1)
    std = (squares - mean.square()).clamp_min(0).sqrt()
    std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant channel: shifted only
    why = f"per channel ({len(mean)}), mean and std of {whose}"
    return Normalization(tuple(mean.tolist()), tuple(std.tolist()), why)


class _ArrayDataset(torch.utils.data.Dataset):
    """The whole split channel-last in RAM (or on the device): no per-sample work."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor | None):
        self.images, self.labels, self.rows = images, labels, rows

    def __getitem__(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        # The DataLoader asks for a whole batch at once (a list of indices; the resident loader
        # a tensor): one gather instead of N small tensors.
        index = torch.as_tensor(index, device=self.images.device)
        rows = index if self.rows is None else self.rows.index_select(0, index)
        # index_select, not images[index]: the latter is ~300x slower for uint8 on CPU.
        with one_cpu_thread(self.images.device):
            return self.images.index_select(0, rows), self.labels.index_select(0, index)


class _FileDataset(torch.utils.data.Dataset):
    """Image files decoded on demand (in the worker processes): disk -> uint8 NHWC batch; with
    `gpu_jpegs`, the JPEGs' bytes for the GPU and the rest decoded (gpudecode.EncodedBatch)."""

    def __init__(self, split: FileSplit, gpu_jpegs: bool = False):
        self.split, self.gpu_jpegs = split, gpu_jpegs

    def __getitem__(self, indices: list[int]):
        split = self.split
        paths = [split.paths[i] for i in indices]
        try:
            # One thread: a worker has one anyway; without workers (or in a peek) the main
            # process's pool would spin over each image's small resize (8 vs 1.3 ms per image).
            with one_cpu_thread(torch.device("cpu")):
                batch = gpudecode.read_batch(
                    paths, split.image_shape, split.value_ranges, jpegs=self.gpu_jpegs
                )
        except UnreadableImage as e:  # to the main process as a value: it names the file
            return e, None
        return batch if self.gpu_jpegs else batch.decoded, split.labels[torch.as_tensor(indices)]


class _EpochBatches(torch.utils.data.Sampler):
    """Batch sampler that yields the loader's current epoch (iterated in the main process)."""

    def __init__(self, loader: Loader):
        self.loader = loader

    def __iter__(self):
        return (b.tolist() for b in self.loader.batch_indices())


class Loader:
    """Iterable of `(x, y)` batches on `device`: x the model's input (float32, normalised, in
    the split's layout; images channels_last), y the split's labels as they are.

    Train loaders shuffle (order = f(seed, epoch)), augment and drop the ragged last batch
    (BatchNorm sees full batches, compiled graphs one shape); evaluation keeps it, so every
    sample is scored. `gpu_resident=True` keeps an in-memory split whole on `device`: nothing
    crosses the bus during training. Otherwise a torch DataLoader's `workers` gather (image
    files: decode) uint8 batches, converted on the device. `shard=(rank, world)`: this rank's
    contiguous 1/world of every batch.
    """

    def __init__(
        self,
        split: Split | FileSplit,
        batch_size: int,
        *,
        train: bool,
        device,
        seed: int = 0,
        workers: int | None = None,
        gpu_resident: bool = False,
        augment: bool | Augmentation = True,
        shard: tuple[int, int] = (0, 1),
    ):
        _OPEN.add(self)  # close_all ends its workers however the run ends
        self.device = torch.device(device)
        self.batch_size, self.train, self.seed = batch_size, train, seed
        self.shard = shard  # (rank, world): this process takes the rank-th 1/world of each batch
        self.num_samples = len(split)
        self.set_epoch(0)
        # Augmentation and normalisation on the device (augment.py): the loaders only gather.
        # augment=True: --augment auto's choice for this data; False: normalised only.
        if augment is True:
            augment = choose_augmentation(split.image_shape, split.layout, split.dtype)
        self.transform = DeviceTransform(
            split.image_shape,
            device=self.device,
            layout=split.layout,
            augmentation=augment if train and augment else None,
            normalization=split.normalization or own_normalization(split),
        )
        streaming = isinstance(split, FileSplit)
        self.resident = gpu_resident and not streaming
        self.gpu_jpegs, self.decoder = False, ""  # decoder: run.log's `decode:` (streaming)
        self.nvjpeg_refused: list[str] = []  # batches nvJPEG failed and the CPU decoded whole
        self._loader, self._batches = None, None  # _batches: the iterator holding the workers
        if streaming:
            self.gpu_jpegs, self.decoder = gpudecode.choose_gpu_decode(self.device)
            self.dataset = _FileDataset(split, self.gpu_jpegs)
        else:
            images, rows, labels = split.channel_last().contiguous(), split.rows, split.labels
            if self.resident:  # of a shared cache, only this split's rows go to the device
                images = images if rows is None else images.index_select(0, rows)
                images, rows, labels = images.to(self.device), None, labels.to(self.device)
            self.dataset = _ArrayDataset(images, labels, rows)
        self._on_cuda = self.device.type == "cuda"
        self.waited_s = self.spanned_s = 0.0  # __iter__'s waits for batches, its epochs' time
        if self.resident:
            self.how = "resident on the device, gathered there"
            return
        cpus, default = available_cpus(), workers is None
        if default:
            workers = default_workers(self.device, streaming=streaming)
        self.how = f"in memory, {workers} worker(s)"
        if streaming:  # run.log's `decode:`: the decode path and who decodes
            where = "on the GPU (nvJPEG)" if self.gpu_jpegs else "on the CPU (Pillow)"
            self.how = f"streamed, decoded {where}, {workers} worker(s)"
            whose = f"of the {cpus} core(s) this job may use" if default else "(--workers)"
            self.decoder += f"; {workers} loader worker(s) {whose}"
        # Batch-sized buffers, freed, must not fragment the heap: every allocation above 4 MiB
        # served by mmap goes back to the OS when freed. glibc raises its mmap threshold after
        # each large free: streaming 256 px images in batches of 64, the RSS grew from 301 to
        # 871 MB in 40 batches; with a fixed threshold, to 319 MB (benchmarks/RESULTS.md,
        # bench_data.py). -3: M_MMAP_THRESHOLD, from glibc's malloc.h.
        _libc("mallopt", -3, 4 << 20)
        background = self._on_cuda and workers > 0
        self._loader = torch.utils.data.DataLoader(
            self.dataset,
            # Each index the sampler yields is a batch's list, read whole by the dataset; no
            # collation (batch_size None: the batch is left as the dataset returns it).
            sampler=_EpochBatches(self),
            batch_size=None,
            num_workers=workers,
            worker_init_fn=worker_init,
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

    def __len__(self) -> int:
        if self.train:  # drops the ragged last batch
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
        """This epoch's batches as index tensors (on the device when resident): a pure function
        of (seed, epoch, skip)."""
        n = self.num_samples
        rng = np.random.default_rng([self.seed, self.epoch])
        order = torch.from_numpy(rng.permutation(n) if self.train else np.arange(n))
        if self.resident:  # one copy of the epoch's order to the device: every gather is there
            order = order.to(self.device)
        batches = list(order.split(self.batch_size))[: len(self)][self.skip_batches :]
        rank, world = self.shard  # torchrun: contiguous, disjoint shards of the same batches
        batches = [b.tensor_split(world)[rank] for b in batches]
        return [b for b in batches if len(b)]  # a shard of an evaluation's short last batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches; the caller's waits for them count into `waited_s`, the epoch's
        time into `spanned_s` (wait_line)."""
        if self.resident:  # gathered on the device by this process
            self._next_epoch()
            raw = (self.dataset[index] for index in self.batch_indices())
        else:
            raw = self.raw_batches()
        start = asked = time.perf_counter()
        try:
            for batch in (self._on_device(*batch) for batch in raw):
                self.waited_s += time.perf_counter() - asked
                yield batch
                asked = time.perf_counter()  # the caller asks for the next batch
        finally:
            self.spanned_s += time.perf_counter() - start
            raw.close()  # a caller that stops early: the workers end now, not at collection

    def wait_line(self) -> str:
        """run.log's `loader:` line: the share of the loop's time spent waiting for batches."""
        share = self.waited_s / max(self.spanned_s, 1e-9)
        line = (
            f"loader: the loop waited {self.waited_s:.1f} s of {self.spanned_s:.1f} s for "
            f"batches ({100 * share:.0f} %; {self.how})"
        )
        if refused := self.nvjpeg_refused:  # slow: the main process decoded them
            line += (
                f"; nvJPEG failed on {len(refused)} batch(es) of readable JPEGs, decoded again in "
                f"the main process ({refused[0]})"
            )
        return line

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This epoch's first batch as iterating gives it (shape, dtype, device), read in this
        process: no worker is started, no batch is prefetched and thrown away (the compile
        probe's, whose ~20 prefetched batches halved a short streamed run's rate). The order
        is not moved; the augmentation's RNG draws are the caller's to put back."""
        images, labels = self.dataset[self.batch_indices()[0].tolist()]
        if isinstance(images, UnreadableImage):
            raise images
        return self._on_device(images, labels)

    def _on_device(self, images, labels) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gpu_jpegs:  # JPEG bytes to nvJPEG, the rows decoded by a worker copied
            shape = self.dataset.split.image_shape
            images = gpudecode.decode_batch(images, shape, self.device, self.nvjpeg_refused)
        # uint8 crosses the bus (4x fewer bytes than float32); non_blocking lets the copy
        # overlap with the GPU still computing the previous step (resident: no copy).
        images, labels = (t.to(self.device, non_blocking=self._on_cuda) for t in (images, labels))
        return self.transform(images), labels

    def raw_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This epoch's batches as the DataLoader's workers give them (uint8 NHWC, or a
        gpudecode.EncodedBatch) and labels, on the CPU. On any error the workers are shut down
        at once: an iterator kept alive by the traceback would outlive main() with them."""
        self._next_epoch()
        # The stop signals blocked while the workers are forked: a group signal landing between
        # a worker's fork and its worker_init_fn would kill it. One that came meanwhile reaches
        # the stop handler when they are unblocked.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            batches = iter(self._loader)  # forks the workers (CPU: every epoch)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self._batches = weakref.ref(batches)
        try:
            for images, labels in batches:
                if isinstance(images, UnreadableImage):
                    raise images
                yield images, labels
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """End this loader's worker processes now; iterating again starts new ones. Persistent
        workers left to the interpreter's exit are joined for 5 s each by torch <= 2.12's atexit
        hook (pytorch issue 81794: 19 s after `finished` with 2 workers per loader)."""
        batches = self._batches and self._batches()  # a weak reference, or None
        self._batches = None
        if self._loader is not None:
            self._loader._iterator = None  # persistent workers: a fresh set if iterated again
        if hasattr(batches, "_shutdown_workers"):  # none without workers
            batches._shutdown_workers()


_OPEN: weakref.WeakSet[Loader] = weakref.WeakSet()  # every Loader of this process


def close_all() -> None:
    """End the workers of every loader of this process (a job's end, however it ended)."""
    for loader in list(_OPEN):
        loader.close()
