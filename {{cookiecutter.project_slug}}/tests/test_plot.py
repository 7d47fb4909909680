"""plot.py and PKG/analysis.py on a synthetic results directory (no torch, no training).

The directory follows docs/design.md: 3 learning rates x 3 seeds with known metrics, one learning
rate with only 2 seeds, plus a corrupt, an unfinished and a failed run that must be skipped.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.text
import pytest

import plot
from {{ cookiecutter.package_name }}.analysis import (
    aggregate,
    curve,
    load_runs,
    mean_se,
)

PROJECT = Path(__file__).resolve().parents[1]
FIGURES = ("learning_curves", "final_vs_hparam", "throughput")
EPOCHS = 6
# test_acc by (lr, seed): the aggregate must reproduce the hand-computed mean and SE below.
TEST_ACC = {
    (0.001, 0): 0.70, (0.001, 1): 0.72, (0.001, 2): 0.74,
    (0.01, 0): 0.80, (0.01, 1): 0.82, (0.01, 2): 0.87,
    (0.1, 0): 0.60, (0.1, 1): 0.66, (0.1, 2): 0.63,
    (0.3, 0): 0.50, (0.3, 1): 0.40,  # fewer seeds than its siblings
}  # fmt: skip
HISTORY_HEADER = "epoch,step,lr,train_loss,train_acc,val_loss,val_acc,epoch_time_s,samples_per_sec"


def write_run(root: Path, lr: float, seed: int, *, test_acc: float | None, status="finished"):
    """One run directory as run.py leaves it; test_acc=None leaves out metrics.json."""
    config = {
        "dataset": "digits", "lr": lr, "width": 64, "seed": seed, "epochs": EPOCHS,
        "device": "cpu", "workers": 0, "results_dir": str(root),
        "experiment_keys": ["dataset", "epochs", "lr", "seed", "width"],
    }  # fmt: skip
    config["run_name"] = name = f"digits_lr={lr:g}_seed={seed}-{abs(hash((lr, seed))) % 16**8:08x}"
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    rows = [HISTORY_HEADER]
    for e in range(1, EPOCHS + 1):
        acc = (test_acc or 0.5) * (1 - 0.5**e)
        rows.append(f"{e},{e * 10},{lr},{1 - acc:.4f},{acc:.4f},{1 - acc:.4f},{acc:.4f},0.5,1000")
    (path / "history.csv").write_text("\n".join(rows) + "\n")
    (path / "status").write_text(status + "\n")
    if test_acc is not None:
        metrics = {
            "best_val_acc": test_acc + 0.01, "test_acc": test_acc, "test_loss": 1 - test_acc,
            "best_epoch": EPOCHS, "epochs_run": EPOCHS, "steps": EPOCHS * 10,
            "wall_time_s": 30.0 + seed, "train_time_s": 25.0, "compile_time_s": 0.0,
            "samples_per_sec": 1000.0 + 10 * seed, "peak_mem_bytes": 0, "device": "cpu",
            "stop_reason": "max_epochs", "mlflow_run_id": None,
        }  # fmt: skip
        (path / "metrics.json").write_text(json.dumps(metrics))
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "results"
    for (lr, seed), acc in TEST_ACC.items():
        write_run(root, lr, seed, test_acc=acc)
    corrupt = write_run(root, 0.01, 7, test_acc=0.9)
    (corrupt / "metrics.json").write_text('{"test_acc": 0.9, ')  # cut off mid-write
    write_run(root, 0.01, 8, test_acc=None, status="running")
    write_run(root, 0.01, 9, test_acc=None, status="failed")
    return root


def run_plot(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PROJECT / "plot.py"), *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plotted(results) -> tuple[Path, subprocess.CompletedProcess]:
    out = results.parent / "figures"
    proc = run_plot("--results-dir", results, "--out", out, cwd=results.parent)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def media_box(pdf: Path) -> tuple[float, float]:
    """Page size in inches from the PDF's /MediaBox (matplotlib writes it uncompressed)."""
    match = re.search(rb"/MediaBox\s*\[\s*([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s*\]",
                      pdf.read_bytes())  # fmt: skip
    assert match, f"no /MediaBox in {pdf}"
    x0, y0, x1, y1 = map(float, match.groups())
    return (x1 - x0) / 72, (y1 - y0) / 72


