#!/usr/bin/env bash
# One task of the Slurm job array that `run.sh --slurm` submits; not meant to be run by hand.
#
# Usage (by sbatch): slurm_task.sh SUBMIT_DIR
#   SUBMIT_DIR/args/<SLURM_ARRAY_TASK_ID>  this task's run.py arguments, NUL-separated
#   SUBMIT_DIR/script/<SLURM_ARRAY_TASK_ID> the script it runs, when not run.py (analyze.py, ...)
#   SUBMIT_DIR/python                      the interpreter that run.sh --slurm resolved
#   SUBMIT_DIR/tasks.tsv                   task number -> run directory
#   SUBMIT_DIR/torchrun                    "GPUS NODES" when one job has several GPUs: run.py
#                                          under torchrun (one node: --standalone; several:
#                                          srun, one torchrun per node, c10d rendezvous on the
#                                          first node). torchrun exits 1 whatever its workers
#                                          did, so an exit 75 is read from the run directory's
#                                          status (rank 0 writes "interrupted" when it stopped).
#        slurm_task.sh --launch GPUS NODES   print that torchrun command (run.sh --dry-run)
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
# Under torchrun USR1 becomes TERM (torchrun dies of USR1; it passes TERM on to its workers, and
# kills them 30 s later: the checkpoint must be written by then).
# After an exit 75 the task requeues itself unless it was cancelled; its log says which and why.

set -euo pipefail

SWEEP_CHILD_PID=""
SWEEP_GOT_USR1=0
SWEEP_TRAPPED=0   # a trap ran: `wait` may have returned early
SWEEP_NODES=0     # > 0: run.py runs under torchrun on this many nodes
TORCHRUN=()       # filled by torchrun_command

#######################################
# Wait (60 s at most) until process PID catches SIGNAL, then send it. A Python process catches
# its stop signals only once its first lines have run: a signal before that kills it (run.py
# exited 138 when Slurm's warning came at its start) instead of stopping it.
# Arguments: SIGNAL (a name), PID.
#######################################
# shellcheck disable=SC2329
send_when_caught() {
  local signal="$1" pid="$2" mask bit tries
  bit=$(( 1 << ($(kill -l "${signal}") - 1) ))
  for (( tries = 0; tries < 600; tries++ )); do
    # SigCgt: the signals the process has a handler for, in hex; gone: it has ended
    mask="$(awk '/^SigCgt:/ { print $2 }' "/proc/${pid}/status" 2>/dev/null)" || break
    if [[ -z "${mask}" ]] || (( 16#${mask} & bit )); then break; fi
    sleep 0.1
  done
  kill -"${signal}" "${pid}" 2>/dev/null || true
}

# Called from the traps in main.
# shellcheck disable=SC2329
on_usr1() {
  SWEEP_GOT_USR1=1 SWEEP_TRAPPED=1
  echo "slurm_task: SIGUSR1 (time limit near): asking run.py to checkpoint and stop" >&2
  if [[ -z "${SWEEP_CHILD_PID}" ]]; then return; fi
  if (( SWEEP_NODES > 1 )); then
    scancel --signal=TERM "${SLURM_JOB_ID}" || true   # every process of the srun step
  elif (( SWEEP_NODES == 1 )); then
    send_when_caught TERM "${SWEEP_CHILD_PID}"   # torchrun passes it on
  else
    send_when_caught USR1 "${SWEEP_CHILD_PID}"
  fi
}

#######################################
# The command that starts one job on GPUS processes per node on NODES nodes, into TORCHRUN.
# Arguments: python, GPUS, NODES.
#######################################
torchrun_command() {
  local python="$1" gpus="$2" nodes="$3" head
  if (( nodes == 1 )); then
    TORCHRUN=("${python}" -m torch.distributed.run --standalone --nproc-per-node="${gpus}")
    return
  fi
  head="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1 || true)"
  # One port per job (array tasks of other jobs may share the first node).
  TORCHRUN=(srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${python}" -m torch.distributed.run
    --nnodes="${nodes}" --nproc-per-node="${gpus}" --rdzv-backend=c10d
    --rdzv-endpoint="${head:-FIRST_NODE}:$(( 20000 + ${SLURM_JOB_ID:-0} % 40000 ))"
    --rdzv-id="${SLURM_JOB_ID:-JOB_ID}")
}

#######################################
# 75 when this start's run stopped to be resumed (status "interrupted", written after the start
# marker), else the code given: what torchrun's 1 stands for.
#######################################
torchrun_exit_code() {
  local rc="$1" run_dir="$2" marker="$3"
  if (( rc != 0 )) && [[ -n "${run_dir}" && "${run_dir}/status" -nt "${marker}" ]] \
    && [[ "$(<"${run_dir}/status")" == "interrupted" ]]; then
    echo "torchrun exited with ${rc}; rank 0 wrote status interrupted: resumable (75)" >&2
    rc=75
  fi
  echo "${rc}"
}

# shellcheck disable=SC2329
on_term() {
  SWEEP_TRAPPED=1
  echo "slurm_task: SIGTERM (preemption, scancel or time limit): run.py got it too" >&2
}

main() {
  if [[ "$1" == "--launch" ]]; then
    torchrun_command PYTHON "$2" "$3"
    echo "${TORCHRUN[*]}"
    return
  fi
  local submit_dir="$1" python rc=0 again script=run.py gpus run_dir="" marker
  local task="${SLURM_ARRAY_TASK_ID:?not running as a Slurm array task}"
  local -a args=() launch=()
  mapfile -d '' -t args <"${submit_dir}/args/${task}"
  python="$(<"${submit_dir}/python")"
  if [[ -f "${submit_dir}/script/${task}" ]]; then script="$(<"${submit_dir}/script/${task}")"; fi
  launch=("${python}")
  if [[ -f "${submit_dir}/torchrun" ]]; then
    read -r gpus SWEEP_NODES <"${submit_dir}/torchrun"
    torchrun_command "${python}" "${gpus}" "${SWEEP_NODES}"
    launch=("${TORCHRUN[@]}")
    run_dir="$(awk -F '\t' -v t="${task}" '$1 == t { print $2 }' "${submit_dir}/tasks.tsv")"
    marker="${submit_dir}/started-${task}"
    touch "${marker}"
  fi
  printf '=== %(%F %T)T  job %s_%s on %s, CUDA_VISIBLE_DEVICES=%s, start #%s\n' -1 \
    "${SLURM_ARRAY_JOB_ID:-?}" "${task}" "$(hostname -s)" "${CUDA_VISIBLE_DEVICES-}" \
    "$(( ${SLURM_RESTART_COUNT:-0} + 1 ))"
  printf '    %s %s %s\n' "${launch[*]}" "${script}" "${args[*]}"

  trap on_usr1 USR1
  trap on_term TERM
  "${launch[@]}" "${script}" "${args[@]}" &
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
  if (( SWEEP_NODES > 0 )); then rc="$(torchrun_exit_code "${rc}" "${run_dir}" "${marker}")"; fi
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
