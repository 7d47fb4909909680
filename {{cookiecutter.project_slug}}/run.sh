#!/usr/bin/env bash
# run.sh: the sweep. Runs run.py once per job listed below, one job per GPU, until all are done.
#
# Usage: bash run.sh [--dry-run] [--slurm] [-h|--help] [-- EXTRA_RUN_PY_ARGS...]
#   --dry-run   list every job and its state (done / pending / failed); run nothing
#   --slurm     submit the pending jobs as one Slurm job array instead of running them here
#   -- ARGS     appended to every job, e.g.  bash run.sh -- --dataset digits --epochs 3
#
# Jobs already done (metrics.json exists) are skipped; unfinished ones resume from their
# checkpoint, so after a crash or Ctrl-C just run it again. Each job logs to LOG_DIR/<run>.log.
# Ctrl-C stops every job (each saves a checkpoint first); a second Ctrl-C kills them.
# Exit status: 0 when every job is done, 1 if any failed or is unfinished, 130/143 if stopped.
#
# Environment (defaults in brackets):
#   PYTHON        interpreter that runs run.py [python]
#   GPUS          GPU ids to use, e.g. "0 2" [all that nvidia-smi lists; none: run on CPU]
#   JOBS_PER_GPU  jobs sharing one GPU, for small models [1]
#   CPU_JOBS      jobs at a time when there is no GPU [1]
#   LOG_DIR       one log file per job [logs/sweep]
#   SLURM_PARTITION, SLURM_TIME, SLURM_MEM, SLURM_CPUS, SLURM_GRES, SLURM_MAX_PARALLEL,
#   SLURM_SIGNAL_SECS, SLURM_EXTRA (more sbatch options)   used by --slurm, see below

set -euo pipefail

# ---- The sweep: edit here. Call `job` once per run.py command line. -------------------------
readonly LRS=(1e-3 3e-3 1e-2)
readonly SEEDS=(0 1 2)

define_jobs() {
  local lr seed
  for lr in "${LRS[@]}"; do
    for seed in "${SEEDS[@]}"; do
      job --lr "${lr}" --seed "${seed}"
    done
  done
}

# ---- Where the jobs run -----------------------------------------------------------------------
PYTHON="${PYTHON:-python}"
JOBS_PER_GPU="${JOBS_PER_GPU:-1}"
CPU_JOBS="${CPU_JOBS:-1}"
LOG_DIR="${LOG_DIR:-logs/sweep}"
# run.sh --slurm: one array task per job, one GPU each.
SLURM_PARTITION="${SLURM_PARTITION:-}"          # empty: the cluster's default partition
SLURM_TIME="${SLURM_TIME:-24:00:00}"            # per task; a task near its limit checkpoints
SLURM_MEM="${SLURM_MEM:-32G}"                   #   and requeues itself (see slurm_task.sh)
SLURM_CPUS="${SLURM_CPUS:-8}"                   # CPU cores per task (data loading)
SLURM_GRES="${SLURM_GRES:-gpu:1}"               # e.g. gpu:a100:1
SLURM_MAX_PARALLEL="${SLURM_MAX_PARALLEL:-16}"  # tasks running at once (be fair to the lab)
SLURM_SIGNAL_SECS="${SLURM_SIGNAL_SECS:-300}"   # warning before the time limit, to checkpoint
SLURM_EXTRA="${SLURM_EXTRA:-}"                  # e.g. "--account=mylab --qos=normal"

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")"
  # shellcheck source-path=SCRIPTDIR disable=SC1091  # (followed with -x)
  source scripts/sweep_lib.sh
  sweep_main define_jobs "$@"
}

main "$@"
