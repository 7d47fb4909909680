"""labrun: the machinery of the lab's deep-learning projects, so that a project keeps its method.

A project's run.py holds the method (data, model, optimizer, the step, the loop); labrun holds
what is the same in every project: the run directory and its identity, the claim, checkpoints and
exact resume, stop signals, MLflow tracking, the sweep engine and Slurm, the data layer, the
device / precision / compile policy, torchrun, results tables and gpucheck. Importing labrun
imports no torch: `--help` stays instant (the names below load their module on first use).

run.py's API (lib/README.md, "Public surface"): `labrun.lifecycle(argv, train, Config)` calls
`train(job)` with a `labrun.TrainingJob`, the run directory (session.py); `labrun.flag` types a
field of run.py's Config (config.py); `labrun.load_data`, `labrun.evaluate`, `labrun.TrainSums`,
`labrun.EMA` (train.py); `labrun.EarlyStopping` (stopping.py); `labrun.is_tool`,
`labrun.run_tools` (the tools run.py's flags ask for); `labrun.Interrupted`, `labrun.RunFailed`.
"""


def _installed_version() -> str:
    """The version pip installed (the wheel a project carries names its code: 0.1.0+g<hash>);
    "0+unknown" for a source tree on sys.path that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(__name__)
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

_LAZY = {
    "TrainingJob": "session",
    "lifecycle": "session",
    "is_tool": "session",
    "RunFailed": "runs",
    "EMA": "train",
    "TrainSums": "train",
    "load_data": "train",
    "evaluate": "train",
    "EarlyStopping": "stopping",
    "run_tools": "tools.tuning",
    "Interrupted": "jobs",
    "flag": "config",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
