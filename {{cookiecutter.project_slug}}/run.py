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
from {{ cookiecutter.package_name }}.config import (
    PROJECT_ROOT,
    UsageError,
    parse_args,
    resolved_config,
    run_dir,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 75


def error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    # ---- config: cheap answers first, before importing torch (~2 s) -------------------------
    started = time.perf_counter()
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
    from {{ cookiecutter.package_name }}.hardware import (
        choose_compile, choose_gpu_resident, choose_precision, peak_memory_bytes, resolve_device,
        setup_backends, timed,
    )
    from {{ cookiecutter.package_name }}.train import (
        EarlyStopping, GracefulStop, Trainer, build_ema, build_optimizer, build_scheduler,
        check_finite, evaluate, seed_everything,
    )

    # ---- setup + data: every bad input is found here, before a single file is written -------
    config = resolved_config(args, parser)
    try:
        device = resolve_device(args.device)
        dtype, precision_why = choose_precision(device, args.amp)
        if args.profile:  # the memory snapshot then covers the whole run, model included
            from {{ cookiecutter.package_name }}.tuning import start_memory_history

            start_memory_history(device)
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
    out.mkdir(parents=True, exist_ok=True)
    log = runs.setup_logging(out, out.name)
    backends_why = setup_backends(device, args.deterministic)
    compile_mode, compile_why = choose_compile(device, args.compile, total_steps,
                                               args.deterministic)
    for what, why in (("precision", precision_why), ("kernels", backends_why),
                      ("compile", compile_why)):
        log.info("%s: %s", what, why)
    trainer = Trainer(model, optimizer, scheduler, device=device, dtype=dtype,
                      grad_accum=args.grad_accum, clip_grad=args.clip_grad, ema=ema,
                      label_smoothing=args.label_smoothing, compile_mode=compile_mode, log=log)

    # ---- tools: measure something and exit without training ------------------------------------
    if tool:
        from {{ cookiecutter.package_name }}.tuning import (
            find_batch_size,
            find_lr,
            profile_training,
            recommend_batch_size,
        )

        if args.find_lr:
            loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
            lr = find_lr(model, loaders["train"], loss_fn,
                         lambda m: build_optimizer(m, args.lr, args.weight_decay, device),
                         device=device, amp_dtype=dtype, out_dir=out)
            print(f"suggested --lr {lr:.3g} (plot in {out})")
        if args.find_batch_size:
            size = find_batch_size(lambda: build_model(NUM_CLASSES, args.width), device=device,
                                   amp_dtype=dtype, start=args.batch_size,
                                   max_batch=len(splits["train"]))
            batch, lr = recommend_batch_size(size, device)
            print(f"largest batch size that fits: {size}; this device's default rule: "
                  f"--batch-size {batch} --lr {lr:.3g}")
        if args.profile:
            print(profile_training(trainer, loaders["train"], out_dir=out))
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
            trainer.load_state_dict(resume["trainer"])
            stopper.load_state_dict(resume["early_stopping"])
            epoch, batch, step = resume["epoch"], resume["batch"], resume["step"]
            history, times, run_id = resume["history"], resume["times"], resume["mlflow_run_id"]
        except (KeyError, ValueError, ckpt.CheckpointError) as exc:
            runs.close_logging(log)
            return error(f"cannot resume from {out / runs.CHECKPOINT}: {exc}", EXIT_USAGE)
        log.info("resuming %s at epoch %d, step %d (micro-batch %d)", out, epoch + 1, step, batch)
    runs.write_json(out / runs.CONFIG, config)
    runs.write_status(out, "running")

    def snapshot() -> dict:  # the full state: enough to continue as if never stopped
        return {"trainer": trainer.state_dict(), "early_stopping": stopper.state_dict(),
                "rng": ckpt.rng_state(device), "epoch": epoch, "batch": batch, "step": step,
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
            log.info("run %s on %s | %d steps/epoch | MLflow run %s",
                     out.name, device, steps_per_epoch, tracker.run_id)
            if trainer.compiled:  # compile warm-up: its own step, outside the timed loop
                x, _ = next(iter(loaders["val"]))  # only for the shape; reads no RNG
                shape = (args.batch_size, *x.shape[1:])
                x = torch.zeros(shape, device=device).contiguous(memory_format=torch.channels_last)
                t_compile = now()
                trainer.warm_up(x, torch.zeros(args.batch_size, dtype=torch.long, device=device))
                spent = now() - t_compile
                times["compile_time_s"] += spent  # summed over resumes: all compiling paid
                if trainer.compiled:
                    log.info("compiled (%s) in %.1f s", trainer.compile_mode, spent)
            if resume is not None:  # last, so nothing above consumes random numbers
                note = ckpt.set_rng_state(resume["rng"], device)
                if note:
                    log.warning(note)
            progress = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
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
                    if bar is not None:
                        bar.update()
                    if stop.requested:
                        break
                t1 = now()
                if bar is not None:
                    bar.close()
                train_s = t1 - t0
                times["train_time_s"] += train_s
                if stop.requested and batch < micro_per_epoch and step < total_steps:
                    break  # mid-epoch: the checkpoint below records where we are in this epoch
                # note: sync point, once per epoch (the step loop above never waits for the GPU)
                train_loss, train_acc, seen = trainer.take_sums()
                check_finite(train_loss, epoch + 1, steps_before + 1, step)
                times["samples"] += seen
                val_loss, val_acc = evaluate(eval_model, loaders["val"], device=device,
                                             dtype=dtype)
                epoch, batch = epoch + 1, 0
                if stopper.update(val_acc, epoch, eval_model):  # keep the best weights, never test
                    ckpt.save_weights(out / runs.BEST_MODEL, stopper.best_state)
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
            test_loss, test_acc = evaluate(eval_model, loaders["test"], device=device,
                                           dtype=dtype)
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
                       "or a smaller --batch-size with --grad-accum")
        return error(message.splitlines()[0] if message.strip() else message, EXIT_FAILED)
    finally:
        runs.close_logging(log)


if __name__ == "__main__":
    sys.exit(main())
