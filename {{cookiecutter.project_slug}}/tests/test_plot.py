"""plot.py and PKG/analysis.py on a synthetic results directory (no torch, no training).

The directory holds run directories as run.py writes them: 4 learning rates x 3 seeds with known
metrics (lr=0.3 with only 2 seeds; one lr=0.1 seed stopped early; one lr=0.001 seed from before
the `patience` flag existed; one non-finite test loss), plus runs that must not count: a corrupt,
an empty, an unfinished and a failed run, a copied run directory, a config without experiment keys.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.colors
import matplotlib.text
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.lines import Line2D

import plot
from labrun.analysis import (
    aggregate,
    curve,
    format_value,
    load_runs,
    mean_se,
)
from labrun.config import build_parser

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
STOPPED_EARLY = (0.1, 2)  # after 3 epochs: the lr=0.1 curve is a mean of 2 seeds from epoch 4
BEFORE_PATIENCE = (0.001, 2)  # written before --patience existed: no such key in its config
NAN_LOSS = (0.001, 0)  # diverged: test_loss is NaN, so test_loss has n=2 for lr=0.001
PATIENCE = build_parser().get_default("patience")  # what run.py uses today
HISTORY_HEADER = "epoch,step,lr,train_loss,train_acc,val_loss,val_acc,epoch_time_s,samples_per_sec"


def write_run(root: Path, lr: float, seed: int, *, test_acc: float | None, status="finished",
              epochs: int = EPOCHS, keys=("dataset", "epochs", "lr", "patience", "seed", "width"),
              test_loss: float | None = None):  # fmt: skip
    """One run directory as run.py leaves it; test_acc=None leaves out metrics.json."""
    config = {
        "dataset": "digits", "lr": lr, "width": 64, "seed": seed, "epochs": EPOCHS,
        "patience": PATIENCE, "device": "cpu", "workers": 0, "results_dir": str(root),
        "experiment_keys": list(keys),
    }  # fmt: skip
    if "patience" not in keys:
        del config["patience"]
    config["run_name"] = name = f"digits_lr={lr:g}_seed={seed}-{abs(hash((lr, seed))) % 16**8:08x}"
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    rows = [HISTORY_HEADER]
    for e in range(1, epochs + 1):
        acc = (test_acc or 0.5) * (1 - 0.5**e)
        rows.append(f"{e},{e * 10},{lr},{1 - acc:.4f},{acc:.4f},{1 - acc:.4f},{acc:.4f},0.5,1000")
    (path / "history.csv").write_text("\n".join(rows) + "\n")
    (path / "status").write_text(status + "\n")
    if test_acc is not None:
        metrics = {
            "best_val_acc": test_acc + 0.01, "test_acc": test_acc,
            "test_loss": 1 - test_acc if test_loss is None else test_loss,
            "best_epoch": epochs, "epochs_run": epochs, "steps": epochs * 10,
            "wall_time_s": 600.0 + 30 * seed, "train_time_s": 25.0, "compile_time_s": 0.0,
            "samples_per_sec": 1000.0 + 10 * seed, "peak_mem_bytes": 0, "device": "cpu",
            "stop_reason": "max_epochs", "mlflow_run_id": None,
        }  # fmt: skip
        # json.dumps writes NaN for float("nan"), as run.py's json.dump would.
        (path / "metrics.json").write_text(json.dumps(metrics))
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "results"
    for (lr, seed), acc in TEST_ACC.items():
        kw = {}
        if (lr, seed) == STOPPED_EARLY:
            kw["epochs"] = 3
        if (lr, seed) == BEFORE_PATIENCE:
            kw["keys"] = ("dataset", "epochs", "lr", "seed", "width")
        if (lr, seed) == NAN_LOSS:
            kw["test_loss"] = math.nan
        path = write_run(root, lr, seed, test_acc=acc, **kw)
        if (lr, seed) == (0.01, 0):
            shutil.copytree(path, root / "copy-of-lr0.01-seed0")  # the same run, counted once
    corrupt = write_run(root, 0.01, 7, test_acc=0.9)
    (corrupt / "metrics.json").write_text('{"test_acc": 0.9, ')  # cut off mid-write
    empty = write_run(root, 0.01, 10, test_acc=0.9)
    (empty / "metrics.json").write_text("")
    write_run(root, 0.01, 8, test_acc=None, status="running")
    write_run(root, 0.01, 9, test_acc=None, status="failed")
    keyless = write_run(root, 0.01, 11, test_acc=0.9)
    (keyless / "config.json").write_text("{}")
    return root


def run_plot(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PROJECT / "plot.py"), *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


# plot.py's main() as `python plot.py` runs it, then: which heavy modules did it import?
MAIN_THEN_MODULES = (
    "import sys, plot; code = plot.main(sys.argv[1:]); "
    "print('imported:', sorted({'torch', 'mlflow', 'pandas'} & set(sys.modules))); sys.exit(code)"
)


@pytest.fixture(scope="module")
def plotted(results) -> tuple[Path, subprocess.CompletedProcess]:
    out = results.parent / "figures"
    proc = subprocess.run(
        [sys.executable, "-c", MAIN_THEN_MODULES, "--results", results, "--out", out],
        cwd=PROJECT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, proc


def media_box(pdf: Path) -> tuple[float, float]:
    """Page size in inches from the PDF's /MediaBox (matplotlib writes it uncompressed)."""
    match = re.search(rb"/MediaBox\s*\[\s*([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s*\]",
                      pdf.read_bytes())  # fmt: skip
    assert match, f"no /MediaBox in {pdf}"
    x0, y0, x1, y1 = map(float, match.groups())
    return (x1 - x0) / 72, (y1 - y0) / 72


