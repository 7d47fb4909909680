"""The streamed loader against a plain PIL + DataLoader loop written by hand, img/s per worker.

    python benchmarks/bench_stream.py                       # the table in RESULTS.md
    python benchmarks/bench_stream.py --images 128 --repeats 1     # a quick look

Writes --images JPEGs of 500x375 (gpucheck's folder: smooth photo-like pictures, quality 90) and
reads one training epoch of them (shuffled, batch --batch-size, the ragged last batch dropped)
at --size px on the CPU, with each of --workers DataLoader workers, two ways:
- labrun: `Loader(FileSplit)` streaming, the path `--data-mode stream` takes (imagefolder's
  decode_image in the workers: draft, crop, torch's uint8 antialiased resize);
- by hand: `Dataset.__getitem__` = `Image.open(path).convert("RGB")`, `ImageOps.fit(image,
  (size, size), BILINEAR)` (the same cover + center crop), `np.asarray` -> tensor, and a
  `DataLoader(batch_size, shuffle=True, num_workers, drop_last=True)`: default collation.
Both fork their workers at each epoch's start (on the CPU neither keeps them): one epoch's wall
time, worker start-up included. Two readings: the uint8 batches as the workers hand them over
(labrun's `raw_batches`), and the model's input (float32, normalised: labrun's whole
iteration; by hand `x.permute(0, 3, 1, 2).float()`, minus the mean, over the std). Each timing
--repeats times, interleaved, the best counts; all are listed. torch 1 thread per process.

--gpu (the GPU box, where torchvision imports): on CUDA, labrun's loader as a run picks it
(nvJPEG), the same with the decode left to the workers, and torchvision's ImageFolder +
DataLoader (its PIL loader, Resize(size) + CenterCrop(size) + PILToTensor; pinned, persistent
workers), each to normalised float32 on the device, the same workers. From the repository's
root, after `bash ../shared/gpu/pack.sh` (the project and labrun's wheel into .gpu/):

    bash .gpu/on-device.sh python3 "$PWD/benchmarks/bench_stream.py" --gpu --images 3840 \
        --batch-size 128 --workers 8 15
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=384, help="JPEGs written (3 classes)")
    p.add_argument("--size", type=int, default=224, help="the training size (--image-size)")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts timed")
    p.add_argument("--repeats", type=int, default=3, help="epochs timed per reading")
    p.add_argument("--gpu", action="store_true", help="on CUDA, against torchvision's loader")
    p.add_argument("--folder", type=Path, help="reuse (or write) the JPEGs here")
    return p.parse_args(argv)


def make_jpegs(root: Path, count: int, size=(500, 375), classes: int = 3) -> tuple[list, list]:
    """root/train/<class>/<i>.jpg as gpucheck writes them; (paths, labels)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    paths, labels = [], []
    for i in range(count):
        path = root / "train" / f"class{i % classes}" / f"{i}.jpg"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            image = Image.fromarray(small, "RGB").resize(size, Image.Resampling.BICUBIC)
            image.save(path, quality=90)
        paths.append(str(path))
        labels.append(i % classes)
    return paths, labels


class HandFolder:
    """The hand-written dataset: one image per __getitem__, Pillow end to end."""

    def __init__(self, paths, labels, size: int):
        self.paths, self.labels, self.size = paths, labels, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        import torch
        from PIL import Image, ImageOps

        with Image.open(self.paths[i]) as image:
            fitted = ImageOps.fit(image.convert("RGB"), (self.size,) * 2, Image.Resampling.BILINEAR)
        return torch.from_numpy(np.asarray(fitted).copy()), self.labels[i]


def hand_loader(paths, labels, args, workers: int):
    import torch

    dataset = HandFolder(paths, labels, args.size)
    # A map-style Dataset is all DataLoader needs (no subclass required).
    return torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=workers, drop_last=True
    )


def labrun_loader(paths, labels, args, workers: int, device: str = "cpu"):
    import torch
    from labrun.loaders import FileSplit, Loader

    split = FileSplit(paths, torch.tensor(labels), (3, args.size, args.size))
    return Loader(split, args.batch_size, train=True, device=device, workers=workers, augment=False)


def normalised(x):
    """The hand loop's model input: NCHW float, ImageNet's mean and std."""
    import torch

    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    return (x.permute(0, 3, 1, 2).float() - mean) / std


def epoch_rate(batches) -> float:
    """img/s of one epoch of `batches` (an iterable of (x, y)), worker start-up included."""
    start = time.perf_counter()
    seen = sum(len(y) for _, y in batches)
    return seen / (time.perf_counter() - start)


