"""One job on several processes (torchrun + DistributedDataParallel): the rank logic in one place.

`torchrun --nproc-per-node N run.py ARGS` starts N copies of run.py with RANK, WORLD_SIZE and
LOCAL_RANK in their environment. Each copy is a rank; together they train ONE run:
- the same run, whatever the world size: --batch-size stays the global batch, each rank takes a
  contiguous 1/N of every global batch (`Loader(shard=...)`), so steps per epoch, the LR schedule
  and the epoch's order (a function of seed and epoch) are those of one process;
- gradients are all-reduced by DDP (not on non-final --grad-accum micro-steps: `no_sync`);
  BatchNorm statistics are synchronised with SyncBatchNorm on CUDA. torch refuses SyncBatchNorm
  on CPU modules, so on CPU each rank normalises with its own share of the batch (said in the
  log); evaluation then uses rank 0's running statistics on every rank (`sync_buffers`);
- one writer: rank 0 alone claims the run directory, writes its files and talks to MLflow; the
  others follow its decisions (`decide`, `settle`) and exit with the same code;
- stops that agree: a stop signal on any rank is seen by all at the same step through one
  all_reduce MAX of a CPU flag on a gloo group every `STOP_EVERY` steps and at every epoch end
  (no GPU sync), then rank 0 checkpoints and every rank exits 75;
- a checkpoint holds the full state once (rank 0's) plus each rank's own RNG state and partial
  epoch sums, so a resume on the same world size is exact; on another one it is refused.

Without torchrun (or with one process) `session()` yields `Dist()`: no process group, no torch
import, every method hands its input back; run.py then behaves exactly as one process always did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from .config import UsageError
from .project import current
from .runs import EXIT_FAILED, EXIT_INTERRUPTED, code_version, first_line, seconds_from_env

TIMEOUT_ENV = "LAB_DIST_TIMEOUT_S"  # how long any collective or the rendezvous may wait
DEFAULT_TIMEOUT_S = 600.0  # longer than a checkpoint write or a compile; torch's gloo waits 30 min
FAILURE_KEY = "labrun/failed/"  # + rank: a rank's traceback, in torchrun's store
STOP_EVERY = 10  # steps between stop polls: a stop waits at most this many steps


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def other_rank() -> bool:
    """True in a rank other than 0 of a torchrun job (read from the environment, no torch)."""
    return _env_int("WORLD_SIZE", 1) > 1 and _env_int("RANK", 0) != 0


class JoinFailed(RuntimeError):
    """This rank could not join the job's process group (the others never came): exit 1."""


def timeout_from_env() -> float:
    """No rank waits longer in the rendezvous or a collective: it fails instead of hanging."""
    return seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def launch_problem() -> str | None:
    """Why this environment is not a job torchrun started (one line), or None. A WORLD_SIZE
    left in a shell without MASTER_ADDR would otherwise end in torch's 20-line traceback."""
    if _env_int("WORLD_SIZE", 1) <= 1:
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        return (
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but no {' or '.join(missing)}: start several "
            "processes with torchrun (run.sh --gpus N), or unset WORLD_SIZE for one process"
        )
    try:
        timeout_from_env()
    except ValueError as exc:
        return str(exc)
    return None


def experiment_identity(args, out) -> dict:
    """What every rank of one job must share: every argument, the run directory, the code
    (runs.code_version), the world size."""
    identity = {f"--{k.replace('_', '-')}": str(v) for k, v in sorted(vars(args).items())}
    identity["run directory"] = str(out)
    code = code_version(current().root)
    identity["code version"] = f"{code['project']}/{code['labrun']}"
    identity["world size"] = os.environ.get("WORLD_SIZE", "1")
    return identity


