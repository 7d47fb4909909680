"""Benchmark: the CPU path of a new lab member -- one job's start-up, and a sweep's jobs at a time.

    .venv/bin/python benchmarks/bench_cpu.py startup            # ~2 min: one job's fixed cost
    .venv/bin/python benchmarks/bench_cpu.py sweep               # ~10 min: CPU_JOBS settings
    .venv/bin/python benchmarks/bench_cpu.py default-sweep       # ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_cpu.py startup --template DIR   # another checkout (before)
    .venv/bin/python benchmarks/bench_cpu.py loop                # ~5 min: job vs a plain loop

startup: a freshly rendered project; `run.py` with one optimizer step (digits, width 16), so what
  is left is the fixed cost every job pays: interpreter, imports, data, model, MLflow, the files.
  The first job (it decodes digits into data/) is shown apart; then --repeats jobs with MLflow
  (sqlite, the default) and with `--tracking off`, median wall time and peak RSS of the job's
  process. One more job under `python -X importtime` says where the imports go. Last, the peak
  RSS of a CIFAR-sized job (synthetic 50000 images in memory, one step): what CPU_JOB_MEM_GB
  budgets for.
sweep: the demo's sweep (9 jobs: 3 lr x 3 seeds, digits, width 16, 6 epochs) under each CPU_JOBS
  / OMP_NUM_THREADS setting, each into its own SWEEP_NAME: wall time of `bash run.sh`.
loop: issue 28.9, side by side on this CPU (named from /proc/cpuinfo), OMP_NUM_THREADS as set:
  the plain PyTorch loop (reference.plain_loop_rate: fp32, NCHW, per-sample augmentation),
  run.py on the same model, data and batch (its metrics.json samples/s, steps only), and the
  step itself in each candidate habit (NCHW / channels_last x fp32 / bf16 autocast where the CPU
  has native bf16): which habit costs here. Interleaved, --repeats each, the best reported.
default-sweep: the generated run.sh as it is (9 jobs, width 64, up to 20 epochs with early
  stopping), CPU_JOBS at its default: what "bash run.sh" costs on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
ONE_STEP = ["--width", "16", "--epochs", "1", "--max-steps", "1", "--progress", "off"]
DEMO_ARGS = ["--", "--epochs", "6", "--width", "16"]
# name -> environment for `bash run.sh` (OMP_NUM_THREADS absent: run.sh's rule decides).
SWEEP_SETTINGS = {
    "CPU_JOBS=1, 1 thread": {"CPU_JOBS": "1", "OMP_NUM_THREADS": "1"},
    "CPU_JOBS=1, threads = cores": {"CPU_JOBS": "1"},
    "CPU_JOBS=auto (a job per core, 1 thread each)": {"CPU_JOBS": "auto"},
    "CPU_JOBS=cores, threads = cores (oversubscribed)": {
        "CPU_JOBS": str(len(os.sched_getaffinity(0))),
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
    },
}


def render(template: Path, out: Path) -> Path:
    """The default answers' project (its hook's "next steps" not printed into the table)."""
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", str(template), "-o",
                    str(out)], check=True, capture_output=True)
    return out / "lab_project"


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB of the process, stderr)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss / 1024, err


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LAB_"))}
    env.update(OMP_NUM_THREADS="1", **extra)  # one thread: stable on shared cores
    return env


def top_imports(stderr: str, top: int = 6) -> list[tuple[str, float]]:
    """The slowest imports that run.py's own code triggered (cumulative seconds)."""
    rows = []
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if match:  # only unindented names: the top of each import chain
            rows.append((match.group(2), int(match.group(1)) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def startup(template: Path, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        results = Path(tmp) / "results"
        cmd = [sys.executable, "run.py", *ONE_STEP]
        first = timed([*cmd, "--results-dir", str(results / "first")], project, job_env())
        rows = {}
        for label, extra in (("MLflow (sqlite)", []), ("`--tracking off`", ["--tracking", "off"])):
            samples = [timed([*cmd, *extra, "--seed", str(100 + i), "--results-dir",
                              str(results / label[:6])], project, job_env())
                       for i in range(repeats)]
            rows[label] = ([s[0] for s in samples], max(s[1] for s in samples))
        _, _, trace = timed([sys.executable, "-X", "importtime", "run.py", *ONE_STEP,
                             "--tracking", "off", "--seed", "999", "--results-dir",
                             str(results / "trace")], project, job_env())
        cifar_sized = timed([*cmd, "--dataset", "synthetic", "--synthetic-size", "50000",
                             "--tracking", "off", "--results-dir", str(results / "big")],
                            project, job_env())
    print(f"- template: {template}; {repeats} jobs per row, 1 thread each")
    print("\n| job (digits, width 16, 1 step) | wall time (s), median | all (s) | peak RSS (MB) |")
    print("|---|---:|---|---:|")
    print(f"| first job of the project (decodes digits into data/) | {first[0]:.2f} | | "
          f"{first[1]:.0f} |")
    for label, (walls, rss) in rows.items():
        listed = ", ".join(f"{w:.2f}" for w in walls)
        print(f"| {label} | {statistics.median(walls):.2f} | {listed} | {rss:.0f} |")
    print(f"| CIFAR-sized (synthetic 50000 in memory, `--tracking off`) | {cifar_sized[0]:.2f} | "
          f"| {cifar_sized[1]:.0f} |")
    print("\n| slowest imports of one job (`-X importtime`, top of each chain) | cumulative (s) |")
    print("|---|---:|")
    for name, seconds in top_imports(trace):
        print(f"| `{name}` | {seconds:.2f} |")


def sweep_wall(project: Path, name: str, env_extra: dict[str, str], args: list[str]) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "CPU_JOBS", "GPUS") and not k.startswith("MLFLOW_")}
    env.update(PYTHON=sys.executable, SWEEP_NAME=name, STATUS_EVERY_LOG="0", **env_extra)
    started = time.perf_counter()
    out = subprocess.run(["bash", "run.sh", *args], cwd=project, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"sweep {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    slots = next((line.split("; ")[1] for line in out.stdout.splitlines()
                  if "job(s) to run" in line), "?")
    return f"{wall:.0f} | {slots}"


