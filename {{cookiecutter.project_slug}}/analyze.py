"""Compare two trained runs: linear CKA between their hidden layers on the same test images.

Usage (copy-paste):
    python analyze.py RUN_A RUN_B                  # the last hidden layer of each (default)
    python analyze.py RUN_A RUN_B --layer 3        # another layer; a wrong name lists them all
    python analyze.py RUN_A RUN_B --images 2000    # more test images (a seeded random choice)
    python analyze.py RUN_A RUN_B --print-run-dir  # where it writes (imports no torch)

RUN_A and RUN_B are finished run directories of run.py (metrics.json and best_model.pt), trained
on the same dataset. Each model is rebuilt from its config.json through the model registry, loads
its best_model.pt and runs on the same test images; forward hooks record every layer
(similarity.layers). Results go to results/analysis/<readable name>-<hash>/: metrics.json (`cka`
of the chosen layers, written last), cka_layers.csv (every layer of A against every layer of
B), config.json, status, run.log. The identity is the two runs' config hashes and trainings
(their metrics.json, written once at the end of each training: a run trained again with --fresh
is analysed again), the layer, the number of images and the seed; run again, it says "already
finished". A job of jobs.py: exit
codes, the claim, --fresh, MLflow tracking and `run.sh` sweeps work as for run.py.
"""

import argparse
import csv
import hashlib
import io
import sys
from pathlib import Path
from types import SimpleNamespace

from labrun import jobs, runs
from labrun.config import UsageError, _positive_int, _seed

TABLE = "cka_layers.csv"
# The arguments of run.py that decide which images the test split holds.
DATA_KEYS = ("dataset", "data_path", "image_size", "synthetic_size")


def build_parser() -> argparse.ArgumentParser:
    p = jobs.parser(
        "analyze.py",
        "Linear CKA between hidden layers of two trained runs, on the same test images.",
        "results/analysis",
    )
    a = p.add_argument_group("analysis (these define the job's hash)")
    a.add_argument("run_a", type=Path, help="finished run directory of run.py (rows of the table)")
    a.add_argument("run_b", type=Path, help="finished run directory of run.py (columns)")
    a.add_argument(
        "--layer",
        default=None,
        help="layer compared for `cka`, by name in both models; default: each model's last "
        "hidden layer (the one before the classifier)",
    )
    a.add_argument(
        "--images", type=_positive_int, default=500, help="test images used (at most all)"
    )
    a.add_argument("--seed", type=_seed, default=0, help="seed of the choice of test images")
    x = p.add_argument_group("execution (not part of the hash)")
    x.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto = cuda when available",
    )
    x.add_argument("--batch-size", type=_positive_int, default=256, help="images per forward")
    x.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where datasets are cached; default: the one RUN_A was trained with",
    )
    return p


def finished_config(run: Path, flag: str) -> dict:
    """A finished run's config.json; NotReady while it trains, UsageError if it is no run."""
    if not run.is_dir():
        raise jobs.NotReady(f"{flag}: {run} does not exist (yet): train it first")
    if not runs.is_done(run):
        raise jobs.NotReady(f"{flag}: {run} is not finished (no metrics.json): train it first")
    if not (run / runs.BEST_MODEL).is_file():
        raise UsageError(f"{flag}: {run} has no {runs.BEST_MODEL}")
    try:
        config = runs.read_json(run / runs.CONFIG)
        config["config_hash"]  # noqa: B018 (a config.json of run.py has it)
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{flag}: {run}/{runs.CONFIG} is missing or not run.py's") from None
    return config


def training(run: Path) -> str:
    """Which training of `run` is analysed: its metrics.json is written once, last, by each
    training, so a run trained again (--fresh) has another, and its old analysis stays apart."""
    return hashlib.sha256((run / runs.METRICS).read_bytes()).hexdigest()[:16]


def identity(args) -> dict:
    a, b = finished_config(args.run_a, "RUN_A"), finished_config(args.run_b, "RUN_B")
    return {
        "run_a": a["config_hash"],
        "run_b": b["config_hash"],
        "training_a": training(args.run_a),
        "training_b": training(args.run_b),
        "layer": args.layer,
        "images": args.images,
        "seed": args.seed,
    }


def readable(args) -> list[str]:
    parts = ["cka", args.run_a.resolve().name, "vs", args.run_b.resolve().name]
    if args.layer is not None:
        parts.append(f"layer={args.layer}")
    return parts


