"""Train one model: config -> data -> model -> (resume) -> loop -> test -> save.

Usage (copy-paste):
    python run.py                                     # digits (offline), defaults
    python run.py --dataset cifar10 --epochs 30 --seed 1
    python run.py --device cpu --epochs 3 --width 8   # a quick CPU smoke run
    python run.py ARGS --print-run-dir                # where ARGS write (imports no torch)
    python run.py ARGS                                # again: resumes if interrupted, skips if done
    python run.py ARGS --fresh                        # delete that run's files and start over
    python run.py ARGS --find-lr | --find-batch-size | --profile     # tools: report and exit
    python run.py ARGS --tracking off                 # no MLflow (also LAB_TRACKING=off)

Results go to <results-dir>/<dataset>_<changed args>-<hash8>/ (README, "What a run writes"):
config.json, status, history.csv, checkpoint.pt, best_model.pt, metrics.json (only when
finished), run.log, tracking.json. One process at a time trains a run directory (it holds
`.lock`); any number of jobs may share one results folder and one MLflow database.
Exit codes: 0 finished (or already), 1 failed, 2 bad input, 73 running elsewhere (another process
holds this run directory), 75 interrupted (re-run the same command to resume).
Stop signals (SIGTERM, SIGINT, SIGUSR1, SIGHUP, in any number): finish the step, checkpoint, exit
75. A run whose directory is deleted (or its .lock replaced) while it trains stops at its next
epoch end with one `error:` line, writes nothing more and exits 73: the path may be another's now.
"""

import sys
import traceback
from typing import NamedTuple

from labrun import distributed, jobs, runs
from labrun.claim import LostClaim
from labrun.config import UsageError, parse_args, resolved_config, run_dir
from labrun.jobs import (
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    error,
)
from labrun.stopping import GracefulStop

UNREADABLE_HINT = (
    "it changed after its folder was checked (rewritten in place); re-run: the folder is "
    "fingerprinted again (a new data version, a new run directory), the file skipped and listed"
)


def main(argv: list[str] | None = None) -> int:
    # The contract every job shares (jobs.py): --plan, --print-run-dir, skip when done, the
    # claim (exit 73); then train() holds the run directory. Tools run even when it is done.
    # torchrun (distributed.py): one job in N processes; rank 0 alone claims and writes.
    return jobs.lifecycle(argv, parse_args, run_dir, train, redo=is_tool, ranks=True)


