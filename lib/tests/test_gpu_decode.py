"""JPEGs decoded on the GPU (gpudecode.py), tested on the CPU: the choice with patched
availability, the files left to the CPU, and the batch assembly with a stand-in for
torchvision.io.decode_jpeg that decodes with Pillow (no GPU here: its speed waits for one)."""

from __future__ import annotations

import enum
import io
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from labrun import gpudecode
from labrun.augment import STD
from labrun.data import FileSplit, build_loader
from labrun.imagefolder import UnreadableImage, decode_image

SHAPE = (3, 24, 32)  # (C, H, W) of the run


def fake_torchvision_io(calls: list) -> types.ModuleType:
    """torchvision.io's decode_jpeg as nvJPEG's contract: a list of byte tensors in, a list of
    uint8 (C, h, w) out; one bad file fails the whole batch (RuntimeError)."""

    class ImageReadMode(enum.Enum):
        GRAY = "L"
        RGB = "RGB"

    def decode_jpeg(data, mode, device):
        calls.append(len(data))
        out = []
        for encoded in data:
            try:
                with Image.open(io.BytesIO(encoded.numpy().tobytes())) as image:
                    pixels = np.array(image.convert(mode.value))
            except OSError as e:
                raise RuntimeError(f"nvjpeg: {e}") from e
            out.append(torch.from_numpy(pixels.reshape(*pixels.shape[:2], -1)).permute(2, 0, 1))
        return [image.to(device) for image in out]

    module = types.ModuleType("torchvision.io")
    module.ImageReadMode, module.decode_jpeg = ImageReadMode, decode_jpeg
    return module


@pytest.fixture
def torchvision_io(monkeypatch):
    calls = []
    package = types.ModuleType("torchvision")
    package.io = fake_torchvision_io(calls)
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.io", package.io)
    return calls


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One of each kind: the GPU takes the upright 8-bit JPEGs, the CPU the rest."""
    root = tmp_path_factory.mktemp("kinds")
    rng = np.random.default_rng(0)
    # 40x30: less than twice the run's 32x24, so the CPU decodes every pixel too (no draft)
    rgb = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((40, 30))
    kinds = {}
    rgb.save(kinds.setdefault("jpeg", root / "a.jpg"), quality=95)
    rgb.convert("L").save(kinds.setdefault("grey", root / "g.jpg"), quality=95)
    rgb.save(kinds.setdefault("png", root / "p.png"))
    rgb.convert("CMYK").save(kinds.setdefault("cmyk", root / "c.jpg"), quality=95)
    exif = rgb.getexif()
    exif[0x0112] = 6  # rotated: the CPU applies it
    rgb.save(kinds.setdefault("rotated", root / "r.jpg"), exif=exif, quality=95)
    deep = (np.asarray(rgb.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    Image.fromarray(deep).save(kinds.setdefault("16-bit", root / "d.png"))
    return {kind: str(path) for kind, path in kinds.items()}


def test_the_choice_needs_cuda_and_an_importable_torchvision(monkeypatch, torchvision_io):
    use, why = gpudecode.choose_gpu_decode(torch.device("cpu"))
    assert not use and why.endswith("no CUDA device")
    use, why = gpudecode.choose_gpu_decode(torch.device("cuda"))
    assert use and why.startswith("on the GPU (nvJPEG")
    monkeypatch.setitem(sys.modules, "torchvision.io", None)  # import fails, as here
    use, why = gpudecode.choose_gpu_decode(torch.device("cuda"))
    assert not use and "pip install 'labrun[gpu-decode]'" in why


def test_png_cmyk_16_bit_and_rotated_files_stay_on_the_cpu(files):
    paths = list(files.values())
    batch = gpudecode.read_batch(paths, SHAPE, None)
    on_gpu = {kind for kind, data in zip(files, batch.encoded, strict=True) if data is not None}
    assert on_gpu == {"jpeg", "grey"}
    for row, (kind, path) in enumerate(files.items()):
        expected = 0 if kind in on_gpu else decode_image(path, SHAPE[1:], 3)
        assert np.array_equal(batch.decoded[row].numpy(), np.broadcast_to(expected, (24, 32, 3)))


def test_a_batch_decodes_to_the_cpu_paths_pixels(files, torchvision_io):
    paths = list(files.values())
    batch = gpudecode.read_batch(paths, SHAPE, None)
    images = gpudecode.decode_batch(batch, SHAPE, torch.device("cpu"))
    assert torchvision_io == [2]  # one call for the batch's JPEGs
    assert images.shape == (len(paths), 24, 32, 3) and images.dtype == torch.uint8
    for row, path in enumerate(paths):
        cpu = torch.from_numpy(decode_image(path, SHAPE[1:], 3)).int()
        assert (images[row].int() - cpu).abs().max() <= 2, path


def test_a_jpeg_nvjpeg_refuses_is_named_as_the_cpu_path_names_it(files, tmp_path, torchvision_io):
    cut = tmp_path / "cut.jpg"
    with open(files["jpeg"], "rb") as whole:
        data = whole.read()
    cut.write_bytes(data[: data.index(b"\xff\xda") + 20])  # the header reads, the scan not
    batch = gpudecode.read_batch([files["jpeg"], str(cut)], SHAPE, None)
    assert batch.encoded[1] is not None
    with pytest.raises(UnreadableImage) as gpu:
        gpudecode.decode_batch(batch, SHAPE, torch.device("cpu"))
    with pytest.raises(UnreadableImage) as cpu:
        decode_image(str(cut), SHAPE[1:], 3)
    assert str(gpu.value) == str(cpu.value) and gpu.value.path == str(cut)


def test_the_loader_streams_through_the_gpu_decode(files, monkeypatch, torchvision_io):
    """The whole path (a worker reads bytes, the main process decodes), on the CPU."""
    monkeypatch.setattr(gpudecode, "choose_gpu_decode", lambda device: (True, "patched"))
    paths = list(files.values()) * 2
    split = FileSplit(paths, torch.arange(len(paths)) % 2, SHAPE)
    loader = build_loader(split, 4, train=False, device="cpu", workers=1)
    assert loader.gpu_jpegs and loader.decoder.startswith("patched")
    streamed = torch.cat([x for x, _ in loader])
    monkeypatch.setattr(gpudecode, "choose_gpu_decode", lambda device: (False, "cpu"))
    plain = build_loader(split, 4, train=False, device="cpu", workers=0)
    expected = torch.cat([x for x, _ in plain])
    assert streamed.shape == expected.shape == (len(paths), 3, 24, 32)
    assert (streamed - expected).abs().max() <= 2 / min(STD) + 1e-5  # 2 levels, normalised
