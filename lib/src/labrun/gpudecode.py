"""Streamed JPEGs decoded on the GPU: batched nvJPEG through torchvision.io.decode_jpeg.

    use, why = choose_gpu_decode(device)   # run.log's `decode:` line
    batch = read_batch(paths, shape, ranges)  # in a loader worker: JPEG bytes, the rest decoded
    images = decode_batch(batch, shape, device)  # in the main process: uint8 NHWC on the device

read_batch is every streamed batch's reader: without the GPU decode (jpegs=False) it decodes
every file and the loader takes `batch.decoded`.

On a 16-core H100 box the CPU decode of 224-px ResNet-18's JPEGs fed 1,808 img/s, nvJPEG in
batches of 128 with the resize on the GPU 10,272 (../shared/notes/gpu.md). The workers send the
bytes of each JPEG the GPU decodes as the CPU would (jpeg_bytes) and decode every other file;
the main process decodes and resizes the JPEGs as imagefolder.cover_resize does: the same data
contract (uint8, the run's size, the same files and splits), not the same bits (nvJPEG's IDCT
and the float resize differ from libjpeg-turbo's and the uint8 one by a level or two).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .imagefolder import DECODE_ERRORS, EXIF_ORIENTATION, cover_resize, decode_image
from .runs import first_line


def choose_gpu_decode(device: torch.device) -> tuple[bool, str]:
    """(decode JPEGs on `device`, why): on CUDA where torchvision imports and its decode_jpeg
    decodes a JPEG there (a torchvision built without nvJPEG imports but cannot: every batch
    would then fail over to a decode in the main process, on one core)."""
    cpu = "on the CPU (Pillow, imagefolder.decode_image, in the loader's workers)"
    if device.type != "cuda":
        return False, f"{cpu}: no CUDA device"
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as e:  # noqa: BLE001 (a torchvision that does not match torch: RuntimeError)
        return False, (
            f"{cpu}: torchvision does not import ({type(e).__name__}); "
            "pip install 'labrun[gpu-decode]' for nvJPEG on the GPU"
        )
    probes = []  # a batch of two sizes, as a folder's batches are
    for size in ((16, 16), (24, 8)):
        probes.append(io.BytesIO())
        Image.new("RGB", size, (90, 120, 200)).save(probes[-1], format="JPEG")
    try:  # also starts nvJPEG (its handle: ~0.1 s) here, not inside the first timed step
        data = [_as_tensor(probe.getvalue()) for probe in probes]
        decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except Exception as e:  # noqa: BLE001 (RuntimeError, or torch's AssertionError without CUDA)
        return False, f"{cpu}: torchvision's decode_jpeg fails on {device} ({type(e).__name__})"
    return True, (
        "on the GPU (nvJPEG, torchvision.io.decode_jpeg, batch by batch) for JPEGs; PNG, "
        "CMYK, 16-bit and EXIF-rotated files on the CPU in the loader's workers"
    )


def jpeg_bytes(path: str) -> bytes | None:
    """The file's bytes when the GPU decodes it as the CPU would, else None (decode it on the
    CPU). Reads the header only; a file that does not open is the CPU's to refuse."""
    with contextlib.suppress(*DECODE_ERRORS):
        data = Path(path).read_bytes()  # read once: the header below is parsed from memory
        with Image.open(io.BytesIO(data)) as image:
            upright = image.getexif().get(EXIF_ORIENTATION, 1) == 1
            # The modes nvJPEG decodes as Pillow does (not CMYK, YCCK).
            if image.format == "JPEG" and image.mode in ("RGB", "L") and upright:
                return data
    return None


def _as_tensor(data: bytes) -> torch.Tensor:
    # Over a bytearray: writable, so torch takes it without a copy or a warning (numpy's view,
    # unlike torch.frombuffer, also takes an empty one).
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))


