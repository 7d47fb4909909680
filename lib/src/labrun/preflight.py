"""Refusals before training: a model that does not fit the data, the task or the memory.

Each before the run directory holds anything but its lock (a refusal leaves nothing behind,
exit 2, one `error:` line naming the flags to change), each on run.py's own `make_model`:
- `check_model_fits`, before any image is decoded: an --image-size the model cannot take.
- `check_memory`, once the data is loaded: the model built on torch's meta device (shapes only,
  nothing allocated) and driven forward on a batch of the loop's shape; its parameters, their
  gradients, AdamW's two moments, the EMA copy, early stopping's best weights (host) and the
  activations a backward pass keeps, held against the free memory: the host's
  (data.available_ram_bytes: the cgroup, Slurm and ulimit included) and, on CUDA, the GPU's.
  Without it `--width 4000` grew to 19.5 GB on a 2-core node until the kernel's OOM killer
  ended it, or a neighbour's job; `--width 100000000` died in the allocator. The estimate is a
  lower bound (allocator slack, workspaces): what it refuses cannot train; what it lets through
  may still meet a CUDA OOM, which the run reports with --find-batch-size's advice.
- `forward_problem`, once the real model exists: one forward pass and the task's loss on two
  samples of a real training batch, in eval mode without gradients (no BatchNorm statistic,
  no RNG draw changes the run): a 1-D model on images, or `--task regression` on class ids,
  is one line instead of a traceback in a `failed` directory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import UsageError
from .runs import first_line, size_text


@dataclass(frozen=True)
class Needs:
    """Bytes one training process holds, by what holds them."""

    parameters: int  # weights and buffers
    training: int  # gradients + AdamW's exp_avg and exp_avg_sq
    ema: int  # the EMA's copy of the weights (--ema > 0)
    best: int  # early stopping's copy of the best weights, always on the host
    activations: int  # what the forward pass keeps for backward, for one micro-batch

    def held(self, *names: str) -> tuple[int, str]:
        """The bytes the fields `names` hold, and what holds them (those that hold none left
        out)."""
        parts = {LABELS.get(name, name): getattr(self, name) for name in names}
        text = ", ".join(f"{label} {size_text(n)}" for label, n in parts.items() if n)
        return sum(parts.values()), text


LABELS = {"training": "gradients and AdamW state", "ema": "EMA", "best": "best weights"}
ON_DEVICE = ("parameters", "training", "ema", "activations")  # the rest: the best weights


def estimate(model, batch_shape: tuple[int, ...], *, ema: bool, half: bool) -> Needs:
    """What training `model` (built on the meta device) takes for a micro-batch of
    `batch_shape`; `half`: the forward runs under 16-bit autocast (activations of 2 bytes).
    A forward the meta device cannot run (data-dependent Python, an op without a meta kernel)
    leaves the activations at 0: the rest still refuses what cannot fit."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    outputs: dict[int, torch.Tensor] = {}  # by identity: an in-place ReLU's output is its input

    def count(_module, _inputs, output) -> None:
        for t in output if isinstance(output, list | tuple) else (output,):
            if isinstance(t, torch.Tensor):
                outputs[id(t)] = t  # held: no id is reused during the pass

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        model(torch.empty(batch_shape, device="meta"))
    except Exception:  # noqa: BLE001 (the forward's own errors are forward_problem's to report)
        outputs.clear()
    finally:
        for hook in hooks:
            hook.remove()
    kept = sum(
        t.numel() * (2 if half and t.is_floating_point() else t.element_size())
        for t in outputs.values()
    )
    return Needs(weights, 3 * trainable, weights if ema else 0, weights, kept)


def check_model_fits(args, make_model) -> None:
    """Refuse an --image-size that --model cannot take before any image is read or decoded:
    run.py's `make_model(args, info)` is built on torch's meta device (no memory, no compute),
    first at a size it surely takes (so a model of another kind of input is left to its real
    build), then at this one.
    UsageError (one line, exit 2) with the model's own message."""
    if args.image_size is None:
        return
    from types import SimpleNamespace

    def error(size, channels) -> Exception | None:
        shape = dict(channels=channels, image_size=size, input_shape=(channels, *size))
        try:
            with torch.device("meta"):
                make_model(args, SimpleNamespace(num_classes=10, **shape))
        except Exception as e:  # noqa: BLE001 (only a ValueError refuses, below)
            return e
        return None

    for channels in (3, 1):
        if error((256, 256), channels) is None:  # the model takes such images
            misfit = error(tuple(args.image_size), channels)
            if isinstance(misfit, ValueError):
                raise UsageError(str(misfit))
            return


def check_memory(args, info, device, amp_dtype, make_model, *, micro_batch: int) -> str:
    """Refuse (UsageError) a model and batch whose training cannot fit the free memory;
    return the estimate for run.log. See the module docstring."""
    from .data import available_ram_bytes

    own = getattr(args, "model_args", None) or {}  # --model-args, as config.py parsed them
    try:
        with torch.device("meta"):
            model = make_model(args, info)  # run.py's: what it trains is what is estimated
    except ValueError:
        raise  # a misfit of the model's own arguments: bad input as run.py's build says it
    except Exception as exc:  # noqa: BLE001 (a model the meta device cannot build: not estimated)
        return f"not estimated ({type(exc).__name__} on the meta device)"
    shape = (micro_batch, *info.input_shape)
    # run.py's --ema; amp_dtype is bf16 or fp16 when set: activations of 2 bytes
    needs = estimate(model, shape, ema=getattr(args, "ema", 0) > 0, half=amp_dtype is not None)
    on_gpu = device.type == "cuda"  # the best weights on the host, the rest on the GPU
    places = [("host memory", needs.held(*() if on_gpu else ON_DEVICE, "best"))]
    places += [(f"memory on {device}", needs.held(*ON_DEVICE))] if on_gpu else []
    free = [available_ram_bytes(), *([torch.cuda.mem_get_info(device)[0]] if on_gpu else [])]
    problems = [
        f"{size_text(need)} of {where} ({detail}) but {size_text(room)} is free"
        for (where, (need, detail)), room in zip(places, free, strict=True)
        if room is not None and need > room  # None: no limit known
    ]
    if problems:
        # the flags that size the model, then those that shrink what does not fit: the model,
        # and the batch when the activations are a sizeable part of it
        given = f" --width {args.width}" if args.width is not None else ""
        given += f" --model-args {','.join(f'{k}={v}' for k, v in own.items())}" if own else ""
        flags = ["a smaller --width"] if args.width is not None else []
        flags = flags + (["smaller --model-args"] if own else []) or ["a smaller --model"]
        if needs.activations * 4 >= needs.held(*ON_DEVICE)[0]:
            flags.append("a smaller --batch-size (with --grad-accum to keep the effective batch)")
        raise UsageError(
            f"--model {args.model}{given}, --batch-size {args.batch_size}: training needs about "
            f"{' and '.join(problems)}; choose {' or '.join(flags)}"
        )
    total, detail = needs.held(*ON_DEVICE, "best")
    return f"training needs about {size_text(total)} ({detail})"


def forward_problem(model, batch, loss_fn, dtype) -> str | None:
    """Why `model` cannot train on this data and task (one forward pass and the loss on two
    samples of the real `batch`), or None. Eval mode, no gradients: nothing of the run moves."""
    x, y = batch
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(x.device.type, dtype, enabled=dtype is not None):
            loss_fn(model(x[:2]), y[:2])
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 (any failure here is the misfit to report)
        return f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        model.train(was_training)
    return None
