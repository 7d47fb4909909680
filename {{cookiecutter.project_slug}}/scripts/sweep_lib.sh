# shellcheck shell=bash
# The sweep engine behind run.sh. Sourced, never executed: run.sh lists the jobs in a function
# and calls `sweep_main THAT_FUNCTION "$@"`. Nothing in here needs editing to change a sweep.
#
# How it works:
#   1. plan:  run the job function; each `job ARGS...` call records one run.py invocation. Ask
#             run.py where each job writes (`run.py ARGS --print-run-dir`) and read the state
#             from the files run.py writes there: metrics.json => done, status "failed" =>
#             failed, anything else => pending (resumes from its checkpoint, if any).
#   2. queue: one slot per GPU (JOBS_PER_GPU slots per GPU; CPU_JOBS slots without a GPU). Every
#             job runs in its own process group with CUDA_VISIBLE_DEVICES set to its slot's GPU.
#             `wait -n -p` says which job ended; its slot takes the next pending job at once.
#   3. stop:  SIGINT/SIGTERM/SIGHUP send SIGTERM to every running run.py (it checkpoints and
#             exits 75), wait for them, clean up their process groups, exit 128+signal. A second
#             signal sends SIGKILL.
#   4. --slurm: the same pending jobs as one sbatch array (scripts/slurm_task.sh runs one).
# Needs bash >= 5.1 (`wait -n -p`).

# All jobs, flattened: job I's run.py arguments are SWEEP_ARGV[SWEEP_START[I]] and the
# SWEEP_LEN[I]-1 that follow (bash has no arrays of arrays).
SWEEP_ARGV=()
SWEEP_START=()
SWEEP_LEN=()
SWEEP_EXTRA=()   # arguments after `--` on run.sh's command line, appended to every job
SWEEP_STATE=()   # per job: done | pending | failed | invalid | duplicate
SWEEP_DIR=()     # per job: its run directory (from run.py --print-run-dir)
SWEEP_NAME=()    # per job: basename of its run directory
SWEEP_NOTE=()    # per job: detail shown by --dry-run and the summary
SWEEP_STOP_SIGNAL=""   # set by the first INT/TERM/HUP
JOB_ARGV=()            # filled by job_argv

#######################################
# Add one run.py invocation to the sweep; called from run.sh's job list.
# Arguments: run.py's arguments for this job.
#######################################
job() {
  SWEEP_START+=("${#SWEEP_ARGV[@]}")
  SWEEP_LEN+=("$#")
  SWEEP_ARGV+=("$@")
}

err() { echo "run.sh: $*" >&2; }
die() { err "$@"; exit 2; }
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }

# job_argv I: set JOB_ARGV to job I's complete run.py argument list.
job_argv() {
  JOB_ARGV=("${SWEEP_ARGV[@]:${SWEEP_START[$1]}:${SWEEP_LEN[$1]}}" "${SWEEP_EXTRA[@]}")
}

# Print the header comment of run.sh (the usage text). run.sh has cd'ed to its own directory.
usage() {
  sed -n '2,/^$/{s/^# \{0,1\}//;p}' "${BASH_SOURCE[-1]##*/}"
}

# Defaults for the settings run.sh lists at its top (for a driver script that leaves some out).
sweep_defaults() {
  : "${PYTHON:=python}" "${JOBS_PER_GPU:=1}" "${CPU_JOBS:=1}" "${LOG_DIR:=logs/sweep}"
  : "${SLURM_PARTITION:=}" "${SLURM_TIME:=24:00:00}" "${SLURM_MEM:=32G}" "${SLURM_CPUS:=8}"
  : "${SLURM_GRES:=gpu:1}" "${SLURM_MAX_PARALLEL:=16}" "${SLURM_SIGNAL_SECS:=300}"
  : "${SLURM_LOG_DIR:=logs/slurm}" "${SLURM_EXTRA:=}"
}

