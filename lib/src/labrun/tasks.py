"""The task registry (`--task`): what the model's outputs are scored against. A task is one
decorated function that returns a `Task`: its loss, its metrics as sums, and which way is better
(`regression` below; lib/README.md, "Tasks", has one of a project's own). `--help` lists the
names and help texts without importing torch (registry.py).

The contract (docs/design.md, "Metric names"):
- `loss(outputs, targets)`: the mean loss the optimizer minimises, fp32 (outputs may be bf16/fp16
  under autocast). `eval_loss` is what val_loss/test_loss report (default: `loss`). run.py's
  train() names both on one line: what its step trains on, and what evaluation reports.
- `sums(outputs, targets)`: a 1-d tensor of per-batch *sums* of fixed length and order. The
  training step and `evaluate` add them up on the device (no host sync); the epoch's total is read
  once and given to `finish(total, n)` (a float64 numpy array and the sample count), which returns
  `{metric: value}` for every key of `metrics`. Sums, not means, so that batches of any size (and
  later, processes) combine by addition.
- `metrics`: `{name: "max" | "min"}`: the direction of each metric, named so in history.csv and
  metrics.json (lib/README.md). `monitor`: the default of `--monitor` (`val_<first>`).
- `spatial_targets`: True when targets are per pixel (segmentation masks): the training loader's
  random crop and flip move the image but not the target, so they are turned off for such a task.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from .config import UsageError
from .registry import Entry, Registry


@dataclass(frozen=True)
class Task:
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    finish: Callable[[np.ndarray, int], dict[str, float]]
    metrics: dict[str, str]
    monitor: str | None = None  # None: val_<first metric>
    eval_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    spatial_targets: bool = False
    name: str = ""
    directions: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.metrics.items() if v not in ("max", "min")}
        if bad or "loss" in self.metrics:
            raise ValueError(f"task metrics need 'max' or 'min' and no 'loss' entry, got {bad}")
        object.__setattr__(self, "directions", {"loss": "min", **self.metrics})
        if self.eval_loss is None:  # evaluation reports the loss trained on
            object.__setattr__(self, "eval_loss", self.loss)


TASKS: dict[str, Entry] = Registry("register_task")  # the project may add its own


# @register_task(name, help=...) on `fn(args) -> Task` (args: run.py's arguments)
register_task = TASKS.register


def create_task(name: str, args: argparse.Namespace, monitor: str | None = None) -> Task:
    """The registered task `name` with its monitored metric resolved (UsageError if unknown)."""
    if name not in TASKS:
        raise UsageError(f"--task: unknown task {name!r}; choose one of {', '.join(TASKS)}")
    task = TASKS[name].build(args)
    valid = [f"val_{m}" for m in task.directions]
    monitor = monitor or task.monitor or valid[1 if len(valid) > 1 else 0]
    if monitor not in valid:
        raise UsageError(
            f"--monitor: {monitor!r} is not a metric of task {name!r}; choose one of "
            f"{', '.join(valid)}"
        )
    return replace(task, name=name, monitor=monitor)


def check_targets(splits: dict, task: str, dataset: str, num_classes: int | None) -> None:
    """Refuse targets no reported number could be trusted on (UsageError: one line, exit 2):
    class ids outside 0..num_classes-1 (None: float targets in some split; a NaN or inf one
    is refused by data.refuse_non_finite), under --task multilabel a split without one positive
    label (its mAP is undefined: the monitored val_map would never be finite, test_map would be
    made up), and under --task classification a train split of one class (test acc 1,
    whatever the model). `splits`: {name: Split or FileSplit} as the dataset gave them."""
    for name, split in splits.items():
        labels = split.labels
        if not labels.is_floating_point():  # (no split is empty: data._as_split)
            if num_classes is not None and (labels.min() < 0 or labels.max() >= num_classes):
                raise UsageError(f"{dataset}/{name}: labels outside 0..{num_classes - 1}")
            continue
        if task == "classification":
            raise UsageError(
                f"dataset {dataset!r}: --task classification needs integer class ids; the "
                f"{name} split's labels are floats (such as {labels.flatten()[0].item()}): "
                "give integer labels (labels.astype(int)), or choose --task regression"
            )
        if task == "multilabel" and not (labels > 0.5).any():
            raise UsageError(
                f"dataset {dataset!r}: the {name} split has no positive label in any of its "
                f"{len(labels)} rows: its mAP is undefined; give it rows with a label"
            )
    classes = splits["train"].labels.unique().numel()
    if task == "classification" and classes < 2:
        raise UsageError(
            f"dataset {dataset!r}: --task classification needs at least 2 classes; the train "
            f"split has {classes} (every prediction would be right)"
        )


def summed(*parts: torch.Tensor) -> torch.Tensor:
    """Per-batch sums as one float64 vector (exact counts; r2's sum of squares keeps its digits)."""
    return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])