@dataclass
class EncodedBatch:
    """A batch as a worker reads it: the JPEGs left for the GPU end to end in one buffer (one
    shared-memory segment to send and pin, not one per image) and the other rows decoded."""

    decoded: torch.Tensor  # uint8 (K, H, W, C): the rows the worker decoded, in order
    data: torch.Tensor  # uint8: the GPU's JPEGs' bytes, one after another
    sizes: list[int]  # of each JPEG in `data`
    on_gpu: list[bool]  # per row: its JPEG is in `data` (else it is the next row of `decoded`)
    paths: list[str]

    def pin_memory(self) -> EncodedBatch:  # the DataLoader's pin_memory thread calls it
        self.decoded, self.data = self.decoded.pin_memory(), self.data.pin_memory()
        return self


def read_batch(paths: list[str], shape, value_ranges, jpegs: bool = True) -> EncodedBatch:
    """In a loader worker: the bytes of the JPEGs the GPU decodes (`jpegs`; else none), every
    other file decoded (imagefolder.decode_image)."""
    channels, height, width = shape
    encoded = [jpeg_bytes(path) if jpegs else None for path in paths]
    cpu = [path for path, data in zip(paths, encoded, strict=True) if data is None]
    decoded = torch.empty((len(cpu), height, width, channels), dtype=torch.uint8)
    if torch.utils.data.get_worker_info() is not None:
        # Decoded straight into shared memory, as DataLoader's own collation does: sent to the
        # main process without a copy of the batch (which a tensor in private memory takes).
        decoded.share_memory_()
    for row, path in enumerate(cpu):
        decoded[row] = torch.from_numpy(decode_image(path, (height, width), channels, value_ranges))
    gpu = [data for data in encoded if data is not None]
    on_gpu = [data is not None for data in encoded]
    data = _as_tensor(b"".join(gpu))
    return EncodedBatch(decoded, data, list(map(len, gpu)), on_gpu, list(paths))


def decode_batch(batch: EncodedBatch, shape, device, refused: list | None = None) -> torch.Tensor:
    """A worker's batch -> uint8 (N, H, W, C) on `device`. A batch nvJPEG refuses is decoded
    again on the CPU, which names a bad file (UnreadableImage); if it decodes whole, nvJPEG's
    error is appended to `refused` (the loader's `loader:` line counts them: they slow the run).
    JPEGs of one size are cut and resized in one call."""
    from torchvision.io import ImageReadMode, decode_jpeg

    channels, height, width = shape
    rows = [i for i, gpu in enumerate(batch.on_gpu) if gpu]
    decoded = batch.decoded.to(device, non_blocking=True)
    if not rows:
        return decoded
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    try:
        images = decode_jpeg(list(batch.data.split(batch.sizes)), mode=mode, device=device)
    except RuntimeError as e:  # one bad file fails the batch: the CPU decodes, naming a bad one
        cpu = [decode_image(batch.paths[i], (height, width), channels) for i in rows]
        if refused is not None:  # every file decoded: nvJPEG's own failure
            refused.append(f"{type(e).__name__}: {first_line(e)}")
        images = [torch.from_numpy(pixels).permute(2, 0, 1).to(device) for pixels in cpu]
    by_size: dict[tuple, list[int]] = {}  # the positions in `images` of each source size
    for position, image in enumerate(images):
        by_size.setdefault(tuple(image.shape), []).append(position)
    if len(by_size) == 1 and len(rows) == len(batch.on_gpu):  # every row, one size: no scatter
        return cover_resize(torch.stack(images), height, width).permute(0, 2, 3, 1).contiguous()
    out = torch.empty(
        (len(batch.on_gpu), height, width, channels), dtype=torch.uint8, device=device
    )
    cpu_rows = [i for i, gpu in enumerate(batch.on_gpu) if not gpu]
    for row, pixels in zip(cpu_rows, decoded, strict=True):
        out[row] = pixels
    for positions in by_size.values():
        resized = cover_resize(torch.stack([images[i] for i in positions]), height, width)
        for position, image in zip(positions, resized.permute(0, 2, 3, 1), strict=True):
            out[rows[position]] = image  # an int index: no index tensor copied to the device
    return out
