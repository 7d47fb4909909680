"""Train one model: config -> setup -> data -> model -> optimizer -> loop -> save.

Usage (copy-paste):
    python run.py                                     # digits (offline), defaults
    python run.py --dataset cifar10 --epochs 30 --seed 1
    python run.py --device cpu --epochs 3 --width 8   # a quick CPU smoke run
    python run.py ARGS --print-run-dir                # where ARGS write (imports no torch)
    python run.py ARGS                                # again: resumes if interrupted, skips if done
    python run.py ARGS --fresh                        # delete that run's files and start over
    python run.py ARGS --find-lr | --find-batch-size | --profile     # tools: report and exit
    python run.py --init-tracking                     # create the MLflow DB once (run.sh does it)

Results go to <results-dir>/<dataset>_<changed args>-<hash8>/ (docs/design.md): config.json,
status, history.csv, checkpoint.pt, best_model.pt, metrics.json (only when finished), run.log.
Exit codes: 0 finished (or already), 1 failed, 2 bad input, 75 interrupted (re-run to resume).
Ctrl-C / SIGTERM / SIGUSR1: finish the step, checkpoint, exit 75; a second Ctrl-C exits at once.
"""

import sys
import time
import traceback

from {{ cookiecutter.package_name }} import runs
from {{ cookiecutter.package_name }}.claim import Busy, claim
from {{ cookiecutter.package_name }}.config import (
    PROJECT_ROOT,
    UsageError,
    parse_args,
    resolved_config,
    run_dir,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 75
EXIT_BUSY = 73  # another live process holds this run directory (claim.py): "running elsewhere"


def error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    # ---- config: cheap answers first, before importing torch (~2 s) -------------------------
    started = time.perf_counter()
    # -- sweep helper (run.sh): plan many jobs in one call; no torch (plan.py) --
    if (sys.argv[1:] if argv is None else argv) == ["--plan"]:
        from {{ cookiecutter.package_name }} import plan

        return plan.main()
    # -- end sweep helper --
    args, parser = parse_args(argv)
    out = run_dir(args, parser)
    if args.print_run_dir:
        print(out)
        return EXIT_OK
    if args.init_tracking:
        from {{ cookiecutter.package_name }}.tracking import init, tracking_uri

        print(f"MLflow ready: {tracking_uri()} (experiment id {init(args.experiment)})")
        return EXIT_OK
    tool = args.find_lr or args.find_batch_size or args.profile
    if runs.is_done(out) and not (args.fresh or tool):
        print(f"already finished: {out} (metrics.json exists; --fresh re-trains)")
        return EXIT_OK

    import torch  # noqa: I001 (the train import below is kept compact on purpose)
    from torch import nn

    from {{ cookiecutter.package_name }} import checkpoint as ckpt
    from {{ cookiecutter.package_name }}.data import NUM_CLASSES, build_loader, load_dataset
    from {{ cookiecutter.package_name }}.model import build_model
    from {{ cookiecutter.package_name }}.train import (
        EarlyStopping, GracefulStop, Trainer, amp_dtype, build_ema, build_optimizer,
        build_scheduler, check_finite, choose_gpu_resident, evaluate, peak_memory_bytes,
        resolve_device, seed_everything, setup_backends, timed, use_compile,
    )

    # ---- setup + data: every bad input is found here, before a single file is written -------
    config = resolved_config(args, parser)
    try:
        device = resolve_device(args.device)
        dtype = amp_dtype(device, args.amp)
        runs.ensure_writable(args.results_dir)
        splits = load_dataset(args.dataset, args.data_dir, val_fraction=args.val_fraction,
                              seed=args.seed, synthetic_size=args.synthetic_size)
        resident = choose_gpu_resident(args.gpu_resident, device, splits)
        loaders = {
            name: build_loader(split, args.batch_size, train=name == "train", device=device,
                               workers=args.workers, gpu_resident=resident, seed=args.seed)
            for name, split in splits.items()
        }
        # Optimizer steps per epoch; a trailing remainder of < grad_accum micro-batches is skipped.
        steps_per_epoch = len(loaders["train"]) // args.grad_accum
        micro_per_epoch = steps_per_epoch * args.grad_accum
        if steps_per_epoch == 0:
            raise UsageError(f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} "
                             f"is larger than the training set ({len(splits['train'])} "
                             "images): not one full optimizer step per epoch")
        if len(splits["val"]) == 0:
            raise UsageError("the validation split is empty: raise --val-fraction")
        # -- sweep helper: one live process per run directory (claim.py), held until main
        #    returns; checked for done again once claimed: it may have finished meanwhile --
        try:
            held = claim(out)  # noqa: F841 (kept alive: the claim lasts as long as this name)
        except Busy as exc:
            return error(f"running elsewhere: {exc}", EXIT_BUSY)
        if runs.is_done(out) and not (args.fresh or tool):
            print(f"already finished: {out} (metrics.json exists; --fresh re-trains)")
            return EXIT_OK
        # -- end sweep helper --
        if args.fresh and out.exists():
            print(f"--fresh: deleting {', '.join(runs.clear_run_dir(out)) or 'nothing'} in {out}")
        resume = None
        if (out / runs.CHECKPOINT).exists() and not tool:
            resume = ckpt.load(out / runs.CHECKPOINT, config_hash=config["config_hash"])
    except (UsageError, ValueError, OSError, ckpt.CheckpointError) as exc:
        return error(str(exc), EXIT_USAGE)

    # ---- model + optimizer --------------------------------------------------------------------
    seed_everything(args.seed)  # same seed => same init, split, order, augmentation
    model = build_model(NUM_CLASSES, args.width).to(device, memory_format=torch.channels_last)
    optimizer = build_optimizer(model, args.lr, args.weight_decay, device)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)  # the schedule ends exactly at the last step
    scheduler = build_scheduler(optimizer, args.lr, total_steps)
    ema = build_ema(model, args.ema)
    eval_model = ema.module if ema is not None else model  # EMA weights are what we evaluate
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    eval_loss_fn = nn.CrossEntropyLoss()  # plain CE, comparable across --label-smoothing values
    out.mkdir(parents=True, exist_ok=True)
    log = runs.setup_logging(out, out.name)
    setup_backends(device, args.deterministic, log)
    trainer = Trainer(model, optimizer, scheduler, loss_fn, device=device, dtype=dtype,
                      grad_accum=args.grad_accum, clip_grad=args.clip_grad, ema=ema,
                      compile_model=use_compile(device, args.compile), log=log)

    # ---- tools: measure something and exit without training ------------------------------------
    if tool:
        from {{ cookiecutter.package_name }}.tuning import find_batch_size, find_lr, profile_steps

        if args.find_lr:
            lr = find_lr(model, loaders["train"], loss_fn,
                         lambda m: build_optimizer(m, args.lr, args.weight_decay, device),
                         device=device, amp_dtype=dtype, out_dir=out)
            print(f"suggested --lr {lr:.3g} (plot in {out})")
        if args.find_batch_size:
            size = find_batch_size(lambda: build_model(NUM_CLASSES, args.width), device=device,
                                   amp_dtype=dtype, start=args.batch_size,
                                   max_batch=len(splits["train"]))
            print(f"largest batch size that fits: {size}")
        if args.profile:
            loaders["train"].set_epoch(0)
            table = profile_steps(lambda x, y: trainer.step([(x, y)], 0), loaders["train"],
                                  device=device, out_dir=out)
            print(table)
        runs.close_logging(log)
        return EXIT_OK

    # ---- state: fresh, or everything the checkpoint holds --------------------------------------
    config["code_version"], _dirty = runs.git_state(PROJECT_ROOT)
    stopper = EarlyStopping(args.patience)
    epoch, batch, step, history = 0, 0, 0, []  # epoch = epochs completed; batch = micro-batches
    times = {"wall_time_s": 0.0, "train_time_s": 0.0, "compile_time_s": 0.0, "samples": 0}
    run_id = None
    if resume is not None:
        try:
            ckpt.load_model_state(model, resume["model"], f"{out / runs.CHECKPOINT}")
            optimizer.load_state_dict(resume["optimizer"])
            scheduler.load_state_dict(resume["scheduler"])
            trainer.scaler.load_state_dict(resume["scaler"])
            if ema is not None:
                ema.load_state_dict(resume["ema"])
            stopper.load_state_dict(resume["early_stopping"])
            trainer.load_sums_state(resume["sums"])
            epoch, batch, step = resume["epoch"], resume["batch"], resume["step"]
            history, times, run_id = resume["history"], resume["times"], resume["mlflow_run_id"]
        except (KeyError, ValueError, ckpt.CheckpointError) as exc:
            runs.close_logging(log)
            return error(f"cannot resume from {out / runs.CHECKPOINT}: {exc}", EXIT_USAGE)
        log.info("resuming %s at epoch %d, step %d (micro-batch %d)", out, epoch + 1, step, batch)
    runs.write_json(out / runs.CONFIG, config)
    runs.write_status(out, "running")

    def snapshot() -> dict:  # the full state: enough to continue as if never stopped
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": trainer.scaler.state_dict(),
                "ema": ema.state_dict() if ema is not None else None,
                "early_stopping": stopper.state_dict(), "sums": trainer.sums_state(),
                "rng": ckpt.rng_state(), "epoch": epoch, "batch": batch, "step": step,
                "history": history, "times": times, "mlflow_run_id": tracker.run_id,
                "config_hash": config["config_hash"]}

    # ---- loop ---------------------------------------------------------------------------------
    from {{ cookiecutter.package_name }}.tracking import Tracker, provenance

    tracker, now = None, timed(device)
    try:
        with GracefulStop(log, lambda: runs.write_status(out, "interrupted")) as stop:
            tracker = Tracker(args.experiment, out.name, run_id=run_id,
                              params={**config, "amp_dtype": dtype, "total_steps": total_steps},
                              tags={**provenance(), "run_dir": str(out)})
            log.info("run %s on %s | amp %s | compile %s | %d steps/epoch | MLflow run %s",
                     out.name, device, dtype, trainer.compiled, steps_per_epoch, tracker.run_id)
            if resume is not None:
                ckpt.set_rng_state(resume["rng"])  # last, so nothing above consumes random numbers
            progress = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
            t_first = None  # end of the first compiled step: compile time is measured once
            first_compile = trainer.compiled
            while epoch < args.epochs and step < total_steps and not stopper.should_stop:
                t_epoch = time.perf_counter()
                loaders["train"].set_epoch(epoch, skip_batches=batch)  # order = f(seed, epoch)
                batches = iter(loaders["train"])
                model.train()
                bar = None
                if progress:
                    from tqdm import tqdm

                    bar = tqdm(total=steps_per_epoch, initial=batch // args.grad_accum, leave=False,
                               desc=f"epoch {epoch + 1}/{args.epochs}")
                t0 = now()
                steps_before = step
                while batch < micro_per_epoch and step < total_steps:
                    trainer.step([next(batches) for _ in range(args.grad_accum)], step + 1)
                    step, batch = step + 1, batch + args.grad_accum
                    if first_compile:  # the first compiled step = compile + one normal step
                        t_first, first_compile = now(), False
                    if bar is not None:
                        bar.update()
                    if stop.requested:
                        break
                t1 = now()
                if bar is not None:
                    bar.close()
                train_s = t1 - t0
                if t_first is not None and step - steps_before > 1:  # compile time = first step
                    normal = (t1 - t_first) / (step - steps_before - 1)  # minus a normal step
                    times["compile_time_s"] = max(t_first - t0 - normal, 0.0)
                    train_s, t_first = train_s - times["compile_time_s"], None
                times["train_time_s"] += train_s
                if stop.requested and batch < micro_per_epoch and step < total_steps:
                    break  # mid-epoch: the checkpoint below records where we are in this epoch
                # note: sync point, once per epoch (the step loop above never waits for the GPU)
                train_loss, train_acc, seen = trainer.take_sums()
                check_finite(train_loss, epoch + 1, steps_before + 1, step)
                times["samples"] += seen
                val_loss, val_acc = evaluate(eval_model, loaders["val"], eval_loss_fn,
                                             device=device, dtype=dtype)
                epoch, batch = epoch + 1, 0
                if stopper.update(val_acc, epoch, eval_model):  # keep the best weights, never test
                    ckpt.save(out / runs.BEST_MODEL, stopper.best_state)
                row = {"epoch": epoch, "step": step, "lr": scheduler.get_last_lr()[0],
                       "train_loss": train_loss, "train_acc": train_acc, "val_loss": val_loss,
                       "val_acc": val_acc, "epoch_time_s": time.perf_counter() - t_epoch,
                       "samples_per_sec": seen / max(train_s, 1e-9)}
                history.append(row)
                trainer.reset_sums()
                times["wall_time_s"] += time.perf_counter() - started
                started = time.perf_counter()
                ckpt.save(out / runs.CHECKPOINT, snapshot())
                runs.write_history(out, history)
                tracker.log_metrics({k: row[k] for k in list(row)[2:]}, step=epoch)
                log.info("epoch %d/%d step %d | lr %.2e | train %.4f %.2f%% | val %.4f %.2f%%%s | "
                         "%.1fs %.0f img/s", epoch, args.epochs, step, row["lr"], train_loss,
                         100 * train_acc, val_loss, 100 * val_acc,
                         " *" if stopper.best_epoch == epoch else "", row["epoch_time_s"],
                         row["samples_per_sec"])
                if stop.requested:
                    break
            done = epoch >= args.epochs or step >= total_steps or stopper.should_stop
            if stop.requested and not done:  # interrupted: checkpoint, KILLED, exit 75
                times["wall_time_s"] += time.perf_counter() - started
                ckpt.save(out / runs.CHECKPOINT, snapshot())
                runs.write_status(out, "interrupted")
                tracker.finish("KILLED")
                log.warning("interrupted by %s at step %d; re-run the same command to resume",
                            stop.requested, step)
                return EXIT_INTERRUPTED

            # ---- save: restore the best weights, test once, write metrics last ---------------
            stopper.restore(eval_model)
            test_loss, test_acc = evaluate(eval_model, loaders["test"], eval_loss_fn,
                                           device=device, dtype=dtype)
            times["wall_time_s"] += time.perf_counter() - started
            reason = ("early_stopping" if stopper.should_stop else "max_steps"
                      if args.max_steps and step >= args.max_steps else "max_epochs")
            metrics = {"best_val_acc": stopper.best_score, "test_acc": test_acc,
                       "test_loss": test_loss, "best_epoch": stopper.best_epoch,
                       "epochs_run": epoch, "steps": step,
                       "wall_time_s": times["wall_time_s"], "train_time_s": times["train_time_s"],
                       "compile_time_s": times["compile_time_s"],
                       "samples_per_sec": times["samples"] / max(times["train_time_s"], 1e-9),
                       "peak_mem_bytes": peak_memory_bytes(device), "device": str(device),
                       "stop_reason": reason, "mlflow_run_id": tracker.run_id}
            tracker.log_metrics({k: v for k, v in metrics.items()
                                 if isinstance(v, int | float)}, step=step)
            tracker.set_tags({"stop_reason": reason})
            tracker.finish("FINISHED")
            runs.write_status(out, "finished")
            runs.write_json(out / runs.METRICS, metrics)  # last: its existence means "done"
            log.info("finished (%s): best val %.2f%% at epoch %d, test %.2f%% | %s", reason,
                     100 * stopper.best_score, stopper.best_epoch, 100 * test_acc, out)
            return EXIT_OK
    except Exception as exc:  # failed: status, FAILED MLflow run + traceback; no partial files
        log.error("run failed:\n%s", traceback.format_exc())
        runs.write_status(out, "failed")
        if tracker is not None:
            tracker.fail(traceback.format_exc())
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, torch.OutOfMemoryError):
            message = (f"out of memory at --batch-size {args.batch_size}; try --find-batch-size, "
                       "a smaller --batch-size with --grad-accum, or --amp on")
        return error(message.splitlines()[0] if message.strip() else message, EXIT_FAILED)
    finally:
        runs.close_logging(log)


if __name__ == "__main__":
    sys.exit(main())
