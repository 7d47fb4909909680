"""Command line of run.py, the identity of an experiment, and its run directory.

Imports no torch and no mlflow: `run.py --help` and `run.py --print-run-dir` must answer at once,
and the sweep calls the latter for every job.

The method's hyperparameters are run.py's: its `Config` dataclass, one `flag(default, help)` line
a field, given to `labrun.lifecycle(argv, train, Config)`. Each field becomes a flag (`lr` ->
`--lr`, typed by its annotation), joins the identity, config.json and the MLflow params, unless
the field says `execution=True`. The options every project shares (data, model, task, epochs,
device, tracking, results dir...) are this module's.

Identity (README, "What a run writes"): the run directory is `<results-dir>/<readable>-<hash8>`,
the hash over every argument but execution_keys(); a flag added since the first release is
hashed only away from its default (FIRST_RELEASE_KEYS), so every existing run keeps its directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import runpy
import shlex
import typing
from collections.abc import Collection
from fractions import Fraction
from pathlib import Path

from . import project, runs
from .dataversion import data_version
from .models import WIDTH_DEFAULT, listed_arguments, model_arguments
from .registry import REQUIRED, declarations

# The project this process works for (project.py: its pyproject.toml's [tool.labrun]).
PROJECT_ROOT = project.current().root
DEFAULT_EXPERIMENT = project.current().experiment
# Trial runs (results/trials, the default --results-dir) go to their own MLflow experiment, as
# plot.py keeps them out of the sweep's figures.
TRIALS_DIR = PROJECT_ROOT / "results" / "trials"
TRIALS_EXPERIMENT = f"{DEFAULT_EXPERIMENT}-trials"
# Both registries are read without importing a module (no torch): the `@register_dataset` and
# `@register_model` lines of every module of the package, from their source (registry.py).
DATASET_DECLARED = declarations("register_dataset")  # from any module of the package
MODEL_DECLARED = declarations("register_model")
TASK_DECLARED = declarations("register_task")

CROP_SCALE = (0.08, 1.0)  # --crop-scale: the area of a random resized crop (torchvision's)
CROP_RATIO = (3 / 4, 4 / 3)  # --crop-ratio: its width / height (torchvision's)
# The readable part of a run's name lists its changed flags in the first release's parser order
# (names are pinned by the tests), the flags added since placed among them, then any other in the
# order of --help.
NAME_ORDER = (
    "dataset",
    "data_path",
    "image_size",
    "model",
    "model_args",
    "task",
    "monitor",
    "synthetic_size",
    "val_fraction",
    "width",
    "epochs",
    "max_steps",
    "batch_size",
    "lr",
    "weight_decay",
    "patience",
    "min_epochs",
    "augment",
    "seed",
    "grad_accum",
    "clip_grad",
    "ema",
    "label_smoothing",
)
# The first release's experiment flags: always hashed (their run names are pinned by the tests);
# any other only away from its default (identity_args).
ADDED_SINCE = {"model_args", "task", "monitor", "min_epochs", "augment"}  # in NAME_ORDER too
FIRST_RELEASE_KEYS = frozenset(NAME_ORDER) - ADDED_SINCE
MAX_READABLE = 80
MAX_SEED = 2**32 - 1  # numpy's seed range; torch takes 64 bits, but one seed feeds both
MAX_EXPERIMENT_NAME = 500  # MLflow's limit (mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH)
MAX_NAME_BYTES = 255  # NAME_MAX of Linux file systems: longest single path component
TRACKING_ENV = "LAB_TRACKING"  # LAB_TRACKING=off runs without MLflow, like --tracking off
# Set by the sweep for its jobs: JSON [run.py's arguments before a job's own, those after] (run_of)
SWEEP_RUN_ARGS = "LAB_SWEEP_RUN_ARGS"


def tracking_default() -> str:
    """LAB_TRACKING in lower case (default on); parse_args refuses anything but on/off."""
    return os.environ.get(TRACKING_ENV, "").strip().lower() or "on"


class UsageError(ValueError):
    """Bad command line or bad input: run.py prints `error: <message>` and exits 2."""


class NotReady(UsageError):
    """An input is not there yet (a run still training): exit 2; run.sh lists it as waiting."""


class Parser(argparse.ArgumentParser):
    """argparse, but a refusal is one line, `error: --flag: why`, and exit 2 (no usage dump).
    run.py's parser and a job's (jobs.parser) declare the flags every job shares alike
    (Execution's, Tools'); parsing settles what argparse leaves of them."""

    def parse_known_args(self, args=None, namespace=None):
        found, rest = super().parse_known_args(args, namespace)
        if getattr(found, "tracking", "on") not in ("on", "off"):  # `choices`: command line only
            self.error(f"{TRACKING_ENV}={os.environ.get(TRACKING_ENV)!r}: expected on or off")
        if "experiment" in found and found.experiment is None:
            trial = found.results_dir.resolve() == TRIALS_DIR.resolve()
            found.experiment = TRIALS_EXPERIMENT if trial else DEFAULT_EXPERIMENT
        return found, rest

    def error(self, message: str):
        message = re.sub(
            r"^argument ([^:]+): ", lambda m: m.group(1).split("/")[-1] + ": ", message
        )
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _number(kind: type, above=None, at_least=None, below=None):
    """Text -> a finite `kind` (int or float) within the bounds, or argparse's one-line refusal."""
    low = f"({above}" if above is not None else f"[{at_least}" if at_least is not None else "(-inf"
    if below is not None:
        why = f"in {low}, {below})"
    else:
        why = "positive" if above == 0 else f"> {above}" if above is not None else f">= {at_least}"

    def parse(text: str):
        try:
            value = kind(text) + 0  # -0.0 -> 0.0: equal values must hash to one run directory
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        inside = (above is None or value > above) and (at_least is None or value >= at_least)
        if not inside or (below is not None and value >= below):
            raise argparse.ArgumentTypeError(f"must be {why}, got {text}")
        return value

    return parse