#######################################
# Find every job's run directory and state; SWEEP_STATE etc. are filled in.
#######################################
plan_jobs() {
  local i dir out status
  local -A seen=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    job_argv "${i}"
    SWEEP_NOTE[i]=""
    if ! out="$("${PYTHON}" run.py "${JOB_ARGV[@]}" --print-run-dir 2>&1)"; then
      SWEEP_STATE[i]="invalid" SWEEP_DIR[i]="" SWEEP_NAME[i]="job-${i}"
      SWEEP_NOTE[i]="run.py rejected the arguments: ${out##*$'\n'}"
      continue
    fi
    dir="${out##*$'\n'}"   # last line: the directory
    SWEEP_DIR[i]="${dir}" SWEEP_NAME[i]="${dir##*/}"
    if [[ -n "${seen[${dir}]:-}" ]]; then
      SWEEP_STATE[i]="duplicate" SWEEP_NOTE[i]="same run as job ${seen[${dir}]}"
      continue
    fi
    seen[${dir}]="${i}"
    status=""
    [[ -f "${dir}/status" ]] && read -r status <"${dir}/status" || true
    if [[ -f "${dir}/metrics.json" ]]; then
      SWEEP_STATE[i]="done"
    elif [[ "${status}" == "failed" ]]; then
      SWEEP_STATE[i]="failed" SWEEP_NOTE[i]="last attempt failed; will be re-run"
    else
      SWEEP_STATE[i]="pending"
      if [[ -f "${dir}/checkpoint.pt" ]]; then
        SWEEP_NOTE[i]="${status:-started}, resumes from checkpoint"
      fi
    fi
  done
}

# Print one line per job with its state, then the counts.
print_plan() {
  local i
  local -A count=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    job_argv "${i}"
    printf '%-9s %s' "${SWEEP_STATE[i]}" "${SWEEP_NAME[i]}"
    if [[ -n "${SWEEP_NOTE[i]}" ]]; then printf '  (%s)' "${SWEEP_NOTE[i]}"; fi
    printf '\n          run.py %s\n' "${JOB_ARGV[*]}"
    count[${SWEEP_STATE[i]}]=$(( ${count[${SWEEP_STATE[i]}]:-0} + 1 ))
  done
  printf '%d jobs: %d done, %d pending, %d failed' "${#SWEEP_START[@]}" \
    "${count[done]:-0}" "${count[pending]:-0}" "${count[failed]:-0}"
  if (( ${count[invalid]:-0} )); then printf ', %d invalid' "${count[invalid]}"; fi
  if (( ${count[duplicate]:-0} )); then printf ', %d duplicate' "${count[duplicate]}"; fi
  printf '\n'
}

# Create the MLflow database and experiment once, before jobs start in parallel (several
# processes creating a fresh sqlite DB at once race in its migrations and fail).
# Arguments: index of a job whose arguments (e.g. --experiment) to use.
init_tracking() {
  job_argv "$1"
  "${PYTHON}" run.py "${JOB_ARGV[@]}" --init-tracking >/dev/null \
    || die "could not create the MLflow database (run.py --init-tracking failed)"
}

