"""Train one model: flags -> data -> model -> optimizer, schedule -> step -> loop -> test, save.

Usage (copy-paste):
    python run.py                                     # digits (offline), defaults
    python run.py --dataset cifar10 --epochs 30 --seed 1
    python run.py --device cpu --epochs 3 --width 8   # a quick CPU smoke run
    python run.py ARGS --print-run-dir                # where ARGS write (imports no torch)
    python run.py ARGS                                # again: resumes if interrupted, skips if done
    python run.py ARGS --fresh                        # delete that run's files and start over
    python run.py ARGS --find-lr | --find-batch-size | --profile     # tools: report and exit
    python run.py ARGS --tracking off                 # no MLflow (also LAB_TRACKING=off)
    torchrun --nproc-per-node 4 run.py ARGS           # one run on 4 GPUs (same numbers)

Results go to <results-dir>/<dataset>_<changed args>-<hash8>/ (README, "What a run writes"):
config.json, status, history.csv, checkpoint.pt, best_model.pt, metrics.json (only when
finished), run.log, tracking.json. One process at a time trains a run directory (it holds
`.lock`); any number of jobs may share one results folder and one MLflow database.
Exit codes: 0 finished (or already), 1 failed, 2 bad input, 73 running elsewhere (another process
holds this run directory), 75 interrupted (re-run the same command to resume).
Stop signals (SIGTERM, SIGINT, SIGUSR1, SIGHUP, in any number): finish the step, checkpoint, exit
75. A run whose directory is deleted (or its .lock replaced) while it trains stops at its next
epoch end with one `error:` line, writes nothing more and exits 73: the path may be another's now.

The method's hyperparameters are `Config` below: one line a flag (`--lr`, `--weight-decay`...),
each in the run's identity unless it says execution=True. The options every project shares
(data, model, epochs, device, tracking...) are labrun's; `python run.py --help` lists both.
This file holds the method's objects and its loop; labrun's `job` is the run directory (resume,
checkpoints, history, MLflow, stop signals), and its other verbs take what this file passes.
"""

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import labrun
from labrun import flag


@dataclass
class Config:
    """The method's hyperparameters: a new one is a new line here (README, "The method")."""

    lr: float = flag(3e-3, "peak learning rate of the one-cycle schedule", above=0)
    weight_decay: float = flag(5e-4, "AdamW weight decay (of weights, not biases)", at_least=0)
    warm_up: float = flag(0.15, "fraction of the steps the LR climbs to --lr", above=0, below=1)
    clip_grad: float = flag(0.0, "clip the gradients' global norm to this (0 = off)", at_least=0)
    # EMA averages over ~1/(1 - decay) steps after a warm-up (timm's): 0.99 suits the default
    # digits run (200 steps), 0.999 runs of a few thousand steps.
    ema: float = flag(0.0, "EMA decay of the weights evaluated (0 = off)", at_least=0, below=1)


def main(argv: list[str] | None = None) -> int:
    # The contract every job shares: --plan, --print-run-dir, skip when done, the claim (exit
    # 73); torchrun: one job in N processes, rank 0 alone writes. Then train(job) below.
    return labrun.lifecycle(argv, train, Config)


