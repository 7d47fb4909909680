"""labrun.analysis (loading, mean +- SE over seeds, tables) and the project's plot.py, fed with
what run.py really writes: two tiny sweeps trained once per module, in this process.

- `hparam`: cnn on digits, lr 0.003 / 0.01 / 0.03 x seeds 0-2 (lr 0.03: two seeds), plus two
  regression runs (another task, monitored on val_mse);
- `comparison`: cnn and resnet18 x digits and synthetic x seeds 0-1 (model x condition).
Runs that must not count (corrupt, unfinished, copied ...) are made from copies of real ones.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path

import matplotlib.text
import numpy as np
import pandas as pd
import pytest
from conftest import DEADLINE, ROOT, load_run_py
from matplotlib.backends.backend_agg import FigureCanvasAgg

from labrun import analysis as A
from labrun import figures as F
from labrun.analysis import aggregate, by_monitor, comparison, curves, load_runs

LRS = {0.003: 3, 0.01: 3, 0.03: 2}  # lr -> seeds
TINY_RUN = ["--device", "cpu", "--width", "8", "--batch-size", "64", "--progress", "off",
            "--tracking", "off", "--epochs", "2", "--image-size", "16",
            "--synthetic-size", "300"]  # fmt: skip


def load_plot():
    spec = importlib.util.spec_from_file_location("plot_under_test", ROOT / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = load_plot()


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sweeps")
    run = load_run_py()
    jobs = [("hparam", ["--lr", str(lr), "--seed", str(s)]) for lr, n in LRS.items()
            for s in range(n)]  # fmt: skip
    jobs += [("hparam", ["--task", "regression", "--dataset", "synthetic", "--seed", str(s)])
             for s in (0, 1)]  # fmt: skip
    jobs += [("comparison", ["--model", m, "--dataset", d, "--seed", str(s)])
             for m in ("cnn", "resnet18") for d in ("digits", "synthetic")
             for s in (0, 1)]  # fmt: skip
    for folder, args in jobs:
        where = ["--results-dir", str(base / folder), "--data-dir", str(base / "data")]
        assert run.main([*TINY_RUN, *where, *args]) == 0, args
    return {name: base / name for name in ("hparam", "comparison")}


def metrics_json(results: Path) -> pd.DataFrame:
    """What each run directory says: its config keys and metrics.json, one row per run."""
    rows = []
    for path in results.glob("*/metrics.json"):
        config = json.loads((path.parent / "config.json").read_text())
        rows.append({**{k: config[k] for k in ("lr", "seed", "model", "dataset", "task")},
                     **json.loads(path.read_text())})  # fmt: skip
    return pd.DataFrame(rows)


def draw(main_args: list[str], capsys) -> tuple[int, str]:
    code = plot.main([*main_args, "--formats", "png"])
    return code, capsys.readouterr().err


def test_mean_se_and_n_are_the_runs_own_numbers(sweeps, tmp_path, capsys):
    truth = metrics_json(sweeps["hparam"])
    truth = truth[truth.task == "classification"]
    (classification,) = [g for m, g in by_monitor(load_runs(sweeps["hparam"])[0]).items()
                         if m == "val_acc"]  # fmt: skip
    table = aggregate(classification)
    assert table.keys == ["lr"] and list(table.stats.lr) == sorted(LRS)
    for lr, n in LRS.items():
        acc = truth[truth.lr == lr].test_acc.to_numpy()
        row = table.stats.loc[f"lr={lr:g}"]
        assert row.n == n == row.test_acc_n and row.fewer_seeds == (n < 3)
        assert row.seeds == " ".join(map(str, range(n)))
        assert row.test_acc_mean == pytest.approx(acc.mean())
        assert row.test_acc_se == pytest.approx(acc.std(ddof=1) / math.sqrt(n))
    out = tmp_path / "figures"
    code, err = draw(["--results", str(sweeps["hparam"]), "--out", str(out)], capsys)
    assert code == 0, err
    csv = pd.read_csv(out / "val_acc" / "aggregate.csv").set_index("lr")
    assert csv.loc[0.03, "n"] == 2 and csv.loc[0.03, "fewer_seeds"]
    assert csv.loc[0.01, "test_acc_se"] == pytest.approx(table.stats.test_acc_se["lr=0.01"])
    tex = (out / "val_acc" / "aggregate.tex").read_text()
    assert "\\toprule" in tex and "\\pm" in tex and "$^\\dagger$ fewer seeds" in tex
    assert "note: fewer seeds than the others (max n=3): lr=0.03 (n=2)" in err


def test_several_tasks_give_a_figure_set_each(sweeps, tmp_path, capsys):
    """Issue 29.8: runs of two tasks (val_acc and val_mse) are never drawn as one set."""
    out = tmp_path / "figures"
    code, err = draw(["--results", str(sweeps["hparam"]), "--out", str(out)], capsys)
    assert code == 0, err
    assert f"a figure set each: {out}/val_acc/ (8 runs); {out}/val_mse/ (2 runs)" in err
    for monitor in ("val_acc", "val_mse"):
        assert (out / monitor / "learning_curves.png").is_file(), monitor
        assert (out / monitor / "aggregate.csv").is_file(), monitor
    regression = pd.read_csv(out / "val_mse" / "aggregate.csv")
    assert regression.n.tolist() == [2] and "test_mse_mean" in regression
    # --curve that only one task has: the other's runs are left out by name, not dropped silently
    code, err = draw(["--results", str(sweeps["hparam"]), "--out", str(out), "--curve", "val_r2"],
                     capsys)  # fmt: skip
    assert code == 0 and "warning: left out 8 runs monitored on val_acc (--curve: val_r2" in err


def test_comparison_is_model_by_condition_with_its_table(sweeps, tmp_path, capsys):
    """Issue 30.4: two categorical keys: the final metric as model x dataset, in a figure with
    visible error bars and in a pivoted CSV / LaTeX table; no final_vs_hparam of categories."""
    out = tmp_path / "figures"
    code, err = draw(["--results", str(sweeps["comparison"]), "--out", str(out)], capsys)
    assert code == 0, err
    assert (out / "comparison.png").is_file() and not (out / "final_vs_hparam.png").exists()
    truth = metrics_json(sweeps["comparison"])
    expected = truth.groupby(["model", "dataset"]).test_acc.agg(["mean", "sem", "count"])
    csv = pd.read_csv(out / "comparison.csv").set_index("model")
    assert list(csv.index) == ["cnn", "resnet18"]
    for (model, dataset), row in expected.iterrows():
        assert csv.loc[model, f"dataset={dataset} mean"] == pytest.approx(row["mean"])
        assert csv.loc[model, f"dataset={dataset} se"] == pytest.approx(row["sem"])
        assert csv.loc[model, f"dataset={dataset} n"] == row["count"] == 2
    tex = (out / "comparison.tex").read_text()
    assert "model & dataset=digits & dataset=synthetic" in tex and tex.count(" \\pm ") == 4

    table = aggregate(load_runs(sweeps["comparison"])[0])
    fig = plot.plot_comparison(table, plot.PAGES["single"], "test_acc", "val_acc")
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["cnn", "resnet18"]
    row_key, wide = comparison(table, "test_acc")
    assert row_key == "model"
    bars = [c for c in ax.containers]  # one ErrorbarContainer per condition
    assert len(bars) == 2
    for container, condition in zip(bars, ["dataset=digits", "dataset=synthetic"], strict=True):
        line, _caps, (segments,) = container.lines[0], container.lines[1], container.lines[2]
        assert line.get_markerfacecolor() == "none", "hollow markers: the bar shows through"
        lengths = [abs(s[1][1] - s[0][1]) for s in segments.get_segments()]
        assert lengths == pytest.approx(list(2 * wide[(condition, "se")]))
    looks = {(matplotlib.colors.to_hex(c.lines[0].get_color()), c.lines[0].get_marker())
             for c in bars}  # fmt: skip
    assert len(looks) == len(bars), "each condition its own colour and marker"


def test_labels_are_never_cut_off(sweeps):
    """Issue 30.4: three long dataset names that share a prefix stay whole in every figure (the
    old throughput figure cut them to the same `position_shuffled_s…`)."""
    runs, _ = load_runs(sweeps["comparison"])
    names = {"digits": "position_shuffled_signals_long", "synthetic": "position_shuffled_sig_B"}
    for r in runs:
        r.config["dataset"] = names[r.config["dataset"]]
    table = aggregate(runs)
    for width, page in plot.PAGES.items():
        for name, fig in every_figure(table, page).items():
            texts = " ".join(t.get_text().replace("\n", "") for t in visible_texts(fig))
            assert "…" not in texts and all(n in texts.replace(" ", "") for n in names.values()), (
                name, width)  # fmt: skip
            assert_on_the_page(fig, f"{name} ({width})")


def every_figure(table, page) -> dict:
    """Every figure, drawn under plot.STYLE as plot.py draws them (not under whatever style an
    earlier test left: alone, a test must see what plot.py makes)."""
    with matplotlib.rc_context(plot.STYLE):
        figures = {d.__name__: d(table, page, "test_acc", table.monitor) for d in plot.FIGURES}
        figures = {name: fig for name, fig in figures.items() if fig is not None}
        for fig in figures.values():
            FigureCanvasAgg(fig).draw()
    return figures


def visible_texts(fig):
    """The texts drawn: tick labels of ticks outside an axis' limits are not."""
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            slack = 1e-9 * (hi - lo)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = tick.get_loc()
                if loc is None or not lo - slack <= loc <= hi + slack:
                    hidden |= {id(tick.label1), id(tick.label2)}
    return [t for t in fig.findobj(matplotlib.text.Text)
            if t.get_visible() and t.get_text() and id(t) not in hidden]  # fmt: skip


