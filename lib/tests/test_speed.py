"""Speed you can see (issue 33.4): samples/s in every run's run.log and metrics.json; on CUDA
also MFU (FLOPs per sample x rate / this GPU's measured matmul peak) and the share of the step
the GPU was busy, with what a larger batch would give when under 50 %. The CUDA parts run on
CPU here with the device queries (the profiler, the peak) patched."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch
from conftest import capture_step, read_metrics, run_dir_of
from torch import nn

from labrun import compiling, hardware
from labrun.session import EpochPace, Progress, TrainingJob
from labrun.tasks import cross_entropy

CPU = torch.device("cpu")


def test_flops_per_sample_counts_forward_and_backward_and_leaves_no_trace():
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    # forward: 2 x 4 x 3 per sample; backward: the weight's gradient only (x needs none)
    assert hardware.flops_per_sample(model, x, y, cross_entropy, None) == 2 * 2 * 4 * 3
    assert model.weight.grad is None


class FakeProfile:
    """torch.profiler.profile's part GpuBusy uses: kernels of 1.41 ms per step (gpu.md)."""

    def __init__(self, activities):
        self.running = False

    def start(self):
        self.running = True

    def stop(self):
        self.running = False

    def events(self):
        from torch.autograd import DeviceType

        steps = hardware.BUSY_STEPS
        kernel = {"device_type": DeviceType.CUDA, "is_user_annotation": False}
        return [types.SimpleNamespace(self_device_time_total=1410.0 * steps, **kernel)]


def test_gpu_busy_profiles_a_few_real_steps(monkeypatch):
    import torch.profiler

    clock = iter([10.0, 10.0 + 0.00759 * hardware.BUSY_STEPS])
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(hardware, "timed", lambda device: lambda: next(clock))
    busy = hardware.GpuBusy(torch.device("cuda"))
    for step in range(30):
        busy.at(step)
    busy.close(30)  # already closed at BUSY_FIRST + BUSY_STEPS: nothing more
    assert busy.share == pytest.approx(1.41 / 7.59) and busy.step_s == pytest.approx(0.00759)


def test_a_launch_bound_step_says_so_and_what_a_larger_batch_gives():
    line = hardware.busy_line(1.41 / 7.59, 0.00759, 128)
    assert line.startswith("GPU busy 19 % of the step (1.41 of 7.59 ms): under 50 %")
    # 8 x the batch: the GPU's 11.3 ms then outlast the 7.6 ms of launches
    assert "--batch-size 1024 would give >= 90,780 samples/s (now 16,864)" in line
    assert "under 50" not in hardware.busy_line(0.8, 0.01, 512)


