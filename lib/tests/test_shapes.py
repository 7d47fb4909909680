"""Data of any shape (issue 30): arrays kept as given and normalised with the training split's
statistics, augmentation as an explicit data-aware choice, models with their own size
arguments, and the project's 1-D example trained end to end against a plain PyTorch loop."""

import importlib.util
import inspect
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import PACKAGE, ROOT, RUN_PY

from labrun import config, datasets, registry
from labrun.analysis import RunResult, aggregate
from labrun.augment import choose_augmentation
from labrun.data import Split, load_dataset
from labrun.listing import describe
from labrun.loaders import Loader


@pytest.fixture
def dataset(monkeypatch):
    """dataset(**DatasetSplits fields) -> the name of a registered dataset returning them."""

    def register(**fields):
        entry = registry.Entry("shaped", build=lambda _: datasets.DatasetSplits(**fields))
        monkeypatch.setitem(datasets.DATASETS, "shaped", entry)
        return "shaped"

    return register


def arrays(shape, dtype=np.float32, n=400, seed=0):
    rng = np.random.default_rng(seed)
    x = (3 + 2 * rng.standard_normal((n, *shape))).astype(dtype)
    return x, rng.integers(0, 4, n)


@pytest.mark.parametrize(
    "shape, dtype, layout, channels",
    [((1, 40), np.float64, None, 1), ((12,), np.int16, None, 12), ((7, 3), np.float32, "NTF", 3)],
)
def test_arrays_of_any_dtype_and_shape_are_kept_and_normalised(
    tmp_path, dataset, shape, dtype, layout, channels
):
    name = dataset(train=arrays(shape, dtype), layout=layout)
    loaded = load_dataset(name, tmp_path)
    train = loaded.splits["train"]
    kept = torch.float32 if dtype == np.float64 else torch.from_numpy(np.zeros(1, dtype)).dtype
    assert train.images.dtype == kept and train.images.shape[1:] == shape  # no uint8 round trip
    assert loaded.info.input_shape == shape and loaded.info.channels == channels
    described = loaded.info.as_config()["input"]
    assert described["normalization"].startswith(f"per channel ({channels}), mean and std")
    assert described["augmentation"].startswith("off (auto: only uint8 images")
    for gpu_resident in (False, True):
        loader = Loader(train, 50, train=False, device="cpu", gpu_resident=gpu_resident)
        x = torch.cat([x for x, _ in loader])
        assert x.dtype == torch.float32 and x.shape[1:] == shape and x.is_contiguous()
        # Per channel (axis 1; features of vectors; the last axis of sequences): mean 0, std 1.
        axis = x.ndim - 1 if layout == "NTF" else 1
        per_channel = x.movedim(axis, -1).reshape(-1, channels)
        torch.testing.assert_close(per_channel.mean(0), torch.zeros(channels), atol=1e-4, rtol=0)
        torch.testing.assert_close(per_channel.std(0), torch.ones(channels), atol=0.01, rtol=0)
    # val and test are scaled with the training split's statistics, not their own.
    assert loaded.splits["test"].normalization is train.normalization


def test_inputs_declared_unnormalised_reach_the_model_as_they_are(tmp_path, dataset):
    tokens = np.random.default_rng(0).integers(0, 100, (200, 9))  # ids for an nn.Embedding
    name = dataset(train=(tokens, np.arange(200) % 4), normalize=False)
    loaded = load_dataset(name, tmp_path)
    x, _ = next(iter(Loader(loaded.splits["test"], 8, train=False, device="cpu")))
    assert x.dtype == torch.int64 and torch.equal(x, loaded.splits["test"].images[:8])
    assert loaded.info.describe()["normalization"].startswith("none (the dataset declares")


def test_bad_inputs_are_one_line_errors(tmp_path, dataset):
    with pytest.raises(
        ValueError, match=r"expected inputs \(N, \.\.\.\) .* got torch.float32 \(5,\)"
    ):
        load_dataset(dataset(train=(np.zeros(5, np.float32), np.zeros(5, int))), tmp_path)
    with pytest.raises(ValueError, match="--image-size: resizes images"):
        load_dataset(dataset(train=arrays((1, 40))), tmp_path, image_size=(8, 8))


