#!/usr/bin/env bash
# One task of the Slurm job array that `run.sh --slurm` submits; not meant to be run by hand.
#
# Usage (by sbatch): slurm_task.sh SUBMIT_DIR
#   SUBMIT_DIR/args/<SLURM_ARRAY_TASK_ID>  this task's run.py arguments, NUL-separated
#   SUBMIT_DIR/python                      the interpreter that run.sh --slurm resolved
#
# Runs run.py in the background so that this script can catch signals while it runs:
#   USR1  sent by Slurm SLURM_SIGNAL_SECS before the time limit (--signal=B:USR1@N): forwarded
#         to run.py, which checkpoints and exits 75; this task then requeues itself, and the
#         next start resumes from the checkpoint.
#   TERM  preemption or scancel: forwarded as well. A preempted task is requeued by Slurm
#         itself (--requeue); a cancelled one must stay cancelled, so no self-requeue here.

set -euo pipefail

CHILD_PID=""
GOT_USR1=0

# Forward a signal to run.py (it checkpoints and exits 75). Called from the traps in main.
# shellcheck disable=SC2329
forward() {
  if [[ "$1" == "USR1" ]]; then GOT_USR1=1; fi
  echo "slurm_task: got SIG$1, asking run.py to checkpoint and stop" >&2
  if [[ -n "${CHILD_PID}" ]]; then kill -"$1" "${CHILD_PID}" 2>/dev/null || true; fi
}

main() {
  local submit_dir="$1" python rc=0
  local task="${SLURM_ARRAY_TASK_ID:?not running as a Slurm array task}"
  local -a args=()
  mapfile -d '' -t args <"${submit_dir}/args/${task}"
  python="$(<"${submit_dir}/python")"
  printf '=== %(%F %T)T  job %s_%s on %s, CUDA_VISIBLE_DEVICES=%s, start #%s\n' -1 \
    "${SLURM_ARRAY_JOB_ID:-?}" "${task}" "$(hostname -s)" "${CUDA_VISIBLE_DEVICES-}" \
    "$(( ${SLURM_RESTART_COUNT:-0} + 1 ))"
  printf '    %s run.py %s\n' "${python}" "${args[*]}"

  trap 'forward USR1' USR1
  trap 'forward TERM' TERM
  "${python}" run.py "${args[@]}" &
  CHILD_PID=$!
  # `wait` returns early when a trapped signal arrives; keep waiting until run.py has exited.
  while true; do
    rc=0
    wait "${CHILD_PID}" || rc=$?
    kill -0 "${CHILD_PID}" 2>/dev/null || break
  done
  echo "run.py exited with ${rc}"

  if (( rc == 75 && GOT_USR1 )); then
    # Slurm does not requeue a job that reaches its time limit; run.py has just saved a
    # checkpoint, so put this array task back in the queue to continue later.
    echo "requeueing ${SLURM_ARRAY_JOB_ID}_${task} to resume from the checkpoint"
    scontrol requeue "${SLURM_ARRAY_JOB_ID}_${task}" || echo "slurm_task: requeue failed" >&2
  fi
  exit "${rc}"
}

main "$@"