def train(args, parser, out, stop: GracefulStop, held, dist) -> int:
    """The method: config -> data -> model -> (resume) -> loop -> test -> save."""
    import torch

    from labrun import checkpoint as ckpt
    from labrun.hardware import (
        choose_precision,
        resolve_device,
        setup_backends,
    )
    from labrun.state import TrainingState
    from labrun.stopping import EarlyStopping, check_finite
    from labrun.tasks import create_task
    from labrun.train import (
        build_trainer,
        evaluate,
        peak_epoch,
        seed_everything,
    )

    # ---- config + data: every bad input is found here, before a file of the run is written ----
    config = resolved_config(args, parser)
    config["world_size"] = dist.world  # processes of this job (torchrun), not of its identity
    try:
        runs.check_ownership(out)  # a colleague's run directory, or files planted in ours
        task = create_task(args.task, args, args.monitor)  # loss, metrics, the monitored one
        config.update(monitored=task.monitor, metric_directions=task.directions)
        dist.check(args)  # a --batch-size that does not divide among the processes: exit 2
        device = dist.place(resolve_device(args.device))
        dtype, precision_why = choose_precision(device, args.amp)
        if args.profile:  # the CUDA memory snapshot then covers the whole run, model included
            from labrun.tuning import start_memory_history

            start_memory_history(device)
        data = build_data(args, device, task, dist.shard)
        dist.check_splits({name: len(split) for name, split in data.splits.items()})
        # num_classes, channels, image_size, class_names, split sizes, the arrays' content hash
        config.update(data.info.as_config())
        seed_everything(args.seed)  # same seed => same init, split, order, augmentation
        model = make_model(args, data.info)
        model = dist.prepare(model, args.seed).to(device, memory_format=torch.channels_last)
        if dist.is_main:
            try:
                runs.ensure_writable(out, need_bytes=checkpoint_bytes(model, args.ema))
            except OSError as exc:  # not writable, or no room for a checkpoint
                raise UsageError(f"--results-dir: {exc.strerror or exc}") from exc
        why, code = "", None
    except (UsageError, ValueError, OSError) as exc:
        why, code = str(exc), error(str(exc), EXIT_USAGE)
    # torchrun: a refusal on any rank, or a stop while starting, ends every rank here
    if (code := dist.settle(code, stop, why)) is not None:
        return code

    # ---- model, its training step and the resumable state ------------------------------------
    if dist.is_main:  # one writer
        out.mkdir(parents=True, exist_ok=True)
        if args.fresh:
            print(f"--fresh: deleting {', '.join(runs.clear_run_dir(out)) or 'nothing'} in {out}")
        runs.remove_stale_temps(out)
    log = runs.setup_logging(out, out.name) if dist.is_main else dist.follower_log(out.name)
    dist.agree(None)  # the others read the checkpoint once --fresh has deleted it
    stop.log = log  # from here on, stop requests are in run.log too
    for note in data.notes:  # e.g. skipped unreadable images: in run.log, not only on screen
        log.warning("data: %s", note)
    version = config["data_version"] or config.get("data_content")  # files | arrays
    log.info("data: %s images (train/val/test) | %s", config["split_sizes"], version)
    steps = total_steps(args, data.steps_per_epoch)
    for what, why in (
        ("precision", precision_why),
        ("kernels", setup_backends(device, args.deterministic)),
        ("augmentation", "off: per-pixel targets" if task.spatial_targets else "crop + flip"),
    ):
        log.info("%s: %s", what, why)
    if dist.active:
        log.info("distributed: %s", dist.describe())
    trainer = build_trainer(
        model,
        args,
        device=device,
        dtype=dtype,
        compile_mode=None,  # warm_up compiles where it pays, once it has timed a real batch
        total_steps=steps,
        log=log,
        task=task,
    )
    trainer.ddp = dist.ddp(model)  # torchrun: gradients all-reduced over the processes
    # Patience counts only after the LR peak and --min-epochs: no stop during the warm-up.
    patience_from = max(args.min_epochs, peak_epoch(steps, data.steps_per_epoch))
    stopper = EarlyStopping(
        args.patience, start_epoch=patience_from, mode=task.direction(task.monitor)
    )
    state = TrainingState(
        trainer, stopper, device=device, config_hash=config["config_hash"], dist=dist
    )
    if is_tool(args):
        if args.profile:  # profile the step the run would take, compiled where it would be
            warm_up(state, data, args, log)
        return run_tools(args, trainer, data, device, dtype, out, log)
    if changed := changed_data(out, config):  # arrays: a resume on other data is refused
        log.error("cannot resume: %s", changed)
        if dist.is_main:  # one writer
            runs.try_write_status(out, "refused")
        runs.close_logging(log)
        return error(changed, EXIT_USAGE)
    try:
        if state.resume(out / runs.CHECKPOINT, out / runs.BEST_MODEL, log):  # (resume)
            log.info(
                "resuming %s at epoch %d, step %d",
                out,
                state.progress.epoch + 1,
                state.progress.step,
            )
    except ckpt.CheckpointError as exc:  # refused for good: the planner must not say "resumes"
        log.error("cannot resume: %s", exc)
        if dist.is_main:
            runs.try_write_status(out, "refused")
        runs.close_logging(log)
        return error(f"cannot resume: {exc}", EXIT_USAGE)
    try:
        record = (
            RunRecord(out, config, args, device, dtype, log, held)
            if dist.is_main
            else distributed.Follower(out, log, dist)
        )
    except LostClaim as exc:  # the directory was deleted while the data loaded
        runs.close_logging(log)
        return error(str(exc), EXIT_BUSY)
    except OSError as exc:  # e.g. the disk filled since the start-up check
        runs.try_write_status(out, "failed")
        runs.close_logging(log)
        return error(f"{exc.strerror} writing {exc.filename or out}", EXIT_FAILED)
    stop.on_force_exit = record.force_exited  # exit 130 leaves "interrupted", not "running"

    # ---- loop -----------------------------------------------------------------------------------
    p, loaders, steps_per_epoch = state.progress, data.loaders, data.steps_per_epoch
    eval_model = trainer.ema.module if trainer.ema is not None else model  # EMA is what we test
    try:
        log.info(
            "run %s on %s | %d steps/epoch | %s",
            out.name,
            device,
            steps_per_epoch,
            record.tracker_line(),
        )
        warm_up(state, data, args, log)  # compiling: its own step, outside the timed loop
        while not finished(p, args, steps_per_epoch, state.stopper):
            train_s = train_epoch(state, loaders["train"], steps_per_epoch, args, stop, dist)
            if not epoch_complete(p, args, steps_per_epoch):
                break  # stopped mid-epoch: the checkpoint below records where in the epoch
            # {loss, metric...} summed over ranks; note: one sync (and all-reduce) per epoch
            train, seen = trainer.take_sums(dist.sum)
            check_finite(train["loss"], p.epoch + 1, first_step_of_epoch(p, args), p.step)
            trainer.reset_sums()
            dist.sync_buffers(eval_model)  # CPU torchrun: rank 0's BatchNorm statistics
            val = evaluate(
                eval_model, loaders["val"], device=device, dtype=dtype, task=task, reduce=dist.sum
            )
            p.epoch, p.batch, p.samples = p.epoch + 1, 0, p.samples + seen
            p.history.append(
                {
                    "epoch": p.epoch,
                    "step": p.step,
                    "lr": trainer.scheduler.get_last_lr()[0],
                    **{f"train_{name}": value for name, value in train.items()},
                    **{f"val_{name}": value for name, value in val.items()},
                    "epoch_time_s": train_s,
                    "samples_per_sec": seen / max(train_s, 1e-9),
                }
            )
            if state.stopper.update(p.history[-1][task.monitor], p.epoch, eval_model):
                record.save_best(state)  # keep the best, never test
            record.epoch_done(state, checkpoint_due=dist.decide(record.checkpoint_due(args)))
            if dist.stopped(stop):
                break
        if not finished(p, args, steps_per_epoch, state.stopper):  # stopped: checkpoint, exit 75
            record.checkpoint(state)
            record.interrupted(state, stop.requested or "a stop signal to another process")
            return EXIT_INTERRUPTED

        # ---- test once, with the best weights; save ---------------------------------------------
        state.stopper.restore(eval_model)
        test = evaluate(
            eval_model, loaders["test"], device=device, dtype=dtype, task=task, reduce=dist.sum
        )
        record.checkpoint(state)
        record.finished(state, task, test, stop_reason(p, args, state.stopper))
        return EXIT_OK
    except Exception as exc:  # failed: one line here, the traceback in run.log and MLflow
        return record.failed(state, exc, args)
    finally:
        record.close()


