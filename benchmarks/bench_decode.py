"""Per-image decode time: labrun's decode_image against torchvision's PIL path, same JPEGs.

    python benchmarks/bench_decode.py                  # defaults: the table in RESULTS.md
    python benchmarks/bench_decode.py --images 50      # a quick look

torchvision does not import with this machine's torch build, so its training path is
reproduced with Pillow exactly as torchvision runs it: ImageFolder's loader
(`Image.open(f).convert("RGB")`), RandomResizedCrop(--size) (`get_params` with scale
(0.08, 1) and ratio (3/4, 4/3), then `crop` and `resize`, bilinear) and PILToTensor
(`np.array(copy=True)`, CHW). labrun's path is `imagefolder.decode_image` (oriented, converted
only when needed, the JPEG's DCT downscale where the target allows, the crop cut before torch's
uint8 antialiased resize). Reported: CPU time per image (process_time, so other processes on
a loaded machine count less), the best of --repeats, both paths interleaved in each repeat,
one thread, for JPEGs of each --sources size (quality 90, smooth gradients plus noise).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=150, help="JPEGs per source size")
    p.add_argument("--sources", nargs="+", default=["500x375", "2000x1500"],
                   help="source sizes WxH (500x375: gpucheck's folder; 2000x1500: a photo)")
    p.add_argument("--size", type=int, default=224, help="the training size (--image-size)")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def make_jpegs(folder: Path, count: int, width: int, height: int) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        ramp = np.linspace(0, 200, width, dtype=np.float32)[None, :, None]
        pixels = ramp + rng.normal(0, 25, (height, width, 3)).astype(np.float32) + 5 * (i % 8)
        path = folder / f"{i}.jpg"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(str(path))
    return paths


def torchvision_path(path: str, size: int, rng: random.Random):
    """ImageFolder + RandomResizedCrop(size) + PILToTensor, as torchvision 0.2x runs them."""
    import torch
    from PIL import Image

    with open(path, "rb") as f:  # torchvision.datasets.folder.pil_loader
        image = Image.open(f).convert("RGB")
    width, height = image.size  # RandomResizedCrop.get_params
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.randint(0, height - h), rng.randint(0, width - w)
            break
    else:  # torchvision's fallback: the central crop (the whole image at these ratios)
        top, left, h, w = 0, 0, height, width
    image = image.crop((left, top, left + w, top + h))  # F.resized_crop: crop, then resize
    image = image.resize((size, size), Image.Resampling.BILINEAR)
    pixels = torch.as_tensor(np.array(image, copy=True))  # PILToTensor
    return pixels.view(size, size, 3).permute(2, 0, 1)


def per_image_s(paths, decode, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for path in paths:
            decode(path)
        times.append((time.process_time() - start) / len(paths))
    return times


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from labrun.imagefolder import decode_image

    torch.set_num_threads(1)  # per core: a loader worker has one thread
    work = Path(tempfile.mkdtemp(prefix="bench_decode_"))
    load_before = os.getloadavg()[0]
    rows = []
    for source in args.sources:
        width, height = map(int, source.lower().split("x"))
        paths = make_jpegs(work / source, args.images, width, height)
        rng = random.Random(0)
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved: a load spike hits both alike
            ours += per_image_s(paths, lambda p: decode_image(p, (args.size,) * 2, 3), 1)
            theirs += per_image_s(paths, lambda p, r=rng: torchvision_path(p, args.size, r), 1)
        rows.append((source, min(ours), min(theirs), ours, theirs))
    print("```")
    print(f"- device: {platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} cores available, 1 torch thread, no GPU used")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, "
          f"{datetime.date.today()}")
    print(f"- command: python benchmarks/bench_decode.py {' '.join(argv or sys.argv[1:])}")
    print(f"- load average (1 min) before / after: {load_before:.2f} / "
          f"{os.getloadavg()[0]:.2f}")
    print("```\n")
    print(f"CPU ms per image to a {args.size}x{args.size} uint8 training image ({args.images} "
          f"JPEGs per size, best of {args.repeats})\n")
    print("| source JPEG | labrun decode_image | torchvision's PIL path | ratio | all runs "
          "(labrun / torchvision) |")
    print("|---|---:|---:|---:|---|")
    for source, ours, theirs, all_ours, all_theirs in rows:
        pairs = zip(all_ours, all_theirs, strict=True)
        runs = ", ".join(f"{1e3 * a:.2f}/{1e3 * b:.2f}" for a, b in pairs)
        print(f"| {source} | {1e3 * ours:.2f} | {1e3 * theirs:.2f} | {ours / theirs:.2f}x "
              f"| {runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