_positive_int = _number(int, at_least=1)  # also analyze.py's
_seed = _number(int, at_least=0, below=MAX_SEED + 1)  # also analyze.py's


def _range_of(low: float, high: float):
    """`LOW,HIGH` (numbers or fractions such as 3/4), low < LOW <= HIGH <= high."""

    def parse(text: str) -> tuple[float, float]:
        try:
            values = tuple(float(Fraction(part.strip())) for part in text.split(","))
        except (ValueError, ZeroDivisionError):
            values = ()
        if len(values) != 2 or not low < values[0] <= values[1] <= high:
            raise argparse.ArgumentTypeError(
                f"must be LOW,HIGH with {low:g} < LOW <= HIGH <= {high:g}, got {text}"
            )
        return values

    return parse


def _image_size(text: str) -> tuple[int, int]:
    """`N` (NxN) or `HxW`."""
    parts = text.lower().split("x")
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"must be N or HxW with positive integers, got {text}")
    return (int(parts[0]),) * 2 if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def _model_args(text: str) -> dict:
    """`k=v,k=v` -> {k: v} of texts, typed later by the defaults (models.model_arguments)."""
    found = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(
                f"expected name=value pairs separated by commas, got {item!r}"
            )
        found[key.strip()] = value.strip()
    return found


def _choices_help(declared: dict, more=lambda entry: "") -> str:
    """`name: help (more); ...` of registry entries (registry.declarations)."""
    parts = (f"{name}: {d.help} ({more(d)})".removesuffix(" ()") for name, d in declared.items())
    return "; ".join(parts)


def _experiment(text: str) -> str:
    if not text.strip() or len(text) > MAX_EXPERIMENT_NAME:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {MAX_EXPERIMENT_NAME} characters, got {len(text)}"
        )
    return text


def _directory(text: str) -> Path:
    if not text.strip():  # Path("") is the working directory: a run in the project's root
        raise argparse.ArgumentTypeError("empty: name a folder")
    path = Path(text).expanduser()
    for part in path.parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise argparse.ArgumentTypeError(
                f"path component '{part[:20]}...' is {len(part)} characters; file systems "
                f"allow {MAX_NAME_BYTES} bytes"
            )
    return path.resolve()


# ---- the flags: run.py's Config and labrun's own, declared alike ------------------------------
def flag(
    default,
    help: str,
    *,
    execution: bool = False,
    choices: Collection[str] | None = None,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    parse=None,
    metavar: str | None = None,
):
    """One field of run.py's Config: `lr: float = flag(3e-3, "peak learning rate", above=0)`.
    The annotation types the flag (bool: --x / --no-x when it defaults to True, else a switch),
    or `parse` (text -> value); `choices` and the bounds refuse other values with one `error:`
    line. `execution=True`: how the run is executed (out of the run's identity and name)."""
    bounds = {"above": above, "at_least": at_least, "below": below}
    meta = dict(help=help, execution=execution, choices=choices, bounds=bounds, parse=parse)
    meta["metavar"] = metavar
    if isinstance(default, dict | list | set):  # a dataclass refuses a mutable default
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


