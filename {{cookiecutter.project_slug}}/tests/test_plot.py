"""plot.py and analyze.py draw every figure from a few tiny real runs of this project's run.py.

The figures' rules (sizes, fonts, labels on the page, statistics) are tested in labrun's tests;
this checks that this project's runs, models and figures go together, whatever they are.
"""

from __future__ import annotations

import importlib.util
import signal

import pandas as pd
import pytest
from conftest import ROOT, TINY, load_run_py

JOBS = [  # a numeric key (lr) and a categorical one (dataset): every figure has something to draw
    ["--dataset", "digits", "--lr", "0.01"],
    ["--dataset", "digits", "--lr", "0.02"],
    ["--dataset", "synthetic", "--lr", "0.01"],
]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from labrun.stopping import STOP_SIGNALS

    base = tmp_path_factory.mktemp("plot")
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    run = load_run_py()
    try:
        for job in JOBS:
            argv = [*TINY, "--epochs", "1", "--synthetic-size", "300", *job]
            argv += ["--data-dir", str(base / "data"), "--results-dir", str(base / "sweep")]
            assert run.main(argv) == 0, job
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return base


def test_every_figure_and_table_of_a_sweep(results, capsys):
    out = results / "figures"
    argv = ["--results", str(results / "sweep"), "--out", str(out), "--formats", "png"]
    assert load("plot").main(argv) == 0  # PNG only: the PDFs' font subsetting takes seconds
    for name in ("learning_curves", "final_vs_hparam", "comparison", "throughput"):
        assert (out / f"{name}.png").stat().st_size > 1000, name
    table = pd.read_csv(out / "aggregate.csv")
    assert len(table) == len(JOBS) and set(table.n) == {1}
    paper = pd.read_csv(out / "table.csv")  # plot.py's TABLE (default: test metrics and time)
    assert len(paper) == len(JOBS) and "\\toprule" in (out / "aggregate.tex").read_text()
    comparison = pd.read_csv(out / "comparison.csv").set_index("dataset")
    assert sorted(comparison.index) == ["digits", "synthetic"]
    assert "\\begin{tabular}" in (out / "comparison.tex").read_text()
    assert "error" not in capsys.readouterr().err


def test_cka_of_two_runs_and_its_heat_map(results, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # analyze.py builds models with run.py's make_model
    a, b = sorted(p for p in (results / "sweep").iterdir() if p.name.startswith("digits"))
    analysis = results / "analysis"
    argv = [str(a), str(b), "--images", "64", "--device", "cpu", "--tracking", "off"]
    assert load("analyze").main([*argv, "--results-dir", str(analysis)]) == 0
    (done,) = analysis.iterdir()
    cka = pd.read_csv(done / "cka_layers.csv", index_col=0)
    assert cka.shape[0] == cka.shape[1] > 1 and ((cka >= -1e-6) & (cka <= 1 + 1e-6)).all().all()
    out = results / "cka-figures"
    assert (
        load("plot").main(["--analysis", str(analysis), "--out", str(out), "--formats", "png"]) == 0
    )
    assert (out / f"{done.name}.png").stat().st_size > 1000
    assert "error" not in capsys.readouterr().err
