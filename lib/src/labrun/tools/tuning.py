"""Measure before you tune: LR range test, largest batch size, and a profile of training steps.

Used by `run.py --find-lr | --find-batch-size | --profile`; each writes into the run directory
and changes nothing about the run itself.
"""

from __future__ import annotations

import copy
import csv
import itertools
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..data import available_ram_bytes

SMOOTHING = 0.98  # EMA factor of the LR-finder loss (fastai's value: ~50 steps of memory)
DIVERGENCE_FACTOR = 4.0  # stop the range test once the smoothed loss is 4x its best
# Batch-size rule: one default batch size, 128, on every device: the batch size is part of the
# run's identity (it changes the numbers), so a default that followed the device would put the
# same command into different run directories on a laptop and on a GPU node, and a sweep's
# results would stop being comparable. A GPU usually wants more work per launch: CUDA_BATCH_SIZE
# is the *recommendation* `--find-batch-size` prints (capped by what fits, LR scaled by
# sqrt(batch ratio), the usual rule for Adam-type optimizers); you pass it explicitly.
BASE_BATCH_SIZE, BASE_LR = 128, 3e-3
CUDA_BATCH_SIZE = 512


def _cycle_batches(loader: Iterable) -> Iterable:
    """Batches from `loader`, epoch after epoch, for tools that need more steps than one epoch."""
    for epoch in itertools.count():
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader yielded no batches")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Learning-rate range test