# --------------------------------------------------------------------------------------------
# classification: the default


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy from log_softmax + gather: equal to F.cross_entropy (tested), also per
    pixel (logits (N, C, H, W), target (N, H, W)), and deterministic on CUDA, where NLLLoss has
    no deterministic kernel (torch raises under --deterministic)."""
    log_probs = F.log_softmax(logits.float(), dim=1)
    nll = -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * log_probs.mean(1)
    return nll.mean()


@register_task("classification", help="cross-entropy on class ids; acc (the default)")
def classification(args) -> Task:
    """Training loss with --label-smoothing; val/test loss without (the plain cross-entropy)."""
    smoothing = getattr(args, "label_smoothing", 0.0)
    return Task(
        loss=lambda logits, y: cross_entropy(logits, y, smoothing),
        eval_loss=cross_entropy,
        sums=lambda logits, y: summed((logits.argmax(1) == y).sum()),
        finish=lambda s, n: {"acc": s[0] / max(n, 1)},
        metrics={"acc": "max"},
    )


# --------------------------------------------------------------------------------------------
# regression: float targets (N, k)


def mse(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), y.float().reshape(outputs.shape))


def regression_sums(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per output column: sum err^2, sum |err|, sum y, sum y^2 (4k numbers, float64)."""
    y = y.reshape(outputs.shape).double().flatten(1)
    err = outputs.double().flatten(1) - y
    return summed(err.square().sum(0), err.abs().sum(0), y.sum(0), y.square().sum(0))


def regression_metrics(s: np.ndarray, n: int) -> dict[str, float]:
    """mse, mae over all outputs; r2 per output column, averaged (sklearn's r2_score:
    uniform_average; a constant column scores 1 if predicted exactly, else 0)."""
    sse, sae, sy, syy = s.reshape(4, -1)
    count = max(n, 1) * sse.size
    sst = syy - sy**2 / max(n, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = np.where(sst > 0, 1 - sse / sst, np.where(sse == 0, 1.0, 0.0))
    return {"mse": sse.sum() / count, "mae": sae.sum() / count, "r2": float(r2.mean())}


@register_task("regression", help="MSE on float targets (N, k); mse, mae, r2")
def regression(args) -> Task:
    return Task(
        loss=mse,
        sums=regression_sums,
        finish=regression_metrics,
        metrics={"mse": "min", "mae": "min", "r2": "max"},  # monitor: val_mse, the first
    )


# --------------------------------------------------------------------------------------------
# multilabel: multi-hot float targets (N, L)

AP_BINS = 4096  # histogram bins of the logits per label, for the mean average precision
AP_OCTAVES = 10  # the bins cover |logit| from 2**-10 to 2**10 on a log scale (clamped outside)


def ap_bins(logits: torch.Tensor) -> torch.Tensor:
    """The AP histogram's bin of every logit, in the order of the logits: uniform in
    sign(z) (log2 |z| + AP_OCTAVES), |z| clamped to [2**-AP_OCTAVES, 2**AP_OCTAVES]. Every
    scale gets the same relative resolution (0.7%): a confident model's logits of 8 and 12
    stay apart, where sigmoid scores binned on [0, 1] all fell into the top bin."""
    z = logits.float()
    t = z.sign() * (z.abs().clamp(2.0**-AP_OCTAVES, 2.0**AP_OCTAVES).log2() + AP_OCTAVES)
    return ((t + 2 * AP_OCTAVES) * (AP_BINS / (4 * AP_OCTAVES))).long().clamp_(0, AP_BINS - 1)


def multilabel_sums(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per label: tp, fp, fn at score 0.5 (logit 0), then histograms of the logits of positives
    and of negatives in AP_BINS bins (ap_bins) (3L + 2 L AP_BINS numbers)."""
    labels = logits.shape[1]
    y = y.reshape(logits.shape) > 0.5
    pred = logits.float() >= 0  # sigmoid(z) >= 0.5
    index = (ap_bins(logits) + AP_BINS * torch.arange(labels, device=logits.device)).flatten()
    hist = torch.zeros(2, labels * AP_BINS, dtype=torch.float64, device=logits.device)
    hist.index_add_(1, index, torch.stack([y, ~y]).flatten(1).double())  # positives, negatives
    return summed((pred & y).sum(0), (pred & ~y).sum(0), (~pred & y).sum(0), hist)


def multilabel_metrics(s: np.ndarray, n: int) -> dict[str, float]:
    """f1: per-label F1 at 0.5, macro-averaged (a label never present nor predicted scores 0, as
    sklearn's default). map: per-label average precision, averaged over labels with a positive
    (NaN when none has one: check_targets refuses such a val or test split).

    AP from the histograms: logits in one bin count as tied, and AP = sum over thresholds (bins,
    high to low) of (recall gain) x precision, which is sklearn's average_precision_score of the
    logits replaced by their bins (tested to 1e-12); against the logits themselves it differs
    only by the order inside a bin (tested within 1e-3 on confident, moderate and noisy ones)."""
    labels = len(s) // (3 + 2 * AP_BINS)
    tp, fp, fn = s[: 3 * labels].reshape(3, labels)
    hist = s[3 * labels :].reshape(2, labels, AP_BINS)[..., ::-1]  # high scores first
    cum_pos, cum_neg = hist.cumsum(-1)
    total = cum_pos[:, -1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        f1 = np.where(2 * tp + fp + fn > 0, 2 * tp / (2 * tp + fp + fn), 0.0)
        precision = np.where(cum_pos + cum_neg > 0, cum_pos / (cum_pos + cum_neg), 0.0)
        ap = (hist[0] / total * precision).sum(-1)
    present = total[:, 0] > 0
    return {"f1": float(f1.mean()), "map": float(ap[present].mean()) if present.any() else np.nan}


@register_task("multilabel", help="binary cross-entropy on multi-hot (N, L) targets; f1, map")
def multilabel(args) -> Task:
    return Task(
        loss=lambda logits, y: F.binary_cross_entropy_with_logits(
            logits.float(), y.float().reshape(logits.shape)
        ),
        sums=multilabel_sums,
        finish=multilabel_metrics,
        metrics={"f1": "max", "map": "max"},
        monitor="val_map",
    )
