"""Load a sweep's runs and aggregate them over seeds (pandas): what plot.py and notebooks read.

    from labrun.analysis import load_runs, aggregate
    runs, skipped = load_runs("results/sweep")
    table = aggregate(runs)
    table.stats[["test_acc_mean", "test_acc_se", "test_acc_n"]]   # one row per configuration

No torch and no matplotlib here. Metric names come from the task: metrics.json has
`best_<monitor>`, `test_<metric>` and `test_loss`; history.csv `train_<metric>`, `val_<metric>`;
config.json `monitored` (the history column early stopping followed). Runs written before tasks
have none of these keys: they are classification runs monitored on `val_acc`.

Sources: `<results>/<run>/{config.json, metrics.json, history.csv, status}` as run.py writes them,
or an MLflow experiment (`load_runs_from_mlflow`). A run is *done* iff its metrics.json parses to
a non-empty JSON object. Every run left out is returned in `skipped` with its reason:
- `unfinished`, `failed` (no metrics.json), `corrupt` (a file missing or unparsable);
- a config.json without `experiment_keys`: we cannot tell which keys define the experiment;
- duplicates (same experiment keys *and* seed, e.g. a copied run directory) count once: the one
  whose directory name is its run name stays (equal numbers: else the first), the others are
  `duplicate of ...` (`with other numbers (test_acc 0.91 vs 0.93)`); with other numbers and not
  exactly one such record, all are left out, `conflicts with ...`.
A key that older runs lack (a flag added since) takes its default from run.py's current parser,
so those runs join the configuration they belong to (`RunResult.defaulted`).

Statistics: a *configuration* is the tuple of experiment keys except `seed`; its runs are its
seeds. Rows come in the sweep's order (of each configuration's first start: run.log's first line,
MLflow's start time; run.sh starts its jobs in its job order), ties by the swept values. Per
metric (and per derived column: `train_acc@final`, `train_acc@best`, `train_acc>=0.9`, see
`column_value`): mean, SE = s / sqrt(n) (sample standard deviation, ddof=1: pandas' `sem`) and
n = the number of *finite* values: a NaN or inf of a diverged seed is never averaged nor counted,
and is listed in `Table.dropped`. With n = 1 the SE is NaN (an empty CSV cell, no error bar),
never a misleading 0. A configuration with fewer seeds than the most any has is `fewer_seeds`.
"""

from __future__ import annotations

import ast
import datetime
import io
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .runs import (
    CONFIG,
    HISTORY,
    HISTORY_FIELDS,
    LOG,
    METRICS,
    STATUS,
    atomic_write_text,
    read_json,
    read_status,
)

# metrics.json's keys that every task writes; a table lists the task's own first.
METRIC_NAMES = (
    "best_epoch", "epochs_run", "steps", "wall_time_s", "train_time_s", "compile_time_s",
    "samples_per_sec", "peak_mem_bytes", "tested_epoch",
)  # fmt: skip
SEED_KEY = "seed"
DEFAULT_MONITOR = "val_acc"  # runs written before tasks: classification, early-stopped on it
RESULT_NAMES = ("best_epoch", "tested_epoch", "epochs_run", "steps")  # compared in duplicates
TIME_METRIC = "wall_time_s"  # with the test metrics in the default table


def is_task_metric(name: str) -> bool:
    """best_<monitor>, test_<metric>, test_loss: the metrics.json names the task gives."""
    return name.startswith(("best_val_", "test_"))


def final_metric(monitor: str) -> str:
    """The metrics.json name of a monitored column's test value: val_acc -> test_acc."""
    return "test_" + monitor.removeprefix("val_")


@dataclass
class RunResult:
    """One finished run: its resolved config, final metrics and per-epoch history."""

    name: str
    config: dict
    metrics: dict[str, float]  # numeric entries of metrics.json
    history: dict[str, np.ndarray]  # history.csv column -> values, one per epoch
    source: str = ""  # run directory or MLflow run id
    defaulted: dict = field(default_factory=dict)  # keys this run lacked -> the parser's default
    started: float = math.nan  # when it first started (s since the epoch): the sweep's order

    @property
    def experiment_keys(self) -> list[str]:
        keys = self.config.get("experiment_keys")
        ok = isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)
        return keys if ok else []

    @property
    def where(self) -> str:
        """How warnings name the run: its directory's name, or its MLflow run name."""
        return Path(self.source).name if Path(self.source).is_dir() else self.name

    @property
    def monitor(self) -> str:
        """config.json `monitored`, else the metric named best_<monitor> (MLflow), else val_acc."""
        best = [m.removeprefix("best_") for m in self.metrics if m.startswith("best_val_")]
        return self.config.get("monitored") or (best[0] if best else DEFAULT_MONITOR)