def find_lr(
    model: nn.Module,
    loader: Iterable,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    device,
    amp_dtype: torch.dtype | None = None,
    out_dir,
    start_lr: float = 1e-6,
    end_lr: float = 1.0,
    steps: int = 100,
) -> float:
    """LR range test (Smith 2017): train `steps` steps with the LR growing exponentially from
    `start_lr` to `end_lr`, stopping early once the smoothed loss diverges (> 4x its minimum).

    Suggestion rule (`suggest_lr`): the smaller of (1) the LR where the smoothed loss falls
    fastest (most negative slope against log LR) before its minimum and (2) the LR at the
    minimum / 10. The EMA lags the raw loss, which moves (1) to the right; (2) bounds that.
    The model's weights and buffers, the optimizer's state and the torch RNG are restored
    afterwards (`optimizer` is the run's own: any optimizer of the model's parameters).
    Writes `lr_find.csv` (step, lr, loss, smoothed_loss) and `lr_find.png` into `out_dir`.
    """
    device = torch.device(device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    initial_model = copy.deepcopy(model.state_dict())
    was_training = model.training
    rng_state = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    initial_optimizer = copy.deepcopy(optimizer.state_dict())
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    growth = (end_lr / start_lr) ** (1 / max(steps - 1, 1))

    lrs, losses, smoothed = [], [], []
    average, best = 0.0, math.inf
    model.train()
    try:
        for step, (x, y) in zip(range(steps), _cycle_batches(loader), strict=False):
            lr = start_lr * growth**step
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            value = loss.item()  # a sync point every step: fine for a 100-step tool
            average = SMOOTHING * average + (1 - SMOOTHING) * value
            debiased = average / (1 - SMOOTHING ** (step + 1))
            lrs.append(lr)
            losses.append(value)
            smoothed.append(debiased)
            best = min(best, debiased)
            if not math.isfinite(debiased) or debiased > DIVERGENCE_FACTOR * best:
                break
    finally:
        model.load_state_dict(initial_model)
        optimizer.load_state_dict(initial_optimizer)
        model.train(was_training)
        torch.set_rng_state(rng_state)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    suggestion = suggest_lr(lrs, smoothed)
    _write_lr_find(out_dir, lrs, losses, smoothed, suggestion)
    return suggestion


def suggest_lr(lrs: list[float], smoothed: list[float]) -> float:
    """min(LR of steepest descent before the minimum, LR at the minimum / 10), never below the
    first LR tried: the test says nothing about LRs it did not try (a minimum that early means
    the range should start lower)."""
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if not finite:
        return lrs[0]
    lowest = min(finite, key=lambda i: smoothed[i])
    # The first points carry the EMA's start-up noise, which can look like a steep descent.
    skip = max(3, len(lrs) // 10)
    if lowest - skip < 3:  # too few points before the minimum for a meaningful slope
        return max(lrs[0], lrs[lowest] / 10)
    curve = np.asarray(smoothed[skip : lowest + 1])
    slope = np.gradient(curve, np.log(lrs[skip : lowest + 1]))
    return max(lrs[0], min(float(lrs[skip + int(np.argmin(slope))]), lrs[lowest] / 10))


def _write_lr_find(out_dir: Path, lrs, losses, smoothed, suggestion: float) -> None:
    with open(out_dir / "lr_find.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "lr", "loss", "smoothed_loss"])
        writer.writerows(zip(range(len(lrs)), lrs, losses, smoothed, strict=True))
    # Figure without pyplot: no global backend switch, no GUI, safe on a headless node.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 3.0), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(lrs, losses, color="0.75", linewidth=0.8, label="loss")
    ax.plot(lrs, smoothed, color="C0", label="smoothed")
    ax.axvline(suggestion, color="C3", linestyle="--", label=f"suggested {suggestion:.2g}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss", title="LR range test")
    finite = [v for v in smoothed + losses if math.isfinite(v)]
    if finite:  # the divergence spike would flatten the interesting part
        ax.set_ylim(min(finite) * 0.9, min(max(finite), 2 * smoothed[0]) * 1.1)
    ax.legend(fontsize=8)
    fig.savefig(out_dir / "lr_find.png", dpi=150)


# --------------------------------------------------------------------------------------------
# Batch size


def scale_lr(base_lr: float, base_batch: int, new_batch: int, rule: str = "linear") -> float:
    """LR for `new_batch` given a good `base_lr` at `base_batch`.

    "linear": lr * k (Goyal et al. 2017; for SGD, with warm-up), "sqrt": lr * sqrt(k) (keeps the
    gradient-noise scale; the usual choice for Adam), with k = new_batch / base_batch.
    """
    ratio = new_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"unknown LR scaling rule {rule!r}; use 'linear' or 'sqrt'")


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _activation_bytes_per_sample(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of all module outputs of one forward pass, per sample (what backward keeps)."""
    total = 0

    def count(_module, _inputs, output):
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * output.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return total // len(x)


def _try_batch(build_model_fn, batch: int, device, amp_dtype, input_shape, loss_fn, targets):
    """One full training step (forward, backward, AdamW step) at `batch`, on a fresh model."""
    model = build_model_fn().to(device, memory_format=torch.channels_last)
    # AdamW keeps two state tensors per weight: the hungriest common optimizer, so the answer
    # also holds for SGD with momentum.
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, *input_shape, device=device)
    if x.ndim == 4:  # images arrive channels_last; signals, vectors, sequences contiguous
        x = x.contiguous(memory_format=torch.channels_last)
    y = targets[torch.arange(batch) % len(targets)].to(device)  # the task's targets, repeated
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    _sync(device)


def find_batch_size(
    build_model_fn: Callable[[], nn.Module],
    *,
    device,
    amp_dtype: torch.dtype | None = None,
    start: int = 32,
    max_batch: int = 8192,
    input_shape: tuple[int, ...] = (3, 32, 32),
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    targets: torch.Tensor | None = None,
) -> int:
    """Largest power-of-two batch (from `start`, doubling, at most `max_batch`) for which a full
    training step of a fresh model runs in the current precision. `loss_fn` (the task's loss;
    default cross-entropy) is computed on `targets` (the training labels; default 10 classes).

    On CUDA each size is tried until torch.OutOfMemoryError. On the CPU running out of memory
    means the kernel kills the process, so sizes are also capped by a conservative estimate
    (3x the forward activations per sample must fit in half of the available RAM), and the cap
    is printed. The largest size is rarely the fastest to converge: scale the LR (`scale_lr`).
    """
    device = torch.device(device)
    if loss_fn is None:
        loss_fn, targets = nn.functional.cross_entropy, torch.arange(10)
    batch, cap = _power_of_two_at_most(start), _power_of_two_at_most(max_batch)
    if device.type != "cuda":
        probe = build_model_fn().to(device, memory_format=torch.channels_last)
        sample = torch.randn(2, *input_shape, device=device)
        per_sample = 3 * _activation_bytes_per_sample(probe, sample)
        del probe
        available = available_ram_bytes()  # cgroup and Slurm limits too
        if available is not None:
            ram_cap = _power_of_two_at_most(available // 2 // max(per_sample, 1))
            print(
                f"find_batch_size on {device.type}: capped at {min(cap, ram_cap)} by max_batch="
                f"{max_batch} and RAM (~{per_sample / 2**20:.1f} MiB/sample estimated, "
                f"{available / 2**30:.1f} GiB available); no out-of-memory test on the CPU"
            )
            cap = min(cap, ram_cap)
    batch = min(batch, cap)
    largest = 0
    while batch <= cap:
        try:
            _try_batch(build_model_fn, batch, device, amp_dtype, input_shape, loss_fn, targets)
        except torch.OutOfMemoryError:
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # give the failed try's blocks back before the next
        largest, batch = batch, batch * 2
    if largest == 0:
        raise ValueError(f"not even batch {batch} fits on {device}")
    return largest


def recommended_batch_size(device: torch.device) -> int:
    """What --find-batch-size recommends (capped by what fits); not a default (batch-size rule)."""
    return CUDA_BATCH_SIZE if device.type == "cuda" else BASE_BATCH_SIZE


def default_lr(batch_size: int) -> float:
    return BASE_LR * math.sqrt(batch_size / BASE_BATCH_SIZE)


def recommend_batch_size(largest_fitting: int, device) -> tuple[int, float]:
    """The device's recommended batch size (recommended_batch_size, sqrt LR scaling) capped by
    what fits: the (--batch-size, --lr) to pass on this device (not a default: the batch size
    is part of the run's identity, see the batch-size rule above)."""
    batch = min(largest_fitting, recommended_batch_size(torch.device(device)))
    return batch, default_lr(batch)


# --------------------------------------------------------------------------------------------
# Profiler


def start_memory_history(device) -> None:
    """On CUDA, record every allocation from now on (call it before the model is built, so the
    snapshot shows the whole run's memory); `profile_training` dumps and stops it."""
    if torch.device(device).type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)


def profile_training(
    step: Callable[[list], None],
    loader: Iterable,
    *,
    device,
    grad_accum: int = 1,
    scheduler=None,
    out_dir,
    steps: int = 3,
    warmup: int = 2,
) -> str:
    """Profile `steps` whole optimizer steps of run.py's `step` (all `grad_accum` micro-batches,
    clipping, optimizer, EMA) after `warmup` untimed ones (compilation, cuDNN autotuning and
    allocator growth would otherwise dominate).

    A tool: it trains the model (run.py exits afterwards), at a constant LR (`scheduler` is
    held still) so that any run length can be profiled (a one-cycle schedule refuses steps
    beyond its end). Writes `trace.json` (https://ui.perfetto.dev or chrome://tracing) and, on
    CUDA, `memory_snapshot.pickle` (https://pytorch.org/memory_viz; allocations since
    `start_memory_history`) into `out_dir`. Returns the top-10 ops by self time: the loader's
    own ops show up there too, if it is the bottleneck.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device(device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    on_cuda = device.type == "cuda"
    if scheduler is not None:
        scheduler.step = lambda *args, **kwargs: None  # this instance only: a constant LR
    source = iter(_cycle_batches(loader))

    def one_step() -> None:
        step([next(source) for _ in range(grad_accum)])

    try:
        for _ in range(warmup):
            one_step()
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            started = time.perf_counter()
            for i in range(steps):
                with record_function(f"optimizer_step_{i}"):
                    one_step()
            _sync(device)
            wall_s = (time.perf_counter() - started) / steps
        if on_cuda:
            torch.cuda.memory._dump_snapshot(str(out_dir / "memory_snapshot.pickle"))
    finally:
        if on_cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    prof.export_chrome_trace(str(out_dir / "trace.json"))
    sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=10)
    return f"{launches_per_step(prof, steps, wall_s, on_cuda)}\n{table}"


def launches_per_step(prof, steps: int, wall_s: float, on_cuda: bool) -> str:
    """Per step: the kernels launched and the GPU's busy time against the step's (CUDA), or
    the aten ops called (CPU: each a kernel there). A launch-bound step shows many kernels and
    a GPU busy a small share of the step: CUDA graphs (--compile reduce-overhead) then pay."""
    from ..hardware import kernels

    if not on_cuda:
        ops = sum(
            1
            for e in prof.events()
            if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        )
        return f"per step: {ops / steps:.0f} aten ops, {1e3 * wall_s:.2f} ms"
    launched = kernels(prof.events())  # not the optimizer_step_N annotations: 143 % (gpu.md)
    busy_s = sum(e.self_device_time_total for e in launched) / 1e6 / steps
    return (
        f"per step: {len(launched) / steps:.0f} kernels, GPU busy {1e3 * busy_s:.2f} of "
        f"{1e3 * wall_s:.2f} ms ({100 * busy_s / wall_s:.0f} %)"
    )


def run_tools(job, built, step, loss_fn) -> None:
    """What run.py's --find-lr, --find-batch-size and --profile ask: each measures on the job's
    device and precision and prints its answer; files (plots, traces) go to its run directory.
    `built`: what run.py's build returned; `step` is run.py's step, profiled as the run takes
    it; `loss_fn` the step's loss."""
    args, data, out, env = job.args, built.data, job.out, job.env
    on = {"device": env.device, "amp_dtype": env.amp_dtype}  # as the run would train
    if args.find_lr:
        lr = find_lr(built.model, data.train, loss_fn, built.optimizer, out_dir=out, **on)
        print(f"suggested --lr {lr:.3g} (plot in {out})")
    if args.find_batch_size:
        train = data.splits["train"]
        size = find_batch_size(
            lambda: copy.deepcopy(built.model),
            start=args.batch_size,
            max_batch=len(train),
            input_shape=data.info.input_shape,
            loss_fn=loss_fn,
            targets=train.labels,
            **on,
        )
        batch, lr = recommend_batch_size(size, env.device)
        print(
            f"largest batch size that fits: {size}; recommended on this device (pass "
            f"it: the default stays 128): --batch-size {batch} --lr {lr:.3g}"
        )
    if args.profile:
        report = profile_training(
            step,
            data.train,
            device=env.device,
            grad_accum=args.grad_accum,
            scheduler=built.scheduler,
            out_dir=out,
        )
        print(report)
    job.done = True


def capture_step(run_py, argv: list[str]):
    """A project's run.py built for `argv` as far as its step, training nothing, in this
    process and without a run directory: run.py's own `build(args, env)`, compiled where the
    run would compile (`job.compile`'s decision, logged to stderr), and its `make_step`. A
    namespace of what build returns (data, model, optimizer, scheduler, sums...) plus `step`,
    `compiled`, `args`, `env`, `loss_fn`, `batch` (a function: a real batch) and `run_py`: for
    tools that drive the project's own step (gpucheck, benchmarks, tests)."""
    import logging
    import types

    from ..compiling import compile_model
    from ..config import parse_args, use_config
    from ..distributed import Dist
    from ..train import environment, peek_batch

    use_config(run_py.Config)
    args, _ = parse_args(list(argv))
    env, _ = environment(args, Dist())
    loss_fn = env.task.loss
    built = run_py.build(args, env)
    data = built.data
    batch = lambda: peek_batch(data.train, 0, data.layout, env.device)  # noqa: E731
    log = logging.getLogger("labrun.capture_step")
    compiled = compile_model(
        built.model, loss_fn, batch, args, env, steps=data.total_steps, log=log
    )
    step = run_py.make_step(built, compiled, args, env, loss_fn)
    return types.SimpleNamespace(
        **vars(built), step=step, compiled=compiled, args=args, env=env, loss_fn=loss_fn,
        batch=batch, run_py=run_py,
    )  # fmt: skip
