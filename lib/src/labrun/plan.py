"""Plan a sweep in one interpreter: the run directory and state of many command lines of a script
(run.py, or any script built on jobs.py: `python analyze.py --plan`).

run.sh asks this once for all its jobs (`python run.py --plan`) instead of starting one Python per
job (`run.py ARGS --print-run-dir`), which cost a second or more per job. It parses each command
line with run.py's own parser (config.parse_args, config.run_dir), so the directories are exactly
the ones run.py will use, and imports no torch and no mlflow.

Input on stdin, for each job: the number of arguments, then the arguments, each ending in NUL:
    printf '%s\\0' 2 --lr 0.01  3 --seed 1 --epochs 3 | python run.py --plan
Output on stdout, for each job three NUL-terminated fields: STATE, RUN_DIR, NOTE, where STATE is
    done         metrics.json exists and parses to a non-empty object (runs.is_done)
    running      another live process holds the run's claim (claim.py): "running elsewhere"
    stopping     its holder got a stop signal and is checkpointing: free in a few seconds
    interrupted  stopped before the end (status interrupted, or running with no live holder)
    failed       the last attempt failed
    refused      run.py refused to continue it (its checkpoint cannot be loaded): not re-run;
                 `run.py ARGS --fresh` starts it over (NOTE says so)
    pending      never started
    waiting      an input of the job is not finished yet (NotReady; RUN_DIR: the folder its run
                 directory will be in, for the sweep's MLflow follower)
    invalid      the script would refuse the command line (RUN_DIR empty, NOTE = its error)
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from labrun import config, runs
from labrun.claim import STOPPING, holder
from labrun.config import NotReady, UsageError, parse_args, run_dir
from labrun.sweepjobs import nul_join, read_lists


def resolver(parse: Callable, locate: Callable) -> Callable[[list[str]], Path]:
    """A script's `argv -> run directory` from its own parser (jobs.contract's `parse` and
    `locate`); it raises UsageError with the script's own message."""

    def resolve(argv: list[str]) -> Path:
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
                args, parser = parse(argv)
                try:
                    return locate(args, parser)
                except NotReady as exc:  # its folder is known before its inputs are
                    exc.folder = getattr(args, "results_dir", "")
                    raise
        except SystemExit:  # argparse reports the error on stderr, then exits
            lines = captured.getvalue().strip().splitlines() or ["rejected"]
            raise UsageError(lines[-1].removeprefix("run.py: ")) from None

    return resolve


resolve = resolver(parse_args, run_dir)  # run.py's


def is_stopping(description: str | None) -> bool:
    """Whether holder()'s description says the holder is checkpointing and about to exit."""
    return description is not None and f", {STOPPING} since " in description


def job_state(directory: Path) -> tuple[str, str]:
    """(state, note) of one run directory, from the files run.py writes and the claim."""
    if runs.is_done(directory):  # the one definition of "done", run.py's own
        return "done", ""
    who = holder(directory)
    if who is not None:
        return "stopping" if is_stopping(who) else "running", f"running elsewhere: {who}"
    status = runs.read_status(directory)
    resumes = (directory / runs.CHECKPOINT).is_file()
    then = "resumes from its checkpoint" if resumes else "starts over: no checkpoint yet"
    if status == "failed":
        return "failed", f"last attempt failed; will be re-run, {then}"
    if status == "refused" and resumes:  # without its checkpoint (deleted), it starts over
        return "refused", (
            f"run.py refused its checkpoint (why: the last lines of {runs.LOG}); not re-run: "
            "fix the cause, or re-run the job with --fresh to start it over"
        )
    if status == "interrupted":
        return "interrupted", then
    if status == "running":  # says running, but nobody holds the claim: its process died
        return "interrupted", f"its process died; {then}"
    return "pending", ""


@contextlib.contextmanager
def one_parser() -> Iterator[None]:
    """Let config.parse_args reuse one parser (it keeps no state between parses): building it is
    most of a job's planning time (benchmarks/bench_sweep.py)."""
    build = config.build_parser
    parser = build()
    config.build_parser = lambda: parser
    try:
        yield
    finally:
        config.build_parser = build


def plan(
    jobs: list[list[str]], where: Callable[[list[str]], Path] = resolve
) -> list[tuple[str, str, str]]:
    """(state, run_dir, note) per job; `where` maps a command line to its run directory."""
    with one_parser():
        return [_plan_one(argv, where) for argv in jobs]


def _plan_one(argv: list[str], where: Callable[[list[str]], Path]) -> tuple[str, str, str]:
    try:
        directory = where(argv)
    except NotReady as exc:  # e.g. analyze.py of a run still training: run.sh again later
        return "waiting", str(getattr(exc, "folder", "")), str(exc)
    except (UsageError, ValueError) as exc:
        return "invalid", "", str(exc)
    state, note = job_state(directory)
    return state, str(directory), note


def main(
    where: Callable[[list[str]], Path] = resolve,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
) -> int:
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    try:
        jobs = read_lists(stdin)
    except ValueError:
        print("error: --plan: stdin is not 'COUNT\\0ARG\\0...' per job", file=sys.stderr)
        return 2
    for fields in plan(jobs, where):
        stdout.write(nul_join(fields))
    stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