FRACTION = {"at_least": 0, "below": 1}  # flag(..., **FRACTION): a value in [0, 1)


def _auto(help: str):
    """A flag whose default, auto, lets labrun decide (run.log says what and why)."""
    return flag("auto", help, choices=("auto", "on", "off"))


@dataclasses.dataclass
class Experiment:
    """labrun's flags that define what a run computes (in its identity)."""

    dataset: str = flag(
        "digits",
        _choices_help(DATASET_DECLARED),
        choices=DATASET_DECLARED,
    )
    data_path: Path | None = flag(
        None,
        "your data (e.g. the folder of --dataset folder); part of the run's identity, so two "
        "datasets never share a run directory",
        parse=_directory,  # absolute: the same data named two ways is one experiment
    )
    image_size: tuple | None = flag(
        None, "resize images to N x N (or HxW); default: their own size", parse=_image_size
    )
    model: str = flag(
        "cnn",
        _choices_help(MODEL_DECLARED, listed_arguments),  # `cnn1d: ... (width, depth=2)`
        choices=MODEL_DECLARED,  # the dict itself: a model registered later is a choice too
    )
    model_args: dict = flag(
        {},
        "the model's own size arguments (listed with --model, in parentheses), e.g. "
        "depth=3,kernel=5; unset ones take the function's defaults. Run names show those you "
        "set, tables the ones that vary",
        parse=_model_args,
        metavar="K=V,...",
    )
    task: str = flag("classification", _choices_help(TASK_DECLARED), choices=TASK_DECLARED)
    monitor: str | None = flag(
        None,
        "the validation metric early stopping and best_model.pt follow, e.g. val_loss, val_r2 "
        "(lower or higher is better as the task says); default: the task's own "
        "(classification: val_acc, regression: val_mse, multilabel: val_map)",
        metavar="METRIC",
    )
    synthetic_size: int = flag(10_000, "number of images of the synthetic dataset", at_least=1)
    val_fraction: float = flag(
        0.1,
        "fraction of the training set held out for validation / early stopping",
        **FRACTION,
    )
    width: int = flag(
        WIDTH_DEFAULT,
        "size of models that take `width` (the built-ins: channels of the first stage); a model "
        "without one ignores the default and refuses any other value",
        at_least=1,
    )
    epochs: int = flag(20, "maximum number of epochs", at_least=1)
    max_steps: int = flag(
        0, "stop after exactly this many optimizer steps (0 = no limit)", at_least=0
    )
    batch_size: int = flag(
        128, "micro-batch size; effective batch = batch size x --grad-accum", at_least=1
    )
    patience: int = flag(
        5,
        "early stopping: epochs without a better --monitor value (0 = off); counted only after "
        "--min-epochs (and after the peak of a OneCycleLR schedule)",
        at_least=0,
    )
    test_weights: str = flag(
        "best",
        "the weights the test split is evaluated with: the best --monitor epoch's, or the last "
        "epoch's (fitting experiments); metrics.json's test_weights and tested_epoch say which",
        choices=("best", "final"),
    )
    min_epochs: int = flag(
        0,
        "early stopping counts no epoch up to this one (nor any before the peak of a "
        "OneCycleLR schedule)",
        at_least=0,
    )
    augment: str = _auto(
        "training augmentation; auto = random crop + flip for uint8 images (N, C, H, W), none "
        "for other data (or as the dataset declares); on = crop + flip of images, shift + flip "
        "along the length of signals and sequences; run.log says which and why",
    )
    crop: str = flag(
        "pad",
        "the images' random crop: pad = a crop of the image zero-padded by 1/8 of its side "
        "(small images, CIFAR's); resized = a random part of the image (--crop-scale, "
        "--crop-ratio) resized to the full size (photos, ImageNet's RandomResizedCrop); both "
        "with a random flip",
        choices=("pad", "resized"),
    )
    crop_scale: tuple = flag(
        CROP_SCALE,
        "--crop resized: the part's area, a fraction of the image's, drawn from LOW..HIGH",
        parse=_range_of(0.0, 1.0),
        metavar="LOW,HIGH",
    )
    crop_ratio: tuple = flag(
        CROP_RATIO,
        "--crop resized: the part's width / height, drawn log-uniformly from LOW..HIGH "
        "(fractions allowed: 3/4,4/3)",
        parse=_range_of(0.0, math.inf),
        metavar="LOW,HIGH",
    )
    seed: int = flag(
        0, "seed of the initialisation, validation split, shuffling, augmentation", parse=_seed
    )
    grad_accum: int = flag(1, "micro-batches per optimizer step", at_least=1)
    label_smoothing: float = flag(
        0.0,
        "label smoothing of the cross-entropy loss (--task classification)",
        **FRACTION,
    )