# Fill SLOTS with one device per slot: "0 0 1 1" for GPUS="0 1" JOBS_PER_GPU=2; "" per CPU slot.
make_slots() {
  local gpus dev k
  if [[ -n "${GPUS+set}" ]]; then
    gpus="${GPUS//,/ }"
  elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then   # already restricted: stay inside it
    gpus="${CUDA_VISIBLE_DEVICES//,/ }"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')" \
      || gpus=""
  else
    gpus=""
  fi
  read -ra gpus <<<"${gpus}"
  SLOTS=()
  if (( ${#gpus[@]} == 0 )); then
    for ((k = 0; k < CPU_JOBS; k++)); do SLOTS+=(""); done
    # CPU jobs share the cores rather than each starting one thread per core.
    if [[ -z "${OMP_NUM_THREADS:-}" ]] && (( CPU_JOBS > 1 )); then
      export OMP_NUM_THREADS=$(( $(nproc 2>/dev/null || echo "${CPU_JOBS}") / CPU_JOBS ))
      (( OMP_NUM_THREADS >= 1 )) || OMP_NUM_THREADS=1
    fi
  else
    for dev in "${gpus[@]}"; do
      for ((k = 0; k < JOBS_PER_GPU; k++)); do SLOTS+=("${dev}"); done
    done
  fi
}

#######################################
# Signal handler: the first signal asks every running job to checkpoint and stop (SIGTERM to
# the job's main process), the second one kills their process groups outright.
#######################################
on_signal() {
  local pid
  if [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then
    err "second signal: killing all jobs"
    for pid in "${!SWEEP_RUNNING[@]}"; do kill -KILL -- "-${pid}" 2>/dev/null || true; done
    return
  fi
  SWEEP_STOP_SIGNAL="$1"
  err "got SIG$1: stopping ${#SWEEP_RUNNING[@]} running job(s) (they checkpoint; again to kill)"
  for pid in "${!SWEEP_RUNNING[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; done
}

# launch I SLOT: start job I in the background, in a process group of its own.
launch() {
  local i="$1" slot="$2" dev="${SLOTS[$2]}" pid
  local log_file="${LOG_DIR}/${SWEEP_NAME[$1]}.log"
  job_argv "${i}"
  printf '=== %(%F %T)T  CUDA_VISIBLE_DEVICES=%s  %s run.py %s\n' -1 "${dev}" "${PYTHON}" \
    "${JOB_ARGV[*]}" >>"${log_file}"
  # setsid: its own process group (pgid = pid), so stopping it reaches its children too, and
  # Ctrl-C in the terminal reaches run.sh only, which then stops every job the same way.
  if (( SWEEP_HAVE_SETSID )); then
    CUDA_VISIBLE_DEVICES="${dev}" setsid "${PYTHON}" run.py "${JOB_ARGV[@]}" \
      </dev/null >>"${log_file}" 2>&1 &
  else   # no setsid (macOS): job control gives the job its own process group
    set -m
    CUDA_VISIBLE_DEVICES="${dev}" "${PYTHON}" run.py "${JOB_ARGV[@]}" \
      </dev/null >>"${log_file}" 2>&1 &
    set +m
  fi
  pid=$!
  SWEEP_RUNNING[${pid}]="${i}" SWEEP_SLOT_OF[${pid}]="${slot}" SWEEP_T0[${pid}]="${EPOCHSECONDS}"
  SWEEP_GROUPS+=("${pid}")
  SLOT_BUSY[slot]=1
  log "start    ${SWEEP_NAME[i]}  (${dev:+GPU }${dev:-CPU}, slot ${slot})"
  # A signal that arrived while this job was being started missed it.
  if [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then kill -TERM "${pid}" 2>/dev/null || true; fi
}

# finish PID STATUS: record how job PID ended and free its slot.
finish() {
  local pid="$1" rc="$2" i="${SWEEP_RUNNING[$1]}" took
  took=$(( EPOCHSECONDS - SWEEP_T0[$1] ))
  local slot="${SWEEP_SLOT_OF[${pid}]}"
  unset "SWEEP_RUNNING[${pid}]"
  SLOT_BUSY[slot]=0
  # Children the job left behind (data-loader workers, ...) go with it.
  kill -TERM -- "-${pid}" 2>/dev/null || true
  if (( rc == 0 )) && [[ -f "${SWEEP_DIR[i]}/metrics.json" ]]; then
    SWEEP_RESULT[i]="done"
    log "done     ${SWEEP_NAME[i]}  (${took}s)"
  elif (( rc == 75 )); then
    SWEEP_RESULT[i]="interrupted"
    log "stopped  ${SWEEP_NAME[i]}  (checkpointed; re-run run.sh to resume)"
  else
    SWEEP_RESULT[i]="failed"
    if (( rc == 0 )); then rc="0 but no metrics.json"; fi
    log "FAILED   ${SWEEP_NAME[i]}  (exit ${rc}, ${took}s)  log: ${LOG_DIR}/${SWEEP_NAME[i]}.log"
  fi
}

# After the queue: give leftover processes of every job's group 10 s, then kill them.
reap_groups() {
  local pg alive tries
  for ((tries = 0; tries < 100; tries++)); do
    alive=0
    for pg in "${SWEEP_GROUPS[@]}"; do
      if kill -0 -- "-${pg}" 2>/dev/null; then alive=1; fi
    done
    (( alive )) || return 0
    sleep 0.1
  done
  for pg in "${SWEEP_GROUPS[@]}"; do kill -KILL -- "-${pg}" 2>/dev/null || true; done
}

#######################################
# Run every pending job through the dynamic queue; print the summary.
# Returns: 0 if every job is done, 1 otherwise.
#######################################
run_queue() {
  local i s pid rc next=0
  local -a queue=()
  declare -gA SWEEP_RUNNING=() SWEEP_SLOT_OF=() SWEEP_T0=()
  declare -ga SWEEP_GROUPS=() SLOT_BUSY=() SWEEP_RESULT=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    case "${SWEEP_STATE[i]}" in
      pending | failed) queue+=("${i}") ;;
      done) SWEEP_RESULT[i]="skipped" ;;
      duplicate) SWEEP_RESULT[i]="duplicate" ;;
      *) SWEEP_RESULT[i]="failed" ;;
    esac
  done
  for s in "${!SLOTS[@]}"; do SLOT_BUSY[s]=0; done
  mkdir -p "${LOG_DIR}"
  trap 'on_signal INT' INT
  trap 'on_signal TERM' TERM
  trap 'on_signal HUP' HUP
  if (( ${#queue[@]} > 0 )); then
    log "${#queue[@]} job(s) to run, $(( ${#SWEEP_START[@]} - ${#queue[@]} )) done or skipped;" \
      "${#SLOTS[@]} slot(s): ${SLOTS[*]:-CPU}; logs in ${LOG_DIR}/"
    init_tracking "${queue[0]}"
  fi
  while true; do
    if [[ -z "${SWEEP_STOP_SIGNAL}" ]]; then
      for s in "${!SLOTS[@]}"; do
        if (( SLOT_BUSY[s] == 0 && next < ${#queue[@]} )); then
          launch "${queue[next]}" "${s}"
          next=$(( next + 1 ))
        fi
      done
    fi
    (( ${#SWEEP_RUNNING[@]} > 0 )) || break
    pid="" rc=0
    wait -n -p pid || rc=$?
    # No pid: a trapped signal interrupted the wait (or it was not one of ours).
    if [[ -n "${pid:-}" && -n "${SWEEP_RUNNING[${pid}]+set}" ]]; then finish "${pid}" "${rc}"; fi
  done
  reap_groups
  trap - INT TERM HUP
  summarize
}

# Print the counts and the failures; returns 0 iff every job is done.
summarize() {
  local i n_done=0 n_skip=0 n_fail=0 n_int=0 n_left=0 n_dup=0
  local -a failures=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    case "${SWEEP_RESULT[i]:-}" in
      done) n_done=$(( n_done + 1 )) ;;
      skipped) n_skip=$(( n_skip + 1 )) ;;
      duplicate) n_dup=$(( n_dup + 1 )) ;;
      interrupted) n_int=$(( n_int + 1 )) ;;
      failed)
        n_fail=$(( n_fail + 1 ))
        if [[ "${SWEEP_STATE[i]}" == "invalid" ]]; then
          job_argv "${i}"
          failures+=("job ${i} (run.py ${JOB_ARGV[*]}): ${SWEEP_NOTE[i]}")
        else
          failures+=("${SWEEP_NAME[i]}  log: ${LOG_DIR}/${SWEEP_NAME[i]}.log")
        fi
        ;;
      *) n_left=$(( n_left + 1 )) ;;
    esac
  done
  echo "---"
  printf 'sweep summary: %d done (%d ran now, %d skipped: already done), %d failed, ' \
    "$(( n_done + n_skip ))" "${n_done}" "${n_skip}" "${n_fail}"
  printf '%d interrupted, %d not started' "${n_int}" "${n_left}"
  if (( n_dup )); then printf ' (%d duplicate job(s) ignored)' "${n_dup}"; fi
  printf '\n'
  for i in "${failures[@]}"; do echo "  failed: ${i}"; done
  if (( n_int + n_left )); then
    echo "re-run run.sh to finish the rest (interrupted jobs resume from their checkpoints)."
  fi
  (( n_fail + n_int + n_left == 0 ))
}

#######################################
# Submit the pending jobs as one Slurm job array (scripts/slurm_task.sh runs one task).
#######################################
submit_slurm() {
  local dry_run="$1" i n=0 dir python jobid
  local -a pending=() cmd=() extra=()
  [[ -f scripts/slurm_task.sh ]] || die "--slurm is not available: scripts/slurm_task.sh is" \
    "missing (this project was generated with use_slurm=false)"
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    case "${SWEEP_STATE[i]}" in
      pending | failed) pending+=("${i}") ;;
      invalid) err "not submitted, ${SWEEP_NOTE[i]}" ;;
    esac
  done
  if (( ${#pending[@]} == 0 )); then
    echo "nothing to submit: all ${#SWEEP_START[@]} jobs are done."
    return 0
  fi
  dir="${PWD}/${SLURM_LOG_DIR}/$(date +%Y%m%d-%H%M%S)-$$"
  cmd=(sbatch --parsable --job-name="${SLURM_JOB_NAME:-${PWD##*/}}"
    --array="0-$(( ${#pending[@]} - 1 ))%${SLURM_MAX_PARALLEL}"
    --gres="${SLURM_GRES}" --cpus-per-task="${SLURM_CPUS}" --mem="${SLURM_MEM}" --time="${SLURM_TIME}"
    # --requeue: preempted tasks go back to the queue. B:USR1@N: N s before the time limit,
    # the task script gets USR1; run.py checkpoints and the task requeues itself.
    --requeue --signal="B:USR1@${SLURM_SIGNAL_SECS}" --open-mode=append
    --output="${dir}/%A_%a.out" --chdir="${PWD}")
  if [[ -n "${SLURM_PARTITION}" ]]; then cmd+=(--partition="${SLURM_PARTITION}"); fi
  read -ra extra <<<"${SLURM_EXTRA}"
  cmd+=("${extra[@]}" scripts/slurm_task.sh "${dir}")
  if (( dry_run )); then
    echo "would submit ${#pending[@]} job(s): ${cmd[*]}"
    return 0
  fi
  command -v sbatch >/dev/null 2>&1 || die "--slurm: sbatch not found (run this on a Slurm login node)"
  init_tracking "${pending[0]}"
  mkdir -p "${dir}/args"
  # The interpreter the tasks use: PYTHON as resolved here, so the tasks get the same venv.
  python="$(command -v "${PYTHON}")" || die "PYTHON=${PYTHON} not found"
  printf '%s\n' "${python}" >"${dir}/python"
  for i in "${pending[@]}"; do
    job_argv "${i}"
    # One file per array task: its run.py arguments, NUL-separated (any character is safe).
    printf '%s\0' "${JOB_ARGV[@]}" >"${dir}/args/${n}"
    printf '%d\t%s\n' "${n}" "${SWEEP_NAME[i]}" >>"${dir}/tasks.tsv"
    n=$(( n + 1 ))
  done
  jobid="$("${cmd[@]}")" || die "sbatch failed"
  jobid="${jobid%%;*}"
  printf '%s\n' "${jobid}" >"${dir}/job_id"
  echo "submitted ${n} job(s) as Slurm array ${jobid} (at most ${SLURM_MAX_PARALLEL} at a time)"
  echo "  watch:  squeue -j ${jobid}        cancel: scancel ${jobid}"
  echo "  logs:   ${dir}/${jobid}_<task>.out   (task -> run: ${dir}/tasks.tsv)"
}

#######################################
# Entry point, called by run.sh.
# Arguments: the name of the function that lists the jobs, then run.sh's arguments.
#######################################
sweep_main() {
  local define_jobs="$1" dry_run=0 slurm=0
  shift
  sweep_defaults
  if (( BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1) )); then
    die "needs bash >= 5.1 (this is ${BASH_VERSION}); on macOS: brew install bash"
  fi
  while (( $# > 0 )); do
    case "$1" in
      --dry-run) dry_run=1 ;;
      --slurm) slurm=1 ;;
      -h | --help) usage; exit 0 ;;
      --) shift; SWEEP_EXTRA=("$@"); break ;;
      *) usage >&2; die "unknown option: $1" ;;
    esac
    shift
  done
  [[ "${JOBS_PER_GPU}" =~ ^[1-9][0-9]*$ ]] || die "JOBS_PER_GPU must be a positive integer"
  [[ "${CPU_JOBS}" =~ ^[1-9][0-9]*$ ]] || die "CPU_JOBS must be a positive integer"
  command -v "${PYTHON}" >/dev/null 2>&1 \
    || die "PYTHON=${PYTHON} not found (activate the project's venv, or set PYTHON)"
  [[ -f run.py ]] || die "run.py not found in ${PWD}"
  SWEEP_HAVE_SETSID=0
  if command -v setsid >/dev/null 2>&1; then SWEEP_HAVE_SETSID=1; fi

  "${define_jobs}"
  (( ${#SWEEP_START[@]} > 0 )) || die "the sweep has no jobs"
  plan_jobs
  if (( slurm )); then
    if (( dry_run )); then print_plan; fi
    submit_slurm "${dry_run}"
  elif (( dry_run )); then
    print_plan
    make_slots
    echo "would run on ${#SLOTS[@]} slot(s): ${SLOTS[*]:-CPU}"
  else
    make_slots
    local rc=0
    run_queue || rc=$?
    if [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then
      exit $(( 128 + $(kill -l "${SWEEP_STOP_SIGNAL}") ))
    fi
    return "${rc}"
  fi
}
