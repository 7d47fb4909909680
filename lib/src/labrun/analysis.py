"""Load a sweep's runs and aggregate them over seeds: the analysis half of plot.py.

No torch and no matplotlib here (and no pandas: `python plot.py` should start fast). The same
functions serve a notebook:

    from PKG.analysis import load_runs, aggregate
    runs, skipped = load_runs("results")
    table = aggregate(runs)
    for row in table.rows:
        print(row.label, row.n, row.mean["test_acc"], row.se["test_acc"])

Metric names come from the task (PKG/tasks.py; docs/design.md, "Metric names"): metrics.json has
`best_<monitor>`, `test_<metric>` and `test_loss`; history.csv `train_<metric>`, `val_<metric>`;
config.json `monitored` (the history column early stopping followed). Runs written before tasks
have none of these keys: they are classification runs monitored on `val_acc`.

Sources: `results/sweep/<run>/{config.json, metrics.json, history.csv, status}` as run.py writes
them (PKG/runs.py names the files), or the MLflow tracking server (`load_runs_from_mlflow`). A run
is *done* iff its metrics.json parses to a non-empty JSON object.

Which runs count (each exclusion is returned in `skipped`, with its reason, for one warning line):
- a config.json without `experiment_keys` (every config.json run.py writes has it) is skipped: we
  cannot tell which of its keys define the experiment;
- a key that older runs lack (a flag added since) takes its default from run.py's current parser
  (PKG/config.py `build_parser()`), so those runs join the configuration they belong to;
- duplicates (same experiment keys *and* seed, e.g. a copied run directory) count once: the one
  whose directory name is its run name (else the first) stays, the others are `duplicate of ...`.

Statistics: a *configuration* is the tuple of experiment keys except `seed`; runs of the same
configuration are its seeds. For every numeric metric: mean, standard error SE = s / sqrt(n) with
the sample standard deviation s (ddof=1), and n = the number of *finite* values (a NaN or inf
test loss of a diverged seed is dropped and listed in `Table.dropped`, never averaged and never
counted). With n = 1 the SE is undefined and is NaN (an empty cell in the CSV, no error bar in the
figures), never a misleading 0. A configuration with fewer seeds than the largest n of the sweep
is flagged (`fewer_seeds`).
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import build_parser
from .runs import (
    CONFIG,
    HISTORY,
    HISTORY_FIELDS,
    METRICS,
    STATUS,
    atomic_write_text,
    read_json,
    read_status,
)

# metrics.json's keys that every task writes, in design order. A table lists the task's own
# first (best_<monitor>, test_<metric>..., test_loss), then these, then any other.
METRIC_NAMES = (
    "best_epoch", "epochs_run", "steps", "wall_time_s", "train_time_s", "compile_time_s",
    "samples_per_sec", "peak_mem_bytes",
)  # fmt: skip
SEED_KEY = "seed"
DEFAULT_MONITOR = "val_acc"  # runs written before tasks: classification, early-stopped on it
# The LaTeX table shows the task's metrics and these (a paper table has room for a handful);
# the CSV has every metric.
LATEX_METRICS = ("epochs_run", "wall_time_s")


def is_task_metric(name: str) -> bool:
    """best_<monitor>, test_<metric>, test_loss: the metrics.json names the task gives."""
    return name.startswith(("best_val_", "test_"))


def monitored(runs: Iterable[Run]) -> str:
    """The history column the runs were early-stopped on (config.json `monitored`, else the
    metric named best_<monitor>, as MLflow has it; val_acc for runs written before tasks); the
    most common one when they differ."""
    counts: dict[str, int] = {}
    for run in runs:
        best = [m.removeprefix("best_") for m in run.metrics if m.startswith("best_val_")]
        name = run.config.get("monitored") or (best[0] if best else DEFAULT_MONITOR)
        counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get, default=DEFAULT_MONITOR)


def final_metric(monitor: str) -> str:
    """The metrics.json name of a monitored column's test value: val_acc -> test_acc."""
    return "test_" + monitor.removeprefix("val_")


