"""What every figure of plot.py shares: colours and markers per configuration, labels wrapped
at the font's real width between words (never cut off, never split inside one), legends that fit
the page, markers spaced along long curves, reference lines, atomic saves. The figures
themselves, their sizes and the rcParams live in the project's plot.py."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib import rcParams
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath

from .analysis import Table, format_value
from .runs import atomic_path

MARKERS = "osD^vP<X>*"
GID = "config:"  # the gid of every artist that stands for a configuration (tests read it)
MAX_SHOWN = 24  # configurations a figure draws (a legend must fit the page); a note says so


def text_width(text: str, size: float) -> float:
    """Width of `text` at `size` pt in inches, from the font's own metrics."""
    return (
        TextToPath().get_text_width_height_descent(text, FontProperties(size=size), False)[0] / 72
    )


def wrap(text, width: float, size: float = 8) -> str:
    """`text` in lines at most `width` inches wide at `size` pt, broken only after spaces, `_`,
    `,`, `=`, `-` or `/`: never inside a word, so a word wider than the line stays whole and
    sticks out (`fits` tells; the caller rotates or widens)."""
    lines: list[str] = []
    for piece in re.split(r"(?<=[ _,=/-])", str(text)):
        if lines and text_width(lines[-1] + piece, size) <= width:
            lines[-1] += piece
        else:
            lines.append(piece)
    return "\n".join(line.rstrip() for line in lines)


def fits(text: str, width: float, size: float = 8) -> bool:
    """Every line of `text` at most `width` inches wide at `size` pt."""
    return all(text_width(line, size) <= width for line in str(text).split("\n"))


