"""gpucheck can fail: each verdict is tested on planted results (a slow job, a recompile in the
log, diverging losses, a host sync), a CPU build of torch on a machine whose nvidia-smi lists a
GPU gives FAIL and a non-zero exit; without CUDA, what cannot run says "not checked" (never PASS)
and the exit status is 0; `--device cpu` from a project runs run.py itself and never crashes."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from labrun.tools import gpucheck
from labrun.tools.gpucheck import FAIL, NOT_CHECKED, PASS, JobResult


def job_with(
    tmp_path, name: str, losses: list[float], stderr: str = "", log: str = ""
) -> JobResult:
    """A finished run.py job as gpucheck reads it: history.csv, run.log, its stderr."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    rows = ["epoch,train_loss,epoch_time_s"] + [f"{i + 1},{x},0.5" for i, x in enumerate(losses)]
    (run_dir / "history.csv").write_text("\n".join(rows) + "\n")
    (run_dir / "run.log").write_text(log)
    return JobResult(0, run_dir, stderr)


def test_feed_and_plain_thresholds():
    assert gpucheck.feed_result("feed", 95.0, 100.0).status == PASS
    assert gpucheck.feed_result("feed", 89.0, 100.0).status == FAIL
    assert gpucheck.reference_result("plain", 101.0, 100.0, gpucheck.PLAIN_MIN, None).status == (
        PASS
    )
    slower = gpucheck.reference_result("plain", 471.0, 529.0, gpucheck.PLAIN_MIN, None)
    assert slower.status == FAIL and "0.89x" in slower.detail  # issue 28.9's Xeon
    # gpu.md's H100 at batch 128: the job 15,433, the hand-written CUDA-graph loop 49,089
    ceiling = gpucheck.reference_result("ceiling", 15433, 49089, 0.9, "reduce-overhead")
    assert (
        ceiling.status == FAIL
        and "0.31x" in ceiling.detail
        and "reduce-overhead" in (ceiling.detail)
    )
    assert gpucheck.reference_result("ceiling", 45000, 49089, 0.9, None).status == PASS


@pytest.mark.parametrize("loop", ["best_practice_rate", "naive_rate"])
def test_the_reference_loops_train_the_model_they_are_given(loop):
    """The yardsticks must do the work they claim: every weight moves, a rate comes back."""
    from labrun.tools import reference

    torch.manual_seed(0)
    model = reference.default_model(4)
    before = [p.detach().clone() for p in model.parameters()]
    split = reference.synthetic_split(64)
    extra = {"dtype": None} if loop == "best_practice_rate" else {}
    rate = getattr(reference, loop)(
        model, split.images, split.labels, batch_size=16, steps=3, warmup=1, **extra
    )
    assert rate > 0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_recompile_or_a_broken_job_fails_the_compile_checks(tmp_path):
    compiled = "INFO compile: default (--compile on)\nINFO compiled (default) in 3.0 s\n"
    clean = job_with(tmp_path, "clean", [1.0], log=compiled)
    assert gpucheck.recompile_result("recompiles", clean, "train").status == PASS
    recompiled = job_with(
        tmp_path,
        "again",
        [1.0],
        stderr="V1124 torch/_dynamo/guards.py] Recompiling function forward in run.py:140\n"
        "    triggered by the following guard failure(s): tensor 'x' stride mismatch\n",
        log=compiled,
    )
    result = gpucheck.recompile_result("ddp compile", recompiled, "2 ranks")
    assert result.status == FAIL and "1 recompiles" in result.detail, result
    broken = JobResult(1, None, "Traceback ...\nerror: torchrun: rank 1 failed\n")
    assert gpucheck.recompile_result("ddp compile", broken, "2 ranks").status == FAIL


def test_accumulated_gradients_that_diverge_from_eager_fail(tmp_path):
    eager = job_with(tmp_path, "eager", [2.0, 1.5])
    same = job_with(tmp_path, "same", [2.01, 1.49], log="INFO compile: max-autotune\n")
    assert gpucheck.accumulation_result(same, eager).status == PASS
    # CUDA graphs that overwrite the accumulated gradients (issue 28.8) learn something else
    overwritten = job_with(tmp_path, "overwritten", [2.3, 2.2])
    assert gpucheck.accumulation_result(overwritten, eager).status == FAIL


