"""JPEGs decoded on the GPU (gpudecode.py), tested on the CPU: the choice with patched
availability, the files left to the CPU, and the batch assembly with a stand-in for
torchvision.io.decode_jpeg that decodes with Pillow (no GPU here: its speed waits for one)."""

from __future__ import annotations

import enum
import io
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from labrun import gpudecode
from labrun.augment import STD
from labrun.data import FileSplit
from labrun.imagefolder import UnreadableImage, cover_resize, decode_image
from labrun.loaders import Loader

SHAPE = (3, 24, 32)  # (C, H, W) of the run


def fake_torchvision_io(calls: list) -> types.ModuleType:
    """torchvision.io's decode_jpeg as nvJPEG's contract: a list of byte tensors in, a list of
    uint8 (C, h, w) out; one bad file fails the whole batch (RuntimeError)."""

    class ImageReadMode(enum.Enum):
        GRAY = "L"
        RGB = "RGB"

    def decode_jpeg(data, mode, device):
        calls.append(len(data))
        if torch.device(device).type == "cuda":  # the choice's probe: a stand-in for the GPU
            device = "cpu"
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
    assert torchvision_io == [2]  # the probe: a batch of two JPEGs decoded on the device
    monkeypatch.setitem(sys.modules, "torchvision.io", None)  # import fails, as here
    use, why = gpudecode.choose_gpu_decode(torch.device("cuda"))
    assert not use and "pip install 'labrun[gpu-decode]'" in why


def test_a_torchvision_that_cannot_decode_on_the_device_leaves_it_to_the_cpu(
    monkeypatch, torchvision_io
):
    """Built without nvJPEG (or another CUDA): it imports, but each batch would fail over to a
    decode in the main process on one core; so the workers decode, and run.log says why."""

    def no_nvjpeg(data, mode, device):
        raise RuntimeError("torchvision not compiled with nvJPEG support")

    monkeypatch.setattr(sys.modules["torchvision.io"], "decode_jpeg", no_nvjpeg)
    use, why = gpudecode.choose_gpu_decode(torch.device("cuda"))
    assert not use and why.startswith("on the CPU (Pillow")
    assert why.endswith("torchvision's decode_jpeg fails on cuda (RuntimeError)")


def test_png_cmyk_16_bit_and_rotated_files_stay_on_the_cpu(files):
    paths = list(files.values())
    batch = gpudecode.read_batch(paths, SHAPE, None)
    on_gpu = {kind for kind, gpu in zip(files, batch.on_gpu, strict=True) if gpu}
    assert on_gpu == {"jpeg", "grey"}
    cpu = [path for kind, path in files.items() if kind not in on_gpu]
    assert len(batch.decoded) == len(cpu)  # only the CPU's rows are decoded and sent
    for row, path in enumerate(cpu):
        assert np.array_equal(batch.decoded[row].numpy(), decode_image(path, SHAPE[1:], 3))
    # the GPU's JPEGs in one buffer (one shared-memory segment per batch), end to end
    jpegs = [Path(files[kind]).read_bytes() for kind in ("jpeg", "grey")]
    assert batch.sizes == list(map(len, jpegs)) and batch.data.numpy().tobytes() == b"".join(jpegs)


def test_a_batch_nvjpeg_fails_whole_is_counted_on_the_loader_line(
    files, monkeypatch, torchvision_io
):
    """Readable JPEGs nvJPEG refuses (its own failure, every batch) are decoded again in the
    main process, on one core: a slow run that must not be silent."""
    monkeypatch.setattr(gpudecode, "choose_gpu_decode", lambda device: (True, "patched"))

    def broken(data, mode, device):
        raise RuntimeError("nvjpegDecodeBatched failed: 7\nmore")

    monkeypatch.setattr(sys.modules["torchvision.io"], "decode_jpeg", broken)
    paths = [files["jpeg"], files["png"], files["grey"], files["jpeg"]]
    split = FileSplit(paths, torch.zeros(len(paths), dtype=torch.long), SHAPE)
    loader = Loader(split, 2, train=False, device="cpu", workers=0)
    assert sum(len(y) for _, y in loader) == 4
    assert loader.nvjpeg_refused == ["RuntimeError: nvjpegDecodeBatched failed: 7"] * 2
    assert loader.wait_line().endswith(
        "; nvJPEG failed on 2 batch(es) of readable JPEGs, decoded again in the main process "
        "(RuntimeError: nvjpegDecodeBatched failed: 7)"
    )


def test_a_worker_decodes_into_shared_memory(files, monkeypatch):
    """As DataLoader's collation does: the batch goes to the main process without a copy (a
    private one is copied into shared memory to be sent: 3.1 ms per 32 images at 224 px)."""
    paths = [files["png"], files["jpeg"]]
    assert not gpudecode.read_batch(paths, SHAPE, None, jpegs=False).decoded.is_shared()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())  # in a worker
    assert gpudecode.read_batch(paths, SHAPE, None, jpegs=False).decoded.is_shared()


def test_jpegs_of_one_size_are_resized_in_one_call(files, tmp_path, monkeypatch, torchvision_io):
    """A camera's photos (one size): one resize per batch, not one per image; same pixels."""
    sizes = []

    def counted(images, height, width):
        sizes.append(len(images))
        return cover_resize(images, height, width)

    monkeypatch.setattr(gpudecode, "cover_resize", counted)
    rng = np.random.default_rng(1)
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"{i}.jpg")
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(paths[-1])
    batch = gpudecode.read_batch(list(map(str, paths)), SHAPE, None)
    images = gpudecode.decode_batch(batch, SHAPE, torch.device("cpu"))
    assert sizes == [5] and images.is_contiguous()
    one_by_one = gpudecode.decode_batch(
        gpudecode.read_batch([str(paths[0]), files["png"]], SHAPE, None), SHAPE, "cpu"
    )
    assert sizes == [5, 1] and torch.equal(one_by_one[0], images[0])


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
    assert batch.on_gpu == [True, True]
    with pytest.raises(UnreadableImage) as gpu:
        gpudecode.decode_batch(batch, SHAPE, torch.device("cpu"))
    with pytest.raises(UnreadableImage) as cpu:
        decode_image(str(cut), SHAPE[1:], 3)
    assert str(gpu.value) == str(cpu.value) and gpu.value.args[0] == str(cut)


def test_the_loader_streams_through_the_gpu_decode(files, monkeypatch, torchvision_io):
    """The whole path (a worker reads bytes, the main process decodes), on the CPU."""
    monkeypatch.setattr(gpudecode, "choose_gpu_decode", lambda device: (True, "patched"))
    paths = list(files.values()) * 2
    split = FileSplit(paths, torch.arange(len(paths)) % 2, SHAPE)
    loader = Loader(split, 4, train=False, device="cpu", workers=1)
    assert loader.gpu_jpegs and loader.decoder.startswith("patched")
    streamed = torch.cat([x for x, _ in loader])
    monkeypatch.setattr(gpudecode, "choose_gpu_decode", lambda device: (False, "cpu"))
    plain = Loader(split, 4, train=False, device="cpu", workers=0)
    expected = torch.cat([x for x, _ in plain])
    assert streamed.shape == expected.shape == (len(paths), 3, 24, 32)
    assert (streamed - expected).abs().max() <= 2 / min(STD) + 1e-5  # 2 levels, normalised
