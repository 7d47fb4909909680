"""Image-folder loading speed and the streamed path's memory (the generated data.py).

    python benchmarks/bench_data.py                      # defaults: the table in RESULTS.md
    python benchmarks/bench_data.py --images 600 --big-images 0     # a quick look

Part 1, throughput: a folder of JPEGs (varied sizes around --source-size, resized to --size on
decode) read as training batches on the CPU: streamed from disk with 0/1/2/4 DataLoader workers,
and in memory (decoded once into the .npy cache, then gathered from RAM). Samples/s of one full
epoch (worker start-up included, as in a run on the CPU), best of --repeats.

Part 2, memory: a folder whose decoded images (--big-images at --big-size) are larger than the
address-space limit (RLIMIT_AS, --limit-mb) given to a child process; the child loads it with
--data-mode auto and streams one epoch. Reported: the mode auto chose, the child's peak RSS
(ru_maxrss) and the peak proportional set size (PSS) of the child and its workers together,
sampled every 20 ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
from bench_train import import_package, render_project


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000, help="images of the throughput folder")
    p.add_argument("--source-size", type=int, default=96, help="typical side of those JPEGs")
    p.add_argument("--size", type=int, default=64, help="--image-size they are resized to")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--big-images", type=int, default=7000,
                   help="images of the memory-test folder (0 skips part 2)")
    p.add_argument("--big-size", type=int, default=256, help="their side (decoded 3 x side^2 B)")
    p.add_argument("--limit-mb", type=int, default=1280, help="RLIMIT_AS of the child process")
    return p.parse_args(argv)


def make_jpegs(root: Path, count: int, side: int, *, vary: bool, classes: int = 4) -> Path:
    """`count` JPEGs (quality 90) of smooth colour gradients plus noise, like photos compress."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        w = h = side
        if vary:
            w, h = (int(side * f) for f in rng.uniform(0.8, 1.25, 2))
        ramp = np.linspace(0, 200, w, dtype=np.float32)[None, :, None]
        pixels = ramp + rng.normal(0, 25, (h, w, 3)).astype(np.float32) + 20 * (i % classes)
        path = root / "train" / f"class{i % classes}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return root


def epoch_rate(pkg, split, batch_size: int, workers: int) -> float:
    loader = pkg.loaders.Loader(split, batch_size, train=True, device="cpu", workers=workers)
    start = time.perf_counter()
    seen = sum(len(y) for _, y in loader)
    return seen / (time.perf_counter() - start)


def throughput(pkg, args, work: Path) -> dict:
    folder = make_jpegs(work / "folder", args.images, args.source_size, vary=True)
    size = (args.size, args.size)
    stream = pkg.data.load_dataset("folder", work / "cache", data_path=folder, image_size=size,
                                   mode="stream")
    rates = {}
    for workers in args.workers:
        runs = [epoch_rate(pkg, stream.splits["train"], args.batch_size, workers)
                for _ in range(args.repeats)]
        rates[f"stream, {workers} workers"] = runs
    t0 = time.perf_counter()
    memory = pkg.data.load_dataset("folder", work / "cache", data_path=folder, image_size=size,
                                   mode="memory", workers=1)
    first_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    pkg.data.load_dataset("folder", work / "cache", data_path=folder, image_size=size,
                          mode="memory")
    cached_load = time.perf_counter() - t0
    rates["memory (decoded .npy cache)"] = [
        epoch_rate(pkg, memory.splits["train"], args.batch_size, 0) for _ in range(args.repeats)]
    return {"rates": rates, "first_load_s": first_load, "cached_load_s": cached_load,
            "train_images": len(stream.splits["train"])}


CHILD = textwrap.dedent("""
    import json, resource, sys, time
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch
    from {package}.data import load_dataset
    from {package}.loaders import Loader
    loaded = load_dataset("folder", sys.argv[2], data_path=sys.argv[3], mode="auto")
    loader = Loader(loaded.splits["train"], 64, train=True, device="cpu", workers=1)
    start = time.perf_counter()
    seen = sum(len(y) for _, y in loader)
    print(json.dumps({{"mode": loaded.mode, "seen": seen,
                      "samples_per_s": seen / (time.perf_counter() - start),
                      "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
""")


GROWTH = textwrap.dedent("""
    import json, sys
    import {package}.data as data
    import {package}.loaders as loaders
    if sys.argv[3] == "off":  # what glibc does by default
        loaders._libc = lambda *args: None  # no mallopt (nor the worker's prctl: no matter here)
    loaded = data.load_dataset("folder", sys.argv[1], data_path=sys.argv[2], mode="stream")
    loader = loaders.Loader(loaded.splits["train"], 64, train=True, device="cpu", workers=1)
    rss = []
    for i, _ in enumerate(loader):
        if i % 10 == 0:
            status = open("/proc/self/status").read()
            rss.append(int(status.split("VmRSS:")[1].split()[0]) // 1024)
        if i == 40:
            break
    print(json.dumps(rss))
""")