def test_a_resume_that_differs_and_a_host_sync_fail(tmp_path):
    straight = job_with(tmp_path, "straight", [2.0, 1.5])
    assert gpucheck.resume_result(straight, straight, interrupted=True).status == PASS
    other = job_with(tmp_path, "other", [2.0, 1.6])
    assert gpucheck.resume_result(straight, other, interrupted=True).status == FAIL
    assert gpucheck.sync_result([]).status == PASS
    assert gpucheck.sync_result(["called a synchronizing CUDA operation"]).status == FAIL


def test_the_cuda_checks_run_run_py_on_a_patched_gpu(tmp_path, monkeypatch):
    """The CUDA-only checks with the device queries patched: two GPUs seen, run.py's jobs
    planted (a recompile under DDP, gradients overwritten under accumulation): both FAIL."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    options = argparse.Namespace(width=8, batch_size=16, skip=[], timeout=60)
    ctx = gpucheck.Context(options, torch.device("cuda"), tmp_path, logging.getLogger("t"), ROOT)
    planted = {
        "--nproc": job_with(
            tmp_path,
            "ddp",
            [1.0],
            stderr="Recompiling function step\n",
            log="INFO compile: default\nINFO compiled (default)\n",
        ),
        "on": job_with(tmp_path, "accum", [2.3, 2.2], log="INFO compile: max-autotune\n"),
        "off": job_with(tmp_path, "eager", [2.0, 1.5]),
    }
    calls = []

    def run_job(ctx, *flags, nproc=1, **kwargs):
        calls.append((flags, nproc))
        return planted["--nproc"] if nproc > 1 else planted[flags[flags.index("--compile") + 1]]

    monkeypatch.setattr(gpucheck, "run_job", run_job)
    [ddp] = gpucheck.check_ddp_compile(ctx)
    [accum] = gpucheck.check_accumulation(ctx)
    assert ddp.status == FAIL and accum.status == FAIL, (ddp, accum)
    assert calls[0][1] == 2 and "--grad-accum" in calls[1][0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpucheck.check_ddp_compile(ctx)[0].status == NOT_CHECKED


def cli(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    return subprocess.run(
        [sys.executable, "-m", "labrun.gpucheck", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )


def test_without_cuda_nothing_is_claimed_and_the_exit_is_0(tmp_path):
    (tmp_path / "bin").mkdir()  # a PATH without nvidia-smi: a machine without NVIDIA GPUs
    result = cli(path=f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines()[1:] if line.strip()]
    rows = lines[:-1]
    assert rows and all(f"  {NOT_CHECKED}  " in row for row in rows), result.stdout
    assert "PASS" not in result.stdout and "no check failed; not checked here:" in lines[-1]


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")
def test_cpu_torch_on_a_machine_with_nvidia_gpus_fails_with_the_install_line(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"  # what nvidia-smi -L prints on a GPU node
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)'\n")
    fake.chmod(0o755)
    result = cli(path=f"{fake.parent}:{os.environ['PATH']}")
    assert result.returncode == 1, result.stdout + result.stderr
    build = next(line for line in result.stdout.splitlines() if line.startswith("torch build"))
    assert f"  {FAIL}  " in build and "CPU build" in build
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu128" in build
    assert "FAILED: torch build" in result.stdout


@pytest.mark.slow  # run.py jobs, two of them compiled, one under torchrun
def test_dry_run_on_cpu_runs_run_py_itself_and_never_crashes():
    """28.10: the streamed-folder check died with a segmentation fault (exit 139)."""
    result = cli(
        *("--device", "cpu", "--steps", "4", "--width", "8", "--batch-size", "16"),
        *("--synthetic-size", "600", "--stream-size", "32", "--timeout", "600"),
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    rows = {}
    for line in result.stdout.splitlines()[1:]:
        if line.strip() and not line.startswith(("FAILED", "no check failed")):
            rows[line.split("  ")[0]] = line
    for name in ("resume", "recompiles", "ddp compile"):
        assert f"  {PASS}  " in rows[name], result.stdout + result.stderr[-3000:]
    for name in ("ceiling", "plain", "feed stream 32px"):  # on CPU too: a verdict, not a pass
        assert f"  {PASS}  " in rows[name] or f"  {FAIL}  " in rows[name], result.stdout
    for name in ("sync", "accum", "precision", "feed"):
        assert f"  {NOT_CHECKED}  no CUDA" in rows[name], result.stdout
    # where the streamed job's time went: its decode path and the loop's wait for batches
    assert "streamed job's loader: the loop waited " in rows["feed stream 32px"], result.stdout
    assert "decoded on the CPU (Pillow)" in rows["feed stream 32px"], result.stdout
    failed = any(f"  {FAIL}  " in row for row in rows.values())
    assert result.returncode == (1 if failed else 0), result.stdout + result.stderr


# What TORCH_LOGS=cudagraphs printed for run.py --compile reduce-overhead on the H200 (gpu.md,
# forward and backward alike), and what a step whose graphs replay prints (cudagraph_trees).
H200_LOG = """\
Created 3 graph partitions: 1 cudagraphable, 2 non-cudagraphable
  Partition 1: 92 nodes, non-cudagraphable, inputs=40, outputs=30
    buf0: reason=dynamic shape ops, ir=ComputedBuffer, fx=convert_element_type(primals_1, torch.bfloat16)
