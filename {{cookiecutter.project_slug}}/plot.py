"""Figures and tables of a sweep, mean +- SE over seeds (labrun.analysis does the arithmetic).

    python plot.py                     # results/sweep -> figures/*.pdf, *.png, aggregate.csv/.tex
    python plot.py --results results/trials    # the trial runs of `python run.py` instead
    python plot.py --width double      # for the full text width of a two-column paper
    python plot.py --from-mlflow       # the runs of the MLflow experiment instead
    python plot.py --curve val_loss --metric test_loss    # other columns than the monitored one
    python plot.py --table test_acc train_acc@final "train_acc>=0.99"   # aggregate.tex's columns
    python plot.py --system RUN        # GPU/CPU utilisation over time of one run (MLflow)
    python plot.py --analysis          # CKA heat maps of analyze.py, mean +- SE over seed pairs

Style in code: PAGES in inches (a PDF page is that size: include it at 100 %), STYLE's 10 pt text.
What a paper needs of this experiment, each in one line below: TABLE (the columns of the paper's
table), ORDER (the legends' order, else the sweep's), REFERENCES (chance, a published number),
LABELS (a name the automatic labels get wrong). One function per figure over the aggregate table
(add yours to FIGURES). A swept category (model, dataset) adds `comparison` +
comparison.csv/.tex; several tasks get a figure set each.
"""

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the fastest backend to import
import numpy as np  # noqa: E402
from labrun import analysis as A  # noqa: E402  (pandas; no torch)
from labrun import ckaresults as C  # noqa: E402  (analyze.py's results, over seed pairs)
from labrun import figures as F  # noqa: E402  (legends, wrapping, colours, atomic saves)
from labrun.config import DEFAULT_EXPERIMENT, PROJECT_ROOT  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

RESULTS = PROJECT_ROOT / "results"  # run.sh writes results/<SWEEP_NAME>, run.py results/trials
# (width, height of a row of panels) in inches: ICML's column and text width; a 16:9 slide
PAGES = {"single": (3.25, 2.0), "double": (6.75, 2.3), "slide": (10.0, 4.5)}
STYLE = {  # 10 pt text, 8 pt the minimum; TrueType fonts: journals refuse Type 3
    "font.size": 10, "axes.labelsize": 10, "axes.titlesize": 10, "xtick.labelsize": 9,
    "ytick.labelsize": 9, "legend.fontsize": 8, "legend.title_fontsize": 9, "pdf.fonttype": 42,
    "ps.fonttype": 42, "svg.fonttype": "none", "savefig.dpi": 300, "axes.spines.top": False,
    "axes.spines.right": False, "axes.linewidth": 0.6, "lines.linewidth": 1.2,
    "lines.markersize": 4, "errorbar.capsize": 2.5, "legend.frameon": False,
    "legend.handlelength": 1.2, "legend.columnspacing": 0.9, "legend.labelspacing": 0.25,
}  # fmt: skip
# aggregate.tex and table.csv: mean +- SE of these columns, per configuration: metrics.json names
# (test_acc), a history column at the final or best epoch (train_acc@final, train_acc@best) or
# the first epoch it crosses a threshold (train_acc>=0.99, val_loss<=0.2); [] = test metrics, time
TABLE: list[str] = []
# Legends, tables and comparison in this order of swept values (e.g. ["baseline", "noisy-labels"]);
# [] or a value not named: the sweep's order (run.sh's job order), then the values' own order
ORDER: list = []
# Dotted reference lines per column, or per column name without train_/val_/test_/best_val_
# ("acc": every accuracy), e.g. dict(acc={"chance": 0.1, "Smith et al. 2024": 0.93})
REFERENCES: dict[str, dict[str, float]] = {}
# Axis and table labels: derived from the column's name (train_acc -> "train accuracy",
# wall_time_s -> "wall time (s)"); a name here wins, e.g. {"test_r2": "test $R^2$"}
LABELS: dict[str, str] = {}


