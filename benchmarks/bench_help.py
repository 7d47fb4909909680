"""`python run.py --help` of rendered projects: wall and CPU time (median of N runs, interleaved so
that a loaded machine weighs on each alike), and whether torch was imported.

Usage: python benchmarks/bench_help.py PROJECT [PROJECT...] [--runs 15]
Each PROJECT is a rendered project (its run.py); PYTHONPATH picks the labrun each one uses
(`NAME=PATH` as the project's argument: PROJECT=LIB_SRC runs it with that library first).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

PROBE = (
    "import runpy, sys\nsys.argv = ['run.py', '--help']\n"
    "try:\n    runpy.run_path('run.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
    "print('torch' in sys.modules, file=sys.stderr)"
)


def once(project: str, lib: str | None) -> tuple[float, float, bool]:
    env = {**os.environ, **({"PYTHONPATH": lib} if lib else {})}
    env.pop("LABRUN_PROJECT", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=project, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stderr.strip().endswith("True")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("projects", nargs="+", help="PROJECT or PROJECT=LIB_SRC")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    targets = [tuple(p.split("=", 1)) if "=" in p else (p, None) for p in args.projects]
    for project, lib in targets:  # warm: caches (the registry listing, .pyc) as a user has them
        once(project, lib)
    times = {t: [] for t in targets}
    for _ in range(args.runs):
        for target in targets:
            times[target].append(once(*target))
    for (project, lib), runs in times.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        torch = any(r[2] for r in runs)
        print(f"{project} ({lib or 'installed labrun'}): wall {wall:.3f} s, CPU {cpu:.3f} s "
              f"(medians of {args.runs}); torch imported: {torch}")  # fmt: skip


if __name__ == "__main__":
    main()
