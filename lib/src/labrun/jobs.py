"""Jobs: the run-directory contract as an API, for any script, training or not.

run.py trains; analyze.py compares two trained runs; your script may do anything else. Each gets
the same contract, and a job of your own is a parser and one `work(job) -> metrics` function
(lib/README.md, "A job that does not train", with an example; docs/design.md, "Jobs"): its run
directory from its arguments (`--print-run-dir` imports neither torch nor mlflow), skip when
done, one process per run directory (claim.py), config.json, status, run.log, metrics.json
written last, MLflow, `--plan` for sweeps, and one mapping of how it ends to its exit code
(`ended`). Its identity is every argument but the job flags parser() adds (COMMON_KEYS), unless
`identity=` says it (analyze.py); bad input found only by loading things goes in `prepare=`,
which runs before any file of the job is written. Imports neither torch nor mlflow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path

from . import distributed, runs
from .claim import Busy, Claim, LostClaim, claim
from .config import (
    PROJECT_ROOT,
    Execution,
    NotReady,  # noqa: F401  (jobs.NotReady: scripts raise it, analyze.py)
    Parser,
    Tools,
    UsageError,
    _add_field,
    changed_args,
    fields_of,
    readable_name,
    short_hash,
    tracking_default,
)
from .runs import EXIT_BUSY, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from .stopping import GracefulStop

# The flags parser() adds, declared once with run.py's (config.Execution and config.Tools): how
# a job runs, never what it computes, so out of its identity.
COMMON_KEYS = frozenset(
    ("results_dir", "fresh", "print_run_dir", "experiment", "tracking", "init_tracking")
)


class Interrupted(Exception):
    """Raised by Job.check_stop() after a stop signal: the job ends `interrupted`, exit 75."""


def error(message: str, code: int, exc: BaseException | None = None) -> int:
    """One `error:` line on stderr (torchrun: from rank 0); when `exc` passed through the
    project's own code, the traceback's frames there follow it (project_frames)."""
    if not distributed.other_rank():
        frames = project_frames(exc) if exc is not None else ""
        where = f"in your code:\n{frames}" if frames else ""
        print(f"error: {message}\n{where}", end="", file=sys.stderr)
    return code


def project_frames(exc: BaseException) -> str:
    """The frames of `exc`'s traceback (and of the exceptions it was raised from) that stand in
    the project's own files (run.py, analyze.py, its package; not an environment inside it), as
    Python prints them: the student's line, without labrun's frames around it."""
    frames, seen = [], set()
    while exc is not None and id(exc) not in seen:  # the chain: `raise ... from`, or during
        seen.add(id(exc))
        frames[:0] = [f for f in traceback.extract_tb(exc.__traceback__) if _ours(f.filename)]
        exc = exc.__cause__ or exc.__context__
    return "".join(traceback.format_list(frames))


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    inside = path.is_relative_to(PROJECT_ROOT) and path.is_file()
    return inside and not {"site-packages", ".venv", "venv"} & set(path.parts)


def parser(prog: str, description: str, results_dir: str | Path) -> argparse.ArgumentParser:
    """An argparse parser with the job flags (bad input: one `error:` line, exit 2).
    `results_dir` is relative to the project folder."""
    p = Parser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    j = p.add_argument_group("job (not part of the identity)")
    for field_, kind in fields_of(Execution) + fields_of(Tools):
        if field_.name in COMMON_KEYS:
            _add_field(j, field_, kind)
    p.set_defaults(results_dir=PROJECT_ROOT / results_dir, tracking=tracking_default())
    return p


# ---- the contract every job shares (run.py's main() is this, with train() as its body) -------
def contract(
    argv: list[str] | None,
    parse: Callable[[list[str] | None], tuple[argparse.Namespace, argparse.ArgumentParser]],
    locate: Callable[[argparse.Namespace, argparse.ArgumentParser], Path],
    body: Callable[..., int],
    *,
    redo: Callable[[argparse.Namespace], bool] = lambda args: False,
    ranks: bool = False,
    program: Callable,
) -> int:
    """--plan, parse, --print-run-dir, --init-tracking, skip when done, claim; then
    `body(program, args, parser, out, stop, held, dist) -> exit code` while holding the claim
    `held` (claim.Claim: the Record checks it before every write, in case the directory was
    deleted).

    `locate` may raise UsageError (bad input, exit 2); `redo(args)` True runs even when done
    (run.py's tools). `ranks=True` (run.py): under torchrun rank 0 alone does all this; the
    other ranks do as it decides; the body runs on every rank (`held`: the claim on rank 0, None
    on the others; `dist`: distributed.Dist, one process without torchrun). `program`: the
    project's function (run.py's train, a job's work), which the body calls; when it is the
    script's own (`python run.py`), the process leaves as soon as the claim is released
    (_leave), instead of returning. The body is called from here, no deeper: a traceback from
    the project's function reads main -> lifecycle -> contract -> body."""
    try:
        stop = GracefulStop()
    except ValueError as exc:  # LAB_STOP_GRACE_S is not a number of seconds
        return error(str(exc), EXIT_USAGE)
    with stop:  # first: a stop signal at any later moment still ends in 75
        if (sys.argv[1:] if argv is None else argv) == ["--plan"]:  # run.sh: all jobs, one call
            from . import plan  # the sweep's query (side): one interpreter answers for all

            return plan.main(plan.resolver(parse, locate))
        args, parser_ = parse(argv)  # bad flags: one `error:` line, exit 2
        try:
            out = locate(args, parser_)
        except UsageError as exc:
            return error(str(exc), EXIT_USAGE)
        if args.print_run_dir:
            print(out)
            return EXIT_OK
        if args.init_tracking:
            from .mirror import init, tracking_uri

            print(f"MLflow ready: {tracking_uri()} (experiment id {init(args.experiment)})")
            return EXIT_OK
        if ranks and (problem := distributed.launch_problem()):  # a stray WORLD_SIZE, say
            return error(problem, EXIT_USAGE)
        # torchrun: N processes, one job (without it, or for a job that does not train: one)
        one = distributed.session(args.device) if ranks else nullcontext(distributed.Dist())
        try:
            with one as dist, ExitStack() as claimed:
                try:
                    code, held = _admit(dist, args, out, redo, stop, claimed)
                    if code is None:
                        code = body(program, args, parser_, out, stop, held, dist)
                        if held is not None and code in (EXIT_USAGE, EXIT_INTERRUPTED):
                            held.discard()  # refused or stopped before any work: leave nothing
                except Busy as exc:
                    code = error(f"running elsewhere: {exc}", EXIT_BUSY)
                except OSError as exc:  # the run directory cannot be created
                    code = error(
                        f"--results-dir: cannot write to {out.parent}: {exc.strerror}", EXIT_USAGE
                    )
                code = dist.finish(code)  # every rank leaves with rank 0's code
        except distributed.JoinFailed as exc:
            return error(str(exc), EXIT_FAILED)
        if dist.active:  # a torchrun rank leaves once its process group is gone (_leave)
            _leave(code, hooks=False)
    if _is_program(program):  # after the body, a skip or a refusal alike: nothing is left
        _leave(code, hooks=True)
    return code


def _is_program(function: Callable) -> bool:
    """`function` belongs to the script this interpreter runs (`python run.py`), not to a module
    imported by a test, a notebook or another tool that goes on after main() returns."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    return (
        getattr(function, "__module__", None) == "__main__"
        and script is not None
        and bool(sys.argv)
        and os.path.realpath(script) == os.path.realpath(sys.argv[0])
    )


def _leave(code: int, *, hooks: bool) -> None:
    """End the process now, less Python's finalization: everything of the run is closed by then
    (its files, run.log, its MLflow run, the claim).

    `hooks` (`python run.py`): first as the interpreter's exit would, non-daemon threads joined
    and every atexit hook run (MLflow's, torch's, multiprocessing's, logging's); tearing down
    every module and object took 2-4 s after a job's last line on 2 loaded cores
    (benchmarks/RESULTS.md, "Leave at once"). Without (a torchrun rank whose exit code every
    rank agreed and whose process group is destroyed): torchrun sends SIGTERM to a rank still
    exiting when another has exited, and a rank hit while finalization tears down gloo's C++
    threads aborts (`terminate called without an active exception`, SIGABRT, exit -6 instead of
    the agreed code; pytorch PR 179291; 1 run in 4 here with both cores busy)."""
    import atexit
    import logging
    import threading

    if hooks:
        threading._shutdown()  # what the interpreter's exit calls first: joins non-daemon threads
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)


def _admit(dist, args, out: Path, redo, stop: GracefulStop, claimed: ExitStack):
    """(None, the claim) when this rank runs the body; else (the exit code, None): another
    experiment on some rank (2), done (0), or rank 0's decision on the other ranks. Rank 0
    skips when done, else claims the run directory into `claimed` (Busy: exit 73)."""
    # Before anything is written: the same arguments, code, data and run directory.
    if dist.active and (differs := dist.agree_on(distributed.experiment_identity(args, out))):
        return error(differs, EXIT_USAGE), None
    if not dist.is_main:  # the others run when rank 0 does, else leave with its code
        return dist.verdict(None), None
    skip = not (args.fresh or redo(args))
    if not (skip and runs.is_done(out)):
        # one process per run directory, freed by the kernel on death
        held = claimed.enter_context(claim(out))
        stop.on_request = held.mark_stopping  # run.sh waits for a stopping holder
        if not (skip and runs.is_done(out)):  # else done meanwhile, by the process we waited for
            dist.verdict(None)  # torchrun: the other ranks run too
            return None, held
    print(f"already finished: {out} (metrics.json exists; --fresh starts over)")
    if note := runs.other_code_line(out, PROJECT_ROOT, "note"):
        print(note)
    return EXIT_OK, None  # contract's dist.finish tells the other ranks


def open_dir(out: Path, fresh: bool, stop: GracefulStop):
    """The claimed run directory made ready for its work: `fresh` (--fresh) deletes its files,
    a killed writer's temps go; returns run.log's logger, where stop requests go from now on."""
    if fresh:
        print(f"--fresh: deleting {', '.join(runs.clear_run_dir(out)) or 'nothing'} in {out}")
    runs.remove_stale_temps(out)
    stop.log = runs.setup_logging(out, out.name)
    return stop.log


# ---- a job that does not train ---------------------------------------------------------------
@dataclass
class Job:
    """What `work` gets: its arguments, run directory, log, stop request, what `prepare`
    returned, and `artifacts` (files of its run directory to attach to its MLflow run)."""

    args: argparse.Namespace
    out: Path
    log: object  # logging.Logger: stderr and run.log
    stop: GracefulStop
    prepared: object = None
    artifacts: list[Path] = field(default_factory=list)

    def check_stop(self) -> None:
        if self.stop.requested:
            raise Interrupted(self.stop.requested)


def main(
    parser: argparse.ArgumentParser,
    work: Callable[[Job], dict],
    argv: list[str] | None = None,
    *,
    identity: Callable[[argparse.Namespace], dict] | None = None,
    readable: Callable[[argparse.Namespace], list[str]] | None = None,
    prepare: Callable[[argparse.Namespace], object] | None = None,
) -> int:
    """Run `work(job) -> metrics` as a job of the contract; return the exit code.

    identity(args): what defines the result (default: the arguments less COMMON_KEYS); may raise
    UsageError (exit 2). readable(args): the name's readable parts (default: the script's name and
    the arguments not at their default). prepare(args): loads and checks inputs before any file
    is written (UsageError, ValueError, OSError: exit 2); `job.prepared` is what it returns.
    """
    ident = identity or (lambda args: {k: v for k, v in vars(args).items() if k not in COMMON_KEYS})
    name = readable or (
        lambda args: [Path(parser.prog).stem, *changed_args(args, parser, COMMON_KEYS)]
    )

    def locate(args, _parser) -> Path:
        return args.results_dir / readable_name(name(args), ident(args))

    def body(work, args, _parser, out: Path, stop: GracefulStop, held: Claim, dist) -> int:
        try:
            prepared = prepare(args) if prepare else None
        except Exception as exc:  # bad input (exit 2) or a failure in it (1): nothing written
            return ended(exc)
        if stop.requested:
            return EXIT_INTERRUPTED  # stopped while starting: nothing of this job exists yet
        from .tracking import provenance

        job = Job(args, out, open_dir(out, args.fresh, stop), stop, prepared)
        started, identity = time.monotonic(), ident(args)
        # (write_json turns the Paths of args into strings in config.json)
        config = dict(vars(args), identity=identity, experiment_keys=sorted(identity))
        config.update(run_name=out.name, config_hash=short_hash(identity))
        tags = {**(provenance() if args.tracking == "on" else {}), "job": sys.argv[0]}
        record = Record(out, config, args, stop, held, dist, identity, tags, what="job")
        try:  # recorded as it ends: finished, interrupted or failed
            metrics = work(job)
            if not isinstance(metrics, dict) or not metrics:
                raise TypeError(f"work() must return a non-empty dict of metrics, got {metrics!r}")
            metrics["wall_time_s"] = time.monotonic() - started
            record.finished(metrics, artifacts=job.artifacts)
            job.log.info(f"finished: {job.out}")
            return EXIT_OK
        except Interrupted as exc:
            record.interrupted(str(exc))
            return EXIT_INTERRUPTED
        except Exception as exc:  # failed: one line here, the traceback in run.log and MLflow
            return ended(exc, record, job.log)
        finally:
            record.close()

    return contract(argv, lambda a: (parser.parse_args(a), parser), locate, body, program=work)


BAD_INPUT = (UsageError, ValueError, OSError)  # raised before any file of the job: exit 2


def ended(exc: Exception, record: Record | None = None, log=None) -> int:
    """The one mapping of an exception that ends a job to its exit code and its `error:` line:
    75 interrupted (its status written where it stopped); once the record started, Record.failed
    (status failed, the traceback in run.log and MLflow, its code: 1, 2 or 73); before
    it, bad input (BAD_INPUT before run.log opened) 2, a lost claim 73, anything else 1, with
    the project's frames of the traceback under the line when run.log has not got it."""
    if isinstance(exc, Interrupted):
        return EXIT_INTERRUPTED
    if record is not None:
        return record.failed(exc)
    if isinstance(exc, BAD_INPUT) and log is None:
        return error(str(exc) or type(exc).__name__, EXIT_USAGE)  # bad input: one line
    if log is not None:  # the whole traceback: run.log, and stderr with its lines
        log.error("failed:\n%s", traceback.format_exc())
    if isinstance(exc, LostClaim):
        return error(str(exc), EXIT_BUSY)
    line = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return error(line, EXIT_FAILED, None if log is not None else exc)


