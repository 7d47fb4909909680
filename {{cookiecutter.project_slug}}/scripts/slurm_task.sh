#!/usr/bin/env bash
# One task of the Slurm job array that `run.sh --slurm` submits; not meant to be run by hand.
#
# Usage (by sbatch): slurm_task.sh SUBMIT_DIR
#   SUBMIT_DIR/args/<SLURM_ARRAY_TASK_ID>  this task's run.py arguments, NUL-separated
#   SUBMIT_DIR/python                      the interpreter that run.sh --slurm resolved
#
# Which event sends which signal (Slurm's documentation: sbatch --signal, scancel, preempt.html),
# and what this task does:
#   time limit   USR1 to this script only (--signal=B:USR1@SLURM_SIGNAL_SECS), that many seconds
#                before the limit: passed on to run.py, which checkpoints and exits 75; this task
#                then requeues itself (Slurm never requeues a timed-out job) and resumes later.
#                Should run.py still run at the limit: TERM to every process, KillWait later KILL.
#   preemption   TERM to every process of the job (run.py included) when it is selected, KILL
#                when its GraceTime is over: run.py checkpoints and exits 75; Slurm requeues it
#                (--requeue) when the partition's PreemptMode is REQUEUE.
#   scancel      TERM to every process, KillWait later KILL: run.py checkpoints, exits 75, and
#                the task stays cancelled. `scancel --signal=TERM --full` is the same TERM.
# TERM is not passed on: Slurm has already sent it to run.py, and a second one would be a burst.

set -euo pipefail

SWEEP_CHILD_PID=""
SWEEP_GOT_USR1=0
SWEEP_TRAPPED=0   # a trap ran: `wait` may have returned early

# Called from the traps in main.
# shellcheck disable=SC2329
on_usr1() {
  SWEEP_GOT_USR1=1 SWEEP_TRAPPED=1
  echo "slurm_task: SIGUSR1 (time limit near): asking run.py to checkpoint and stop" >&2
  if [[ -n "${SWEEP_CHILD_PID}" ]]; then kill -USR1 "${SWEEP_CHILD_PID}" 2>/dev/null || true; fi
}

# shellcheck disable=SC2329
on_term() {
  SWEEP_TRAPPED=1
  echo "slurm_task: SIGTERM (preemption, scancel or time limit): run.py got it too" >&2
}

main() {
  local submit_dir="$1" python rc=0 again
  local task="${SLURM_ARRAY_TASK_ID:?not running as a Slurm array task}"
  local -a args=()
  mapfile -d '' -t args <"${submit_dir}/args/${task}"
  python="$(<"${submit_dir}/python")"
  printf '=== %(%F %T)T  job %s_%s on %s, CUDA_VISIBLE_DEVICES=%s, start #%s\n' -1 \
    "${SLURM_ARRAY_JOB_ID:-?}" "${task}" "$(hostname -s)" "${CUDA_VISIBLE_DEVICES-}" \
    "$(( ${SLURM_RESTART_COUNT:-0} + 1 ))"
  printf '    %s run.py %s\n' "${python}" "${args[*]}"

  trap on_usr1 USR1
  trap on_term TERM
  "${python}" run.py "${args[@]}" &
  SWEEP_CHILD_PID=$!
  # `wait` returns early (128+signal) when a trap runs. bash keeps the status of a child it has
  # reaped until `wait PID` collects it, so waiting again gives run.py's own exit code exactly;
  # 127 means that status was already collected by the first wait (the trap ran after it).
  wait "${SWEEP_CHILD_PID}" || rc=$?
  while (( SWEEP_TRAPPED )); do
    SWEEP_TRAPPED=0 again=0
    wait "${SWEEP_CHILD_PID}" || again=$?
    if (( again == 127 )); then break; fi
    rc="${again}"
  done
  echo "run.py exited with ${rc}"

  if (( rc == 75 && SWEEP_GOT_USR1 )); then
    # Slurm does not requeue a job that reaches its time limit; run.py has just saved a
    # checkpoint, so put this array task back in the queue to continue later.
    echo "requeueing ${SLURM_ARRAY_JOB_ID}_${task}: stopped by the time-limit warning" \
      "(SIGUSR1) with a checkpoint; the next start resumes from it"
    scontrol requeue "${SLURM_ARRAY_JOB_ID}_${task}" || echo "slurm_task: requeue failed" >&2
  elif (( rc == 75 )); then
    echo "not requeueing: stopped by SIGTERM (scancel stays cancelled; a preempted task is" \
      "requeued by Slurm itself)"
  fi
  exit "${rc}"
}

main "$@"