def plot_learning_curves(table: A.Table, page, metric: str, curve: str) -> Figure:
    """History column `curve` per epoch: mean over seeds, band +-SE (a note when the bands are
    thinner than the lines); dashed where seeds have stopped early (a mean over fewer of them:
    `n=3→1` in the legend). The first configuration is drawn on top; long curves carry a few
    staggered markers, short ones one per epoch."""
    data, (configs, note), look = A.curves(table, curve), F.shown(table), F.looks(table)
    fig = Figure(figsize=page, layout="constrained")
    ax, handles, labels = fig.add_subplot(), [], []
    for i, config in enumerate(configs):
        c = data[data.config == config].sort_values("epoch")
        full = c.runs.to_numpy() >= table.stats.n[config]
        dashed = ~full | np.r_[~full[1:], False]  # from the last point with every seed
        z = 3 - i / len(configs)  # the first (the baseline, in the sweep's order) on top
        every = F.mark_every(len(c), i, len(configs))
        handles += ax.plot(
            c.epoch, c["mean"].where(full), markevery=every, zorder=z, **look[config]
        )
        ax.plot(c.epoch, c["mean"].where(dashed), color=look[config]["color"], ls="--", lw=0.9,
                zorder=z)  # fmt: skip
        band = (c["mean"] - c.se, c["mean"] + c.se)
        ax.fill_between(c.epoch, *band, color=look[config]["color"], alpha=0.25, lw=0, zorder=1)
        fewer = f" (n={int(c.runs.max())}→{int(c.runs.min())})" if not full.all() else ""
        labels.append(F.label(table, config) + fewer)
    F.references(ax, REFERENCES, curve)
    ax.set(xlabel="epoch", ylabel=A.readable(curve, LABELS))
    ax.xaxis.get_major_locator().set_params(integer=True)
    note = "; ".join(filter(None, [note, F.band_note(ax, data.se, page[1])]))
    if len(configs) > 1 or note:
        fig.set_figheight(page[1] + F.legend(fig, handles, labels, page[0], F.title(table, note)))
    return fig