class Dist:
    """This process's place in the job: rank, world size, and the collectives run.py needs."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.cuda = False
        self.cpu_group = None  # gloo: decisions and stop polls never wait for the GPU
        self.td = None  # torch.distributed: imported by start(), in a job of several processes
        self._stop = False
        self._told = False

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- start and end ---------------------------------------------------------------------
    def start(self, device: str) -> None:
        """Join the job's process group: NCCL on CUDA (this rank's GPU), gloo on CPU. Joining
        and every collective wait at most LAB_DIST_TIMEOUT_S, then raise (nothing hangs)."""
        import datetime

        import torch
        import torch.distributed as td

        self.td = td
        timeout = datetime.timedelta(seconds=timeout_from_env())
        self.cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if self.cuda:
            torch.cuda.set_device(self.local_rank)
            td.init_process_group(
                "nccl", device_id=torch.device("cuda", self.local_rank), timeout=timeout
            )
            self.cpu_group = td.new_group(backend="gloo", timeout=timeout)
        else:
            td.init_process_group("gloo", timeout=timeout)
            self.cpu_group = td.group.WORLD
        if not self.is_main:  # one voice: rank 0 prints; the others' warnings go to stderr
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)

    def finish(self, code: int) -> int:
        """Every rank leaves with rank 0's code; wait for rank 0's last writes (a rank that
        exits first with a non-zero code would have torchrun kill the writer). torchrun then
        sends SIGTERM to the ranks still exiting: GracefulStop's handlers, kept until the
        process ends, keep their exit code (75, 73, 2) from becoming death by that signal."""
        code = self.verdict(code)  # rank 0 ended before training: tell the others why
        # a failure is one rank's: the others may be mid-collective
        if self.active and code != EXIT_FAILED:
            self.td.barrier(group=self.cpu_group)
        return code

    # ---- decisions -------------------------------------------------------------------------
    def verdict(self, code: int | None) -> int | None:
        """Rank 0's one decision before training (None: train; else the exit code). Collective
        once; later calls return `code` unchanged."""
        if not self.active or self._told:
            return code
        self._told = True
        return self.decide(code)

    def decide(self, value):
        """Rank 0's `value` on every rank (a broadcast over the CPU group)."""
        box = [value]
        if self.active:
            self.td.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def agree_on(self, identity: dict) -> str | None:
        """None when every rank's `identity` is rank 0's; else one line, the same on every rank,
        naming the first rank and key that differ (one all_gather, before anything is written)."""
        everyone: list = [identity] * self.world  # one process: its own
        if self.active:
            self.td.all_gather_object(everyone, identity, group=self.cpu_group)
        ours = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            key = next((k for k in {**ours, **theirs} if ours.get(k) != theirs.get(k)), None)
            if key is not None:
                return (
                    f"torchrun: rank {rank} runs another experiment than rank 0: {key} is "
                    f"{theirs.get(key)} there, {ours.get(key)} on rank 0; start every process "
                    "with the same arguments, code and data"
                )
        return None

    def settle(self, code: int | None, stop=None, why: str = "") -> int | None:
        """One collective for every way a rank may leave here, called by every rank at the same
        point: the first code in rank order, else EXIT_INTERRUPTED when a stop reached any rank,
        else None (go on). `why`: another rank's refusal line, which rank 0 prints."""
        stopping = stop is not None and stop.requested is not None
        votes: list = [(code, stopping, why)] * self.world  # one process: its own
        if self.active:
            self.td.all_gather_object(votes, votes[0], group=self.cpu_group)
        first = next((rank for rank, vote in enumerate(votes) if vote[0] is not None), None)
        if first is None:
            if any(vote[1] for vote in votes):
                self._stop = True
                return EXIT_INTERRUPTED
            return None
        if first != 0 and votes[first][2] and self.is_main:  # rank 0 is the one voice
            print(f"error: rank {first}: {votes[first][2]}", file=sys.stderr)
        return votes[first][0]

    def stopped(self, stop, step: int | None = None) -> bool:
        """Whether `stop.requested` on any rank, polled every STOP_EVERY steps and at epoch ends
        (`step` None); once true, it stays true."""
        if not self.active:
            return stop.requested is not None
        if not self._stop and (step is None or step % STOP_EVERY == 0):
            import torch

            flag = torch.tensor([int(stop.requested is not None)])
            self.td.all_reduce(flag, op=self.td.ReduceOp.MAX, group=self.cpu_group)
            self._stop = bool(flag.item())
        return self._stop

    # ---- a rank that fails: its cause reaches rank 0 (run.log, MLflow) ------------------------
    def _store(self):
        return self.td.distributed_c10d._get_default_store()

    def report_failure(self, text: str) -> None:
        """Leave this rank's traceback in torchrun's store (not a collective: the others may
        be anywhere), where rank 0 reads it when its own collective breaks."""
        if not self.active:
            return
        with contextlib.suppress(Exception):  # the store may be gone: stderr still has it
            self._store().set(f"{FAILURE_KEY}{self.rank}", text)

    def peer_failures(self, wait_s: float = 2.0) -> list[tuple[int, str]]:
        """[(rank, traceback)] of the other ranks' report_failure; waits up to `wait_s`: a peer's
        exit breaks this rank's collective a moment before its report lands."""
        if not self.active:
            return []
        import time

        found: list[tuple[int, str]] = []
        keys = [f"{FAILURE_KEY}{r}" for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(Exception):  # no store (the group is gone): nothing to read
            store = self._store()
            while not found and time.monotonic() <= deadline:
                found = [
                    (int(k.removeprefix(FAILURE_KEY)), store.get(k).decode(errors="replace"))
                    for k in keys
                    if store.check([k])
                ]
                time.sleep(0 if found else 0.05)
        return found

    # ---- model, data, metrics --------------------------------------------------------------
    def check_splits(self, sizes: dict) -> None:
        """Refuse a split with fewer samples than processes: a rank with nothing to evaluate
        would report nan and the others could not tell (UsageError, exit 2 on every rank)."""
        if not self.active:
            return
        for name, size in sizes.items():
            if size < self.world:
                raise UsageError(
                    f"the {name} split has {size} sample(s), fewer than the {self.world} "
                    "processes that would share it; use more data or fewer processes"
                )

    def check(self, args) -> None:
        """Refuse what cannot run on several processes (UsageError: exit 2 on every rank)."""
        if not self.active:
            return
        if args.batch_size % self.world:
            raise UsageError(
                f"--batch-size: {args.batch_size} is the global batch and does not divide among "
                f"{self.world} processes; use a multiple of {self.world}"
            )
        if args.find_lr or args.find_batch_size or args.profile:
            raise UsageError("--find-lr, --find-batch-size and --profile run in one process")

    def place(self, device):
        import torch

        if self.active and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def prepare(self, model, seed: int):
        """SyncBatchNorm on CUDA; then each rank its own augmentation stream (the init above
        came from the common seed, and DDP starts every rank from rank 0's weights anyway)."""
        if not self.active:
            return model
        import numpy as np
        import torch

        from .train import seed_everything

        if self.cuda:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        seed_everything(int(np.random.SeedSequence([seed, self.rank]).generate_state(1)[0]))
        return model

    def describe(self) -> str:
        bn = (
            "SyncBatchNorm"
            if self.cuda
            else "BatchNorm per rank (torch refuses SyncBatchNorm on CPU: each rank normalises "
            "with its share of the batch; evaluation uses rank 0's statistics)"
        )
        backend = "NCCL + a gloo group for decisions" if self.cuda else "gloo"
        return f"{self.world} processes (torchrun, {backend}); {bn}"

    def ddp(self, model):
        """`model` in DistributedDataParallel under torchrun; one process: `model` itself."""
        if not self.active:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.local_rank] if self.cuda else None
        return DistributedDataParallel(model, device_ids=ids)

    def sum(self, totals):
        if self.active:
            self.td.all_reduce(totals)
        return totals

    def sync_buffers(self, model) -> None:
        """Rank 0's buffers (BatchNorm statistics) on every rank: what its checkpoint holds."""
        if self.active and not self.cuda:
            for buffer in model.buffers():
                self.td.broadcast(buffer, src=0)

    # ---- checkpoint: the full state once, each rank's own part ---------------------------------
    def gather_state(self, state: dict) -> dict | None:
        """What rank 0 writes: its state with every rank's RNG state and partial-epoch sums
        (collective); None on the other ranks."""
        state["world_size"] = self.world
        if not self.active:
            return state
        sums = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in state["trainer"]["sums"].items()}
        own = {"rng": state["rng"], "sums": sums}
        parts: list | None = [None] * self.world if self.is_main else None
        self.td.gather_object(own, parts, dst=0, group=self.cpu_group)
        return {**state, "ranks": parts} if self.is_main else None

    def own_state(self, state: dict, path) -> dict:
        """The checkpoint as this rank resumes it; refused when written by another world size."""
        from .checkpoint import CheckpointError

        saved = state.get("world_size", 1)
        if saved != self.world:
            raise CheckpointError(
                f"{path} was written by {saved} process(es), this run has {self.world}: "
                "each rank's data shard and random stream depend on it, so the continuation "
                f"would not be exact; resume with {saved} process(es) or re-run with --fresh"
            )
        if self.active:
            own = state["ranks"][self.rank]
            state["rng"], state["trainer"]["sums"] = own["rng"], own["sums"]
        return state

    # ---- the ranks other than 0 ---------------------------------------------------------------
    def rank_log(self, name: str) -> logging.Logger:
        """A rank other than 0's log: warnings and errors on stderr, `[rank N]` first."""
        log = logging.getLogger(f"run.{name}.rank{self.rank}")
        log.setLevel(logging.WARNING)
        log.propagate = False
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(f"[rank {self.rank}] %(message)s"))
            log.addHandler(handler)
        return log


@contextlib.contextmanager
def session(device: str) -> Iterator[Dist]:
    """This process's Dist: under torchrun with WORLD_SIZE > 1 inside the job's process group
    (destroyed on every way out); else one process, no torch import."""
    dist = Dist(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0))
    if not dist.active:
        yield dist
        return
    try:
        dist.start(device)
    except Exception as exc:  # a peer that never came, a port taken: one line, not 40
        if dist.td is not None and dist.td.is_initialized():
            dist.td.destroy_process_group()
        raise JoinFailed(
            f"torchrun: rank {dist.rank} could not join the {dist.world} processes of the job "
            f"(waited at most {TIMEOUT_ENV}={timeout_from_env():.0f}s): {first_line(exc)}"
        ) from exc
    try:
        yield dist
    finally:
        dist.td.destroy_process_group()
