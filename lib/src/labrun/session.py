"""run.py's training job: `lifecycle` (its main) and `TrainingJob` (the run directory).

run.py holds the method's objects; its train(job) calls the job's verbs with them, in the order
lib/README.md's public surface lists (resume, compile, batches/tick, end_epoch, save_best,
checkpoint, finish): a verb called before what it needs exists is a NameError at run.py's line.
The job writes config.json, run.log, status, history.csv, checkpoint.pt (every object given to
`resume` by its state_dict, progress, early stopping with the best weights, RNG, the
precision), best_model.pt, metrics.json (last; never NaN: null and a reason) and MLflow; it
handles stop signals, exact resume, torchrun (rank 0 writes) and every way a run ends (jobs.ended:
0 finished, 1 failed, 2 bad input or a refused checkpoint, 73 its directory is another's,
75 stopped: re-run to resume, 130 forced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import time

from . import __version__, jobs, runs
from .config import PROJECT_ROOT, parse_args, resolved_config, run_dir, use_config
from .jobs import EXIT_OK, EXIT_USAGE, Interrupted, error
from .runs import RunFailed


def is_tool(args) -> bool:
    """--find-lr, --find-batch-size or --profile: measure, report and exit; nothing resumed or
    recorded (tools.tuning.run_tools)."""
    return bool(args.find_lr or args.find_batch_size or args.profile)


def lifecycle(argv: list[str] | None, train, config: type) -> int:
    """run.py's main(): --plan, --print-run-dir, skip when done, the claim (exit 73), torchrun's
    ranks (rank 0 writes); then `train(TrainingJob)`, every failure mapped to its exit code.
    `config`: run.py's Config dataclass, the method's flags (config.flag)."""
    use_config(config)
    return jobs.contract(argv, parse_args, run_dir, _body, redo=is_tool, ranks=True, program=train)


def _body(train, args, parser, out, stop, held, dist) -> int:
    job = None
    try:
        job = TrainingJob(args, parser, out, stop, held, dist)
        try:
            code = train(job)
        except SystemExit as exc:  # sys.exit(0) in the method's code (a dataset, a model)
            if exc.code not in (0, None) or job.done:
                raise
            message = f"sys.exit({exc.code}) before job.finish(): the run has no result"
            raise RunFailed(message) from None
        if code is None and not job.done:
            raise RunFailed("train() returned before job.finish(): the run has no result")
        return EXIT_OK if code is None else code
    except SystemExit as exc:  # a refusal, its line printed and logged: end with its code
        return exc.code
    except Exception as exc:  # interrupted (tick wrote it), refused or failed: jobs.ended
        record, log = (job.record, job.log) if job is not None else (None, None)
        bad_input = isinstance(exc, jobs.BAD_INPUT) and log is None
        if bad_input and (job is None or not job.agreed):  # torchrun: ranks still starting end
            dist.settle(EXIT_USAGE, why=str(exc) or type(exc).__name__)
        return jobs.ended(exc, record, log)
    finally:
        if job is not None:
            job.close()
        from .loaders import close_all

        close_all()  # its loaders' workers end now, not in the interpreter's exit


@dataclasses.dataclass
class Progress:
    """Where a run is (checkpointed; run.py's loop reads `epoch`)."""

    epoch: int = 0  # epochs completed
    batch: int = 0  # micro-batches done in the current epoch
    step: int = 0  # optimizer steps done
    history: list[dict] = dataclasses.field(default_factory=list)
    wall_time_s: float = 0.0
    train_time_s: float = 0.0
    epoch_time_s: float = 0.0  # training time of the current epoch so far, across resumes
    compile_time_s: float = 0.0
    samples: int = 0


class TrainingJob:
    """One training run's directory and record, made by `lifecycle` for run.py's train(job).

    For run.py: `args` (the flags), `env` (train.Env: device, amp_dtype, task, dist), `out` (the
    run directory), `log` (run.log, once `resume` opened it). Its verbs take the method's
    objects: `resume` (the only one that keeps them, to checkpoint them by state_dict),
    `compile`, `batches`/`tick`, `end_epoch`, `save_best`, `checkpoint`, `finish`.
    Over 300 lines because it is the run directory's whole life in one place (its refusals,
    resume, checkpoints, the loop's bookkeeping, the endings), each verb short; what it measures
    stands apart (EpochPace).
    """

    def __init__(self, args, parser, out, stop, held, dist) -> None:
        import torch

        from .loaders import available_cpus
        from .project import version_warning
        from .train import environment

        self.args, self.out, self.stop, self.held = args, out, stop, held
        self.agreed = self.done = False
        self.log = self.record = self.data = self.progress = self.loader = None
        self.objects, self.speed, self.compiled = {}, {}, None
        # ---- config: every bad input is found before a file of the run is written ----
        self.config = config = resolved_config(args, parser)
        # The processes of this job (torchrun), not of its identity; the CPU share it computes
        # with (its numbers depend on the thread count): run.sh gives a resumed job the same.
        config.update(world_size=dist.world, torch_threads=torch.get_num_threads())
        config["job_cpus"] = available_cpus()
        runs.check_ownership(out)  # a colleague's run directory, or files planted in ours
        self.env, self._notes = environment(args, dist)
        task = self.env.task
        config.update(monitored=task.monitor, metric_directions=task.directions)
        if dist.is_main and (mismatch := version_warning(PROJECT_ROOT, __version__)):
            print(f"warning: {mismatch}", file=sys.stderr)  # runs on, but says so at start
            self._notes.append(("labrun", mismatch))
        if args.profile:  # the CUDA memory snapshot then covers the whole run, model included
            from .tools.tuning import start_memory_history

            start_memory_history(self.env.device)

    # ---- the run directory: opened once the model exists ----------------------------------------
    def resume(self, data, stopper, loss_fn, **objects):
        """Open the run directory and resume from its checkpoint, or start: returns the run's
        Progress. `objects` (name -> object with state_dict(), or None; the first the model)
        are checkpointed from now on by their state_dict and loaded from it here; `stopper`
        (stopping.EarlyStopping) with its best weights. Refused before any file is written
        (exit 2): a model, data and task that do not train together (one forward pass and
        `loss_fn` on a real batch), no room for a checkpoint; refused after (status refused,
        exit 2): a checkpoint that cannot be loaded, a resume on other data. Then the run's
        record starts (config.json, status running, MLflow). Tools (--find-lr ...) only open
        the run directory."""
        from .preflight import forward_problem
        from .train import peek_batch

        self.data, self.stopper, self.objects, self.progress = data, stopper, objects, Progress()
        model = next(iter(objects.values()))
        args, out, dist, env = self.args, self.out, self.env.dist, self.env
        self.config.update(data.info.as_config())  # classes, channels, sizes, content hash...
        why = ""
        try:
            # one forward pass and the loss on a real batch: a misfit of model, data and task
            batch = None if is_tool(args) else peek_batch(data.train, 0, data.layout, env.device)
            if batch and (problem := forward_problem(model, batch, loss_fn, env.amp_dtype)):
                why = (
                    f"--model {args.model} cannot train on --dataset {args.dataset} under "
                    f"--task {args.task} ({problem}); choose another --model, --task or --dataset"
                )
            elif dist.is_main:
                runs.ensure_writable(out, need_bytes=room_needed(out, objects.values()))
        except OSError as exc:  # not writable, or no room for a checkpoint: before any work
            why = f"--results-dir: {exc.strerror or exc}"
        code = error(why, EXIT_USAGE) if why else None
        self.agreed = True
        # torchrun: one collective whatever each rank found (a refusal, a stop while starting:
        # nothing of this run exists yet), so that no rank waits in another one (issue 28.2)
        if (code := dist.settle(code, self.stop, why)) is not None:
            raise SystemExit(code)
        if dist.is_main:  # one writer (--fresh, run.log); the other ranks log to stderr
            self.log = jobs.open_dir(out, args.fresh, self.stop)
        else:
            self.log = self.stop.log = dist.rank_log(out.name)
        dist.settle(None)  # the others read the checkpoint once --fresh has deleted it
        for note in data.warnings:  # e.g. skipped unreadable images
            self.log.warning(f"data: {note}")
        notes = (
            self._notes + data.notes + ([("distributed", dist.describe())] if dist.active else [])
        )
        for what, why in notes:
            self.log.info(f"{what}: {why}")
        self._saved_at = time.monotonic()  # the last save (the start): wall time, checkpoint()
        if is_tool(args):
            return self.progress
        self._resume()
        params = tags = None
        if dist.is_main:
            from .mirror import run_params
            from .tracking import provenance

            params = run_params(self.config)  # with `experiment_keys`: plot.py --from-mlflow's
            tags = {**provenance(self.log), "device": str(env.device)}  # Record adds run_dir
            tags.update(amp_dtype=str(env.amp_dtype), compile=args.compile)
            tags.update(workers=str(args.workers), world_size=str(dist.world))
        # config.json, status running, its MLflow run (rank 0 writes); an OSError here (the
        # disk filled since the start-up check) is _body's: one `error:` line, exit 1
        self.record = jobs.Record(out, self.config, args, self.stop, self.held, dist, params, tags)
        steps = f"{data.steps_per_epoch} steps/epoch | labrun {__version__}"
        self.log.info(f"run {out.name} on {env.device} | {steps} | {self.record.tracker_line()}")
        return self.progress

    def _refuse(self, message: str) -> None:
        self.log.error(message)
        if self.env.dist.is_main:  # one writer
            runs.try_write_status(self.out, "refused")
        raise SystemExit(error(message, EXIT_USAGE))

    # ---- checkpoint.pt ---------------------------------------------------------------------------
    # Every object given to resume by its state_dict, so saving and resuming are one call each;
    # labrun assumes nothing of them but state_dict() / load_state_dict(): any optimizer, a
    # scheduler or None, any number of parameter groups. The best weights are in the checkpoint
    # too, not only in best_model.pt (a plain state_dict written at every new best): a hard kill
    # after a new best_model.pt but before the next checkpoint would otherwise resume with the
    # weights of an epoch the checkpoint has not reached. On resume the checkpoint's copy wins.
    def _save(self) -> None:
        """checkpoint.pt now: collective under torchrun (every rank calls it, rank 0 writes).
        It holds every object given to resume by its state_dict (None recorded as None),
        progress, early stopping with the best weights, the partial epoch's sums, RNG, the
        config hash."""
        from . import checkpoint as ckpt

        self.record.ours()  # LostClaim once the run directory is another's
        now, p = time.monotonic(), self.progress  # wall time is accumulated across resumes
        p.wall_time_s, self._saved_at = p.wall_time_s + now - self._saved_at, now
        state = {
            # the name distributed.py's gather_state / own_state read
            "trainer": ckpt.objects_state(self.objects, self.env.amp_dtype),
            "early_stopping": self.stopper.state_dict(),
            "progress": dataclasses.asdict(self.progress),
            "rng": ckpt.rng_state(self.env.device),
            "config_hash": self.config["config_hash"],
        }
        if (state := self.env.dist.gather_state(state)) is not None:
            ckpt.save(self.out / runs.CHECKPOINT, state)

    def _resume(self) -> None:
        """Load checkpoint.pt if there is one. One that cannot be loaded (corrupt, another
        configuration, another model, anything that fails while loading it) is refused in one
        line with the reason, never a traceback (_refuse). The checkpoint's best weights
        rewrite best_model.pt. The RNG state is restored last: nothing after it draws."""
        from . import checkpoint as ckpt
        from .dataversion import changed_since

        path, before = self.out / runs.CHECKPOINT, {}
        if not path.exists():  # nothing to resume: it starts on today's data
            return
        # Arrays keep their run name across data versions: a resume on other data is refused.
        with contextlib.suppress(OSError, ValueError):
            before = runs.read_json(self.out / runs.CONFIG)
        if before and (changed := changed_since(before, self.config, self.out)):
            self._refuse(changed)
        try:  # a refusal is for good: the planner must not say "resumes" (status refused)
            state = ckpt.load(path, config_hash=self.config["config_hash"])
            state = self.env.dist.own_state(state, path)
            ckpt.load_objects(self.objects, state["trainer"], self.env.amp_dtype, self.log)
            early = state["early_stopping"]
            if early["best_epoch"] and self.env.dist.is_main:  # one writer
                ckpt.save_weights(self.out / runs.BEST_MODEL, early["best_state"])
            self.stopper.load_state_dict(early)
            self.progress = Progress(**state["progress"])
            note = ckpt.set_rng_state(state["rng"], self.env.device)
        except ckpt.CheckpointError as exc:
            self._refuse(f"cannot resume: {exc}")
        except Exception as exc:  # whatever torch or this code raises: refused, with the reason
            self._refuse(
                f"cannot resume: {path} does not fit this code or this machine "
                f"({type(exc).__name__}: {runs.first_line(exc)}); re-run with --fresh to start over"
            )
        if note:
            self.log.warning(note)
        p = self.progress
        self.log.info(f"resuming {self.out} at epoch {p.epoch + 1}, step {p.step}")
        if other := runs.other_code_line(self.out, PROJECT_ROOT, "resuming under other code"):
            self.log.warning(other)  # README, "What a run writes"

    # ---- compile and DDP -------------------------------------------------------------------------
    def compile(self, model, loss_fn, loader, progress):
        """compiling.compile_model for the steps left after `progress` (job.resume's), probed
        on a real batch of `loader` in the run's layout: a Compiled (its `net` is what the step
        calls). The compile's seconds are summed over resumes: every compile was paid for."""
        from .compiling import compile_model
        from .train import peek_batch

        env, layout = self.env, self.data.layout
        batch = functools.partial(peek_batch, loader, progress.epoch, layout, env.device)
        steps = self.data.total_steps - progress.step
        self.compiled = compile_model(
            model, loss_fn, batch, self.args, env, steps=steps, log=self.log
        )
        progress.compile_time_s += self.compiled.compile_s
        self.speed.update(self.compiled.speed)
        return self.compiled

    # ---- the loop: verbs run.py's loop calls --------------------------------------------------
    def batches(self, loader):
        """This epoch's optimizer steps, each a list of --grad-accum micro-batches on the device,
        from where the run is (the order is f(seed, epoch): a resumed epoch skips the
        micro-batches it did) to the epoch's end or the run's last step. job.tick() follows each
        step. Times the epoch's training (EpochPace)."""
        if self.progress is None:
            raise RuntimeError("job.batches() before job.resume(): nothing says where the run is")
        p, accum, data = self.progress, self.args.grad_accum, self.data
        self.loader = loader  # finish() reports its share of the training time
        loader.set_epoch(p.epoch, skip_batches=p.batch)
        source = iter(loader)
        profile = "gpu_busy" not in self.speed  # the GPU's busy share: once per model and mode
        pace = self.pace = EpochPace(p, self.args, data, self.env, self.log, profile=profile)
        try:
            while p.batch < data.steps_per_epoch * accum and p.step < data.total_steps:
                if pace.busy is not None:  # GpuBusy.at before each step
                    pace.busy.at(p.step - pace.first_step)
                done = p.step
                yield [next(source) for _ in range(accum)]
                if p.step == done:  # the loop would never end: say so instead
                    raise RuntimeError("call job.tick() after each step of job.batches()")
        finally:
            getattr(source, "close", lambda: None)()
        self._epoch_trained()

    def tick(self) -> None:
        """One optimizer step done: counted (progress, bar). A stop signal (torchrun: on any
        rank, polled every 10 steps) now writes the checkpoint, status interrupted and raises
        Interrupted: exit 75, and the same command resumes at the next step."""
        p = self.progress
        p.step, p.batch = p.step + 1, p.batch + self.args.grad_accum
        self.pace.after_step(p)
        if self.env.dist.stopped(self.stop, p.step):
            self._epoch_trained()
            self._save()
            self.record.interrupted(self.stop.requested or "a stop signal to another rank", p)
            raise Interrupted(self.stop.requested)

    def _epoch_trained(self) -> None:
        """The epoch's training time into progress (once: at its end, or at a stop); what it
        measured into the compile and busy records."""
        from .hardware import LOOP_MIN_STEPS, busy_line, write_record

        p, pace, compiled = self.progress, self.pace, self.compiled
        train_s, busy = pace.end(p), pace.busy  # busy: its share None where none was measured
        if busy is not None and busy.share is not None:  # the GPU's busy share, once measured
            self.log.info(busy_line(busy.share, busy.step_s, self.args.batch_size))
            self.speed["gpu_busy"] = busy.share
            if compiled is not None and compiled.busy_record:
                write_record(*compiled.busy_record, share=busy.share, step_s=busy.step_s)
        p.train_time_s += train_s
        p.epoch_time_s = train_s + (p.epoch_time_s if pace.resumed_in_epoch else 0.0)
        # A mode is judged on the training step's own time: the first epoch's, once.
        steps = p.step - pace.first_step
        first = p.epoch == 0 and not pace.resumed_in_epoch and steps >= LOOP_MIN_STEPS
        if compiled is not None and compiled.record is not None and first:
            compiled.record.save_step(compiled.mode, train_s / steps)

    def end_epoch(self, sums, val: dict[str, float], *, lr: float) -> dict:
        """The epoch's row, returned and written (history.csv, run.log, MLflow): the training
        `sums` (train.TrainSums), read and reset now (the one sync of the epoch: NonFiniteLoss
        when the loss is not finite), beside `val` and the learning rate `lr`."""
        from .stopping import check_finite

        p, args = self.progress, self.args
        # {loss, metric...} summed over ranks; note: one sync (and all-reduce) per epoch
        train, seen = sums.take(self.env.dist.sum)
        first_step = p.step - p.batch // args.grad_accum + 1
        check_finite(train["loss"], p.epoch + 1, first_step, p.step)
        sums.reset()
        p.epoch, p.batch, p.samples = p.epoch + 1, 0, p.samples + seen
        row = {
            "epoch": p.epoch,
            "step": p.step,
            "lr": lr,
            **{f"train_{name}": value for name, value in train.items()},
            **{f"val_{name}": value for name, value in val.items()},
            "epoch_time_s": p.epoch_time_s,
            "samples_per_sec": seen / max(p.epoch_time_s, 1e-9),
        }
        p.history.append(row)
        if self.record.ours():  # history.csv, MLflow, run.log
            runs.write_history(self.out, p.history)
            self.record.tracker.log_history()  # history.csv, as just written
            self.log.info(
                f"epoch {p.epoch}/{args.epochs} step {p.step} | lr {row['lr']:.2e} | "
                f"train {metrics_line(row, 'train_')} | val {metrics_line(row, 'val_')} | "
                f"{row['epoch_time_s']:.1f}s {row['samples_per_sec']:.0f} samples/s"
            )
        return row

    def save_best(self, stopper) -> None:
        """best_model.pt: the best weights `stopper` holds (after its update said "new best"),
        a plain state_dict."""
        from .checkpoint import save_weights

        if self.record.ours():
            save_weights(self.out / runs.BEST_MODEL, stopper.best_state)
            best = f"{stopper.best_score:.4g}, epoch {stopper.best_epoch}"
            self.log.info(f"best so far ({best}): best_model.pt")

    def checkpoint(self, every: float) -> None:
        """checkpoint.pt (every object given to resume, progress, RNG, early stopping) once
        `every` seconds have passed since the last (0: now; rank 0's clock decides for all)."""
        if self.env.dist.decide(time.monotonic() - self._saved_at >= every):
            self._save()

    def finish(self, stopper, test: dict[str, float]) -> None:
        """Checkpoint, metrics.json (last: the run is done; strict JSON: finite_or_null):
        `test`'s numbers, the best of `stopper`, the run's steps, times, memory, speed and on
        CUDA the MFU (the model's FLOPs at the run's rate / the GPU's peak); MLflow FINISHED."""
        from .hardware import peak_memory_bytes

        self._save()
        if self.loader is not None:  # the loader's share of the training time
            self.log.info(self.loader.wait_line())
        p, task, args, speed = self.progress, self.env.task, self.args, self.speed
        weights, rate = args.test_weights, p.samples / max(p.train_time_s, 1e-9)
        reason = stop_reason(p, args, stopper)
        metrics = {
            f"best_{task.monitor}": stopper.best_score,
            **{f"test_{name}": test[name] for name in (*task.metrics, "loss")},
            "task": task.name,
            "monitor": task.monitor,
            "best_epoch": stopper.best_epoch,
            # what the test_* numbers describe (--test-weights): best_* stay the monitor's record
            "test_weights": weights,
            "tested_epoch": stopper.best_epoch if weights == "best" else p.epoch,
            "epochs_run": p.epoch,
            "steps": p.step,
            "wall_time_s": p.wall_time_s,
            "train_time_s": p.train_time_s,
            "compile_time_s": p.compile_time_s,
            "samples_per_sec": rate,
            "peak_mem_bytes": peak_memory_bytes(self.env.device),
            "device": str(self.env.device),
            "stop_reason": reason,
        }
        if "peak_flops" in speed:
            metrics["flops_per_sample"] = flops = speed["flops_per_sample"]
            metrics["mfu"] = flops * rate / speed["peak_flops"]
        if "gpu_busy" in speed:
            metrics["gpu_busy_share"] = speed["gpu_busy"]
        mfu = f", MFU {100 * metrics['mfu']:.1f} %" if "mfu" in metrics else ""
        tags = {"stop_reason": reason, "test_weights": weights}
        artifacts = [self.out / runs.HISTORY, self.out / runs.BEST_MODEL]
        if self.env.dist.is_main:  # history.csv written again, before MLflow attaches it
            runs.write_history(self.out, p.history)
        self.record.finished(finite_or_null(metrics), tags=tags, artifacts=artifacts)
        self.log.info(
            f"finished ({reason}): best {task.monitor} {stopper.best_score:.4g} at epoch "
            f"{stopper.best_epoch} | test ({weights} weights) {metrics_line(metrics, 'test_')} | "
            f"{rate:.0f} samples/s{mfu} | {self.out}"
        )
        self.done = True

    # ---- endings -------------------------------------------------------------------------------
    def close(self) -> None:
        if self.record is not None:
            self.record.close()
        elif self.log is not None:
            runs.close_logging(self.log)


# ---- the pieces TrainingJob names ---------------------------------------------------------------
class EpochPace:
    """One epoch's pace, from where it starts (a resumed epoch: mid-way): its training time
    (waiting for the device: the work, not the launches), the progress bar in a terminal or, in
    a log file (nohup, sweeps, Slurm), a run.log line every --log-every seconds from the wall
    clock and the step counter only (no wait for the device); on CUDA, once, the GPU's busy
    share over a few of its steps (hardware.GpuBusy)."""

    def __init__(self, p: Progress, args, data, env, log, *, profile: bool) -> None:
        from tqdm import tqdm

        from .hardware import GpuBusy, timed

        self.args, self.data, self.log, main = args, data, log, env.dist.is_main
        self.now = timed(env.device)
        self.t0, self.first_step, self.resumed_in_epoch = self.now(), p.step, p.batch > 0
        # --progress: tqdm's disable=None shows the bar only when stderr is a terminal (auto)
        off = {"on": False, "off": True, "auto": None}[args.progress] if main else True
        desc, initial = f"epoch {p.epoch + 1}/{args.epochs}", p.batch // args.grad_accum
        self.bar = tqdm(total=data.steps_per_epoch, initial=initial, leave=False, desc=desc,
                        disable=off)  # fmt: skip
        self.every = args.log_every if main and self.bar.disable else 0.0
        self.wall0 = time.monotonic()
        self.line_at = self.wall0 + self.every
        profile = profile and env.device.type == "cuda" and main
        self.busy = GpuBusy(env.device) if profile else None

    def after_step(self, p: Progress) -> None:
        """The bar; every --log-every seconds (a log file), run.log: where the epoch is, its pace
        since the epoch (or the resume) began, and when it ends. Steps are counted as launched:
        on a GPU the pace includes the queue ahead."""
        self.bar.update()
        if self.every and time.monotonic() >= self.line_at:
            args, now, per_epoch = self.args, time.monotonic(), self.data.steps_per_epoch
            self.line_at = now + self.every
            rate = (p.step - self.first_step) / max(now - self.wall0, 1e-9)
            done = p.batch // args.grad_accum
            left = min(per_epoch - done, self.data.total_steps - p.step)
            self.log.info(
                f"epoch {p.epoch + 1}/{args.epochs} step {done}/{per_epoch} | "
                f"{rate:.2f} steps/s {rate * args.batch_size * args.grad_accum:.0f} samples/s | "
                f"epoch ETA {left / max(rate, 1e-9):.0f}s"
            )

    def end(self, p: Progress) -> float:
        """The epoch's training seconds (its GPU profile, if any, closed)."""
        train_s = self.now() - self.t0
        self.bar.close()
        if self.busy is not None:
            self.busy.close(p.step - self.first_step)
        return train_s


def stop_reason(p: Progress, args, stopper) -> str:
    """ "early_stopping" only when patience ended the run before its last step (patience
    that runs out on the last epoch changed nothing)."""
    at_max_steps = bool(args.max_steps) and p.step >= args.max_steps
    if stopper.should_stop and p.epoch < args.epochs and not at_max_steps:
        return "early_stopping"
    return "max_steps" if at_max_steps else "max_epochs"


def room_needed(out, objects) -> int:
    """Disk a run needs: checkpoint (every object's state as it is now, an AdamW's two moments
    of the weights that come with its first step, the best weights) twice during its atomic
    replace, plus best_model.pt; less the checkpoint and best_model.pt a re-run replaces (their
    space is the run's already, and comes back as each new file replaces the old one)."""
    sizes = [tensor_bytes(o.state_dict()) for o in objects if o is not None]
    weights, held = sizes[0], sum(sizes)  # weights: the model's, resume's first object
    ours = [out / name for name in (runs.CHECKPOINT, runs.BEST_MODEL)]  # claimed: none goes
    kept = sum(path.stat().st_size for path in ours if path.is_file())
    return max(2 * (held + 3 * weights) + weights - kept, 0)


def tensor_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state_dict."""
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(state)  # dicts, lists and tuples walked; the rest are leaves
    return sum(t.numel() * t.element_size() for t in leaves if hasattr(t, "element_size"))


def metrics_line(row: dict, prefix: str) -> str:
    """`loss 0.3124 acc 0.9012`: a row's numbers of one split, for run.log."""
    names = [k for k in row if k.startswith(prefix) and isinstance(row[k], int | float)]
    return " ".join(f"{k.removeprefix(prefix)} {row[k]:.4g}" for k in names)


def finite_or_null(metrics: dict) -> dict:
    """metrics.json is strict JSON: a NaN or infinite number becomes null, and `null_reasons`
    says what it was."""
    reasons = {
        k: f"{v} (not finite)"
        for k, v in metrics.items()
        if isinstance(v, float) and not math.isfinite(v)
    }
    return {**metrics, **dict.fromkeys(reasons), "null_reasons": reasons} if reasons else metrics
