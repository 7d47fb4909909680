"""Decode once vs decode every epoch: img/s per core at 224 px through the generated loaders.

    python benchmarks/bench_cache.py                 # the table in RESULTS.md (~1-2 min)
    python benchmarks/bench_cache.py --images 200 --repeats 1     # a quick look

Writes --images JPEGs of 500x375 (quality 90, photo-like: gradients plus noise), loads them with
the generated package's `load_dataset("folder", image_size=224)` and times one training epoch
(shuffled, batch 64, drop_last) through its `Loader`, one torch thread, on the CPU:
- stream: `--data-mode stream`, every image decoded again (Pillow: draft, resize, crop) by the
  loader, in the main process (0 workers: one core does everything);
- cache, gather only: `--data-mode memory`, the decoded uint8 cache memory-mapped, the batches as
  the loader's workers hand them over (`raw_batches`: index_select of rows, what a worker does);
- cache, full: the same plus the crop/flip/normalise that runs on the training device (here the
  CPU; on a GPU it runs there, in whole batches);
- memory copy: `torch.Tensor.copy_` of the same bytes, the ceiling of any "slice and copy".
Also the decode into the cache itself (every core, once). Each timing is repeated --repeats times,
interleaved; the best counts, all are listed. The 1-minute load average is printed before and
after: on a shared machine, compare runs only at a similar load.
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
from bench_train import import_package, render_project


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=400, help="JPEGs written (4 classes)")
    p.add_argument("--width", type=int, default=500, help="their width (height: 3/4 of it)")
    p.add_argument("--size", type=int, default=224, help="--image-size of the loaders")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def make_jpegs(root: Path, count: int, width: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    height = width * 3 // 4
    ramp = np.linspace(0, 200, width, dtype=np.float32)[None, :, None]
    for i in range(count):
        pixels = ramp + rng.normal(0, 25, (height, width, 3)).astype(np.float32) + 10 * (i % 4)
        path = root / "train" / f"class{i % 4}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return root


def epoch(loader, raw: bool = False) -> float:
    """img/s of one epoch of `loader` (raw: the uint8 batches, before the device transform)."""
    start = time.perf_counter()
    batches = loader.raw_batches() if raw else loader
    seen = sum(len(y) for _, y in batches)
    return seen / (time.perf_counter() - start)


def copy_rate(images, batch_size: int, rounds: int = 20) -> float:
    """img/s of copying batches of these images' bytes (a plain memcpy into a fresh buffer)."""
    import torch

    src = torch.from_numpy(np.ascontiguousarray(images[:batch_size]))
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(rounds):
        dst.copy_(src)
    return rounds * batch_size / (time.perf_counter() - start)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_cache_"))
    project = render_project(work / "render")
    pkg, package = import_package(project)
    data = __import__(f"{package}.data", fromlist=["load_dataset"])
    loaders = __import__(f"{package}.loaders", fromlist=["Loader"])
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    folder = make_jpegs(work / "folder", args.images, args.width)
    size = (args.size, args.size)

    def load(mode):
        return data.load_dataset("folder", work / "cache", data_path=folder, image_size=size,
                                 mode=mode, val_fraction=0.0001)

    stream = load("stream").splits["train"]
    t0 = time.perf_counter()
    cached = load("memory").splits["train"]  # decodes once, every core
    decode_s = time.perf_counter() - t0
    cores = len(os.sched_getaffinity(0))

    def loader(split):
        return loaders.Loader(split, args.batch_size, train=True, device="cpu", workers=0)

    aug = __import__(f"{package}.augment", fromlist=["crop_flip_gather"])
    batch = cached.images[: args.batch_size].permute(0, 2, 3, 1)
    pad = max(1, args.size // 8)  # augment.py's crop padding: 1/8 of the side
    padded = torch.nn.functional.pad(batch, (0, 0, pad, pad, pad, pad))
    draws = [torch.randint(0, 2 * pad + 1, (len(batch),)) for _ in range(2)]
    draws.append(torch.randint(0, 2, (len(batch),)))

    def crop_ms(cut) -> float:
        start = time.perf_counter()
        cut(padded, *draws, (args.size, args.size))
        return 1000 * (time.perf_counter() - start)

    runs = {k: [] for k in ("stream", "gather", "full", "copy", "crop_gather", "crop_slices")}
    for _ in range(args.repeats):  # interleaved: a load spike hits every variant alike
        runs["stream"].append(epoch(loader(stream)))
        runs["gather"].append(epoch(loader(cached), raw=True))
        runs["full"].append(epoch(loader(cached)))
        runs["copy"].append(copy_rate(cached.images.permute(0, 2, 3, 1).numpy(), args.batch_size))
        runs["crop_gather"].append(crop_ms(aug.crop_flip_gather))
        runs["crop_slices"].append(crop_ms(aug.crop_flip_slices))
    load_after = os.getloadavg()[0]
    best = {k: (min if k.startswith("crop") else max)(v) for k, v in runs.items()}

    print("```")
    cpu = platform.processor() or platform.machine()
    print(f"- device: {cpu}, {cores} cores available, 1 torch thread, no GPU used")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, "
          f"{datetime.date.today()}")
    print(f"- {len(stream)} training JPEGs of {args.width}x{args.width * 3 // 4} -> "
          f"{args.size}x{args.size}, batch {args.batch_size}, one epoch each, best of "
          f"{args.repeats} (interleaved)")
    print(f"- command: python benchmarks/bench_cache.py {' '.join(argv or sys.argv[1:])}")
    print(f"- load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}; "
          f"took {time.perf_counter() - started:.0f} s")
    print("```\n")
    rows = [
        ("stream: decode every epoch (0 workers)", "stream"),
        ("cache: gather only (what a worker does)", "gather"),
        ("cache: gather + crop/flip/normalise on the CPU", "full"),
        ("memory copy of the same bytes (ceiling)", "copy"),
    ]
    print("| data path, 1 core | img/s per core (best) | vs stream | all runs |")
    print("|---|---:|---:|---|")
    for name, key in rows:
        print(f"| {name} | {best[key]:.0f} | {best[key] / best['stream']:.1f}x | "
              f"{', '.join(f'{r:.0f}' for r in runs[key])} |")
    print("| GPU (cache -> pinned -> non_blocking, transform on the GPU) | not yet measured: "
          f"run `python -m {package}.gpucheck` | | |")
    decoded = len(cached.images)  # the cache holds the split before carving (all images)
    print(f"\nDecode once into the cache: {decoded} images in {decode_s:.1f} s with "
          f"{cores} processes ({decoded / decode_s:.0f} img/s, "
          f"{decoded / decode_s / cores:.0f} img/s per core); later starts read it.")
    def listed(key):
        return f"{best[key]:.1f} (all: {', '.join(f'{r:.1f}' for r in runs[key])})"

    print(f"\nRandom crop + flip of one batch ({args.batch_size} x {args.size} px, uint8, one "
          f"thread), ms, best of {args.repeats}: one index_select for the batch (the path on a "
          f"GPU) {listed('crop_gather')}; one slice per image (the CPU path) "
          f"{listed('crop_slices')}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
