"""The verbs run.py's method calls with its own objects, and what they return: the environment
(device, precision, task, torchrun), the data, the step's device-side sums, evaluation, a real
batch to probe with; and the pieces the same in every project (EMA, the LR peak, seeding).
None of them holds the method's objects: run.py passes them and keeps what comes back.

The step never waits for the device (no host sync, whatever the flags; `gpucheck` proves it on
CUDA with `torch.cuda.set_sync_debug_mode("error")`): the loss and the task's metric sums are
added up on the device (TrainSums) and read once per epoch; EMA is a foreach lerp over
tensors collected once, its counter a Python int; fp16's GradScaler: fused AdamW takes the inf
check on the device; clipping is foreach.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .config import UsageError
from .tasks import Task


class Env(NamedTuple):
    """Where and how a job computes (`job.env`): what run.py's build and step read."""

    device: torch.device
    amp_dtype: torch.dtype | None  # autocast's: bf16 or fp16 by the GPU's capability; None: fp32
    task: Task  # --task: the loss, the device-side metric sums, the monitored metric
    dist: object  # distributed.Dist: torchrun's processes (one without torchrun)


def environment(args, dist) -> tuple[Env, list[tuple[str, str]]]:
    """The job's Env from its flags, and what run.log says of it (precision, kernels). Bad input
    (a --device without one, a --batch-size the processes cannot share): ValueError/UsageError."""
    from .hardware import choose_precision, resolve_device, setup_backends
    from .tasks import create_task

    task = create_task(args.task, args, args.monitor)
    dist.check(args)  # a --batch-size that does not divide among the processes: exit 2
    device = dist.place(resolve_device(args.device))
    amp_dtype, precision = choose_precision(device, args.amp)
    kernels = setup_backends(device, args.deterministic)
    return Env(device, amp_dtype, task, dist), [("precision", precision), ("kernels", kernels)]


class Data(NamedTuple):
    splits: dict
    train: object  # loaders.Loader: batches on the device, an order that is f(seed, epoch)
    val: object
    test: object
    steps_per_epoch: int  # optimizer steps: a trailing remainder of < grad_accum is skipped
    total_steps: int  # of the whole run: epochs x steps per epoch, or --max-steps
    last_epoch: int  # the epoch the run's last step falls in (--max-steps may end it sooner)
    layout: torch.memory_format  # channels_last for images (the loaders'), else contiguous
    info: object  # data.DatasetInfo: classes, channels, image size, class names, split sizes
    notes: list  # (what, why) for run.log: sizes, inputs, decoding, layout, memory
    warnings: list  # what the dataset has to say (skipped files): run.log's warnings


