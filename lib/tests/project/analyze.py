"""Compare two trained runs: linear CKA between their layers on the same test inputs.

    python analyze.py RUN_A RUN_B                  # the last hidden layer of each (default)
    python analyze.py "--seed 0" "--seed 1"        # runs named by run.py's arguments
    python analyze.py RUN_A RUN_B --layer 3        # another layer; a wrong name lists them all
    python analyze.py RUN_A RUN_B --images 2000    # more test inputs (a seeded random choice)
    python analyze.py RUN_A RUN_B --print-run-dir  # where it writes (imports no torch)

RUN_A and RUN_B: finished runs of run.py on the same data, each its directory or the arguments
of run.py that make it (starting with `-`): in run.sh's job list, `job analyze.py "--seed 0"
"--seed 1"` names the runs of that sweep and preset (labrun.config.run_of). Each model is built
by run.py's make_model from the run's config.json and loads its best_model.pt (tensors only: no
pickled code runs); forward hooks record every layer on the same test inputs. A layer returning
a tuple, dict or PackedSequence (GRU, LSTM, attention) is read as its first tensor
(similarity.first_tensor).
Writes results/analysis/<name>-<hash>/: cka_layers.csv (every layer of A x every layer of B),
metrics.json (`cka` of the chosen pair), config.json, status, run.log. A labrun job: exit codes,
claim, --fresh, MLflow and sweeps as for run.py; a failure is one `error:` line, status `failed`,
MLflow FAILED. Its identity: both runs' configurations and trainings, the layer, inputs, seed.
"""

import hashlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from labrun import jobs, runs
from labrun.config import MAX_READABLE, UsageError, _positive_int, _seed, _shown, run_of

DATA_KEYS = ("dataset", "data_path", "image_size", "synthetic_size")  # what decides the inputs


def build_parser():
    p = jobs.parser("analyze.py", __doc__.split("\n")[0], "results/analysis")
    a = p.add_argument_group("analysis (these define the job's hash)")
    a.add_argument("run_a", type=run_path, help="finished run of run.py (rows): its directory, "
                   "or run.py's arguments that make it, e.g. \"--seed 0\"")  # fmt: skip
    a.add_argument("run_b", type=run_path, help="finished run of run.py (columns), as RUN_A")
    a.add_argument("--layer", help="layer compared for `cka`, by name in both models; default: "
                   "each model's last hidden layer (the one before the output)")  # fmt: skip
    a.add_argument("--images", type=_positive_int, default=500, help="test inputs (at most all)")
    a.add_argument("--seed", type=_seed, default=0, help="seed of the choice of test inputs")
    x = p.add_argument_group("execution (not part of the hash)")
    x.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: a GPU if there is one")  # fmt: skip
    x.add_argument("--batch-size", type=_positive_int, default=256, help="inputs per forward")
    x.add_argument("--data-dir", type=Path, help="dataset cache; default: the one RUN_A used")
    return p


def run_path(text: str) -> Path:
    """A run directory; text starting with `-` is run.py's arguments (config.run_of)."""
    return run_of(text) if text.startswith("-") else Path(text)


