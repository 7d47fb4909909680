"""Three hand-written training loops on the job's model, batch, data and precision: the yardsticks
`python -m labrun.gpucheck` and benchmarks/bench_reference.py hold run.py against (issue 33.5).

  best_practice_rate  what a good engineer writes by hand in an afternoon: the uint8 set on the
                      device, crop + flip and normalisation per batch on the device, channels_last,
                      autocast in the run's precision, fused AdamW, no host sync in the loop,
                      optionally torch.compile (reduce-overhead: CUDA graphs). gpucheck's
                      `ceiling`: the job must reach CEILING_MIN of it.
  naive_rate          a student's first loop with the data already on the device: fp32, eager,
                      NCHW, foreach-less AdamW, `loss.item()` every step. gpucheck's `plain`:
                      the job must not be slower.
  plain_loop_rate     the textbook loop: per-sample augmentation on the CPU, MLflow every step
                      (gpucheck's `textbook`, info).
Each is written out on purpose, without labrun's machinery, so that a reader sees what each
yardstick does; each returns samples/s of `steps` optimizer steps after `warmup` untimed ones,
the device synchronised at both ends. Their inputs (`synthetic_split`, `default_model`) and
`train_flops_per_sample` serve the benchmarks too (bench_train.py, bench_cpu.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..augment import MEAN, STD
from ..hardware import timed


def timed_rate(
    step: Callable[[int], object], *, warmup: int, steps: int, batch_size: int, device
) -> float:
    """samples/s of step(i) for i in warmup..warmup+steps, after `warmup` untimed calls; the
    clock waits for the device (hardware.timed), so it times the work, not the launches."""
    now = timed(device)
    for i in range(warmup):
        step(i)
    start = now()
    for i in range(warmup, warmup + steps):
        step(i)
    return steps * batch_size / (now() - start)


def best_practice_rate(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int,
    steps: int,
    warmup: int,
    dtype: torch.dtype | None,
    compile_mode: str | None = None,
) -> float:
    """samples/s of the hand-written best-practice loop; `images` uint8 (N, C, H, W) and
    `labels` already on the model's device (their place for the whole run)."""
    step = best_practice_step(model, images, labels, batch_size, dtype, compile_mode)
    device = next(model.parameters()).device
    return timed_rate(step, warmup=warmup, steps=steps, batch_size=batch_size, device=device)


def best_practice_step(model, images, labels, batch_size, dtype, compile_mode=None):
    """best_practice_rate's step(i): batch i (crop + flip on the device), forward, backward,
    fused AdamW."""
    device = next(model.parameters()).device
    model = model.to(memory_format=torch.channels_last).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=5e-4, fused=True)
    # dynamic=False: gpucheck compiles several models and batch sizes in one process; dynamo's
    # automatic dynamic would give the later ones a symbolic batch size.
    net = torch.compile(model, mode=compile_mode, dynamic=False) if compile_mode else model
    mean = torch.tensor(MEAN, device=device).view(1, -1, 1, 1)
    std = torch.tensor(STD, device=device).view(1, -1, 1, 1)
    n, _, height, width = images.shape
    pad = 4

    def batch(order: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = order[i * batch_size : (i + 1) * batch_size]
        x = F.pad(images[index], (pad, pad, pad, pad))  # uint8 on the device
        # One random translation per batch and a per-sample flip: whole-batch ops, no loop.
        dy, dx = torch.randint(0, 2 * pad + 1, (2,), device=device)  # stays on the device
        rows = torch.arange(height, device=device) + dy
        cols = torch.arange(width, device=device) + dx
        x = x.index_select(2, rows).index_select(3, cols)
        flip = torch.rand(len(index), 1, 1, 1, device=device) < 0.5
        x = torch.where(flip, x.flip(3), x)
        x = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        return x, labels[index]

    per_epoch = n // batch_size
    order = torch.randperm(n, device=device)

    def step(i: int) -> None:
        nonlocal order
        if i % per_epoch == 0 and i:
            order = torch.randperm(n, device=device)
        x, y = batch(order, i % per_epoch)
        if compile_mode == "reduce-overhead":  # the last replay's outputs are dead now
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def naive_rate(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    warmup: int,
    steps: int,
    batch_size: int,
) -> float:
    """samples/s of a student's first loop with the data on the device (no augmentation)."""
    step = naive_step(model, images, labels, batch_size)
    device = next(model.parameters()).device
    return timed_rate(step, warmup=warmup, steps=steps, batch_size=batch_size, device=device)


def naive_step(model, images, labels, batch_size):
    """naive_rate's step(i): batch i, forward, backward, AdamW, the loss printed."""
    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=5e-4, foreach=False)
    mean = torch.tensor(MEAN, device=device).view(1, -1, 1, 1)
    std = torch.tensor(STD, device=device).view(1, -1, 1, 1)
    per_epoch = len(labels) // batch_size

    def step(i: int) -> None:
        j = i % per_epoch
        x = (images[j * batch_size : (j + 1) * batch_size].float() - mean) / std
        loss = F.cross_entropy(model(x), labels[j * batch_size : (j + 1) * batch_size])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()  # the printed loss: a host sync every step

    return step