Created 3 graph partitions: 1 cudagraphable, 2 non-cudagraphable
"""  # noqa: E501
REPLAYED_LOG = """\
Created 1 graph partitions: 1 cudagraphable, 0 non-cudagraphable
Created 1 graph partitions: 1 cudagraphable, 0 non-cudagraphable
[0/0] Running warmup function=partition_0, mode=FORWARD
[0/0] Recording function=partition_0, mode=FORWARD, cuda_graph_id=0, inputs: 63
[0/0] Recording function=partition_0, mode=BACKWARD, cuda_graph_id=1, inputs: 80
"""


def test_the_graphs_check_fails_where_the_step_would_not_replay_cuda_graphs(tmp_path):
    ok = gpucheck.graphs_result(REPLAYED_LOG)
    assert ok.status == PASS and "2 CUDA graphs recorded (backward, forward)" in ok.detail, ok
    h200 = gpucheck.graphs_result(H200_LOG)
    assert h200.status == FAIL and "4 not (threshold 0)" in h200.detail, h200
    assert "non-cudagraphable nodes (dynamic shape ops)" in h200.detail
    skipped = "skipping cudagraphs due to mutated inputs (1 instances)\n"
    assert gpucheck.graphs_result(REPLAYED_LOG + skipped).status == FAIL
    rerecorded = "Re-recording function=partition_0, mode=FORWARD, reason=static input changed\n"
    assert gpucheck.graphs_result(REPLAYED_LOG + rerecorded).status == FAIL
    forward_only = "\n".join(x for x in REPLAYED_LOG.splitlines() if "BACKWARD" not in x)
    assert "no graph recorded for backward" in gpucheck.graphs_result(forward_only).detail
    older = (
        "Recording function 0 of graph recording id 0\nRecording function 1 of graph recording id 1"
    )
    assert gpucheck.graphs_result(older).status == PASS  # torch before the mode was logged
    assert gpucheck.graphs_result(older.splitlines()[0]).status == FAIL
    # A CPU run claims nothing; on a (patched) GPU the job is run.py --compile reduce-overhead.
    options = argparse.Namespace(width=8, batch_size=16, skip=[], timeout=60)
    log = logging.getLogger("t")
    cpu = gpucheck.Context(options, torch.device("cpu"), tmp_path, log, ROOT)
    [result] = gpucheck.check_graphs(cpu)
    assert result.status == NOT_CHECKED and result.detail.startswith("skipped: no GPU")
    seen = []

    def run_job(ctx, *flags, env=None, **kwargs):
        seen.append((flags, env))  # the graphed job, then the eager one: other losses
        name, losses = ("ro", [2.0, 1.0]) if len(seen) == 1 else ("eager", [2.0, 1.5])
        return job_with(tmp_path, name, losses, stderr=H200_LOG)

    cuda = gpucheck.Context(options, torch.device("cuda"), tmp_path, log, ROOT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpucheck, "run_job", run_job)
        graphs, numbers = gpucheck.check_graphs(cuda)
    assert graphs.status == FAIL and numbers.status == FAIL and numbers.name == "graphs = eager"
    [(flags, env), (eager, _)] = seen
    assert "reduce-overhead" in flags and env == {"TORCH_LOGS": "cudagraphs"}
    assert eager[eager.index("--compile") + 1] == "off" and "--seed" in eager