def readable(args) -> list[str]:
    """`cka_<run A's name less what differs>_<A's differing arguments>_vs_<B's>`: both runs'
    distinguishing arguments (seed=0 too, a default that run names leave out) stay within the
    name's length cap (MAX_READABLE), the shared part cut first."""
    sides = {"RUN_A": args.run_a, "RUN_B": args.run_b}
    configs = [finished_config(run, side) for side, run in sides.items()]
    keys = dict.fromkeys(k for c in configs for k in c.get("experiment_keys", []))
    differ = [k for k in keys if configs[0].get(k) != configs[1].get(k)]
    mine = [[f"{k}={_shown(c.get(k))}" for k in differ] for c in configs]
    own = ["_".join(m) for m in mine] if differ else ["", "same"]  # a run with itself: `_vs_same`
    shared = re.sub(r"-[0-9a-f]{8}$", "", args.run_a.resolve().name)
    for part in mine[0]:  # A's differing values: in its own part, not twice
        shared = re.sub(rf"(^|_){re.escape(part)}(?=_|$)", "", shared)
    tail = [f"layer={args.layer}"] if args.layer else []
    room = MAX_READABLE - len("_".join(["cka", "vs", *tail])) - 3  # - the joining underscores
    if len(own[0]) + len(own[1]) > room:  # no room for the shared part: half each
        shared, own = "", [o[: room // 2] for o in own]
    while len(shared) + len(own[0]) + len(own[1]) > room:
        shared = shared.rpartition("_")[0]
    return [p for p in ("cka", shared, own[0], "vs", own[1], *tail) if p]


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
    """Both runs' configurations and trainings (a run trained again with --fresh writes another
    metrics.json: its old analysis stays apart), the layer, the inputs and their seed."""
    ident = {"layer": args.layer, "images": args.images, "seed": args.seed}
    for side, run in (("a", args.run_a), ("b", args.run_b)):
        ident[f"run_{side}"] = finished_config(run, f"RUN_{side.upper()}")["config_hash"]
        trained = hashlib.sha256((run / runs.METRICS).read_bytes()).hexdigest()[:16]
        ident[f"training_{side}"] = trained
    return ident


def load_model(run: Path, config: dict, which: str, device):
    """The run's model with its best weights; bad or crafted weights: one UsageError line."""
    import torch

    from run import make_model  # the model as run.py builds it, from the run's own flags

    args = SimpleNamespace(**{"model_args": {}, "input_shape": None, **config})
    model = make_model(args, info=args)  # config.json holds the data's shape beside the flags
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
    from labrun.tools.similarity import choose_layer, layers, test_inputs

    configs = [finished_config(args.run_a, "RUN_A"), finished_config(args.run_b, "RUN_B")]
    if differ := [k for k in DATA_KEYS if configs[0].get(k) != configs[1].get(k)]:
        raise UsageError(f"RUN_B: trained on other inputs than RUN_A ({', '.join(differ)} "
                         "differ): CKA compares representations of the same inputs")  # fmt: skip
    device = resolve_device(args.device)
    sides = ("RUN_A", "RUN_B")
    each = zip(sides, (args.run_a, args.run_b), configs, strict=True)
    models = [load_model(run, config, which, device) for which, run, config in each]
    chosen = [choose_layer(m, args.layer, which) for m, which in zip(models, sides, strict=True)]
    inputs = test_inputs(configs[0], args.images, args.seed, args.batch_size, device, args.data_dir)
    return models, [list(layers(m)) for m in models], chosen, inputs


def work(job: jobs.Job) -> dict:
    import pandas as pd
    from labrun.tools.similarity import activations, cka_matrix

    models, names, (layer_a, layer_b), inputs = job.prepared
    job.log.info("CKA of %s vs %s on %d test inputs", job.args.run_a, job.args.run_b,
                 sum(len(x) for x in inputs))  # fmt: skip
    pairs = zip(models, names, strict=True)
    features = [activations(model, inputs, layers, job.check_stop) for model, layers in pairs]
    table = pd.DataFrame(cka_matrix(*features), index=names[0], columns=names[1])
    csv = job.out / "cka_layers.csv"  # every layer of A (rows) with every layer of B
    runs.atomic_write_text(csv, table.rename_axis("layer_a").to_csv(float_format="%.6f"))
    job.artifacts.append(csv)
    cka = float(table.at[layer_a, layer_b])
    job.log.info("linear CKA of %s (A) and %s (B): %.4f", layer_a, layer_b, cka)
    images = len(features[0][names[0][0]])
    return {"cka": cka, "layer_a": layer_a, "layer_b": layer_b, "images": images}


def main(argv=None) -> int:
    return jobs.main(build_parser(), work, argv, identity=identity, readable=readable,
                     prepare=prepare)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