# ---- the pieces main() and train() name --------------------------------------------------------
def is_tool(args) -> bool:
    return bool(args.find_lr or args.find_batch_size or args.profile)


class Data(NamedTuple):
    splits: dict
    loaders: dict
    steps_per_epoch: int
    info: object  # data.DatasetInfo: classes, channels, image size, class names, split sizes
    notes: list  # what the dataset has to say (skipped files): logged into run.log


def build_data(args, device, task, shard: tuple[int, int] = (0, 1)) -> Data:
    """Splits, loaders, optimizer steps per epoch; UsageError for sizes that cannot work."""
    from labrun.data import build_loader, check_batch_size, load_dataset
    from labrun.hardware import choose_gpu_resident

    loaded = load_dataset(
        args.dataset,
        args.data_dir,
        data_path=args.data_path,
        image_size=args.image_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        synthetic_size=args.synthetic_size,
        mode=args.data_mode,
        workers=args.workers,
        data_version=args.data_version,  # the version in the run's identity (dataversion.py)
        task=args.task,  # datasets that offer several kinds of targets (synthetic) pick by it
    )
    splits = loaded.splits
    # Only decoded in-memory data can live on the GPU; streamed files come through workers.
    resident = loaded.mode == "memory" and choose_gpu_resident(args.gpu_resident, device, splits)
    loaders = {
        name: build_loader(
            split,
            args.batch_size,
            train=name == "train",
            device=device,
            workers=args.workers,
            gpu_resident=resident,
            seed=args.seed,
            augment=not task.spatial_targets,  # crop/flip would not move per-pixel targets
            shard=shard,
        )
        for name, split in splits.items()
    }
    # Optimizer steps per epoch; a trailing remainder of < grad_accum micro-batches is skipped.
    steps_per_epoch = len(loaders["train"]) // args.grad_accum
    check_batch_size(len(splits["train"]), args.batch_size, args.grad_accum)  # small data
    if len(splits["val"]) == 0:
        raise UsageError("--val-fraction: the validation split is empty; raise it")
    return Data(splits, loaders, steps_per_epoch, loaded.info, loaded.notes)