def assert_on_the_page(fig, what: str) -> None:
    """Every text is inside the declared page (the real extents, not an estimate), at least
    8 pt, and no two tick labels of an axis overlap."""
    renderer = fig.canvas.get_renderer()
    page = fig.bbox.expanded(1.002, 1.002)
    for text in visible_texts(fig):
        box = text.get_window_extent(renderer)
        assert page.contains(box.x0, box.y0) and page.contains(box.x1, box.y1), (what, text)
        assert text.get_fontsize() >= 8, (what, text)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            drawn = {id(t) for t in visible_texts(fig)}
            boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels()
                     if id(t) in drawn]  # fmt: skip
            assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :]), what


@pytest.mark.parametrize("width", sorted(plot.PAGES))
def test_every_figure_fits_its_page(sweeps, width):
    for folder in ("hparam", "comparison"):
        runs, _ = load_runs(sweeps[folder])
        table = aggregate(by_monitor(runs)["val_acc"])
        figures = every_figure(table, plot.PAGES[width])
        assert set(figures) >= {"plot_learning_curves", "plot_throughput"}
        for name, fig in figures.items():
            assert fig.get_size_inches()[0] == plot.PAGES[width][0], name
            assert_on_the_page(fig, f"{folder}/{name} ({width})")


def test_a_configuration_keeps_its_colour_and_marker(sweeps):
    table = aggregate(by_monitor(load_runs(sweeps["hparam"])[0])["val_acc"])
    looks: dict[str, set] = {}
    for fig in every_figure(table, plot.PAGES["single"]).values():
        for line in fig.findobj(matplotlib.lines.Line2D):
            if (line.get_gid() or "").startswith(F.GID) and line.get_marker() not in "_|":
                colour = matplotlib.colors.to_hex(line.get_color())
                looks.setdefault(line.get_gid(), set()).add((colour, line.get_marker()))
    assert set(looks) == {F.GID + c for c in table.stats.index}
    assert all(len(v) == 1 for v in looks.values()), looks


