"""Streamed JPEGs decoded on the GPU: batched nvJPEG through torchvision.io.decode_jpeg.

    use, why = choose_gpu_decode(device)   # run.log's `decode:` line
    batch = read_batch(paths, shape, ranges)  # in a loader worker: JPEG bytes, the rest decoded
    images = decode_batch(batch, shape, device)  # in the main process: uint8 NHWC on the device

read_batch is every streamed batch's reader: without the GPU decode (jpegs=False) it decodes
every file and the loader takes `batch.decoded`.

On a 16-core H100 box the CPU decode of 224-px ResNet-18's JPEGs fed 1,808 img/s, nvJPEG in
batches of 128 with the resize on the GPU 10,272 (../shared/notes/gpu.md). Where a CUDA device
and torchvision (the optional extra `labrun[gpu-decode]`) are there, the loader's workers only
read the bytes of each JPEG the GPU decodes as the CPU would (8-bit RGB or greyscale, upright)
and decode everything else as before (imagefolder.decode_image: PNG, CMYK, 16-bit, EXIF-rotated
files); the main process decodes the batch's JPEGs on the device, cuts the same centered box
and resizes it (imagefolder.cover_resize: antialiased bilinear, rounded to uint8): the same data
contract (uint8, the run's size, the same files and splits), not the same bits (nvJPEG's IDCT
and the float resize differ from libjpeg-turbo's and the uint8 one by a level or two).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .imagefolder import DECODE_ERRORS, EXIF_ORIENTATION, cover_resize, decode_image


def choose_gpu_decode(device: torch.device) -> tuple[bool, str]:
    """(decode JPEGs on `device`, why): on CUDA where torchvision imports."""
    cpu = "on the CPU (Pillow, imagefolder.decode_image, in the loader's workers)"
    if device.type != "cuda":
        return False, f"{cpu}: no CUDA device"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401 (imported to be known usable)
    except Exception as e:  # noqa: BLE001 (a torchvision that does not match torch: RuntimeError)
        return False, (
            f"{cpu}: torchvision does not import ({type(e).__name__}); "
            "pip install 'labrun[gpu-decode]' for nvJPEG on the GPU"
        )
    return True, (
        "on the GPU (nvJPEG, torchvision.io.decode_jpeg, batch by batch) for JPEGs; PNG, "
        "CMYK, 16-bit and EXIF-rotated files on the CPU in the loader's workers"
    )


def jpeg_bytes(path: str) -> torch.Tensor | None:
    """The file's bytes when the GPU decodes it as the CPU would, else None (decode it on the
    CPU). Reads the header only; a file that does not open is the CPU's to refuse."""
    try:
        with Image.open(path) as image:
            upright = image.getexif().get(EXIF_ORIENTATION, 1) == 1
            # The modes nvJPEG decodes as Pillow does (not CMYK, YCCK).
            if image.format != "JPEG" or image.mode not in ("RGB", "L") or not upright:
                return None
        # A bytearray: writable, so torch takes it without a copy or a warning.
        return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    except DECODE_ERRORS:
        return None


@dataclass
class EncodedBatch:
    """A batch as a worker reads it: `encoded[i]` row i's JPEG bytes (a uint8 tensor), or None
    where `decoded[i]` holds the row, decoded by the worker."""

    decoded: torch.Tensor  # uint8 (N, H, W, C); the rows of JPEGs left for the GPU are zeros
    encoded: list
    paths: list[str]

    def pin_memory(self) -> EncodedBatch:  # the DataLoader's pin_memory thread calls it
        self.decoded = self.decoded.pin_memory()
        return self


def read_batch(paths: list[str], shape, value_ranges, jpegs: bool = True) -> EncodedBatch:
    """In a loader worker: the bytes of the JPEGs the GPU decodes (`jpegs`; else none), every
    other file decoded (imagefolder.decode_image; UnreadableImage names a file that does not
    decode)."""
    channels, height, width = shape
    decoded = np.zeros((len(paths), height, width, channels), dtype=np.uint8)
    encoded = [jpeg_bytes(path) if jpegs else None for path in paths]
    for row, path in enumerate(paths):
        if encoded[row] is None:
            decoded[row] = decode_image(path, (height, width), channels, value_ranges)
    return EncodedBatch(torch.from_numpy(decoded), encoded, list(paths))


def decode_batch(batch: EncodedBatch, shape, device) -> torch.Tensor:
    """A worker's batch -> uint8 (N, H, W, C) on `device`. A JPEG nvJPEG refuses (truncated,
    corrupt) is decoded again on the CPU, which raises UnreadableImage naming it, as the CPU
    path does."""
    from torchvision.io import ImageReadMode, decode_jpeg

    channels, height, width = shape
    out = batch.decoded.to(device, non_blocking=True)
    rows = [i for i, data in enumerate(batch.encoded) if data is not None]
    if not rows:
        return out
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    try:
        images = decode_jpeg([batch.encoded[i] for i in rows], mode=mode, device=device)
    except RuntimeError:  # one bad file fails the batch: the CPU decodes them, naming a bad one
        cpu = (decode_image(batch.paths[i], (height, width), channels) for i in rows)
        images = [torch.from_numpy(pixels).permute(2, 0, 1) for pixels in cpu]
    for i, image in zip(rows, images, strict=True):
        out[i] = cover_resize(image.to(device), height, width).permute(1, 2, 0)
    return out
