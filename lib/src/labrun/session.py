"""`Run`: the run around a project's training loop, as small verbs that run.py's loop calls.

run.py's `main()` is `labrun.lifecycle(argv, train, Config)`; `train(run)` gets a `Run`. Its
`build(run)` makes what the loop needs, and the loop stands in `train` (README, "What a run
writes"):

    loss_fn = run.use_loss(run.task.loss, report=run.task.eval_loss)  # the step's, evaluate's
    data = run.data()                       # splits + loaders (batches arrive on run.device)
    ...model, optimizer, scheduler, scaler, EMA...
    run.restore(model=..., optimizer=..., scheduler=..., scaler=..., ema=...)  # resume or start
    mode = run.compile_mode(model)          # times eager passes on a real batch (rank 0 decides)
    net = run.distributed(torch.compile(model, mode=mode, dynamic=False) if mode else model)
    net = run.warm_up(net, eager=model)     # compiles outside the timed loop
    if run.tool: return run.tools(...)      # --find-lr, --find-batch-size, --profile
    p = run.progress
    while p.epoch < run.last_epoch and not run.stopper.should_stop:
        for micro_batches in run.batches(data.train):   # resume-exact
            step(micro_batches)                         # adds to run.train_sums on the device
            run.tick()                                  # a stop signal: checkpoint, exit 75
        row = run.end_epoch(run.evaluate(eval_model, data.val))  # history.csv
        if run.stopper.update(row[run.task.monitor], p.epoch, eval_model):
            run.save_best()                             # best_model.pt
        run.checkpoint(every=args.checkpoint_every)
    if args.test_weights == "best":
        run.restore_best(eval_model)
    run.finish(test=run.evaluate(eval_model, data.test))

Tools get the same step by calling run.py's `build` (`capture_step`), nothing patched.

What it owns: config.json, run.log, status, history.csv, checkpoint.pt (every object given to
`restore` by its state_dict, progress, early stopping with the best weights, RNG, the partial
epoch's metric sums, the precision), best_model.pt, metrics.json (last; never NaN: null and a
reason), MLflow, stop signals, exact resume, torchrun (rank 0 writes; distributed.Dist), and every
way a run ends: exit 0 finished, 1 failed (one `error:` line, the traceback in run.log), 2 bad
input or a refused checkpoint (nothing written), 73 its directory is another's, 75 stopped
(re-run to resume), 130 forced (status interrupted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import time
import traceback
from typing import NamedTuple

from . import jobs, runs
from .claim import LostClaim
from .config import (
    PROJECT_ROOT,
    UsageError,
    check_model_fits,
    parse_args,
    resolved_config,
    run_dir,
    use_config,
)
from .jobs import EXIT_BUSY, EXIT_FAILED, EXIT_OK, EXIT_USAGE, Interrupted, error


class RunFailed(RuntimeError):
    """The run cannot give a result (e.g. its monitored metric was never finite): status
    failed, exit 1, this message as the one `error:` line."""


def is_tool(args) -> bool:
    return bool(args.find_lr or args.find_batch_size or args.profile)


def lifecycle(argv: list[str] | None, train, config: type, *, tool=False) -> int:
    """run.py's main(): --plan, --print-run-dir, skip when done, the claim (exit 73), torchrun's
    ranks (rank 0 writes); then `train(Run)` with every failure mapped to its exit code.
    `config`: run.py's Config dataclass, the method's flags (config.flag). `tool`: a tool run
    whatever the flags (nothing resumed or recorded, also when the run is done: capture_step)."""
    use_config(config)
    body = functools.partial(_body, train, tool)
    redo = (lambda args: True) if tool else is_tool
    return jobs.contract(argv, parse_args, run_dir, body, redo=redo, ranks=True, program=train)


def _body(train, tool, args, parser, out, stop, held, dist) -> int:
    run = None
    try:
        run = Run(args, parser, out, stop, held, dist, tool=tool)
        try:
            code = train(run)
        except SystemExit as exc:  # sys.exit(0) in the method's code (a dataset, a model)
            if exc.code not in (0, None) or run.done:
                raise
            message = f"sys.exit({exc.code}) before run.finish(): the run has no result"
            raise RunFailed(message) from None
        if code is None and not run.done:
            raise RunFailed("train() returned before run.finish(): the run has no result")
        return EXIT_OK if code is None else code
    except SystemExit as exc:  # a refusal, its line printed and logged: end with its code
        return exc.code
    except Interrupted:
        return jobs.EXIT_INTERRUPTED
    except Exception as exc:  # failed: one line here, the traceback in run.log and MLflow
        bad_input = isinstance(exc, UsageError | ValueError | OSError)
        # found before any file of the run (run.restore opens its directory and run.log)
        if bad_input and (run is None or run.log is None):
            if run is None or not run._agreed:  # torchrun: the ranks still starting end too
                dist.settle(EXIT_USAGE, why=str(exc) or type(exc).__name__)
            return error(str(exc) or type(exc).__name__, EXIT_USAGE)  # bad input: one line
        if run is not None and run.record is not None:
            return run.record.failed(exc, explain=run._explain)
        logged = run is not None and run.log is not None
        if logged:  # the whole traceback: run.log, and stderr with its lines
            run.log.error("run failed:\n%s", traceback.format_exc())
        if isinstance(exc, LostClaim):
            return error(str(exc), EXIT_BUSY)
        # before run.log: the project's frames of the traceback under the line (a typo's line)
        return error(
            f"{type(exc).__name__}: {exc}".splitlines()[0], EXIT_FAILED, None if logged else exc
        )
    finally:
        if run is not None:
            run._close()


class Data(NamedTuple):
    splits: dict
    train: object  # loaders.Loader: batches on the device, an order that is f(seed, epoch)
    val: object
    test: object
    steps_per_epoch: int  # optimizer steps: a trailing remainder of < grad_accum is skipped
    info: object  # data.DatasetInfo: classes, channels, image size, class names, split sizes
    notes: list  # what the dataset has to say (skipped files): logged into run.log


class Run:
    """One training run, entered by `lifecycle`: see the module docstring for the order of calls.

    Attributes for run.py: args, device, amp_dtype (autocast dtype or None: fp32), task (loss,
    device-side metric sums, the monitored metric), dist (torchrun), ddp (True when `net` is
    DistributedDataParallel), train_sums (add each micro-batch in the step), total_steps, tool,
    log (run.log, once `restore` has opened the run directory), progress, stopper (from
    `restore` on: early stopping, stopping.EarlyStopping: `update(score, epoch, model)` is True
    at a new best, its weights copied; `should_stop` once patience ran out, which counts only
    after the LR peak and --min-epochs; checkpointed with the run).
    """

    def __init__(self, args, parser, out, stop, held, dist, *, tool=False) -> None:
        import torch

        from . import __version__
        from .hardware import choose_precision, resolve_device, setup_backends
        from .loaders import available_cpus
        from .project import version_warning
        from .state import Progress, TrainSums
        from .tasks import create_task

        self.args, self.out, self.stop, self.held, self.dist = args, out, stop, held, dist
        self.tool = tool or is_tool(args)
        self._agreed, self.ddp, self.done = False, False, False
        # loss, report_loss: run.py's, given by use_loss (never guessed here)
        self.log = self.record = self.data_ = self.loss = self.report_loss = None
        self.objects, self.speed = {}, {}  # speed: CUDA's flops_per_sample, peak_flops, gpu_busy
        self.progress = Progress()
        # ---- config: every bad input is found before a file of the run is written ----
        self.config = config = resolved_config(args, parser)
        # The processes of this job (torchrun), not of its identity; the CPU share it computes
        # with (its numbers depend on the thread count): run.sh gives a resumed job the same.
        config.update(world_size=dist.world, torch_threads=torch.get_num_threads())
        config["job_cpus"] = available_cpus()
        runs.check_ownership(out)  # a colleague's run directory, or files planted in ours
        self.task = create_task(args.task, args, args.monitor)  # loss, metrics, the monitored one
        config.update(monitored=self.task.monitor, metric_directions=self.task.directions)
        dist.check(args)  # a --batch-size that does not divide among the processes: exit 2
        self.device = dist.place(resolve_device(args.device))
        self.amp_dtype, precision_why = choose_precision(self.device, args.amp)
        kernels = setup_backends(self.device, args.deterministic)
        self._notes = [("precision", precision_why), ("kernels", kernels)]
        if dist.is_main and (mismatch := version_warning(PROJECT_ROOT, __version__)):
            print(f"warning: {mismatch}", file=sys.stderr)  # runs on, but says so at start
            self._notes.append(("labrun", mismatch))
        if args.profile:  # the CUDA memory snapshot then covers the whole run, model included
            from .tools.tuning import start_memory_history

            start_memory_history(self.device)
        self.train_sums = TrainSums(self.task, self.device)

    def use_loss(self, loss_fn, report=None):
        """`loss_fn(outputs, targets)`: the loss run.py's step trains on, which the model check,
        the compile probe, the warm-up and the tools (--find-lr...) use; `report` (default: the
        same) is the loss evaluate reports as val/test loss (classification: without label
        smoothing). Returns `loss_fn`."""
        self.loss, self.report_loss = loss_fn, report or loss_fn
        return loss_fn

    # ---- data ----------------------------------------------------------------------------------
    def data(self) -> Data:
        """Splits and loaders (pinned memory + non_blocking copies, or the whole set resident on
        the GPU); UsageError for sizes that cannot work. Seeds everything afterwards: the same
        seed gives the same init, split, order and augmentation."""
        from .data import build_loader, check_batch_size, load_dataset
        from .hardware import choose_gpu_resident
        from .preflight import check_memory
        from .train import seed_everything

        args = self.args
        check_model_fits(args)  # an --image-size the model cannot take: before any decoding
        # The flags of the same name: data_version is the one in the run's identity, task picks
        # among a dataset's kinds of targets, augment/crop/crop_* what the training loader does.
        same = ("data_path", "image_size", "val_fraction", "seed", "synthetic_size", "workers")
        same += ("data_version", "task", "augment", "crop", "crop_scale", "crop_ratio")
        loaded = load_dataset(
            args.dataset,
            args.data_dir,
            mode=args.data_mode,
            spatial_targets=self.task.spatial_targets,  # crop/flip would not move the targets
            **{name: getattr(args, name) for name in same},
        )
        splits = loaded.splits
        # Only decoded in-memory data can live on the GPU; streamed files come through workers.
        in_memory = loaded.mode == "memory"
        resident = in_memory and choose_gpu_resident(args.gpu_resident, self.device, splits)
        loaders = {
            name: build_loader(
                split,
                args.batch_size,
                train=name == "train",
                device=self.device,
                workers=args.workers,
                gpu_resident=resident,
                seed=args.seed,
                augment=loaded.info.augmentation,  # used by the training loader only
                shard=self.dist.shard,
            )
            for name, split in splits.items()
        }
        # torchrun: a rank with no sample of a split would skip its final all-reduce
        self.dist.check_splits({name: len(split) for name, split in splits.items()})
        steps_per_epoch = len(loaders["train"]) // args.grad_accum
        check_batch_size(len(splits["train"]), args.batch_size, args.grad_accum)  # small data
        if len(splits["val"]) == 0:
            raise UsageError("--val-fraction: the validation split is empty; raise it")
        # num_classes, channels, image_size, class names, split sizes, the arrays' content hash
        self.config.update(loaded.info.as_config())
        seed_everything(args.seed)
        version = self.config["data_version"] or self.config.get("data_content")
        sizes = f"{self.config['split_sizes']} samples (train/val/test) | {version}"
        # dtype and shape, normalisation, augmentation: what was done to the inputs, and why
        self._notes += [("data", sizes), *loaded.info.describe().items()]
        if getattr(loaders["train"], "decoder", ""):  # streamed files: on the GPU or the CPU
            self._notes.append(("decode", loaders["train"].decoder))
        train, val, test = (loaders[k] for k in ("train", "val", "test"))
        self.data_ = Data(splits, train, val, test, steps_per_epoch, loaded.info, loaded.notes)
        # Before run.py builds the model: a model or batch too big for the free memory is
        # refused here (exit 2), not ended by the OOM killer (preflight.py)
        micro = max(1, args.batch_size // self.dist.world)
        needs = check_memory(args, loaded.info, self.device, self.amp_dtype, micro_batch=micro)
        self._notes.append(("memory", needs))
        return self.data_

    def memory_format(self, model):
        """The memory layout to train `model` in, by rule: channels_last for images (the layout
        tensor cores convolve in, and the one the loaders deliver: no copy per batch on a CPU),
        contiguous for other inputs. run.log says which."""
        import torch

        info = self.data_.info
        shape = tuple(info.input_shape) or (info.channels, *info.image_size)
        if len(shape) == 3 and info.layout == "NCHW":
            self.layout, why = torch.channels_last, "channels_last (images)"
        else:
            self.layout, why = torch.contiguous_format, "contiguous (the inputs are not images)"
        self._notes.append(("layout", why))
        return self.layout

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: epochs x steps per epoch, or --max-steps."""
        steps = self.data_.steps_per_epoch * self.args.epochs
        return min(steps, self.args.max_steps) if self.args.max_steps else steps

    # ---- the run directory: opened once the model exists ----------------------------------------
    def restore(self, **objects) -> None:
        """Register what the checkpoint holds (name -> object with state_dict(), or None) and
        resume from it if there is one; then the run's record starts (config.json, status
        running, MLflow). A checkpoint that cannot be loaded is refused (status refused, exit 2);
        so is a resume on other data. The first object is the model (its size: the disk check).
        Tools (--find-lr ...) only open the run directory."""
        import torch

        from .preflight import forward_problem
        from .stopping import EarlyStopping
        from .train import EMA, lr_peak_step, peak_epoch

        if self.loss is None:  # labrun never takes the task's loss behind run.py's back
            raise RunFailed("run.py gave no loss: call run.use_loss(loss_fn) before run.restore")
        self.objects = objects
        model, ema = next(iter(objects.values())), self._given(EMA)
        # Refusals that need the model (no room for a checkpoint), then the run directory and
        # run.log; a refusal on any rank ends all (torchrun).
        args, out, dist = self.args, self.out, self.dist
        why = ""
        try:
            # one forward pass and the loss on a real batch: a misfit of model, data and task
            # (not for tools: capture_step drives the step with its caller's own batches)
            batch = None if self.tool else self.peek_batch()
            if batch and (problem := forward_problem(model, batch, self.loss, self.amp_dtype)):
                why = (
                    f"--model {args.model} cannot train on --dataset {args.dataset} under "
                    f"--task {args.task} ({problem}); choose another --model, --task or --dataset"
                )
            elif dist.is_main:
                runs.ensure_writable(out, need_bytes=room_needed(out, model, ema))
        except OSError as exc:  # not writable, or no room for a checkpoint: before any work
            why = f"--results-dir: {exc.strerror or exc}"
        code = error(why, EXIT_USAGE) if why else None
        self._agreed = True
        # torchrun: one collective whatever each rank found (a refusal, a stop while starting:
        # nothing of this run exists yet), so that no rank waits in another one (issue 28.2)
        if (code := dist.settle(code, self.stop, why)) is not None:
            raise SystemExit(code)
        if dist.is_main:  # one writer (--fresh, run.log); the other ranks log to stderr
            self.log = jobs.open_dir(out, args.fresh, self.stop)
        else:
            self.log = self.stop.log = dist.rank_log(out.name)
        dist.settle(None)  # the others read the checkpoint once --fresh has deleted it
        for note in self.data_.notes:  # e.g. skipped unreadable images
            self.log.warning(f"data: {note}")
        for what, why in self._notes + ([("distributed", dist.describe())] if dist.active else []):
            self.log.info(f"{what}: {why}")
        # Patience counts only after the LR peak and --min-epochs: no stop during the warm-up.
        peak = lr_peak_step(self._given(torch.optim.lr_scheduler.LRScheduler))
        patience_from = max(args.min_epochs, peak_epoch(peak, self.data_.steps_per_epoch))
        self.stopper = EarlyStopping(
            args.patience, start_epoch=patience_from, mode=self.task.direction(self.task.monitor)
        )
        self._saved_at = time.monotonic()  # the last save (the start): wall time, checkpoint()
        if self.tool:
            return
        self._resume()
        params = tags = None
        if dist.is_main:
            from .tracking import provenance, run_params

            params = run_params(self.config)  # with `experiment_keys`: plot.py --from-mlflow's
            tags = {**provenance(self.log), "run_dir": str(out), "device": str(self.device)}
            tags.update(amp_dtype=str(self.amp_dtype), compile=args.compile)
            tags.update(workers=str(args.workers), world_size=str(dist.world))
        # config.json, status running, its MLflow run (rank 0 writes); an OSError here (the
        # disk filled since the start-up check) is _body's: one `error:` line, exit 1
        self.record = jobs.Record(out, self.config, args, self.stop, self.held, dist, params, tags)
        from . import __version__

        steps = f"{self.data_.steps_per_epoch} steps/epoch | labrun {__version__}"
        self.log.info(f"run {out.name} on {self.device} | {steps} | {self.record.tracker_line()}")

    def _given(self, kind: type):
        """The object of type `kind` given to restore, whatever its keyword (run.py names them:
        an `opt=` instead of `optimizer=` must not leave history's lr NaN), or None."""
        return next((o for o in self.objects.values() if isinstance(o, kind)), None)

    def _refuse(self, message: str) -> None:
        self.log.error(message)
        if self.dist.is_main:  # one writer
            runs.try_write_status(self.out, "refused")
        raise SystemExit(error(message, EXIT_USAGE))

    # ---- checkpoint.pt (state.py says what it holds and why) -----------------------------------
    def precision(self) -> dict:
        """What the checkpoint records of the arithmetic: the autocast dtype and the scaler."""
        import torch

        names = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}
        scaled = (o for o in self.objects.values() if isinstance(o, torch.amp.GradScaler))
        scaler = any(s.is_enabled() for s in scaled)
        return {"autocast": names.get(self.amp_dtype, str(self.amp_dtype)), "grad_scaler": scaler}

    def state_dict(self) -> dict:
        """Every object given to restore by its state_dict (None recorded as None), progress,
        early stopping with the best weights, the partial epoch's sums, RNG, the config hash."""
        from .checkpoint import rng_state

        objects = {k: None if o is None else o.state_dict() for k, o in self.objects.items()}
        objects.update(precision=self.precision(), sums=self.train_sums.state_dict())
        return {
            "trainer": objects,  # the name distributed.py's gather_state / own_state read
            "early_stopping": self.stopper.state_dict(),
            "progress": dataclasses.asdict(self.progress),
            "rng": rng_state(self.device),
            "config_hash": self.config["config_hash"],
        }

    def _save(self) -> None:
        """checkpoint.pt now: collective under torchrun (every rank calls it, rank 0 writes)."""
        from . import checkpoint as ckpt

        self.record.ours()  # LostClaim once the run directory is another's
        now, p = time.monotonic(), self.progress  # wall time is accumulated across resumes
        p.wall_time_s, self._saved_at = p.wall_time_s + now - self._saved_at, now
        if (state := self.dist.gather_state(self.state_dict())) is not None:
            ckpt.save(self.out / runs.CHECKPOINT, state)

    def load_objects(self, saved: dict) -> None:
        """Every object given to restore from the checkpoint's copy (strict: refused when it
        differs, or when one is None here and not there: an EMA that is off)."""
        import torch

        from .checkpoint import CheckpointError, load_model_state
        from .state import load_scaler

        for name, obj in self.objects.items():
            if name not in saved:
                raise CheckpointError(f"the checkpoint holds no {name!r}")
            if (saved[name] is None) != (obj is None):
                raise CheckpointError(f"the checkpoint's {name!r} setting differs from this run's")
            if obj is None:
                continue
            if isinstance(obj, torch.amp.GradScaler):
                load_scaler(obj, saved[name], saved["precision"], self.precision(), self.log)
            elif isinstance(obj, torch.nn.Module):
                load_model_state(obj, saved[name], f"the checkpoint's {name}")
            else:
                obj.load_state_dict(saved[name])
        self.train_sums.load_state_dict(saved["sums"])

    def _resume(self) -> None:
        """Load checkpoint.pt if there is one. One that cannot be loaded (corrupt, another
        configuration, another model, anything that fails while loading it) is refused in one
        line with the reason, never a traceback (_refuse). The checkpoint's best weights
        rewrite best_model.pt (state.py). The RNG state is restored last: nothing after it
        draws."""
        from . import checkpoint as ckpt
        from .dataversion import changed_since
        from .state import Progress

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
            state = self.dist.own_state(state, path)
            self.load_objects(state["trainer"])
            early = state["early_stopping"]
            if early["best_epoch"] and self.dist.is_main:  # one writer
                ckpt.save_weights(self.out / runs.BEST_MODEL, early["best_state"])
            self.stopper.load_state_dict(early)
            self.progress = Progress(**state["progress"])
            note = ckpt.set_rng_state(state["rng"], self.device)
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
    def compile_mode(self, model) -> str | None:
        """torch.compile's mode where compiling pays for this run (hardware.decide_compile:
        eager time of forward + backward on a real batch against the recorded compile cost),
        else None. Decided on rank 0, the same on every rank; run.log says why. After
        run.restore (the model and the run directory are there)."""
        from .hardware import decide_compile

        self._compile = (None, 0.0, None)
        if self.dist.is_main:
            self._compile = decide_compile(
                model,
                self.peek_batch,
                loss_fn=self.loss,
                dtype=self.amp_dtype,
                steps=self.total_steps - self.progress.step,
                micro_batches=self.args.grad_accum,
                flag=self.args.compile,
                deterministic=self.args.deterministic,
                project_root=PROJECT_ROOT,
                log=self.log,
                ddp=self.dist.active,
            )
        self.compiled = self.dist.decide(self._compile[0])  # torchrun: rank 0's, on every rank
        if self.device.type == "cuda" and self.dist.is_main:
            self._measure_speed_scale(model)
        return self.compiled

    def _measure_speed_scale(self, model) -> None:
        """What MFU needs (CUDA): the FLOPs of one sample's forward + backward on a real batch
        and this GPU's matmul peak in the run's precision (measured once per machine); the
        GPU's busy share where a job of this model and mode recorded one. Never fails the run."""
        from .hardware import (
            busy_line,
            flops_per_sample,
            matmul_peak,
            model_key,
            read_record,
            use_inductor_cache,
        )

        try:
            x, y = self.peek_batch()
            flops = flops_per_sample(model, x, y, self.loss, self.amp_dtype)
            cache = use_inductor_cache(PROJECT_ROOT)[0]  # the compile records' folder
            peak, when = matmul_peak(cache, self.device, self.amp_dtype)
        except Exception as exc:  # an op the counter cannot run, no memory for the matmuls
            self.log.warning(f"MFU not measured ({type(exc).__name__}: {exc})")
            return
        self.speed.update(flops_per_sample=flops, peak_flops=peak)
        dtype = str(self.amp_dtype or "fp32").removeprefix("torch.")
        self.log.info(
            f"MFU scale: {flops / 1e9:.3g} GFLOP per training sample (forward + backward); "
            f"matmul peak {peak / 1e12:.0f} TFLOP/s in {dtype} ({when})"
        )
        # The busy share: profiled in one job of this model, input and compile mode, then read.
        key = {**model_key(model, x, self.amp_dtype, self.device), "busy": self.compiled}
        self._busy_record = (cache, key)
        if seen := read_record(cache, key):
            self.speed["gpu_busy"] = seen["share"]
            line = busy_line(seen["share"], seen["step_s"], self.args.batch_size)
            self.log.info(f"{line} (recorded {seen['when']})")

    @property
    def cuda_graphs(self) -> bool:
        """True when the step's module replays CUDA graphs: each step must then mark its
        start (torch.compiler.cudagraph_mark_step_begin) so that a replay may reuse the last
        step's memory."""
        from .hardware import WITHOUT_GRAPHS

        return self.device.type == "cuda" and getattr(self, "compiled", None) in WITHOUT_GRAPHS

    def distributed(self, module):
        """`module` in DistributedDataParallel under torchrun (gradients all-reduced over the
        processes), else `module` itself. Give it the compiled module: DDP goes outermost."""
        self.ddp = (wrapped := self.dist.ddp(module)) is not None
        return wrapped if self.ddp else module

    def warm_up(self, net, *, eager):
        """Compile `net` (what the step calls) on a real batch before the timed loop, and time
        it; returns `net`, or `eager` (in DDP where it applies) when the compiler fails. Puts
        back all it touches (BatchNorm statistics, gradients, RNG). Compile time is summed over
        resumes: every compile of the run was paid for."""
        from .hardware import compile_cache_counts, time_forward_backward, timed
        from .train import compiler_errors

        if not getattr(self, "compiled", None):
            return net
        mode, eager_s, record = self._compile
        now, (x, y), cache_before = timed(self.device), self.peek_batch(), compile_cache_counts()
        started = now()
        try:
            compiled_s = time_forward_backward(net, x, y, self.loss, self.amp_dtype, now)
        except compiler_errors() as exc:
            why = f"{type(exc).__name__}: {runs.first_line(exc)}"
            self.log.warning(f"torch.compile failed ({why}); continuing eagerly")
            self.compiled = None
            return self.distributed(eager)
        spent = now() - started - 4 * compiled_s  # the compile, without the timed passes
        self.progress.compile_time_s += spent
        if record is not None:
            (hits, misses), (hits_after, misses_after) = cache_before, compile_cache_counts()
            warm = hits_after > hits and misses_after == misses  # every graph from the cache
            record.save(
                mode, compile_s=spent, warm=warm, eager_step_s=eager_s, compiled_step_s=compiled_s
            )
            self.log.info(
                f"compiled ({mode}) in {spent:.1f} s ({'warm' if warm else 'cold'} inductor "
                f"cache); forward + backward {1e3 * compiled_s:.1f} ms (eager "
                f"{1e3 * eager_s:.1f} ms); recorded in {record.path}"
            )
        return net

    def peek_batch(self):
        """A training batch exactly as the loop gets it (shape, dtype, strides), without
        shifting the run: the loader's order is f(seed, epoch) and `batches` sets the epoch
        again; the RNG draws of the augmentation are put back. Read in this process
        (Loader.peek): no loader worker is started for it."""
        from .checkpoint import rng_state, set_rng_state

        loader = self.data_.train
        saved = rng_state(self.device)
        loader.set_epoch(self.progress.epoch)
        try:
            x, y = loader.peek()
            layout = getattr(self, "layout", None)  # the step's layout: no recompile after
            return (x.contiguous(memory_format=layout) if layout and x.dim() == 4 else x), y
        finally:
            set_rng_state(saved, self.device)

    # ---- the loop: verbs run.py's loop calls --------------------------------------------------
    @property
    def last_epoch(self) -> int:
        """The epoch the run's last step falls in: --epochs, or fewer when --max-steps ends the
        run sooner."""
        per_epoch = max(self.data_.steps_per_epoch, 1)
        return min(self.args.epochs, math.ceil(self.total_steps / per_epoch))

    def batches(self, loader):
        """This epoch's optimizer steps, each a list of --grad-accum micro-batches on the device,
        from where the run is (the order is f(seed, epoch): a resumed epoch skips the
        micro-batches it did) to the epoch's end or the run's last step. run.tick() follows each
        step. Times the epoch's training (waiting for the device) and shows a progress bar."""
        from tqdm import tqdm

        from .hardware import GpuBusy, timed

        p, accum, main = self.progress, self.args.grad_accum, self.dist.is_main
        loader.set_epoch(p.epoch, skip_batches=p.batch)
        source = iter(loader)
        self._now = timed(self.device)  # waits for the device: times the work, not the launches
        self._t0, self._first_step, self._resumed_in_epoch = self._now(), p.step, p.batch > 0
        # --progress: tqdm's disable=None shows the bar only when stderr is a terminal (auto)
        off = {"on": False, "off": True, "auto": None}[self.args.progress] if main else True
        desc, steps = f"epoch {p.epoch + 1}/{self.args.epochs}", self.data_.steps_per_epoch
        self._bar = tqdm(total=steps, initial=p.batch // accum, leave=False, desc=desc, disable=off)
        # No bar (a log file: nohup, sweeps, Slurm): a line every --log-every seconds instead,
        # from the wall clock and the step counter only (no wait for the device).
        self._every = self.args.log_every if main and self._bar.disable else 0.0
        self._wall0 = time.monotonic()
        self._line_at = self._wall0 + self._every
        profile = self.device.type == "cuda" and main and "gpu_busy" not in self.speed
        self._busy = GpuBusy(self.device) if profile else None  # a few steps of this epoch
        try:
            while p.batch < self.data_.steps_per_epoch * accum and p.step < self.total_steps:
                if self._busy is not None:
                    self._busy.at(p.step - self._first_step)
                done = p.step
                yield [next(source) for _ in range(accum)]
                if p.step == done:  # the loop would never end: say so instead
                    raise RuntimeError("call run.tick() after each step of run.batches()")
        finally:
            getattr(source, "close", lambda: None)()
        self._epoch_trained()

    def tick(self) -> None:
        """One optimizer step done: counted (progress, bar). A stop signal (torchrun: on any
        rank, polled every 10 steps) now writes the checkpoint, status interrupted and raises
        Interrupted: exit 75, and the same command resumes at the next step."""
        p = self.progress
        p.step, p.batch = p.step + 1, p.batch + self.args.grad_accum
        self._bar.update()
        if self._every and time.monotonic() >= self._line_at:
            self._progress_line()
        if self.dist.stopped(self.stop, p.step):
            self._epoch_trained()
            self._save()
            self.record.interrupted(self.stop.requested or "a stop signal to another rank", p)
            raise Interrupted(self.stop.requested)

    def _progress_line(self) -> None:
        """run.log: where the epoch is, its pace since the epoch (or the resume) began, and when
        it ends. Steps are counted as launched: on a GPU the pace includes the queue ahead."""
        p, args, now = self.progress, self.args, time.monotonic()
        self._line_at = now + self._every
        rate = (p.step - self._first_step) / max(now - self._wall0, 1e-9)
        done = p.batch // args.grad_accum
        left = min(self.data_.steps_per_epoch - done, self.total_steps - p.step)
        self.log.info(
            f"epoch {p.epoch + 1}/{args.epochs} step {done}/{self.data_.steps_per_epoch} | "
            f"{rate:.2f} steps/s {rate * args.batch_size * args.grad_accum:.0f} samples/s | "
            f"epoch ETA {left / max(rate, 1e-9):.0f}s"
        )

    def _epoch_trained(self) -> None:
        """The epoch's training time into progress (once: at its end, or at a stop)."""
        p, busy = self.progress, self._busy
        train_s = self._now() - self._t0
        self._bar.close()
        if busy is not None:
            busy.close(p.step - self._first_step)
            if busy.share is not None:
                from .hardware import busy_line, write_record

                self.speed["gpu_busy"] = busy.share
                self.log.info(busy_line(busy.share, busy.step_s, self.args.batch_size))
                if record := getattr(self, "_busy_record", None):
                    write_record(*record, share=busy.share, step_s=busy.step_s)
        p.train_time_s += train_s
        p.epoch_time_s = train_s + (p.epoch_time_s if self._resumed_in_epoch else 0.0)
        from .hardware import LOOP_MIN_STEPS

        # A mode is judged on the training step's own time: the first epoch's, once.
        record, steps = getattr(self, "_compile", (None,) * 3)[2], p.step - self._first_step
        first = p.epoch == 0 and not self._resumed_in_epoch and steps >= LOOP_MIN_STEPS
        if record is not None and first:
            record.save_step(self.compiled, train_s / steps)

    def evaluate(self, model, loader) -> dict[str, float]:
        """{loss, metric...} of the task over `loader` in eval mode, summed over ranks; the loss
        is the one run.use_loss named `report`."""
        from .train import evaluate

        self.dist.sync_buffers(model)  # CPU torchrun: rank 0's BatchNorm statistics
        return evaluate(
            model,
            loader,
            device=self.device,
            dtype=self.amp_dtype,
            task=self.task,
            loss_fn=self.report_loss,
            reduce=self.dist.sum,
        )

    def end_epoch(self, val: dict[str, float]) -> dict:
        """The epoch's row, returned and written (history.csv, run.log, MLflow): its training
        sums, read now (the one sync of the epoch: NonFiniteLoss when the loss is not finite),
        beside `val`."""
        import torch

        from .stopping import check_finite

        p, args = self.progress, self.args
        # {loss, metric...} summed over ranks; note: one sync (and all-reduce) per epoch
        train, seen = self.train_sums.take(self.dist.sum)
        first_step = p.step - p.batch // args.grad_accum + 1
        check_finite(train["loss"], p.epoch + 1, first_step, p.step)
        self.train_sums.reset()
        p.epoch, p.batch, p.samples = p.epoch + 1, 0, p.samples + seen
        optimizer = self._given(torch.optim.Optimizer)
        row = {
            "epoch": p.epoch,
            "step": p.step,
            "lr": optimizer.param_groups[0]["lr"] if optimizer is not None else math.nan,
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

    def save_best(self) -> None:
        """best_model.pt: the best weights run.stopper holds (after its update said "new best"),
        a plain state_dict."""
        from .checkpoint import save_weights

        if self.record.ours():
            save_weights(self.out / runs.BEST_MODEL, self.stopper.best_state)
            best = f"{self.stopper.best_score:.4g}, epoch {self.stopper.best_epoch}"
            self.log.info(f"best so far ({best}): best_model.pt")

    def checkpoint(self, every: float) -> None:
        """checkpoint.pt (every object given to restore, progress, RNG, early stopping) once
        `every` seconds have passed since the last (0: now; rank 0's clock decides for all)."""
        if self.dist.decide(time.monotonic() - self._saved_at >= every):
            self._save()

    def restore_best(self, model) -> None:
        """The best epoch's weights into `model` (to test once); RunFailed when the monitored
        metric was never finite (nothing to test)."""
        if self.stopper.best_state is None:
            raise RunFailed(
                f"{self.task.monitor} was never finite in {self.progress.epoch} epoch(s): no "
                "best weights to test (try a lower --lr or --clip-grad)"
            )
        self.stopper.restore(model)

    def finish(self, test: dict[str, float]) -> None:
        """Checkpoint, metrics.json (last: the run is done; strict JSON: finite_or_null),
        MLflow FINISHED."""
        from .hardware import peak_memory_bytes

        self._save()
        self.log.info(self.data_.train.wait_line())  # the loader's share of the training time
        p, stopper, task, speed = self.progress, self.stopper, self.task, self.speed
        reason, weights = self.stop_reason(), self.args.test_weights
        rate = p.samples / max(p.train_time_s, 1e-9)
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
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "device": str(self.device),
            "stop_reason": reason,
        }
        mfu = ""
        if "peak_flops" in speed:  # CUDA: the model's FLOPs at the run's rate / the GPU's peak
            metrics["flops_per_sample"] = flops = speed["flops_per_sample"]
            metrics["mfu"] = flops * rate / speed["peak_flops"]
            mfu = f", MFU {100 * metrics['mfu']:.1f} %"
        if "gpu_busy" in speed:
            metrics["gpu_busy_share"] = speed["gpu_busy"]
        tags = {"stop_reason": reason, "test_weights": weights}
        artifacts = [self.out / runs.HISTORY, self.out / runs.BEST_MODEL]
        self.record.finished(finite_or_null(metrics), p.history, tags=tags, artifacts=artifacts)
        self.log.info(
            f"finished ({reason}): best {task.monitor} {stopper.best_score:.4g} at epoch "
            f"{stopper.best_epoch} | test ({weights} weights) {metrics_line(metrics, 'test_')} | "
            f"{rate:.0f} samples/s{mfu} | {self.out}"
        )
        self.done = True

    def stop_reason(self) -> str:
        """ "early_stopping" only when patience ended the run before its last step (patience
        that runs out on the last epoch changed nothing)."""
        p, args, stopper = self.progress, self.args, self.stopper
        at_max_steps = bool(args.max_steps) and p.step >= args.max_steps
        if stopper.should_stop and p.epoch < args.epochs and not at_max_steps:
            return "early_stopping"
        return "max_steps" if at_max_steps else "max_epochs"

    # ---- tools ---------------------------------------------------------------------------------
    def tools(self, *, model, optimizer, step, scheduler=None) -> int:
        """--find-lr, --find-batch-size, --profile: measure, report, exit without training
        (labrun.tools.tuning.run_tools). `step` is run.py's step (profiled as the run takes it)."""
        from .tools.tuning import run_tools

        run_tools(self, model=model, optimizer=optimizer, step=step, scheduler=scheduler)
        self.done = True
        return EXIT_OK

    # ---- endings -------------------------------------------------------------------------------
    def _explain(self, exc: BaseException, message: str) -> tuple[int, str]:
        """A training run's failure as its exit code and one line (`message`: the exception's
        first line, or the rank whose failure caused it)."""
        import torch

        from .imagefolder import UnreadableImage

        args = self.args
        if isinstance(exc, UnreadableImage):  # changed since the scan: bad input, not a retry
            from .dataversion import forget

            # the next start fingerprints every file; the hint says so
            return EXIT_USAGE, f"{exc}; {forget(args.data_path, args.data_dir)}"
        if isinstance(exc, RunFailed):
            return EXIT_FAILED, str(exc)
        if isinstance(exc, torch.OutOfMemoryError):
            return EXIT_FAILED, (
                f"out of memory at --batch-size {args.batch_size}; try --find-batch-size, "
                "or a smaller --batch-size with --grad-accum"
            )
        if runs.is_disk_error(exc):
            return EXIT_FAILED, (
                f"{exc.strerror} writing {exc.filename or self.out}: the run stopped; its "
                "last complete checkpoint is kept (free space, then re-run to resume)"
            )
        return EXIT_FAILED, message

    def _close(self) -> None:
        # However the run ended: its loaders' workers end now, not in the interpreter's exit.
        data = self.data_
        for loader in (data.train, data.val, data.test) if data is not None else ():
            loader.close()
        if self.record is not None:
            self.record.close()
        elif self.log is not None:
            runs.close_logging(self.log)


# ---- the pieces Run names ----------------------------------------------------------------------
def room_needed(out, model, ema=None) -> int:
    """Disk a run needs: checkpoint (weights, two AdamW moments, `ema`'s copy if any, best
    weights) twice during its atomic replace, plus best_model.pt; less the checkpoint and
    best_model.pt a re-run replaces (their space is the run's already, and comes back as each
    new file replaces the old one)."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ours = [out / name for name in (runs.CHECKPOINT, runs.BEST_MODEL)]  # claimed: none goes
    kept = sum(path.stat().st_size for path in ours if path.is_file())
    return max(weights * (2 * (4 + (ema is not None)) + 1) - kept, 0)


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


def capture_step(run_py, argv: list[str]):
    """A project's run.py built for `argv` as far as its step, training nothing: a namespace of
    what its `build(run)` returns (model, optimizer, scheduler, step...) and `run`, for tools
    that drive the project's own step (gpucheck, benchmarks, tests). In this process, as a tool
    run (nothing is resumed or recorded, also when the run is done); works under torchrun (each
    rank gets its own; `run.ddp` says whether the step's module is in DDP). `run` is the live
    Run (device, amp_dtype, train_sums, state_dict, data_, peek_batch, warm_up...)."""
    import types

    captured: dict = {}

    def build(run) -> int:
        captured.update(vars(run_py.build(run)), run=run)
        run.done = True  # built is all a tool run of this kind does
        return EXIT_OK

    jobs.LEAVE_AT_ONCE = False  # this process goes on after the run: no os._exit under torchrun
    try:
        code = lifecycle(list(argv), build, run_py.Config, tool=True)
    finally:
        jobs.LEAVE_AT_ONCE = True
    if not captured:
        raise RuntimeError(f"run.py did not reach its step (exit {code})")
    return types.SimpleNamespace(**captured)