def test_curves_over_seeds_that_stopped_early(sweeps):
    runs, _ = load_runs(sweeps["hparam"])
    table = aggregate(by_monitor(runs)["val_acc"])
    stopped = next(r for r in table.runs if r.config["lr"] == 0.01)
    stopped.history = {k: v[:1] for k, v in stopped.history.items()}  # stopped after epoch 1
    data = curves(table, "val_acc")
    mine = data[data.config == "lr=0.01"]
    assert mine.n.tolist() == [3, 2]
    others = [r.history["val_acc"][1] for r in table.runs if r.config["lr"] == 0.01 and
              r is not stopped]  # fmt: skip
    assert mine["mean"].iloc[1] == pytest.approx(np.mean(others))
    fig = plot.plot_learning_curves(table, plot.PAGES["single"], "test_acc", "val_acc")
    assert "0.01 (n=3→2)" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_runs_left_out_are_named(sweeps, tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(sweeps["hparam"], results)
    dirs = sorted(p for p in results.iterdir() if "regression" not in p.name)
    (dirs[0] / "metrics.json").write_text('{"test_acc": 0.9, ')  # cut off mid-write
    (dirs[1] / "metrics.json").unlink()  # unfinished
    (dirs[2] / "metrics.json").unlink()
    (dirs[2] / "status").write_text("failed\n")
    shutil.copytree(dirs[3], results / "copy-of-a-run")  # the same run twice counts once
    metrics = json.loads((dirs[4] / "metrics.json").read_text())
    diverged = {"test_loss": None, "null_reasons": {"test_loss": "nan (not finite)"}}
    (dirs[4] / "metrics.json").write_text(json.dumps({**metrics, **diverged}))  # as run.py does
    config = json.loads((dirs[5] / "config.json").read_text())
    del config["patience"]  # written before --patience existed: takes today's default
    (dirs[5] / "config.json").write_text(json.dumps(config))
    code, err = draw(["--results", str(results), "--out", str(tmp_path / "f")], capsys)
    assert code == 0, err
    skipped = next(line for line in err.splitlines() if line.startswith("warning: skipped"))
    assert skipped.startswith("warning: skipped 4 runs (") and "copy-of-a-run" in skipped
    for reason, d in (("corrupt", dirs[0]), ("unfinished", dirs[1]), ("failed", dirs[2])):
        assert f"{reason}: {d.name}" in skipped
    assert f"duplicate of {dirs[3].name}: copy-of-a-run" in skipped
    assert f"left out 1 non-finite value, not counted in n (test_loss=nan: {dirs[4].name})" in err
    assert "note: 1 older runs lack keys; took run.py's current defaults: patience=" in err


@pytest.mark.parametrize("make", ["missing", "only-unfinished"])
def test_no_finished_runs_is_one_error_line(sweeps, tmp_path, capsys, make):
    results = tmp_path / "results"
    if make == "only-unfinished":
        shutil.copytree(next(sweeps["hparam"].iterdir()), results / "a-run")
        (results / "a-run" / "metrics.json").unlink()
    code, err = draw(["--results", str(results), "--out", str(tmp_path / "f")], capsys)
    assert code == 1 and len(err.splitlines()) == 1 and not (tmp_path / "f").exists()
    assert err.startswith(f"error: no finished runs in {results}/") and "results/trials" in err
    assert ("unfinished: a-run" in err) == (make == "only-unfinished")


def test_unknown_metric_or_curve_is_bad_input(sweeps, tmp_path, capsys):
    results = tmp_path / "results"
    for path in sweeps["comparison"].iterdir():
        shutil.copytree(path, results / path.name)
    code, err = draw(["--results", str(results), "--metric", "test_r2"], capsys)
    assert code == 2 and err.startswith("error: --metric: test_r2 is not among the runs' metrics")
    code, err = draw(["--results", str(results), "--curve", "val_r2"], capsys)
    assert code == 2 and err.startswith("error: --curve: val_r2 is not a history column")


def test_pdf_is_the_declared_size_with_truetype_fonts(sweeps, tmp_path, capsys):
    out = tmp_path / "f"
    assert plot.main(["--results", str(sweeps["comparison"]), "--out", str(out), "--formats",
                      "pdf", "--width", "double"]) == 0  # fmt: skip
    for pdf in out.glob("*.pdf"):
        data = pdf.read_bytes()
        box = re.search(rb"/MediaBox \[ 0 0 ([\d.]+) ([\d.]+) \]", data)
        assert float(box.group(1)) == pytest.approx(6.75 * 72), pdf.name
        assert b"/FontFile2" in data and b"/Type3" not in data, pdf.name
    assert not list(out.glob(".*")), "temporary files left behind"


def test_many_configurations_keep_a_page_and_say_what_is_left_out(sweeps):
    runs, _ = load_runs(sweeps["comparison"])
    many = []
    for i in range(40):  # 40 configurations of one real run each
        run = runs[i % len(runs)]
        varied = {"width": 8 + i, "lr": 10 ** (-4 + i / 7), "epochs": 2 + i % 4,
                  "batch_size": 32 * (1 + i % 3)}  # four numeric keys, long values  # fmt: skip
        clone = type(run)(f"{run.name}-{i}", {**run.config, **varied}, run.metrics,
                          run.history, run.source)  # fmt: skip
        many.append(clone)
    table = aggregate(many)
    for name, fig in every_figure(table, plot.PAGES["single"]).items():
        width, height = fig.get_size_inches()
        if name != "plot_throughput":  # a row per configuration, labels wrapped whole: it grows
            assert height <= 2.5 * width + 1, (name, height)
        words = " ".join(t.get_text() for t in visible_texts(fig))
        if name != "plot_comparison":
            assert "of 40" in words.replace("\n", " "), name
        if name == "plot_final_vs_hparam":  # two panels fit a column: the others are named
            assert "first 2 of 4 keys" in words.replace("\n", " ")
        assert_on_the_page(fig, name)


def test_plot_imports_neither_torch_nor_mlflow(sweeps, tmp_path):
    import subprocess

    code = ("import sys, runpy; sys.argv = ['plot.py', *sys.argv[1:]]\n"
            "try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('rc', e.code, sorted({'torch', 'mlflow'} & set(sys.modules)))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, "--results", str(sweeps["comparison"]),
                           "--out", str(tmp_path), "--formats", "png"], cwd=ROOT,
                          capture_output=True, text=True, timeout=DEADLINE)  # fmt: skip
    assert "rc 0 []" in done.stdout, done.stdout + done.stderr


