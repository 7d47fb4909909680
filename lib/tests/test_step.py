"""run.py's step on CPU (taken from its train() by conftest.capture_step): GradScaler with clipping
and accumulation, a skipped step, the epoch's sums, the state that resumes it exactly; EMA, the
loss; the compile warm-up (compiling._warm) and its fallback. Tiny models."""

from __future__ import annotations

import io
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import capture_step
from torch import nn
from torch._dynamo.exc import InternalTorchDynamoError

from labrun import checkpoint, compiling
from labrun.tasks import cross_entropy
from labrun.train import EMA

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


@pytest.fixture
def step_of(monkeypatch, data_dir, tmp_path):
    """step_of(model, *args, amp_dtype=...) -> run.py's pieces around `model` (capture_step)."""
    count = iter(range(100))

    def capture(model, *args, amp_dtype="auto"):
        out = tmp_path / f"r{next(count)}"
        return capture_step(monkeypatch, data_dir, out, *args, model=model, amp_dtype=amp_dtype)

    return capture


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


def sgd_instead_of_adamw(monkeypatch):
    """run.py's step with plain SGD (its first step: p -= lr * grad, whatever the momentum)."""
    monkeypatch.setattr(torch.optim, "AdamW", lambda groups, lr, fused: torch.optim.SGD(groups, lr))


def test_grad_scaler_on_cpu_unscales_before_clipping_and_accumulates(step_of, monkeypatch):
    # Small inputs: the scaled fp16 gradients (x 65536) stay finite, so the step is not skipped;
    # clip at 0.01, below the true gradient norm, so clipping acts.
    sgd_instead_of_adamw(monkeypatch)
    x, y = torch.randn(8, 8) * 0.1, torch.randint(0, 3, (8,))
    torch.manual_seed(0)
    scaled = step_of(nn.Linear(8, 3), "--clip-grad", "0.01", amp_dtype=torch.float16)
    assert checkpoint.precision(objects(scaled), torch.float16) == {
        "autocast": "fp16",
        "grad_scaler": True,
    }
    lr = scaled.optimizer.param_groups[0]["lr"]
    start = [p.detach().clone() for p in scaled.model.parameters()]
    scaled.step([(x[:4], y[:4]), (x[4:], y[4:])])
    # Reference: the same fp16 autocast forward, one big batch, no scaler, clip, SGD.
    torch.manual_seed(0)
    reference = nn.Linear(8, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = reference(x)
    F.cross_entropy(logits.float(), y).backward()
    assert nn.utils.clip_grad_norm_(reference.parameters(), 0.01) > 0.01  # clipping acted
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    for p, q, p0 in zip(scaled.model.parameters(), reference.parameters(), start, strict=True):
        assert not torch.equal(p, p0)  # the step was taken, not skipped
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-3)
    assert scaled.scaler.state_dict()["scale"] == 65536.0
    metrics, seen = scaled.sums.take()
    assert seen == 8 and 0 <= metrics["acc"] <= 1  # both micro-batches counted, once


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_grad_scaler_skips_a_step_with_inf_gradients_and_halves_the_scale(step_of):
    c = step_of(nn.Linear(8, 3), "--clip-grad", "1", amp_dtype=torch.float16)
    before = [p.detach().clone() for p in c.model.parameters()]
    x = torch.full((4, 8), float("inf"))
    c.step([(x, torch.zeros(4, dtype=torch.long))])
    assert c.scaler.state_dict()["scale"] == 32768.0
    for p, q in zip(c.model.parameters(), before, strict=True):
        assert torch.equal(p, q)