@pytest.fixture(scope="module")
def table(results):
    runs, _ = load_runs(results)
    return aggregate(runs)


def figures_in_process(table, width: str):
    """Every figure, drawn (so tick labels and layout exist) with an Agg renderer."""
    plot.set_style()
    style = plot.make_style(table, width)
    figures = {
        "learning_curves": plot.plot_learning_curves(table, style),
        "final_vs_hparam": plot.plot_final_vs_hparam(table, style),
        "throughput": plot.plot_throughput(table, style),
    }
    for fig in figures.values():
        FigureCanvasAgg(fig).draw()
    return figures


@pytest.fixture(scope="module", params=sorted(plot.PAGE_WIDTHS))
def drawn(request, table):
    return request.param, figures_in_process(table, request.param)


def test_every_figure_and_table_is_written(plotted):
    out, proc = plotted
    for name in FIGURES:
        for fmt in ("pdf", "png"):
            assert (out / f"{name}.{fmt}").stat().st_size > 1000, f"{name}.{fmt}"
    assert (out / "aggregate.csv").is_file()
    assert (out / "aggregate.tex").read_text().endswith("\\end{tabular}\n")
    assert not list(out.glob(".*")), "temporary files left behind"
    assert "imported: []" in proc.stdout, "plot.py imported torch, mlflow or pandas"


def test_pdf_page_is_the_declared_size_with_embedded_truetype(plotted, table):
    out, _ = plotted
    declared = figures_in_process(table, "single")
    for name, fig in declared.items():
        width, height = fig.get_size_inches()
        assert width == plot.PAGE_WIDTHS["single"]
        assert media_box(out / f"{name}.pdf") == pytest.approx((width, height), abs=1e-2)
        pdf = (out / f"{name}.pdf").read_bytes()
        assert b"/FontFile2" in pdf and b"/Type3" not in pdf, "fonts must be embedded TrueType"


def visible_texts(fig):
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]


def test_no_text_smaller_than_8pt(drawn):
    width, figures = drawn
    for name, fig in figures.items():
        texts = visible_texts(fig)
        assert len(texts) > 5, name
        small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < 8]
        assert not small, f"{name} ({width}): text below 8 pt: {small}"