def system_series(gpus: int, minutes: float = 30.0):
    t = np.linspace(0, minutes * 60, 50)
    if not gpus:
        return {"cpu_utilization_percentage": (t, 50 + 40 * np.sin(t / 100)),
                "system_memory_usage_percentage": (t, np.full_like(t, 35.0))}  # fmt: skip
    series = {}
    for i in range(gpus):
        series[f"gpu_{i}_utilization_percentage"] = (t, 90 - 10 * i + 5 * np.sin(t))
        series[f"gpu_{i}_memory_usage_percentage"] = (t, np.full_like(t, 60.0 + i))
        series[f"gpu_{i}_power_usage_watts"] = (t, np.full_like(t, 300.0))
    return series


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_system_figure(gpus):
    fig = plot.plot_system(system_series(gpus), plot.PAGES["single"], "digits_lr=0.01-1234abcd")
    FigureCanvasAgg(fig).draw()
    assert_on_the_page(fig, f"system ({gpus} GPUs)")
    util, memory = fig.axes
    device, ram = ("GPU", "GPU memory") if gpus else ("CPU", "RAM")
    assert util.get_ylabel() == f"{device} util. (%)" and memory.get_ylabel() == f"{ram} (%)"
    assert len(util.get_lines()) == max(1, gpus)
    assert memory.get_xlabel() == "time since the first sample (min)"
    if gpus == 2:
        assert [t.get_text() for t in util.get_legend().get_texts()] == ["GPU 0", "GPU 1"]


