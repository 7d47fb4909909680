"""One slot's fork server: a local sweep's run.py jobs start in seconds, not in ~10 s of imports.

    python -m labrun.forkserver [--engine PID] SCRIPT.py

The sweep engine (sweep.py) starts one per slot, in the slot's environment (CUDA_VISIBLE_DEVICES,
OMP_NUM_THREADS, LAB_JOB_CPUS); --engine names the process that adopts the jobs [the parent]. It
imports once what every job imports (torch, torch._dynamo, which every optimizer imports,
labrun's training modules, SCRIPT as the module __labrun_job__ without running it; a job calls
its main() with sys.argv set, as `python SCRIPT` does), prints `ready`, then reads one JSON line
per job on stdin
({"argv": [...], "log": PATH, "cwd": PATH, "header": LINE}) and answers one line on stdout: the
job's pid, `stale` (SCRIPT, the project's or labrun's code changed on disk since the import: the
engine starts a new server) or `error: WHY`. It never starts torch's thread pool and never
touches CUDA, which cannot survive a fork: a job initialises both itself, as a fresh one does.

Each job forks twice, so that it is the engine's child, not this server's: the engine is a child
subreaper (PR_SET_CHILD_SUBREAPER), and the middle process exits at once. The job then is what a
fresh `python SCRIPT ARGS` would be: its own session, the parent-death signal (SIGTERM when the
engine dies), stdin /dev/null, stdout and stderr appended to its log, sys.argv, default signal
handlers; its claim, exit code (75 when stopped) and files are its own. It leaves as a program
does (jobs._leave): output flushed, atexit hooks run, then os._exit; it never returns here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

# What a run.py job imports before its first step, besides SCRIPT itself (~half a quick job's wall
# time when each job imports them afresh). A module that is missing is imported by the job, if
# at all.
PRELOAD = (
    "numpy", "torch", "torch._dynamo", "torch.optim", "labrun", "labrun.session", "labrun.jobs",
    "labrun.config", "labrun.data", "labrun.datasets", "labrun.loaders", "labrun.hardware",
    "labrun.preflight", "labrun.models", "labrun.train", "labrun.checkpoint", "labrun.stopping",
    "labrun.runs", "labrun.tasks",
)  # fmt: skip
JOB_MODULE = "__labrun_job__"
PR_SET_PDEATHSIG = 1


def _prctl():
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def _threads() -> int:
    """Threads of this process (native ones too: torch's OpenMP pool would show here)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _cuda_driver_loaded() -> bool:
    """Whether the CUDA driver (libcuda) is loaded: the first CUDA call loads it (importing
    torch does not), and a driver initialised before a fork fails in the child."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def _watched(script: str) -> dict[str, tuple[int, int]]:
    """(mtime, size) of every loaded module's file that a job could see change: SCRIPT and the
    modules under its folder (the project's package) or labrun's."""
    roots = (str(Path(script).parent) + os.sep, str(Path(__file__).parent) + os.sep)
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.startswith(roots) and "site-packages" not in path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            found[path] = (st.st_mtime_ns, st.st_size)
    return found


def _changed(watched: dict[str, tuple[int, int]]) -> bool:
    for path, seen in watched.items():
        try:
            st = os.stat(path)
        except OSError:
            return True
        if (st.st_mtime_ns, st.st_size) != seen:
            return True
    return False


def load_script(script: str):
    """Import what every job imports, then SCRIPT as a module (its __main__ block not run)."""
    sys.path.insert(0, str(Path(script).parent))  # as `python SCRIPT` puts its folder first
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(JOB_MODULE, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[JOB_MODULE] = module
    spec.loader.exec_module(module)
    return module


def _answer(text: str) -> None:
    os.write(1, f"{text}\n".encode())


def _requests():
    """One request per line of fd 0, read unbuffered: a job must find no server input buffered
    in its sys.stdin."""
    buffer = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine = os.getppid()
    if len(argv) == 3 and argv[0] == "--engine" and argv[1].isdecimal():
        engine, argv = int(argv[1]), argv[2:]
    if len(argv) != 1 or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        print(
            "error: usage: python -m labrun.forkserver [--engine PID] SCRIPT.py "
            "(one JSON request per line on stdin)",
            file=sys.stderr,
        )
        return 2
    script, started = os.path.abspath(argv[0]), time.monotonic()
    module = load_script(script)
    import torch

    # The threads that are here now are numpy's OpenBLAS pool (OMP_NUM_THREADS - 1), which
    # shuts itself down around a fork (pthread_atfork); Python 3.12+ would warn at each fork.
    warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
    watched, threads = _watched(script), _threads()
    took = time.monotonic() - started
    print(f"fork server {os.getpid()}: {argv[0]} imported in {took:.1f}s; ready", file=sys.stderr)
    sys.stderr.flush()
    _answer("ready")
    for line in _requests():
        try:
            request = json.loads(line)
            job_argv, log, cwd = list(map(str, request["argv"])), request["log"], request["cwd"]
            header = str(request.get("header", ""))
        except (ValueError, KeyError, TypeError):
            _answer("error: bad request")
            continue
        if _changed(watched):
            _answer("stale")
            return 0
        # A fork copies one thread: CUDA and a started thread pool would be broken in the job.
        if torch.cuda.is_initialized() or _cuda_driver_loaded() or _threads() > threads:
            _answer("error: CUDA or a thread pool was started in the fork server")
            return 1
        pid = _spawn(module, argv[0], job_argv, log, cwd, header, engine)
        _answer(str(pid) if pid else "error: fork failed")
    return 0


def _spawn(module, script: str, argv: list[str], log: str, cwd: str, header: str, engine: int):
    """Fork the job through a middle process that exits at once; the job's pid, or None."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        return None
    if middle == 0:  # the middle process: fork the job, say its pid, exit
        code = 1
        try:
            os.close(read_end)
            me = os.getpid()
            job = os.fork()
            if job == 0:
                os.close(write_end)
                _job(module, script, argv, log, cwd, header, engine, me)
            os.write(write_end, f"{job}\n".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        said = f.read().strip()
    os.waitpid(middle, 0)  # once it is gone, the job is the engine's child
    return int(said) if said.isdigit() else None


def _job(module, script, argv, log, cwd, header, engine, middle) -> None:  # pragma: no cover
    """The job: runs in the forked process and always ends it."""
    code = 1
    try:
        os.setsid()  # a session of its own, as the engine gives a fresh job
        while os.getppid() == middle:  # until the middle process is gone and the engine adopted it
            os.sched_yield()
        prctl = _prctl()
        if os.getppid() == engine:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != engine:  # the engine died meanwhile (or is no subreaper): no job
            os._exit(1)
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        if header:
            os.write(1, f"{header}\n".encode())
        # Signals as a fresh interpreter has them: SIGINT raises KeyboardInterrupt, SIGPIPE is
        # ignored, every other one does its default; none blocked.
        for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        sys.argv = [script, *argv]
        sys.modules["__main__"] = module  # labrun.project finds the project from its file
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global RNG from the OS
            sys.modules["numpy"].random.seed()
        try:
            code = module.main()
        except SystemExit as exc:
            code = exc.code
        except KeyboardInterrupt:
            traceback.print_exc()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python ends: killed by SIGINT
            os.kill(os.getpid(), signal.SIGINT)
        if code is None:
            code = 0
        elif not isinstance(code, int):  # sys.exit("message"): printed, exit 1
            print(code, file=sys.stderr)
            code = 1
        from labrun.jobs import _leave

        _leave(code, hooks=True)  # flushes, runs atexit hooks, os._exit: never returns
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown of torch's modules: nothing of the server is left to close