@dataclasses.dataclass
class Execution:
    """labrun's flags of how a run is executed, not what it computes: out of the hash, so the
    same experiment on another GPU, with more workers or after a Ctrl-C has one directory."""

    device: str = flag("auto", "auto = cuda when available", choices=("auto", "cpu", "cuda"))
    amp: str = _auto(
        "mixed precision; auto = bf16 on GPUs of compute capability >= 8.0, fp16 + GradScaler "
        "below, fp32 on CPU; on: CPU bf16 only where it is native",
    )
    compile: str = flag(
        "auto",
        "torch.compile the step; auto = on CUDA in the mode (default, reduce-overhead: CUDA "
        "graphs, max-autotune) whose measured saving over the steps left is >= 2x its recorded "
        "compile time, off on CPU; on = always, in the best mode; a mode name: that mode "
        "(without CUDA graphs where they cannot work); --deterministic stays eager",
        choices=("auto", "on", "off", "default", "reduce-overhead", "max-autotune"),
    )
    workers: int | None = flag(
        None,
        "data-loader worker processes; None = chosen from the cores this job may use, 0 = load "
        "in the main process",
        at_least=0,
    )
    data_mode: str = flag(
        "auto",
        "image files: decode once into RAM, or stream them from disk in workers; auto = memory "
        "when they take < 1/4 of the available RAM",
        choices=("auto", "memory", "stream"),
    )
    gpu_resident: str = _auto(
        "keep the dataset on the GPU; auto = when it fits comfortably",
    )
    deterministic: bool = flag(
        False,
        "bitwise-reproducible: deterministic kernels (an op without one raises), TF32 and "
        "compile off; resume then matches exactly. Not across GPU models, drivers, torch "
        "versions or thread counts",
    )
    results_dir: Path = flag(
        TRIALS_DIR,
        "parent of the run directories (run.sh uses results/<sweep name>)",
        parse=_directory,
    )
    data_dir: Path = flag(
        PROJECT_ROOT / "data", "where datasets are downloaded / cached", parse=_directory
    )
    experiment: str | None = flag(
        None,
        f"MLflow experiment name (default: {DEFAULT_EXPERIMENT!r}; {TRIALS_EXPERIMENT!r} for "
        "runs into results/trials)",
        parse=_experiment,
    )
    tracking: str = flag(
        "on",  # tracking_default(), read when the parser is built
        f"log to MLflow (off: only the run directory; also {TRACKING_ENV}=off). An unreachable "
        "tracker never stops training: see README, Tracking",
        choices=("on", "off"),
    )
    progress: str = _auto("tqdm progress bar; auto = when stderr is a terminal")
    log_every: float = flag(
        60.0,
        "seconds between progress lines inside an epoch when no bar is shown (a log file: "
        "nohup, sweeps, Slurm); 0 = off",
        at_least=0,
    )
    checkpoint_every: float = flag(
        300.0,
        "seconds between end-of-epoch checkpoints (0 = every epoch); a stop signal and the end "
        "of the run always checkpoint",
        at_least=0,
    )
    fresh: bool = flag(False, "delete this run's directory contents and start over")


@dataclasses.dataclass
class Tools:
    """Flags that do one thing and exit (out of the hash, like Execution's)."""

    find_lr: bool = flag(False, "LR range test: plot + suggestion")
    find_batch_size: bool = flag(False, "largest batch size that fits in memory, then exit")
    profile: bool = flag(
        False, "profile a few training steps after warm-up; trace into the run dir"
    )
    print_run_dir: bool = flag(
        False, "print the absolute run directory and exit (imports no torch)"
    )
    init_tracking: bool = flag(
        False, "create the MLflow DB and experiment, then exit (sweeps call it once)"
    )


_config: type | None = None  # run.py's Config, given to lifecycle (use_config)