def by_monitor(runs: Iterable[RunResult]) -> dict[str, list[RunResult]]:
    """Runs grouped by the metric they were early-stopped on (one task each), largest first."""
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(run.monitor, []).append(run)
    return dict(sorted(groups.items(), key=lambda item: -len(item[1])))


# ---- loading ----------------------------------------------------------------------------------


def load_runs(results_dir: str | os.PathLike) -> tuple[list[RunResult], list[tuple[str, str]]]:
    """Every finished run under `results_dir`, and (name, reason) of each one left out.
    Sub-directories with none of the run files are ignored; a missing directory has no runs."""
    root = Path(results_dir)
    runs: list[RunResult] = []
    skipped: list[tuple[str, str]] = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        names = (CONFIG, METRICS, HISTORY, STATUS)
        if path.name.startswith(".") or not any((path / n).is_file() for n in names):
            continue
        if not (path / METRICS).is_file():
            skipped.append((path.name, "failed" if read_status(path) == "failed" else "unfinished"))
            continue
        try:
            config, metrics = read_json(path / CONFIG), read_json(path / METRICS)
            if not isinstance(config, dict) or not isinstance(metrics, dict) or not metrics:
                raise ValueError("config.json and metrics.json must be non-empty JSON objects")
            history = read_history((path / HISTORY).read_text())
        except (OSError, ValueError, TypeError, UnicodeDecodeError):
            skipped.append((path.name, "corrupt"))
            continue
        name = str(config.get("run_name") or path.name)
        started = first_log_time(path / LOG)
        runs.append(RunResult(name, config, _numeric(metrics), history, str(path), started=started))
    runs, unsettled = settle(runs)
    return runs, skipped + unsettled


def first_log_time(log: Path) -> float:
    """When run.log's first line was written (its run's first start), else NaN."""
    try:
        with open(log, "rb") as f:
            stamp = f.read(19).decode()
        return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
    except (OSError, ValueError):
        return math.nan


def read_history(text: str) -> dict[str, np.ndarray]:
    """history.csv -> {column: float array}, rows sorted by epoch, empty cells NaN (ValueError
    when it is no table of numbers). The one reader of history.csv."""
    frame = pd.read_csv(io.StringIO(text))
    if "epoch" not in frame.columns:
        raise ValueError("history.csv has no header with an 'epoch' column")
    frame = frame.astype(float).sort_values("epoch", kind="stable")
    return {column: frame[column].to_numpy() for column in frame.columns}


def parser_defaults() -> dict:
    """run.py's current defaults of every flag (no torch), as declared: parsing nothing would
    also settle the job flags (config.Parser: a bad LAB_TRACKING exits), which no table needs."""
    from .config import build_parser

    return {a.dest: a.default for a in build_parser()._actions if a.dest != "help"}


def settle(runs: Sequence[RunResult]) -> tuple[list[RunResult], list[tuple[str, str]]]:
    """The runs that count and (run, reason) for the others: see the module docstring."""
    kept = [run for run in runs if run.experiment_keys]
    skipped = [(r.where, "no experiment_keys in its config") for r in runs if not r.experiment_keys]
    keys = sorted({k for run in kept for k in run.experiment_keys})
    defaults = parser_defaults() if any(k not in r.config for r in kept for k in keys) else {}
    for run in kept:
        for key in keys:
            if key not in run.config and key in defaults:
                run.config[key] = run.defaulted[key] = defaults[key]
    by_identity: dict[str, list[RunResult]] = {}
    for run in kept:
        identity = json.dumps({k: _hashable(run.config.get(k)) for k in keys}, sort_keys=True)
        by_identity.setdefault(identity, []).append(run)
    dropped: set[int] = set()
    for same in by_identity.values():
        owners = [r for r in same if r.where == r.name]  # at the path run.py gives its identity
        keeper = owners[0] if owners else same[0]
        conflicts = [(r, d) for r in same if (d := differences(keeper, r))]
        if conflicts and len(owners) != 1:  # no record to prefer: which is right is unknown
            other, first = conflicts[0]
            skipped += [(keeper.where, f"conflicts with {other.where} ({first})")]
            skipped += [(r.where, f"conflicts with {keeper.where} ({d})") for r, d in conflicts]
            dropped |= {id(r) for r in same}
            continue
        other = dict((id(r), f" with other numbers ({d})") for r, d in conflicts)
        skipped += [(r.where, f"duplicate of {keeper.where}{other.get(id(r), '')}")
                    for r in same if r is not keeper]  # fmt: skip
        dropped |= {id(r) for r in same if r is not keeper}
    return [run for run in kept if id(run) not in dropped], skipped


