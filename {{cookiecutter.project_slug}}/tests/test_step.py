"""The Trainer's step on CPU: EMA, loss, GradScaler with clipping and accumulation, the compile
fallback (a patched torch.compile that fails in forward or in backward), warm-up, and the
Trainer's state_dict. Tiny models; each test takes well under a second."""

from __future__ import annotations

import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.exc import InternalTorchDynamoError

from labrun.tasks import cross_entropy
from labrun.train import EMA, Trainer, build_scheduler

CPU = torch.device("cpu")


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


def batches(n: int, size: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, 4, 4, generator=gen), torch.randint(0, 3, (size,), generator=gen))
        for _ in range(n)
    ]


def make_trainer(model: nn.Module, **kwargs) -> Trainer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    kwargs.setdefault("dtype", None)
    return Trainer(
        model,
        optimizer,
        build_scheduler(optimizer, 0.01, 20),
        device=CPU,
        log=logging.getLogger("test"),
        **kwargs,
    )


def warm_up_ema_fn(decay: float):
    """AveragedModel's multi_avg_fn for the timm/TensorFlow warm-up, written from the formula:
    AveragedModel copies on its first update and calls this with n = updates so far."""

    def average(ema, current, n):
        d = min(decay, (1 + int(n)) / (10 + int(n)))
        for e, c in zip(ema, current, strict=True):
            e.copy_(d * e + (1 - d) * c)

    return average


