"""Command line of run.py, the identity of an experiment, and its run directory.

Imports no torch and no mlflow: `run.py --help` and `run.py --print-run-dir` must answer at once,
and the sweep calls the latter for every job.

Identity (docs/design.md): the run directory is `<results-dir>/<readable>-<hash8>`, where the hash
is sha256 over the sorted-key JSON of every *experiment-defining* argument, i.e. every argument
except those in EXECUTION_KEYS. Add a flag to the parser and it joins the hash unless you also add
it to EXECUTION_KEYS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXPERIMENT = {{ cookiecutter.project_slug | py_string }}
# Mirrors data.DATASETS (data.py imports torch, so it cannot be imported here).
DATASET_CHOICES = ("digits", "cifar10", "synthetic")

# How a run is executed, not what it computes: left out of the hash, so the same experiment run on
# another GPU, with more workers or after a Ctrl-C lands in the same directory.
EXECUTION_KEYS = frozenset(
    {
        "device", "amp", "compile", "workers", "gpu_resident", "results_dir", "data_dir", "fresh",
        "progress", "deterministic", "profile", "find_lr", "find_batch_size", "print_run_dir",
        "experiment", "init_tracking",
    }
)
MAX_READABLE = 80


class UsageError(ValueError):
    """Bad command line or bad input: run.py prints `error: <message>` and exits 2."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="Train one model; results go to <results-dir>/<run name>/ (docs/design.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e = p.add_argument_group("experiment (these define the run directory's hash)")
    e.add_argument("--dataset", choices=DATASET_CHOICES, default="digits",
                   help="digits works offline; cifar10 downloads into --data-dir")
    e.add_argument("--synthetic-size", type=_positive_int, default=10_000,
                   help="number of images of the synthetic dataset")
    e.add_argument("--val-fraction", type=_fraction, default=0.1,
                   help="fraction of the training set held out for validation / early stopping")
    e.add_argument("--width", type=_positive_int, default=64, help="channels of the first stage")
    e.add_argument("--epochs", type=_positive_int, default=20, help="maximum number of epochs")
    e.add_argument("--max-steps", type=_non_negative_int, default=0,
                   help="stop after exactly this many optimizer steps (0 = no limit)")
    e.add_argument("--batch-size", type=int, default=128,
                   help="micro-batch size; effective batch = batch size x --grad-accum")
    e.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one-cycle schedule)")
    e.add_argument("--weight-decay", type=_non_negative_float, default=5e-4,
                   help="AdamW weight decay")
    e.add_argument("--patience", type=_non_negative_int, default=5,
                   help="early stopping: epochs without a better val accuracy (0 = off)")
    e.add_argument("--seed", type=int, default=0,
                   help="seed of the initialisation, validation split, shuffling, augmentation")
    e.add_argument("--grad-accum", type=_positive_int, default=1,
                   help="micro-batches per optimizer step")
    e.add_argument("--clip-grad", type=_non_negative_float, default=0.0,
                   help="clip the global gradient norm to this value (0 = off)")
    e.add_argument("--ema", type=_fraction, default=0.0,
                   help="EMA decay of the weights, e.g. 0.999; evaluated instead of them (0 = off)")
    e.add_argument("--label-smoothing", type=_fraction, default=0.0,
                   help="label smoothing of the cross-entropy loss")

    x = p.add_argument_group("execution (not part of the hash)")
    x.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = cuda when available")
    x.add_argument("--amp", choices=("auto", "on", "off"), default="auto",
                   help="mixed precision; auto = bf16 (or fp16 + GradScaler) on CUDA, off on CPU")
    x.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the model; auto = on for CUDA, off on CPU")
    x.add_argument("--workers", type=_non_negative_int, default=None,
                   help="data-loader worker processes (%(default)s: chosen by the loader)")
    x.add_argument("--gpu-resident", choices=("auto", "on", "off"), default="auto",
                   help="keep the dataset on the GPU; auto = when it fits comfortably")
    x.add_argument("--deterministic", action="store_true",
                   help="bitwise-reproducible kernels (slower; resume then matches exactly)")
    x.add_argument("--results-dir", type=Path, default=PROJECT_ROOT / "results",
                   help="parent of the run directories")
    x.add_argument("--data-dir", type=Path, default=PROJECT_ROOT / "data",
                   help="where datasets are downloaded / cached")
    x.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
    x.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="tqdm progress bar; auto = when stderr is a terminal")
    x.add_argument("--fresh", action="store_true",
                   help="delete this run's directory contents and start over")

    t = p.add_argument_group("tools (do one thing and exit)")
    t.add_argument("--find-lr", action="store_true", help="LR range test: plot + suggestion")
    t.add_argument("--find-batch-size", action="store_true",
                   help="largest batch size that fits in memory, then exit")
    t.add_argument("--profile", action="store_true",
                   help="profile a few training steps after warm-up; trace into the run dir")
    t.add_argument("--print-run-dir", action="store_true",
                   help="print the absolute run directory and exit (imports no torch)")
    t.add_argument("--init-tracking", action="store_true",
                   help="create the MLflow DB and experiment, then exit (sweeps call it once)")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Parse and check what can be checked without data; argparse exits 2 on errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.lr <= 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    args.results_dir = args.results_dir.expanduser().resolve()
    args.data_dir = args.data_dir.expanduser().resolve()
    return args, parser


def experiment_args(args: argparse.Namespace) -> dict:
    """The arguments that define what is computed (everything but EXECUTION_KEYS)."""
    return {k: v for k, v in vars(args).items() if k not in EXECUTION_KEYS}


def config_hash(args: argparse.Namespace) -> str:
    blob = json.dumps(experiment_args(args), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def run_name(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """`<dataset>_key=value_...-<hash8>`: readable part lists the non-default experiment args."""
    parts = [str(args.dataset)]
    for action in parser._actions:  # parser order, so names are stable and predictable
        key = action.dest
        if key in EXECUTION_KEYS or key in ("help", "dataset"):
            continue
        value = getattr(args, key)
        if value != action.default:
            parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    readable = re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join(parts))[:MAX_READABLE].rstrip("_")
    return f"{readable}-{config_hash(args)}"


def run_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path:
    return args.results_dir / run_name(args, parser)


def resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """What config.json holds: all arguments (paths as strings) plus the run's identity."""
    cfg = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cfg["run_name"] = run_name(args, parser)
    cfg["config_hash"] = config_hash(args)
    cfg["experiment_keys"] = sorted(experiment_args(args))
    return cfg
