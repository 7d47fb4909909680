"""The training step and its state: optimizer, schedule, EMA, the Trainer; plus evaluation.

The Trainer owns everything that changes on every optimizer step (model, optimizer, scheduler,
GradScaler, EMA, the epoch's running sums) and saves/restores it with `state_dict()` /
`load_state_dict()`. Device, precision and compile choices are made in `hardware.py`.
When to stop (signals, early stopping, a non-finite loss) is stopping.py's.

The step never waits for the device (no host sync, whatever the flags; `gpucheck` proves it on
CUDA with `torch.cuda.set_sync_debug_mode("error")`):
- loss, per-batch loss sum and the task's metric sums (tasks.py) come out of one (compiled, if
  enabled) function; two tiny in-place adds accumulate them on the device; the loop reads them
  once per epoch.
- EMA is a foreach lerp over tensors collected once; its counter is a Python int.
- fp16's GradScaler: fused AdamW takes the inf check on the device; clipping is foreach.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import logging
import math
import random
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from .tasks import Task


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and biases (1-d tensors); fused kernel on CUDA (it also
    does GradScaler's inf check on the device, without a host sync)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, fused=device.type == "cuda")


WARM_UP_FRACTION = 0.15  # of the optimizer steps: the one-cycle LR climbs, then anneals


def build_scheduler(optimizer: torch.optim.Optimizer, lr: float, total_steps: int):
    """One-cycle (Smith & Topin): the LR climbs over the first 15 % of the steps to `lr`, then
    cosine-anneals to ~0 at the last optimizer step.

    Momentum cycles too, deliberately (OneCycleLR's cycle_momentum, as in Smith's one-cycle
    policy and fastai): AdamW's beta1 goes 0.95 -> 0.85 at the LR peak -> 0.95, i.e. less
    momentum while the LR is high. It replaces AdamW's beta1 = 0.9 for the whole run; beta2
    stays 0.999. --lr's help says so.
    """
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=lr,
        total_steps=max(total_steps, 1),
        pct_start=WARM_UP_FRACTION,
        anneal_strategy="cos",
        cycle_momentum=True,
        base_momentum=0.85,
        max_momentum=0.95,
    )


def peak_epoch(total_steps: int, steps_per_epoch: int) -> int:
    """The epoch at whose end the one-cycle LR has passed its peak: early stopping counts only
    from the next one (run.py), so a run never stops while its LR climbs."""
    return math.ceil(WARM_UP_FRACTION * total_steps / max(steps_per_epoch, 1))


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
        pairs = list(
            zip(
                itertools.chain(self.module.parameters(), self.module.buffers()),
                itertools.chain(model.parameters(), model.buffers()),
                strict=True,
            )
        )
        # Collected once: the same tensor objects live for the whole run (load_state_dict
        # copies into them in place).
        self._float = (
            [e.detach() for e, m in pairs if e.is_floating_point()],
            [m.detach() for e, m in pairs if e.is_floating_point()],
        )
        self._other = [(e, m) for e, m in pairs if not e.is_floating_point()]

    def current_decay(self) -> float:
        """The decay of the next update: 0 (a copy) first, then the warm-up toward `decay`."""
        n = self.updates
        return 0.0 if n == 0 else min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        ema, live = self._float
        decay = self.current_decay()
        if decay == 0.0:
            torch._foreach_copy_(ema, live)
        else:
            torch._foreach_lerp_(ema, live, 1 - decay)
        for e, m in self._other:
            e.copy_(m)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]


def build_ema(model: nn.Module, decay: float) -> EMA | None:
    """EMA of the weights (and BatchNorm buffers), or None when decay is 0."""
    return EMA(model, decay) if decay > 0 else None


def build_trainer(
    model: nn.Module,
    args,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    compile_mode: str | None,
    total_steps: int,
    log: logging.Logger,
    task: Task,
) -> Trainer:
    """The Trainer a run's arguments describe: AdamW, one-cycle schedule, EMA, compile; the
    loss and metrics are `task`'s."""
    optimizer = build_optimizer(model, args.lr, args.weight_decay, device)
    return Trainer(
        model,
        optimizer,
        build_scheduler(optimizer, args.lr, total_steps),
        device=device,
        dtype=dtype,
        grad_accum=args.grad_accum,
        clip_grad=args.clip_grad,
        ema=build_ema(model, args.ema),
        task=task,
        compile_mode=compile_mode,
        log=log,
    )


def forward_and_sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype, task: Task):
    """(mean loss, loss summed over the batch, the task's metric sums): the region torch.compile
    sees. The forward runs under autocast; the task's loss is fp32 on its outputs."""
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        outputs = model(x)
    loss = task.loss(outputs, y)
    return loss, loss.detach() * y.shape[0], task.sums(outputs.detach(), y)