def changed_data(out, config: dict) -> str | None:
    """Why this run directory must not resume: it began on other data (arrays keep their run
    name across data versions; their content hash is compared here)."""
    from labrun.dataversion import changed_since

    if not (out / runs.CHECKPOINT).is_file():  # nothing to resume: it starts on today's data
        return None
    try:
        before = runs.read_json(out / runs.CONFIG)
    except (OSError, ValueError):
        return None
    return changed_since(before, config, out)


def make_model(args, info):
    """The registered --model, sized for this dataset (a misfit is bad input: ValueError)."""
    from labrun.models import create_model

    return create_model(
        args.model,
        num_classes=info.num_classes,
        channels=info.channels,
        image_size=info.image_size,
        width=args.width,
    )


def checkpoint_bytes(model, ema: float) -> int:
    """Disk a run needs: checkpoint (weights, two AdamW moments, EMA, best weights) twice during
    its atomic replace, plus best_model.pt."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return weights * (2 * (4 + (ema > 0)) + 1)


def total_steps(args, steps_per_epoch: int) -> int:
    steps = steps_per_epoch * args.epochs
    return min(steps, args.max_steps) if args.max_steps else steps  # the schedule ends exactly


def finished(p, args, steps_per_epoch: int, stopper) -> bool:
    return (
        p.epoch >= args.epochs
        or p.step >= total_steps(args, steps_per_epoch)
        or stopper.should_stop
    )


def epoch_complete(p, args, steps_per_epoch: int) -> bool:
    return p.batch >= steps_per_epoch * args.grad_accum or p.step >= total_steps(
        args, steps_per_epoch
    )


def first_step_of_epoch(p, args) -> int:
    return p.step - p.batch // args.grad_accum + 1


def stop_reason(p, args, stopper) -> str:
    """Why the run ended: "early_stopping" only when patience ended it before its last step
    (patience that runs out on the last epoch changed nothing)."""
    at_max_steps = bool(args.max_steps) and p.step >= args.max_steps
    if stopper.should_stop and p.epoch < args.epochs and not at_max_steps:
        return "early_stopping"
    return "max_steps" if at_max_steps else "max_epochs"


def warm_up(state, data: Data, args, log) -> None:
    """Compile the step where it pays, before the timed loop: eager passes on a real batch of
    the loader time the steps left, against the compile time recorded for this model and machine
    (hardware.compile_if_it_pays; auto on CPU stays eager and measures nothing). The Trainer and
    peek_batch put back all they touch, so the run goes on as if this had not happened.
    Compile time is summed over resumes: every compile of the run was paid for."""
    from labrun.config import PROJECT_ROOT
    from labrun.hardware import compile_if_it_pays

    p, trainer = state.progress, state.trainer
    p.compile_time_s += compile_if_it_pays(
        trainer,
        lambda: peek_batch(data.loaders["train"], p.epoch, trainer.device),
        steps=total_steps(args, data.steps_per_epoch) - p.step,
        flag=args.compile,
        deterministic=args.deterministic,
        project_root=PROJECT_ROOT,
        log=log,
    )


def peek_batch(loader, epoch: int, device):
    """A batch exactly as the loop gets it (shape, dtype, strides: a batch of zeros differs in
    strides for 1-channel data, and the compiled graph would recompile on the first real batch),
    without shifting the run: the loader's order is a function of (seed, epoch) and train_epoch
    sets the epoch again; the RNG draws of the augmentation are put back."""
    from labrun.checkpoint import rng_state, set_rng_state

    saved = rng_state(device)
    loader.set_epoch(epoch)
    batches = iter(loader)
    try:
        return next(batches)
    finally:
        getattr(batches, "close", lambda: None)()  # a generator: stop its workers now
        set_rng_state(saved, device)


def train_epoch(state, loader, steps_per_epoch: int, args, stop, dist) -> float:
    """Optimizer steps until the epoch ends, the run's last step, or a stop request.

    Returns the seconds of training of the whole epoch, those before a resume in it included,
    so that its rate counts the samples of the steps timed. The loader's order is a function
    of (seed, epoch), so a resumed epoch skips the micro-batches it already did and continues.
    """
    from labrun.hardware import timed

    p, trainer = state.progress, state.trainer
    resumed_in_epoch = p.batch > 0
    now = timed(trainer.device)  # waits for the device: times the work, not the launches
    loader.set_epoch(p.epoch, skip_batches=p.batch)
    batches, last = iter(loader), total_steps(args, steps_per_epoch)
    bar = progress_bar(args, steps_per_epoch, p) if dist.is_main else None
    trainer.model.train()
    t0 = now()
    while p.batch < steps_per_epoch * args.grad_accum and p.step < last:
        if dist.stopped(stop, p.step):  # stop.requested; torchrun: on any rank, every 10 steps
            break
        trainer.step([next(batches) for _ in range(args.grad_accum)], p.step + 1)
        p.step, p.batch = p.step + 1, p.batch + args.grad_accum
        if bar is not None:
            bar.update()
    train_s = now() - t0
    if bar is not None:
        bar.close()
    p.train_time_s += train_s
    p.epoch_time_s = train_s + (p.epoch_time_s if resumed_in_epoch else 0.0)
    return p.epoch_time_s


def progress_bar(args, steps_per_epoch: int, p):
    if not (args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())):
        return None
    from tqdm import tqdm

    return tqdm(
        total=steps_per_epoch,
        initial=p.batch // args.grad_accum,
        leave=False,
        desc=f"epoch {p.epoch + 1}/{args.epochs}",
    )


def run_tools(args, trainer, data: Data, device, dtype, out, log) -> int:
    """--find-lr, --find-batch-size, --profile: measure, report, exit without training."""
    from labrun.train import build_optimizer
    from labrun.tuning import (
        find_batch_size,
        find_lr,
        profile_training,
        recommend_batch_size,
    )

    try:
        if args.find_lr:
            lr = find_lr(
                trainer.model,
                data.loaders["train"],
                trainer.task.loss,
                lambda m: build_optimizer(m, args.lr, args.weight_decay, device),
                device=device,
                amp_dtype=dtype,
                out_dir=out,
            )
            print(f"suggested --lr {lr:.3g} (plot in {out})")
        if args.find_batch_size:
            info = data.info
            size = find_batch_size(
                lambda: make_model(args, info),
                device=device,
                amp_dtype=dtype,
                start=args.batch_size,
                max_batch=len(data.splits["train"]),
                input_shape=(info.channels, *info.image_size),
                loss_fn=trainer.task.loss,
                targets=data.splits["train"].labels,
            )
            batch, lr = recommend_batch_size(size, device)
            print(
                f"largest batch size that fits: {size}; recommended on this device (pass "
                f"it: the default stays 128): --batch-size {batch} --lr {lr:.3g}"
            )
        if args.profile:
            print(profile_training(trainer, data.loaders["train"], out_dir=out))
    finally:
        runs.close_logging(log)
    return EXIT_OK


def metrics_line(row: dict, prefix: str) -> str:
    """`loss 0.3124 acc 0.9012`: a row's numbers of one split, for run.log."""
    names = [k for k in row if k.startswith(prefix) and not isinstance(row[k], str)]
    return " ".join(f"{k.removeprefix(prefix)} {row[k]:.4g}" for k in names)


