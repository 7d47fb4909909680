#!/usr/bin/env bash
# run.sh: the sweep. Runs run.py once per job listed below, one job per GPU, until all are done.
#
# Usage: bash run.sh [--dry-run] [--slurm] [--quick] [-h|--help] [-- EXTRA_RUN_PY_ARGS...]
#   --dry-run   list every job and its state (done / pending / interrupted / failed / running
#               elsewhere; with --slurm also queued); run nothing
#   --slurm     submit the pending jobs as one Slurm job array instead of running them here;
#               jobs still queued or running from an earlier submission are not submitted again
#   --quick     the quick preset (also PRESET=quick): the jobs with QUICK_ARGS (a small model,
#               few epochs) and QUICK_LRS, into results/quick and logs/quick, never the sweep's
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
#
# Environment (defaults in brackets):
#   PYTHON        interpreter that runs run.py [python]
#   PRESET        quick: as --quick [empty: the sweep as listed]
#   SWEEP_NAME    results go to results/SWEEP_NAME [sweep; quick with the quick preset]
#   GPUS          GPU ids to use, e.g. "0 2" [all visible: CUDA_VISIBLE_DEVICES, else nvidia-smi;
#                 none: run on CPU]
#   JOBS_PER_GPU  jobs sharing one GPU, for small models [1]
#   CPU_JOBS      jobs at a time when there is no GPU [auto: one per core, at most one per
#                 job left and per CPU_JOB_MEM_GB of free memory]; the cores are shared
#                 out as OMP_NUM_THREADS (cores / jobs) unless that is set
#   CPU_JOB_MEM_GB  memory one CPU job needs, in GiB, for CPU_JOBS=auto [2]
#   LOG_DIR       one log file per job [logs/sweep]
#   STATUS_EVERY  seconds between status lines on a terminal [60]; STATUS_EVERY_LOG: when the
#                 output goes to a file [600]; 0 = none
#   SLURM_PARTITION, SLURM_TIME, SLURM_MEM, SLURM_CPUS, SLURM_GRES, SLURM_MAX_PARALLEL,
#   SLURM_SIGNAL_SECS, SLURM_EXTRA (more sbatch options), SLURM_LOG_DIR, SWEEP_JOB_NAME,
#   GPUS_PER_JOB, NODES_PER_JOB
#                 used by --slurm, see below

set -euo pipefail

# ---- The sweep: edit here. Call `job` once per run.py command line. -------------------------
# A job of another script names it first: `job analyze.py RUN_A RUN_B` (README, "A job that does
# not train"); it keeps its own --results-dir, and `-- ARGS` are not added to it.
readonly LRS=(1e-3 3e-3 1e-2)
# The quick preset's grid: its small model (QUICK_ARGS) learns best near 1e-2 on digits, so a
# decade grid puts the best in the middle, not at an edge (the lab template's
# benchmarks/RESULTS.md, "The quick preset's learning rates").
readonly QUICK_LRS=(1e-3 1e-2 1e-1)
readonly SEEDS=(0 1 2)

define_jobs() {
  local lr seed
  local -a lrs=("${LRS[@]}")
  if [[ "${PRESET}" == quick ]]; then lrs=("${QUICK_LRS[@]}"); fi
  for lr in "${lrs[@]}"; do
    for seed in "${SEEDS[@]}"; do
      job --lr "${lr}" --seed "${seed}"
    done
  done
  # E.g. the CKA of two of these runs (it waits until both have finished):
  # job analyze.py results/sweep/digits_lr=0.001-95f69369 results/sweep/digits_lr=0.01-57e9003b
}

# The quick preset (`bash run.sh --quick`): these arguments come first on every job's command
# line (extras after `--` still override them), in their own folder, so a plain `bash run.sh`
# later runs the real sweep instead of finding the quick results done.
readonly QUICK_ARGS=(--epochs 6 --width 16)

# ---- Where the jobs run -----------------------------------------------------------------------
PRESET="${PRESET:-}"
for arg in "$@"; do
  if [[ "${arg}" == -- ]]; then break; fi
  if [[ "${arg}" == --quick ]]; then PRESET=quick; fi
done
PYTHON="${PYTHON:-python}"
SWEEP_NAME="${SWEEP_NAME:-${PRESET:-sweep}}"
JOBS_PER_GPU="${JOBS_PER_GPU:-1}"
CPU_JOBS="${CPU_JOBS:-auto}"
CPU_JOB_MEM_GB="${CPU_JOB_MEM_GB:-2}"
LOG_DIR="${LOG_DIR:-logs/${SWEEP_NAME}}"
STATUS_EVERY="${STATUS_EVERY:-60}"
STATUS_EVERY_LOG="${STATUS_EVERY_LOG:-600}"
# run.sh --slurm: one array task per job, one GPU each.
SLURM_PARTITION="${SLURM_PARTITION:-}"          # empty: the cluster's default partition
SLURM_TIME="${SLURM_TIME:-24:00:00}"            # per task; a task near its limit checkpoints
SLURM_MEM="${SLURM_MEM:-32G}"                   #   and requeues itself (see slurm_task.sh)
SLURM_CPUS="${SLURM_CPUS:-8}"                   # CPU cores per task (data loading)
SLURM_GRES="${SLURM_GRES:-gpu:1}"               # e.g. gpu:a100:1
SLURM_MAX_PARALLEL="${SLURM_MAX_PARALLEL:-16}"  # tasks running at once (be fair to the lab)
SLURM_SIGNAL_SECS="${SLURM_SIGNAL_SECS:-300}"   # warning before the time limit, to checkpoint
SLURM_EXTRA="${SLURM_EXTRA:-}"                  # e.g. "--account=mylab --qos=normal"
SLURM_LOG_DIR="${SLURM_LOG_DIR:-logs/slurm}"    # one folder per submission: args, task logs
SWEEP_JOB_NAME="${SWEEP_JOB_NAME:-}"           # squeue's name; empty: the project folder's
# run.sh --slurm, one job on several GPUs (README, "One job on several GPUs"): > 1 runs each job
# under torchrun, one process per GPU; --batch-size stays the job's global batch.
GPUS_PER_JOB="${GPUS_PER_JOB:-1}"               # GPUs of one job on each of its nodes
NODES_PER_JOB="${NODES_PER_JOB:-1}"             # nodes of one job (> 1: srun + c10d rendezvous)

main() {
  local -a options=() extra=()
  while (( $# > 0 )) && [[ "$1" != -- ]]; do
    if [[ "$1" != --quick ]]; then options+=("$1"); fi
    shift
  done
  if (( $# > 0 )); then shift; extra=("$@"); fi
  case "${PRESET}" in
    "") ;;
    quick)
      extra=("${QUICK_ARGS[@]}" "${extra[@]}")
      echo "run.sh: quick preset: ${QUICK_ARGS[*]} on every job, results in results/${SWEEP_NAME}/"
      ;;
    *) echo "run.sh: PRESET must be quick or empty, got '${PRESET}'" >&2; exit 2 ;;
  esac
  cd "$(dirname "${BASH_SOURCE[0]}")"
  # shellcheck source-path=SCRIPTDIR disable=SC1091  # (followed with -x)
  source scripts/sweep_lib.sh
  sweep_main define_jobs "${options[@]}" -- "${extra[@]}"
}

main "$@"