def rss_growth(project: Path, package: str, work: Path, folder: Path) -> dict:
    """Main-process RSS (MB) at batches 0, 10, ..., 40, with and without the mmap threshold."""
    result = {}
    for fix in ("on", "off"):
        out = subprocess.run([sys.executable, "-c", GROWTH.format(package=package),
                              str(work / "cache"), str(folder), fix], cwd=project, check=True,
                             capture_output=True, text=True).stdout
        result[fix] = json.loads(out.strip().splitlines()[-1])
    return result


def tree_pss_bytes(pid: int) -> int:
    """PSS of `pid` and its descendants (shared pages counted once, split between sharers)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def streamed_memory(project: Path, package: str, args, work: Path) -> dict:
    folder = make_jpegs(work / "big", args.big_images, args.big_size, vary=False)
    decoded = args.big_images * 3 * args.big_size**2
    limit = args.limit_mb * 2**20
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(package=package), str(limit),
                              str(work / "cache"), str(folder)], cwd=project,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             # glibc's per-thread malloc arenas reserve address space that is
                             # never touched; two arenas keep torch + 1 worker under the limit.
                             env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    peak = 0

    def sample():
        nonlocal peak
        while child.poll() is None:
            peak = max(peak, tree_pss_bytes(child.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = child.communicate()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"child failed:\n{err}")
    result = json.loads(out.strip().splitlines()[-1])
    growth = rss_growth(project, package, work, folder)
    return {**result, "decoded_bytes": decoded, "limit_bytes": limit, "peak_tree_pss": peak,
            "growth": growth}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    # torch warns above 2 workers on 2 cores: measuring exactly that is the point here.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    project = render_project(work / "render")
    pkg, package = import_package(project)
    __import__(f"{package}.data")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    part1 = throughput(pkg, args, work)
    cpu = platform.processor() or platform.machine()
    print("```")
    print(f"- device: {cpu}, {len(os.sched_getaffinity(0))} cores available, "
          f"{torch.get_num_threads()} torch threads, no GPU used")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, "
          f"{datetime.date.today()}")
    print(f"- command: python benchmarks/bench_data.py {' '.join(argv or sys.argv[1:])}")
    print(f"- load average (1 min) before part 1 / after: {load_before:.2f} / "
          f"{os.getloadavg()[0]:.2f}; part 1 took {time.perf_counter() - started:.0f} s")
    print("```")
    print()
    print(f"Throughput: {part1['train_images']} training JPEGs (~{args.source_size} px, varied), "
          f"resized to {args.size}x{args.size}, batch {args.batch_size}, one epoch each\n")
    print("| data path | samples/s (best) | all runs |")
    print("|---|---:|---|")
    for name, runs in part1["rates"].items():
        print(f"| {name} | {max(runs):.0f} | {', '.join(f'{r:.0f}' for r in runs)} |")
    print(f"\nIn memory: first load (decode with 1 worker + write the cache) "
          f"{part1['first_load_s']:.1f} s, later loads (read the cache) "
          f"{part1['cached_load_s']:.2f} s.", flush=True)
    part2 = streamed_memory(project, package, args, work) if args.big_images else None
    if part2:
        print(f"\nStreamed under RLIMIT_AS = {part2['limit_bytes'] / 2**20:.0f} MB: "
              f"{args.big_images} JPEGs of {args.big_size}x{args.big_size}, decoded "
              f"{part2['decoded_bytes'] / 2**20:.0f} MB\n")
        print("| --data-mode auto chose | samples seen | samples/s (1 worker) | peak RSS, main "
              "process | peak PSS, main + workers |")
        print("|---|---:|---:|---:|---:|")
        print(f"| {part2['mode']} | {part2['seen']} | {part2['samples_per_s']:.0f} | "
              f"{part2['maxrss_kb'] / 1024:.0f} MB | {part2['peak_tree_pss'] / 2**20:.0f} MB |")
        print("\nMain-process RSS (MB) at batches 0, 10, 20, 30, 40 of that folder (batch 64, "
              "1 worker), no RLIMIT_AS:\n")
        print("| glibc mmap threshold | RSS (MB) |")
        print("|---|---|")
        print(f"| fixed at 4 MB (data.py) | {', '.join(map(str, part2['growth']['on']))} |")
        print(f"| glibc default (dynamic) | {', '.join(map(str, part2['growth']['off']))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
