#!/usr/bin/env bash
# One task of the Slurm job array that `run.sh --slurm` submits; not meant to be run by hand.
#
# Usage (by sbatch): slurm_task.sh SUBMIT_DIR
#   SUBMIT_DIR/args/<SLURM_ARRAY_TASK_ID>  this task's run.py arguments, NUL-separated
#   SUBMIT_DIR/script/<SLURM_ARRAY_TASK_ID> the script it runs, when not run.py (analyze.py, ...)
#   SUBMIT_DIR/python                      the interpreter that run.sh --slurm resolved
#
# Which event sends which signal (Slurm's documentation: sbatch --signal, scancel, preempt.html),
# and what this task does:
#   time limit   USR1 to this script only (--signal=B:USR1@SLURM_SIGNAL_SECS), that many seconds
#                before the limit: passed on to run.py, which checkpoints and exits 75; this task
#                requeues itself (Slurm never requeues a timed-out job) and resumes later.
#                Should run.py still run at the limit: TERM to every process, KillWait later KILL.
#   preemption   TERM to every process of the job (run.py included) as soon as it is selected,
#                again TERM then KILL when its GraceTime is over: run.py checkpoints and exits 75;
#                with PreemptMode=REQUEUE Slurm requeues the task itself (--requeue).
#   scancel      TERM to every process, KillWait later KILL: run.py checkpoints and exits 75; the
#                task stays cancelled (its state is COMPLETING: this script does not requeue it).
#   scancel --signal=TERM [--full]: the same TERM without cancelling: run.py checkpoints, exits
#                75, and this task requeues itself.
# TERM is not passed on: Slurm has already sent it to run.py, and a second one would be a burst.
# After an exit 75 the task requeues itself unless it was cancelled; its log says which and why.

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
  local submit_dir="$1" python rc=0 again script=run.py
  local task="${SLURM_ARRAY_TASK_ID:?not running as a Slurm array task}"
  local -a args=()
  mapfile -d '' -t args <"${submit_dir}/args/${task}"
  python="$(<"${submit_dir}/python")"
  if [[ -f "${submit_dir}/script/${task}" ]]; then script="$(<"${submit_dir}/script/${task}")"; fi
  printf '=== %(%F %T)T  job %s_%s on %s, CUDA_VISIBLE_DEVICES=%s, start #%s\n' -1 \
    "${SLURM_ARRAY_JOB_ID:-?}" "${task}" "$(hostname -s)" "${CUDA_VISIBLE_DEVICES-}" \
    "$(( ${SLURM_RESTART_COUNT:-0} + 1 ))"
  printf '    %s %s %s\n' "${python}" "${script}" "${args[*]}"

  trap on_usr1 USR1
  trap on_term TERM
  "${python}" "${script}" "${args[@]}" &
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

  if (( rc == 75 )); then
    # run.py saved a checkpoint and stopped. Slurm never requeues a timed-out task itself, and a
    # task stopped by a signal alone (scancel --signal=TERM) would otherwise end here: put it
    # back in the queue, so that its next start resumes. Not a cancelled one: scancel puts the
    # job in COMPLETING before the TERM arrives, and `scontrol requeue` would revive it.
    local state
    state="$(squeue -h -j "${SLURM_JOB_ID:-}" -o %T 2>/dev/null || true)"
    if (( SWEEP_GOT_USR1 )) || [[ "${state}" == "RUNNING" ]]; then
      local reason="SIGTERM (scancel --signal=TERM, or a preemption)"
      if (( SWEEP_GOT_USR1 )); then reason="SIGUSR1 (the time limit is near)"; fi
      echo "requeueing ${SLURM_ARRAY_JOB_ID}_${task}: run.py checkpointed and exited 75 after" \
        "${reason}; the next start resumes from the checkpoint"
      scontrol requeue "${SLURM_ARRAY_JOB_ID}_${task}" \
        || echo "slurm_task: requeue failed (already requeued by Slurm?)" >&2
    else
      echo "not requeueing: the job is ${state:-gone} (cancelled, or past its time limit);" \
        "run.sh --slurm submits it again and it resumes from the checkpoint"
    fi
  fi
  exit "${rc}"
}

main "$@"
