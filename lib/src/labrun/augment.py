"""What happens to a batch on the training device: augmentation and normalisation.

Every loader (loaders.py) hands `DeviceTransform` a batch already on the device, channel-last
as stored (images NHWC, signals (N, L, C), sequences (N, T, F), vectors (N, L)) and in the
stored dtype; it returns the model's input in the dataset's layout: images channels_last, the
rest contiguous; float32, normalised (or the stored values, for data declared unnormalised). It
works on whole batches and draws from the device's default torch RNG, so a checkpoint's RNG
state replays an epoch exactly. A new augmentation goes here, after the crop.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# CIFAR-10 channel statistics, used for every uint8 3-channel image dataset (their mean for 1
# channel): BatchNorm right after the first conv absorbs any remaining offset, and one constant
# keeps train, val and test scaled alike. Other data: the training split's own (data.py).
MEAN = (0.4914 * 255, 0.4822 * 255, 0.4465 * 255)
STD = (0.2470 * 255, 0.2435 * 255, 0.2616 * 255)
# How each layout's axes are read; 2-D is "NL" (vectors), 3-D "NCL", 4-D "NCHW", 5-D "NCDHW".
LAYOUTS = {2: "NL", 3: "NCL", 4: "NCHW", 5: "NCDHW"}
DESCRIBED = dict(NL="vectors", NCL="signals", NCHW="images", NCDHW="volumes", NTF="sequences")


def channel_last(layout: str, ndim: int) -> tuple[int, ...]:
    """The permutation from `layout` to the stored channel-last order (N, *spatial, C)."""
    if layout.startswith("NC") and ndim > 2:
        return (0, *range(2, ndim), 1)
    return tuple(range(ndim))


def spatial_sizes(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The axes a crop or flip moves along: (H, W) of images, L of signals, T of sequences."""
    if layout == "NTF":
        return tuple(shape[:1])
    return tuple(shape[1:]) if layout.startswith("NC") else ()


def describe(shape: tuple[int, ...], layout: str, dtype) -> str:
    """`float32 signals (N, 1, 40)`."""
    dims = ", ".join(map(str, shape))
    return f"{str(dtype).removeprefix('torch.')} {DESCRIBED.get(layout, 'arrays')} (N, {dims})"


@dataclass(frozen=True)
class Normalization:
    """x -> (x - mean) / std per channel; mean None: the stored values pass unchanged."""

    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    why: str = ""


@dataclass(frozen=True)
class Augmentation:
    """Random crop of the batch zero-padded by `padding` (rows, columns of the channel-last
    batch seen as (N, H, W, C); a signal is one row) and a flip of its last spatial axis; or,
    with `resized` = (scale, ratio), a random resized crop of each image (random_resized_crop)."""

    padding: tuple[int, int] = (0, 0)
    flip: bool = False
    why: str = "off"
    resized: tuple[tuple[float, float], tuple[float, float]] | None = None

    @property
    def on(self) -> bool:
        return self.flip or any(self.padding) or self.resized is not None


