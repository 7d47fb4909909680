"""Figures and aggregate tables from a sweep: the plotting half (analysis is in PKG/analysis.py).

    python plot.py                     # results/sweep -> figures/*.pdf, *.png, aggregate.csv/.tex
    python plot.py --results results/trials  # the trial runs of `python run.py` instead
    python plot.py --width double      # figures for the full text width of a two-column paper
    python plot.py --from-mlflow       # read the runs from the MLflow tracking server instead
    python plot.py --system RUN        # GPU/CPU utilisation over time of one run (from MLflow)
    python plot.py --formats pdf       # only PDFs (for LaTeX), faster
    python plot.py --curve val_loss --metric test_loss   # other columns than the monitored one
    python plot.py --analysis          # analyze.py's results: a layer-by-layer CKA heat map each

Figures are made and re-made dozens of times before publication, so their styling lives here, in
code: `figsize` is the size on the page in inches (PAGE_WIDTHS x a height each figure declares),
fonts are 10 pt and never below 8 pt, all set in one place (STYLE), and savefig never crops
(no bbox_inches="tight"), so the PDF's page is exactly the declared size and LaTeX includes it at
100 % (`\\includegraphics{figures/learning_curves.pdf}`, no width=).

One function per figure; each takes the aggregate table and the Style and returns a Figure. To add
a figure, copy one of the plot_* functions, change it, and add a line to `figures` in main().
A configuration has one colour *and* one marker (Style.looks), the same in every figure, and
every legend lists configurations in the table's sorted order. Where fewer seeds stand behind a
number than behind the others, the figure says n.

No torch import, and mlflow only with --from-mlflow or --system, so it starts fast.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: also the fastest backend to import

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.textpath import TextToPath  # noqa: E402
from matplotlib.ticker import EngFormatter, MaxNLocator, NullLocator  # noqa: E402

from labrun.analysis import (  # noqa: E402
    Row,
    Table,
    aggregate,
    curve,
    final_metric,
    format_value,
    load_runs,
    load_runs_from_mlflow,
    load_system_metrics,
    write_tables,
)
from labrun.config import DEFAULT_EXPERIMENT, PROJECT_ROOT  # noqa: E402
from labrun.runs import METRICS, atomic_path, read_json  # noqa: E402
from labrun.tracking import tracking_uri  # noqa: E402  (no mlflow import)

# run.sh gives every job `--results-dir results/$SWEEP_NAME` (default: sweep); `python run.py` on
# its own writes to results/trials, so trial runs never mix into the sweep's figures.
SWEEP_RESULTS = PROJECT_ROOT / "results" / "sweep"
TRIAL_RESULTS = PROJECT_ROOT / "results" / "trials"
ANALYSIS_RESULTS = PROJECT_ROOT / "results" / "analysis"  # analyze.py's run directories
CKA_TABLE = "cka_layers.csv"  # analyze.TABLE (analyze.py imports torch when it runs; not here)
# Widths on the page, in inches. single/double: column and text width of the common two-column
# conference layouts (ICML: 3.25 in / 6.75 in; IEEE and CVPR are within 0.1 in of these).
# slide: the content area of a 16:9 slide (13.33 in x 7.5 in) less margins.
PAGE_WIDTHS = {"single": 3.25, "double": 6.75, "slide": 10.0}
# Height of one row of panels for each width, in inches; figures add room for their legends.
PANEL_HEIGHTS = {"single": 2.0, "double": 2.3, "slide": 4.5}

STYLE = {
    # The lab's rule: 10 pt text, 8 pt the absolute minimum (ticks use 9, legend entries 8).
    "font.size": 10,
    "axes.labelsize": 10,
    "axes.titlesize": 10,
    "figure.titlesize": 10,
    "figure.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 8,
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
    # Compact legends: 20 configurations must not take the height of the panel.
    "legend.handlelength": 1.2,
    "legend.handletextpad": 0.4,
    "legend.columnspacing": 0.9,
    "legend.labelspacing": 0.25,
    "legend.borderpad": 0.2,
}
MARKERS = "osD^vP<X>*"  # with the colours: each configuration's look (Style.looks)
LABELS = {  # axis labels of metrics (anything missing falls back to the metric's name)
    "best_val_acc": "best validation accuracy",
    "test_acc": "test accuracy",
    "test_loss": "test loss",
    "val_acc": "val. accuracy",  # short: it must fit beside a short panel
    "val_loss": "val. loss",
    "test_r2": "test R²",
    "val_r2": "val. R²",
    "test_map": "test mAP",
    "val_map": "val. mAP",
    "samples_per_sec": "throughput (samples/s)",
    "wall_time_s": "wall time",
}
# Identifies the artists that stand for a configuration (its colour and marker); tests read it.
GID = "config:"
# Figures show at most this many configurations (the first, in the table's sorted order) and
# say how many they leave out; aggregate.csv has every one. Beyond this, colours blur and a
# legend or a row of labels no longer fits a page.
MAX_SHOWN = 24


def set_style() -> None:
    """The one place that sets rcParams."""
    matplotlib.rcParams.update(STYLE)


@dataclass(frozen=True)
class Look:
    colour: tuple
    marker: str


@dataclass(frozen=True)
class Style:
    """Page geometry and the look of each configuration that every figure function uses."""

    width: float  # inches, one of PAGE_WIDTHS
    panel_height: float  # inches, one row of panels
    looks: dict[str, Look]  # Row.label -> colour and marker, identical across figures


def make_style(table: Table, width: str = "single") -> Style:
    return Style(PAGE_WIDTHS[width], PANEL_HEIGHTS[width], config_looks(table))


def config_looks(table: Table) -> dict[str, Look]:
    """A stable colour and marker per configuration: the i-th configuration (sorted by its
    hyperparameter values) gets the i-th tab10 colour (11-20: the light tab20 shades; more share
    a colormap) and the i-th marker, so two configurations differ in colour and, up to
    len(MARKERS), in marker too (readable in greyscale print)."""
    n = len(table.rows)
    if n <= 20:
        tab20 = matplotlib.colormaps["tab20"].colors
        palette = list(tab20[0::2]) + list(tab20[1::2])  # tab10 first, then the light shades
    else:
        palette = matplotlib.colormaps["turbo"](np.linspace(0.05, 0.95, n))
    return {
        row.label: Look(tuple(palette[i]), MARKERS[i % len(MARKERS)])
        for i, row in enumerate(table.rows)
    }


def legend_label(row: Row, n: int | None = None, n_last: int | None = None) -> str:
    """A configuration's values only ("0.01, 64"; the key names go in the legend's title, see
    key_title), plus its n where it differs from the others': `(n=2)` for fewer seeds (or fewer
    finite values, `n`), `(n=3→1)` for a curve whose seeds stopped early (`n_last` at the end)."""
    label = ", ".join(format_value(v) for v in row.values) or row.label
    n = row.n if n is None else n
    if n_last is not None and n_last < n:
        return f"{label} (n={n}→{n_last})"
    return f"{label} (n={n})" if row.fewer_seeds or n < row.n else label


def key_title(table: Table) -> str | None:
    """The title of a legend of legend_label()s, e.g. `lr, width`."""
    return ", ".join(table.keys) or None


def text_width(text: str, size: float) -> float:
    """Width of `text` set at `size` pt, in inches (the font's own metrics)."""
    width, _, _ = TextToPath().get_text_width_height_descent(text, FontProperties(size=size), False)
    return width / 72


def wrap(text: str, width: float, size: float) -> str:
    """`text` broken into lines no wider than `width` inches at `size` pt (measured)."""
    lines: list[str] = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return "\n".join(lines)


def shorten(text: str, width: float, size: float) -> str:
    """`text`, cut with an ellipsis where it would be wider than `width` inches at `size` pt."""
    if text_width(text, size) <= width:
        return text
    lo, hi = 0, len(text)  # the longest prefix that fits with its ellipsis: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if text_width(text[:mid] + "…", size) <= width else (lo, mid - 1)
    return text[:lo].rstrip(", ") + "…"


MAX_LEGEND_ROWS = 8  # more entries go into more (narrower) columns, their labels cut to fit


def legend_fit(labels: Sequence[str], width: float, title: str | None) -> tuple[list, str | None]:
    """Labels and title as a legend `width` inches wide shows them: each cut to the width of
    its column, with enough columns (each >= 0.9 in) for at most MAX_LEGEND_ROWS rows."""
    size = STYLE["legend.fontsize"]
    em = size / 72
    ncols = max(1, min(math.ceil(len(labels) / MAX_LEGEND_ROWS), int((width - 0.1) // 0.9)))
    extra = STYLE["legend.handlelength"] + STYLE["legend.handletextpad"]
    room = (width - 0.1) / ncols - (extra + STYLE["legend.columnspacing"] + 0.5) * em
    title = shorten(title, width - 0.1, STYLE["legend.title_fontsize"]) if title else title
    return [shorten(s, room, size) for s in labels], title


def legend_layout(labels: Sequence[str], width: float, title: str | None) -> tuple[int, float]:
    """(ncols, height in inches) of a legend of `labels` spanning `width` inches below the axes.

    As many columns as fit, so that 20 configurations take a few rows rather than the
    height of the panel; the column width is measured with the font's metrics. Labels wider
    than the page are cut (legend_fit), so the legend never runs off the page.
    """
    labels, title = legend_fit(labels, width, title)
    size = STYLE["legend.fontsize"]
    em = size / 72
    handle = (STYLE["legend.handlelength"] + STYLE["legend.handletextpad"]) * em
    col = max(text_width(s, size) for s in labels) + handle + STYLE["legend.columnspacing"] * em
    ncols = max(1, min(len(labels), int((width - 0.1) // col)))
    rows = math.ceil(len(labels) / ncols) + (1 if title else 0)
    return ncols, 0.15 + rows * STYLE["legend.labelspacing"] * em + rows * 1.2 * em


def first_rows(table: Table) -> tuple[Table, str]:
    """The table a figure draws (its first MAX_SHOWN configurations) and, if some are left out,
    the note that says so (in the legend's title or the axis label)."""
    if len(table.rows) <= MAX_SHOWN:
        return table, ""
    note = f"first {MAX_SHOWN} of {len(table.rows)}; all in aggregate.csv"
    return replace(table, rows=table.rows[:MAX_SHOWN]), note


def with_note(title: str | None, note: str) -> str | None:
    """The note first, so that a title cut to the page width keeps it."""
    return f"{note}: {title}" if title and note else (note or title)


def config_legend(fig: Figure, table: Table, style: Style, labels: Sequence[str],
                  title: str | None, **line) -> None:  # fmt: skip
    """The figure's legend of configurations, below the axes, in the table's (sorted) order."""
    handles = [
        Line2D([], [], color=style.looks[row.label].colour, marker=style.looks[row.label].marker,
               gid=GID + row.label, **line)
        for row in table.rows
    ]  # fmt: skip
    labels, title = legend_fit(labels, style.width, title)
    ncols, _ = legend_layout(labels, style.width, title)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, title=title)


def legend_room(table: Table, style: Style, labels: Sequence[str], title: str | None) -> float:
    """Inches to add to a figure's height for its config_legend (0 with one configuration)."""
    return legend_layout(labels, style.width, title)[1] if len(table.rows) > 1 else 0.0


# ----------------------------------------------------------------------------------------------
# Figures: each takes (table, style) and returns a Figure of exactly the declared size.
# ----------------------------------------------------------------------------------------------


def plot_learning_curves(table: Table, style: Style, column: str | None = None) -> Figure:
    """A history column per epoch (default: the monitored one, e.g. val_acc): mean over seeds,
    band = +-1 standard error.

    Where some seeds have stopped (early stopping), the mean is over fewer seeds: that part of
    the curve is dashed and the legend says `n=3→1`. The y-axis spans what the curves reach after
    the first quarter of the epochs (the region where configurations differ); points of the steep
    first epochs that fall outside it are named in a note on the axes ("epochs 1-2 below").
    """
    table, note = first_rows(table)
    column = column or table.monitor
    curves = {row.label: curve(row, column) for row in table.rows}
    labels = [legend_label(row, n_last=int(curves[row.label][3].min(initial=row.n)))
              for row in table.rows]  # fmt: skip
    any_dashed = any(curves[row.label][3].min(initial=row.n) < row.n for row in table.rows)
    title = key_title(table)
    if title and any_dashed:
        title += " (dashed: fewer seeds)"
    title = with_note(title, note)
    height = style.panel_height + legend_room(table, style, labels, title)
    fig = Figure(figsize=(style.width, height), layout="constrained")
    ax = fig.add_subplot()
    focus = []
    for i, row in enumerate(table.rows):
        epochs, mean, se, n = curves[row.label]
        if not epochs.size:
            continue
        look = style.looks[row.label]
        full = n >= row.n
        dashed = ~full
        dashed[:-1] |= dashed[1:]  # the dashed part starts at the last point with every seed
        ax.plot(epochs, np.where(full, mean, np.nan), color=look.colour)
        ax.plot(epochs, np.where(dashed, mean, np.nan), color=look.colour, ls="--", lw=0.9)
        every = max(1, epochs.size // 5)  # ~5 markers a curve, staggered between configurations
        ax.plot(epochs, mean, ls="none", marker=look.marker, color=look.colour, gid=GID + row.label,
                markevery=(i % every, every))  # fmt: skip
        if np.isfinite(se).any():
            ax.fill_between(epochs, mean - se, mean + se, color=look.colour, alpha=0.2, lw=0)
        late = epochs >= epochs.min() + 0.25 * (epochs.max() - epochs.min())
        focus += [mean[late] - np.nan_to_num(se[late]), mean[late] + np.nan_to_num(se[late])]
    values = np.concatenate(focus) if focus else np.empty(0)
    values = values[np.isfinite(values)]
    if values.size:
        lo, hi = values.min(), values.max()
        pad = 0.08 * (hi - lo) or 0.01
        ax.set_ylim(lo - pad, hi + pad)
        _note_points_outside(ax, [curves[row.label][:2] for row in table.rows])
    ax.set_xlabel("epoch")
    ax.set_ylabel(LABELS.get(column, column))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(table.rows) > 1:
        config_legend(fig, table, style, labels, title)
    return fig


def _note_points_outside(ax, lines: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Name the epochs whose points lie outside the y-limits, in a note on the axes: a focused
    y-range must not hide points without saying so."""
    lo, hi = ax.get_ylim()
    for side, outside in (("below", lambda y: y < lo), ("above", lambda y: y > hi)):
        epochs = sorted({int(e) for x, y in lines for e, v in zip(x, y, strict=True)
                         if np.isfinite(v) and outside(v)})  # fmt: skip
        if not epochs:
            continue
        span = f"{epochs[0]}" if len(epochs) == 1 else f"{epochs[0]}-{epochs[-1]}"
        if len(epochs) > 1 and epochs != list(range(epochs[0], epochs[-1] + 1)):
            span = ", ".join(map(str, epochs))
        word = "epoch" if len(epochs) == 1 else "epochs"
        ax.text(0.98, 0.03 if side == "below" else 0.97, f"{word} {span} {side}",
                transform=ax.transAxes, ha="right", va="bottom" if side == "below" else "top",
                fontsize=STYLE["legend.fontsize"], color="0.35", gid=f"outside:{side}")  # fmt: skip


def plot_final_vs_hparam(table: Table, style: Style, metric: str | None = None) -> Figure | None:
    """`metric` against each swept hyperparameter (one panel each), mean +- SE over seeds.

    A point is one configuration, in its colour and marker (legend below); points that share the
    other hyperparameters are joined by a grey line. None if nothing was swept.
    """
    metric = metric or final_metric(table.monitor)
    if not table.keys or metric not in table.metrics:
        return None
    table, note = first_rows(table)
    most = max(row.count[metric] for row in table.rows)
    labels = [legend_label(row, n=row.count[metric]) if row.count[metric] < most
              else legend_label(row) for row in table.rows]  # fmt: skip
    title = with_note(key_title(table), note)
    ncols = min(len(table.keys), max(1, int(style.width // 2.2)))  # panels at least ~2.2 in wide
    # Panels share a height of at most twice the page width (many swept keys: trial runs), each
    # at least 1.3 in tall; keys beyond that many rows are left out, and the title says so.
    max_rows = max(1, int(2 * style.width // 1.3))
    keys = table.keys[: max_rows * ncols]
    if len(keys) < len(table.keys):
        title = with_note(title, f"first {len(keys)} of {len(table.keys)} hyperparameters")
    nrows = math.ceil(len(keys) / ncols)
    row_height = max(1.3, min(style.panel_height, 2 * style.width / nrows))
    height = nrows * row_height + legend_room(table, style, labels, title)
    fig = Figure(figsize=(style.width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes, keys, strict=False):
        _final_vs_one(ax, table, style, key, metric)
        ax.set_ylabel(LABELS.get(metric, metric))  # every panel: each may be read alone
    config_legend(fig, table, style, labels, title, ls="none")
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
        values = sorted(set(xs))
        ticks = values[:: math.ceil(len(values) / 8)]  # the swept values, each labelled
        ax.set_xticks(ticks, [format_value(v) for v in ticks])  # 0.001 0.01, 16 32 64
        ax.xaxis.set_minor_locator(NullLocator())  # no unlabelled ticks between them
    else:  # categorical: evenly spaced, in the table's order
        categories = list(dict.fromkeys(format_value(v) for v in xs))
        ax.set_xticks(range(len(categories)), categories)
    span = ((max(xs) - min(xs)) or 1.0) if numeric and not log else 1.0
    for s, rows in enumerate(series.values()):
        shift = (s - (len(series) - 1) / 2) * 0.03  # dodge series so error bars do not overlap
        if log:
            x = np.array([r.values[k] for r in rows], dtype=float) * 10 ** (shift / 2)
        elif numeric:
            x = np.array([r.values[k] for r in rows], dtype=float) + shift * span / 2
        else:
            x = np.array([categories.index(format_value(r.values[k])) for r in rows]) + shift * 3
        y = np.array([r.mean[metric] for r in rows])
        err = np.nan_to_num(np.array([r.se[metric] for r in rows]))  # n = 1: no bar
        ax.plot(x, y, color="0.7", lw=0.8, zorder=1)
        for xi, yi, ei, r in zip(x, y, err, rows, strict=True):
            look = style.looks[r.label]
            bars = ax.errorbar(xi, yi, yerr=ei, color=look.colour, marker=look.marker, lw=1.0)
            bars.lines[0].set_gid(GID + r.label)
    ax.set_xlabel(key)


def plot_throughput(table: Table, style: Style) -> Figure:
    """Training throughput and wall time of every run, one row per configuration.

    Each dot is one run and the vertical bar their median: the spread between the seeds of one
    configuration is the machine (other jobs sharing the GPU or CPU, data loading), not an effect
    of the hyperparameters (say so in the paper's caption: the figure carries no caption text);
    compare rows only where their dots separate. Both axes start at 0, so a few percent of
    contention look like a few percent. At most MAX_SHOWN rows; the y-label says if more exist.
    """
    table, note = first_rows(table)
    n = len(table.rows)
    # Rows need ~0.17 in each to keep their 9 pt labels apart; plus the axis labels.
    height = max(style.panel_height, 0.6 + 0.17 * n)
    fig = Figure(figsize=(style.width, height), layout="constrained")
    fig.get_layout_engine().set(wspace=0.08)  # room between the panels' tick labels
    ax_speed, ax_time = fig.subplots(1, 2, sharey=True)
    walls = [v for row in table.rows for v in _per_run(row, "wall_time_s")]
    finite = [v for v in walls if math.isfinite(v)]
    scale, unit = _time_unit(max(finite, default=0.0))
    panels = ((ax_speed, "samples_per_sec", 1.0), (ax_time, "wall_time_s", 1 / scale))
    for ax, metric, factor in panels:
        largest = 0.0
        for y, row in enumerate(table.rows):
            look = style.looks[row.label]
            values = np.array(_per_run(row, metric)) * factor
            values = values[np.isfinite(values)]
            if not values.size:
                continue
            ax.plot(values, np.full(values.size, y), ls="none", marker=look.marker,
                    color=look.colour, alpha=0.8, gid=GID + row.label)  # fmt: skip
            ax.plot([np.median(values)] * 2, [y - 0.35, y + 0.35], color="0.2", lw=1.0)
            largest = max(largest, values.max())
        # From 0: the spread between runs is seen against the whole, not blown up to the panel.
        ax.set_xlim(0, 1.1 * largest or 1.0)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3))  # few ticks: no clash at the gap
    ax_speed.set_xlabel("samples/s")  # short: two labels share one width
    ax_time.set_xlabel(f"wall time ({unit})")
    ax_speed.xaxis.set_major_formatter(EngFormatter(sep=""))  # 30k, not 30000
    # Row labels take at most 30 % of the width (the panels keep the rest); longer ones are cut.
    size, room = STYLE["ytick.labelsize"], 0.3 * style.width
    ax_speed.set_yticks(range(n), [shorten(legend_label(row), room, size) for row in table.rows])
    ax_speed.set_ylim(n - 0.5, -0.5)  # first configuration on top, as in the table
    ylabel = with_note(key_title(table), note) or ""
    ax_speed.set_ylabel(shorten(ylabel, height - 0.5, STYLE["axes.labelsize"]))
    ax_time.tick_params(axis="y", left=False)
    return fig


def _per_run(row: Row, metric: str) -> list[float]:
    return [r.metrics.get(metric, math.nan) for r in row.runs]


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "h"
    if seconds >= 120:
        return 60.0, "min"
    return 1.0, "s"


def plot_system(series: dict[str, tuple[np.ndarray, np.ndarray]], style: Style,
                title: str = "") -> Figure | None:  # fmt: skip
    """Utilisation and memory over the run's time, from MLflow's system metrics.

    `series`: metric name without `system/` -> (seconds since the run's first sample, values),
    as `load_system_metrics` returns. Top panel: every GPU's utilisation, or the CPU's when no GPU
    was recorded; bottom: GPU memory (or the machine's RAM), in % of the total. None if `series`
    has neither.
    """
    gpus = sorted(k for k in series if re.fullmatch(r"gpu_\d+_utilization_percentage", k))
    memory = [k.replace("utilization", "memory_usage") for k in gpus]
    panels = [
        ("GPU util. (%)", gpus) if gpus else ("CPU util. (%)", ["cpu_utilization_percentage"]),
        ("GPU memory (%)", memory) if gpus else ("RAM (%)", ["system_memory_usage_percentage"]),
    ]
    panels = [(label, [k for k in names if k in series]) for label, names in panels]
    panels = [(label, names) for label, names in panels if names]
    if not panels:
        return None
    fig = Figure(figsize=(style.width, style.panel_height * max(1, len(panels)) * 0.75 + 0.3),
                 layout="constrained")  # fmt: skip
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False).ravel()
    seconds = max((t.max() for t, _ in series.values() if t.size), default=0.0)
    scale, unit = _time_unit(seconds)
    palette = matplotlib.colormaps["tab10"].colors
    for ax, (label, names) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            t, v = series[name]
            device = " ".join(name.split("_")[:2]) if name.startswith("gpu_") else "all"
            ax.plot(t / scale, v, color=palette[i % 10], label=device.upper())
        ax.set_ylim(0, 105)
        ax.set_ylabel(label)
        if len(names) > 1:
            ax.legend(loc="lower right", ncols=min(4, len(names)))
    axes[-1].set_xlabel(f"time since the first sample ({unit})")
    if title:
        fig.suptitle(title, fontsize=STYLE["legend.fontsize"])
    return fig


@dataclass(frozen=True)
class CkaTable:
    """One analyze.py run directory: CKA of every layer of run A (rows) with every layer of run B
    (columns), the layer pair its `cka` is of, and the two runs' names."""

    rows: list[str]
    columns: list[str]
    values: np.ndarray
    layers: tuple[str, str]  # the pair `cka` is of: a layer of A, a layer of B
    cka: float
    run_a: str
    run_b: str


def read_cka(run_dir: Path) -> CkaTable:
    """An analyze.py run directory's cka_layers.csv, metrics.json and config.json (ValueError or
    OSError when one is missing or malformed)."""
    lines = [line.split(",") for line in (run_dir / CKA_TABLE).read_text().splitlines()]
    if len(lines) < 2 or any(len(line) != len(lines[0]) for line in lines):
        raise ValueError(f"{run_dir / CKA_TABLE} is not a table")
    metrics, config = read_json(run_dir / METRICS), read_json(run_dir / "config.json")
    return CkaTable(
        rows=[line[0] for line in lines[1:]],
        columns=lines[0][1:],
        values=np.array([[float(v) for v in line[1:]] for line in lines[1:]]),
        layers=(str(metrics["layer_a"]), str(metrics["layer_b"])),
        cka=float(metrics["cka"]),
        run_a=Path(config["run_a"]).name,
        run_b=Path(config["run_b"]).name,
    )


def plot_cka(table: CkaTable, style: Style) -> Figure:
    """Layer-by-layer linear CKA of two runs as a heat map on a fixed 0-1 scale (one colour means
    one value in every such figure); the pair `cka` is of is outlined, its value in the title."""
    caption = "\n".join(wrap(f"{side}: {name}", style.width - 0.1, STYLE["legend.fontsize"])
                         for side, name in (("A", table.run_a), ("B", table.run_b)))  # fmt: skip
    height = max(style.panel_height, 0.22 * len(table.rows) + 0.9) + 0.15 * caption.count("\n")
    fig = Figure(figsize=(style.width, height), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(table.values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(
        range(len(table.columns)), table.columns, rotation=90 if len(table.columns) > 8 else 0
    )
    ax.set_yticks(range(len(table.rows)), table.rows)
    ax.set_xlabel("layer of B")
    ax.set_ylabel("layer of A")
    ax.spines[:].set_visible(False)
    layer_a, layer_b = table.layers
    if layer_a in table.rows and layer_b in table.columns:
        i, j = table.rows.index(layer_a), table.columns.index(layer_b)
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                                  edgecolor="white", lw=1.2))  # fmt: skip
    pair = layer_a if layer_a == layer_b else f"{layer_a} / {layer_b}"
    ax.set_title(f"linear CKA, layer {pair}: {table.cka:.3f}")
    fig.colorbar(image, ax=ax, label="linear CKA", shrink=0.9)
    fig.suptitle(caption, fontsize=STYLE["legend.fontsize"])
    return fig


def analysis_main(args: argparse.Namespace) -> int:
    """--analysis [DIR]: one heat map per finished analyze.py run directory in DIR."""
    found = sorted(
        p for p in args.analysis.glob(f"*/{CKA_TABLE}") if (p.parent / METRICS).is_file()
    )
    if not found:
        print(f"error: --analysis: no finished analyze.py results in {shown(args.analysis)} "
              "(python analyze.py RUN_A RUN_B writes them)", file=sys.stderr)  # fmt: skip
        return 1
    set_style()
    style = Style(PAGE_WIDTHS[args.width], PANEL_HEIGHTS[args.width], {})
    skipped = []
    for path in found:
        try:
            table = read_cka(path.parent)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            skipped.append((path.parent, f"unreadable ({type(exc).__name__})"))
            continue
        save(plot_cka(table, style), path.parent.name, args.out, args.formats)
    if skipped:
        print(skipped_line(skipped), file=sys.stderr)
    print(f"{args.out}/: {len(found) - len(skipped)} CKA heat map(s) (<analysis run>.*) "
          f"from {shown(args.analysis)}")  # fmt: skip
    return 0 if len(skipped) < len(found) else 1


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


def dropped_line(table: Table, limit: int = 5) -> str:
    """`warning: left out 2 non-finite values (test_loss=nan: a; ...)`: they are not in n."""
    parts = [f"{metric}={value}: {where}" for where, metric, value in table.dropped]
    more = f"; +{len(parts) - limit} more" if len(parts) > limit else ""
    noun = "value" if len(parts) == 1 else "values"
    return (f"warning: left out {len(parts)} non-finite {noun}, not counted in n "
            f"({'; '.join(parts[:limit])}{more})")  # fmt: skip


def shown(path: Path) -> str:
    """`results/sweep/` relative to the current directory where possible."""
    try:
        return f"{path.resolve().relative_to(Path.cwd())}/"
    except ValueError:
        return f"{path}/"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="plot.py",
        description="Aggregate a sweep over seeds and draw its figures (PDF + PNG) and tables.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--results",
        "--results-dir",
        dest="results",
        type=Path,
        default=SWEEP_RESULTS,
        help="directory of run directories: run.sh's sweep (results/<SWEEP_NAME>); the trial "
        "runs of `python run.py` are in results/trials",
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
        help="read the runs from the MLflow tracking server instead of --results",
    )
    p.add_argument(
        "--system",
        metavar="RUN",
        default=None,
        help="instead of the sweep's figures: GPU (or CPU) utilisation and memory over time of "
        "one run, from MLflow's system metrics; RUN is a run directory or an MLflow run id",
    )
    p.add_argument(
        "--analysis",
        metavar="DIR",
        type=Path,
        nargs="?",
        const=ANALYSIS_RESULTS,
        default=None,
        help="instead of the sweep's figures: a layer-by-layer CKA heat map of every analyze.py "
        "result in DIR (default: results/analysis)",
    )
    p.add_argument(
        "--experiment",
        default=DEFAULT_EXPERIMENT,
        help="MLflow experiment to read (with --from-mlflow); trial runs are in "
        f"{DEFAULT_EXPERIMENT}-trials",
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
        default=None,
        help="final metric (a metrics.json name) plotted against each hyperparameter; "
        "default: the test value of the monitored metric (test_acc for classification)",
    )
    p.add_argument(
        "--curve",
        default=None,
        metavar="COLUMN",
        help="history.csv column of the learning curves; default: the monitored one "
        "(config.json `monitored`; val_acc for runs written before tasks)",
    )
    return p.parse_args(argv)


def system_main(args: argparse.Namespace) -> int:
    """--system RUN: the run's utilisation over time, figures/system_<run>.{pdf,png}."""
    run = Path(args.system)
    run_id, name = args.system, args.system
    if run.is_dir():
        try:
            run_id = read_json(run / METRICS).get("mlflow_run_id")
        except (OSError, ValueError, AttributeError):
            run_id = None
        if not run_id:
            print(f"error: --system: {shown(run)} has no MLflow run id in its {METRICS} "
                  "(unfinished, or trained with tracking off): pass the run id",
                  file=sys.stderr)  # fmt: skip
            return 2
        name = run.resolve().name
    uri = args.tracking_uri or tracking_uri()
    try:
        series = load_system_metrics(uri, run_id)
    except LookupError as e:
        print(f"error: --system: {e}", file=sys.stderr)
        return 2
    set_style()
    style = Style(PAGE_WIDTHS[args.width], PANEL_HEIGHTS[args.width], {})
    fig = plot_system(series, style, title=name)
    if fig is None:
        print(f"error: --system: MLflow run {run_id} recorded no system metrics "
              "(system/gpu_0_utilization_percentage, system/cpu_utilization_percentage, ...)",
              file=sys.stderr)  # fmt: skip
        return 1
    paths = save(fig, f"system_{name}", args.out, args.formats)
    print(f"{args.out}/: {', '.join(p.name for p in paths)} ({len(series)} system metrics)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.system is not None:
        return system_main(args)
    if args.analysis is not None:
        return analysis_main(args)
    if args.from_mlflow:
        uri = args.tracking_uri or tracking_uri()
        try:
            runs, skipped = load_runs_from_mlflow(uri, args.experiment)
        except LookupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        where = f"MLflow experiment {args.experiment!r}"
    else:
        runs, skipped = load_runs(args.results)
        where = shown(args.results)
    if skipped:
        print(skipped_line(skipped), file=sys.stderr)
    if not runs:
        trials = "" if args.from_mlflow else (
            f"; `python run.py` alone writes trial runs to {shown(TRIAL_RESULTS)}, "
            f"plot them with --results {shown(TRIAL_RESULTS)}"
        )  # fmt: skip
        print(f"error: no finished runs in {where} (bash run.sh fills {shown(SWEEP_RESULTS)}"
              f"{trials})", file=sys.stderr)  # fmt: skip
        return 1

    table = aggregate(runs)
    args.metric = args.metric or final_metric(table.monitor)
    args.curve = args.curve or table.monitor
    columns = sorted({c for r in runs for c in r.history} - {"epoch", "step"})
    if args.curve not in columns:
        print(f"error: --curve: {args.curve} is not a history column of the runs: "
              f"{', '.join(columns)}", file=sys.stderr)  # fmt: skip
        return 2
    if args.metric not in table.metrics:
        print(f"error: --metric: {args.metric} is not among the runs' metrics: "
              f"{', '.join(table.metrics)}", file=sys.stderr)  # fmt: skip
        return 2
    if table.dropped:
        print(dropped_line(table), file=sys.stderr)
    defaulted = sorted({f"{k}={format_value(v)}" for r in runs for k, v in r.defaulted.items()})
    if defaulted:
        older = sum(bool(r.defaulted) for r in runs)
        print(f"note: {older} older runs lack keys; took run.py's current defaults: "
              f"{', '.join(defaulted)}", file=sys.stderr)  # fmt: skip
    few = [f"{row.label} (n={row.n})" for row in table.rows if row.fewer_seeds]
    if few:
        print(f"note: fewer seeds than the others (max n={table.max_n}): {'; '.join(few)}",
              file=sys.stderr)  # fmt: skip
    set_style()
    style = make_style(table, args.width)
    figures = {  # name -> Figure; add yours here
        "learning_curves": plot_learning_curves(table, style, column=args.curve),
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