def test_grad_accumulation_equals_one_big_batch(step_of, monkeypatch):
    sgd_instead_of_adamw(monkeypatch)
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    big, small = nn.Linear(5, 3), nn.Linear(5, 3)
    small.load_state_dict(big.state_dict())
    step_of(big).step([(x, y)])
    accumulating = step_of(small, "--grad-accum", "2")
    accumulating.step([(x[:4], y[:4]), (x[4:], y[4:])])
    for p, q in zip(big.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    metrics, seen = accumulating.sums.take()
    assert seen == 8 and metrics["loss"] == metrics["loss"] and 0 <= metrics["acc"] <= 1


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward fails like a lazily compiled backward graph that cannot compile."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise InternalTorchDynamoError("simulated: backward graph failed to compile")


class Compiled(nn.Module):
    """A stand-in for torch.compile's module: counts its calls; fails like a compiler on call
    `fail_on` (in forward or in backward), or with `error`."""

    def __init__(self, model, fail_in="none", fail_on=0, error=InternalTorchDynamoError):
        super().__init__()
        self.model, self.fail_in, self.fail_on, self.error, self.calls = (
            model, fail_in, fail_on, error, 0,
        )  # fmt: skip

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_on and self.fail_in == "forward":
            raise self.error("simulated: forward graph failed to compile")
        out = self.model(x)
        return _FailInBackward.apply(out) if self.calls == self.fail_on else out


def warm(c, net):
    """The warm-up after a decision to compile (mode "default", nothing recorded): the module
    the step calls, its mode (None: eager) and the compile's seconds."""
    decided, log = ("default", 0.01, None), logging.getLogger("test_step")
    return compiling._warm(net, c.model, c.batch, c.loss_fn, c.env, "default", decided, log)


def test_warm_up_runs_what_the_step_calls_and_leaves_no_trace(step_of):
    c = step_of(small_net())
    monkeypatch_batch(c)
    net = Compiled(c.model)
    state = {k: v.clone() for k, v in c.model.state_dict().items()}
    rng = torch.get_rng_state()
    warmed, mode, seconds = warm(c, net)
    assert warmed is net and mode == "default" and net.calls == 4  # untimed, 3 timed passes
    for key, value in c.model.state_dict().items():
        assert torch.equal(value, state[key]), key  # BatchNorm statistics put back
    assert all(p.grad is None for p in c.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng) and c.sums.seen == 0
    assert seconds >= 0


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
def test_warm_up_falls_back_to_eager_when_compiling_fails(step_of, fail_in, caplog):
    c = step_of(small_net())
    monkeypatch_batch(c)
    assert warm(c, Compiled(c.model, fail_in, fail_on=1)) == (c.model, None, 0.0)
    assert all(p.grad is None for p in c.model.parameters())
    assert "torch.compile failed" in caplog.text
    with pytest.raises(RuntimeError, match="simulated"):  # not a compiler error: a bug
        warm(c, Compiled(c.model, "forward", fail_on=1, error=RuntimeError))


def objects(c) -> dict:
    """What run.py's train() gives job.resume: checkpointed by their state_dicts."""
    names = ("model", "optimizer", "scheduler", "scaler", "ema", "sums")
    return {name: getattr(c, name) for name in names}


def monkeypatch_batch(c):
    """The warm-up's batch: the tests' small images, not digits."""
    c.batch = lambda: batches(1)[0]


def test_the_state_resumes_the_step_exactly(step_of):
    data = batches(4)
    straight = step_of(small_net(0), "--clip-grad", "1", "--ema", "0.5")
    for batch in data:
        straight.step([batch])
    first = step_of(small_net(0), "--clip-grad", "1", "--ema", "0.5")
    for batch in data[:2]:
        first.step([batch])
    buffer = io.BytesIO()
    torch.save(checkpoint.objects_state(objects(first), None), buffer)
    buffer.seek(0)
    resumed = step_of(small_net(7), "--clip-grad", "1", "--ema", "0.5")  # all must be loaded
    saved = torch.load(buffer, weights_only=True)
    checkpoint.load_objects(objects(resumed), saved, None, logging.getLogger("test_step"))
    for batch in data[2:]:
        resumed.step([batch])
    for name in ("model", "ema"):
        a, b = (objects(c)[name].state_dict() for c in (straight, resumed))
        a, b = (s.get("module", s) for s in (a, b))  # EMA: its module's weights
        for key, value in a.items():
            assert torch.equal(value, b[key]), key
    assert straight.sums.take() == resumed.sums.take()
    assert straight.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()


# ---- CUDA graphs: every decision on CPU, with the device queries patched ----------------------
@pytest.fixture
def marks(monkeypatch):
    """Counts torch.compiler.cudagraph_mark_step_begin calls (a new CUDA-graph step)."""
    seen = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: seen.append(1))
    return seen