def test_system_needs_a_run_with_an_mlflow_id(sweeps, tmp_path, capsys):
    run = next(sweeps["hparam"].iterdir())
    assert plot.main(["--system", str(run), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --system: ") and "has no MLflow run id" in err
    assert len(err.splitlines()) == 1 and not list(tmp_path.iterdir())


@pytest.mark.slow  # three tiny runs tracked into MLflow, then plot.py in a subprocess
def test_from_mlflow_plots_what_run_py_tracked(run_cli, env, tmp_path):
    import subprocess

    experiment = f"roundtrip-{tmp_path.name}"
    for lr, seed in (("0.01", "0"), ("0.01", "1"), ("0.05", "0")):
        done = run_cli("--lr", lr, "--seed", seed, "--epochs", "2", "--experiment", experiment,
                       results_dir=tmp_path / "results")  # fmt: skip
        assert done.returncode == 0, done.stderr
    out = tmp_path / "figures"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "plot.py"), "--from-mlflow", "--experiment", experiment,
         "--tracking-uri", env["MLFLOW_TRACKING_URI"], "--out", str(out), "--formats", "png"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert proc.returncode == 0 and "skipped" not in proc.stderr, proc.stderr
    assert (out / "learning_curves.png").is_file() and (out / "final_vs_hparam.png").is_file()
    rows = pd.read_csv(out / "aggregate.csv")
    assert sorted(zip(rows.lr, rows.n, strict=True)) == [(0.01, 2), (0.05, 1)]
    truth = metrics_json(tmp_path / "results")
    for lr, mean in zip(rows.lr, rows.test_acc_mean, strict=True):
        assert mean == pytest.approx(truth[truth.lr == lr].test_acc.mean())

    # A crashed run is named, not drawn; --system reads a run's system metrics through its run
    # directory's MLflow run id.
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    crashed = client.create_run(experiment_id, run_name="crashed")
    client.set_terminated(crashed.info.run_id, "FAILED")
    run_dir = next((tmp_path / "results").iterdir())
    run_id = json.loads((run_dir / "metrics.json").read_text())["mlflow_run_id"]
    tracked = client.get_run(run_id).data  # which weights the test numbers come from
    assert tracked.tags["test_weights"] == tracked.params["test_weights"] == "best"
    assert tracked.metrics["tested_epoch"] == tracked.metrics["best_epoch"]
    series = system_series(1)
    client.log_batch(run_id, metrics=[
        Metric(f"system/{name}", float(v), 1_700_000_000_000 + int(t * 1000), i)
        for name, (ts, vs) in series.items() for i, (t, v) in enumerate(zip(ts, vs, strict=True))
    ])  # fmt: skip
    for args in (["--from-mlflow", "--experiment", experiment], ["--system", str(run_dir)]):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "plot.py"), *args, "--tracking-uri",
             env["MLFLOW_TRACKING_URI"], "--out", str(out), "--formats", "png"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEADLINE,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert "warning: skipped 1 run (failed: crashed)" in subprocess.run(
        [sys.executable, str(ROOT / "plot.py"), "--from-mlflow", "--experiment", experiment,
         "--tracking-uri", env["MLFLOW_TRACKING_URI"], "--out", str(out), "--formats", "png"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEADLINE).stderr  # fmt: skip
    assert (out / f"system_{run_dir.name}.png").is_file()


# ---- Issue 38: figures and tables a paper takes, for any condition names and any metric --------

NEWCOMER = ["baseline", "gaussian-noise", "random-labels", "shuffled-pixels",
            "label-smoothing-with-heavy-mixup-augmentation"]  # fmt: skip
START = 1_790_000_000  # run.log's first line: the sweep started its jobs in NEWCOMER's order


def write_sweep(root: Path, conditions, seeds=(0, 1, 2), epochs=60, nan_epochs=(), spread=0.02):
    """Run directories as run.py writes them (config.json, history.csv, metrics.json, run.log,
    status), one per condition x seed, without training: train_acc rises towards a ceiling
    that differs per condition; `nan_epochs` are NaN in every seed (a diverged eval)."""
    import time

    rng = np.random.default_rng(0)
    for i, condition in enumerate(conditions):
        for seed in seeds:
            out = root / f"{condition}-seed{seed}"
            out.mkdir(parents=True)
            epoch = np.arange(1, epochs + 1)
            ceiling = 0.98 - 0.06 * i
            acc = ceiling * (1 - np.exp(-epoch / (3 + i))) + spread * rng.standard_normal(epochs)
            val = acc - 0.05
            history = pd.DataFrame({"epoch": epoch, "step": 10 * epoch, "lr": 0.01,
                                    "train_loss": 1 - acc, "train_acc": acc, "val_loss": 1 - val,
                                    "val_acc": val, "epoch_time_s": 1.0})  # fmt: skip
            history.loc[history.epoch.isin(nan_epochs), ["train_acc", "val_acc"]] = math.nan
            history.to_csv(out / "history.csv", index=False)
            best = int(history.val_acc.idxmax()) + 1
            config = {
                "dataset": condition,
                "seed": seed,
                "lr": 0.01,
                "run_name": out.name,
                "monitored": "val_acc",
                "experiment_keys": ["dataset", "lr", "seed"],
            }
            (out / "config.json").write_text(json.dumps(config))
            metrics = {"best_val_acc": float(history.val_acc.max()), "best_epoch": best,
                       "test_acc": float(acc[best - 1] - 0.03), "test_loss": 0.5,
                       "tested_epoch": best, "test_weights": "best", "epochs_run": epochs,
                       "steps": 10 * epochs, "wall_time_s": 100.0 + i + seed}  # fmt: skip
            (out / "metrics.json").write_text(json.dumps(metrics))
            (out / "status").write_text("finished\n")
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(START + 10 * i + seed))
            (out / "run.log").write_text(f"{stamp} INFO run {out.name}\n")
    return root