def plot_final_vs_hparam(table: A.Table, page, metric: str, curve: str) -> Figure | None:
    """`metric`, mean +- SE, against each swept *numeric* key (a panel each, side by side); a
    grey line joins configurations equal in every other key. Categorical keys: comparison."""
    keys = [k for k in table.keys if k not in table.categorical]
    if not keys or f"{metric}_mean" not in table.stats:
        return None
    (configs, note), look = F.shown(table), F.looks(table)
    s = table.stats.loc[configs]
    if len(keys) > (fit := max(1, int(page[0] // 1.6))):  # panels at least 1.6 in wide
        keys, note = keys[:fit], "; ".join(filter(None, [note, f"first {fit} of {len(keys)} keys"]))
    fig = Figure(figsize=page, layout="constrained")
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        others = [s[k].map(str) for k in table.keys if k != key] or np.zeros(len(s))
        for _, line in s.groupby(others, sort=False):
            ax.plot(line[key], line[f"{metric}_mean"], color="0.75", lw=0.8, zorder=1)
        for c in configs:  # hollow markers: the error bar shows through
            ax.errorbar(s.at[c, key], s.at[c, f"{metric}_mean"], s.at[c, f"{metric}_se"],
                        mfc="none", zorder=3, **look[c])  # fmt: skip
        values = sorted(set(s[key]))  # the swept values: as many labelled as fit side by side
        each = max(F.text_width(A.format_value(v), 9) for v in values) + 0.2  # inches a label
        values = values[:: math.ceil(len(values) * each * len(keys) / (page[0] - 0.6))]
        ax.set_xscale("log" if min(values) > 0 and max(values) / min(values) >= 8 else "linear")
        ax.set_xticks(values, [A.format_value(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(key)
    for ax in axes:
        F.references(ax, REFERENCES, metric)
    axes[0].set_ylabel(A.readable(metric, LABELS))
    labels = [F.label(table, c, metric) for c in configs]  # n: the finite values of `metric`
    if len(table.keys) > 1 or note or any("(n=" in s for s in labels):  # else it repeats x
        handles = [
            matplotlib.lines.Line2D([], [], ls="none", mfc="none", **look[c]) for c in configs
        ]
        fig.set_figheight(page[1] + F.legend(fig, handles, labels, page[0], F.title(table, note)))
    return fig


def plot_comparison(table: A.Table, page, metric: str, curve: str) -> Figure | None:
    """`metric` as model x condition: a group per model, its conditions side by side, mean +-
    SE over seeds (hollow markers: every error bar shows). Models whose names do not fit under
    the axis whole (wrapped between words) become rows, named at the left: no name is split."""
    if (found := A.comparison(table, metric)) is None:
        return None
    row_key, wide = found
    conditions = list(dict.fromkeys(c for c, _ in wide.columns))  # at most 10: one colour each
    note = f"first 10 of {len(conditions)} (all in comparison.csv)" * (len(conditions) > 10)
    conditions = conditions[:10]
    slot = (page[0] - 0.8) / len(wide)  # inches per model along x
    names = [F.wrap(v, slot - 0.1, 9) for v in wide.index]
    across = all(F.fits(n, slot - 0.05, 9) for n in names)
    if not across:  # rows: the names get half the width, wrapped between words
        names = [F.wrap(v, 0.5 * page[0], 9) for v in wide.index]
    per_row = 0.155 * max(n.count("\n") + 1 for n in names) + 0.05  # inches a row's name needs
    height = page[1] if across else max(page[1], 0.8 + per_row * len(names))
    fig = Figure(figsize=(page[0], height), layout="constrained")
    ax, step, look = fig.add_subplot(), 0.8 / len(conditions), F.looks(conditions, "condition:")
    for i, condition in enumerate(conditions):
        at = np.arange(len(wide)) - 0.4 + step * (i + 0.5)
        mean, se = wide[(condition, "mean")], wide[(condition, "se")]
        xy = (at, mean, se) if across else (mean, at, None, se)
        ax.errorbar(*xy, ls="none", mfc="none", label=condition, **look[condition])
    F.references(ax, REFERENCES, metric, across=across)
    label, limits = A.readable(metric, LABELS), (-0.5, len(wide) - 0.5)
    if across:
        ax.set_xticks(range(len(wide)), names)
        ax.set(xlabel=row_key, ylabel=label, xlim=limits)
        height += 0.15 * max(n.count("\n") for n in names)
    else:
        ax.set_yticks(range(len(wide)), names)
        ax.set(ylabel=row_key, xlabel=label, ylim=limits[::-1])  # the first row on top
    room = 0.0
    if conditions != [metric] or note:  # one unnamed condition: the axis label says it all
        room = F.legend(fig, *ax.get_legend_handles_labels(), page[0], note)
    fig.set_figheight(height + room)
    return fig


def plot_throughput(table: A.Table, page, metric: str, curve: str) -> Figure:
    """Samples/s and wall time of every run (a dot each, a bar at the median), a row per
    configuration. The spread between seeds is the machine, not the hyperparameters."""
    (configs, note), look = F.shown(table), F.looks(table)
    names = [F.wrap(F.label(table, c), 0.3 * page[0], 9) for c in configs]
    height = max(page[1], 0.7 + 0.17 * len(names) * max(s.count("\n") + 1 for s in names))
    fig = Figure(figsize=(page[0], height), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    scale, unit = F.time_unit(table.per_run("wall_time_s").max())
    for ax, metric, factor in ((axes[0], "samples_per_sec", 1), (axes[1], "wall_time_s", scale)):
        values = table.per_run(metric).dropna() / factor
        for y, c in enumerate(configs):
            v = values[values.index == c]
            ax.plot(v, np.full(len(v), y), ls="none", alpha=0.8, **look[c])
            ax.plot([v.median()] * 2, [y - 0.35, y + 0.35], color="0.2", lw=1.0)
        ax.set_xlim(0, 1.1 * values.max() if len(values) else 1)  # from 0: the spread to scale
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator("auto", min_n_ticks=3))
    axes[0].set_yticks(range(len(configs)), names)
    axes[0].set_ylim(len(configs) - 0.5, -0.5)  # the first configuration on top
    axes[0].set(xlabel="samples/s", ylabel=F.wrap(F.title(table, note), height - 0.5, 10))
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=""))  # 30k, not 30000
    axes[1].set_xlabel(f"wall time ({unit})")
    axes[1].tick_params(axis="y", left=False)
    return fig


# Drawn in this order, saved as <name without plot_>.<format>; each takes (table, page size,
# final metric, history column) and returns a Figure, or None when it has nothing to show.
FIGURES = [plot_learning_curves, plot_final_vs_hparam, plot_comparison, plot_throughput]


def plot_system(series: dict, page, title: str) -> Figure:
    """GPU (else CPU) utilisation and memory in % over the run's time, from MLflow's system
    metrics (A.system_panels picks them)."""
    panels = A.system_panels(series)
    fig = Figure(figsize=(page[0], 0.75 * page[1] * len(panels) + 0.3), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    scale, unit = F.time_unit(max(t.max(initial=0) for t, _ in series.values()))
    for ax, (ylabel, names) in zip(axes, panels.items(), strict=True):
        for name in names:
            device = " ".join(name.split("_")[:2]).upper()  # GPU 0, GPU 1
            ax.plot(series[name][0] / scale, series[name][1], label=device)
        ax.set(ylim=(0, 105), ylabel=ylabel)
        if len(names) > 1:
            ax.legend(loc="lower right", ncols=min(4, len(names)))
    axes[-1].set_xlabel(f"time since the first sample ({unit})")
    fig.suptitle(F.wrap(title, page[0] - 0.1), fontsize=8)
    return fig


def plot_cka(frame, metrics: dict, config: dict, page) -> Figure:
    """Layer-by-layer linear CKA of two runs; the pair `cka` is of is outlined, its value in the
    title."""
    names = {side: Path(config[f"run_{side.lower()}"]).name for side in "AB"}
    caption = "\n".join(F.wrap(f"{side}: {name}", page[0] - 0.1) for side, name in names.items())
    height = max(page[1], 0.22 * len(frame) + 0.9) + 0.15 * caption.count("\n")
    fig = Figure(figsize=page, layout="constrained")
    ax = F.heat_map(fig, frame, height)
    a, b = str(metrics["layer_a"]), str(metrics["layer_b"])
    if a in frame.index and b in frame.columns:
        xy = (list(frame.columns).index(b) - 0.5, list(frame.index).index(a) - 0.5)
        ax.add_patch(matplotlib.patches.Rectangle(xy, 1, 1, fill=False, ec="white", lw=1.2))
    ax.set_title(f"linear CKA, layer {a if a == b else f'{a} / {b}'}: {metrics['cka']:.3f}")
    fig.suptitle(caption, fontsize=8)
    return fig


def plot_cka_seeds(pairs: C.SeedPairs, page) -> Figure:
    """The mean over seed pairs (results of runs that differ only in --seed) of plot_cka's map;
    a dot marks each row's best match (the table beside it: mean +- SE, and the same layer's)."""
    mean = pairs.mean
    fig = Figure(figsize=page, layout="constrained")
    ax = F.heat_map(fig, mean, max(page[1], 0.22 * len(mean) + 0.9))
    best = [list(mean.columns).index(b) for b in pairs.per_row().best_b]
    ax.plot(best, range(len(mean)), ls="none", marker="o", mfc="white", mec="black", mew=0.5)
    ax.set_title(f"linear CKA, mean of {len(pairs.results)} seed pairs")
    fig.suptitle(F.wrap(pairs.name, page[0] - 0.1), fontsize=8)
    return fig


# fmt: off
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plot.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--results", "--results-dir", dest="results", type=Path, default=RESULTS /
                   "sweep", help="run directories (run.sh: results/<SWEEP_NAME>; run.py: trials)")
    p.add_argument("--out", type=Path, default=Path("figures"), help="figures and tables go here")
    p.add_argument("--from-mlflow", action="store_true", help="read the MLflow experiment's runs")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT,
                   help=f"MLflow experiment to read; trial runs: {DEFAULT_EXPERIMENT}-trials")
    p.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else the project's DB")
    p.add_argument("--system", metavar="RUN", help="instead: GPU/CPU utilisation and memory over "
                   "time of one run (its run directory or MLflow run id)")
    p.add_argument("--analysis", metavar="DIR", type=Path, nargs="?", const=RESULTS / "analysis",
                   help="instead: a CKA heat map per analyze.py result in DIR (results/analysis), "
                   "and their mean over seed pairs with its table")
    p.add_argument("--width", choices=sorted(PAGES), default="single", help="figure width: column "
                   "(3.25 in), text width (6.75 in), slide (10 in)")
    p.add_argument("--formats", nargs="+", choices=("pdf", "png", "svg"), default=["pdf", "png"],
                   help="the files of every figure")
    p.add_argument("--metric", help="final metric (a metrics.json name) of final_vs_hparam and "
                   "comparison; default: the monitored metric's test value (test_acc)")
    p.add_argument("--curve", metavar="COLUMN", help="history.csv column of the learning "
                   "curves; default: the monitored one (val_acc)")
    p.add_argument("--table", nargs="+", metavar="COLUMN", help="columns of aggregate.tex and "
                   "table.csv instead of TABLE's: a metrics.json name, COLUMN@final, "
                   "COLUMN@best, COLUMN>=X or COLUMN<=X of a history column")
    return p.parse_args(argv)
# fmt: on


def warn(line: str, code: int = 0) -> int:
    print(line, file=sys.stderr) if line else None
    return code


def main(argv=None) -> int:
    args = parse_args(argv)
    page = PAGES[args.width]
    matplotlib.rcParams.update(STYLE)
    try:
        if args.system is not None:
            series, name = A.load_system_run(args.system, args.tracking_uri)
            F.save(plot_system(series, page, name), f"system_{name}", args.out, args.formats)
            print(f"{args.out}/system_{name}.* ({len(series)} system metrics)")
            return 0
        if args.analysis is not None:
            found, skipped = C.load_cka_results(args.analysis)
            for name, cka in found.items():
                F.save(plot_cka(*cka, page), name, args.out, args.formats)
            groups, unread = C.seed_pairs(found, PROJECT_ROOT)
            for i, pairs in enumerate(groups):  # two groups of one name (another layer): numbered
                stem = f"cka_seeds_{pairs.name}" + f"_{i}" * (len(groups) > len(
                    {g.name for g in groups}))  # fmt: skip
                F.save(plot_cka_seeds(pairs, page), stem, args.out, args.formats)
                C.write_seed_pair_table(pairs, args.out, stem)
            print(f"{args.out}/: {len(found)} CKA heat map(s) from {args.analysis}, "
                  f"{len(groups)} mean(s) over seed pairs (cka_seeds_*)")  # fmt: skip
            return warn(A.skipped_line(skipped + unread))
        runs, skipped = A.load_runs_from(args.results, args.from_mlflow, args.experiment,
                                         args.tracking_uri)  # fmt: skip
    except A.NoResults as e:
        return warn(f"error: {e}", e.code)
    warn(A.skipped_line(skipped))
    groups = A.by_monitor(runs)
    if len(groups) > 1:  # runs of several tasks: never drawn over one another
        sets = "; ".join(f"{args.out / m}/ ({len(g)} runs)" for m, g in groups.items())
        warn(f"note: runs of {len(groups)} monitored metrics, a figure set each: {sets}")
    drawn = 0
    for monitor, group in groups.items():
        table = A.in_order(A.aggregate(group, args.table or TABLE), ORDER)
        out = args.out / monitor if len(groups) > 1 else args.out
        metric, curve = args.metric or A.final_metric(monitor), args.curve or monitor
        if problem := A.unknown_columns(table, metric, curve):
            if len(groups) == 1:
                return warn(f"error: {problem}", 2)
            warn(f"warning: left out {len(group)} runs monitored on {monitor} ({problem}): "
                 + ", ".join(r.where for r in group))  # fmt: skip
            continue
        for line in A.notes(table):
            warn(line)
        written = []
        for draw in FIGURES:
            if (fig := draw(table, page, metric, curve)) is not None:
                written.append(draw.__name__.removeprefix("plot_"))
                F.save(fig, written[-1], out, args.formats)
        tables = [p.name for p in A.write_tables(table, out, metric, LABELS)]
        print(f"{out}/: {', '.join(written + tables)} from {len(group)} runs in "
              f"{len(table.stats)} configurations")  # fmt: skip
        drawn += 1
    return 0 if drawn else 2  # every set left out: --metric or --curve fits none


if __name__ == "__main__":
    sys.exit(main())