def mark_every(points: int, index: int, count: int) -> int | tuple[int, int]:
    """Line2D `markevery` for the `index`-th of `count` curves of `points` points: a marker on
    each up to 12 points, else about 6 per curve, staggered so that no two curves put theirs on
    the same epoch (markers tell overlapping curves apart, in greyscale too)."""
    if points <= 12:
        return 1
    every = max(1, round(points / 6))
    return (index * every // max(count, 1)) % every, every


def band_note(ax, se, height: float) -> str:
    """What a figure of curves cannot show of their SE (`se`: every point's): one seed (no
    band), or bands mostly thinner than the lines (the median band; the axes' height estimated
    from the figure's `height` in inches, less its labels)."""
    if se.notna().sum() == 0:
        return "one seed: no SE band"
    low, high = ax.get_ylim()
    typical = 2 * se.median() / (high - low) * (height - 0.55) * 72  # points
    thin = typical < 2 * rcParams["lines.linewidth"]
    return "SE bands mostly narrower than the lines" if thin else ""


def references(ax, references: dict[str, dict], column: str, across: bool = True) -> None:
    """plot.py's REFERENCES of `column` (else of its name without the split's prefix: "acc" for
    train_acc, best_val_acc...) as dotted grey lines, named outside the axes where no data can
    hide the name: at the right end (`across`: values on the y axis), else above the top."""
    bare = re.sub(r"^(best_val|train|val|test)_", "", column)
    for name, value in (references.get(column) or references.get(bare, {})).items():
        if across:
            ax.axhline(value, color="0.45", ls=":", lw=0.9, zorder=1)
            ax.annotate(name, (1, value), xycoords=("axes fraction", "data"), xytext=(3, 0),
                        textcoords="offset points", ha="left", va="center", fontsize=8,
                        color="0.35")  # fmt: skip
        else:
            ax.axvline(value, color="0.45", ls=":", lw=0.9, zorder=1)
            ax.annotate(name, (value, 1), xycoords=("data", "axes fraction"), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8,
                        color="0.35")  # fmt: skip


def shown(table: Table) -> tuple[list[str], str]:
    """The configurations a figure draws (the first MAX_SHOWN), and the note naming the rest."""
    configs = list(table.stats.index)
    if len(configs) <= MAX_SHOWN:
        return configs, ""
    return configs[:MAX_SHOWN], f"first {MAX_SHOWN} of {len(configs)} (all in aggregate.csv)"


def title(table: Table, note: str = "") -> str:
    """A legend's title: the swept keys its labels give the values of, then the note."""
    return "; ".join(filter(None, [", ".join(table.keys), note]))


def looks(table: Table | Sequence[str], gid: str = GID) -> dict[str, dict]:
    """Line2D keywords per configuration (or any names): the i-th tab10 colour (beyond 10, a
    colormap's shades) and marker, the same in every figure; `gid` + name tags its artists."""
    names = list(table.stats.index) if isinstance(table, Table) else list(table)
    colours = matplotlib.colormaps["tab10"](range(10))
    if len(names) > 10:
        colours = matplotlib.colormaps["turbo"](np.linspace(0.05, 0.95, len(names)))
    return {name: {"color": colours[i], "marker": MARKERS[i % len(MARKERS)], "gid": gid + name}
            for i, name in enumerate(names)}  # fmt: skip


def label(table: Table, config: str, metric: str | None = None) -> str:
    """A configuration's values ("0.01, 64": the keys are in the legend's title), with its n
    where it has fewer seeds than the others, or fewer finite values of `metric` than seeds."""
    row = table.stats.loc[config]
    # None or NaN (v != v): an argument this configuration's model does not take (logreg: width)
    values = [row[k] for k in table.keys]
    text = ", ".join(format_value(v) for v in values if v is not None and v == v) or config
    n = int(row[f"{metric}_n"]) if metric else row.n
    return f"{text} (n={n})" if n < row.n or row.fewer_seeds else text


def legend(fig: Figure, handles, labels, width: float, title: str = "") -> float:
    """A legend below the axes, in as many columns as fit `width` inches, labels wrapped, in the
    order given; returns the height in inches it needs (add it to the figure's)."""
    labels, title = [wrap(s, width - 0.5) for s in labels], wrap(title, width - 0.1, 9)
    widest = max(text_width(line, 8) for s in labels for line in s.split("\n")) + 0.4
    ncols = max(1, min(len(labels), int((width - 0.1) // widest)))
    lines = max(sum(s.count("\n") + 1 for s in labels[i::ncols]) for i in range(ncols))
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, title=title or None)
    return 0.15 + 0.155 * lines + (0.19 * (title.count("\n") + 1) if title else 0)


def heat_map(fig: Figure, frame, height: float):
    """`frame` (e.g. linear CKA of layer pairs) as a heat map on a fixed 0-1 scale (a colour means
    one value in every such figure), with its colour bar, `height` inches high; its axes."""
    fig.set_figheight(height)
    ax = fig.add_subplot()
    image = ax.imshow(frame.to_numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(frame.shape[1]), frame.columns, rotation=90 * (frame.shape[1] > 8))
    ax.set_yticks(range(len(frame)), frame.index)
    ax.set(xlabel="layer of B", ylabel="layer of A")
    fig.colorbar(image, ax=ax, label="linear CKA", shrink=0.9)
    return ax


def time_unit(seconds: float) -> tuple[float, str]:
    """(seconds per unit, unit) for an axis of durations up to `seconds`."""
    return (3600, "h") if seconds >= 7200 else (60, "min") if seconds >= 120 else (1, "s")


def save(fig: Figure, name: str, out: Path, formats=("pdf", "png")) -> list[Path]:
    """out/<name>.<fmt> for each format, written atomically (a LaTeX preview never sees half a
    PDF); the PDF carries no date, so a re-run without changes gives the same bytes."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.{fmt}" for fmt in formats]
    for path in paths:
        with atomic_path(path) as tmp:
            metadata = {"CreationDate": None} if path.suffix == ".pdf" else None
            fig.savefig(tmp, format=path.suffix[1:], metadata=metadata)
    return paths