def differences(a: RunResult, b: RunResult) -> str:
    """The first result of metrics.json in which two runs differ (`test_acc 0.91 vs 0.93`), ""
    when all are equal (times, memory and ids are the machine's, not results)."""
    for name in sorted({*a.metrics, *b.metrics}):
        x, y = a.metrics.get(name), b.metrics.get(name)
        same = x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))
        if (is_task_metric(name) or name in RESULT_NAMES) and not same:
            return f"{name} {x:.6g} vs {y:.6g}" if None not in (x, y) else f"{name} in one only"
    return ""


def _numeric(metrics: dict) -> dict[str, float]:
    """The numeric entries (not bools); a null that `null_reasons` says was not finite is NaN
    again, so aggregate() names it dropped."""
    numbers = {k: float(v) for k, v in metrics.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
    reasons = metrics.get("null_reasons")
    nulls = [k for k in reasons if metrics.get(k) is None] if isinstance(reasons, dict) else []
    return numbers | dict.fromkeys(nulls, math.nan)


def load_runs_from_mlflow(tracking_uri: str, experiment: str) -> tuple[list[RunResult], list]:
    """`load_runs` from an MLflow experiment (as mirror.py writes it): FINISHED runs are done,
    FAILED failed, the rest unfinished; among duplicates the newest stays. LookupError when the
    experiment does not exist."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
    found, token = [], None
    while True:  # newest first, a page at a time
        page = client.search_runs([exp.experiment_id], order_by=["start_time DESC"],
                                  max_results=1000, page_token=token)  # fmt: skip
        found += page
        if not (token := page.token):
            break
    runs, skipped = [], []
    for mr in found:  # newest first, so settle() keeps the newest of duplicates
        name = mr.data.tags.get("mlflow.runName") or mr.info.run_id
        if mr.info.status != "FINISHED":
            skipped.append((name, "failed" if mr.info.status == "FAILED" else "unfinished"))
            continue
        config = {k: _parse_param(v) for k, v in mr.data.params.items()}
        logged = mr.data.metrics
        metrics = {m: float(v) for m, v in logged.items() if m in METRIC_NAMES or is_task_metric(m)}
        columns = [c for c in logged if c in HISTORY_FIELDS or c.startswith(("train_", "val_"))]
        history = _mlflow_history(client, mr.info.run_id, columns)
        started = mr.info.start_time / 1000 if mr.info.start_time else math.nan
        runs.append(RunResult(str(config.get("run_name", name)), config, metrics, history,
                        mr.info.run_id, started=started))  # fmt: skip
    runs, unsettled = settle(runs)
    return runs[::-1], skipped + unsettled


def _mlflow_history(client, run_id: str, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Histories aligned on step = epoch. The final metrics are logged at step = total steps,
    and samples_per_sec is one of both: the epochs are the steps of the per-epoch-only names."""
    series = {}
    for col in (c for c in columns if c not in ("epoch", "step", *METRIC_NAMES[1:4])):
        points = sorted(client.get_metric_history(run_id, col), key=lambda m: m.timestamp)
        series[col] = pd.Series({m.step: m.value for m in points}, dtype=float)
    frame = pd.DataFrame(series)
    per_epoch = [c for c in frame.columns if c not in METRIC_NAMES]
    frame = frame.dropna(how="all", subset=per_epoch or None).rename_axis("epoch").reset_index()
    return {column: frame[column].to_numpy(dtype=float) for column in frame.columns}


def load_system_metrics(tracking_uri: str, run_id: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One run's MLflow system metrics: name without `system/` -> (seconds since the run's first
    sample, values). {} when none were recorded; LookupError for an unknown run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        names = [k for k in client.get_run(run_id).data.metrics if k.startswith("system/")]
    except MlflowException as e:
        raise LookupError(f"no MLflow run {run_id!r} at {tracking_uri}") from e
    points = {n: sorted((m.timestamp, m.value) for m in client.get_metric_history(run_id, n))
              for n in names}  # fmt: skip
    start = min((t for p in points.values() for t, _ in p), default=0)
    return {name.removeprefix("system/"): (np.array([(t - start) / 1000 for t, _ in p]),
                                           np.array([v for _, v in p], dtype=float))
            for name, p in sorted(points.items())}  # fmt: skip


def _parse_param(text: str):
    """MLflow params are strings: '0.01' -> 0.01, 'True' -> True, '[1, 2]' -> [1, 2]."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


# ---- aggregation over seeds -------------------------------------------------------------------


def _hashable(value):
    # A tuple default (--crop-scale's) is a list once in config.json: the same value either way.
    return json.dumps(value, sort_keys=True) if isinstance(value, list | tuple | dict) else value


def _sort_key(value):
    """Mixed values in order: None, numbers numerically, then the rest as text."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (0, 0.0, "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (1, float(value), "")
    return (2, 0.0, str(value))


def format_value(value) -> str:
    """0.001 -> '0.001', 1e-05 -> '1e-05', True -> 'True'."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def is_numeric(values: Iterable) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


# A column of a table: a metrics.json name, or a history column at an epoch (`train_acc@final`,
# `train_acc@best`: at metrics.json's best_epoch), or the first epoch where it crosses a threshold
# (`train_acc>=0.99`, `val_loss<=0.1`: NaN for a run that never does).
DERIVED = re.compile(r"(?P<column>\w+)(?:@(?P<at>final|best)|(?P<op>>=|<=)(?P<threshold>.+))")


def column_value(run: RunResult, spec: str) -> float:
    """A derived column's value for one run (see DERIVED); NaN where its history lacks it."""
    found = DERIVED.fullmatch(spec)
    values, epochs = run.history.get(found["column"]), run.history.get("epoch")
    if values is None or epochs is None or not len(values):
        return math.nan
    if found["at"] == "final":
        return float(values[-1])
    if found["at"] == "best":
        at = values[epochs == run.metrics.get("best_epoch", math.nan)]
        return float(at[0]) if len(at) else math.nan
    threshold = float(found["threshold"])
    crossed = values >= threshold if found["op"] == ">=" else values <= threshold
    return float(epochs[crossed][0]) if crossed.any() else math.nan


def is_crossing(spec: str) -> bool:
    """`train_acc>=0.99`: NaN means "never reached", not a diverged value."""
    return bool((found := DERIVED.fullmatch(spec)) and found["op"])


def default_columns(metrics: Sequence[str]) -> list[str]:
    """What a table shows unless the owner names its columns: the test metrics and the time."""
    return [m for m in metrics if m.startswith("test_")] + [TIME_METRIC] * (TIME_METRIC in metrics)


def readable(name: str, labels: dict[str, str] | None = None) -> str:
    """An axis or table label for any column: `labels` (plot.py's LABELS) where it has one,
    else derived from the name: train_acc -> "train accuracy", wall_time_s -> "wall time (s)",
    train_acc@final -> "train accuracy (final epoch)", train_acc>=0.9 -> "first epoch train
    accuracy ≥ 0.9"."""
    if labels and name in labels:
        return labels[name]
    if found := DERIVED.fullmatch(name):
        column = readable(found["column"], labels)
        if found["at"]:
            return f"{column} ({found['at']} epoch)"
        return f"first epoch {column} {'≥' if found['op'] == '>=' else '≤'} {found['threshold']}"
    words = [w for w in name.split("_") if w]
    unit = UNITS.get(words[-1]) if len(words) > 1 else None
    words = [WORDS.get(w, w) for w in (words[:-1] if unit else words)]
    return " ".join(words + [unit] * bool(unit)) or name


WORDS = {"acc": "accuracy", "val": "val.", "lr": "learning rate", "mse": "MSE", "mae": "MAE",
         "rmse": "RMSE", "r2": "R²", "per": "/", "sec": "s", "mem": "memory"}  # fmt: skip
UNITS = {"s": "(s)", "bytes": "(bytes)", "pct": "(%)"}


@dataclass
class Table:
    """The aggregate: `stats` has one row per configuration (index: its label, sorted by the
    swept values): the swept keys, n, seeds, fewer_seeds, and <metric>_mean, _se, _n."""

    keys: list[str]  # swept: experiment keys (not seed) whose values differ
    metrics: list[str]  # numeric metrics present in any run
    stats: pd.DataFrame
    runs: list[RunResult]
    configs: list[str]  # the label of each run's configuration, in `runs` order
    constant: dict = field(default_factory=dict)  # experiment keys shared by every run
    dropped: list[tuple[str, str, float]] = field(default_factory=list)  # (run, metric, value)
    monitor: str = DEFAULT_MONITOR
    columns: list[str] = field(default_factory=list)  # the paper table's (aggregate.tex)
    never: list[tuple[str, str]] = field(default_factory=list)  # (run, crossing never reached)

    @property
    def categorical(self) -> list[str]:
        """Swept keys with a value that is no number (model, dataset, ...)."""
        return [k for k in self.keys if not is_numeric(self.stats[k])]

    def per_run(self, metric: str) -> pd.Series:
        """One metric of every run, indexed by its configuration's label."""
        return pd.Series([r.metrics.get(metric, math.nan) for r in self.runs], self.configs)


def aggregate(runs: Iterable[RunResult], columns: Sequence[str] = ()) -> Table:
    """Group runs by configuration (every experiment key but seed); mean, SE and n per metric
    and per derived column of `columns` (the paper table's: default_columns() when empty)."""
    runs = list(runs)
    order = list(dict.fromkeys(k for r in runs for k in r.experiment_keys if k != SEED_KEY))
    keyed = pd.DataFrame([[_hashable(r.config.get(k)) for k in order] for r in runs], columns=order)
    keys = [k for k in order if keyed[k].nunique(dropna=False) > 1]
    constant = {k: runs[0].config.get(k) for k in order if k not in keys}
    # None: an argument this run's model does not take (logreg has no width): not shown.
    configs = [", ".join(f"{k}={format_value(r.config[k])}" for k in keys
                         if r.config.get(k) is not None) or "all runs" for r in runs]  # fmt: skip
    present = {m for r in runs for m in r.metrics}
    metrics = sorted((m for m in present if is_task_metric(m)),
                     key=lambda m: (not m.startswith("best_"), m == "test_loss", m))  # fmt: skip
    metrics += [m for m in METRIC_NAMES if m in present]
    metrics += sorted(present - set(metrics))
    columns = list(columns) or default_columns(metrics)
    derived = [c for c in columns if c not in metrics and DERIVED.fullmatch(c)]
    rows = [r.metrics | {c: column_value(r, c) for c in derived} for r in runs]
    metrics += derived
    values = pd.DataFrame(rows, columns=metrics, dtype=float)
    finite = values.where(np.isfinite(values))
    never = [(r.where, c) for r, row in zip(runs, rows, strict=True) for c in derived
             if is_crossing(c) and math.isnan(row[c])]  # fmt: skip
    dropped = [(r.where, m, row[m]) for r, row in zip(runs, rows, strict=True) for m in metrics
               if m in row and not math.isfinite(row[m]) and (r.where, m) not in never]  # fmt: skip
    stats = finite.groupby(configs, sort=False).agg(["mean", "sem", "count"])
    stats.columns = [f"{m}_{ {'sem': 'se', 'count': 'n'}.get(s, s) }" for m, s in stats.columns]
    groups = keyed.assign(seed=[r.config.get(SEED_KEY) for r in runs]).groupby(configs, sort=False)
    head = groups.first()[keys].map(lambda v: json.loads(v) if isinstance(v, str) and
                                    v[:1] in "[{" else v)  # fmt: skip
    head["n"] = groups.size()
    head["seeds"] = groups["seed"].agg(
        lambda s: " ".join(map(format_value, sorted(s, key=_sort_key)))
    )
    head["fewer_seeds"] = head["n"] < head["n"].max()
    stats = pd.concat([head, stats], axis=1)
    # the sweep's order: each configuration's first start (unknown: last), then its values
    started = pd.Series([r.started for r in runs]).groupby(configs, sort=False).min()
    order_rows = sorted(stats.index, key=lambda c: [
        started[c] if math.isfinite(started[c]) else math.inf,
        *(_sort_key(_hashable(stats.at[c, k])) for k in keys)])  # fmt: skip
    stats = stats.loc[order_rows]
    monitor = Counter(r.monitor for r in runs).most_common(1)[0][0] if runs else DEFAULT_MONITOR
    return Table(keys, metrics, stats, runs, configs, constant, dropped, monitor, columns, never)


def in_order(table: Table, order: Sequence) -> Table:
    """`table` with the configurations that have a value named in `order` first, in its order
    (plot.py's ORDER); the others after them, as they were (the sweep's order)."""
    named = {format_value(v): i for i, v in enumerate(order)}
    rank = {c: min((named.get(format_value(table.stats.at[c, k]), len(named)) for k in table.keys),
                   default=len(named)) for c in table.stats.index}  # fmt: skip
    table.stats = table.stats.loc[sorted(table.stats.index, key=rank.get)]  # stable: ties kept
    return table


def curves(table: Table, column: str) -> pd.DataFrame:
    """Mean, se and n of a history column per configuration and epoch (columns config, epoch,
    mean, se, n: the finite values; runs: the seeds that trained the epoch). Seeds that stopped
    early drop out of the later epochs, so runs can shrink; a NaN (an eval that diverged)
    lowers only n."""
    parts = [
        pd.DataFrame({"epoch": r.history["epoch"], "value": r.history[column], "config": c})
        for r, c in zip(table.runs, table.configs, strict=True)
        if column in r.history
    ]
    if not parts:
        return pd.DataFrame(columns=["config", "epoch", "mean", "se", "n", "runs"])
    long = pd.concat(parts).replace([np.inf, -np.inf], np.nan)
    grouped = long.groupby(["config", "epoch"], sort=False)["value"]
    return grouped.agg(mean="mean", se="sem", n="count", runs="size").reset_index()


def comparison(table: Table, metric: str) -> tuple[str, pd.DataFrame] | None:
    """(row key, the final `metric` as row value x condition: columns (condition, mean|se|n)),
    when a categorical key is swept; the row key is `model` if swept, else the first one."""
    if not table.categorical or f"{metric}_mean" not in table.stats:
        return None
    row_key = "model" if "model" in table.categorical else table.categorical[0]
    others = [k for k in table.keys if k != row_key]
    s = table.stats
    long = pd.DataFrame({
        "row": s[row_key].map(format_value),
        "condition": [", ".join(f"{k}={format_value(s.at[c, k])}" for k in others) or metric
                      for c in s.index],
        "mean": s[f"{metric}_mean"], "se": s[f"{metric}_se"], "n": s[f"{metric}_n"],
    })  # fmt: skip
    wide = long.pivot(index="row", columns="condition", values=["mean", "se", "n"])
    wide = wide.swaplevel(axis=1)[list(dict.fromkeys(long["condition"]))]
    return row_key, wide.loc[list(dict.fromkeys(long["row"]))]


# ---- tables and warnings ----------------------------------------------------------------------


def table_csv(table: Table, columns: Sequence[str] | None = None) -> str:
    """aggregate.csv: swept keys, n, seeds, fewer_seeds, then <metric>_mean, _se, _n; with
    `columns`, table.csv (the paper table's numbers): swept keys, n, then theirs only."""
    stats = table.stats
    if columns is not None:
        fields = [f"{c}_{part}" for c in columns for part in ("mean", "se", "n")]
        stats = stats[[*table.keys, "n", *fields]]
    stats = stats.map(lambda v: json.dumps(v) if isinstance(v, list | dict) else v)
    return stats.to_csv(index=False, float_format="%.12g", lineterminator="\n")


LATEX_SPECIAL = {c: "\\" + c for c in "&%$#_{}"}
LATEX_SPECIAL |= {"\\": r"\textbackslash ", "~": r"\textasciitilde ", "^": r"\^ "}


def latex_escape(text) -> str:
    return "".join(LATEX_SPECIAL.get(ch, ch) for ch in str(text))


def format_mean_se(mean: float, se: float) -> str:
    """'$0.912 \\pm 0.004$': the mean rounded to the SE's second significant digit."""
    if not math.isfinite(mean):
        return "--"
    if not math.isfinite(se) or se == 0:
        return f"${mean:.4g}$"
    decimals = min(6, max(0, 1 - math.floor(math.log10(se))))
    return f"${mean:.{decimals}f} \\pm {se:.{decimals}f}$"


def latex_tabular(cells: pd.DataFrame, notes: Sequence[str]) -> str:
    """A booktabs tabular (\\usepackage{booktabs}) of ready-made LaTeX cells and headers, with
    notes."""
    body = cells.style.hide(axis="index")
    align = "".join("l" if cells[c].map(lambda x: "$" not in x).all() else "r" for c in cells)
    tex = body.to_latex(hrules=True, column_format=align)
    rows = "".join(f"\\multicolumn{{{cells.shape[1]}}}{{l}}{{\\footnotesize {n}}} \\\\\n"
                   for n in notes)  # fmt: skip
    head = "% Mean $\\pm$ standard error over seeds (plot.py). Needs \\usepackage{booktabs}.\n"
    return head + tex.replace("\\end{tabular}", rows + "\\end{tabular}")


def latex_label(name: str, labels: dict[str, str] | None = None) -> str:
    """readable(name) for a LaTeX header: escaped, its ≥ ≤ ² in math mode."""
    text = latex_escape(readable(name, labels))
    return text.replace("≥", "$\\geq$").replace("≤", "$\\leq$").replace("²", "$^2$")


def table_latex(table: Table, labels: dict[str, str] | None = None) -> str:
    """aggregate.tex: keys, n, mean +- SE of the table's columns under readable headers
    ($^\\dagger$: fewer seeds; $^\\ddagger$: over the finite values only)."""
    s = table.stats
    cells = s[table.keys].map(lambda v: latex_escape(format_value(v)))
    cells.columns = [latex_escape(k) for k in table.keys]
    cells["n"] = [f"{n}" + "$^\\dagger$" * f for n, f in zip(s["n"], s["fewer_seeds"], strict=True)]
    for m in table.columns:
        never = (s[f"{m}_n"] == 0) & is_crossing(m)  # no run reached it: a word, not a number
        cells[latex_label(m, labels)] = [
            "never" if no else format_mean_se(a, b) + "$^\\ddagger$" * (k < n)
            for a, b, k, n, no in zip(
                s[f"{m}_mean"], s[f"{m}_se"], s[f"{m}_n"], s["n"], never, strict=True
            )
        ]
    notes = ["$^\\dagger$ fewer seeds than the other configurations"] * bool(s["fewer_seeds"].any())
    if any(cell.endswith("$^\\ddagger$") for cell in cells.to_numpy().ravel()):
        notes.append("$^\\ddagger$ over the runs with a finite value (first epochs: that reached "
                     "it) only; their n: table.csv")  # fmt: skip
    return latex_tabular(cells, notes)


def write_tables(
    table: Table, out_dir: str | os.PathLike, metric: str, labels: dict[str, str] | None = None
) -> list[Path]:
    """aggregate.csv (every number), table.csv and aggregate.tex (the table's columns), and
    comparison.csv/.tex (`comparison` of `metric`), written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = {"aggregate.csv": table_csv(table), "table.csv": table_csv(table, table.columns),
             "aggregate.tex": table_latex(table, labels)}  # fmt: skip
    if found := comparison(table, metric):
        row_key, wide = found
        flat = wide.set_axis([f"{c} {s}" for c, s in wide.columns], axis=1)
        texts["comparison.csv"] = flat.rename_axis(row_key).to_csv(float_format="%.12g")
        cells = pd.DataFrame({latex_escape(row_key): [latex_escape(v) for v in wide.index]})
        for condition in dict.fromkeys(c for c, _ in wide.columns):
            means, ses = wide[(condition, "mean")], wide[(condition, "se")]
            cells[latex_escape(condition)] = [
                format_mean_se(m, e) for m, e in zip(means, ses, strict=True)
            ]
        texts["comparison.tex"] = latex_tabular(
            cells, [f"{latex_label(metric, labels)}, n seeds: comparison.csv"]
        )
    for name, text in texts.items():
        atomic_write_text(out / name, text)
    return [out / name for name in texts]


def few(items: Sequence[str], limit: int = 5, sep: str = ", ") -> str:
    """The first `limit` items, then how many more: `a, b, +3 more`."""
    return sep.join([*items[:limit], *[f"+{len(items) - limit} more"] * (len(items) > limit)])


def skipped_line(skipped: Sequence[tuple], limit: int = 5) -> str:
    """`warning: skipped 3 runs (unfinished: a, b; corrupt: c)`: one line, however many."""
    if not skipped:
        return ""
    by_reason: dict[str, list[str]] = {}
    for where, reason in skipped:
        by_reason.setdefault(reason, []).append(Path(str(where)).name)
    parts = [f"{reason}: {few(names, limit)}" for reason, names in by_reason.items()]
    return f"warning: skipped {len(skipped)} run{'s' * (len(skipped) != 1)} ({'; '.join(parts)})"


def dropped_line(table: Table, limit: int = 5) -> str:
    """`warning: left out 2 non-finite values, not counted in n (test_loss=nan: a; ...)`."""
    parts = [f"{metric}={value}: {where}" for where, metric, value in table.dropped]
    return (f"warning: left out {len(parts)} non-finite value{'s' * (len(parts) != 1)}, "
            f"not counted in n ({few(parts, limit, '; ')})")  # fmt: skip


# ---- what plot.py's command line needs --------------------------------------------------------


class NoResults(Exception):
    """Nothing to draw: one `error:` line, exit `code` (1: no results, 2: bad input)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def load_runs_from(results: Path, from_mlflow: bool, experiment: str, uri: str | None = None):
    """(runs, skipped) of a results directory or an MLflow experiment; NoResults if none."""
    if from_mlflow:
        from .mirror import tracking_uri

        try:
            runs, skipped = load_runs_from_mlflow(uri or tracking_uri(), experiment)
        except LookupError as e:
            raise NoResults(str(e)) from None
        where = f"MLflow experiment {experiment!r}"
    else:
        runs, skipped = load_runs(results)
        where = f"{results}/" + (f" ({skipped_line(skipped)[9:]})" if skipped else "")
    if not runs:
        raise NoResults(
            f"no finished runs in {where}: bash run.sh fills results/sweep; "
            "`python run.py` alone writes results/trials (--results results/trials)"
        )
    return runs, skipped


def unknown_columns(table: Table, metric: str, curve: str) -> str | None:
    """Why --metric, --curve or a table column cannot be drawn from these runs (None: they can)."""
    columns = sorted({c for r in table.runs for c in r.history} - {"epoch", "step"})
    if curve not in columns:
        return f"--curve: {curve} is not a history column of the runs: {', '.join(columns)}"
    if metric not in table.metrics:
        return f"--metric: {metric} is not among the runs' metrics: {', '.join(table.metrics)}"
    for column in table.columns:
        found = DERIVED.fullmatch(column)
        if found and found["column"] in columns and _threshold_ok(found):
            continue
        if not found and column in table.metrics:
            continue
        return (f"--table: {column} is neither a metric ({', '.join(table.metrics)}) nor "
                f"COLUMN@final, COLUMN@best, COLUMN>=X or COLUMN<=X of a history column "
                f"({', '.join(columns)})")  # fmt: skip
    return None


def _threshold_ok(found: re.Match) -> bool:
    try:
        return not found["op"] or math.isfinite(float(found["threshold"]))
    except ValueError:
        return False


def notes(table: Table) -> list[str]:
    """The lines that name what the numbers leave out or assume: non-finite values dropped,
    configurations with fewer seeds, keys older runs lacked (taken at today's defaults)."""
    lines = [dropped_line(table)] if table.dropped else []
    for column in dict.fromkeys(c for _, c in table.never):
        never = [where for where, c in table.never if c == column]
        lines.append(f"note: {len(never)} run{'s' * (len(never) != 1)} never reached {column} "
                     f"(the first epoch's mean is over the others): {few(never)}")  # fmt: skip
    s = table.stats
    if s.fewer_seeds.any():
        short = "; ".join(f"{c} (n={n})" for c, n in s.n[s.fewer_seeds].items())
        lines.append(f"note: fewer seeds than the others (max n={s.n.max()}): {short}")
    defaulted = sorted(
        {f"{k}={format_value(v)}" for r in table.runs for k, v in r.defaulted.items()}
    )
    if defaulted:
        older = sum(bool(r.defaulted) for r in table.runs)
        lines.append(f"note: {older} older runs lack keys; took run.py's current defaults: "
                     + ", ".join(defaulted))  # fmt: skip
    return lines


def load_system_run(target: str, uri: str | None) -> tuple[dict, str]:
    """--system RUN (a run directory or an MLflow run id): its system metrics and its name."""
    from .mirror import read_state, tracking_uri

    run_id = name = target
    if Path(target).is_dir():
        try:
            run_id = read_json(Path(target) / METRICS).get("mlflow_run_id")
        except (OSError, ValueError, AttributeError):
            run_id = None
        run_id = run_id or read_state(Path(target)).get("run_id")  # a sweep's: its follower's
        if not run_id:
            raise NoResults(
                f"--system: {target} has no MLflow run id in its {METRICS} "
                "(unfinished, or trained with tracking off): pass the run id",
                2,
            )
        name = Path(target).resolve().name
    try:
        series = load_system_metrics(uri or tracking_uri(), run_id)
    except LookupError as e:
        raise NoResults(f"--system: {e}", 2) from None
    if not system_panels(series):
        raise NoResults(f"--system: MLflow run {run_id} recorded no system metrics "
                        "(system/gpu_0_utilization_percentage, system/cpu_...)", 1)  # fmt: skip
    return series, name


def system_panels(series: dict) -> dict[str, list[str]]:
    """y-label -> metric names: every GPU's utilisation and memory, else the CPU's and RAM."""
    gpus = sorted(k for k in series if re.fullmatch(r"gpu_\d+_utilization_percentage", k))
    panels = {
        "GPU util. (%)": gpus,
        "GPU memory (%)": [k.replace("utilization", "memory_usage") for k in gpus],
    }
    if not gpus:
        panels = {"CPU util. (%)": ["cpu_utilization_percentage"],
                  "RAM (%)": ["system_memory_usage_percentage"]}  # fmt: skip
    panels = {label: [k for k in names if k in series] for label, names in panels.items()}
    return {label: names for label, names in panels.items() if names}