def load_data(args, env: Env, make_model) -> Data:
    """Splits and loaders on env.device (pinned memory + non_blocking copies, or the whole set
    resident on the GPU). `make_model(args, info)` (run.py's) is built on the meta device first
    (an --image-size it cannot take, before any decoding) and after (a model or batch too big
    for the free memory): UsageError, exit 2. Seeds everything afterwards: the same seed gives
    the same init, split, order and augmentation."""
    from .data import check_batch_size, load_dataset
    from .hardware import choose_gpu_resident
    from .loaders import Loader
    from .preflight import check_memory, check_model_fits

    check_model_fits(args, make_model)  # an --image-size the model cannot take: before decoding
    # The flags of the same name: data_version is the one in the run's identity, task picks
    # among a dataset's kinds of targets, augment/crop/crop_* what the training loader does.
    same = ("data_path", "image_size", "val_fraction", "seed", "synthetic_size", "workers")
    same += ("data_version", "task", "augment", "crop", "crop_scale", "crop_ratio")
    loaded = load_dataset(
        args.dataset,
        args.data_dir,
        mode=args.data_mode,
        spatial_targets=env.task.spatial_targets,  # crop/flip would not move the targets
        **{name: getattr(args, name) for name in same},
    )
    splits, info, dist = loaded.splits, loaded.info, env.dist
    # Only decoded in-memory data can live on the GPU; streamed files come through workers.
    in_memory = loaded.mode == "memory"
    resident = in_memory and choose_gpu_resident(args.gpu_resident, env.device, splits)
    loaders = {
        name: Loader(
            split,
            args.batch_size,
            train=name == "train",
            device=env.device,
            workers=args.workers,
            gpu_resident=resident,
            seed=args.seed,
            augment=info.augmentation,  # used by the training loader only
            shard=(dist.rank, dist.world),
        )
        for name, split in splits.items()
    }
    # torchrun: a rank with no sample of a split would skip its final all-reduce
    dist.check_splits({name: len(split) for name, split in splits.items()})
    steps_per_epoch = len(loaders["train"]) // args.grad_accum
    check_batch_size(len(splits["train"]), args.batch_size, args.grad_accum)  # small data
    if len(splits["val"]) == 0:
        raise UsageError("--val-fraction: the validation split is empty; raise it")
    seed_everything(args.seed)
    total = steps_per_epoch * args.epochs
    total = min(total, args.max_steps) if args.max_steps else total
    last_epoch = min(args.epochs, math.ceil(total / max(steps_per_epoch, 1)))
    config = info.as_config()  # num_classes, channels, image_size, class names, split sizes...
    version = args.data_version or config.get("data_content")
    sizes = f"{config['split_sizes']} samples (train/val/test) | {version}"
    # dtype and shape, normalisation, augmentation: what was done to the inputs, and why
    notes = [("data", sizes), *info.describe().items()]
    if getattr(loaders["train"], "decoder", ""):  # streamed files: on the GPU or the CPU
        notes.append(("decode", loaders["train"].decoder))
    # The layout the step trains in: channels_last is the one tensor cores convolve in, and the
    # one the loaders deliver images in (no copy per batch on a CPU); contiguous otherwise.
    shape = tuple(info.input_shape) or (info.channels, *info.image_size)
    if len(shape) == 3 and info.layout == "NCHW":
        layout, why = torch.channels_last, "channels_last (images)"
    else:
        layout, why = torch.contiguous_format, "contiguous (the inputs are not images)"
    notes.append(("layout", why))
    # A model or batch too big for the free memory is refused here (exit 2), not ended by the
    # OOM killer (preflight.py)
    micro = max(1, args.batch_size // dist.world)
    needs = check_memory(args, info, env.device, env.amp_dtype, make_model, micro_batch=micro)
    notes.append(("memory", needs))
    train, val, test = (loaders[k] for k in ("train", "val", "test"))
    steps = (steps_per_epoch, total, last_epoch)
    return Data(splits, train, val, test, *steps, layout, info, notes, loaded.notes)


def peek_batch(loader, epoch: int, layout, device: torch.device):
    """A training batch exactly as the loop gets it in `epoch` (shape, dtype, strides in
    `layout`), without shifting the run: the loader's order is f(seed, epoch) and the loop sets
    the epoch again; the RNG draws of the augmentation are put back. Read in this process
    (Loader.peek): no loader worker is started for it."""
    from .checkpoint import rng_state, set_rng_state

    saved = rng_state(device)
    loader.set_epoch(epoch)
    try:
        x, y = loader.peek()
        return (x.contiguous(memory_format=layout) if x.dim() == 4 else x), y
    finally:
        set_rng_state(saved, device)


class TrainSums:
    """The epoch's training loss and the task's metric sums, accumulated on the device (no host
    sync in the step: run.py's step calls add); read once per epoch by `take()` (job.end_epoch).
    Checkpointed by its state_dict, like every object run.py gives job.resume."""

    def __init__(self, task: Task, device: torch.device) -> None:
        self.task, self.device = task, device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.sums: torch.Tensor | None = None  # the task's sums; their length comes with a batch
        self.seen = 0

    def add(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one micro-batch: `loss` its mean loss, `outputs` the model's outputs."""
        self.loss_sum.add_(loss.detach(), alpha=targets.shape[0])  # one kernel, not two
        sums = self.task.sums(outputs.detach(), targets)
        # A copy first: a CUDA-graph (max-autotune) output is overwritten by the next replay.
        self.sums = sums.clone() if self.sums is None else self.sums.add_(sums)
        self.seen += targets.shape[0]

    def take(self, reduce=None) -> tuple[dict[str, float], int]:
        """({loss, metric...}, samples) since the last reset, from the device sums: one host read
        of loss, sums and count together, after `reduce` (torchrun: their sum over ranks, one
        all_reduce). # note: sync point (one per epoch, one per evaluation)"""
        task, sums = self.task, self.sums
        if sums is None:  # nothing was seen
            return {"loss": float("nan"), **dict.fromkeys(task.metrics, float("nan"))}, 0
        count = torch.full((1,), float(self.seen), dtype=torch.float64, device=sums.device)
        total = torch.cat([self.loss_sum.double().reshape(1), sums.double(), count])
        total = (reduce(total) if reduce is not None else total).cpu().numpy()
        seen = int(total[-1])
        metrics = task.finish(total[1:-1], seen)
        values = {k: float(metrics[k]) for k in task.metrics}
        return {"loss": float(total[0] / max(seen, 1)), **values}, seen

    def state_dict(self) -> dict:
        return {"loss_sum": self.loss_sum, "sums": self.sums, "seen": self.seen}

    def load_state_dict(self, sums: dict) -> None:
        self.loss_sum = sums["loss_sum"].to(self.device, torch.float32)
        if "correct" in sums:  # written before tasks: the classification count
            sums["sums"] = sums["correct"].reshape(1)
        self.sums = None if sums["sums"] is None else sums["sums"].to(self.device, torch.float64)
        self.seen = sums["seen"]


def lr_peak_step(scheduler) -> float:
    """The optimizer step at which `scheduler`'s LR peaks: early stopping counts only from the
    epoch after it (a run never stops while its LR climbs). OneCycleLR: the end of its warm-up
    (`pct_start` x total steps); any other schedule (or none): 0."""
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        return scheduler._schedule_phases[0]["end_step"] + 1  # OneCycleLR: pct_start x total
    return 0.0


def peak_epoch(peak_step: float, steps_per_epoch: int) -> int:
    """The epoch at whose end the LR has passed its peak."""
    return math.ceil(peak_step / max(steps_per_epoch, 1))


class EMA:
    """Exponential moving average of the weights and float buffers (BatchNorm statistics).

    The first update copies the weights (the random initialisation never enters the average);
    update n >= 1 does `ema = d_n * ema + (1 - d_n) * weight` as one foreach lerp, with the
    warm-up `d_n = min(decay, (1 + n) / (10 + n))` of timm and TensorFlow: without it, 0.999
    keeps 0.999**n of the first weights in the average, 82 % after 200 updates.
    Same arithmetic as `AveragedModel(model, multi_avg_fn=<that lerp>, use_buffers=True)` for
    float tensors (tested). Unlike AveragedModel it keeps its update count as a Python int
    (AveragedModel copies a CPU counter to the device every update: a blocking copy) and copies
    integer buffers instead of averaging them. The count is in `state_dict()`: a resumed run
    continues the warm-up exactly.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        ema = [*self.module.parameters(), *self.module.buffers()]
        pairs = list(zip(ema, [*model.parameters(), *model.buffers()], strict=True))
        # Collected once: the same tensor objects live for the whole run (load_state_dict
        # copies into them in place).
        floats = [(e.detach(), m.detach()) for e, m in pairs if e.is_floating_point()]
        self._float = ([e for e, _ in floats], [m for _, m in floats])
        self._other = [(e, m) for e, m in pairs if not e.is_floating_point()]

    def current_decay(self) -> float:
        """The decay of the next update: 0 (a copy) first, then the warm-up toward `decay`."""
        n = self.updates
        return 0.0 if n == 0 else min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        ema, live = self._float
        # decay 0 (the first update): lerp's weight 1 computes live - (live - ema) * 0, the copy
        torch._foreach_lerp_(ema, live, 1 - self.current_decay())
        for e, m in self._other:
            e.copy_(m)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]


def compiler_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "torch.compile could not compile", not "the model is wrong"."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    names = ("InductorError", "OperatorIssue", "CppCompileError", "InvalidCxxCompiler")
    return (
        dynamo_exc.TorchDynamoException,
        *(getattr(inductor_exc, n) for n in names if hasattr(inductor_exc, n)),
    )


def evaluate(model: nn.Module, loader: Iterable, loss_fn, env: Env) -> dict[str, float]:
    """{loss, metric...} of env.task over `loader` in eval mode, in the run's precision, summed
    on the device as the step's are (TrainSums); `loss_fn` is the loss to report (run.py's: the
    task's, without label smoothing). Torchrun: each rank evaluates its shard and the sums are
    summed over ranks (BatchNorm statistics first taken from rank 0 on a CPU). One host sync,
    at the end."""
    env.dist.sync_buffers(model)  # CPU torchrun: rank 0's BatchNorm statistics
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        sums = TrainSums(env.task, env.device)
        for x, y in loader:
            with torch.autocast(env.device.type, env.amp_dtype, enabled=env.amp_dtype is not None):
                outputs = model(x)
            sums.add(loss_fn(outputs, y), outputs, y)
        model.train(was_training)
        return sums.take(env.dist.sum)[0]  # note: sync point (one per evaluation)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