@dataclass
class Run:
    """One finished run: its resolved config, final metrics and per-epoch history."""

    name: str
    config: dict
    metrics: dict[str, float]  # numeric entries of metrics.json
    history: dict[str, np.ndarray]  # history.csv column -> values, one per epoch
    source: str = ""  # run directory or MLflow run id
    defaulted: dict = field(default_factory=dict)  # keys this run lacked -> the parser's default

    @property
    def experiment_keys(self) -> list[str]:
        """config.json's `experiment_keys`; [] if it has none (such a run is skipped)."""
        keys = self.config.get("experiment_keys")
        if isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys):
            return keys
        return []

    @property
    def where(self) -> str:
        """How warnings name the run: its directory's name, or its MLflow run name."""
        return Path(self.source).name if Path(self.source).is_dir() else self.name


@dataclass
class Row:
    """One configuration: its runs (seeds) and the statistics over them."""

    values: tuple  # values of Table.keys (the swept hyperparameters)
    label: str  # "lr=0.01, width=64": legends, table rows
    runs: list[Run]
    mean: dict[str, float] = field(default_factory=dict)
    se: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)  # finite values per metric (<= n)
    fewer_seeds: bool = False

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def seeds(self) -> list:
        return sorted((r.config.get(SEED_KEY) for r in self.runs), key=_sort_key)


@dataclass
class Table:
    """The aggregate: one row per configuration, sorted by the swept values."""

    keys: list[str]  # swept hyperparameters: experiment keys (not seed) whose values differ
    metrics: list[str]  # numeric metrics present in any run
    rows: list[Row]
    constant: dict = field(default_factory=dict)  # experiment keys shared by every run
    dropped: list[tuple[str, str, float]] = field(default_factory=list)  # (run, metric, value)
    monitor: str = DEFAULT_MONITOR  # the history column the runs were early-stopped on

    @property
    def max_n(self) -> int:
        return max((row.n for row in self.rows), default=0)

    def column(self, key: str) -> list:
        """Values of one swept hyperparameter, row by row."""
        i = self.keys.index(key)
        return [row.values[i] for row in self.rows]

    def to_dataframe(self):
        """The CSV's content as a pandas DataFrame (imports pandas, for notebooks)."""
        import pandas as pd

        header, records = _records(self)
        return pd.DataFrame(records, columns=header)


# ----------------------------------------------------------------------------------------------
# Loading from the results directory
# ----------------------------------------------------------------------------------------------


def load_runs(results_dir: str | os.PathLike) -> tuple[list[Run], list[tuple[Path, str]]]:
    """Every finished run under `results_dir`, and the (path, reason) of the ones skipped.

    reason is `unfinished` (running or interrupted: no metrics.json yet), `failed` (status says
    so and no metrics.json), `corrupt` (a file is missing or cannot be parsed; an empty
    metrics.json too) or one of `settle`'s. Sub-directories with none of the run files (e.g. a
    user's notes) are ignored. A missing directory gives no runs.
    """
    root = Path(results_dir)
    runs: list[Run] = []
    skipped: list[tuple[Path, str]] = []
    if not root.is_dir():
        return runs, skipped
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        names = {CONFIG, METRICS, HISTORY, STATUS}
        present = {n for n in names if (path / n).is_file()}
        if not present:
            continue
        if METRICS not in present:
            status = read_status(path)
            skipped.append((path, "failed" if status == "failed" else "unfinished"))
            continue
        try:
            runs.append(_load_run_dir(path))
        except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError):
            skipped.append((path, "corrupt"))
    runs, unsettled = settle(runs)
    return runs, skipped + unsettled


def parser_defaults() -> dict:
    """run.py's current defaults of every flag (PKG/config.py, no torch)."""
    return vars(build_parser().parse_args([]))


