"""The pieces of a training loop that a second entry point (a notebook, a sweep helper) reuses.

Policy (why each default is what it is):
- AMP: bf16 autocast on CUDA where supported, else fp16 with a GradScaler. Off on CPU by default:
  without native bf16 (AVX512-BF16/AMX) bf16 autocast is 6-9x *slower* on CPU.
- torch.compile: on for CUDA (~10-30 % faster steps), off on CPU by default (13-24 s to compile on
  2 cores for ~15 %). If compilation fails we warn and continue eagerly.
- cudnn.benchmark + TF32 on CUDA unless --deterministic.
- The train step never synchronises with the host: losses and correct counts accumulate in device
  tensors that the loop reads once per epoch.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

INJECT_NAN_ENV = "LAB_INJECT_NAN_AT_STEP"  # test hook, see inject_nan_step()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def amp_dtype(device: torch.device, amp: str) -> torch.dtype | None:
    """The autocast dtype, or None for full fp32."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not cpu_has_native_bf16():
        warnings.warn("--amp on: this CPU has no native bf16; expect a 6-9x slowdown", stacklevel=2)
    return torch.bfloat16


def use_compile(device: torch.device, compile_flag: str) -> bool:
    return compile_flag == "on" or (compile_flag == "auto" and device.type == "cuda")


def setup_backends(device: torch.device, deterministic: bool, log: logging.Logger) -> None:
    """Fast kernels on CUDA, or bitwise-reproducible ones with --deterministic."""
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn where no such kernel exists
        log.info("deterministic: cudnn.benchmark off, deterministic kernels, no TF32 "
                 "(costs speed on CUDA, typically 10-50 %%; nothing on CPU)")
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv once
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere+
        torch.backends.cudnn.allow_tf32 = True


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and biases (1-d tensors); fused kernel on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=device.type == "cuda")


def build_scheduler(optimizer: torch.optim.Optimizer, lr: float, total_steps: int):
    """One-cycle: short warm-up, then cosine annealing to ~0 at the last optimizer step."""
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=max(total_steps, 1), pct_start=0.15, anneal_strategy="cos"
    )


def build_ema(model: nn.Module, decay: float) -> torch.optim.swa_utils.AveragedModel | None:
    """EMA of the weights (and BatchNorm buffers), or None when decay is 0."""
    if decay <= 0:
        return None
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def build_trainer(model: nn.Module, args, *, device: torch.device, dtype: torch.dtype | None,
                  total_steps: int, log: logging.Logger) -> Trainer:
    """The Trainer a run's arguments describe: AdamW, one-cycle, EMA, loss, compile policy."""
    optimizer = build_optimizer(model, args.lr, args.weight_decay, device)
    return Trainer(model, optimizer, build_scheduler(optimizer, args.lr, total_steps),
                   nn.CrossEntropyLoss(label_smoothing=args.label_smoothing), device=device,
                   dtype=dtype, grad_accum=args.grad_accum, clip_grad=args.clip_grad,
                   ema=build_ema(model, args.ema), compile_model=use_compile(device, args.compile),
                   log=log)


def inject_nan_step() -> int | None:
    """Test hook: with LAB_INJECT_NAN_AT_STEP=N the loss of optimizer step N becomes nan.

    Read here and nowhere else; used by the tests to prove that a diverged run fails cleanly.
    """
    value = os.environ.get(INJECT_NAN_ENV, "").strip()
    return int(value) if value else None