def test_ema_matches_averaged_model_with_the_warm_up():
    from torch.optim.swa_utils import AveragedModel

    model = small_net()
    ours = EMA(model, 0.75)
    theirs = AveragedModel(model, multi_avg_fn=warm_up_ema_fn(0.75), use_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    decays = []
    for x, y in batches(30):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        decays.append(ours.current_decay())
        ours.update()
        theirs.update_parameters(model)
    # A copy, then the warm-up (2/11, 3/12, ...), capped at 0.75 from n = 26 (27/36 = 0.75).
    assert decays[:3] == [0.0, 2 / 11, 3 / 12] and decays[25] < 0.75 == decays[26] == decays[-1]
    ours_state, theirs_state = ours.module.state_dict(), theirs.module.state_dict()
    floats = [k for k, v in ours_state.items() if v.is_floating_point()]
    assert len(floats) == 7  # conv; BN weight, bias, mean, var; linear weight, bias: all compared
    for key in floats:
        torch.testing.assert_close(ours_state[key], theirs_state[key], rtol=1e-6, atol=1e-7)
    # Integer buffers: copied, where AveragedModel averaged a counter into a meaningless value.
    assert ours_state["1.num_batches_tracked"] == model[1].num_batches_tracked == 30
    assert not any(t.requires_grad for t in ours.module.parameters())


def test_ema_of_a_short_run_holds_little_of_the_initial_weights():
    """The issue's case in numbers: 200 updates at decay 0.999. Without a warm-up 0.999**199 =
    82 % of the initial weights stay in the EMA; with it, under 1 %."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # the "initial weights"
    ema = EMA(model, 0.999)
    ema.update()  # the first update copies
    with torch.no_grad():
        model.weight.fill_(0.0)  # every later weight: 0, so what is left of the 1 is the share
    for _ in range(199):
        ema.update()
    assert ema.module.weight.item() < 0.01


def test_gather_cross_entropy_equals_torch_with_and_without_smoothing():
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.randint(0, 5, (6,))
    for smoothing in (0.0, 0.1):
        ours = cross_entropy(logits, target, smoothing)
        reference = F.cross_entropy(logits, target, label_smoothing=smoothing)
        torch.testing.assert_close(ours, reference)
        (g1,) = torch.autograd.grad(ours, logits)
        (g2,) = torch.autograd.grad(reference, logits)
        torch.testing.assert_close(g1, g2)


def linear_trainer(dtype, clip_grad: float, grad_accum: int) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Trainer(
        model,
        optimizer,
        scheduler,
        device=CPU,
        dtype=dtype,
        clip_grad=clip_grad,
        grad_accum=grad_accum,
    )


def test_grad_scaler_on_cpu_unscales_before_clipping_and_accumulates():
    # Small inputs: the scaled fp16 gradients (x 65536) stay finite, so the step is not skipped;
    # clip at 0.01, below the true gradient norm, so clipping acts.
    x, y = torch.randn(8, 8) * 0.1, torch.randint(0, 3, (8,))
    scaled = linear_trainer(torch.float16, clip_grad=0.01, grad_accum=2)
    assert scaled.scaler.is_enabled() and scaled.scaler.get_scale() == 65536.0
    start = [p.detach().clone() for p in scaled.model.parameters()]
    scaled.step([(x[:4], y[:4]), (x[4:], y[4:])], 1)
    # Reference: the same fp16 autocast forward, one big batch, no scaler, clip, SGD.
    reference = linear_trainer(None, clip_grad=0.0, grad_accum=1).model
    with torch.autocast("cpu", dtype=torch.float16):
        logits = reference(x)
    F.cross_entropy(logits.float(), y).backward()
    assert nn.utils.clip_grad_norm_(reference.parameters(), 0.01) > 0.01  # clipping acted
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    for p, q, p0 in zip(scaled.model.parameters(), reference.parameters(), start, strict=True):
        assert not torch.equal(p, p0)  # the step was taken, not skipped
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)
    assert scaled.state_dict()["scaler"]["scale"] == 65536.0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_grad_scaler_skips_a_step_with_inf_gradients_and_halves_the_scale():
    trainer = linear_trainer(torch.float16, clip_grad=1.0, grad_accum=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    x = torch.full((4, 8), float("inf"))
    trainer.step([(x, torch.zeros(4, dtype=torch.long))], 1)
    assert trainer.scaler.get_scale() == 32768.0
    for p, q in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p, q)


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward fails like a lazily compiled backward graph that cannot compile."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise InternalTorchDynamoError("simulated: backward graph failed to compile")


def patch_compile(monkeypatch, *, fail_in: str, on_call: int, error=InternalTorchDynamoError):
    """torch.compile -> a function that fails on its `on_call`-th call, in forward or backward."""
    calls = []

    def fake_compile(fn, mode=None):
        def compiled(*args):
            calls.append(1)
            if len(calls) == on_call and fail_in == "forward":
                raise error("simulated: forward graph failed to compile")
            loss, loss_sum, correct = fn(*args)
            if len(calls) == on_call:
                loss = _FailInBackward.apply(loss)
            return loss, loss_sum, correct

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
@pytest.mark.parametrize("on_call", [1, 2])  # first micro-batch, or the second (after one's grads)
def test_compile_fallback_counts_once_and_keeps_accumulated_gradients(
    monkeypatch, fail_in, on_call
):
    data = batches(4)
    eager = make_trainer(small_net(), grad_accum=2)
    patch_compile(monkeypatch, fail_in=fail_in, on_call=on_call)
    falling = make_trainer(small_net(), grad_accum=2, compile_mode="default")
    assert falling.compiled
    for trainer in (eager, falling):
        trainer.step(data[:2], 1)
        trainer.step(data[2:], 2)
    assert not falling.compiled
    for p, q in zip(eager.model.parameters(), falling.model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert falling.take_sums() == eager.take_sums()
    assert falling.seen == 16  # 4 micro-batches of 4, each counted once


def test_compile_errors_after_the_first_step_and_other_errors_propagate(monkeypatch):
    data = batches(2)
    patch_compile(monkeypatch, fail_in="forward", on_call=2)
    trainer = make_trainer(small_net(), compile_mode="default")
    trainer.step(data[:1], 1)
    with pytest.raises(InternalTorchDynamoError):
        trainer.step(data[1:], 2)  # a compiler error on a later step is not silently eager
    patch_compile(monkeypatch, fail_in="forward", on_call=1, error=RuntimeError)
    trainer = make_trainer(small_net(), compile_mode="default")
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.step(data[:1], 1)  # not a compiler error: the model's own bug


def test_warm_up_compiles_and_leaves_no_trace(monkeypatch):
    calls = patch_compile(monkeypatch, fail_in="none", on_call=0)
    trainer = make_trainer(small_net(), compile_mode="default")
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    x, y = batches(1)[0]
    trainer.warm_up(x, y)
    assert len(calls) == 1 and trainer.compiled
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, state[key]), key  # BatchNorm statistics put back
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng) and trainer.seen == 0


def test_warm_up_falls_back_when_compiling_fails(monkeypatch):
    patch_compile(monkeypatch, fail_in="backward", on_call=1)
    trainer = make_trainer(small_net(), compile_mode="default")
    trainer.warm_up(*batches(1)[0])
    assert not trainer.compiled and all(p.grad is None for p in trainer.model.parameters())


def test_trainer_state_dict_resumes_exactly():
    data = batches(4)
    straight = make_trainer(small_net(0), clip_grad=1.0)
    straight.ema = EMA(straight.model, 0.5)
    for step, batch in enumerate(data, start=1):
        straight.step([batch], step)

    first = make_trainer(small_net(0), clip_grad=1.0)
    first.ema = EMA(first.model, 0.5)
    for step, batch in enumerate(data[:2], start=1):
        first.step([batch], step)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make_trainer(small_net(7), clip_grad=1.0)  # other init: everything must be loaded
    resumed.ema = EMA(resumed.model, 0.5)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step, batch in enumerate(data[2:], start=3):
        resumed.step([batch], step)
    for a, b in ((straight.model, resumed.model), (straight.ema.module, resumed.ema.module)):
        for key, value in a.state_dict().items():
            assert torch.equal(value, b.state_dict()[key]), key
    assert straight.take_sums() == resumed.take_sums()
    assert straight.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()