def figures_in_process(results: Path, width: str):
    runs, _ = load_runs(results)
    table = aggregate(runs)
    plot.set_style()
    style = plot.make_style(table, width)
    return {
        "learning_curves": plot.plot_learning_curves(table, style),
        "final_vs_hparam": plot.plot_final_vs_hparam(table, style),
        "throughput": plot.plot_throughput(table, style),
    }


def test_every_figure_and_table_is_written(plotted):
    out, proc = plotted
    for name in FIGURES:
        for fmt in ("pdf", "png"):
            assert (out / f"{name}.{fmt}").stat().st_size > 1000, f"{name}.{fmt}"
    assert (out / "aggregate.csv").is_file() and (out / "aggregate.tex").is_file()
    assert not list(out.glob(".*")), "temporary files left behind"


def test_pdf_page_is_the_declared_size_with_embedded_truetype(plotted, results):
    out, _ = plotted
    declared = figures_in_process(results, "single")
    for name, fig in declared.items():
        width, height = fig.get_size_inches()
        assert width == plot.PAGE_WIDTHS["single"]
        assert media_box(out / f"{name}.pdf") == pytest.approx((width, height), abs=1e-2)
        pdf = (out / f"{name}.pdf").read_bytes()
        assert b"/FontFile2" in pdf and b"/Type3" not in pdf, "fonts must be embedded TrueType"


@pytest.mark.parametrize("width", sorted(plot.PAGE_WIDTHS))
def test_no_text_smaller_than_8pt(results, width):
    for name, fig in figures_in_process(results, width).items():
        fig.draw_without_rendering()  # creates the tick labels
        texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]
        assert len(texts) > 5, name
        small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < 8]
        assert not small, f"{name} ({width}): text below 8 pt: {small}"


def test_aggregate_mean_se_and_n(results, plotted):
    runs, skipped = load_runs(results)
    table = aggregate(runs)
    assert table.keys == ["lr"], "only lr differs between configurations"
    row = {r.values: r for r in table.rows}[(0.01,)]
    # Hand-computed: 0.80, 0.82, 0.87 -> mean 0.83, s^2 = (0.03^2 + 0.01^2 + 0.04^2) / 2 = 0.0013
    assert row.n == 3 and row.seeds == [0, 1, 2]
    assert row.mean["test_acc"] == pytest.approx(0.83)
    assert row.se["test_acc"] == pytest.approx(math.sqrt(0.0013 / 3))
    assert [r.fewer_seeds for r in table.rows] == [False, False, False, True]  # lr=0.3: 2 seeds
    assert math.isnan(mean_se([0.5])[1]), "SE of one seed is undefined, not 0"

    out, proc = plotted
    lines = (out / "aggregate.csv").read_text().splitlines()
    header = lines[0].split(",")
    csv_row = dict(
        zip(header, next(ln for ln in lines if ln.startswith("0.01,")).split(","), strict=True)
    )
    assert csv_row["n"] == "3" and csv_row["fewer_seeds"] == "False"
    assert float(csv_row["test_acc_mean"]) == pytest.approx(0.83)
    assert float(csv_row["test_acc_se"]) == pytest.approx(math.sqrt(0.0013 / 3))
    tex = (out / "aggregate.tex").read_text()
    assert "\\begin{tabular}" in tex and "$0.830 \\pm 0.021$" in tex and "\\dagger" in tex
    assert "note: fewer seeds" in proc.stderr and "lr=0.3 (n=2)" in proc.stderr


def test_bad_runs_skipped_with_one_warning_line(results, plotted):
    _, skipped = load_runs(results)
    reasons = {path.name.split("-")[0]: reason for path, reason in skipped}
    assert reasons == {
        "digits_lr=0.01_seed=7": "corrupt",
        "digits_lr=0.01_seed=8": "unfinished",
        "digits_lr=0.01_seed=9": "failed",
    }
    _, proc = plotted
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("warning: skipped 3 runs (")
    assert "corrupt: digits_lr=0.01_seed=7" in warnings[0]


def test_curve_aligns_seeds_that_stopped_early(results):
    runs, _ = load_runs(results)
    row = aggregate(runs).rows[0]
    h = row.runs[0].history
    for key in h:  # the first seed stopped after 3 epochs
        h[key] = h[key][:3]
    epochs, mean, se, n = curve(row, "val_acc")
    assert list(epochs) == list(range(1, EPOCHS + 1))
    assert list(n) == [3, 3, 3, 2, 2, 2]
    assert mean[-1] == pytest.approx(0.73 * (1 - 0.5**EPOCHS), abs=1e-4)