def settle(runs: Sequence[Run]) -> tuple[list[Run], list[tuple[str, str]]]:
    """The runs that count, and (run, reason) for the others (see the module docstring).

    Skips runs without experiment keys; fills keys other runs have and this one lacks with the
    parser's default (recorded in `Run.defaulted`); keeps one run per (configuration, seed).
    """
    kept: list[Run] = []
    skipped: list[tuple[str, str]] = []
    for run in runs:
        if run.experiment_keys:
            kept.append(run)
        else:
            skipped.append((run.where, "no experiment_keys in its config"))
    keys = sorted({k for run in kept for k in run.experiment_keys})
    defaults = parser_defaults()
    for run in kept:
        for key in keys:
            if key not in run.config and key in defaults:
                run.config[key] = run.defaulted[key] = defaults[key]
    by_identity: dict[str, list[Run]] = {}
    for run in kept:
        identity = json.dumps({k: _hashable(run.config.get(k)) for k in keys}, sort_keys=True)
        by_identity.setdefault(identity, []).append(run)
    unique = []
    for same in by_identity.values():
        # The original directory is named after its run; a copy has another name.
        keeper = next((r for r in same if r.where == r.name), same[0])
        unique.append(keeper)
        skipped += [(r.where, f"duplicate of {keeper.where}") for r in same if r is not keeper]
    order = {id(run): i for i, run in enumerate(kept)}
    unique.sort(key=lambda run: order[id(run)])
    return unique, skipped


def _load_run_dir(path: Path) -> Run:
    config = read_json(path / CONFIG)
    metrics = read_json(path / METRICS)
    if not isinstance(config, dict) or not isinstance(metrics, dict) or not metrics:
        raise ValueError("config.json and metrics.json must hold JSON objects, metrics non-empty")
    history = read_history((path / HISTORY).read_text())
    name = str(config.get("run_name") or path.name)
    return Run(name, config, _numeric(metrics), history, source=str(path))


def read_history(text: str) -> dict[str, np.ndarray]:
    """history.csv -> {column: float array}; empty cells become NaN; rows sorted by epoch.

    The project's one reader of history.csv (run.py only writes it, PKG/runs.py).
    """
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or "epoch" not in rows[0]:
        raise ValueError("history.csv has no header with an 'epoch' column")
    header, body = rows[0], [r for r in rows[1:] if r]
    if any(len(r) != len(header) for r in body):
        raise ValueError("history.csv has rows of the wrong length")
    # float('') fails: map empty cells to NaN explicitly, let any other junk raise ValueError.
    data = np.array([[float(c) if c else math.nan for c in r] for r in body], dtype=float)
    data = data.reshape(len(body), len(header))
    data = data[np.argsort(data[:, header.index("epoch")], kind="stable")]
    return {col: data[:, j] for j, col in enumerate(header)}


def _numeric(metrics: dict) -> dict[str, float]:
    """The numeric entries (bool is not a number here: it is a flag)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


# ----------------------------------------------------------------------------------------------
# Loading from MLflow
# ----------------------------------------------------------------------------------------------


def load_runs_from_mlflow(
    tracking_uri: str, experiment: str
) -> tuple[list[Run], list[tuple[str, str]]]:
    """The same as `load_runs`, from an MLflow experiment (imports mlflow: slow, ~2 s).

    Mapping (what run.py logs, see PKG/tracking.py): every config key is a param (strings,
    parsed back to numbers/bools/lists where they look like one); per-epoch metrics carry the
    history.csv column names with step = epoch; final metrics carry the metrics.json names.
    FINISHED runs are done; RUNNING/SCHEDULED/KILLED are unfinished; FAILED are failed. When
    several finished runs share a config *and* seed (a re-run with --fresh), the newest wins and
    the others are reported as duplicates (`settle`).
    Raises LookupError when the experiment does not exist.
    """
    from mlflow.tracking import MlflowClient  # lazy: keeps `python plot.py` fast

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
    mlflow_runs, token = [], None
    while True:
        page = client.search_runs(
            [exp.experiment_id], max_results=1000, page_token=token, order_by=["start_time DESC"]
        )
        mlflow_runs.extend(page)
        token = page.token
        if not token:
            break

    runs: list[Run] = []
    skipped: list[tuple[str, str]] = []
    for mr in mlflow_runs:  # newest first
        name = mr.data.tags.get("mlflow.runName") or mr.info.run_id
        status = mr.info.status
        if status != "FINISHED":
            skipped.append((name, "failed" if status == "FAILED" else "unfinished"))
            continue
        config = {k: _parse_param(v) for k, v in mr.data.params.items()}
        config.setdefault("run_name", name)
        run = Run(str(config["run_name"]), config, {}, {}, source=mr.info.run_id)
        logged = mr.data.metrics
        finals = [m for m in logged if m in METRIC_NAMES or is_task_metric(m)]
        run.metrics = {m: float(logged[m]) for m in finals}
        columns = [c for c in logged if _is_history_column(c)]
        run.history = _mlflow_history(client, mr.info.run_id, columns)
        runs.append(run)
    runs, unsettled = settle(runs)  # newest first: the newest of duplicates stays
    runs.reverse()  # oldest first, like the sorted directory listing
    return runs, skipped + unsettled


def _is_history_column(name: str) -> bool:
    """history.csv's columns: the released ones, and train_/val_<metric> of any task."""
    if name in HISTORY_FIELDS:
        return True
    return name.startswith(("train_", "val_")) and name not in METRIC_NAMES  # not train_time_s


