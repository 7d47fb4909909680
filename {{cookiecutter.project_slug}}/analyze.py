"""Compare two trained runs: linear CKA between their layers on the same test inputs.

    python analyze.py RUN_A RUN_B                  # the last hidden layer of each (default)
    python analyze.py RUN_A RUN_B --layer 3        # another layer; a wrong name lists them all
    python analyze.py RUN_A RUN_B --images 2000    # more test inputs (a seeded random choice)
    python analyze.py RUN_A RUN_B --print-run-dir  # where it writes (imports no torch)

RUN_A and RUN_B are finished run directories of run.py trained on the same data. Each model is
rebuilt from its config.json, loads its best_model.pt (tensors only: no pickled code runs) and
sees the same test inputs; forward hooks record every layer. A layer that returns a tuple, a dict
or a PackedSequence (GRU, LSTM, attention) is read as its first tensor (similarity.first_tensor).
Results go to results/analysis/<name>-<hash>/: cka_layers.csv (every layer of A x every layer of
B), metrics.json (`cka` of the chosen pair, written last), config.json, status, run.log; the
identity is both runs' config hashes and trainings, the layer, the inputs and the seed. A job of
labrun.jobs: exit codes, the claim, --fresh, MLflow tracking and sweeps work as for run.py; any
failure is one `error:` line, status `failed` and the MLflow run FAILED. Figures: plot.py --analysis.
"""

import hashlib
import sys
from pathlib import Path

from labrun import jobs, runs
from labrun.config import UsageError, _positive_int, _seed

DATA_KEYS = ("dataset", "data_path", "image_size", "synthetic_size")  # what decides the inputs


def build_parser():
    p = jobs.parser("analyze.py", __doc__.split("\n")[0], "results/analysis")
    a = p.add_argument_group("analysis (these define the job's hash)")
    a.add_argument("run_a", type=Path, help="finished run directory of run.py (rows)")
    a.add_argument("run_b", type=Path, help="finished run directory of run.py (columns)")
    a.add_argument("--layer", help="layer compared for `cka`, by name in both models; default: "
                   "each model's last hidden layer (the one before the output)")  # fmt: skip
    a.add_argument("--images", type=_positive_int, default=500, help="test inputs (at most all)")
    a.add_argument("--seed", type=_seed, default=0, help="seed of the choice of test inputs")
    x = p.add_argument_group("execution (not part of the hash)")
    x.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if any"
    )
    x.add_argument("--batch-size", type=_positive_int, default=256, help="inputs per forward")
    x.add_argument("--data-dir", type=Path, help="dataset cache; default: the one RUN_A used")
    return p


def finished_config(run: Path, flag: str) -> dict:
    """A finished run's config.json; NotReady while it trains, UsageError if it is no run."""
    if not runs.is_done(run):
        raise jobs.NotReady(f"{flag}: {run} is not finished (no metrics.json): train it first")
    try:
        config = runs.read_json(run / runs.CONFIG)
        config["config_hash"]  # noqa: B018 (every config.json of run.py has it)
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{flag}: {run}/{runs.CONFIG} is missing or not run.py's") from None
    return config


def identity(args) -> dict:
    """Both runs' configurations and trainings: a run trained again (--fresh) writes another
    metrics.json, so its old analysis stays apart."""
    a, b = finished_config(args.run_a, "RUN_A"), finished_config(args.run_b, "RUN_B")
    trained = [hashlib.sha256((r / runs.METRICS).read_bytes()).hexdigest()[:16]
               for r in (args.run_a, args.run_b)]  # fmt: skip
    return {"run_a": a["config_hash"], "run_b": b["config_hash"], "training_a": trained[0],
            "training_b": trained[1], "layer": args.layer, "images": args.images, "seed": args.seed}  # fmt: skip