class Trainer:
    """Owns one optimizer step: forward/backward of `grad_accum` micro-batches, clip, step, EMA.

    Running sums (loss, correct, seen) stay on the device; `take_sums()` reads them (a sync point).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 loss_fn: nn.Module, *, device: torch.device, dtype: torch.dtype | None,
                 grad_accum: int = 1, clip_grad: float = 0.0, ema=None, compile_model: bool = False,
                 log: logging.Logger | None = None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn = loss_fn
        self.device, self.dtype, self.ema = device, dtype, ema
        self.grad_accum, self.clip_grad = grad_accum, clip_grad
        self.log = log or logging.getLogger(__name__)
        # fp16 needs loss scaling to keep small gradients; bf16 has fp32's range and does not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.forward = torch.compile(model) if compile_model else model
        self.compiled = compile_model
        self.nan_at = inject_nan_step()
        self.reset_sums()

    def state_dict(self) -> dict:
        """Everything the step owns: model, optimizer, scheduler, GradScaler, EMA, running sums."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "sums": self.sums_state()}

    def load_state_dict(self, state: dict) -> None:
        from .checkpoint import load_model_state

        load_model_state(self.model, state["model"], "the checkpoint's model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.load_sums_state(state["sums"])

    def reset_sums(self) -> None:
        zero = torch.zeros((), device=self.device)
        self.loss_sum, self.correct, self.seen = zero.clone(), zero.clone(), 0

    def sums_state(self) -> dict:
        return {"loss_sum": self.loss_sum.cpu(), "correct": self.correct.cpu(), "seen": self.seen}

    def load_sums_state(self, state: dict) -> None:
        self.loss_sum = state["loss_sum"].to(self.device)
        self.correct = state["correct"].to(self.device)
        self.seen = state["seen"]

    def take_sums(self) -> tuple[float, float, int]:
        """Mean loss and accuracy since the last reset.  # note: sync point (one per epoch)"""
        loss_sum, correct = torch.stack([self.loss_sum, self.correct]).tolist()
        seen = max(self.seen, 1)
        return loss_sum / seen, correct / seen, self.seen

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            logits = self.forward(x)
            loss = self.loss_fn(logits.float(), y)
        if step == self.nan_at:
            loss = loss * float("nan")
        # Sum (not mean) of the accumulated micro-batch losses, detached: no graph kept, no sync.
        self.loss_sum += loss.detach() * y.shape[0]
        self.correct += (logits.detach().argmax(1) == y).sum()
        self.seen += y.shape[0]
        self.scaler.scale(loss / self.grad_accum).backward()

    def step(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
        """One optimizer step over `grad_accum` micro-batches. `step` counts from 1."""
        for x, y in micro_batches:
            try:
                self._micro_step(x, y, step)
            except Exception as exc:  # compilation errors surface on the first call
                if not self.compiled or isinstance(exc, torch.OutOfMemoryError):
                    raise
                self.log.warning("torch.compile failed (%s: %s); falling back to eager",
                                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                self.forward, self.compiled = self.model, False
                self.optimizer.zero_grad(set_to_none=True)
                self._micro_step(x, y, step)
        if self.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)  # frees grad memory; no memset kernel
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)


@torch.inference_mode()
def evaluate(model: nn.Module, loader: Iterable, loss_fn: nn.Module, *, device: torch.device,
             dtype: torch.dtype | None) -> tuple[float, float]:
    """Mean loss and accuracy over a loader, in eval mode; one host sync at the end."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    seen = 0
    for x, y in loader:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss_sum += loss_fn(logits.float(), y) * y.shape[0]
        correct += (logits.argmax(1) == y).sum()
        seen += y.shape[0]
    model.train(was_training)
    # note: sync point (one per evaluation)
    total_loss, total_correct = torch.stack([loss_sum, correct.float()]).tolist()
    return total_loss / max(seen, 1), total_correct / max(seen, 1)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def timed(device: torch.device) -> Callable[[], float]:
    """A clock that waits for the device first, so timings measure work, not kernel launches."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def choose_gpu_resident(flag: str, device: torch.device, splits: dict) -> bool:
    """auto: keep the uint8 images on the GPU when they use under a quarter of free memory."""
    from .data import fits_on_device

    if flag != "auto" or device.type != "cuda":
        return flag == "on" and device.type == "cuda"
    return fits_on_device(splits, device)