def test_nothing_outside_the_canvas(drawn):
    """Every label, tick label, legend and caption lies on the page (the clipped 'wall time (min'
    of a reviewer's complaint): the union of what is drawn fits in the declared figure size."""
    width, figures = drawn
    for name, fig in figures.items():
        renderer = fig.canvas.get_renderer()
        box = fig.get_tightbbox(renderer)  # inches
        w, h = fig.get_size_inches()
        tol = 1 / 72
        outside = [t.get_text() for t in visible_texts(fig)
                   if not fig.bbox.expanded(1.001, 1.001).contains(
                       *t.get_window_extent(renderer).min) or not fig.bbox.expanded(
                       1.001, 1.001).contains(*t.get_window_extent(renderer).max)]  # fmt: skip
        assert box.x0 >= -tol and box.y0 >= -tol, f"{name} ({width}): {outside}"
        assert box.x1 <= w + tol and box.y1 <= h + tol, f"{name} ({width}): {outside}"


def test_log_axes_label_every_tick_without_overlap(drawn):
    width, figures = drawn
    log_axes = [(name, ax) for name, fig in figures.items() for ax in fig.axes
                if ax.get_visible() and ax.get_xscale() == "log"]  # fmt: skip
    assert log_axes, "the lr sweep (0.001 ... 0.3) is drawn on a log axis"
    for name, ax in log_axes:
        lo, hi = sorted(ax.get_xlim())
        shown = [(loc, lab) for loc, lab in zip(ax.get_xticks(), ax.get_xticklabels(), strict=True)
                 if lo <= loc <= hi]  # fmt: skip
        texts = [lab.get_text() for _, lab in shown]
        assert texts == ["0.001", "0.01", "0.1", "0.3"], f"{name} ({width})"
        assert ax.xaxis.get_minor_ticks() == [] or not any(
            t.label1.get_text() == "" and t.tick1line.get_visible()
            for t in ax.xaxis.get_minor_ticks()[: len(ax.xaxis.get_minorticklocs())]
        ), f"{name} ({width}): unlabelled minor ticks"
        boxes = [lab.get_window_extent() for _, lab in shown]
        for a, b in zip(boxes, boxes[1:], strict=False):
            assert a.x1 <= b.x0, f"{name} ({width}): tick labels overlap: {texts}"


def test_no_tick_labels_overlap(drawn):
    width, figures = drawn
    for name, fig in figures.items():
        renderer = fig.canvas.get_renderer()
        for ax in (a for a in fig.axes if a.get_visible()):
            for axis in (ax.xaxis, ax.yaxis):
                lo, hi = sorted(axis.get_view_interval())
                labels = [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi
                          and t.label1.get_visible() and t.label1.get_text()]  # fmt: skip
                boxes = [lab.get_window_extent(renderer) for lab in labels]
                for i, a in enumerate(boxes):
                    for b in boxes[i + 1 :]:
                        assert not a.overlaps(b), (
                            f"{name} ({width}): tick labels overlap: "
                            f"{[lab.get_text() for lab in labels]}"
                        )