WORD = re.compile(r"[^ _,=/\n-]+")  # the pieces between the places a label may break


def drawn_words(fig) -> set[str]:
    return {w for t in visible_texts(fig) for w in WORD.findall(t.get_text())}


def assert_no_word_split(fig, names, what: str) -> None:
    """Every word of every name is drawn whole in some text (a split word shows as two)."""
    words = drawn_words(fig)
    missing = {w for name in names for w in WORD.findall(name)} - words
    assert not missing, (what, missing)


@pytest.mark.parametrize("case", ["newcomer", "twelve", "nan-epochs", "one-seed"])
def test_awkward_sweeps_stay_on_the_page_with_every_word_whole(tmp_path, case):
    conditions = {"twelve": [f"condition-number-{i}-with-a-long-name" for i in range(12)]}.get(
        case, NEWCOMER)  # fmt: skip
    seeds = (0,) if case == "one-seed" else (0, 1, 2)
    nan_epochs = (5, 6, 30) if case == "nan-epochs" else ()
    write_sweep(tmp_path / "sweep", conditions, seeds, nan_epochs=nan_epochs)
    runs, skipped = load_runs(tmp_path / "sweep")
    assert not skipped
    table = aggregate(runs)
    assert list(table.stats.dataset) == conditions, "the sweep's order, not the alphabet's"
    with matplotlib.rc_context(plot.STYLE):  # as plot.py draws them
        check_awkward(table, case, conditions, tmp_path)


def check_awkward(table, case, conditions, tmp_path):
    for width, page in plot.PAGES.items():
        for name in ("plot_learning_curves", "plot_comparison", "plot_throughput"):
            fig = getattr(plot, name)(table, page, "test_acc", "train_acc")
            FigureCanvasAgg(fig).draw()
            assert_on_the_page(fig, f"{case}/{name} ({width})")
            assert_no_word_split(fig, conditions, f"{case}/{name} ({width})")
            texts = " ".join(t.get_text() for t in visible_texts(fig))
            if name == "plot_learning_curves":
                ax = fig.axes[0]
                assert ax.get_ylabel() == "train accuracy"
                legend = [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]
                assert legend == conditions[: len(legend)], "legend in the sweep's order"
                for line in ax.get_lines():  # 60 epochs: a few markers a line, not 60
                    if line.get_marker() not in ("None", "", None) and line.get_gid():
                        assert line.get_markevery()[1] >= 8, (case, line.get_markevery())
                if case == "one-seed":
                    assert "one seed: no SE band" in texts.replace("\n", " ")
            if name == "plot_comparison":
                assert not fig.legends, "one condition: no legend entry repeating the y-label"
                ax = fig.axes[0]
                assert "test accuracy" in (ax.get_xlabel(), ax.get_ylabel())
    if case == "newcomer":  # kept for a look: pytest's tmp_path of this test
        for name in ("plot_learning_curves", "plot_comparison"):
            fig = getattr(plot, name)(table, plot.PAGES["single"], "test_acc", "train_acc")
            F.save(fig, name, tmp_path / "figures", ["png"])