def sweep(template: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        timed([sys.executable, "run.py", *ONE_STEP, "--tracking", "off"], project, job_env())
        print("| the demo's sweep: 9 jobs, digits, width 16, 6 epochs | wall (s) | slots |")
        print("|---|---:|---|")
        for i, (label, env_extra) in enumerate(SWEEP_SETTINGS.items()):
            load = os.getloadavg()[0]
            row = sweep_wall(project, f"s{i}", env_extra, DEMO_ARGS)
            print(f"| {label} (load before {load:.1f}) | {row} |", flush=True)


def default_sweep(template: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        load = os.getloadavg()[0]
        row = sweep_wall(project, "sweep", {}, [])
        print("| `bash run.sh` as generated: 9 jobs, digits, width 64, <= 20 epochs | wall (s) | "
              "slots |\n|---|---:|---|")
        print(f"| CPU_JOBS at its default (load before {load:.1f}) | {row} |")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def habit_rate(layout, bf16: bool, batch: int, width: int, steps: int = 8) -> float:
    """samples/s of forward + backward + AdamW of the default model on random images."""
    import torch
    import torch.nn.functional as F
    from labrun.tools.reference import default_model

    model = default_model(width).to(memory_format=layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, 32, 32).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - started)


def loop(template: Path, repeats: int, batch: int = 128, width: int = 64, steps: int = 30) -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        project = render(template, Path(tmp))
        os.environ["LABRUN_PROJECT"] = str(project)  # the project's models, as run.py finds them
        sys.path.insert(0, str(project))
        from labrun.hardware import cpu_has_native_bf16
        from labrun.tools import gpucheck, reference

        rates: dict[str, list[float]] = {}
        candidates = [("NCHW fp32", torch.contiguous_format, False),
                      ("channels_last fp32", torch.channels_last, False)]
        if cpu_has_native_bf16():
            candidates += [("NCHW bf16", torch.contiguous_format, True),
                           ("channels_last bf16", torch.channels_last, True)]
        cpu = torch.device("cpu")
        split = reference.synthetic_split(10_000)
        layout_line = ""
        for i in range(repeats):
            rates.setdefault("plain loop", []).append(reference.plain_loop_rate(
                split, cpu, batch_size=batch, steps=steps, warmup=3, tracking_dir=Path(tmp),
                width=width))
            metrics = gpucheck.job_rate(
                cpu, batch_size=batch, steps=steps, synthetic_size=10_000,
                data_dir=Path(tmp) / "data", results_dir=Path(tmp) / f"results{i}",
                extra_args=("--tracking", "off", "--progress", "off"), width=width)
            rates.setdefault("run.py", []).append(metrics["samples_per_sec"])
            log = next((Path(tmp) / f"results{i}").glob("*/run.log")).read_text()
            layout_line = next((x for x in log.splitlines() if "layout: " in x), layout_line)
            for name, layout, bf16 in candidates:
                rates.setdefault(f"step only, {name}", []).append(
                    habit_rate(layout, bf16, batch, width))
    plain = max(rates["plain loop"])
    print(f"- CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"native bf16: {cpu_has_native_bf16()}; batch {batch}, width {width}, {steps} steps")
    print(f"- run.py's layout line: {layout_line.split('INFO ')[-1] or '(none)'}\n")
    print("| variant | samples/s (best) | all | vs plain loop |\n|---|---:|---|---:|")
    for name, values in rates.items():
        listed = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {max(values):.0f} | {listed} | {max(values) / plain:.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["startup", "sweep", "default-sweep", "loop"])
    parser.add_argument("--template", type=Path, default=TEMPLATE,
                        help="template checkout to render (default: this one)")
    parser.add_argument("--repeats", type=int, default=5, help="startup: jobs per row")
    args = parser.parse_args()
    print(f"- machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores; Python "
          f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}; load average (1 min) "
          f"{os.getloadavg()[0]:.2f}")
    print(f"- command: `python benchmarks/bench_cpu.py {args.part}`\n")
    {"startup": lambda: startup(args.template, args.repeats),
     "sweep": lambda: sweep(args.template),
     "default-sweep": lambda: default_sweep(args.template),
     "loop": lambda: loop(args.template, min(args.repeats, 3))}[args.part]()
    print(f"\n- load average (1 min) after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