class RunRecord:
    """What the run leaves behind: its files (config, status, history, checkpoint, metrics) and
    its MLflow run. Every fault path here is best-effort: a full disk or a dead tracker never
    turns an ending run into a traceback. Before each write it checks that the run directory is
    still this process's (`claim.check()`): if it was deleted meanwhile, LostClaim, and nothing
    more is written there."""

    def __init__(self, out, config: dict, args, device, dtype, log, claim) -> None:
        import time

        from labrun.tracking import Tracker, provenance, run_params

        self.out, self.log, self.device, self._time = out, log, device, time
        self.claim = claim
        claim.check()
        self.epochs = args.epochs
        self.last_checkpoint = time.monotonic()
        runs.write_json(out / runs.CONFIG, config)
        runs.write_status(out, "running")
        self.tracker = Tracker(
            out,
            enabled=args.tracking == "on",
            experiment=args.experiment,
            run_name=out.name,
            log=log,
            params=run_params(config),  # with `experiment_keys`: what plot.py --from-mlflow reads
            tags={
                **provenance(log),
                "run_dir": str(out),
                "device": str(device),
                "amp_dtype": str(dtype),
                "compile": args.compile,
                "workers": str(args.workers),
                "world_size": str(config["world_size"]),
            },
        )

    def tracker_line(self) -> str:
        if not self.tracker.enabled:
            return "MLflow off"
        return f"MLflow run {self.tracker.run_id or 'not reached (continuing without)'}"

    def checkpoint_due(self, args) -> bool:
        return self._time.monotonic() - self.last_checkpoint >= args.checkpoint_every

    def save_best(self, state) -> None:
        self.claim.check()
        state.save_best(self.out / runs.BEST_MODEL)

    def checkpoint(self, state) -> None:
        self.claim.check()
        state.save(self.out / runs.CHECKPOINT)
        self.last_checkpoint = self._time.monotonic()

    def epoch_done(self, state, *, checkpoint_due: bool) -> None:
        p, row = state.progress, state.progress.history[-1]
        self.claim.check()
        if checkpoint_due:
            self.checkpoint(state)
        runs.write_history(self.out, p.history)
        self.tracker.log_history(p.history)
        self.log.info(
            "epoch %d/%d step %d | lr %.2e | train %s | val %s%s | %.1fs %.0f img/s",
            p.epoch,
            self.epochs,
            p.step,
            row["lr"],
            metrics_line(row, "train_"),
            metrics_line(row, "val_"),
            " *" if state.stopper.best_epoch == p.epoch else "",
            row["epoch_time_s"],
            row["samples_per_sec"],
        )

    def interrupted(self, state, signal_name: str) -> None:
        self.claim.check()
        runs.write_status(self.out, "interrupted")
        self.tracker.end("KILLED", state.progress.history)
        self.log.warning(
            "interrupted by %s at step %d; re-run the same command to resume",
            signal_name,
            state.progress.step,
        )

    def force_exited(self) -> None:
        """Exit 130 (a second Ctrl-C, a late signal): the last checkpoint resumes the run."""
        if self.claim.still_ours() and not runs.is_done(self.out):
            runs.try_write_status(self.out, "interrupted")

    def finished(self, state, task, test: dict[str, float], reason: str) -> None:
        from labrun.hardware import peak_memory_bytes

        p, stopper = state.progress, state.stopper
        metrics = {
            f"best_{task.monitor}": stopper.best_score,
            **{f"test_{name}": test[name] for name in (*task.metrics, "loss")},
            "task": task.name,
            "monitor": task.monitor,
            "best_epoch": stopper.best_epoch,
            "epochs_run": p.epoch,
            "steps": p.step,
            "wall_time_s": p.wall_time_s,
            "train_time_s": p.train_time_s,
            "compile_time_s": p.compile_time_s,
            "samples_per_sec": p.samples / max(p.train_time_s, 1e-9),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "device": str(self.device),
            "stop_reason": reason,
            "mlflow_run_id": self.tracker.run_id,
        }
        self.claim.check()
        runs.write_history(self.out, p.history)
        self.tracker.end(
            "FINISHED",
            p.history,
            metrics=metrics,
            tags={"stop_reason": reason},
            artifacts=[self.out / name for name in (runs.CONFIG, runs.HISTORY, runs.BEST_MODEL)],
        )
        self.claim.check()  # again: the tracker's end may have taken a while
        runs.write_status(self.out, "finished")
        runs.write_json(self.out / runs.METRICS, metrics)  # last: its existence means "done"
        self.log.info(
            "finished (%s): best %s %.4g at epoch %d | test %s | %s",
            reason,
            task.monitor,
            stopper.best_score,
            stopper.best_epoch,
            metrics_line(metrics, "test_"),
            self.out,
        )

    def failed(self, state, exc: BaseException, args) -> int:
        import torch

        if not self.claim.still_ours():  # LostClaim, or any failure once the path is another's
            message = str(exc)
            if not isinstance(exc, LostClaim):
                message = f"{self.claim.lost_message()} (then {type(exc).__name__})"
            self.log.error("%s", message)
            self.tracker.abandon(message)
            return error(message, EXIT_BUSY)
        text = traceback.format_exc()
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        for rank, theirs in distributed.peer_failures():  # torchrun: the cause, from its rank
            text += f"\nthe cause, on rank {rank}:\n{theirs}"
            message = f"rank {rank} failed: {theirs.strip().splitlines()[-1]}"
        self.log.error("run failed:\n%s", text)
        runs.try_write_status(self.out, "failed")
        self.tracker.end("FAILED", state.progress.history, error=text)
        from labrun.imagefolder import UnreadableImage

        if isinstance(exc, UnreadableImage):  # changed since the scan: bad input, not a retry
            from labrun.dataversion import forget

            forget(args.data_path, args.data_dir)  # the next start fingerprints every file
            return error(f"{exc}; {UNREADABLE_HINT}", EXIT_USAGE)
        if isinstance(exc, torch.OutOfMemoryError):
            message = (
                f"out of memory at --batch-size {args.batch_size}; try --find-batch-size, "
                "or a smaller --batch-size with --grad-accum"
            )
        elif runs.is_disk_error(exc):
            message = (
                f"{exc.strerror} writing {exc.filename or self.out}: the run stopped; its "
                "last complete checkpoint is kept (free space, then re-run to resume)"
            )
        return error(message, EXIT_FAILED)

    def close(self) -> None:
        self.tracker.close()
        runs.close_logging(self.log)


if __name__ == "__main__":
    sys.exit(main())