def make_model(args, info):
    """The registered --model, sized for this dataset (a misfit is bad input: ValueError).
    labrun's checks (an --image-size the model cannot take, memory) build it with this too."""
    from labrun.models import create_model

    return create_model(
        args.model,
        num_classes=info.num_classes,
        channels=info.channels,
        image_size=info.image_size,
        input_shape=info.input_shape,  # one sample: (C, H, W), (C, L), (L,), (T, F)
        width=args.width,  # None for a model that takes none
        **args.model_args,  # its own size arguments: --model-args, else its defaults
    )


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on weights only: decaying norms' scales and biases only hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def build(args, env):
    """Data, model, optimizer, schedule, the step's sums and early stopping: what train()
    resumes and loops over, and what tools (--profile, gpucheck, tests) call to drive the same
    step. `env`: the device, the autocast dtype, the task (--task) and torchrun's processes."""
    import torch

    # ---- the hardware's fast paths --------------------------------------------------------------
    # cuDNN tries each convolution algorithm once for our fixed shapes and keeps the fastest.
    torch.backends.cudnn.benchmark = not args.deterministic
    # TF32 (fp32's range, a 10-bit mantissa) matmuls and convolutions on Ampere+ tensor cores.
    torch.backends.cuda.matmul.allow_tf32 = not args.deterministic
    torch.backends.cudnn.allow_tf32 = not args.deterministic

    # ---- data: splits and loaders ------------------------------------------------------------
    # Batches arrive on the device: pinned host memory copied with non_blocking=True (the copy
    # overlaps the previous step), or the whole uint8 set resident on the GPU when it fits;
    # augmentation and normalisation run on the device. The order is a function of (seed, epoch).
    # make_model: an --image-size or a batch the model cannot take is refused before any work.
    data = labrun.load_data(args, env, make_model)

    # ---- model ----------------------------------------------------------------------------------
    model = make_model(args, data.info)
    # torchrun: SyncBatchNorm on CUDA, and each rank its own augmentation stream.
    model = env.dist.prepare(model, args.seed)
    # channels_last (NHWC) is the layout tensor cores convolve in: no transposes per layer; for
    # images on a CPU too (the loaders' layout). Other inputs: contiguous (run.log says which).
    layout = data.layout
    model = model.to(env.device, memory_format=layout)

    # ---- optimizer and schedule: swap them here (README, "Another optimizer") -------------------
    # AdamW fused into one kernel (CUDA and CPU; on CUDA it also does GradScaler's inf check on
    # the device): unfused, it is ~10 ops per parameter tensor and step.
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, fused=True)
    # One-cycle (Smith & Topin): the LR climbs over the first --warm-up of the steps to --lr,
    # then anneals (cosine) to ~0 at the last one; AdamW's beta1 cycles 0.95 -> 0.85 -> 0.95.
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=args.lr,
        total_steps=max(data.total_steps, 1),
        pct_start=args.warm_up,
        anneal_strategy="cos",
        cycle_momentum=True,
        base_momentum=0.85,
        max_momentum=0.95,
    )
    # bf16 autocast where the GPU has bf16 tensor cores, fp16 below (env.amp_dtype, chosen by
    # compute capability), fp32 on CPU. fp16 needs loss scaling to keep small gradients; bf16
    # has fp32's range and needs none.
    scaler = torch.amp.GradScaler(env.device.type, enabled=env.amp_dtype == torch.float16)
    # An exponential moving average of the weights: what we evaluate and test.
    ema = labrun.EMA(model, args.ema) if args.ema > 0 else None
    # The epoch's loss and metric sums stay on the device: the step adds, no host sync.
    sums = labrun.TrainSums(env.task, env.device)
    # Early stopping keeps the best weights; patience counts only after the LR peak and
    # --min-epochs (no stop while the warm-up makes validation jump).
    stopper = labrun.EarlyStopping.after_warm_up(args, env.task, sched, data.steps_per_epoch)
    return SimpleNamespace(
        data=data, model=model, layout=layout, optimizer=opt, scheduler=sched, scaler=scaler,
        ema=ema, eval_model=ema.module if ema is not None else model, sums=sums, stopper=stopper,
    )  # fmt: skip