def prepare(args) -> SimpleNamespace:
    """Both models with their best weights, the layer names, the test images: every bad input
    is found here, before a file of the job is written."""
    from labrun.checkpoint import (  # one per line: fits any package name
        CheckpointError,
        load_model_state,
        load_weights,
    )
    from labrun.hardware import resolve_device
    from labrun.models import create_model
    from labrun.similarity import default_layer, describe, layers

    configs = [finished_config(args.run_a, "RUN_A"), finished_config(args.run_b, "RUN_B")]
    differ = [k for k in DATA_KEYS if configs[0].get(k) != configs[1].get(k)]
    if differ:
        raise UsageError(
            f"RUN_B: trained on other images than RUN_A ({', '.join(differ)} differ): "
            "CKA compares representations of the same inputs"
        )
    device = resolve_device(args.device)
    models = []
    for run, config in zip((args.run_a, args.run_b), configs, strict=True):
        model = create_model(
            config.get("model", "cnn"),
            num_classes=config["num_classes"],
            channels=config["channels"],
            image_size=tuple(config["image_size"]),
            width=config["width"],
        )
        try:
            load_model_state(model, load_weights(run / runs.BEST_MODEL), str(run))
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
        models.append(model.to(device).eval())
    names = [list(layers(m)) for m in models]
    chosen = [args.layer or default_layer(found) for found in names]  # each its last hidden
    for which, layer, found, model in zip(("RUN_A", "RUN_B"), chosen, names, models, strict=True):
        if layer not in found:
            raise UsageError(
                f"--layer: {layer!r} is not a layer of {which}'s model; choose one of "
                f"{describe(layers(model))}"
            )
    images = test_images(configs[0], args, device)
    return SimpleNamespace(models=models, names=names, layers=chosen, images=images)


def test_images(config: dict, args, device):
    """`--images` test images of the runs' dataset (a seeded choice), as one batch per entry."""
    import torch

    from labrun.data import FileSplit, Split, build_loader, load_dataset

    image_size = config.get("image_size")  # the size the run's model saw (config.json)
    loaded = load_dataset(
        config["dataset"],
        args.data_dir or config["data_dir"],
        data_path=config.get("data_path"),
        image_size=tuple(image_size) if image_size else None,
        val_fraction=config.get("val_fraction", 0.1),
        seed=config.get("seed", 0),
        synthetic_size=config.get("synthetic_size", 10_000),
        workers=0,
    )
    test = loaded.splits["test"]
    n = min(args.images, len(test))
    chosen = torch.randperm(len(test), generator=torch.Generator().manual_seed(args.seed))[:n]
    chosen = chosen.sort().values
    if isinstance(test, FileSplit):
        test = FileSplit([test.paths[i] for i in chosen], test.labels[chosen], test.image_shape)
    else:
        test = Split(test.images[chosen], test.labels[chosen])
    loader = build_loader(test, args.batch_size, train=False, device=device, workers=0)
    return [x for x, _ in loader]


def work(job: jobs.Job) -> dict:
    from labrun.similarity import activations, cka_matrix

    p = job.prepared
    n = sum(len(x) for x in p.images)
    job.log.info("CKA of %s vs %s on %d test images", job.args.run_a, job.args.run_b, n)
    features = [activations(m, p.images, names, job.check_stop) for m, names in zip(
        p.models, p.names, strict=True)]  # fmt: skip
    matrix = cka_matrix(*features)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["layer_a", *p.names[1]])
    for name, row in zip(p.names[0], matrix, strict=True):
        writer.writerow([name, *(f"{v:.6f}" for v in row)])
    runs.atomic_write_text(job.out / TABLE, buf.getvalue())
    job.artifacts.append(job.out / TABLE)
    (layer_a, layer_b), (names_a, names_b) = p.layers, p.names
    cka = matrix[names_a.index(layer_a)][names_b.index(layer_b)]
    job.log.info("linear CKA of %s (A) and %s (B): %.4f (every pair: %s)", layer_a, layer_b, cka,
                 TABLE)  # fmt: skip
    return {"cka": cka, "layer_a": layer_a, "layer_b": layer_b, "images": n}


def main(argv: list[str] | None = None) -> int:
    return jobs.main(
        build_parser(), work, argv, identity=identity, readable=readable, prepare=prepare
    )


if __name__ == "__main__":
    sys.exit(main())