def test_each_timed_pass_starts_without_grads_and_marks_a_graph_step(marks):
    """gpu.md: reduce-overhead crashed in this timing ("accessing tensor output of CUDAGraphs
    that has been overwritten"): four passes accumulated into .grad that a replay had
    overwritten. Each pass must start with no .grad and a new CUDA-graph step."""
    from labrun.hardware import time_forward_backward, timed

    model = small_net()
    grads_at_forward = []
    model.register_forward_pre_hook(
        lambda module, args: grads_at_forward.append([p.grad for p in module.parameters()])
    )
    x, y = batches(1)[0]
    time_forward_backward(model, x, y, cross_entropy, None, timed(CPU))
    assert len(marks) == len(grads_at_forward) == 4
    assert all(g is None for grads in grads_at_forward for g in grads)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("device", "mode", "expected"),
    [("cuda", "reduce-overhead", 3), ("cuda", "max-autotune", 3), ("cuda", "default", 0),
     ("cuda", None, 0), ("cpu", "reduce-overhead", 0)],
)  # fmt: skip
def test_the_step_marks_each_step_begin_only_under_cuda_graphs(
    step_of, marks, device, mode, expected
):
    c = step_of(small_net())
    marks.clear()  # count only the steps' marks
    graphs = compiling.replays_graphs(torch.device(device), mode)  # as compile_model decides
    step = c.run_py.make_step(c, c.compiled._replace(cuda_graphs=graphs), c.args, c.env, c.loss_fn)
    for micro_batches in [[b] for b in batches(3)]:
        step(micro_batches)
    assert len(marks) == expected


def test_cuda_graph_runs_set_no_inductor_setting_that_keeps_graphs_from_replaying(
    step_of, monkeypatch
):
    """gpu.md (H200): with cudagraph_skip_dynamic_graphs, which run.py set for CUDA graphs,
    every node of a graph with a symbolic size is a "non-cudagraphable" partition, and the
    step ran inductor's kernels without graphs. run.py's batches have one shape (torch.compile
    dynamic=False): no inductor setting is changed for a run that picks CUDA graphs."""
    import torch._inductor.config as inductor

    from labrun import hardware

    before = inductor.get_config_copy()
    c = step_of(small_net())
    monkeypatch.setattr(hardware, "decide_compile", lambda *a, **k: ("reduce-overhead", 0.01, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compiling, "speed_scale", lambda *a: ({}, None))  # no GPU to measure
    monkeypatch.setattr(compiling, "_warm", lambda net, eager, batch, *a: (net, a[2], 0.0))
    env, log = c.env._replace(device=torch.device("cuda")), logging.getLogger("test_step")
    compiled = compiling.compile_model(c.model, c.loss_fn, c.batch, c.args, env, steps=9, log=log)
    assert compiled.mode == "reduce-overhead" and compiled.cuda_graphs
    after = inductor.get_config_copy()
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}


# ---- no wasted launch: the default step's aten ops, held to a budget ---------------------------
class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched that would launch a kernel on a GPU: not views (detach,
    view, t: metadata only) nor the profiler's record_function markers."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace == "aten":
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


# run.py's default step against labrun's own best-practice reference (tools/reference.py: its
# batch's crop + flip, forward, backward, fused AdamW) on the same model, data and batch size,
# counted with torch 2.13 on CPU with the GPU's crop (one gather): 136 kernels (the batch 16,
# the step 120; 77 views more) against the reference's 126, 1.08x. Before issue 45: 145 (1.15x):
# the crop's window offsets rebuilt every batch (8), the loss sum in two kernels. What remains
# over the reference earns its place: the epoch's loss and accuracy sums on the device (~7), a
# crop per sample (the reference's is per batch), AdamW in two groups (no decay of norms and
# biases: 2), the released loss (log_softmax + gather, bit for bit: 4). New per-step work must
# earn its place too, and then move the numbers here.
STEP_OPS_OVER_REFERENCE = 1.10


def test_the_default_step_stays_within_its_op_budget_of_the_reference(step_of, monkeypatch):
    import copy

    from labrun import augment
    from labrun.tools import reference

    monkeypatch.setattr(augment, "crop_flip_slices", augment.crop_flip_gather)  # the GPU's
    c = step_of(None, "--dataset", "synthetic", "--synthetic-size", "600")
    model = copy.deepcopy(c.model)
    batches = iter(c.data.train)
    c.step([next(batches)])  # the first step allocates AdamW's state: not a per-step cost
    with OpCounter() as ours:
        c.step([next(batches)])  # the batch's augmentation and the step
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (256, 3, 32, 32), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (256,), generator=gen)
    step = reference.best_practice_step(model, images, labels, c.args.batch_size, None)
    step(0)
    with OpCounter() as theirs:
        step(1)
    total, budget = sum(ours.ops.values()), STEP_OPS_OVER_REFERENCE * sum(theirs.ops.values())
    assert total <= budget, sorted(ours.ops.items(), key=lambda kv: -kv[1])