def test_wrap_breaks_only_between_words():
    assert F.wrap("shuffled-pixels", 0.3, 9) == "shuffled-\npixels"
    assert F.wrap("gaussian", 0.1, 9) == "gaussian" and not F.fits("gaussian", 0.1, 9)
    assert F.wrap("a b c", 5) == "a b c"


@pytest.mark.parametrize(("name", "label"), [
    ("train_acc", "train accuracy"), ("val_loss", "val. loss"), ("wall_time_s", "wall time (s)"),
    ("samples_per_sec", "samples / s"), ("test_r2", "test R²"), ("my_new_metric", "my new metric"),
    ("train_acc@final", "train accuracy (final epoch)"),
    ("train_acc>=0.99", "first epoch train accuracy ≥ 0.99"),
])  # fmt: skip
def test_every_column_has_a_readable_label(name, label):
    assert A.readable(name) == label
    assert A.readable(name, {name: "mine"}) == "mine"


def test_bands_thinner_than_the_lines_are_said_and_references_drawn(tmp_path, monkeypatch):
    write_sweep(tmp_path / "sweep", NEWCOMER[:2], epochs=8, spread=1e-5)
    table = aggregate(load_runs(tmp_path / "sweep")[0])
    monkeypatch.setattr(plot, "REFERENCES", {"acc": {"chance": 0.2, "Smith et al.": 0.9}})
    with matplotlib.rc_context(plot.STYLE):  # as plot.py draws it, not after another test's style
        fig = plot.plot_learning_curves(table, plot.PAGES["single"], "test_acc", "train_acc")
        FigureCanvasAgg(fig).draw()
    texts = [t.get_text() for t in visible_texts(fig)]
    assert "SE bands mostly narrower than the lines" in " ".join(texts).replace("\n", " ")
    assert {"chance", "Smith et al."} <= set(texts)
    heights = {tuple(line.get_ydata()) for line in fig.axes[0].get_lines()}
    assert (0.2, 0.2) in heights and (0.9, 0.9) in heights
    assert all(line.get_markevery() == 1 for line in fig.axes[0].get_lines()[:1]), "8 epochs"
    assert_on_the_page(fig, "references")


def test_the_paper_table_has_just_the_named_columns(tmp_path, capsys):
    write_sweep(tmp_path / "sweep", NEWCOMER, epochs=20)
    columns = ["test_acc", "train_acc@final", "train_acc@best", "train_acc>=0.9", "wall_time_s"]
    out = tmp_path / "figures"
    code, err = draw(["--results", str(tmp_path / "sweep"), "--out", str(out), "--curve",
                      "train_acc", "--table", *columns], capsys)  # fmt: skip
    assert code == 0, err
    runs, _ = load_runs(tmp_path / "sweep")
    table = pd.read_csv(out / "table.csv")
    assert list(table.columns) == ["dataset", "n"] + [f"{c}_{p}" for c in columns
                                                      for p in ("mean", "se", "n")]  # fmt: skip
    assert list(table.dataset) == NEWCOMER
    for condition, row in table.set_index("dataset").iterrows():
        mine = [r for r in runs if r.config["dataset"] == condition]
        final = [r.history["train_acc"][-1] for r in mine]
        best = [r.history["train_acc"][int(r.metrics["best_epoch"]) - 1] for r in mine]
        first = [next((e for e, a in zip(r.history["epoch"], r.history["train_acc"], strict=True)
                       if a >= 0.9), math.nan) for r in mine]  # fmt: skip
        for column, values in (("train_acc@final", final), ("train_acc@best", best),
                               ("train_acc>=0.9", first)):  # fmt: skip
            finite = [v for v in values if math.isfinite(v)]
            assert row[f"{column}_n"] == len(finite), (condition, column)
            if finite:
                assert row[f"{column}_mean"] == pytest.approx(np.mean(finite)), (condition, column)
    never = table.set_index("dataset").loc[NEWCOMER[-1], "train_acc>=0.9_n"]
    assert never == 0 and "never reached train_acc>=0.9" in err
    tex = (out / "aggregate.tex").read_text()
    header = next(line for line in tex.splitlines() if line.startswith("dataset &"))
    assert header == ("dataset & n & test accuracy & train accuracy (final epoch) & train "
                      "accuracy (best epoch) & first epoch train accuracy $\\geq$ 0.9 & wall "
                      "time (s) \\\\")  # fmt: skip
    assert "\\toprule" in tex and "test\\_loss" not in tex
    code, err = draw(["--results", str(tmp_path / "sweep"), "--out", str(out), "--table",
                      "train_acc@last"], capsys)  # fmt: skip
    assert code == 2 and err.startswith("error: --table: train_acc@last is neither")