# ---- what every job leaves behind --------------------------------------------------------------
class Record:
    """A job's record: config.json, status (running -> finished | failed | interrupted),
    metrics.json last (its existence means done) and its MLflow run; a training run adds
    history.csv, checkpoint.pt and best_model.pt (session.TrainingJob, after `ours()`). Every
    fault path is best-effort: a full disk or a dead tracker never turns an ending job into a
    traceback. Before each write it checks that the run directory is still this process's
    (`claim.check()`): if it was deleted meanwhile, LostClaim, and nothing more is written there.

    One writer: under torchrun the ranks other than 0 keep a Record that writes nothing
    (`writes` False; their part of the collective checkpoint goes to rank 0), and sends a
    failure's traceback to rank 0, which puts it into run.log and MLflow. `what`: "run"
    (training) or "job", as run.log names it."""

    def __init__(
        self, out, config: dict, args, stop, held: Claim | None, dist, params, tags, what="run"
    ) -> None:
        """`stop` (GracefulStop): its log is the run's; its exit 130 leaves "interrupted"."""
        self.out, self.log, self.claim, self.dist, self.what = out, stop.log, held, dist, what
        self.args = args
        self.writes, self.tracker = dist.is_main, None
        stop.on_force_exit = self.force_exited
        if not self.writes:
            return
        from .tracking import Tracker

        held.check()
        runs.write_json(out / runs.CONFIG, config)
        runs.write_status(out, "running")
        self.tracker = Tracker(
            out,
            enabled=args.tracking == "on",
            experiment=args.experiment,
            log=self.log,
            params=params,
            tags={**tags, "run_dir": str(out)},  # every job's, training or not
            system_metrics=what == "run",  # a job that does not train: no machine samples
        )

    def ours(self) -> bool:
        """Whether this process writes the record (rank 0), once it checked that the run
        directory is still its own (else LostClaim)."""
        if self.writes:
            self.claim.check()
        return self.writes

    def tracker_line(self) -> str:
        if not self.writes:
            return ""
        if not self.tracker.enabled:
            return "MLflow off"
        if self.tracker.deferred:
            return "MLflow: the sweep's follower mirrors this run once it ends"
        return f"MLflow run {self.tracker.run_id or 'not reached (continuing without)'}"

    def interrupted(self, signal_name: str, progress=None) -> None:
        """Status interrupted, MLflow KILLED. `progress`: a training run's (state.Progress),
        which resumes from its checkpoint; a job without one is redone."""
        if not self.ours():
            return
        runs.write_status(self.out, "interrupted")
        self.tracker.end("KILLED")
        where, redo = (f" at step {progress.step}", "resume") if progress else ("", "redo")
        self.log.warning(f"interrupted by {signal_name}{where}; re-run the same command to {redo}")

    def force_exited(self) -> None:
        """Exit 130 (a second Ctrl-C, a late signal): status interrupted, unless done."""
        if self.writes and self.claim.still_ours() and not runs.is_done(self.out):
            runs.try_write_status(self.out, "interrupted")

    def finished(self, metrics: dict, *, tags=None, artifacts=()) -> None:
        """MLflow FINISHED (the numbers of `metrics`, `tags`, config.json and `artifacts`
        attached), status finished, then metrics.json with the MLflow run's id: last, its
        existence means done."""
        if not self.ours():
            return
        self.tracker.end(
            "FINISHED",
            metrics={k: v for k, v in metrics.items() if v is not None},
            tags=tags,
            artifacts=[self.out / runs.CONFIG, *artifacts],
        )
        metrics["mlflow_run_id"] = self.tracker.run_id  # the end may rebuild the MLflow run
        self.claim.check()  # again: the tracker's end may have taken a while
        runs.write_status(self.out, "finished")
        runs.write_json(self.out / runs.METRICS, metrics)  # last: its existence means "done"

    def failed(self, exc: BaseException) -> int:
        """Call in the `except` that caught `exc`: the traceback into run.log, status failed,
        MLflow FAILED; one `error:` line (the exception's first line, the rank whose failure
        caused it, or what to do); returns the exit code: 2 for input that changed under it, 73
        when the run directory is no longer ours, else 1. A rank other than 0 sends its
        traceback to rank 0."""
        text = traceback.format_exc()
        if not self.writes:
            self.log.error("failed:\n%s", text)
            self.dist.report_failure(text)  # rank 0 writes it into run.log and MLflow
            return EXIT_FAILED
        if not self.claim.still_ours():  # LostClaim, or any failure once the path is another's
            message = str(exc)
            if not isinstance(exc, LostClaim):
                message = f"{self.claim.lost_message()} (then {type(exc).__name__})"
            self.log.error("%s", message)
            self.tracker.abandon(message)
            return error(message, EXIT_BUSY)
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        for rank, theirs in self.dist.peer_failures():  # torchrun: the cause, from its rank
            text += f"\nthe cause, on rank {rank}:\n{theirs}"
            message = f"rank {rank} failed: {theirs.strip().splitlines()[-1]}"
        self.log.error("%s failed:\n%s", self.what, text)
        runs.try_write_status(self.out, "failed")
        self.tracker.end("FAILED", error=text)
        # The traceback went to stderr with run.log's lines; the `error:` line says what to do
        # for the failures that have a remedy. Input that changed under the job is bad input.
        # The remedies name run.py's flags: a job that does not train has its own first line.
        training = self.what == "run"  # then torch is imported (TrainingJob.__init__)
        from .imagefolder import UnreadableImage

        if training and isinstance(exc, UnreadableImage):  # changed since the scan: bad input
            from .dataversion import forget

            # the next start fingerprints every file; the hint says so
            return error(f"{exc}; {forget(self.args.data_path, self.args.data_dir)}", EXIT_USAGE)
        if isinstance(exc, runs.RunFailed):
            message = str(exc)
        elif training and isinstance(exc, sys.modules["torch"].OutOfMemoryError):
            message = (
                f"out of memory at --batch-size {self.args.batch_size}; try --find-batch-size, "
                "or a smaller --batch-size with --grad-accum"
            )
        elif runs.is_disk_error(exc):
            message = (
                f"{exc.strerror} writing {exc.filename or self.out}: the run stopped; its "
                "last complete checkpoint is kept (free space, then re-run to resume)"
            )
        return error(message, EXIT_FAILED)

    def close(self) -> None:
        if self.writes:
            self.tracker.close()
            runs.close_logging(self.log)
