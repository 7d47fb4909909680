"""Figures and aggregate tables from a sweep: the plotting half (analysis is in PKG/analysis.py).

    python plot.py                       # results/ -> figures/*.pdf, *.png, aggregate.csv, .tex
    python plot.py --width double        # figures for the full text width of a two-column paper
    python plot.py --from-mlflow         # read the runs from the MLflow tracking server instead
    python plot.py --formats pdf         # only PDFs (for LaTeX), faster

Figures are made and re-made dozens of times before publication, so their styling lives here, in
code: `figsize` is the size on the page in inches (PAGE_WIDTHS x a height each figure declares),
fonts are 10 pt and never below 8 pt, all set in one place (STYLE), and savefig never crops
(no bbox_inches="tight"), so the PDF's page is exactly the declared size and LaTeX includes it at
100 % (`\\includegraphics{figures/learning_curves.pdf}`, no width=).

One function per figure; each takes the aggregate table and the Style and returns a Figure. To add
a figure, copy one of the plot_* functions, change it, and add a line to `figures` in main().
Colours are per configuration (Style.colours) and the same in every figure.

No torch import, and mlflow only with --from-mlflow: this runs in a few seconds
(benchmarks/RESULTS.md: 200 runs x 50 epochs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: also the fastest backend to import

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter, MaxNLocator, NullLocator  # noqa: E402

from {{ cookiecutter.package_name }}.analysis import (  # noqa: E402
    Row,
    Table,
    aggregate,
    curve,
    format_value,
    load_runs,
    load_runs_from_mlflow,
    write_tables,
)
from {{ cookiecutter.package_name }}.runs import atomic_path  # noqa: E402

PROJECT_ROOT = Path(__file__).resolve().parent
DEFAULT_EXPERIMENT = {{ cookiecutter.project_slug | py_string }}

# Widths on the page, in inches. single/double: column and text width of the common two-column
# conference layouts (ICML: 3.25 in / 6.75 in; IEEE and CVPR are within 0.1 in of these).
# slide: the content area of a 16:9 slide (13.33 in x 7.5 in) less margins.
PAGE_WIDTHS = {"single": 3.25, "double": 6.75, "slide": 10.0}
# Height of one row of panels for each width, in inches; figures add room for their legends.
PANEL_HEIGHTS = {"single": 2.0, "double": 2.3, "slide": 4.5}

STYLE = {
    # The lab's rule: 10 pt text, 8 pt the absolute minimum (ticks and legends use 9).
    "font.size": 10,
    "axes.labelsize": 10,
    "axes.titlesize": 10,
    "figure.titlesize": 10,
    "figure.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.title_fontsize": 9,
    # Embed TrueType (Type 42) fonts: editable text in Illustrator/Inkscape, and journals reject
    # the Type 3 fonts matplotlib embeds by default.
    "pdf.fonttype": 42,
    "ps.fonttype": 42,
    "svg.fonttype": "none",
    "savefig.dpi": 300,  # PNG resolution; the PDF is vector
    "savefig.bbox": "standard",  # never "tight": the saved page must equal figsize
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.linewidth": 0.6,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "lines.linewidth": 1.2,
    "lines.markersize": 4,
    "errorbar.capsize": 2,
    "legend.frameon": False,
    "legend.handlelength": 1.5,
    "legend.columnspacing": 1.0,
}
MARKERS = "osD^vPX*"  # one per series in plot_final_vs_hparam
LABELS = {  # axis labels of metrics (anything missing falls back to the metric's name)
    "best_val_acc": "best validation accuracy",
    "test_acc": "test accuracy",
    "test_loss": "test loss",
    "val_acc": "val. accuracy",  # short: it must fit beside a short panel
    "samples_per_sec": "throughput (samples/s)",
    "wall_time_s": "wall time",
}


def set_style() -> None:
    """The one place that sets rcParams."""
    matplotlib.rcParams.update(STYLE)


@dataclass(frozen=True)
class Style:
    """Page geometry and colours that every figure function uses."""

    width: float  # inches, one of PAGE_WIDTHS
    panel_height: float  # inches, one row of panels
    colours: dict[str, tuple]  # Row.label -> RGBA, identical across figures


def make_style(table: Table, width: str = "single") -> Style:
    return Style(PAGE_WIDTHS[width], PANEL_HEIGHTS[width], config_colours(table))


def config_colours(table: Table) -> dict[str, tuple]:
    """A stable colour per configuration: the i-th configuration (sorted by its hyperparameter
    values) gets the i-th tab10 colour; 11-20 the light tab20 shades; more share a colormap."""
    n = len(table.rows)
    if n <= 20:
        tab20 = matplotlib.colormaps["tab20"].colors
        palette = list(tab20[0::2]) + list(tab20[1::2])  # tab10 first, then the light shades
    else:
        palette = matplotlib.colormaps["turbo"](np.linspace(0.05, 0.95, n))
    return {row.label: tuple(palette[i]) for i, row in enumerate(table.rows)}


def legend_label(row: Row) -> str:
    """A configuration's values only ("0.01, 64"; the key names go in the legend's title, see
    key_title); those with fewer seeds than the others show their n."""
    label = ", ".join(format_value(v) for v in row.values) or row.label
    return f"{label} (n={row.n})" if row.fewer_seeds else label


def key_title(table: Table) -> str | None:
    """The title of a legend of legend_label()s, e.g. `lr, width`."""
    return ", ".join(table.keys) or None


def legend_rows(labels: Sequence[str], width: float) -> tuple[int, int]:
    """(ncols, rows) of a legend of `labels` that spans `width` inches (a rough text estimate)."""
    size = STYLE["legend.fontsize"] / 72  # inches
    col = 0.55 * size * max(len(s) for s in labels) + 0.5  # text + handle + spacing
    ncols = max(1, min(len(labels), int(width // col)))
    return ncols, math.ceil(len(labels) / ncols)


def legend_height(rows: int) -> float:
    """Inches a legend of `rows` rows needs below the axes (line spacing ~1.5 x font size)."""
    return 0.1 + rows * 1.5 * STYLE["legend.fontsize"] / 72 if rows else 0.0


# ----------------------------------------------------------------------------------------------
# Figures: each takes (table, style) and returns a Figure of exactly the declared size.
# ----------------------------------------------------------------------------------------------


def plot_learning_curves(table: Table, style: Style, column: str = "val_acc") -> Figure:
    """Validation accuracy per epoch: mean over seeds, band = +-1 standard error."""
    labels = [legend_label(row) for row in table.rows]
    ncols, rows = legend_rows(labels, style.width) if len(labels) > 1 else (1, 0)
    height = style.panel_height + legend_height(rows + 1)  # the declared height; +1: its title
    fig = Figure(figsize=(style.width, height), layout="constrained")
    ax = fig.add_subplot()
    for row, label in zip(table.rows, labels, strict=True):
        epochs, mean, se, _ = curve(row, column)
        colour = style.colours[row.label]
        ax.plot(epochs, mean, color=colour, label=label)
        if np.isfinite(se).any():
            ax.fill_between(epochs, mean - se, mean + se, color=colour, alpha=0.2, lw=0)
    ax.set_xlabel("epoch")
    ax.set_ylabel(LABELS.get(column, column))
    if rows:
        fig.legend(loc="outside lower center", ncols=ncols, title=key_title(table))
    return fig


def plot_final_vs_hparam(table: Table, style: Style, metric: str = "test_acc") -> Figure | None:
    """`metric` against each swept hyperparameter (one panel each), mean +- SE over seeds.

    A point is one configuration, in its colour; points that share the other hyperparameters are
    joined by a grey line and share a marker (legend to the right). None if nothing was swept.
    """
    if not table.keys or metric not in table.metrics:
        return None
    ncols = min(len(table.keys), max(1, int(style.width // 2.2)))  # panels at least ~2.2 in wide
    nrows = math.ceil(len(table.keys) / ncols)
    fig = Figure(figsize=(style.width, nrows * style.panel_height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(table.keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes, table.keys, strict=False):
        _final_vs_one(ax, table, style, key, metric)
    axes[0].set_ylabel(LABELS.get(metric, metric))
    return fig


def _final_vs_one(ax, table: Table, style: Style, key: str, metric: str) -> None:
    k = table.keys.index(key)
    others = [i for i in range(len(table.keys)) if i != k]
    series: dict[tuple, list[Row]] = {}
    for row in table.rows:  # rows are sorted, so each series is sorted along `key`
        series.setdefault(tuple(format_value(row.values[i]) for i in others), []).append(row)
    xs = table.column(key)
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in xs)
    log = numeric and min(xs) > 0 and max(xs) / min(xs) >= 8  # geometric grids: lr, width
    if numeric:
        ax.set_xscale("log" if log else "linear")
        ticks = sorted(set(xs))
        if log and len(ticks) <= 6 and all(float(v).is_integer() for v in ticks):
            ax.set_xticks(ticks, [format_value(v) for v in ticks])  # 16 32 64, not 10^1 10^2
            ax.xaxis.set_minor_locator(NullLocator())
    else:  # categorical: evenly spaced, in the table's order
        categories = list(dict.fromkeys(format_value(v) for v in xs))
        ax.set_xticks(range(len(categories)), categories)
    span = ((max(xs) - min(xs)) or 1.0) if numeric and not log else 1.0
    for s, (other, rows) in enumerate(series.items()):
        shift = (s - (len(series) - 1) / 2) * 0.03  # dodge series so error bars do not overlap
        if log:
            x = np.array([r.values[k] for r in rows], dtype=float) * 10 ** (shift / 2)
        elif numeric:
            x = np.array([r.values[k] for r in rows], dtype=float) + shift * span / 2
        else:
            x = np.array([categories.index(format_value(r.values[k])) for r in rows]) + shift * 3
        y = np.array([r.mean[metric] for r in rows])
        err = np.nan_to_num(np.array([r.se[metric] for r in rows]))  # n = 1: no bar
        marker = MARKERS[s % len(MARKERS)]
        name = ", ".join(other)
        ax.plot(x, y, color="0.6", lw=0.8, marker=marker, mfc="0.6", mec="0.6", label=name)
        for xi, yi, ei, r in zip(x, y, err, rows, strict=True):
            c = style.colours[r.label]
            ax.errorbar(xi, yi, yerr=ei, color=c, marker=marker, mfc=c, mec=c, lw=1.0)
    ax.set_xlabel(key)
    if len(series) > 1:
        title = ", ".join(table.keys[i] for i in others)
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), handlelength=1.2, title=title)


def plot_throughput(table: Table, style: Style) -> Figure:
    """Training throughput and wall time per configuration (horizontal bars, mean +- SE)."""
    n = len(table.rows)
    # Bars need ~0.17 in each to keep their 9 pt labels apart; plus room for the axis labels.
    height = max(style.panel_height, 0.6 + 0.17 * n)
    fig = Figure(figsize=(style.width, height), layout="constrained")
    fig.get_layout_engine().set(wspace=0.08)  # room between the panels' tick labels
    ax_speed, ax_time = fig.subplots(1, 2, sharey=True)
    y = np.arange(n)
    colours = [style.colours[row.label] for row in table.rows]
    walls = [row.mean.get("wall_time_s", math.nan) for row in table.rows]
    scale, unit = _time_unit(np.nanmax(walls) if np.isfinite(walls).any() else 0.0)
    for ax, metric, factor in (
        (ax_speed, "samples_per_sec", 1.0),
        (ax_time, "wall_time_s", 1 / scale),
    ):
        mean = np.array([row.mean.get(metric, math.nan) for row in table.rows]) * factor
        err = np.nan_to_num(np.array([row.se.get(metric, math.nan) for row in table.rows]))
        ax.barh(y, mean, xerr=err * factor, color=colours, height=0.7,
                error_kw={"lw": 0.8, "capsize": 1.5})  # fmt: skip
    ax_speed.set_xlabel("samples/s")  # short: two labels share one width
    ax_time.set_xlabel(f"wall time ({unit})")
    for ax in (ax_speed, ax_time):
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3))  # few ticks: no clash at the gap
    ax_speed.xaxis.set_major_formatter(EngFormatter(sep=""))  # 30k, not 30000
    ax_speed.set_yticks(y, [legend_label(row) for row in table.rows])
    ax_speed.set_ylabel(key_title(table) or "")
    ax_speed.invert_yaxis()  # first configuration on top, as in the table
    ax_time.tick_params(axis="y", left=False)
    return fig


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "h"
    if seconds >= 120:
        return 60.0, "min"
    return 1.0, "s"


# ----------------------------------------------------------------------------------------------
# Output and command line
# ----------------------------------------------------------------------------------------------


def save(fig: Figure, name: str, out: Path, formats: Sequence[str] = ("pdf", "png")) -> list[Path]:
    """`out/<name>.<fmt>` for each format, written atomically (a LaTeX preview never sees half a
    PDF); the PDF carries no timestamp, so re-running without changes gives identical files."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out / f"{name}.{fmt}"
        metadata = {"CreationDate": None} if fmt == "pdf" else None
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt, metadata=metadata)
        paths.append(path)
    return paths