def synthetic_split(n: int, seed: int = 0):
    """n random CIFAR-shaped uint8 images with labels: speed does not depend on content."""
    from ..data import Split

    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen)
    return Split(images, torch.randint(0, 10, (n,), generator=gen))


def default_model(width: int):
    """The model the project's run.py trains by default, built by its own make_model (what the
    student changed there is what the yardsticks train too), on CIFAR-shaped inputs."""
    from types import SimpleNamespace

    from ..config import parse_args, project_run_py

    args, _ = parse_args(["--width", str(width)])
    shape = {"channels": 3, "image_size": (32, 32), "input_shape": (3, 32, 32)}
    return project_run_py()["make_model"](args, SimpleNamespace(num_classes=10, **shape))


def plain_loop_rate(
    split, device, *, batch_size: int, steps: int, warmup: int, tracking_dir: Path, width: int = 64
) -> float:
    """The textbook loop: fp32, NCHW, a per-sample Dataset that converts and augments on the CPU
    (num_workers=0), `loss.item()` and a synchronous `mlflow.log_metric` every step, no
    compile."""
    import mlflow

    class PerSampleDataset(torch.utils.data.Dataset):
        def __init__(self, images, labels):
            self.images, self.labels = images, labels
            self.mean = torch.tensor(MEAN).view(3, 1, 1) / 255
            self.std = torch.tensor(STD).view(3, 1, 1) / 255

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            image = self.images[i].float() / 255  # "ToTensor"
            image = F.pad(image, (4, 4, 4, 4))  # "RandomCrop(32, padding=4)"
            dy, dx = torch.randint(0, 9, (2,)).tolist()
            image = image[:, dy : dy + 32, dx : dx + 32]
            if torch.rand(()) < 0.5:  # "RandomHorizontalFlip"
                image = image.flip(2)
            return (image - self.mean) / self.std, self.labels[i]  # "Normalize"

    loader = torch.utils.data.DataLoader(
        PerSampleDataset(split.images.contiguous(), split.labels),
        batch_size=batch_size,
        shuffle=True,
        num_workers=0,
        drop_last=True,
    )
    model = default_model(width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=5e-4)
    mlflow.set_tracking_uri(f"sqlite:///{tracking_dir / 'plain.db'}")
    mlflow.set_experiment("bench-plain")
    batches = iter(loader)

    def step(i: int) -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mlflow.log_metric("loss", loss.item(), step=i)

    with mlflow.start_run():
        return timed_rate(step, warmup=warmup, steps=steps, batch_size=batch_size, device=device)


def train_flops_per_sample(width: int, device) -> float:
    """FLOPs of one training step (forward + backward) per sample, counted by torch's
    FlopCounterMode (matmuls and convolutions; elementwise ops are not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = default_model(width).to(device)
    x = torch.randn(2, 3, 32, 32, device=device)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 2
