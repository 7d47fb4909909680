"""analyze.py and labrun.tools.similarity: linear CKA, its properties, layers whatever they return,
and the job on two real runs of run.py.

The properties are the ones a wrong formula breaks: without centring, X and X + offset are not
at 1; a normalisation by the wrong norms leaves [0, 1] or breaks the scale invariance; any
whitening would make every invertible linear map look identical.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEADLINE, ROOT, TINY, load_run_py
from torch import nn

from labrun import runs
from labrun.models import create_model, register_model
from labrun.tools.similarity import activations, default_layer, first_tensor, layers, linear_cka

CNN_LAYERS = ["stem", "stage1", "stage2", "stage3", "pool", "flatten", "fc"]  # the default model's


def random_features(n=64, p=20, seed=0) -> torch.Tensor:
    return torch.randn(n, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def random_orthogonal(p: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(random_features(p, p, seed))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed, det +-1


def test_cka_of_a_representation_with_itself_is_one():
    x = random_features()
    assert abs(linear_cka(x, x) - 1) < 1e-12
    assert abs(linear_cka(x.float(), x.float()) - 1) < 1e-5  # float32 activations too


def test_cka_is_invariant_to_rotation_and_isotropic_scaling():
    x, y = (
        random_features(seed=1),
        random_features(p=12, seed=2) + 0.5 * random_features(seed=1)[:, :12],
    )
    q = random_orthogonal(x.shape[1], seed=3)
    assert not torch.allclose(x @ q, x)  # a real rotation
    base = linear_cka(x, y)
    assert 0.05 < base < 0.95  # neither trivial end, so equality below means something
    assert linear_cka(x @ q, y) == pytest.approx(base, abs=1e-10)
    assert linear_cka(7.5 * x, 0.01 * y) == pytest.approx(base, abs=1e-10)
    assert linear_cka(x, x @ q * 3.0) == pytest.approx(1.0, abs=1e-10)


def test_cka_is_not_invariant_to_an_arbitrary_invertible_map():
    x = random_features(seed=4)
    stretch = torch.diag(torch.logspace(-2, 2, x.shape[1], dtype=torch.float64))
    mixed = stretch @ random_orthogonal(x.shape[1], seed=5)  # invertible, not orthogonal
    assert torch.linalg.matrix_rank(mixed) == x.shape[1]
    assert linear_cka(x, x @ mixed) < 0.9


def test_cka_centres_the_features():
    x = random_features(seed=6)
    offset = torch.full((1, x.shape[1]), 10.0, dtype=torch.float64)
    assert linear_cka(x, x + offset) == pytest.approx(1.0, abs=1e-10)
    # The same formula without centring is far from 1 here: the test can tell them apart.
    a, b = x.numpy(), (x + offset).numpy()
    uncentred = np.linalg.norm(b.T @ a) ** 2 / (np.linalg.norm(a.T @ a) * np.linalg.norm(b.T @ b))
    assert uncentred < 0.9


def test_cka_lies_in_the_unit_interval_and_matches_the_feature_space_formula():
    for seed in range(20):
        x = random_features(n=30, p=1 + seed, seed=seed)
        y = random_features(n=30, p=40 - seed, seed=100 + seed) + (seed % 3) * x[:, :1]
        value = linear_cka(x, y)
        assert 0.0 <= value <= 1.0
        a, b = x.numpy() - x.numpy().mean(0), y.numpy() - y.numpy().mean(0)
        paper = np.linalg.norm(b.T @ a) ** 2 / (np.linalg.norm(a.T @ a) * np.linalg.norm(b.T @ b))
        assert value == pytest.approx(paper, rel=1e-9)


def test_layers_of_the_registered_models_and_their_default():
    cnn = layers(create_model("cnn", num_classes=10, channels=1, image_size=(8, 8), width=8))
    assert list(cnn) == CNN_LAYERS and default_layer(list(cnn)) == "flatten"
    resnet = layers(
        create_model("resnet18", num_classes=10, channels=3, image_size=(32, 32), width=8)
    )
    assert list(resnet) == ["stem", *(f"blocks.{i}" for i in range(8)), "fc"]
    assert default_layer(list(resnet)) == "blocks.7"


def test_help_and_print_run_dir_import_neither_torch_nor_mlflow(tmp_path):
    for args in (["--help"], [str(tmp_path), str(tmp_path), "--print-run-dir"]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", str(ROOT / "analyze.py"), *args],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()}
        assert not {"torch", "mlflow"} & imported, args
    assert (
        "--layer"
        in subprocess.run(
            [sys.executable, str(ROOT / "analyze.py"), "--help"], capture_output=True, text=True
        ).stdout
    )


# ---- layers that return tuples, dicts or packed sequences (issue 30.5) -------------------------
class Rows(nn.Module):
    """Images (N, C, H, W) as sequences of H rows of W features."""

    def forward(self, x):
        return x.float().mean(1)


class Packed(nn.Module):
    def forward(self, x):
        return nn.utils.rnn.pack_padded_sequence(x, [x.shape[1]] * len(x), batch_first=True)


class Keyed(nn.Module):
    def forward(self, x):
        return {"weights": None, "output": (x, x.sum())}


class Attend(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 1, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x)  # (output, attention weights)


class Last(nn.Module):
    def forward(self, x):
        x = x[0] if isinstance(x, tuple) else x
        x = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)[0] if isinstance(
            x, nn.utils.rnn.PackedSequence) else x  # fmt: skip
        return x[:, -1]


class LastOfTimeFirst(nn.Module):
    def forward(self, x):
        return x[0][-1]


class Pick(nn.Module):
    def forward(self, x):
        return x["output"][0]


class TimeFirst(nn.Module):
    def forward(self, x):
        return x.transpose(0, 1)


def sequence_model(width: int = 6, classes: int = 3, features: int = 5) -> nn.Sequential:
    return nn.Sequential(
        nn.GRU(features, width, batch_first=True),  # (output, h_n)
        Last(),
        nn.Linear(width, width),
        nn.Unflatten(1, (1, width)),
        Packed(),  # a PackedSequence
        nn.LSTM(width, width, batch_first=True),  # (PackedSequence, (h_n, c_n))
        Last(),
        nn.Unflatten(1, (1, width)),
        Attend(width),  # (output, attention weights)
        Last(),
        nn.Unflatten(1, (1, width)),
        Keyed(),  # a dict whose first value holds no tensor
        Pick(),
        TimeFirst(),
        nn.GRU(width, width),  # sequence-first: (time, batch, features)
        LastOfTimeFirst(),
        nn.Linear(width, classes),
    )


def test_layers_returning_tuples_dicts_and_packed_sequences_are_read():
    model = sequence_model()
    batches = [torch.randn(4, 7, 5), torch.randn(3, 7, 5)]
    names = list(layers(model))
    got = activations(model, batches, names)
    assert all(v.shape[0] == 7 for v in got.values()), {k: v.shape for k, v in got.items()}
    assert got["0"].shape == (7, 7 * 6)  # the GRU's output (batch, time, width), not h_n
    assert got["5"].shape == (7, 6) and got["8"].shape == (7, 6)  # LSTM padded; attention output
    assert got["11"].shape == (7, 6)  # the dict's first value that holds a tensor
    assert got["13"].shape == got["14"].shape == (7, 6)  # (time, batch, width) read batch first
    with torch.no_grad():
        expected = model[0](batches[0])[0].flatten(1)
    assert torch.allclose(got["0"][:4], expected)
    assert linear_cka(got["0"], got["0"]) == pytest.approx(1.0)


def test_an_output_without_the_batch_is_named():
    with pytest.raises(ValueError, match=r"no dimension of 4 inputs"):
        first_tensor(torch.zeros(3, 5), 4)
    with pytest.raises(ValueError, match="holds no tensor"):
        first_tensor(("text", None), 4)
    assert first_tensor([{"a": torch.ones(4, 2, 3)}], 4).shape == (4, 6)


# ---- the job, on two real runs of run.py --------------------------------------------------------
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("cka")
    run = load_run_py()
    where = ["--results-dir", str(base / "runs"), "--data-dir", str(base / "data")]
    for seed in ("0", "1"):
        assert run.main([*TINY, *where, "--epochs", "1", "--seed", seed, "--tracking", "off",
                         "--image-size", "16"]) == 0  # fmt: skip
    a, b = sorted((base / "runs").iterdir(), key=lambda p: "seed=1" in p.name)
    return a, b


def analyze(*args, results: Path, env: dict | None = None):
    env = env or {**os.environ, "LAB_TRACKING": "off"}
    return subprocess.run(
        [sys.executable, str(ROOT / "analyze.py"), *map(str, args), "--results-dir", str(results),
         "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def load_analyze():
    spec = importlib.util.spec_from_file_location("analyze_under_test", ROOT / "analyze.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rowgru(num_classes, channels, image_size, width):
    return nn.Sequential(Rows(), nn.GRU(image_size[1], width, batch_first=True), Last(),
                         nn.Linear(width, num_classes))  # fmt: skip


@pytest.fixture
def registered_rowgru():
    """`rowgru` registered for one test only: a registration at import would stay in the
    registry for every later test of the process (test_model compares it with the sources)."""
    from labrun.models import MODELS

    register_model("rowgru", help="a GRU over image rows (tests)")(rowgru)
    yield
    dict.pop(MODELS, "rowgru", None)


def finished_run(where: Path, **experiment) -> Path:
    """A run directory as analyze.py reads it before loading a model: config.json, metrics.json."""
    where.mkdir(parents=True)
    config = {"config_hash": "0", "experiment_keys": sorted(experiment), **experiment}
    (where / "config.json").write_text(json.dumps(config))
    (where / "metrics.json").write_text('{"test_acc": 0.5}')
    return where


def test_an_analysis_name_keeps_what_tells_its_runs_apart(tmp_path):
    """Issue 50: the issue's pair of long run names lost B's seed to the length cap; now each
    run's differing arguments (seed=0 too, which run names leave out) stay, the shared part is
    cut first, and arguments too long for the cap get half of it each."""
    from labrun.config import MAX_READABLE

    def name(a: Path, b: Path, layer=None) -> str:
        return "_".join(load_analyze().readable(argparse.Namespace(run_a=a, run_b=b, layer=layer)))

    shared = dict(dataset="digits", model="resnet18", width=8, epochs=40, image_size=[16, 16])
    long = "digits_model=resnet18_width=8_epochs=40_image_size=16x16_patience=0_weight_decay=0.001"
    a = finished_run(tmp_path / f"{long}-01f16fa3", **shared, seed=0)
    b = finished_run(tmp_path / f"{long}_seed=1-68654187", **shared, seed=1)
    assert (
        name(a, b)
        == "cka_digits_model=resnet18_width=8_epochs=40_image_size=16x16_seed=0_vs_seed=1"
    )
    assert len(name(a, b, "blocks.7")) <= MAX_READABLE
    assert name(a, b, "blocks.7").endswith("_seed=0_vs_seed=1_layer=blocks.7")
    assert name(a, a).startswith("cka_digits_model=") and name(a, a).endswith("_vs_same")
    assert len(name(a, a)) <= MAX_READABLE
    many = {f"key{i}": "x" * 9 for i in range(6)}
    c = finished_run(tmp_path / "c-00000000", **shared, **many, seed=2)
    far = name(a, c)  # every difference of A then of B, cut to half the room each
    assert len(far) <= MAX_READABLE and far.startswith("cka_seed=0_key0=None_key1=None_")
    assert "_vs_seed=2_key0=xxxxxxxxx_" in far


def test_a_run_named_by_its_arguments_is_the_one_its_sweep_trains(monkeypatch, tmp_path):
    """Issue 50: `job analyze.py "--seed 1" ...` names the run the same sweep trains for the job
    line `--seed 1`: its results folder and preset first, `-- ARGS` last (LAB_SWEEP_RUN_ARGS);
    outside a sweep, the run `python run.py --seed 1` writes."""
    from labrun.config import TRIALS_DIR, run_of

    first, last = ["--results-dir", str(tmp_path / "quick"), "--epochs", "6", "--width", "16"], [
        "--image-size", "12"]  # fmt: skip
    monkeypatch.setenv("LAB_SWEEP_RUN_ARGS", json.dumps([first, last]))
    argv = [sys.executable, str(ROOT / "run.py"), *first, "--seed", "1", "--width", "8", *last]
    printed = subprocess.run(
        [*argv, "--print-run-dir"], capture_output=True, text=True, timeout=120
    )
    assert run_of("--seed 1 --width 8") == Path(printed.stdout.strip())
    assert "width=8" in printed.stdout and "image_size=12x12" in printed.stdout
    monkeypatch.delenv("LAB_SWEEP_RUN_ARGS")
    assert run_of("--seed 1").parent == TRIALS_DIR


def test_a_model_with_a_gru_is_analysed(two_runs, tmp_path, capsys, registered_rowgru):
    """Issue 30.5: analyze.py on a model whose layer returns a tuple (today: AttributeError in
    the hook, exit 1, status failed)."""
    a, _ = two_runs
    gru = tmp_path / "runs" / a.name
    shutil.copytree(a, gru)
    config = json.loads((gru / "config.json").read_text())
    config["model"] = "rowgru"
    (gru / "config.json").write_text(json.dumps(config))
    model = rowgru(config["num_classes"], config["channels"], config["image_size"], 8)
    torch.save(model.state_dict(), gru / "best_model.pt")
    results = tmp_path / "analysis"
    args = [str(gru), str(gru), "--layer", "1", "--images", "50", "--results-dir", str(results),
            "--device", "cpu", "--tracking", "off"]  # fmt: skip
    assert load_analyze().main(args) == 0, capsys.readouterr().err
    (out,) = results.iterdir()
    assert runs.read_status(out) == "finished"
    assert runs.read_metrics(out)["cka"] == pytest.approx(1.0, abs=1e-5)


def test_a_failure_is_one_line_status_failed_and_mlflow_failed(two_runs, tmp_path, env, capsys,
                                                              monkeypatch):  # fmt: skip
    """Issue 30.5: whatever fails inside the job ends it `failed`, in run.log, in one `error:`
    line and in MLflow (not left RUNNING)."""
    from mlflow.tracking import MlflowClient

    import labrun.tools.similarity

    def broken(*_):
        raise RuntimeError("the CKA went wrong\nand a second line of detail")

    monkeypatch.setattr(labrun.tools.similarity, "cka_matrix", broken)
    a, b = two_runs
    results = tmp_path / "analysis"
    experiment = f"cka-{tmp_path.name}"
    args = [str(a), str(b), "--images", "20", "--results-dir", str(results), "--device", "cpu"]
    code = load_analyze().main([*args, "--tracking", "on", "--experiment", experiment])
    err = capsys.readouterr().err
    assert code == 1
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        "error: RuntimeError: the CKA went wrong"]  # fmt: skip
    (out,) = results.iterdir()
    assert runs.read_status(out) == "failed" and not (out / "metrics.json").exists()
    assert "the CKA went wrong" in (out / "run.log").read_text()
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (found,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert found.info.status == "FAILED"


def test_a_crafted_weights_file_is_refused_in_one_line(two_runs, tmp_path):
    """Issue 29.10: a best_model.pt that would run code when unpickled is refused by torch's
    weights_only loader; analyze.py says so in one line, without torch's advice to load it
    anyway (today: 6 lines ending in advice that does not apply)."""
    a, b = two_runs
    crafted = tmp_path / "runs" / a.name
    shutil.copytree(a, crafted)
    torch.save({"weight": os.system}, crafted / "best_model.pt")  # a pickled callable
    refused = analyze(crafted, b, results=tmp_path / "analysis")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"error: RUN_A: {crafted / 'best_model.pt'} is not weights of this run's model "
        "(UnpicklingError); train the run again"
    ]
    assert not (tmp_path / "analysis").exists() or not any((tmp_path / "analysis").iterdir())


def read_table(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    rows = list(csv.reader(path.read_text().splitlines()))
    return [r[0] for r in rows[1:]], rows[0][1:], np.array([r[1:] for r in rows[1:]], float)


@pytest.mark.slow
def test_analyze_two_runs_end_to_end(two_runs, tmp_path):
    a, b = two_runs
    results = tmp_path / "analysis"
    first = analyze(a, b, results=results)
    assert first.returncode == 0, first.stderr
    (out,) = results.iterdir()
    # Both runs' distinguishing arguments in the name (seed=0 too, which run names leave out)
    assert out.name.endswith("_seed=0_vs_seed=1-" + out.name[-8:]), out.name
    assert runs.read_status(out) == "finished"
    metrics = runs.read_metrics(out)
    rows, cols, table = read_table(out / "cka_layers.csv")
    assert rows == cols == CNN_LAYERS
    assert metrics["layer_a"] == metrics["layer_b"] == "flatten"  # the last hidden layer of each
    assert metrics["images"] == 360  # digits' whole test split: fewer than --images 500
    assert metrics["cka"] == pytest.approx(table[5, 5], abs=1e-6)
    assert ((table >= 0) & (table <= 1)).all() and 0 < metrics["cka"] < 0.999
    again = analyze(a, b, results=results)
    assert again.returncode == 0 and again.stdout.startswith(f"already finished: {out}")

    # A run with itself: every layer with itself is 1 (the same images, the same weights).
    itself = analyze(a, a, "--images", "100", results=results)
    assert itself.returncode == 0, itself.stderr
    where = analyze(a, a, "--images", "100", "--print-run-dir", results=results)
    same = Path(where.stdout.strip())
    assert runs.read_metrics(same)["cka"] == pytest.approx(1.0, abs=1e-5)
    assert np.allclose(np.diagonal(read_table(same / "cka_layers.csv")[2]), 1.0, atol=1e-5)

    # plot.py draws each result as a heat map of the declared size, and the mean over the seed
    # pairs (here one: A and B differ only in --seed; A with itself is no pair) with its table.
    figures = tmp_path / "figures"
    drawn = subprocess.run(
        [sys.executable, str(ROOT / "plot.py"), "--analysis", str(results), "--out",
         str(figures), "--formats", "pdf", "png"],
        capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr
    seeds = "cka_seeds_" + a.name[:-9]  # run A's name without its hash (and seed=0)
    assert sorted(p.name for p in figures.iterdir()) == sorted(
        f"{d}.{ext}" for d in (out.name, same.name) for ext in ("pdf", "png")
    ) + sorted(f"{seeds}.{ext}" for ext in ("csv", "pdf", "png", "tex"))
    with open(figures / f"{seeds}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["layer_a"] for r in rows] == CNN_LAYERS
    assert float(rows[5]["same_mean"]) == pytest.approx(table[5, 5], abs=1e-5)  # one pair: itself
    assert all(float(r["best_mean"]) == pytest.approx(table[i].max(), abs=1e-5)
               for i, r in enumerate(rows)) and rows[0]["n"] == "1"  # fmt: skip
    assert "mean $\\pm$ SE over 1 seed pair of " in (figures / f"{seeds}.tex").read_text()
    pdf = (figures / f"{out.name}.pdf").read_bytes()
    assert b"/MediaBox [ 0 0 234 " in pdf  # 3.25 in = 234 pt wide: no tight crop


@pytest.mark.slow
def test_analyze_identity_and_refusals(two_runs, tmp_path):
    a, b = two_runs
    results = tmp_path / "analysis"

    def where(*args):
        return analyze(*args, "--print-run-dir", results=results).stdout.strip()

    # The identity is the runs' config hashes (not their paths), the layer and the image count.
    moved = tmp_path / "elsewhere" / a.name
    shutil.copytree(a, moved)
    assert where(moved, b) == where(a, b)
    assert (
        len({where(a, b), where(b, a), where(a, b, "--layer", "3"), where(a, b, "--images", "9")})
        == 4
    )

    bad = analyze(a, b, "--layer", "nope", results=results)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert (
        bad.stderr.startswith("error: --layer: 'nope' is not a layer")
        and "fc (Linear)" in bad.stderr
    )
    assert not results.exists() or not any(results.iterdir())  # refused: nothing left behind

    unfinished = tmp_path / "unfinished" / a.name
    shutil.copytree(a, unfinished)
    (unfinished / "metrics.json").unlink()
    refused = analyze(a, unfinished, results=results)
    assert refused.returncode == 2 and refused.stderr.startswith("error: RUN_B: ")
    assert "not finished" in refused.stderr
    (moved / "best_model.pt").unlink()
    refused = analyze(moved, b, results=results)
    assert refused.returncode == 2 and "has no best_model.pt" in refused.stderr


@pytest.mark.slow
def test_analyze_is_tracked_in_mlflow(two_runs, tmp_path, env):
    from mlflow.tracking import MlflowClient

    a, b = two_runs
    results = tmp_path / "analysis"
    done = analyze(a, b, "--images", "50", "--tracking", "on", results=results, env=env)
    assert done.returncode == 0, done.stderr
    (out,) = results.iterdir()
    metrics = json.loads((out / "metrics.json").read_text())
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["cka"] == pytest.approx(
        metrics["cka"]
    )
    assert {x.path for x in client.list_artifacts(run.info.run_id)} >= {"cka_layers.csv"}


@pytest.mark.slow
def test_a_run_trained_again_is_analysed_again(tmp_path):
    """--fresh retrains a run in place (same directory, new weights): the CKA computed on the old
    weights must not be reported as the new run's ("already finished"), and stays as it was."""
    env = {**os.environ, "LAB_TRACKING": "off"}
    argv = [sys.executable, str(ROOT / "run.py"), "--device", "cpu", "--width", "8", "--epochs",
            "1", "--progress", "off", "--results-dir", str(tmp_path / "runs"), "--data-dir",
            str(tmp_path / "data")]  # fmt: skip
    assert subprocess.run(argv, env=env, capture_output=True, timeout=300).returncode == 0
    run = next((tmp_path / "runs").iterdir())
    results = tmp_path / "analysis"
    first = analyze(run, run, "--images", "50", results=results)
    assert first.returncode == 0, first.stderr
    (old,) = results.iterdir()
    old_metrics = (old / runs.METRICS).read_bytes()
    again = subprocess.run([*argv, "--fresh"], env=env, capture_output=True, timeout=300)
    assert again.returncode == 0
    second = analyze(run, run, "--images", "50", results=results)
    assert second.returncode == 0 and not second.stdout.startswith("already finished")
    assert len(list(results.iterdir())) == 2
    assert (old / runs.METRICS).read_bytes() == old_metrics