def load_model(run: Path, config: dict, which: str, device):
    """The run's model with its best weights; bad or crafted weights: one UsageError line."""
    import torch
    from labrun.models import create_model

    model = create_model(config.get("model", "cnn"), num_classes=config["num_classes"],
                         channels=config["channels"], image_size=tuple(config["image_size"]),
                         width=config["width"])  # fmt: skip
    if not (run / runs.BEST_MODEL).is_file():
        raise UsageError(f"{which}: {run} has no {runs.BEST_MODEL}")
    try:  # weights_only: tensors and numbers only, a crafted pickle is refused, never run
        state = torch.load(run / runs.BEST_MODEL, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:  # torch's own text is many lines of advice that does not apply
        raise UsageError(f"{which}: {run / runs.BEST_MODEL} is not weights of this run's model "
                         f"({type(exc).__name__}); train the run again") from None  # fmt: skip
    return model.to(device).eval()


def prepare(args):
    """Both models, their layers and the test inputs: bad input is found before a file is made."""
    from labrun.hardware import resolve_device
    from labrun.similarity import default_layer, describe, layers

    configs = [finished_config(args.run_a, "RUN_A"), finished_config(args.run_b, "RUN_B")]
    if differ := [k for k in DATA_KEYS if configs[0].get(k) != configs[1].get(k)]:
        raise UsageError(f"RUN_B: trained on other inputs than RUN_A ({', '.join(differ)} "
                         "differ): CKA compares representations of the same inputs")  # fmt: skip
    device = resolve_device(args.device)
    pairs = zip(("RUN_A", "RUN_B"), (args.run_a, args.run_b), configs, strict=True)
    models = [load_model(run, config, which, device) for which, run, config in pairs]
    names = [list(layers(m)) for m in models]
    chosen = [args.layer or default_layer(found) for found in names]
    for which, layer, found, model in zip(("RUN_A", "RUN_B"), chosen, names, models, strict=True):
        if layer not in found:
            raise UsageError(f"--layer: {layer!r} is not a layer of {which}'s model; choose one "
                             f"of {describe(layers(model))}")  # fmt: skip
    return models, names, chosen, test_inputs(configs[0], args, device)


def test_inputs(config: dict, args, device) -> list:
    """`--images` test inputs of the runs' dataset (a seeded choice), in batches on `device`."""
    import torch
    from labrun.data import FileSplit, Split, build_loader, load_dataset

    loaded = load_dataset(
        config["dataset"], args.data_dir or config["data_dir"], data_path=config.get("data_path"),
        image_size=tuple(config["image_size"]) if config.get("image_size") else None,
        val_fraction=config.get("val_fraction", 0.1), seed=config.get("seed", 0),
        synthetic_size=config.get("synthetic_size", 10_000), workers=0,
    )  # fmt: skip
    test = loaded.splits["test"]
    generator = torch.Generator().manual_seed(args.seed)
    chosen = torch.randperm(len(test), generator=generator)[: args.images].sort().values
    if isinstance(test, FileSplit):
        test = FileSplit([test.paths[i] for i in chosen], test.labels[chosen], test.image_shape)
    else:
        test = Split(test.images[chosen], test.labels[chosen])
    loader = build_loader(test, args.batch_size, train=False, device=device, workers=0)
    return [x for x, _ in loader]


def work(job: jobs.Job) -> dict:
    import pandas as pd
    from labrun.similarity import activations, cka_matrix

    models, names, (layer_a, layer_b), inputs = job.prepared
    job.log.info("CKA of %s vs %s on %d test inputs", job.args.run_a, job.args.run_b,
                 sum(len(x) for x in inputs))  # fmt: skip
    features = [
        activations(m, inputs, n, job.check_stop) for m, n in zip(models, names, strict=True)
    ]
    table = pd.DataFrame(cka_matrix(*features), index=names[0], columns=names[1])
    runs.atomic_write_text(
        job.out / "cka_layers.csv", table.rename_axis("layer_a").to_csv(float_format="%.6f")
    )
    job.artifacts.append(job.out / "cka_layers.csv")
    cka = float(table.at[layer_a, layer_b])
    job.log.info("linear CKA of %s (A) and %s (B): %.4f", layer_a, layer_b, cka)
    return {
        "cka": cka,
        "layer_a": layer_a,
        "layer_b": layer_b,
        "images": len(features[0][names[0][0]]),
    }


def main(argv=None) -> int:
    readable = lambda a: ["cka", a.run_a.resolve().name, "vs", a.run_b.resolve().name] + (  # noqa: E731
        [f"layer={a.layer}"] if a.layer else [])  # fmt: skip
    return jobs.main(
        build_parser(), work, argv, identity=identity, readable=readable, prepare=prepare
    )


if __name__ == "__main__":
    sys.exit(main())
