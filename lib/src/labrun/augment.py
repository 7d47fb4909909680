"""What happens to a batch on the training device: augmentation and normalisation.

Every loader (loaders.py) hands `DeviceTransform` a uint8 NHWC batch already on the device; it
returns the model's input: float32, normalised, channels_last. It works on whole batches and
draws from the device's default torch RNG, so a checkpoint's RNG state replays an epoch exactly.
A new augmentation goes here, after the crop: it sees uint8 NHWC pixels of the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# CIFAR-10 channel statistics, used for every 3-channel dataset (their mean for 1 channel):
# BatchNorm right after the first conv absorbs any remaining offset, and one constant keeps
# train, val and test scaled alike.
MEAN = (0.4914 * 255, 0.4822 * 255, 0.4465 * 255)
STD = (0.2470 * 255, 0.2435 * 255, 0.2616 * 255)


def channel_stats(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if channels == 3:
        return MEAN, STD
    return (sum(MEAN) / 3,) * channels, (sum(STD) / 3,) * channels


def crop_padding(height: int, width: int) -> int:
    """Padding of the random-crop augmentation: 4 px at 32x32, 1/8 of the shorter side."""
    return max(1, min(height, width) // 8)


class DeviceTransform:
    """uint8 NHWC batch on the device -> (train: random crop + flip) -> normalised float32.

    Train crops are cut out of the batch zero-padded by `crop_padding` on every side, padded
    here per batch: stored images need no margin, and a padded copy of a split would double the
    memory it takes.
    """

    def __init__(self, image_shape: tuple[int, int, int], *, train: bool, device):
        channels, height, width = image_shape
        self.device = torch.device(device)
        self.padding = crop_padding(height, width) if train else 0
        # (x - mean) / std = x * scale + shift, as full (1, C, H, W) channels_last tensors:
        # broadcasting (1, 3, 1, 1) over an innermost dim of 3 takes a ~20x slower path on CPU.
        mean, std = channel_stats(channels)
        scale = 1 / torch.tensor(std, device=self.device)
        shift = -torch.tensor(mean, device=self.device) * scale
        shape = (1, height, width, channels)
        self._scale = scale.expand(shape).contiguous().permute(0, 3, 1, 2)
        self._shift = shift.expand(shape).contiguous().permute(0, 3, 1, 2)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with one_cpu_thread(self.device):
            if self.padding:
                p = self.padding
                images = random_crop_flip(F.pad(images, (0, 0, p, p, p, p)), p)
            # NHWC memory viewed as NCHW is exactly the channels_last layout, no copy needed;
            # addcmul promotes uint8 to float32 and normalises in one call.
            return torch.addcmul(self._shift, images.permute(0, 3, 1, 2), self._scale)


def random_crop_flip(padded: torch.Tensor, padding: int) -> torch.Tensor:
    """Per-sample random crop and horizontal flip of a zero-padded uint8 NHWC batch.

    Offsets and flips come from the default RNG of the batch's device (so a checkpoint's RNG
    state replays them exactly). Both ways of cutting give the same pixels (a test checks).
    """
    n, hp, wp, c = padded.shape
    dev = padded.device
    dy = torch.randint(0, 2 * padding + 1, (n,), device=dev)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=dev)
    flip = torch.randint(0, 2, (n,), device=dev)
    cut = crop_flip_slices if dev.type == "cpu" else crop_flip_gather
    return cut(padded, dy, dx, flip, (hp - 2 * padding, wp - 2 * padding))


def crop_flip_gather(padded, dy, dx, flip, size) -> torch.Tensor:
    """One index_select for the whole batch: no host sync (the offsets stay on the device)."""
    n, hp, wp, c = padded.shape
    h, w = size
    dev = padded.device
    # Pixel offsets of one window, plain and mirrored; each sample adds its own start pixel.
    window = torch.arange(h, device=dev).view(h, 1) * wp + torch.arange(w, device=dev)
    windows = torch.stack([window, window.flip(1)])
    start = torch.arange(n, device=dev) * (hp * wp) + dy * wp + dx
    pixels = (windows[flip] + start.view(n, 1, 1)).view(-1)
    return padded.reshape(-1, c).index_select(0, pixels).view(n, h, w, c)


def crop_flip_slices(padded, dy, dx, flip, size) -> torch.Tensor:
    """One slice copy per image, for the CPU: the gather of 3-byte pixels cost 7x more at 224 px
    (67 vs 9 ms for 64 images on one core: the lab template's benchmarks/RESULTS.md,
    bench_cache.py); `.tolist()` would sync a GPU, so only the CPU."""
    h, w = size
    out = torch.empty((len(padded), h, w, padded.shape[3]), dtype=padded.dtype)
    draws = zip(dy.tolist(), dx.tolist(), flip.tolist(), strict=True)
    for i, (y, x, mirrored) in enumerate(draws):
        window = padded[i, y : y + h, x : x + w]
        out[i] = window.flip(1) if mirrored else window
    return out


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
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