def use_config(config: type) -> None:
    """Make `config` (run.py's Config dataclass) the method's flags of this process."""
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"labrun.lifecycle: Config must be a dataclass, got {config!r}")
    global _config
    _config = config


@functools.cache
def project_run_py() -> dict:
    """The names of the project's run.py (its Config, its make_model...), for callers that are
    not run.py (plot.py, tools, tests); {} outside a project. run.py's module level imports no
    torch, so reading it is cheap."""
    path = PROJECT_ROOT / "run.py"
    return runpy.run_path(str(path), run_name="_labrun_project_run") if path.is_file() else {}


def fields_of(config: type) -> list[tuple[dataclasses.Field, type]]:
    """(field, type) of each field of a dataclass of flags, in its order."""
    hints = typing.get_type_hints(config)
    return [(f, hints[f.name]) for f in dataclasses.fields(config)]


def method_fields() -> list[tuple[dataclasses.Field, type]]:
    """(field, type) of each hyperparameter of run.py's Config, in its order (none outside a
    project)."""
    config = _config or project_run_py().get("Config")
    return fields_of(config) if config else []


def execution_keys() -> frozenset:
    """The flags of Execution and Tools, and the Config fields marked execution=True."""
    own = [f.name for config in (Execution, Tools) for f in dataclasses.fields(config)]
    return frozenset(own + [f.name for f, _ in method_fields() if f.metadata.get("execution")])


def _add_field(group, field: dataclasses.Field, kind: type) -> None:
    """`--name` for one field, typed by its annotation (`X | None`: X) or its `parse`."""
    meta, name = field.metadata, "--" + field.name.replace("_", "-")
    help_text = meta.get("help", "(no help: give the field flag(default, help))")
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    options = {"default": default, "help": help_text.replace("%", "%%")}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction if default else "store_true"
    else:
        kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)
        number = kind in (int, float) and _number(kind, **meta.get("bounds", {}))
        options.update(choices=meta.get("choices"), metavar=meta.get("metavar"))
        options["type"] = meta.get("parse") or number or kind
    group.add_argument(name, **options)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="run.py",
        description="Train one model; results go to <results-dir>/<run name>/ (README.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e = p.add_argument_group("experiment (these define the run directory's hash)")
    # run.py's Config fields: added last, once every group exists (--help shows groups in order)
    m = p.add_argument_group("method: run.py's Config (these define the run directory's hash)")
    x = p.add_argument_group("execution (not part of the hash)")
    t = p.add_argument_group("tools (do one thing and exit)")
    for group, config in ((e, Experiment), (x, Execution), (t, Tools)):
        for field, kind in fields_of(config):
            _add_field(group, field, kind)
    p.set_defaults(tracking=tracking_default())
    for field, kind in method_fields():
        _add_field(x if field.metadata.get("execution") else m, field, kind)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Parse and check what can be checked without data; argparse exits 2 on errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Bounded by the machine, before anything is written: more loader processes than the cores
    # this job may use only compete for them; a synthetic set is made whole in memory (3x32x32
    # bytes an image, and a fifth as many for its test split).
    cores = len(os.sched_getaffinity(0))
    if args.workers is not None and args.workers > cores:
        parser.error(f"--workers: at most {cores} (the cores this job may use), got {args.workers}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.dataset == "synthetic" and args.synthetic_size * 6 // 5 * 3 * 32 * 32 > ram:
        parser.error(f"--synthetic-size: {args.synthetic_size} images do not fit in this "
                     f"machine's {runs.size_text(ram)} of memory")  # fmt: skip
    dataset = DATASET_DECLARED[args.dataset]
    if dataset.needs_data_path and args.data_path is None:
        parser.error(f"--data-path: dataset {args.dataset!r} reads your files: give --data-path")
    built_in = dataset.module == f"{__package__}.datasets"  # a dataset of yours may read it
    if args.data_path is not None and built_in and not dataset.needs_data_path:
        parser.error(
            f"--data-path: --dataset {args.dataset} reads no files of yours; drop "
            "--data-path, or use --dataset folder (or a dataset of your own)"
        )
    built_in_task = TASK_DECLARED[args.task].module == f"{__package__}.tasks"  # yours may read it
    if args.label_smoothing and args.task != "classification" and built_in_task:
        parser.error(
            f"--label-smoothing: --task {args.task} has no class labels to smooth (only "
            "--task classification uses it); drop it"
        )
    try:  # the data's version: cheap, a stat per directory while none changed (dataversion.py)
        args.data_version = args.data_path and data_version(args.data_path, args.data_dir)
        # the model's own size arguments, read from its function without importing it
        declared = MODEL_DECLARED[args.model]
        args.width, args.model_args = model_arguments(declared, args.width, args.model_args)
    except ValueError as exc:
        parser.error(str(exc))
    clash = sorted(set(args.model_args) & set(vars(args)))
    if clash:  # config.json holds them beside the flags: one name, one meaning
        parser.error(f"--model: model {args.model!r} has argument(s) named like run.py's flags "
                     f"({', '.join(clash)}); rename them in its function")  # fmt: skip
    for path in (args.results_dir, run_dir(args, parser)):
        if path.exists() and not path.is_dir():
            parser.error(f"--results-dir: {path} exists and is not a directory")
    return args, parser


def identity_args(args: argparse.Namespace) -> dict:
    """What the hash covers: of the experiment arguments (all but execution_keys()), those of
    the first release, and any other one away from its default (`data_version` too: None for
    the array datasets, whose released names must not move)."""
    defaults, execution = {a.dest: a.default for a in build_parser()._actions}, execution_keys()
    return {
        k: v
        for k, v in vars(args).items()
        if k not in execution and (k in FIRST_RELEASE_KEYS or v != defaults.get(k))
    }


def short_hash(identity: dict, digits: int = 8) -> str:
    """`digits` hex digits of sha256 over the sorted-key JSON of `identity`."""
    blob = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:digits]


def changed_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser, skip: Collection, order: tuple = ()
) -> list[str]:
    """`key=value` for every argument not at its default and not in `skip` (both callers name
    what stays out of the name): those in `order` first, in its order, then the others in parser
    order (stable names)."""
    rank, changed = {key: i for i, key in enumerate(order)}, []
    for action in sorted(parser._actions, key=lambda a: rank.get(a.dest, len(rank))):  # stable
        key, value = action.dest, getattr(args, action.dest, None)
        # None: --help, or an argument the model does not take (its width)
        if key in skip or value is None or value == action.default:
            continue
        if key == "model_args":  # those set on the command line, each as its own part
            defaults = MODEL_DECLARED[args.model].params if args.model in MODEL_DECLARED else {}
            changed += [(k, v) for k, v in value.items() if defaults.get(k, REQUIRED) != v]
        else:
            changed.append((key, value))
    return [f"{key}={_shown(value)}" for key, value in changed]