def config_texts(fig) -> list[str]:
    """The entries of the figure's legends that name configurations."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for leg in legends for t in leg.get_texts()]


def test_legends_sorted_compact_and_n_shown_where_it_varies(drawn, table):
    width, figures = drawn
    values = [", ".join(format_value(v) for v in row.values) for row in table.rows]
    assert [float(v) for v in values] == sorted(float(v) for v in values)
    for name in ("learning_curves", "final_vs_hparam"):
        fig = figures[name]
        texts = config_texts(fig)
        assert [t.split(" (")[0] for t in texts] == values, f"{name} ({width}): not sorted"
        legend = fig.legends[0].get_window_extent()
        assert legend.height < 0.5 * fig.bbox.height, f"{name} ({width}): legend too tall"
    curves = config_texts(figures["learning_curves"])
    assert "0.1 (n=3→2)" in curves, "the lr=0.1 curve ends as a mean of 2 seeds"
    assert "0.3 (n=2)" in curves and "0.01" in curves
    dashed = [ln for ln in figures["learning_curves"].axes[0].get_lines()
              if ln.get_linestyle() == "--" and np.isfinite(ln.get_ydata()).any()]  # fmt: skip
    assert len(dashed) == 1, "only the lr=0.1 curve has a part over fewer seeds"
    assert "0.3 (n=2)" in config_texts(figures["final_vs_hparam"])
    rows = [t.get_text() for t in figures["throughput"].axes[0].get_yticklabels()]
    assert rows == ["0.001", "0.01", "0.1", "0.3 (n=2)"], "throughput rows, sorted, with n"


def test_a_configuration_keeps_its_colour_and_marker_everywhere(drawn, table):
    width, figures = drawn
    looks: dict[str, set] = {}
    for name, fig in figures.items():
        seen = set()
        for line in fig.findobj(Line2D):
            gid = line.get_gid() or ""
            if gid.startswith(plot.GID):
                look = (matplotlib.colors.to_hex(line.get_color()), line.get_marker())
                looks.setdefault(gid, set()).add(look)
                seen.add(gid)
        assert seen == {plot.GID + row.label for row in table.rows}, f"{name} ({width})"
    assert all(len(v) == 1 for v in looks.values()), looks
    pairs = [next(iter(v)) for v in looks.values()]
    assert len({c for c, _ in pairs}) == len({m for _, m in pairs}) == len(pairs), "distinct"


def test_every_panel_has_a_y_label(drawn):
    width, figures = drawn
    for name, fig in figures.items():
        for ax in (a for a in fig.axes if a.get_visible()):
            shared = ax.get_shared_y_axes().get_siblings(ax)
            assert any(a.get_ylabel() for a in shared), f"{name} ({width}): no y-label"


def test_learning_curves_focus_on_the_late_epochs(drawn, table):
    _, figures = drawn
    lo, hi = figures["learning_curves"].axes[0].get_ylim()
    late = [curve(row)[1][2:] for row in table.rows]  # from epoch 3 of 6
    assert lo >= min(v.min() for v in late) - 0.1 and lo > 0.2, "y-range not focused"
    assert hi >= max(v.max() for v in late)


def test_learning_curves_name_the_points_outside_the_axes(drawn):
    """A focused y-range must not hide points silently: every plotted point outside the
    y-limits has its epoch named in the note on the axes, and nothing else is named."""
    width, figures = drawn
    ax = figures["learning_curves"].axes[0]
    lo, hi = ax.get_ylim()
    below = sorted({int(x) for line in ax.get_lines() for x, y in zip(*line.get_data(), strict=True)
                    if np.isfinite(y) and y < lo})  # fmt: skip
    assert below, "the fixture's first epochs lie below the focused range"
    notes = [t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("outside:")]
    span = f"{below[0]}" if len(below) == 1 else f"{below[0]}-{below[-1]}"
    assert notes == [f"epoch{'s' if len(below) > 1 else ''} {span} below"], (width, notes)


def test_throughput_shows_every_run_and_says_spread_is_the_machine(drawn, table):
    width, figures = drawn
    fig = figures["throughput"]
    dots = [ln for ln in fig.axes[0].get_lines() if (ln.get_gid() or "").startswith(plot.GID)]
    assert sum(len(ln.get_xdata()) for ln in dots) == sum(row.n for row in table.rows)
    assert not fig.get_suptitle() and "|" not in " ".join(t.get_text() for t in fig.texts)


def many_configurations(n: int) -> list:
    """`n` configurations of trial runs, as results/trials holds them: several keys vary
    (long legend labels), two seeds each."""
    from labrun.analysis import Run

    keys = ["dataset", "lr", "width", "epochs", "batch_size", "model", "seed"]
    runs = []
    for i in range(n):
        for seed in (0, 1):
            config = {"dataset": "digits", "lr": 10 ** (-4 + i / 10), "width": 16 * (1 + i % 4),
                      "epochs": 6 + i % 3, "batch_size": 32 * (1 + i % 2),
                      "model": "resnet18" if i % 5 else "cnn", "seed": seed,
                      "experiment_keys": keys}  # fmt: skip
            acc = 0.5 + 0.4 * (1 - 0.5 ** np.arange(1, 7)) + 0.001 * i
            history = {"epoch": np.arange(1.0, 7.0), "val_acc": acc}
            metrics = {"test_acc": acc[-1], "best_val_acc": acc[-1], "wall_time_s": 60.0 + i,
                       "samples_per_sec": 1000.0 + seed}  # fmt: skip
            runs.append(Run(f"run{i}-{seed}", config, metrics, history))
    return runs


@pytest.mark.parametrize(
    "n, widths",
    [(40, ["single"]), pytest.param(120, sorted(plot.PAGE_WIDTHS), marks=pytest.mark.slow)],
)
def test_layouts_hold_for_any_number_of_configurations(n, widths):
    """`plot.py --results results/trials` with many configurations: every figure keeps a page
    size (not a 15 in tall throughput figure), draws without layout warnings, its legend and
    labels stay on the page, and a figure that leaves configurations out says so."""
    import warnings

    table = aggregate(many_configurations(n))
    assert len(table.rows) == n
    plot.set_style()
    for width in widths:  # single: the narrowest page, where layouts break first
        style = plot.make_style(table, width)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "constrained_layout not applied" fails the test
            figures = {
                "learning_curves": plot.plot_learning_curves(table, style),
                "final_vs_hparam": plot.plot_final_vs_hparam(table, style),
                "throughput": plot.plot_throughput(table, style),
            }
            figures = {name: fig for name, fig in figures.items() if fig is not None}
            for fig in figures.values():
                FigureCanvasAgg(fig).draw()
        for name, fig in figures.items():
            w, h = fig.get_size_inches()
            assert w == plot.PAGE_WIDTHS[width] and h <= 2.5 * w + 1, f"{name} ({width}): {h} in"
            box = fig.get_tightbbox(fig.canvas.get_renderer())
            tol = 1 / 72
            assert box.x0 >= -tol and box.y0 >= -tol, f"{name} ({width}, n={n})"
            assert box.x1 <= w + tol and box.y1 <= h + tol, f"{name} ({width}, n={n})"
            words = " ".join(t.get_text() for t in visible_texts(fig))
            if n > plot.MAX_SHOWN:
                assert f"of {n}" in words, f"{name} ({width}): no note of what is left out"


def test_aggregate_mean_se_and_n(results, plotted, table):
    assert table.keys == ["lr"], "only lr differs (the run before --patience takes its default)"
    row = {r.values: r for r in table.rows}[(0.01,)]
    # Hand-computed: 0.80, 0.82, 0.87 -> mean 0.83, s^2 = (0.03^2 + 0.01^2 + 0.04^2) / 2 = 0.0013
    assert row.n == 3 and row.seeds == [0, 1, 2], "the copied run directory counts once"
    assert row.mean["test_acc"] == pytest.approx(0.83)
    assert row.se["test_acc"] == pytest.approx(math.sqrt(0.0013 / 3))
    assert [r.fewer_seeds for r in table.rows] == [False, False, False, True]  # lr=0.3: 2 seeds
    assert math.isnan(mean_se([0.5])[1]), "SE of one seed is undefined, not 0"
    first = table.rows[0]  # lr=0.001: its seed 0 diverged (NaN test loss)
    assert first.n == 3 and first.count["test_loss"] == 2 and first.count["test_acc"] == 3
    assert first.mean["test_loss"] == pytest.approx((0.28 + 0.26) / 2)
    assert [r.defaulted for r in first.runs] == [{}, {}, {"patience": PATIENCE}]

    out, proc = plotted
    lines = (out / "aggregate.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = {ln.split(",")[0]: dict(zip(header, ln.split(","), strict=True)) for ln in lines[1:]}
    csv_row = rows["0.01"]
    assert csv_row["n"] == "3" and csv_row["fewer_seeds"] == "False"
    assert float(csv_row["test_acc_mean"]) == pytest.approx(0.83)
    assert float(csv_row["test_acc_se"]) == pytest.approx(math.sqrt(0.0013 / 3))
    assert rows["0.001"]["test_loss_n"] == "2" and rows["0.001"]["test_acc_n"] == "3"
    tex = (out / "aggregate.tex").read_text()
    assert "\\begin{tabular}" in tex and "$0.830 \\pm 0.021$" in tex and "\\dagger" in tex
    assert "\\ddagger" in tex, "the test loss of lr=0.001 is over 2 finite values"
    assert "note: fewer seeds" in proc.stderr and "lr=0.3 (n=2)" in proc.stderr
    assert f"took run.py's current defaults: patience={PATIENCE}" in proc.stderr


def test_bad_and_duplicate_runs_skipped_and_named_in_one_line(results, plotted):
    _, skipped = load_runs(results)
    reasons = {Path(str(where)).name.split("-")[0]: reason for where, reason in skipped}
    original = next(p.name for p in results.glob("digits_lr=0.01_seed=0-*"))
    assert reasons == {
        "digits_lr=0.01_seed=7": "corrupt",
        "digits_lr=0.01_seed=10": "corrupt",  # empty metrics.json: not a finished run
        "digits_lr=0.01_seed=8": "unfinished",
        "digits_lr=0.01_seed=9": "failed",
        "digits_lr=0.01_seed=11": "no experiment_keys in its config",
        "copy": f"duplicate of {original}",
    }
    _, proc = plotted
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2, proc.stderr
    assert warnings[0].startswith("warning: skipped 6 runs (")
    assert "corrupt: digits_lr=0.01_seed=10-" in warnings[0] and "seed=7-" in warnings[0]
    assert f"duplicate of {original}: copy-of-lr0.01-seed0" in warnings[0]
    nan_run = next(p.name for p in results.glob("digits_lr=0.001_seed=0-*"))
    assert warnings[1] == (
        f"warning: left out 1 non-finite value, not counted in n (test_loss=nan: {nan_run})"
    )


def test_curve_aligns_seeds_that_stopped_early(table):
    row = {r.values: r for r in table.rows}[(0.1,)]
    epochs, mean, se, n = curve(row, "val_acc")
    assert list(epochs) == list(range(1, EPOCHS + 1))
    assert list(n) == [3, 3, 3, 2, 2, 2]
    assert mean[-1] == pytest.approx((0.60 + 0.66) / 2 * (1 - 0.5**EPOCHS), abs=1e-4)


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


def test_reads_the_sweep_by_default():
    assert plot.parse_args([]).results == PROJECT / "results" / "sweep"
    assert plot.parse_args(["--results-dir", "x"]).results == Path("x")


@pytest.mark.parametrize("make", ["missing", "empty", "only-unfinished"])
def test_no_finished_runs_is_one_error_line(tmp_path, monkeypatch, capsys, make):
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    if make != "missing":
        results.mkdir()
    if make == "only-unfinished":
        write_run(results, 0.01, 0, test_acc=None, status="running")
    assert plot.main(["--results", str(results), "--out", str(tmp_path / "figures")]) == 1
    stderr = capsys.readouterr().err
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: no finished runs in results/")
    assert "bash run.sh fills" in errors[0] and "results/trials" in errors[0], stderr
    assert len(stderr.splitlines()) == (2 if make == "only-unfinished" else 1)
    assert not (tmp_path / "figures").exists()


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
    plot.set_style()
    style = plot.Style(plot.PAGE_WIDTHS["single"], plot.PANEL_HEIGHTS["single"], {})
    fig = plot.plot_system(system_series(gpus), style, title="digits_lr=0.01-1234abcd")
    FigureCanvasAgg(fig).draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    w, h = fig.get_size_inches()
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= w + 1 / 72 and box.y1 <= h + 1 / 72
    util, memory = fig.axes
    device, ram = ("GPU", "GPU memory") if gpus else ("CPU", "RAM")
    assert util.get_ylabel() == f"{device} util. (%)" and memory.get_ylabel() == f"{ram} (%)"
    assert len(util.get_lines()) == max(1, gpus), "one line per GPU, or the CPU's"
    assert memory.get_xlabel() == "time since the first sample (min)"
    if gpus == 2:
        assert [t.get_text() for t in util.get_legend().get_texts()] == ["GPU 0", "GPU 1"]


def test_system_needs_a_run_with_an_mlflow_id(results, tmp_path, capsys):
    run = next(results.glob("digits_lr=0.01_seed=1-*"))
    assert plot.main(["--system", str(run), "--out", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: --system: ") and "has no MLflow run id" in stderr
    assert len(stderr.splitlines()) == 1 and not list(tmp_path.iterdir())


@pytest.mark.slow  # ~10 s: creating the sqlite DB and importing mlflow in a subprocess
def test_from_mlflow(tmp_path, capsys):
    """Logged the way run.py does (PKG/tracking.py): config as params, per-epoch metrics with
    step = epoch, final metrics with step = total steps (samples_per_sec is in both), and the
    system metrics MLflow samples in the background (`system/...`, step = sample index)."""
    pytest.importorskip("mlflow")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from labrun.analysis import load_runs_from_mlflow
    from labrun.config import resolved_config
    from labrun.tracking import run_params

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("sweep")
    parser = build_parser()
    for (lr, seed), acc in TEST_ACC.items():
        if lr not in (0.01, 0.1):
            continue
        for _ in range(2 if (lr, seed) == (0.01, 0) else 1):  # (0.01, 0) re-run with --fresh
            run = client.create_run(exp, run_name=f"digits_lr={lr}_seed={seed}")
            # The params the producer logs (PKG/tracking.run_params of run.py's config.json).
            args = parser.parse_args(["--lr", str(lr), "--seed", str(seed)])
            params = run_params(resolved_config(args, parser))
            for k, v in params.items():
                client.log_param(run.info.run_id, k, str(v))
            for e in range(1, EPOCHS + 1):
                client.log_metric(run.info.run_id, "val_acc", acc * (1 - 0.5**e), step=e)
                client.log_metric(run.info.run_id, "samples_per_sec", 900.0, step=e)
            final = {"test_acc": acc, "best_val_acc": acc, "wall_time_s": 10.0,
                     "samples_per_sec": 1e3}  # fmt: skip
            for k, v in final.items():
                client.log_metric(run.info.run_id, k, v, step=EPOCHS * 10)
            client.set_terminated(run.info.run_id, "FINISHED")
    crashed = client.create_run(exp, run_name="crashed")
    client.log_param(crashed.info.run_id, "lr", "0.5")
    client.set_terminated(crashed.info.run_id, "FAILED")

    runs, skipped = load_runs_from_mlflow(uri, "sweep")
    assert len(runs) == 6
    assert skipped == [("crashed", "failed"),
                       ("digits_lr=0.01_seed=0", "duplicate of digits_lr=0.01_seed=0")]  # fmt: skip
    assert runs[0].config["lr"] in (0.01, 0.1) and runs[0].metrics["samples_per_sec"] == 1e3
    assert list(runs[0].history["epoch"]) == list(range(1, EPOCHS + 1)), "final step is no epoch"

    out = tmp_path / "figures"
    proc = run_plot("--from-mlflow", "--tracking-uri", uri, "--experiment", "sweep",
                    "--out", out, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warning: skipped 2 runs (failed: crashed; duplicate of" in proc.stderr
    for name in FIGURES:
        assert (out / f"{name}.pdf").is_file()
    lines = (out / "aggregate.csv").read_text().splitlines()
    header = lines[0].split(",")
    row = dict(
        zip(header, next(ln for ln in lines if ln.startswith("0.01,")).split(","), strict=True)
    )
    assert row["n"] == "3" and float(row["test_acc_mean"]) == pytest.approx(0.83)

    # System metrics of one run, by id and through its run directory's metrics.json.
    run_id = runs[0].source
    t0 = 1_700_000_000_000
    client.log_batch(run_id, metrics=[
        Metric(f"system/{name}", float(v), t0 + int(t * 1000), i)
        for name, (ts, vs) in system_series(1).items()
        for i, (t, v) in enumerate(zip(ts, vs, strict=True))
    ])  # fmt: skip
    run_dir = tmp_path / "results" / "digits_lr=0.01_seed=0-00000000"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.json").write_text(json.dumps({"mlflow_run_id": run_id}))
    for target in (run_id, run_dir):
        proc = run_plot("--system", target, "--tracking-uri", uri, "--out", out, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert (out / f"system_{run_id}.png").is_file()
    assert (out / f"system_{run_dir.name}.pdf").is_file()
    no_system = runs[1].source
    proc = run_plot("--system", no_system, "--tracking-uri", uri, "--out", out, cwd=tmp_path)
    assert proc.returncode == 1 and "recorded no system metrics" in proc.stderr
    proc = run_plot("--system", "0" * 32, "--tracking-uri", uri, "--out", out, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --system: no MLflow run")

    # In-process (mlflow is already imported): an unknown experiment is one error line, exit 1.
    capsys.readouterr()  # drop mlflow's own log lines from creating the DB above
    assert plot.main(["--from-mlflow", "--tracking-uri", uri, "--experiment", "nope"]) == 1
    assert capsys.readouterr().err.startswith("error: no MLflow experiment named 'nope'")


@pytest.mark.slow  # three real (tiny) training runs, then plot.py, in subprocesses
def test_from_mlflow_plots_what_run_py_tracked(run_cli, env, tmp_path):
    """The round trip a user makes: run.py tracks into MLflow (the private sqlite DB of
    conftest), `plot.py --from-mlflow` reads those runs back and draws the figures."""
    experiment = f"roundtrip-{tmp_path.name}"
    jobs = [("0.01", "0"), ("0.01", "1"), ("0.05", "0")]
    for lr, seed in jobs:
        done = run_cli("--lr", lr, "--seed", seed, "--epochs", "2", "--experiment", experiment,
                       results_dir=tmp_path / "results")  # fmt: skip
        assert done.returncode == 0, done.stderr
    out = tmp_path / "figures"
    proc = subprocess.run(
        [sys.executable, str(PROJECT / "plot.py"), "--from-mlflow", "--experiment", experiment,
         "--tracking-uri", env["MLFLOW_TRACKING_URI"], "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "skipped" not in proc.stderr, proc.stderr
    for name in FIGURES:
        assert (out / f"{name}.pdf").is_file()
    lines = (out / "aggregate.csv").read_text().splitlines()
    rows = [dict(zip(lines[0].split(","), ln.split(","), strict=True)) for ln in lines[1:]]
    assert sorted((float(r["lr"]), int(r["n"])) for r in rows) == [(0.01, 2), (0.05, 1)]
    tested: dict[float, list[float]] = {}  # what each run directory says, by lr
    for path in (tmp_path / "results").glob("*/metrics.json"):
        lr = json.loads((path.parent / "config.json").read_text())["lr"]
        tested.setdefault(lr, []).append(json.loads(path.read_text())["test_acc"])
    for r in rows:
        assert float(r["test_acc_mean"]) == pytest.approx(np.mean(tested[float(r["lr"])]))
