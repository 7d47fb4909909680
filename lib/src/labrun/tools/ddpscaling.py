"""DDP's cost, measured: step time on 1 and N processes (gpucheck's `ddp` check, and
benchmarks/bench_ddp.py). `python -m labrun.tools.ddpscaling DEVICE BATCH STEPS WIDTH OUT.json`
is the worker check_scaling starts under torchrun."""

from __future__ import annotations

import sys

from ..distributed import _env_int, session
from ..project import current

SCALING_MIN = 0.8  # gpucheck's ddp check: weak-scaling efficiency below this is a FAIL


def measure_step(device_name: str, batch: int, steps: int, width: int) -> dict:
    """Seconds per optimizer step (the slowest rank's) of the default model on `batch` random
    images per process, run.py's step: autocast in run.py's precision (timing fp32 would
    overstate the all-reduce's share), channels_last, AdamW, DDP."""
    import torch
    import torch.distributed as td
    import torch.nn.functional as F

    from ..hardware import choose_precision, timed
    from .reference import default_model

    with session(device_name) as dist:
        device = dist.place(torch.device(device_name))
        dtype, _ = choose_precision(device, "auto")
        model = dist.prepare(default_model(width), 0).to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        net = dist.ddp(model) or model
        x = torch.randn(batch, 3, 32, 32, device=device).contiguous(
            memory_format=torch.channels_last
        )
        y = torch.randint(0, 10, (batch,), device=device)

        def step() -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        now = timed(device)
        for _ in range(5):  # warm-up: allocator, cuDNN autotune, DDP buckets
            step()
        now()
        dist.settle(None)  # start together
        started = now()
        for _ in range(steps):
            step()
        seconds = torch.tensor([now() - started])
        if dist.active:
            td.all_reduce(seconds, op=td.ReduceOp.MAX, group=dist.cpu_group)
        precision = str(dtype).removeprefix("torch.") if dtype else "fp32"
        result = {"world": dist.world, "batch": batch, "step_s": seconds.item() / steps}
        return {**result, "precision": precision}


def check_scaling(
    device: str, nproc: int, *, batch: int, steps: int, width: int, threshold: float = SCALING_MIN
) -> tuple[bool, str]:
    """DDP's weak scaling: step time on 1 process and on `nproc` (torchrun), `batch` samples
    per process each; efficiency = t1 / tN (1.0: the gradient all-reduce costs nothing).
    Below `threshold` is a FAIL: the interconnect or the bucketing eats the extra GPUs."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    bench = ["-m", "labrun.tools.ddpscaling", device, str(batch), str(steps), str(width)]
    root = current().root  # the project: its models
    times = {}
    with tempfile.TemporaryDirectory(prefix="ddpcheck_") as work:
        for n in (1, nproc):
            out = Path(work) / f"{n}.json"
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
            cmd = [sys.executable, *(launcher if n > 1 else []), *bench, str(out)]
            done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                return False, f"{n} process(es) failed: {done.stderr.strip()[-300:]}"
            measured = json.loads(out.read_text())
            times[n] = measured["step_s"]
    efficiency = times[1] / times[nproc]
    return efficiency >= threshold, (
        f"step {1000 * times[1]:.1f} ms on 1 process, {1000 * times[nproc]:.1f} ms on {nproc} "
        f"({batch} samples each, {measured['precision']}): scaling efficiency "
        f"{100 * efficiency:.0f} % "
        f"(FAIL below {100 * threshold:.0f} %)"
    )


def _measure_main(argv: list[str]) -> int:
    """check_scaling's worker: DEVICE BATCH STEPS WIDTH OUT.json (rank 0 writes it)."""
    import json
    from pathlib import Path

    device, batch, steps, width, out = argv
    result = measure_step(device, int(batch), int(steps), int(width))
    if _env_int("RANK", 0) == 0:
        Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_measure_main(sys.argv[1:]))