def test_the_default_table_is_test_metrics_and_time(tmp_path, capsys):
    write_sweep(tmp_path / "sweep", NEWCOMER[:2], epochs=5)
    code, err = draw(["--results", str(tmp_path / "sweep"), "--out", str(tmp_path / "f")], capsys)
    assert code == 0, err
    header = pd.read_csv(tmp_path / "f" / "table.csv").columns
    assert [c.removesuffix("_mean") for c in header if c.endswith("_mean")] == [
        "test_acc", "test_loss", "wall_time_s"]  # fmt: skip


def test_order_set_in_plot_py_wins(tmp_path, monkeypatch):
    write_sweep(tmp_path / "sweep", NEWCOMER, epochs=5)
    table = aggregate(load_runs(tmp_path / "sweep")[0])
    monkeypatch.setattr(plot, "ORDER", ["random-labels", "baseline"])
    ordered = A.in_order(table, plot.ORDER)
    assert list(ordered.stats.dataset) == ["random-labels", "baseline", "gaussian-noise",
                                           "shuffled-pixels", NEWCOMER[-1]]  # fmt: skip


def test_duplicates_are_compared_by_their_numbers(tmp_path, capsys):
    """Issue 37: equal numbers collapse to one; different numbers are reported, and kept only
    for the run directory at its own name (run.py's record), never settled by name order."""
    sweep = write_sweep(tmp_path / "sweep", NEWCOMER[:2], epochs=5)
    shutil.copytree(sweep / "baseline-seed0", sweep / "copy-of-baseline-seed0")
    runs, skipped = load_runs(sweep)
    assert skipped == [("copy-of-baseline-seed0", "duplicate of baseline-seed0")]

    def other_numbers(run: str, copy: str) -> None:
        shutil.copytree(sweep / run, sweep / copy)
        metrics = json.loads((sweep / copy / "metrics.json").read_text())
        metrics["test_acc"] += 0.01
        (sweep / copy / "metrics.json").write_text(json.dumps(metrics))

    other_numbers("baseline-seed1", "another-machine-baseline-seed1")
    runs, skipped = load_runs(sweep)
    (reason,) = [r for where, r in skipped if where == "another-machine-baseline-seed1"]
    assert reason.startswith("duplicate of baseline-seed1 with other numbers (test_acc ")
    assert "baseline-seed1" in [r.where for r in runs]
    # two copies and no record at the run's own name: neither is chosen
    other_numbers("baseline-seed2", "copy-a-baseline-seed2")
    (sweep / "baseline-seed2").rename(sweep / "copy-b-baseline-seed2")
    runs, skipped = load_runs(sweep)
    conflicts = sorted(where for where, r in skipped if r.startswith("conflicts with"))
    assert conflicts == ["copy-a-baseline-seed2", "copy-b-baseline-seed2"]
    assert sorted(r.config["seed"] for r in runs if r.config["dataset"] == "baseline") == [0, 1]
    code, err = draw(["--results", str(sweep), "--out", str(tmp_path / "f")], capsys)
    assert code == 0 and "conflicts with" in err and "fewer seeds" in err


def test_test_weights_final_is_recorded_and_best_keeps_the_identity(tmp_path):
    from labrun.config import identity_args, parse_args

    args, _ = parse_args(["--lr", "0.01"])
    assert args.test_weights == "best" and "test_weights" not in identity_args(args)
    final, _ = parse_args(["--lr", "0.01", "--test-weights", "final"])
    assert identity_args(final)["test_weights"] == "final"
    run = load_run_py()
    where = ["--results-dir", str(tmp_path / "r"), "--data-dir", str(tmp_path / "data")]
    for weights in ("best", "final"):
        assert run.main([*TINY_RUN, *where, "--epochs", "3", "--test-weights", weights]) == 0
    done = {json.loads((p.parent / "config.json").read_text())["test_weights"]:
            json.loads(p.read_text()) for p in (tmp_path / "r").glob("*/metrics.json")}  # fmt: skip
    assert done["best"]["test_weights"] == "best"
    assert done["best"]["tested_epoch"] == done["best"]["best_epoch"]
    assert done["final"]["test_weights"] == "final" and done["final"]["tested_epoch"] == 3


def test_throughput_axes_have_ticks_to_read_and_one_swept_key_needs_no_legend(sweeps):
    """The x axes of the throughput figure carry at least three ticks, more where the page is
    wider (as many as their labels leave room for); final_vs_hparam over one swept key with
    every seed present has no legend (it would repeat the x axis)."""
    runs, _ = load_runs(sweeps["hparam"])
    runs = [r for r in by_monitor(runs)["val_acc"] if LRS[r.config["lr"]] == 3]
    table = aggregate(runs)
    for width in sorted(plot.PAGES):
        figures = every_figure(table, plot.PAGES[width])
        for ax in figures["plot_throughput"].axes:
            lo, hi = ax.get_xlim()
            shown = sum(lo <= t <= hi for t in ax.get_xticks())
            assert shown >= (5 if width == "double" else 3), (width, ax.get_xticks())
        assert not figures["plot_final_vs_hparam"].legends, width