def skipped_line(skipped: Sequence[tuple], limit: int = 5) -> str:
    """`warning: skipped 3 runs (unfinished: a, b; corrupt: c)`: one line, however many."""
    by_reason: dict[str, list[str]] = {}
    for where, reason in skipped:
        by_reason.setdefault(reason, []).append(Path(str(where)).name)
    parts = []
    for reason, names in by_reason.items():
        shown = ", ".join(names[:limit]) + (
            f", +{len(names) - limit} more" if len(names) > limit else ""
        )
        parts.append(f"{reason}: {shown}")
    noun = "run" if len(skipped) == 1 else "runs"
    return f"warning: skipped {len(skipped)} {noun} ({'; '.join(parts)})"


def tracking_uri(arg: str | None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else the project's sqlite DB (docs/design.md)."""
    return arg or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="plot.py",
        description="Aggregate a sweep over seeds and draw its figures (PDF + PNG) and tables.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--results-dir",
        type=Path,
        default=Path("results"),
        help="directory of run directories written by run.py / run.sh",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("figures"),
        help="where the figures and aggregate.csv / aggregate.tex go",
    )
    p.add_argument(
        "--from-mlflow",
        action="store_true",
        help="read the runs from the MLflow tracking server instead of --results-dir",
    )
    p.add_argument(
        "--experiment",
        default=DEFAULT_EXPERIMENT,
        help="MLflow experiment to read (with --from-mlflow)",
    )
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else sqlite:///<project>/mlflow.db",
    )
    p.add_argument(
        "--width",
        choices=sorted(PAGE_WIDTHS),
        default="single",
        help="figure width on the page: single column (3.25 in), double (6.75 in), slide (10 in)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        choices=("pdf", "png", "svg"),
        default=["pdf", "png"],
        help="file formats to write for every figure",
    )
    p.add_argument(
        "--metric",
        default="test_acc",
        help="final metric (a metrics.json name) plotted against each hyperparameter",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_mlflow:
        uri = tracking_uri(args.tracking_uri)
        try:
            runs, skipped = load_runs_from_mlflow(uri, args.experiment)
        except LookupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        where = f"MLflow experiment {args.experiment!r}"
    else:
        runs, skipped = load_runs(args.results_dir)
        where = f"{args.results_dir}/"
        if not args.results_dir.is_dir():
            print(f"error: results directory {where} does not exist (run bash run.sh first)",
                  file=sys.stderr)  # fmt: skip
            return 1
    if skipped:
        print(skipped_line(skipped), file=sys.stderr)
    if not runs:
        print(f"error: no finished runs in {where} (run bash run.sh first)", file=sys.stderr)
        return 1

    table = aggregate(runs)
    if args.metric not in table.metrics:
        print(f"error: --metric {args.metric} is not among the runs' metrics: "
              f"{', '.join(table.metrics)}", file=sys.stderr)  # fmt: skip
        return 2
    few = [f"{row.label} (n={row.n})" for row in table.rows if row.fewer_seeds]
    if few:
        print(f"note: fewer seeds than the others (max n={table.max_n}): {'; '.join(few)}",
              file=sys.stderr)  # fmt: skip
    set_style()
    style = make_style(table, args.width)
    figures = {  # name -> Figure; add yours here
        "learning_curves": plot_learning_curves(table, style),
        "final_vs_hparam": plot_final_vs_hparam(table, style, metric=args.metric),
        "throughput": plot_throughput(table, style),
    }
    written = []
    for name, fig in figures.items():
        if fig is None:  # nothing to show
            print(f"note: no {name} figure: no hyperparameter varies between the runs",
                  file=sys.stderr)  # fmt: skip
            continue
        save(fig, name, args.out, args.formats)
        written.append(name)
    write_tables(table, args.out)
    print(f"{args.out}/: {', '.join(written)} ({' '.join(args.formats)}) + aggregate.csv/.tex "
          f"from {len(runs)} runs in {len(table.rows)} configurations")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
