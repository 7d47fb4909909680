"""analyze.py's results read back for plot.py --analysis: each result's CKA table (layers of run
A x layers of run B), and the mean +- SE of those whose runs differ only in their seed. No torch
here (pandas): analyze.py computes the CKA with labrun.tools.similarity.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .analysis import SEED_KEY, NoResults, format_mean_se, latex_escape, latex_tabular, skipped_line
from .runs import CONFIG, METRICS, atomic_write_text, read_json

CKA_TABLE = "cka_layers.csv"  # analyze.py's table of every layer pair


def read_cka(run_dir: Path) -> tuple[pd.DataFrame, dict, dict]:
    """An analyze.py result: its cka_layers.csv (layers of A x layers of B), metrics.json and
    config.json (ValueError, KeyError or OSError when one is missing or malformed)."""
    frame = pd.read_csv(run_dir / CKA_TABLE, index_col=0, dtype={0: str}).astype(float)
    metrics, config = read_json(run_dir / METRICS), read_json(run_dir / CONFIG)
    float(metrics["cka"]), metrics["layer_a"], config["run_a"], config["run_b"]  # noqa: B018
    return frame, metrics, config


def load_cka_results(directory: Path) -> tuple[dict[str, tuple], list[tuple[str, str]]]:
    """Every finished analyze.py result in `directory`: name -> read_cka(), and the skipped."""
    found, skipped = {}, []
    for path in sorted(Path(directory).glob(f"*/{CKA_TABLE}")):
        if (path.parent / METRICS).is_file():
            try:
                found[path.parent.name] = read_cka(path.parent)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                skipped.append((path.parent.name, f"unreadable ({type(exc).__name__})"))
    if not found:
        raise NoResults(f"--analysis: no finished analyze.py results in {directory}/ "
                        "(python analyze.py RUN_A RUN_B writes them)"
                        + (f"; {skipped_line(skipped)[9:]}" if skipped else ""))  # fmt: skip
    return found, skipped


@dataclass
class SeedPairs:
    """analyze.py results of runs that differ only in `seed` and share everything else (their
    other experiment keys, the analysis' layer, inputs and input seed): layer x layer mean and
    SE over the pairs (SE NaN with one pair)."""

    name: str  # the runs' shared name: run A's without its seed and hash
    results: list[str]  # the analysis directories, one per seed pair
    mean: pd.DataFrame  # layers of A (rows) x layers of B
    se: pd.DataFrame

    def per_row(self) -> pd.DataFrame:
        """Per layer of A: its best-matching layer of B (highest mean) and that mean +- SE, and
        the same layer's mean +- SE where B has it: the figure's table."""
        best = self.mean.idxmax(axis=1)
        same = [a if a in self.mean.columns else None for a in self.mean.index]

        def at(frame: pd.DataFrame, cols) -> list[float]:  # each row's value in its column
            return [
                frame.at[a, b] if b else math.nan for a, b in zip(frame.index, cols, strict=True)
            ]

        rows = pd.DataFrame({"best_b": best, "best_mean": at(self.mean, best),
                             "best_se": at(self.se, best), "same_mean": at(self.mean, same),
                             "same_se": at(self.se, same), "n": len(self.results)})  # fmt: skip
        return rows.rename_axis("layer_a")


def seed_pairs(found: dict[str, tuple], root: Path) -> tuple[list[SeedPairs], list[tuple]]:
    """load_cka_results()'s results grouped into SeedPairs (runs relative to `root`); those whose
    runs differ in more than the seed stay apart, those whose runs are gone are skipped."""
    groups: dict[str, list[str]] = {}
    skipped, names = [], {}
    for result, (frame, metrics, config) in found.items():
        try:
            a, b = (read_json(root / config[f"run_{side}"] / CONFIG) for side in "ab")
            same = [{k: c[k] for k in c["experiment_keys"] if k != SEED_KEY} for c in (a, b)]
        except (OSError, ValueError, KeyError, TypeError):
            skipped.append((result, "its runs' config.json unreadable: not in the seed mean"))
            continue
        if same[0] != same[1] or a.get(SEED_KEY) == b.get(SEED_KEY):
            continue
        shared = [same[0], list(frame.index), list(frame.columns), metrics["layer_a"],
                  metrics["layer_b"], config.get("images"), config.get("seed")]  # fmt: skip
        key = json.dumps(shared, sort_keys=True, default=str)
        groups.setdefault(key, []).append(result)
        name = re.sub(r"-[0-9a-f]{8}$", "", Path(config["run_a"]).name)
        names.setdefault(key, re.sub(r"_seed=[^_]*", "", name))
    found_pairs = []
    for key, results in groups.items():
        stack = np.stack([found[r][0].to_numpy() for r in results])
        se = stack.std(0, ddof=1) / math.sqrt(len(stack)) if len(stack) > 1 else stack[0] * np.nan
        axes = found[results[0]][0].index, found[results[0]][0].columns
        found_pairs.append(SeedPairs(names[key], results, pd.DataFrame(stack.mean(0), *axes),
                                     pd.DataFrame(se, *axes)))  # fmt: skip
    return found_pairs, skipped


def write_seed_pair_table(pairs: SeedPairs, out_dir: Path, stem: str) -> list[Path]:
    """<stem>.csv (every number of per_row) and <stem>.tex (booktabs: mean +- SE)."""
    rows = pairs.per_row()
    cells = pd.DataFrame({"layer of A": [latex_escape(a) for a in rows.index],
                          "best layer of B": [latex_escape(b) for b in rows.best_b]})  # fmt: skip
    for head, part in (("its CKA", "best"), ("same layer's CKA", "same")):
        pairs_ = zip(rows[f"{part}_mean"], rows[f"{part}_se"], strict=True)
        cells[head] = [format_mean_se(m, e) for m, e in pairs_]
    n = len(pairs.results)
    note = f"linear CKA, mean $\\pm$ SE over {n} seed pair{'s' * (n != 1)} of "
    note += latex_escape(pairs.name)
    texts = {f"{stem}.csv": rows.to_csv(float_format="%.6g", lineterminator="\n"),
             f"{stem}.tex": latex_tabular(cells, [note])}  # fmt: skip
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        atomic_write_text(Path(out_dir) / name, text)
    return [Path(out_dir) / name for name in texts]