def test_augmentation_is_a_data_aware_choice():
    u8, f32 = torch.uint8, torch.float32
    assert choose_augmentation((3, 32, 32), "NCHW", u8).padding == (4, 4)  # as before
    assert not choose_augmentation((1, 40), "NCL", f32).on  # signals: none by default
    assert not choose_augmentation((3, 32, 32), "NCHW", u8, "off").on
    shifted = choose_augmentation((1, 40), "NCL", f32, "on")
    assert shifted.padding == (0, 5) and shifted.flip and "--augment on" in shifted.why
    assert choose_augmentation((1, 40), "NCL", f32, declared=True).on  # the dataset's choice
    # A 1x40 "image": a crop padded by 1 would blank 2 of its 3 rows.
    thin = choose_augmentation((1, 1, 40), "NCHW", u8)
    assert not thin.on and "would leave up to 2 of 1 values blank" in thin.why
    flip_only = choose_augmentation((1, 1, 40), "NCHW", u8, "on")
    assert flip_only.padding == (0, 0) and flip_only.flip and "crop skipped" in flip_only.why
    with pytest.raises(ValueError, match="no augmentation is defined for float32 vectors"):
        choose_augmentation((12,), "NL", f32, "on")
    with pytest.raises(ValueError, match="per-pixel targets"):
        choose_augmentation((3, 32, 32), "NCHW", u8, "on", spatial_targets=True)


def test_signal_augmentation_shifts_and_flips_and_resumes_exactly():
    signals = torch.arange(20 * 40, dtype=torch.float32).view(20, 1, 40)
    split = Split(signals, torch.arange(20) % 4, layout="NCL")
    shift = choose_augmentation((1, 40), "NCL", torch.float32, "on")
    loader = Loader(split, 5, train=True, device="cpu", augment=shift)
    plain = Loader(split, 5, train=True, device="cpu", augment=False)
    loader.set_epoch(1)
    plain.set_epoch(1)
    torch.manual_seed(0)
    batches = iter(loader)
    first = next(batches)[0]
    state = torch.get_rng_state()
    rest = [x for x, _ in batches]
    assert not torch.equal(first, next(iter(plain))[0])  # shifted or flipped
    torch.set_rng_state(state)
    loader.set_epoch(1, skip_batches=1)
    assert all(map(torch.equal, rest, [x for x, _ in loader]))


def declared_model(tmp_path, source: str):
    """The registry's description of the model function in `source` (not registered)."""
    (tmp_path / "m.py").write_text(source)
    spec = importlib.util.spec_from_file_location("m", tmp_path / "m.py")
    module = importlib.util.module_from_spec(spec)
    module.register_model = lambda name, help="": lambda fn: fn
    spec.loader.exec_module(module)
    [(name, fn)] = [(k, v) for k, v in vars(module).items()
                    if inspect.isfunction(v) and k != "register_model"]  # fmt: skip
    return registry._entry(describe(registry.Entry(name, build=fn), "m"))


def test_a_model_takes_its_own_size_arguments(tmp_path, monkeypatch):
    """--model-args and --width reach only the models that take them; run names and tables
    show only those (a logreg that ignores width shows no `width=64`)."""
    logreg = declared_model(
        tmp_path,
        '@register_model("logreg")\ndef logreg(num_classes, input_shape, width):\n'
        "    return make(num_classes, input_shape)\n",
    )
    monkeypatch.setitem(config.MODEL_DECLARED, "logreg", logreg)

    def name(*argv):
        args, parser = config.parse_args([*argv, "--results-dir", "/r"])
        return args, config.run_dir(args, parser).name

    args, logreg_name = name("--model", "logreg")
    assert args.width is None and args.model_args == {} and "width" not in logreg_name
    args, cnn1d_name = name("--model", "cnn1d", "--model-args", "depth=3")
    assert (args.width, args.model_args) == (64, {"depth": 3, "kernel": 5})
    assert cnn1d_name.startswith("digits_model=cnn1d_depth=3-")
    assert name("--model", "cnn1d", "--model-args", "kernel=5")[1].startswith("digits_model=cnn1d-")
    assert name()[1] == "digits-07ad383c"  # the first release's name, unchanged
    for bad in (["--model", "logreg", "--width", "8"], ["--model", "cnn1d", "--model-args", "x=1"]):
        with pytest.raises(SystemExit) as exit_:
            config.parse_args(bad)
        assert exit_.value.code == 2
    # Tables and legends: the keys a run's model has; None (not taken) is not shown.
    runs = []
    for model, width in (("logreg", None), ("cnn1d", 64), ("cnn1d", 16)):
        cfg = {"model": model, "width": width, "seed": 0, "experiment_keys": ["model", "width"]}
        runs.append(RunResult(model, cfg, {"test_acc": 0.5}, {}))
    labels = list(aggregate(runs).stats.index)  # one row per configuration, by its label
    assert sorted(labels) == ["model=cnn1d, width=16", "model=cnn1d, width=64", "model=logreg"]