def test_single_configuration_has_no_hparam_figure(results):
    runs, _ = load_runs(results)
    table = aggregate(r for r in runs if r.config["lr"] == 0.01)
    assert table.keys == [] and [row.n for row in table.rows] == [3]
    assert table.constant["lr"] == 0.01
    style = plot.make_style(table)
    assert plot.plot_final_vs_hparam(table, style) is None
    assert (
        plot.plot_learning_curves(table, style).get_size_inches()[0] == plot.PAGE_WIDTHS["single"]
    )
    plot.plot_throughput(table, style)


@pytest.mark.parametrize("make", ["missing", "empty", "only-unfinished"])
def test_no_finished_runs_is_one_error_line(tmp_path, make):
    results = tmp_path / "results"
    if make != "missing":
        results.mkdir()
    if make == "only-unfinished":
        write_run(results, 0.01, 0, test_acc=None, status="running")
    proc = run_plot("--results-dir", results, "--out", tmp_path / "figures", cwd=tmp_path)
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "run bash run.sh first" in errors[0], proc.stderr
    assert len(proc.stderr.splitlines()) == (2 if make == "only-unfinished" else 1)
    assert not (tmp_path / "figures").exists()


@pytest.mark.slow  # ~10 s: creating the sqlite DB and importing mlflow in a subprocess
def test_from_mlflow(tmp_path, capsys):
    """Logged the way run.py does (PKG/tracking.py): config as params, per-epoch metrics with
    step = epoch, final metrics with step = total steps (samples_per_sec is in both)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from {{ cookiecutter.package_name }}.analysis import load_runs_from_mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("sweep")
    keys = str(["dataset", "lr", "seed", "width"])  # a list param arrives as its str()
    for (lr, seed), acc in TEST_ACC.items():
        if lr not in (0.01, 0.1):
            continue
        run = client.create_run(exp, run_name=f"digits_lr={lr}_seed={seed}")
        params = {"dataset": "digits", "lr": lr, "width": 64, "seed": seed, "device": "cpu",
                  "experiment_keys": keys, "total_steps": EPOCHS * 10}  # fmt: skip
        for k, v in params.items():
            client.log_param(run.info.run_id, k, str(v))
        for e in range(1, EPOCHS + 1):
            client.log_metric(run.info.run_id, "val_acc", acc * (1 - 0.5**e), step=e)
            client.log_metric(run.info.run_id, "samples_per_sec", 900.0, step=e)
        final = {"test_acc": acc, "best_val_acc": acc, "wall_time_s": 10.0, "samples_per_sec": 1e3}
        for k, v in final.items():
            client.log_metric(run.info.run_id, k, v, step=EPOCHS * 10)
        client.set_terminated(run.info.run_id, "FINISHED")
    crashed = client.create_run(exp, run_name="crashed")
    client.log_param(crashed.info.run_id, "lr", "0.5")
    client.set_terminated(crashed.info.run_id, "FAILED")

    runs, skipped = load_runs_from_mlflow(uri, "sweep")
    assert len(runs) == 6 and skipped == [("crashed", "failed")]
    assert runs[0].config["lr"] in (0.01, 0.1) and runs[0].metrics["samples_per_sec"] == 1e3
    assert list(runs[0].history["epoch"]) == list(range(1, EPOCHS + 1)), "final step is no epoch"

    out = tmp_path / "figures"
    proc = run_plot("--from-mlflow", "--tracking-uri", uri, "--experiment", "sweep",
                    "--out", out, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warning: skipped 1 run (failed: crashed)" in proc.stderr
    for name in FIGURES:
        assert (out / f"{name}.pdf").is_file()
    lines = (out / "aggregate.csv").read_text().splitlines()
    header = lines[0].split(",")
    row = dict(
        zip(header, next(ln for ln in lines if ln.startswith("0.01,")).split(","), strict=True)
    )
    assert row["n"] == "3" and float(row["test_acc_mean"]) == pytest.approx(0.83)

    # In-process (mlflow is already imported): an unknown experiment is one error line, exit 1.
    capsys.readouterr()  # drop mlflow's own log lines from creating the DB above
    assert plot.main(["--from-mlflow", "--tracking-uri", uri, "--experiment", "nope"]) == 1
    assert capsys.readouterr().err.startswith("error: no MLflow experiment named 'nope'")


def test_plot_imports_neither_torch_nor_mlflow():
    code = "import sys, plot; assert not {'torch', 'mlflow', 'pandas'} & set(sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