def choose_augmentation(
    shape: tuple[int, ...],
    layout: str,
    dtype,
    requested: str = "auto",
    declared: bool | None = None,
    spatial_targets: bool = False,
    crop: str = "pad",
    crop_scale: tuple[float, float] | None = None,
    crop_ratio: tuple[float, float] | None = None,
) -> Augmentation:
    """What --augment `requested` means for data of this `shape` (one sample), with the
    dataset's declaration (DatasetSplits.augment) and the task's targets; `why` says which and
    why (run.log, config.json). Raises ValueError where `on` cannot work."""
    data = describe(shape, layout, dtype)
    if requested == "off":
        return Augmentation(why="off (--augment off)")
    if spatial_targets:
        if requested == "on":
            raise ValueError("--augment on: the task's per-pixel targets would not move along")
        return Augmentation(why="off: per-pixel targets, which crop and flip would not move")
    if requested == "on":
        source = "--augment on"
    elif declared is not None:
        source = f"the dataset declares augment={declared}"
        if not declared:
            return Augmentation(why=f"off ({source})")
    elif layout == "NCHW" and dtype == torch.uint8:
        source = "auto: uint8 images"
    else:
        return Augmentation(
            why=f"off (auto: only uint8 images (N, C, H, W) are augmented by default; these are "
            f"{data}; --augment on to shift and flip them)"
        )
    spatial = spatial_sizes(shape, layout)
    if len(spatial) not in (1, 2):
        raise ValueError(
            f"--augment: no augmentation is defined for {data} ({source}); crop and flip "
            "need images, signals or sequences (write your own in labrun's augment.py)"
        )
    if crop == "resized":
        if len(spatial) != 2:
            raise ValueError(f"--crop resized: crops images, not {data}; use --crop pad")
        (low, high), (narrow, wide) = crop_scale, crop_ratio
        return Augmentation(
            flip=True,
            resized=(crop_scale, crop_ratio),
            why=f"random resized crop (area {low:g}-{high:g} of the image, width/height "
            f"{narrow:.3g}-{wide:.3g}) + flip ({source}; --crop resized)",
        )
    pad = max(1, min(spatial) // 8)  # the crop's padding: 1/8 of the shorter side (4 at 32x32)
    kind = "crop + flip" if len(spatial) == 2 else "shift + flip along the length"
    if 4 * pad > min(spatial):  # the crop would cover more than a quarter of an axis
        skipped = (
            f"a random crop padded by {pad} would leave up to {2 * pad} of {min(spatial)} "
            f"values blank along an axis of {data}"
        )
        if source.startswith("auto"):
            return Augmentation(why=f"off (auto: {skipped})")
        return Augmentation(flip=True, why=f"flip only ({source}); crop skipped: {skipped}")
    padding = (pad, pad) if len(spatial) == 2 else (0, pad)
    return Augmentation(padding, True, f"{kind} (random, padding {pad}; {source})")


class DeviceTransform:
    """Channel-last batch on the device -> (train: random crop + flip) -> the model's input.

    Train crops are cut out of the batch zero-padded on every side, padded here per batch:
    stored arrays need no margin, and a padded copy of a split would double its memory.
    `augmentation` None: none; `normalization` None: uint8 images' constants.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        *,
        device,
        layout: str | None = None,
        augmentation: Augmentation | None = None,
        normalization: Normalization | None = None,
    ):
        self.device = torch.device(device)
        self.layout = layout or LAYOUTS[len(shape) + 1]
        self.augmentation = augmentation if augmentation and augmentation.on else None
        order = channel_last(self.layout, len(shape) + 1)
        self._to_layout = tuple(order.index(axis) for axis in range(len(order)))
        # Images keep channels_last memory; other layouts are handed over contiguous.
        self._contiguous = self.layout not in ("NCHW", "NCDHW")
        if normalization is None:  # uint8 images: MEAN, STD, or their means for every channel
            grey = Normalization((sum(MEAN) / 3,), (sum(STD) / 3,))  # (broadcast below)
            normalization = Normalization(MEAN, STD) if shape[0] == 3 else grey
        self._scale = self._shift = None
        if normalization.mean is not None:
            # (x - mean) / std = x * scale + shift, as full channel-last tensors permuted like
            # the batch: broadcasting (1, 3, 1, 1) over an innermost dim of 3 takes a ~20x
            # slower path on CPU.
            stored = tuple(shape[axis - 1] for axis in order[1:])
            scale = 1 / torch.tensor(normalization.std, device=self.device, dtype=torch.float32)
            shift = -torch.tensor(normalization.mean, device=self.device) * scale
            self._scale = scale.expand(1, *stored).contiguous().permute(self._to_layout)
            self._shift = shift.float().expand(1, *stored).contiguous().permute(self._to_layout)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        augmentation = self.augmentation
        with one_cpu_thread(self.device):
            if augmentation is not None and augmentation.resized is not None:
                batch = random_resized_crop(batch, *augmentation.resized)
            elif augmentation is not None:
                py, px = augmentation.padding
                rows = batch if batch.ndim == 4 else batch.unsqueeze(1)  # a signal is one row
                padded = F.pad(rows, (0, 0, px, px, py, py)) if py or px else rows
                rows = random_crop_flip(padded, (py, px), flip=augmentation.flip)
                batch = rows if batch.ndim == 4 else rows.squeeze(1)
            # Channel-last memory viewed in the dataset's layout: for images exactly the
            # channels_last layout, no copy needed.
            x = batch.permute(self._to_layout)
            if self._scale is not None:  # addcmul promotes the stored dtype to float32
                x = torch.addcmul(self._shift, x, self._scale)
            return x.contiguous() if self._contiguous else x


def random_crop_flip(padded: torch.Tensor, padding, *, flip: bool = True) -> torch.Tensor:
    """Per-sample random crop and horizontal flip of a zero-padded NHWC batch (`padding`: rows,
    columns), drawn from the device's default RNG: a checkpoint's RNG state replays them."""
    py, px = padding
    n, hp, wp, _ = padded.shape
    dev = padded.device
    dy = torch.randint(0, 2 * py + 1, (n,), device=dev)
    dx = torch.randint(0, 2 * px + 1, (n,), device=dev)
    flips = torch.randint(0, 2, (n,), device=dev) * flip  # drawn either way: the same stream
    cut = crop_flip_slices if dev.type == "cpu" else crop_flip_gather
    return cut(padded, dy, dx, flips, (hp - 2 * py, wp - 2 * px))


def random_resized_crop(
    batch: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float], tries: int = 10
) -> torch.Tensor:
    """Per image of an NHWC batch, a random box of `scale` of its area and width/height in
    `ratio` (log-uniform), resized back to the image's size (bilinear), flipped half the time:
    float32 NHWC. torchvision's RandomResizedCrop + RandomHorizontalFlip, for a whole batch on
    its device: the box is the first of `tries` draws that fits (none: the whole image), cut
    and resized by one grid_sample; draws from the device's default RNG, no host sync."""
    n, h, w, c = batch.shape
    dev = batch.device
    area = torch.empty(n, tries, device=dev).uniform_(*scale)
    aspect = torch.empty(n, tries, device=dev).uniform_(*map(math.log, ratio)).exp()
    box_w = (area * aspect * h / w).sqrt()  # fractions of the image's width and height
    box_h = (area / aspect * w / h).sqrt()
    # One more try that always fits: the whole image.
    boxes = F.pad(torch.stack([box_w, box_h]), (0, 1), value=1.0)  # (2, n, tries + 1)
    first = (boxes <= 1).all(0).to(torch.uint8).argmax(1)  # argmax: the first True
    box_w, box_h = boxes[:, torch.arange(n, device=dev), first]
    # Box centres in grid_sample's coordinates (-1..1), anywhere the box stays inside.
    centre_x = (torch.rand(n, device=dev) * 2 - 1) * (1 - box_w)
    centre_y = (torch.rand(n, device=dev) * 2 - 1) * (1 - box_h)
    mirror = torch.randint(0, 2, (n,), device=dev) * 2 - 1  # -1: flipped left-right
    zero = torch.zeros_like(box_w)
    theta = torch.stack([box_w * mirror, zero, centre_x, zero, box_h, centre_y], 1).view(n, 2, 3)
    grid = F.affine_grid(theta, [n, c, h, w], align_corners=False)
    images = batch.permute(0, 3, 1, 2).float()
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.permute(0, 2, 3, 1).contiguous()  # NHWC, as the padded crop's


def crop_flip_gather(padded, dy, dx, flip, size) -> torch.Tensor:
    """One index_select for the whole batch: no host sync (the offsets stay on the device)."""
    n, hp, wp, c = padded.shape
    windows, first = _crop_windows(n, hp, wp, *size, padded.device)
    start = first + dy * wp + dx  # each sample's first pixel
    pixels = (windows[flip] + start.view(n, 1, 1)).view(-1)
    return padded.reshape(-1, c).index_select(0, pixels).view(n, *size, c)


@functools.lru_cache(maxsize=8)
def _crop_windows(n, hp, wp, h, w, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Constants of a batch's shape, made once, not per batch (8 fewer kernels a step): the
    pixel offsets of one window, plain and mirrored, and each sample's first padded pixel."""
    window = torch.arange(h, device=device).view(h, 1) * wp + torch.arange(w, device=device)
    return torch.stack([window, window.flip(1)]), torch.arange(n, device=device) * (hp * wp)


def crop_flip_slices(padded, dy, dx, flip, size) -> torch.Tensor:
    """One slice copy per image, for the CPU: the gather of 3-byte pixels cost 7x more at 224 px
    (67 vs 9 ms for 64 images on one core: the lab template's benchmarks/RESULTS.md,
    bench_cache.py); `.tolist()` would sync a GPU, so only the CPU."""
    h, w = size
    out = torch.empty((len(padded), h, w, padded.shape[3]), dtype=padded.dtype)
    for i, (y, x, mirrored) in enumerate(zip(dy.tolist(), dx.tolist(), flip.tolist(), strict=True)):
        window = padded[i, y : y + h, x : x + w]
        out[i] = window.flip(1) if mirrored else window
    return out


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run a batch's data ops on one thread when they execute on the CPU: memory-bound, ~1 ms on
    one core, they wait at a barrier for every thread of the intra-op pool (on 2 busy cores:
    15-22 ms per batch with 2 threads, 1.3-2.8 with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if device.type == "cpu" else threads)  # 0.1 us when unchanged
    try:
        yield
    finally:
        torch.set_num_threads(threads)