def test_the_cuda_speed_scale_is_measured_once_per_machine_and_model(
    monkeypatch, data_dir, tmp_path, caplog
):
    """gpu.md: every CUDA job measured the matmul peak (8192-square products) and profiled 10
    steps. The peak is measured once per GPU model, precision, torch and labrun, the busy
    share once per model, input and compile mode: both kept beside the compile records."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    peaks = []
    monkeypatch.setattr(
        hardware, "measure_matmul_flops", lambda device, dtype: peaks.append(1) or 7.69e14
    )
    caplog.set_level(logging.INFO, logger="test_speed")
    log = logging.getLogger("test_speed")
    for job in ("first", "second"):
        c = capture_step(monkeypatch, data_dir, tmp_path / job)
        speed, busy_record = compiling.speed_scale(
            c.model, c.batch, c.loss_fn, c.env, None, 64, log
        )
        assert speed["flops_per_sample"] > 0 and speed["peak_flops"] == 7.69e14
        assert all(p.grad is None for p in c.model.parameters())
        if job == "first":
            assert "769 TFLOP/s in fp32 (measured now)" in caplog.text
            assert "gpu_busy" not in speed  # batches() profiles the first epoch
            # The first epoch's end with a profile of it (GpuBusy's numbers, gpu.md's step).
            job = TrainingJob.__new__(TrainingJob)  # the loop's bookkeeping only: no run directory
            job.compiled = types.SimpleNamespace(busy_record=busy_record, record=None)
            job.progress, job.speed, job.args, job.log = Progress(), {}, c.args, log
            pace = job.pace = EpochPace.__new__(EpochPace)  # the epoch's end only
            pace.now, pace.t0, pace.first_step, pace.resumed_in_epoch = (lambda: 1.0), 0.0, 0, False
            pace.bar = types.SimpleNamespace(close=print)
            pace.busy = types.SimpleNamespace(share=0.186, step_s=0.00759, close=print)
            job._epoch_trained()
            caplog.clear()
    assert peaks == [1], "the second job measured the peak again"
    assert "769 TFLOP/s in fp32 (recorded " in caplog.text
    assert speed["gpu_busy"] == 0.186  # batches() profiles nothing
    assert "GPU busy 19 % of the step (1.41 of 7.59 ms)" in caplog.text


@pytest.mark.parametrize("cuda", [False, True])
def test_run_log_and_metrics_give_samples_per_sec_and_on_cuda_mfu(
    main_in_process, tmp_path, monkeypatch, cuda
):
    speed = {"flops_per_sample": 4.28e8, "peak_flops": 7.69e14, "gpu_busy": 0.186}
    finish = TrainingJob.finish

    def finish_with_cuda_speed(self, stopper, test):
        if cuda:  # what compile_model and the first epoch measure on a GPU
            self.speed.update(speed)
        return finish(self, stopper, test)

    monkeypatch.setattr(TrainingJob, "finish", finish_with_cuda_speed)
    monkeypatch.setenv("LAB_TRACKING", "off")
    assert main_in_process("--epochs", "1", "--results-dir", str(tmp_path)) == 0
    run_dir = run_dir_of(tmp_path)
    metrics, log = read_metrics(run_dir), (run_dir / "run.log").read_text()
    rate = metrics["samples_per_sec"]
    assert rate > 0 and " samples/s" in log.split("epoch 1/1")[1].splitlines()[0]
    finished = next(line for line in log.splitlines() if " finished (" in line)
    assert f"{rate:.0f} samples/s" in finished
    if not cuda:
        assert not {"mfu", "flops_per_sample", "gpu_busy_share"} & set(metrics)
        return
    assert metrics["mfu"] == pytest.approx(4.28e8 * rate / 7.69e14)
    assert metrics["gpu_busy_share"] == 0.186 and metrics["flops_per_sample"] == 4.28e8
    assert f"MFU {100 * metrics['mfu']:.1f} %" in finished
    json.dumps(metrics)  # plain numbers


def test_profile_counts_each_steps_kernels_and_the_gpus_busy_time(monkeypatch):
    """--profile on CUDA (the profiler's events patched in): gpu.md's default step at 128.
    Its `optimizer_step_N` regions are on the GPU's timeline too (user annotations, a whole
    step each): counted, they made "GPU busy 25.77 of 18.08 ms (143 %)"."""
    from torch.autograd import DeviceType

    from labrun.tools.tuning import launches_per_step

    def event(device, us, annotation=False):
        return types.SimpleNamespace(
            device_type=device, self_device_time_total=us, is_user_annotation=annotation
        )

    kernel, host = event(DeviceType.CUDA, 1410 / 243), event(DeviceType.CPU, 0.0)
    step = event(DeviceType.CUDA, 7590.0, annotation=True)  # optimizer_step_N on the GPU
    prof = types.SimpleNamespace(events=lambda: [kernel] * 243 * 2 + [host] * 100 + [step] * 2)
    line = launches_per_step(prof, 2, 0.00759, on_cuda=True)
    assert line == "per step: 243 kernels, GPU busy 1.41 of 7.59 ms (19 %)"
    busy = hardware.GpuBusy(CPU)  # its sum over the same events, over 1 s of wall time
    busy._profile, busy._started = types.SimpleNamespace(stop=lambda: None, events=prof.events), 1.0
    monkeypatch.setattr(hardware, "timed", lambda device: lambda: 2.0)
    busy.close(hardware.BUSY_FIRST + 2)
    assert busy.share == pytest.approx(2 * 1410 / 1e6) and busy.step_s == 0.5