def make_step(built, compiled, args, env, loss_fn):
    """The training step: `compiled.net` (the model, compiled and in DDP where that applies)
    forward and backward under autocast, then the optimizer, schedule and EMA of `built`."""
    import contextlib

    import torch

    model, opt, sched, scaler, ema = (built.model, built.optimizer, built.scheduler,
                                      built.scaler, built.ema)  # fmt: skip
    net = compiled.net

    def forward_backward(micro_batches, sums: bool = True):
        """Gradients of the mean loss over the micro-batches (summed into .grad); returns that
        mean (LBFGS's closure reads it: README, "Another optimizer")."""
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            if built.layout == torch.contiguous_format:  # LBFGS (README): images come NHWC
                x = x.contiguous()
            # DDP all-reduces the gradients once, on the last micro-batch, not on each.
            final = i == len(micro_batches) - 1
            with contextlib.nullcontext() if final or not compiled.ddp else net.no_sync():
                with torch.autocast(
                    env.device.type, env.amp_dtype, enabled=env.amp_dtype is not None
                ):
                    outputs = net(x)
                loss = loss_fn(outputs, y)  # fp32, on the (bf16/fp16) outputs
                mean = loss / len(micro_batches) if len(micro_batches) > 1 else loss  # no / 1
                scaler.scale(mean).backward()
            if sums:  # the epoch's loss and metric sums stay on the device: no host sync
                built.sums.add(loss, outputs, y)
            losses.append(loss)
        # One micro-batch (the default): its loss is the mean, no kernel launched for it.
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    def step(micro_batches) -> None:
        """One optimizer step over --grad-accum micro-batches. Nothing here waits for the GPU."""
        if compiled.cuda_graphs:  # this replay may now reuse the memory of the last one's
            torch.compiler.cudagraph_mark_step_begin()
        forward_backward(micro_batches)
        if args.clip_grad > 0:
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad, foreach=True)
        scaler.step(opt)  # fp16: skipped if a gradient overflowed (inf or NaN)
        scaler.update()
        opt.zero_grad(set_to_none=True)  # frees the gradients' memory; no memset kernel
        if sched is not None:
            sched.step()
        if ema is not None:
            ema.update()

    return step


def train(job: labrun.TrainingJob) -> None:
    """The method. `job` (labrun.TrainingJob) is the run directory: resume, history, checkpoints,
    metrics, MLflow, stop signals; `job.args` the flags, `job.env` the device and the task."""
    args, env = job.args, job.env
    # The loss the step trains on (the compile probe and --find-lr use it too), and the one
    # validation and test report (the task's: without --label-smoothing).
    loss_fn, report_loss = env.task.loss, env.task.eval_loss
    built = build(args, env)
    data, model, eval_model, stopper = built.data, built.model, built.eval_model, built.stopper

    # Resume: every object by its state_dict, plus progress, RNG and early stopping (or start).
    progress = job.resume(
        data, stopper, loss_fn, model=model, optimizer=built.optimizer,
        scheduler=built.scheduler, scaler=built.scaler, ema=built.ema, sums=built.sums,
    )  # fmt: skip

    # ---- compile where it pays, then DDP around the compiled module (nanoGPT's order) ----------
    # Times eager passes on a real batch against this machine's recorded compile cost (run.log
    # says why; rank 0 decides for all), compiles with dynamic=False (one batch shape: static
    # graphs) outside the timed loop, and wraps it in DistributedDataParallel under torchrun.
    compiled = job.compile(model, loss_fn, data.train, progress)
    step = make_step(built, compiled, args, env, loss_fn)
    if labrun.is_tool(args):  # --find-lr, --find-batch-size, --profile: measure, report, exit
        return labrun.run_tools(job, built, step, loss_fn)

    # ---- the loop: epochs until --epochs (or the one --max-steps ends in), or early stopping ----
    while progress.epoch < data.last_epoch and not stopper.should_stop:
        model.train()
        # This epoch's steps from where the run is (resume-exact: a resumed epoch skips the
        # micro-batches it did), each --grad-accum micro-batches already on the device.
        for micro_batches in job.batches(data.train):
            step(micro_batches)
            job.tick()  # counted; a stop signal: checkpoint, exit 75 (re-run the same command)
        val = labrun.evaluate(eval_model, data.val, report_loss, env)
        lr = built.optimizer.param_groups[0]["lr"]
        row = job.end_epoch(built.sums, val, lr=lr)  # history.csv, run.log, MLflow
        if stopper.update(row[env.task.monitor], progress.epoch, eval_model):
            job.save_best(stopper)  # best_model.pt
        job.checkpoint(every=args.checkpoint_every)  # checkpoint.pt, when that many s passed

    # ---- test once, with the weights --test-weights names (best epoch's or final); save --------
    if args.test_weights == "best":
        stopper.restore(eval_model)  # the best epoch's weights (fails if it was never finite)
    test = labrun.evaluate(eval_model, data.test, report_loss, env)
    job.finish(stopper, test)  # checkpoint, then metrics.json last


if __name__ == "__main__":
    sys.exit(main())