def compiler_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "torch.compile could not compile", not "the model is wrong"."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    names = ("InductorError", "OperatorIssue", "CppCompileError", "InvalidCxxCompiler")
    return (
        dynamo_exc.TorchDynamoException,
        *(getattr(inductor_exc, n) for n in names if hasattr(inductor_exc, n)),
    )


class Trainer:
    """One optimizer step: forward/backward of `grad_accum` micro-batches, clip, step, EMA.

    `task` (tasks.py; default: classification) gives the loss and the metric sums.

    `compile_mode` (from hardware.choose_compile) compiles `forward_and_sums`; a compiler error
    during the first step (or `warm_up`) falls back to eager for the rest of the run; any later
    error, and any other error, propagates. Running sums stay on the device; `take_sums()`
    reads them (the one sync point, once per epoch).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        grad_accum: int = 1,
        clip_grad: float = 0.0,
        ema: EMA | None = None,
        task: Task | None = None,
        compile_mode: str | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.dtype, self.ema = device, dtype, ema
        self.grad_accum, self.clip_grad = grad_accum, clip_grad
        self.task = task or default_task()
        self.log = log or logging.getLogger(__name__)
        # fp16 needs loss scaling to keep small gradients; bf16 has fp32's range and does not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.compile(compile_mode)
        self._first_step_done = False
        self.ddp: nn.Module | None = None  # torchrun: the model in DistributedDataParallel
        self.reset_sums()

    @property
    def compiled(self) -> bool:
        return self.compile_mode is not None

    def compile(self, mode: str | None) -> None:
        """Compile the step's forward and loss with torch.compile `mode` (None: eager), before
        the first step (run.py decides after timing eager passes: hardware.compile_if_it_pays)."""
        self.compile_mode = mode
        self.forward = torch.compile(forward_and_sums, mode=mode) if mode else forward_and_sums

    def reset_sums(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.sums: torch.Tensor | None = None  # the task's sums; their length comes with a batch
        self.seen = 0

    def take_sums(self, reduce=None) -> tuple[dict[str, float], int]:
        """{loss, metric...} since the last reset, and the sample count; `reduce` sums them
        over ranks (torchrun). # note: sync point (one per epoch)"""
        return finish(self.task, self.loss_sum, self.sums, self.seen, reduce)

    def _fall_back(self, exc: BaseException) -> None:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.log.warning(
            "torch.compile failed on the first step (%s: %s); continuing eagerly",
            type(exc).__name__,
            first_line,
        )
        self.forward, self.compile_mode = forward_and_sums, None

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        net = self.model if self.ddp is None else self.ddp
        loss, loss_sum, sums = self.forward(net, x, y, self.dtype, self.task)
        self.scaler.scale(loss / self.grad_accum).backward()
        # Counted only once backward succeeded: a compile fallback re-runs this micro-batch.
        self.loss_sum += loss_sum
        # A copy first: a CUDA-graph (max-autotune) output is overwritten by the next replay.
        self.sums = sums.clone() if self.sums is None else self.sums.add_(sums)
        self.seen += y.shape[0]

    def _checked_micro_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        if self._first_step_done or not self.compiled:
            self._micro_step(x, y, step)
            return
        try:  # forward compiles on the first call, backward lazily on the first backward
            self._micro_step(x, y, step)
        except compiler_errors() as exc:
            # A failed forward or backward wrote no .grad, so earlier micro-batches' gradients
            # are intact: re-run only this one, eagerly.
            self._fall_back(exc)
            self._micro_step(x, y, step)

    def step(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
        """One optimizer step over `grad_accum` micro-batches. `step` counts from 1."""
        for i, (x, y) in enumerate(micro_batches):
            # DDP all-reduces the gradients once, on the last micro-batch (nanoGPT's habit).
            quiet = self.ddp is not None and i < self.grad_accum - 1
            with self.ddp.no_sync() if quiet else contextlib.nullcontext():
                self._checked_micro_step(x, y, step)
        self._first_step_done = True
        if self.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)  # frees grad memory; no memset kernel
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update()

    def warm_up(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Compile forward and backward on one batch before the timed loop, then put back
        everything it touched (BatchNorm statistics, gradients, RNG): the run continues as if
        it had not happened. A no-op when eager. Time it from outside (compile_time_s)."""
        if not self.compiled or self._first_step_done:
            return
        with self._put_back():
            try:
                self._forward_backward(x, y)
            except compiler_errors() as exc:
                self._fall_back(exc)
        self._first_step_done = True

    def time_forward_backward(self, x: torch.Tensor, y: torch.Tensor, now, repeats: int = 3):
        """Seconds of one micro-batch's forward + backward (the part torch.compile speeds up),
        the best of `repeats` after one untimed pass; `now` is a clock that waits for the device
        (hardware.timed). Puts back everything it touched, like `warm_up`."""
        with self._put_back():
            self._forward_backward(x, y)  # untimed: allocator growth, cuDNN autotuning
            best = float("inf")
            for _ in range(repeats):
                start = now()
                self._forward_backward(x, y)
                best = min(best, now() - start)
        return best

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss, _, _ = self.forward(self.model, x, y, self.dtype, self.task)
        self.scaler.scale(loss / self.grad_accum).backward()

    @contextlib.contextmanager
    def _put_back(self):
        """Restore what trial passes change: BatchNorm statistics, gradients, RNG."""
        buffers = [b.detach().clone() for b in self.model.buffers()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        try:
            yield
        finally:
            with torch.no_grad():
                for live, saved in zip(self.model.buffers(), buffers, strict=True):
                    live.copy_(saved)
            self.model.zero_grad(set_to_none=True)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)

    def state_dict(self) -> dict:
        """Everything the step changes; tensors as they are (torch.save copies them out)."""
        sums = {"loss_sum": self.loss_sum, "sums": self.sums, "seen": self.seen}
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "precision": self.precision(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "sums": sums,
        }

    def precision(self) -> dict:
        """What the checkpoint records of the arithmetic: the autocast dtype and the scaler."""
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}
        autocast = names.get(self.dtype, str(self.dtype))
        return {"autocast": autocast, "grad_scaler": self.scaler.is_enabled()}

    def _load_scaler(self, state: dict) -> None:
        """Continue under this run's precision, whatever the checkpoint's (a requeue may land
        on a GPU without bf16, or with it): the GradScaler's state is taken over when both use
        one, dropped when this run needs none, and started afresh when only this run needs one
        (its first steps then find the scale again). run.log says which."""
        # Checkpoints from before "precision" was recorded: a GradScaler saves {} when disabled.
        then = state.get("precision") or {"autocast": None, "grad_scaler": bool(state["scaler"])}
        now = self.precision()
        if then["autocast"] not in (None, now["autocast"]):
            self.log.warning(
                "precision: the checkpoint was written under %s, this run continues under %s",
                then["autocast"],
                now["autocast"],
            )
        if then["grad_scaler"] and now["grad_scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        elif then["grad_scaler"]:
            self.log.warning("precision: the checkpoint's GradScaler state is dropped (not needed)")
        elif now["grad_scaler"]:
            self.log.warning(
                "precision: a new GradScaler starts at scale %g (the checkpoint had none)",
                self.scaler.get_scale(),
            )

    def load_state_dict(self, state: dict) -> None:
        """Strict: a model whose keys or shapes differ raises CheckpointError."""
        from .checkpoint import CheckpointError, load_model_state

        load_model_state(self.model, state["model"], "the checkpoint's model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._load_scaler(state)
        if (state["ema"] is None) != (self.ema is None):
            raise CheckpointError("the checkpoint's EMA setting differs from this run's")
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        sums = state["sums"]
        self.loss_sum = sums["loss_sum"].to(self.device, torch.float32)
        if "correct" in sums:  # written before tasks: the classification count
            sums["sums"] = sums["correct"].reshape(1)
        task_sums = sums["sums"]
        self.sums = None if task_sums is None else task_sums.to(self.device, torch.float64)
        self.seen = sums["seen"]


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    task: Task | None = None,
    reduce=None,
) -> dict[str, float]:
    """{loss, metric...} of `task` over a loader, in eval mode; one host sync at the end.
    `reduce` sums the sums over ranks (torchrun: each rank evaluated its shard)."""
    task = task or default_task()
    was_training = model.training
    model.eval()
    loss_sum, sums, seen = torch.zeros((), device=device), None, 0
    for x, y in loader:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            outputs = model(x)
        loss_sum += (task.eval_loss or task.loss)(outputs, y) * y.shape[0]
        batch_sums = task.sums(outputs, y)
        sums = batch_sums if sums is None else sums.add_(batch_sums)
        seen += y.shape[0]
    model.train(was_training)
    return finish(task, loss_sum, sums, seen, reduce)[0]  # note: sync point (one per evaluation)


def finish(
    task: Task, loss_sum: torch.Tensor, sums: torch.Tensor | None, seen: int, reduce=None
) -> tuple[dict[str, float], int]:
    """({loss, metric...}, samples) from the device sums: one host read of loss, sums and count
    together, after `reduce` (torchrun: their sum over ranks, one all_reduce)."""
    if sums is None:  # nothing was seen
        return {"loss": float("nan"), **dict.fromkeys(task.metrics, float("nan"))}, 0
    count = torch.full((1,), float(seen), dtype=torch.float64, device=sums.device)
    total = torch.cat([loss_sum.double().reshape(1), sums.double(), count])
    total = (reduce(total) if reduce is not None else total).cpu().numpy()
    seen = int(total[-1])
    metrics = task.finish(total[1:-1], seen)
    values = {k: float(metrics[k]) for k in task.metrics}
    return {"loss": float(total[0] / max(seen, 1)), **values}, seen


def default_task() -> Task:
    """Classification without label smoothing: for callers that name no task."""
    from .tasks import create_task

    return create_task("classification", argparse.Namespace(label_smoothing=0.0))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