def cpu_table(paths, labels, args) -> list[str]:
    rows = []
    for workers in args.workers:
        runs = {key: [] for key in ("ours raw", "hand raw", "ours input", "hand input")}
        ours = labrun_loader(paths, labels, args, workers)
        hand = hand_loader(paths, labels, args, workers)
        for _ in range(args.repeats):  # interleaved: a load spike hits both alike
            runs["ours raw"].append(epoch_rate(ours.raw_batches()))
            runs["hand raw"].append(epoch_rate(hand))
            runs["ours input"].append(epoch_rate(ours))
            runs["hand input"].append(epoch_rate((normalised(x), y) for x, y in hand))
        ours.close()
        for what in ("raw", "input"):
            a, b = max(runs[f"ours {what}"]), max(runs[f"hand {what}"])
            listed = ", ".join(
                f"{x / workers:.0f}/{y / workers:.0f}"
                for x, y in zip(runs[f"ours {what}"], runs[f"hand {what}"], strict=True)
            )
            label = "uint8 batches" if what == "raw" else "model input (float32)"
            rows.append(
                f"| {workers} | {label} | {a / workers:.0f} | {b / workers:.0f} | {a / b:.2f}x "
                f"| {listed} |"
            )
    return [
        f"img/s per worker, {len(paths)} JPEGs of 500x375 -> {args.size}x{args.size}, batch "
        f"{args.batch_size}, one epoch, best of {args.repeats}\n",
        "| workers | what the loop gets | labrun Loader | hand PIL + DataLoader | ratio | "
        "all runs (labrun/hand) |",
        "|---:|---|---:|---:|---:|---|",
        *rows,
    ]


def gpu_table(paths, labels, args, root: Path) -> list[str]:
    """On CUDA: labrun's loader as a run picks it (nvJPEG where torchvision decodes on the
    device), the same with the decode left to the workers, and torchvision's own loader; each
    to normalised float32 on the device, the same workers, persistent (as on CUDA both are)."""
    import torch
    import torchvision
    from labrun import gpudecode
    from torchvision import transforms

    tv = transforms.Compose(
        [transforms.Resize(args.size), transforms.CenterCrop(args.size), transforms.PILToTensor()]
    )
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    choose = gpudecode.choose_gpu_decode
    rows = []
    for workers in args.workers:
        folder = torchvision.datasets.ImageFolder(str(root / "train"), transform=tv)
        theirs = torch.utils.data.DataLoader(
            folder, batch_size=args.batch_size, shuffle=True, num_workers=workers,
            drop_last=True, pin_memory=True, persistent_workers=True, prefetch_factor=4,
        )  # fmt: skip
        nvjpeg = labrun_loader(paths, labels, args, workers, device="cuda")
        decoder = nvjpeg.decoder
        try:  # the same loader with the decode left to its workers
            gpudecode.choose_gpu_decode = lambda device: (False, "on the CPU (Pillow): forced")
            cpu = labrun_loader(paths, labels, args, workers, device="cuda")
        finally:
            gpudecode.choose_gpu_decode = choose
        epochs = {  # name -> one epoch's batches
            f"labrun as a run picks it: {nvjpeg.how}": lambda loader=nvjpeg: loader,
            f"labrun, decode forced to the workers: {cpu.how}": lambda loader=cpu: loader,
            "torchvision ImageFolder + DataLoader": lambda loader=theirs: (
                ((x.cuda(non_blocking=True).float() - mean) / std, y) for x, y in loader
            ),
        }
        runs = {name: [] for name in epochs}
        for _ in range(args.repeats):  # the first epoch starts the workers: best of the rest
            for name, epoch in epochs.items():
                runs[name].append(synced_rate(epoch()))
        nvjpeg.close()
        cpu.close()
        tv_best = max(runs["torchvision ImageFolder + DataLoader"])
        for name, rates in runs.items():
            listed = ", ".join(f"{r:.0f}" for r in rates)
            rows.append(
                f"| {workers} | {name} | {max(rates):.0f} | {max(rates) / tv_best:.2f}x "
                f"| {listed} |"
            )
    return [
        f"labrun's `decode:` line: {decoder}\n",
        f"img/s on {torch.cuda.get_device_name()}, {len(paths)} JPEGs of 500x375 -> "
        f"{args.size}px, batch {args.batch_size}, one epoch each, best of {args.repeats}\n",
        "| workers | loader | img/s (best) | vs torchvision | all runs |",
        "|---:|---|---:|---:|---|",
        *rows,
    ]


def synced_rate(batches) -> float:
    import torch

    torch.cuda.synchronize()
    start, seen = time.perf_counter(), 0
    for _, y in batches:
        seen += len(y)
    torch.cuda.synchronize()
    return seen / (time.perf_counter() - start)


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a worker has one thread; the main process gets one core too
    root = args.folder or Path(tempfile.mkdtemp(prefix="bench_stream_"))
    paths, labels = make_jpegs(root, args.images)
    load_before = os.getloadavg()[0]
    table = gpu_table(paths, labels, args, root) if args.gpu else cpu_table(paths, labels, args)
    print("```")
    print(
        f"- device: {cpu_name()}, {len(os.sched_getaffinity(0))} cores available, "
        "1 torch thread per process"
    )
    print(
        f"- torch {torch.__version__}, Python {platform.python_version()}, {datetime.date.today()}"
    )
    print(f"- command: python benchmarks/bench_stream.py {' '.join(argv or sys.argv[1:])}")
    print(f"- load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    print("```\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