def _shown(value) -> str:
    """A value as a run's name shows it."""
    if isinstance(value, Path):  # the hash holds the full path; the name its folder
        return value.name
    if isinstance(value, tuple | list):
        return "x".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def readable_name(parts: list[str], identity: dict) -> str:
    """`<parts joined by _>-<hash8 of identity>`, file-name safe, the readable part capped."""
    readable = re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join(parts))[:MAX_READABLE].rstrip("_")
    return f"{readable}-{short_hash(identity)}"


def run_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path:
    """`<results-dir>/<dataset>_key=value_...-<hash8>`: the name's readable part lists the
    non-default experiment args."""
    parts = changed_args(args, parser, skip=execution_keys() | {"dataset"}, order=NAME_ORDER)
    return args.results_dir / readable_name([str(args.dataset), *parts], identity_args(args))


def run_of(text: str) -> Path:
    """The run directory of `run.py TEXT` (e.g. "--lr 0.01 --seed 1"), with the arguments the
    sweep running this job adds around it (SWEEP_RUN_ARGS), so one job list serves every preset.
    Bad arguments: run.py's one `error:` line, exit 2."""
    first, last = json.loads(os.environ.get(SWEEP_RUN_ARGS) or "[[], []]")
    return run_dir(*parse_args([*first, *shlex.split(text), *last]))


def resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """What config.json holds: all arguments (paths as strings) plus the run's identity."""
    cfg = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cfg.update(run_name=run_dir(args, parser).name, config_hash=short_hash(identity_args(args)))
    # The model's own arguments as keys of their own, so tables and legends name them.
    cfg.update(args.model_args)
    # the experiment arguments (all but execution_keys()), the model's own among them
    cfg["experiment_keys"] = sorted(
        {*vars(args), *args.model_args} - execution_keys() - {"model_args"}
    )
    cfg["code"] = runs.code_version(PROJECT_ROOT)  # which code made it: never in the identity
    return cfg
