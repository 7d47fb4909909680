#!/usr/bin/env bash
# run.sh: the sweep. Runs run.py once per job listed below, until all are done: as many jobs
# per GPU as its cores and memory hold (JOBS_PER_GPU=auto), a job per core without a GPU.
#
# Usage: bash run.sh [--dry-run] [--slurm] [--quick] [-h|--help] [-- EXTRA_RUN_PY_ARGS...]
#   --dry-run   list every job and its state (done / pending / interrupted / failed / running
#               elsewhere; with --slurm also queued); run nothing
#   --slurm     submit the pending jobs as one Slurm job array instead of running them here;
#               jobs still queued or running from an earlier submission are not submitted again
#   --quick     the quick preset (also PRESET=quick): the jobs with QUICK_ARGS (a small model,
#               few epochs) and the quick grid, into results/quick and logs/quick
#   -- ARGS     appended to every run.py job, e.g.  bash run.sh -- --dataset digits --epochs 3
#
# Every job writes to results/SWEEP_NAME/<run>/ (trial runs of run.py go to results/trials).
# Jobs already done (metrics.json) are skipped; unfinished ones resume from their checkpoint, so
# after a crash or Ctrl-C just run it again. A job another process is running (two run.sh on one
# folder, a Slurm task) is left to it: "running elsewhere". Each job logs to LOG_DIR/<run>.log.
# Ctrl-C stops every job (each saves a checkpoint first); a second Ctrl-C kills them; either way
# the summary is printed. If run.sh itself is killed, the kernel sends its jobs SIGTERM.
# Exit status: 0 when every job is done, 1 if any failed, is unfinished or runs elsewhere,
# 2 bad settings, 130/143 if stopped.
# Settings are environment variables (GPUS, JOBS_PER_GPU, CPU_JOBS, LOG_DIR, SWEEP_NAME, PYTHON,
# SLURM_*, ...): `bash run.sh --help` lists them with their defaults. The queue is labrun's sweep
# engine (labrun/sweep.py, the version the project pins): this file only lists the jobs.

set -euo pipefail

# `job ARGS...` records one job: its argument count, then its arguments (bash has no arrays of
# arrays); the engine reads them NUL-separated.
SWEEP_JOBS=()
job() { SWEEP_JOBS+=("$#" "$@"); }

# ---- The sweep: edit here. Call `job` once per run.py command line. -------------------------
# A job of another script names it first: `job analyze.py RUN_A RUN_B` (README, "A job that does
# not train"); it keeps its own --results-dir; neither QUICK_ARGS nor `-- ARGS` reach it. It names
# a run by run.py's arguments ("--seed 0"): that run of this sweep, under --quick the quick one.
define_jobs() {
  local lr seed
  local -a lrs=(1e-3 3e-3 1e-2)
  # The quick preset's small model learns best near 1e-2 on digits: a decade grid puts the best
  # in the middle, not at an edge (the lab template's benchmarks/RESULTS.md, "The quick
  # preset's learning rates").
  if [[ "${PRESET}" == quick ]]; then lrs=(1e-3 1e-2 1e-1); fi
  for lr in "${lrs[@]}"; do
    for seed in 0 1 2; do
      job --lr "${lr}" --seed "${seed}"
    done
  done
  # E.g. the CKA of each seed pair of one learning rate (a job waits until both runs are done;
  # `python plot.py --analysis` draws each and their mean over the pairs):
  # local pair
  # for pair in "0 1" "0 2" "1 2"; do
  #   job analyze.py "--lr ${lrs[1]} --seed ${pair% *}" "--lr ${lrs[1]} --seed ${pair#* }"
  # done
}

# The quick preset (`bash run.sh --quick`): these arguments come first on every run.py job's
# command line, so a job's own arguments and those after `--` win; results go to their own
# folder, so a plain `bash run.sh` later runs the real sweep instead of finding them done.
QUICK_ARGS=(--epochs 6 --width 16)

# ---- The engine: labrun's queue, from the environment that runs the jobs --------------------
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-python}"
# find_spec, not an import: the engine imports labrun right after, and twice costs ~0.3 s.
if ! "${PYTHON}" -c 'import importlib.util, sys; sys.exit(not importlib.util.find_spec("labrun"))' \
  2>/dev/null; then
  echo "run.sh: no labrun in PYTHON=${PYTHON} (activate the project's venv, or set PYTHON)" >&2
  exit 2
fi
# The job list depends on the preset, so --quick is read here too (the engine reads the rest).
PRESET="${PRESET:-}"
for arg in "$@"; do
  case "${arg}" in
    --) break ;;
    --quick) PRESET=quick ;;
  esac
done
define_jobs
# exec: the engine takes this process's place, so signals to run.sh reach it.
exec "${PYTHON}" -m labrun.sweep "${BASH_SOURCE[0]##*/}" "$@" \
  < <(printf '%s\0' "${#QUICK_ARGS[@]}" "${QUICK_ARGS[@]}" "${SWEEP_JOBS[@]}")
