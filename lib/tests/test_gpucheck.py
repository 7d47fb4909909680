"""gpucheck can fail: faults planted on CPU (a slowed loader, a forced recompile, a CPU build of
torch on a machine whose nvidia-smi lists a GPU) give FAIL and a non-zero exit; without CUDA,
what cannot run says "not checked" (never PASS) and the exit status is 0."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from labrun import gpucheck
from labrun.gpucheck import FAIL, NOT_CHECKED, PASS

PACKAGE = "{{ cookiecutter.package_name }}"


def context(tmp_path, **options) -> gpucheck.Context:
    argv = ["--device", "cpu", "--width", "8", "--batch-size", "16", "--steps", "4"]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return gpucheck.Context(
        gpucheck.parse_args(argv), torch.device("cpu"), tmp_path, logging.getLogger("gpucheck")
    )


class SlowLoader:
    """The planted fault: run.py's loader, `delay` seconds slower per batch."""

    def __init__(self, loader, delay: float) -> None:
        self.loader, self.delay = loader, delay

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, *args, **kwargs) -> None:
        self.loader.set_epoch(*args, **kwargs)

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch


def test_feed_threshold():
    assert gpucheck.feed_result("feed", 95.0, 100.0).status == PASS
    assert gpucheck.feed_result("feed", 89.0, 100.0).status == FAIL


@pytest.mark.slow
def test_a_slowed_loader_fails_the_feed_check_and_the_exit_status(tmp_path, monkeypatch, capsys):
    measured = []

    def slowed_feed(ctx):
        """The feed check on run.py's job, its loader slowed (the planted fault)."""
        job = gpucheck.build_job(ctx, "--dataset", "synthetic", "--synthetic-size", "400")
        # 10x the step's forward + backward per batch: far below the threshold, even when a
        # busy machine disturbs one of the two measurements.
        job.data.loaders["train"] = SlowLoader(job.data.loaders["train"], 10 * job.eager_s)
        measured.append(gpucheck.job_and_ceiling(job, steps=4, warmup=1))
        return [gpucheck.feed_result("feed", *measured[-1])]

    monkeypatch.setattr(gpucheck, "CHECKS", [slowed_feed])
    argv = ["--device", "cpu", "--width", "8", "--batch-size", "16"]
    assert gpucheck.main(argv) == 1
    (rate, ceiling), out = measured[0], capsys.readouterr().out
    assert rate < 0.5 * ceiling  # the loop gets at most ~1/11 of the step's rate
    assert f"feed  {FAIL}" in out and "FAILED: feed" in out


@pytest.fixture
def eager_backend(monkeypatch, tmp_path):
    """torch.compile with backend="eager": Dynamo traces, guards and recompiles as with
    inductor, without compiling kernels (seconds instead of minutes on CPU)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="eager"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_recompile_check_passes_and_a_forced_recompile_fails(tmp_path, eager_backend):
    ctx = context(tmp_path)
    flags = ("--dataset", "synthetic", "--synthetic-size", "400")
    job = gpucheck.build_job(ctx, *flags, mode="default")
    assert job.trainer.compiled and job.compiled_s is not None
    assert gpucheck.check_no_recompiles(job).status == PASS
    # The planted fault: batches in another memory layout than the compiled graph's guards.
    loader = job.data.loaders["train"]

    class OtherLayout(SlowLoader):
        def __iter__(self):
            for x, y in self.loader:
                yield x.contiguous(), y  # NCHW instead of the loader's channels_last

    job.data.loaders["train"] = OtherLayout(loader, 0.0)
    result = gpucheck.check_no_recompiles(job)
    assert result.status == FAIL and "Recompile" in result.detail, result


def cli(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.gpucheck", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
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


@pytest.mark.slow
def test_dry_run_on_cpu_runs_what_can_run_and_its_status_follows_the_verdicts():
    result = cli(
        *("--device", "cpu", "--steps", "4", "--width", "8", "--batch-size", "16"),
        *("--synthetic-size", "600", "--stream-size", "32"),
    )
    rows = {}
    for line in result.stdout.splitlines()[1:]:
        if line.strip() and not line.startswith(("FAILED", "no check failed")):
            rows[line.split("  ")[0]] = line
    for name in ("layout", "resume"):
        assert f"  {PASS}  " in rows[name], result.stdout
    for name in ("feed", "feed stream 32px"):  # measured on CPU too: a verdict, not a pass
        assert f"  {PASS}  " in rows[name] or f"  {FAIL}  " in rows[name], result.stdout
    for name in ("sync", "sync --ema", "sync fp16", "plain", "precision"):
        assert f"  {NOT_CHECKED}  no CUDA" in rows[name], result.stdout
    failed = any(f"  {FAIL}  " in row for row in rows.values())
    assert result.returncode == (1 if failed else 0), result.stdout + result.stderr