def _mlflow_history(client, run_id: str, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-epoch metric histories aligned on step (= epoch); the last value logged per step wins.

    run.py also logs the final metrics, with step = total optimizer steps; one of them shares its
    name with a history column (samples_per_sec). So the epochs are the steps of the columns that
    only exist per epoch (val_acc, ...), and other steps of a shared name are ignored.
    """
    series = {}
    for col in columns:
        if col in ("epoch", "step"):
            continue
        points = sorted(client.get_metric_history(run_id, col), key=lambda m: m.timestamp)
        series[col] = {m.step: m.value for m in points}
    per_epoch = [steps for col, steps in series.items() if col not in METRIC_NAMES]
    epochs = sorted(set().union(*(per_epoch or series.values()))) if series else []
    history = {"epoch": np.asarray(epochs, dtype=float)}
    for col, by_step in series.items():
        history[col] = np.array([by_step.get(e, math.nan) for e in epochs], dtype=float)
    return history


SYSTEM_PREFIX = "system/"  # MLflow's system metrics: system/gpu_0_utilization_percentage, ...


def load_system_metrics(tracking_uri: str, run_id: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One run's system metrics (MLflow samples them in the background while the run is active):
    name without `system/` -> (seconds since the run's first sample, values), in time order.
    {} when none were recorded. Raises LookupError for an unknown run (imports mlflow)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        names = [k for k in client.get_run(run_id).data.metrics if k.startswith(SYSTEM_PREFIX)]
    except MlflowException as e:
        raise LookupError(f"no MLflow run {run_id!r} at {tracking_uri}") from e
    histories = {name: client.get_metric_history(run_id, name) for name in names}
    start = min((m.timestamp for h in histories.values() for m in h), default=0)
    series = {}
    for name, history in sorted(histories.items()):
        points = sorted((m.timestamp, m.value) for m in history)
        t = np.array([(ts - start) / 1000 for ts, _ in points], dtype=float)
        series[name.removeprefix(SYSTEM_PREFIX)] = (t, np.array([v for _, v in points], float))
    return series


def _parse_param(text: str):
    """MLflow params are strings: '0.01' -> 0.01, 'True' -> True, '[1, 2]' -> [1, 2]."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)  # Python reprs: True, None, ['a', 'b']
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


# ----------------------------------------------------------------------------------------------
# Aggregation over seeds
# ----------------------------------------------------------------------------------------------


def _hashable(value):
    """Config values as dictionary keys (lists and dicts via their JSON)."""
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    return value


def _sort_key(value):
    """Order mixed values: None, then numbers numerically, then everything else as text."""
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (1, float(value), "")
    return (2, 0.0, str(value))


def format_value(value) -> str:
    """Short text for a hyperparameter value: 0.001 -> '0.001', 1e-05 -> '1e-05', True -> 'True'."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def aggregate(runs: Iterable[Run]) -> Table:
    """Group runs by configuration (all experiment keys but seed); mean, SE and n per metric.

    `runs` as `load_runs` returns them (settled: see `settle`). n per metric counts the finite
    values only; each non-finite value dropped is listed in `Table.dropped`.
    """
    runs = list(runs)
    key_order: list[str] = []
    for run in runs:
        key_order += [k for k in run.experiment_keys if k != SEED_KEY and k not in key_order]
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        ident = tuple(_hashable(run.config.get(k)) for k in key_order)
        groups.setdefault(ident, []).append(run)

    # Swept = takes more than one value over the configurations; the rest is constant.
    swept = [i for i, _ in enumerate(key_order) if len({g[i] for g in groups}) > 1]
    keys = [key_order[i] for i in swept]
    constant = {} if not groups else {
        k: next(iter(groups))[i] for i, k in enumerate(key_order) if i not in swept
    }  # fmt: skip

    present = {m for r in runs for m in r.metrics}
    task_metrics = sorted((m for m in present if is_task_metric(m)), key=_task_metric_order)
    metrics = task_metrics + [m for m in METRIC_NAMES if m in present]
    metrics += sorted(present - set(metrics))

    rows = []
    dropped = []
    for members in groups.values():
        # The original (unhashed) values of the first member: a list stays a list for display.
        values = tuple(members[0].config.get(key_order[i]) for i in swept)
        # None: an argument this row's model does not take (logreg has no width): not shown.
        shown = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
        label = ", ".join(f"{k}={format_value(v)}" for k, v in shown)
        members.sort(key=lambda r: _sort_key(r.config.get(SEED_KEY)))
        row = Row(values, label or "all runs", members)
        for m in metrics:
            values = [r.metrics.get(m, math.nan) for r in members]
            row.mean[m], row.se[m] = mean_se(values)
            row.count[m] = int(np.isfinite(values).sum())
            dropped += [(r.where, m, r.metrics[m]) for r in members
                        if m in r.metrics and not math.isfinite(r.metrics[m])]  # fmt: skip
        rows.append(row)
    rows.sort(key=lambda row: tuple(_sort_key(_hashable(v)) for v in row.values))
    table = Table(keys, metrics, rows, constant, dropped, monitored(runs))
    for row in rows:
        row.fewer_seeds = row.n < table.max_n
    return table


def _task_metric_order(name: str) -> tuple:
    """best_* first, test_<metric> by name, test_loss last: best_val_acc, test_acc, test_loss."""
    return (not name.startswith("best_"), name == "test_loss", name)


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (ddof=1) of the finite values; SE is NaN for fewer than two."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan
    se = float(np.std(x, ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    return float(np.mean(x)), se


def curve(
    row: Row, column: str = DEFAULT_MONITOR
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(epochs, mean, se, n) of one history column over a configuration's seeds.

    Runs are aligned on the epoch number. Seeds that stopped early (early stopping) simply drop
    out of the later epochs, so n can shrink along the curve; SE is NaN where n < 2.
    """
    parts = [(r.history["epoch"], r.history[column]) for r in row.runs if column in r.history]
    if not parts:
        empty = np.empty(0)
        return empty, empty, empty, empty
    epochs = np.unique(np.concatenate([e for e, _ in parts]))
    grid = np.full((len(parts), epochs.size), np.nan)
    for i, (e, v) in enumerate(parts):
        grid[i, np.searchsorted(epochs, e)] = v
    n = np.isfinite(grid).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nansum(grid, axis=0) / n
        dev = np.where(np.isfinite(grid), grid - mean, 0.0)
        se = np.sqrt((dev**2).sum(axis=0) / (n - 1)) / np.sqrt(n)
    se[n < 2] = np.nan
    return epochs, mean, se, n


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def _records(table: Table) -> tuple[list[str], list[list]]:
    header = [*table.keys, "n", "seeds", "fewer_seeds"]
    header += [f"{m}_{s}" for m in table.metrics for s in ("mean", "se", "n")]
    records = []
    for row in table.rows:
        rec = [*row.values, row.n, " ".join(format_value(s) for s in row.seeds), row.fewer_seeds]
        for m in table.metrics:
            rec += [row.mean[m], row.se[m], row.count[m]]
        records.append(rec)
    return header, records


def table_csv(table: Table) -> str:
    """The aggregate as CSV text: swept keys, n, seeds, fewer_seeds, then <metric>_mean,
    <metric>_se and <metric>_n (finite values: smaller than n where a value was dropped)."""
    header, records = _records(table)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for rec in records:
        writer.writerow(["" if _is_nan(v) else _csv_cell(v) for v in rec])
    return buf.getvalue()


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _csv_cell(value):
    if isinstance(value, float):
        return f"{value:.12g}"  # 0.72, not 0.7200000000000001
    if isinstance(value, list | dict):
        return json.dumps(value)
    return value


_LATEX_SPECIAL = [
    ("\\", r"\textbackslash "), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
    ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde "), ("^", r"\^ "),
]  # fmt: skip


def latex_escape(text: str) -> str:
    # One pass, character by character, so an escape's own backslash is not escaped again.
    special = dict(_LATEX_SPECIAL)
    return "".join(special.get(ch, ch) for ch in str(text))


def format_mean_se(mean: float, se: float) -> str:
    """'$0.912 \\pm 0.004$': the mean rounded to the SE's second significant digit."""
    if math.isnan(mean):
        return "--"
    if math.isnan(se) or se == 0:
        return f"${mean:.4g}$"
    decimals = min(6, max(0, 1 - math.floor(math.log10(se))))
    return f"${mean:.{decimals}f} \\pm {se:.{decimals}f}$"


def table_latex(table: Table, metrics: Sequence[str] | None = None) -> str:
    """A booktabs `tabular` (\\usepackage{booktabs}): keys, n, mean +- SE of a few metrics
    (default: the task's metrics, then LATEX_METRICS)."""
    if metrics is None:
        metrics = [m for m in table.metrics if is_task_metric(m)] + list(LATEX_METRICS)
    metrics = [m for m in metrics if m in table.metrics]
    columns = [*table.keys, "n", *metrics]
    align = "l" * len(table.keys) + "r" * (1 + len(metrics))
    lines = [
        "% Generated by plot.py from the aggregate over seeds: mean $\\pm$ standard error.",
        "% Needs \\usepackage{booktabs}. The CSV beside this file has every metric.",
        "\\begin{tabular}{" + align + "}",
        "\\toprule",
        " & ".join(latex_escape(c) for c in columns) + " \\\\",
        "\\midrule",
    ]
    for row in table.rows:
        cells = [latex_escape(format_value(v)) for v in row.values]
        cells.append(f"{row.n}" + ("$^\\dagger$" if row.fewer_seeds else ""))
        cells += [format_mean_se(row.mean[m], row.se[m])
                  + ("$^\\ddagger$" if row.count[m] < row.n else "")
                  for m in metrics]  # fmt: skip
        lines.append(" & ".join(cells) + " \\\\")
    lines.append("\\bottomrule")
    notes = []
    if any(row.fewer_seeds for row in table.rows):
        notes.append("$^\\dagger$ fewer seeds than the other configurations")
    if any(row.count[m] < row.n for row in table.rows for m in metrics):
        notes.append("$^\\ddagger$ over the finite values only (their n: aggregate.csv)")
    notes = ["\\multicolumn{" + str(len(columns)) + "}{l}{\\footnotesize " + note + "}"
             for note in notes]  # fmt: skip
    lines += [" \\\\\n".join(notes)] if notes else []
    lines.append("\\end{tabular}")
    return "\n".join(lines) + "\n"


def write_tables(table: Table, out_dir: str | os.PathLike, stem: str = "aggregate") -> list[Path]:
    """`<out_dir>/<stem>.csv` and `<stem>.tex`, written atomically; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.csv", out / f"{stem}.tex"]
    atomic_write_text(paths[0], table_csv(table))
    atomic_write_text(paths[1], table_latex(table))
    return paths
