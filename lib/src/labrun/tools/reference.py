"""Two hand-written training loops on the job's model, batch, data and precision: the yardsticks
`python -m labrun.gpucheck` and benchmarks/bench_reference.py hold run.py against (issue 33.5).

  best_practice_rate  what a good engineer writes by hand in an afternoon: the uint8 set on the
                      device, crop + flip and normalisation per batch on the device, channels_last,
                      autocast in the run's precision, fused AdamW, no host sync in the loop,
                      optionally torch.compile (reduce-overhead: CUDA graphs). gpucheck's
                      `ceiling`: the job must reach CEILING_MIN of it.
  naive_rate          a student's first loop with the data already on the device: fp32, eager,
                      NCHW, foreach-less AdamW, `loss.item()` every step. gpucheck's `plain`:
                      the job must not be slower.
(The textbook loop, with per-sample augmentation on the CPU and MLflow every step, is
gpucheck.plain_loop_rate: the third reference.) Both are written out on purpose, without
labrun's machinery, so that a reader sees what each yardstick does; each returns samples/s of
`steps` optimizer steps after `warmup` untimed ones, the device synchronised at both ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..augment import MEAN, STD


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a clock read before it would time only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rate(
    step: Callable[[int], object], *, warmup: int, steps: int, batch_size: int, device
) -> float:
    """samples/s of step(i) for i in warmup..warmup+steps, after `warmup` untimed calls."""
    for i in range(warmup):
        step(i)
    synchronize(device)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    synchronize(device)
    return steps * batch_size / (time.perf_counter() - start)


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
