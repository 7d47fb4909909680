"""torch.compile where it pays, compiled before the timed loop, DDP around it: what run.py's
`job.compile(model, loss_fn, loader, progress)` does (tools call `compile_model`). The decision
is hardware.decide_compile's, on rank 0; a compiler failure falls back to eager with one
warning. On CUDA it also reads what MFU needs (speed_scale), once per machine and model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import hardware, runs
from .config import PROJECT_ROOT


class Compiled(NamedTuple):
    """What the step calls, and what was decided about it (run.py's make_step reads the first
    three; the job records the rest)."""

    net: object  # the compiled module (or the model) in DDP under torchrun
    ddp: bool  # net is DistributedDataParallel: micro-batches before the last use no_sync()
    cuda_graphs: bool  # each step marks its start (cudagraph_mark_step_begin) for the replays
    mode: str | None  # torch.compile's mode; None: eager
    compile_s: float  # seconds the compile took (0 when eager)
    record: object  # hardware.CompileRecord of this model and machine, or None
    speed: dict  # CUDA: flops_per_sample, peak_flops; gpu_busy when a job recorded it
    busy_record: tuple | None  # (cache, key) where this job's busy share is recorded


def compile_model(model, loss_fn, batch, args, env, *, steps: int, log) -> Compiled:
    """`model` compiled where it pays for `steps` more steps (eager otherwise), in DDP under
    torchrun, compiled already on `batch()` (a real batch). Decided on rank 0, the same on
    every rank; `log` (run.log) says why."""
    dist, device = env.dist, env.device
    decided = (None, 0.0, None)
    if dist.is_main:
        decided = hardware.decide_compile(
            model, loss_fn, batch, args, env, steps=steps, project_root=PROJECT_ROOT, log=log
        )
    mode = dist.decide(decided[0])  # torchrun: rank 0's, on every rank
    speed, busy = ({}, None)
    if device.type == "cuda" and dist.is_main:
        speed, busy = speed_scale(model, batch, loss_fn, env, mode, args.batch_size, log)
    # dynamic=False: every training batch has one shape (the last ragged one is dropped), so the
    # graphs stay static even where this process compiled another shape before (dynamo's
    # automatic dynamic would otherwise trace a symbolic batch size, which CUDA graphs skip).
    net = torch.compile(model, mode=mode, dynamic=False) if mode else model
    compile_s = 0.0
    if mode:
        net, mode, compile_s = _warm(net, model, batch, loss_fn, env, mode, decided, log)
    net = dist.ddp(net)  # torchrun: DistributedDataParallel around the compiled module
    graphs = replays_graphs(device, mode)
    return Compiled(net, dist.active, graphs, mode, compile_s, decided[2], speed, busy)


def replays_graphs(device, mode: str | None) -> bool:
    """Whether a module compiled in `mode` on `device` replays CUDA graphs: each step must then
    mark its start (torch.compiler.cudagraph_mark_step_begin), so that a replay may reuse the
    last step's memory."""
    return device.type == "cuda" and mode in hardware.WITHOUT_GRAPHS


def _warm(net, eager, batch, loss_fn, env, mode, decided, log):
    """Compile `net` on a real batch before the timed loop, and time it: (net, mode, seconds),
    or (eager, None, 0) when the compiler fails. Puts back all it touches (BatchNorm
    statistics, gradients, RNG)."""
    from .train import compiler_errors

    _, eager_s, record = decided
    now, (x, y), cache_before = hardware.timed(env.device), batch(), hardware.compile_cache_counts()
    started = now()
    try:
        compiled_s = hardware.time_forward_backward(net, x, y, loss_fn, env.amp_dtype, now)
    except compiler_errors() as exc:
        why = f"{type(exc).__name__}: {runs.first_line(exc)}"
        log.warning(f"torch.compile failed ({why}); continuing eagerly")
        return eager, None, 0.0
    spent = now() - started - 4 * compiled_s  # the compile, without the timed passes
    if record is not None:
        (hits, misses), (hits_after, misses_after) = cache_before, hardware.compile_cache_counts()
        warm = hits_after > hits and misses_after == misses  # every graph from the cache
        record.save(
            mode, compile_s=spent, warm=warm, eager_step_s=eager_s, compiled_step_s=compiled_s
        )
        log.info(
            f"compiled ({mode}) in {spent:.1f} s ({'warm' if warm else 'cold'} inductor "
            f"cache); forward + backward {1e3 * compiled_s:.1f} ms (eager "
            f"{1e3 * eager_s:.1f} ms); recorded in {record.path}"
        )
    return net, mode, spent


def speed_scale(model, batch, loss_fn, env, mode, batch_size: int, log):
    """What MFU needs (CUDA): the FLOPs of one sample's forward + backward on a real batch
    and this GPU's matmul peak in the run's precision (measured once per machine); the GPU's
    busy share where a job of this model and mode recorded one. ({}, None) when it cannot be
    measured: never fails the run. Returns (speed, where this job records its busy share)."""
    try:
        x, y = batch()
        flops = hardware.flops_per_sample(model, x, y, loss_fn, env.amp_dtype)
        cache = hardware.use_inductor_cache(PROJECT_ROOT)[0]  # the compile records' folder
        peak, when = hardware.matmul_peak(cache, env.device, env.amp_dtype)
    except Exception as exc:  # an op the counter cannot run, no memory for the matmuls
        log.warning(f"MFU not measured ({type(exc).__name__}: {exc})")
        return {}, None
    speed = {"flops_per_sample": flops, "peak_flops": peak}
    dtype = str(env.amp_dtype or "fp32").removeprefix("torch.")
    log.info(
        f"MFU scale: {flops / 1e9:.3g} GFLOP per training sample (forward + backward); "
        f"matmul peak {peak / 1e12:.0f} TFLOP/s in {dtype} ({when})"
    )
    # The busy share: profiled in one job of this model, input and compile mode, then read.
    key = {**hardware.model_key(model, x, env.amp_dtype, env.device), "busy": mode}
    if seen := hardware.read_record(cache, key):
        speed["gpu_busy"] = seen["share"]
        line = hardware.busy_line(seen["share"], seen["step_s"], batch_size)
        log.info(f"{line} (recorded {seen['when']})")
    return speed, (cache, key)