def test_the_non_image_example_trains_like_a_plain_pytorch_loop(tmp_path, data_dir):
    """The README's example: the project's float (N, 1, 40) `signals` and its `cnn1d`, trained
    by run.py's defaults, reach the test accuracy of a plain PyTorch loop on the same data."""
    epochs = 6
    cmd = [sys.executable, str(RUN_PY), "--device", "cpu", "--dataset", "signals", "--model",
           "cnn1d", "--epochs", str(epochs), "--progress", "off", "--tracking", "off",
           "--data-dir", str(data_dir), "--results-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [run_dir] = tmp_path.iterdir()
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["input"]["data"] == "float32 signals (N, 1, 40)"
    assert "augmentation: off (auto:" in (run_dir / "run.log").read_text()
    test_acc = json.loads((run_dir / "metrics.json").read_text())["test_acc"]

    from importlib import import_module

    project_data, project_models = (
        import_module(f"{PACKAGE}.data"),
        import_module(f"{PACKAGE}.model"),
    )
    x, y = map(torch.as_tensor, project_data.motif_signals())
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:800], order[800:]
    x = (x - x[train].mean()) / x[train].std()
    torch.manual_seed(0)
    model = project_models.cnn1d(num_classes=10, channels=1, width=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for batch in train[torch.randperm(len(train))].split(64):
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        plain_acc = (model.eval()(x[test]).argmax(1) == y[test]).float().mean().item()
    assert plain_acc > 0.75 and abs(test_acc - plain_acc) < 0.06, (test_acc, plain_acc)


def test_signals_with_augmentation_resume_exactly(main_in_process, tmp_path, monkeypatch):
    """Float signals, shifted and flipped (--augment on), stopped mid-epoch and resumed: the
    same history as a run never stopped (the shifts are replayed from the checkpoint's RNG)."""
    import os
    import signal

    import pandas as pd

    from labrun.train import TrainSums

    argv = ["--dataset", "signals", "--model", "cnn1d", "--augment", "on", "--epochs", "2",
            "--tracking", "off"]  # fmt: skip
    assert main_in_process(*argv, "--results-dir", str(tmp_path / "whole")) == 0
    add, calls = TrainSums.add, []

    def add_then_stop(self, *args):  # a stop signal in the middle of epoch 2 (45 steps each)
        calls.append(1)
        if len(calls) == 60:
            os.kill(os.getpid(), signal.SIGUSR1)
        return add(self, *args)

    monkeypatch.setattr(TrainSums, "add", add_then_stop)
    assert main_in_process(*argv, "--results-dir", str(tmp_path / "parts")) == 75
    monkeypatch.setattr(TrainSums, "add", add)
    assert main_in_process(*argv, "--results-dir", str(tmp_path / "parts")) == 0
    [whole], [parts] = (list((tmp_path / k).iterdir()) for k in ("whole", "parts"))
    assert "augmentation: shift + flip along the length" in (parts / "run.log").read_text()
    times = ["epoch_time_s", "samples_per_sec"]  # measured, not computed
    history = [pd.read_csv(d / "history.csv").drop(columns=times) for d in (whole, parts)]
    pd.testing.assert_frame_equal(*history, rtol=1e-4)
