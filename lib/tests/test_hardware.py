"""Device policy on CPU with patched device queries: precision per compute capability,
--deterministic's backend flags, RNG restore across device counts, the
plain best_model.pt, and the batch-size rule (gpucheck: test_gpucheck.py)."""

from __future__ import annotations

import pytest
import torch
from lab_project.model import build_model

from labrun import checkpoint, hardware
from labrun.tools import tuning
from labrun.tools.tuning import recommend_batch_size

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((7, 0), torch.float16),  # V100: bf16 only emulated
        ((7, 5), torch.float16),  # T4
        ((8, 0), torch.bfloat16),  # A100
        ((9, 0), torch.bfloat16),  # H100
    ],
)
def test_cuda_precision_follows_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # is_bf16_supported() says True on V100/T4 too (emulation): it must not decide.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    dtype, why = hardware.choose_precision(CUDA, "auto")
    assert dtype == expected and f"{capability[0]}.{capability[1]}" in why
    assert ("GradScaler" in why) == (expected == torch.float16)
    assert hardware.choose_precision(CUDA, "off")[0] is None


@pytest.mark.parametrize("native", [True, False])
def test_cpu_bf16_only_with_native_support(monkeypatch, native):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    assert hardware.choose_precision(CPU, "on")[0] == (torch.bfloat16 if native else None)
    assert hardware.choose_precision(CPU, "auto")[0] is None


@pytest.fixture
def restore_backends():
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    ) = saved[:4]
    torch.set_float32_matmul_precision(saved[4])
    torch.use_deterministic_algorithms(saved[5], warn_only=saved[6])


def test_deterministic_turns_off_tf32_everywhere_and_raises_instead_of_warning(restore_backends):
    statement = hardware.setup_backends(CUDA, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert "compile off" in statement and "Still not reproducible" in statement
    # The default model trains under these rules (amax pooling, gather loss): one step on CPU.
    from labrun.tasks import cross_entropy

    model = build_model(width=8)
    cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
    # The next run in this process (a notebook, the tests) gets the fast kernels back.
    hardware.setup_backends(CPU, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_rng_restore_with_more_saved_cuda_states_than_devices(tmp_path):
    """A checkpoint from a 4-GPU job (old format: one CUDA state per visible GPU) resumes on a
    CPU-only machine: the CPU generators come back, the CUDA list is ignored."""
    state = checkpoint.rng_state(CPU)
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8) for _ in range(4)]
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"rng": state, "config_hash": "h"})
    expected = torch.rand(3)
    loaded = checkpoint.load(path, config_hash="h")
    assert checkpoint.set_rng_state(loaded["rng"], CPU) is None
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("saved", "index", "restored"),
    [
        (b"single", 0, b"single"),  # the training GPU's only (format 2: v1's lists are refused)
        (b"single", 5, b"single"),  # on whatever device this run trains
        (None, 0, None),  # written on CPU, resumed on CUDA
    ],
)
def test_cuda_rng_restore_picks_the_training_device(monkeypatch, saved, index, restored):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: calls.append((s, device)))
    state = checkpoint.rng_state(CPU)
    if saved is not None:
        state["cuda"] = saved
    note = checkpoint.set_rng_state(state, torch.device("cuda", index))
    if restored is None:
        assert calls == [] and "no CUDA RNG state" in note
    else:
        assert calls == [(restored, torch.device("cuda", index))] and note is None


def test_best_model_is_a_plain_state_dict(tmp_path):
    model = build_model(width=8)
    checkpoint.save_weights(tmp_path / "best_model.pt", model.state_dict())
    fresh = build_model(width=8)
    fresh.load_state_dict(torch.load(tmp_path / "best_model.pt", weights_only=True), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key


def test_the_run_writes_a_best_model_that_loads_strictly(main_in_process, tmp_path):
    from conftest import run_dir_of

    assert main_in_process("--epochs", "1", "--max-steps", "2", "--results-dir", str(tmp_path)) == 0
    run_dir = run_dir_of(tmp_path)
    model = build_model(width=8)
    model.load_state_dict(torch.load(run_dir / "best_model.pt", weights_only=True), strict=True)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert "cuda" not in state["rng"]  # a CPU run saves no CUDA generator
    assert "compile: eager" in (run_dir / "run.log").read_text()
    assert "compiled (" not in (run_dir / "run.log").read_text()


def test_batch_size_rule_and_find_batch_size_agree():
    assert tuning.recommended_batch_size(CPU) == tuning.BASE_BATCH_SIZE
    assert tuning.recommended_batch_size(CUDA) == tuning.CUDA_BATCH_SIZE
    assert tuning.default_lr(tuning.BASE_BATCH_SIZE) == tuning.BASE_LR
    assert tuning.default_lr(4 * tuning.BASE_BATCH_SIZE) == pytest.approx(2 * tuning.BASE_LR)
    assert recommend_batch_size(4096, CUDA) == (512, pytest.approx(2 * tuning.BASE_LR))
    assert recommend_batch_size(256, CUDA) == (256, pytest.approx(2**0.5 * tuning.BASE_LR))
    assert recommend_batch_size(4096, CPU)[0] == 128
