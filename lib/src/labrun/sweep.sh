# shellcheck shell=bash
# labrun's sweep engine: the queue behind a project's run.sh. Sourced, never executed:
#   source "$("${PYTHON:-python}" -m labrun sweep-lib)"
#   sweep_main define_jobs "$@"     # define_jobs: run.sh's job list, one `job ARGS...` per job
# Every setting is an environment variable with its default here; run.sh may set its own before
# sweep_main. `bash run.sh --help` prints run.sh's header, then this list:
#
# Environment (defaults in brackets):
#   PYTHON        interpreter that runs run.py [python]
#   PRESET        quick: as --quick [empty: the sweep as listed]
#   SWEEP_NAME    results go to results/SWEEP_NAME [sweep; quick with the quick preset]
#   GPUS          GPU ids to use, e.g. "0 2" [all visible: CUDA_VISIBLE_DEVICES, else nvidia-smi;
#                 none: run on CPU]
#   JOBS_PER_GPU  jobs sharing one GPU [auto: one per 2 cores of the GPU's share and per job,
#                 as many as the GPU's free memory holds at the largest peak a finished job
#                 of the sweep recorded; one per GPU until a job has measured it]
#   CPU_JOBS      jobs at a time when there is no GPU [auto: one per core, at most one per
#                 job and per CPU_JOB_MEM_GB of free memory]
#                 Either way each job gets its share of the cores: OMP_NUM_THREADS (unless
#                 set) and LAB_JOB_CPUS, from which run.py sizes its loader workers. A resumed
#                 job keeps the threads it started with (config.json), so it ends with the
#                 numbers it would have had uninterrupted.
#   CPU_JOB_MEM_GB  memory one CPU job needs, in GiB, for CPU_JOBS=auto [2]
#   LOG_DIR       one log file per job [logs/SWEEP_NAME]
#   STATUS_EVERY  seconds between status lines on a terminal [60]; STATUS_EVERY_LOG: when the
#                 output goes to a file [600]; 0 = none
#   run.sh --slurm: one array task per job (labrun's slurm_task.sh), one GPU each:
#   SLURM_PARTITION     partition [empty: the cluster's default]
#   SLURM_TIME          time limit per task [24:00:00]; near it a task checkpoints and requeues
#   SLURM_MEM, SLURM_CPUS   memory and CPU cores per task [32G, 8]
#   SLURM_GRES          GPUs per task [gpu:1], e.g. gpu:a100:1
#   SLURM_MAX_PARALLEL  tasks running at once (be fair to the lab) [16]
#   SLURM_SIGNAL_SECS   warning before the time limit, to checkpoint [300]
#   SLURM_EXTRA         more sbatch options, e.g. "--account=mylab --qos=normal" [empty]
#   SLURM_LOG_DIR       one folder per submission: arguments, task logs [logs/slurm]
#   SWEEP_JOB_NAME      squeue's name for the array [the project folder's name]
#   GPUS_PER_JOB        one job on several GPUs of a node, under torchrun; --batch-size stays
#                       the job's global batch [1]
#   NODES_PER_JOB       nodes of one job (> 1: srun + c10d rendezvous) [1]

# How it works:
#   1. plan:  run the job function; each `job ARGS...` call records one run.py invocation:
#             `--results-dir results/SWEEP_NAME`, the preset's arguments (QUICK_ARGS with
#             --quick), the job's own, then those after `--` (the last of a flag wins);
#             `job SCRIPT.py ARGS...` one of another script built on labrun's jobs.py (e.g.
#             analyze.py), as is.
#             ONE call of `SCRIPT --plan` per script (its own parser, no torch) gives every
#             job's run directory and state: done (metrics.json parses), running (its claim is
#             held: running elsewhere), stopping (its holder is checkpointing: waited for, up to
#             SWEEP_STOPPING_WAIT_S), interrupted, failed, refused (run.py refused its
#             checkpoint: not re-run until --fresh), pending, waiting (an input, such as a run
#             it analyses, is not finished: planned again whenever a job of the sweep ends,
#             and queued once its inputs are done), invalid.
#   2. queue: JOBS_PER_GPU slots per GPU (gpu_slots); without a GPU CPU_JOBS slots, by
#             default one per core (cpu_slots). Every job runs in its own process group
#             with CUDA_VISIBLE_DEVICES set to its slot's GPU, under `setpriv --pdeathsig TERM`,
#             so it is told to stop if run.sh dies, even by SIGKILL. `wait -n -p` says which
#             job ended; its slot takes the next pending job.
#             A job that finds its run claimed by another process exits 73: "running elsewhere".
#   3. stop:  the first INT/TERM/HUP sends SIGTERM to every running job (it checkpoints and
#             exits 75); any later one SIGKILLs their process groups. Either way run.sh reaps
#             every job, marks a killed job's status "interrupted" and prints the summary, then
#             exits 128+first signal.
#   4. --slurm: the pending jobs as one sbatch array (slurm_task.sh, beside this file, runs one
#             task); tasks still queued or running from an earlier array are not submitted again.
# Needs bash >= 5.1 (`wait -n -p`).

# All jobs, flattened: job I's run.py arguments are SWEEP_ARGV[SWEEP_START[I]] and the
# SWEEP_LEN[I]-1 that follow (bash has no arrays of arrays).
SWEEP_ARGV=()
SWEEP_START=()
SWEEP_LEN=()
SWEEP_SCRIPT=()     # per job: the script it runs (run.py unless its job line names one)
SWEEP_EXTRA=()      # arguments after `--` on run.sh's command line, appended to every job
SWEEP_PRESET_ARGS=()   # the preset's arguments (QUICK_ARGS), before every run.py job's own
SWEEP_STATE=()      # per job: a state of SCRIPT --plan (plan.py), or duplicate, queued
SWEEP_DIR=()        # per job: its run directory (from run.py --plan)
SWEEP_RUN_NAME=()   # per job: basename of its run directory
SWEEP_NOTE=()       # per job: detail shown by --dry-run and the summary
SWEEP_STOP_SIGNAL=""   # set by the first INT/TERM/HUP
SWEEP_TICKER=""        # pid of the timer child that wakes the queue for a status line
SLOTS=()               # per slot: its GPU, or "" for a CPU slot (size_slots)
SWEEP_GPUS=()          # the GPUs the sweep uses (choose_gpus); none: CPU slots
SWEEP_SLOT_REASON=""   # why the slots are as many as they are (size_slots), for the start line
SWEEP_THREADS=""       # OMP_NUM_THREADS of a job that starts afresh (size_slots)
SWEEP_JOB_CPUS=""      # cores of one slot (LAB_JOB_CPUS): its threads and loader workers
SWEEP_GPU_WIDTH=0      # JOBS_PER_GPU=auto: slots per GPU the cores and jobs allow
SWEEP_GPU_MEASURE=0    # 1 while JOBS_PER_GPU=auto waits for a job's measured peak memory
SWEEP_GPU_WHY=""       # why SWEEP_GPU_WIDTH (gpu_slots)
# CUDA MPS would run the slots' kernels side by side; not measured to help yet (no GPU at hand
# when this was written), so it stays off.
readonly SWEEP_MPS="; CUDA MPS off (not measured to help)"
# GPU memory of one job beyond 1.25 x its peak allocation (the caching allocator holds more than
# it hands out): the CUDA context (an estimate; waits for a GPU to be measured).
readonly SWEEP_CUDA_CONTEXT_MIB="${SWEEP_CUDA_CONTEXT_MIB:-1024}"
readonly SWEEP_CGROUP="${SWEEP_CGROUP:-/sys/fs/cgroup}"   # cgroup v2 mount (tests point it away)
# How long to wait for jobs whose holder is checkpointing and exiting (plan state "stopping").
readonly SWEEP_STOPPING_WAIT_S="${SWEEP_STOPPING_WAIT_S:-30}"
JOB_ARGV=()            # filled by job_argv
readonly SWEEP_EXIT_BUSY=73 SWEEP_EXIT_INTERRUPTED=75
# This file, and the Slurm task script beside it (sbatch copies it at submission).
SWEEP_ENGINE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/${BASH_SOURCE[0]##*/}"
readonly SWEEP_ENGINE SWEEP_TASK_SCRIPT="${SWEEP_ENGINE%/*}/slurm_task.sh"

#######################################
# Add one job to the sweep; called from run.sh's job list.
# Arguments: run.py's arguments for this job, or a script (NAME.py) and its arguments.
#######################################
job() {
  local script="run.py"
  if [[ "${1:-}" == *.py ]]; then script="$1"; shift; fi
  SWEEP_SCRIPT+=("${script}")
  SWEEP_START+=("${#SWEEP_ARGV[@]}")
  SWEEP_LEN+=("$#")
  SWEEP_ARGV+=("$@")
}

err() { echo "run.sh: $*" >&2; }
die() { err "$@"; exit 2; }
bad_setting() { echo "error: $*" >&2; exit 2; }
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }

# job_argv I: set JOB_ARGV to job I's complete argument list. A run.py job gets the sweep's
# results folder and the preset's arguments first, so that its own arguments and those after
# `--` (last) win: argparse keeps the last value of a flag. A job of another script gets its
# own arguments only.
job_argv() {
  local k end=$(( SWEEP_START[$1] + SWEEP_LEN[$1] ))
  JOB_ARGV=()
  if [[ "${SWEEP_SCRIPT[$1]}" == run.py ]]; then
    JOB_ARGV=(--results-dir "results/${SWEEP_NAME}" "${SWEEP_PRESET_ARGS[@]}")
  fi
  # Element by element: bash finds the next element of an indexed array at once, while a slice
  # "${a[@]:off:n}" walks from the start: slicing every job would grow with jobs squared.
  for ((k = SWEEP_START[$1]; k < end; k++)); do JOB_ARGV+=("${SWEEP_ARGV[k]}"); done
  if [[ "${SWEEP_SCRIPT[$1]}" == run.py ]]; then JOB_ARGV+=("${SWEEP_EXTRA[@]}"); fi
}

# Print run.sh's header comment (its usage text), then the settings listed at the top of this
# file. run.sh has cd'ed to its own directory.
usage() {
  sed -n '2,/^$/{s/^# \{0,1\}//;p}' "${BASH_SOURCE[-1]##*/}"
  sed -n '/^# Environment (defaults/,/^$/{s/^# \{0,1\}//;p}' "${SWEEP_ENGINE}"
}

#######################################
# Find every job's run directory and state: one `SCRIPT --plan` call per script (run.py, ...).
#######################################
plan_jobs() {
  local i k n="${#SWEEP_START[@]}" dir script
  local -a fields=() mine=()
  local -A seen=() scripts=()
  for ((i = 0; i < n; i++)); do scripts[${SWEEP_SCRIPT[i]}]=1; done
  for script in "${!scripts[@]}"; do
    mine=()
    for ((i = 0; i < n; i++)); do
      if [[ "${SWEEP_SCRIPT[i]}" == "${script}" ]]; then mine+=("${i}"); fi
    done
    [[ -f "${script}" ]] || die "job ${mine[0]}: ${script} not found in ${PWD}"
    mapfile -d '' fields < <(
      for i in "${mine[@]}"; do
        job_argv "${i}"
        printf '%s\0' "${#JOB_ARGV[@]}" "${JOB_ARGV[@]}"
      done | "${PYTHON}" "${script}" --plan
    )
    (( ${#fields[@]} == 3 * ${#mine[@]} )) || die "${script} --plan answered ${#fields[@]}" \
      "fields for ${#mine[@]} jobs (is ${script} current, built on labrun's jobs.py?)"
    for ((k = 0; k < ${#mine[@]}; k++)); do
      i="${mine[k]}"
      SWEEP_STATE[i]="${fields[3 * k]}" SWEEP_DIR[i]="${fields[3 * k + 1]}"
      SWEEP_NOTE[i]="${fields[3 * k + 2]}"
    done
  done
  for ((i = 0; i < n; i++)); do   # in job order: of two equal jobs, the first one runs
    dir="${SWEEP_DIR[i]}" SWEEP_RUN_NAME[i]="${SWEEP_DIR[i]##*/}"
    if [[ "${SWEEP_STATE[i]}" == "invalid" ]]; then
      SWEEP_RUN_NAME[i]="job-${i}"
      SWEEP_NOTE[i]="${SWEEP_SCRIPT[i]} rejected the arguments: ${SWEEP_NOTE[i]}"
    elif [[ "${SWEEP_STATE[i]}" == "waiting" ]]; then
      SWEEP_RUN_NAME[i]="job-${i}"
    elif [[ -n "${seen[${dir}]:-}" ]]; then
      SWEEP_STATE[i]="duplicate" SWEEP_NOTE[i]="same run as job ${seen[${dir}]}"
    else
      seen[${dir}]="${i}"
    fi
  done
}

#######################################
# Jobs whose holder is stopping (a run.py told to stop, e.g. the orphans of a run.sh killed a
# moment ago, checkpointing) are free in a few seconds: plan again every second until they
# are, for at most SWEEP_STOPPING_WAIT_S seconds; any still stopping then runs elsewhere.
#######################################
wait_for_stopping() {
  local i waited=0 stopping
  while true; do
    stopping=0
    for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
      if [[ "${SWEEP_STATE[i]}" == "stopping" ]]; then stopping=$(( stopping + 1 )); fi
    done
    (( stopping && waited < SWEEP_STOPPING_WAIT_S )) || break
    if (( waited == 0 )); then
      log "waiting up to ${SWEEP_STOPPING_WAIT_S}s for ${stopping} job(s) still checkpointing"
    fi
    sleep 1
    waited=$(( waited + 1 ))
    plan_jobs
  done
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    if [[ "${SWEEP_STATE[i]}" == "stopping" ]]; then SWEEP_STATE[i]="running"; fi
  done
}

# True if job I is to be run (or submitted).
is_runnable() {
  case "${SWEEP_STATE[$1]}" in
    pending | interrupted | failed) return 0 ;;
    *) return 1 ;;
  esac
}

# Print one line per job with its state, then the counts.
print_plan() {
  local i state
  local -A count=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    job_argv "${i}"
    state="${SWEEP_STATE[i]}"
    printf '%-11s %s' "${state}" "${SWEEP_RUN_NAME[i]}"
    if [[ -n "${SWEEP_NOTE[i]}" ]]; then printf '  (%s)' "${SWEEP_NOTE[i]}"; fi
    printf '\n            %s %s\n' "${SWEEP_SCRIPT[i]}" "${JOB_ARGV[*]}"
    count[${state}]=$(( ${count[${state}]:-0} + 1 ))
  done
  printf '%d jobs: %d done, %d pending, %d interrupted, %d failed' "${#SWEEP_START[@]}" \
    "${count[done]:-0}" "${count[pending]:-0}" "${count[interrupted]:-0}" "${count[failed]:-0}"
  for state in running stopping queued waiting invalid refused duplicate; do
    if (( ${count[${state}]:-0} )); then
      printf ', %d %s' "${count[${state}]}" "${state/running/running elsewhere}"
    fi
  done
  printf '\n'
}

# Create the MLflow database and experiment once, before a Slurm array's tasks start in
# parallel: they log to MLflow live. (A local sweep's jobs do not touch MLflow: its follower
# creates the database, under tracking.py's schema lock, while the first jobs train.)
# Arguments: index of a job whose arguments (e.g. --experiment) to use.
init_tracking() {
  job_argv "$1"
  "${PYTHON}" "${SWEEP_SCRIPT[$1]}" "${JOB_ARGV[@]}" --init-tracking >/dev/null \
    || die "could not create the MLflow database (${SWEEP_SCRIPT[$1]} --init-tracking failed)"
}

# ---- MLflow follower (helper "mlflow"; labrun/tracking.py's `follow`) ----------------------
# Jobs do not talk to MLflow (LAB_TRACKING_FOLLOWER=1): one follower per sweep mirrors each run
# directory into MLflow once its job has ended, samples system metrics once for the machine, and
# mirrors what is left when its stdin closes (stop_follower). Killed with run.sh, it loses
# nothing: the next sweep's follower, or `python -m labrun.tracking sync`, mirrors the rest.
# Its stdin is a pipe whose write end jobs inherit too: it closes once every job is gone.
start_follower() {
  export LAB_TRACKING_FOLLOWER=1
  exec {SWEEP_FOLLOWER_FD}> >(exec "${SWEEP_GUARD[@]}" "${PYTHON}" -m labrun.tracking follow \
    "results/${SWEEP_NAME}" >>"${LOG_DIR}/mlflow-follower.out" 2>&1)
  SWEEP_FOLLOWER_PID=$!
}

stop_follower() {
  exec {SWEEP_FOLLOWER_FD}>&-
  wait "${SWEEP_FOLLOWER_PID}" \
    || err "MLflow follower failed (${LOG_DIR}/mlflow-follower.out); python -m labrun.tracking" \
      "sync results/${SWEEP_NAME} mirrors what it missed"
}
# ---- end of the MLflow follower -------------------------------------------------------------

# The devices jobs may use: CUDA_VISIBLE_DEVICES's entries when it is set (jobs stay inside it),
# else what nvidia-smi lists; printed space-separated.
visible_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    echo "${CUDA_VISIBLE_DEVICES//,/ }"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ' || true
  fi
}

#######################################
# Set SWEEP_GPUS to the GPUs of the sweep: GPUS, checked against the visible devices
# (`error: GPUS: ...` and exit 2 otherwise), else every visible one. size_slots makes the slots.
#######################################
choose_gpus() {
  local dev
  local -a gpus=() visible=() listed=()
  read -ra visible <<<"$(visible_gpus)"
  if [[ -n "${GPUS+set}" ]]; then
    read -ra gpus <<<"${GPUS//,/ }"
    for dev in "${gpus[@]}"; do
      if [[ ! "${dev}" =~ ^([0-9]+|(GPU|MIG)-[A-Za-z0-9/-]+)$ ]]; then
        echo "error: GPUS: '${GPUS}' is not a list of GPU indices or UUIDs," \
          "e.g. GPUS=\"0 1\" or GPUS=0,2 (empty: CPU only)" >&2
        exit 2
      fi
      if [[ " ${visible[*]} " != *" ${dev} "* ]]; then
        echo "error: GPUS: GPU ${dev} does not exist (visible: ${visible[*]:-none})" >&2
        exit 2
      fi
      if [[ " ${listed[*]} " == *" ${dev} "* ]]; then
        echo "error: GPUS: GPU ${dev} is listed twice (JOBS_PER_GPU shares a GPU)" >&2
        exit 2
      fi
      listed+=("${dev}")
    done
  else
    gpus=("${visible[@]}")
  fi
  SWEEP_GPUS=("${gpus[@]}")
}

# The cores this process may use: its CPU affinity (taskset, a Slurm allocation), capped by a
# cgroup v2 CPU quota (a container's --cpus), which nproc does not see.
cpu_cores() {
  local cores quota period
  # nproc also obeys OMP_NUM_THREADS and OMP_THREAD_LIMIT: a cluster's OMP_NUM_THREADS=1 made
  # one slot of a 64-core node. Asked without them, it counts the affinity mask alone.
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null) || cores=1
  if read -r quota period 2>/dev/null <"${SWEEP_CGROUP}/cpu.max" \
    && [[ "${quota}" =~ ^[0-9]+$ && "${period}" =~ ^[1-9][0-9]*$ ]]; then
    quota=$(( (quota + period - 1) / period ))
    if (( quota < cores )); then cores="${quota}"; fi
  fi
  echo "$(( cores > 0 ? cores : 1 ))"
}

# MiB new processes can still use: MemAvailable, capped by a cgroup v2 memory limit; empty when
# /proc/meminfo is missing (not Linux).
available_mib() {
  local kib limit used
  kib=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo 2>/dev/null) || true
  [[ "${kib}" =~ ^[0-9]+$ ]] || return 0
  if read -r limit 2>/dev/null <"${SWEEP_CGROUP}/memory.max" && [[ "${limit}" =~ ^[0-9]+$ ]] \
    && read -r used 2>/dev/null <"${SWEEP_CGROUP}/memory.current" && [[ "${used}" =~ ^[0-9]+$ ]] \
    && (( (limit - used) / 1024 < kib )); then
    kib=$(( (limit - used) / 1024 ))
  fi
  echo "$(( kib / 1024 ))"
}

#######################################
# Size the slots once the plan says how many jobs the sweep has: SLOTS (one entry per slot: its
# GPU, or "" on the CPU), each job's share of the cores (SWEEP_JOB_CPUS, SWEEP_THREADS) and
# SWEEP_SLOT_REASON. The share follows from all the sweep's jobs, never from the jobs left, so a
# job that a re-run of an interrupted sweep starts computes with the threads it would have had
# in the uninterrupted sweep (the numbers of a CPU job depend on its thread count).
#######################################
size_slots() {
  local cores i jobs=0 left=0
  cores=$(cpu_cores)
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    case "${SWEEP_STATE[i]}" in duplicate | invalid) continue ;; esac
    jobs=$(( jobs + 1 ))
    if is_runnable "${i}"; then left=$(( left + 1 )); fi
  done
  if (( ${#SWEEP_GPUS[@]} )); then
    gpu_slots "${cores}" "${jobs}"
  else
    cpu_slots "${cores}" "${jobs}" "${left}"
  fi
}

#######################################
# Without a GPU: one "" slot per CPU job. CPU_JOBS=auto runs one job per core (the demo's sweep
# on 2 cores: 78 s, against 94 s for one job at a time with both cores' threads; the lab
# template's benchmarks/RESULTS.md, "Jobs at a time"), but no more than the sweep has jobs (a
# short sweep on a big machine gets more threads per job instead) or than the cores hold at a
# thread count the user set. Each job's share of the cores follows from that alone: the free
# memory (CPU_JOB_MEM_GB per job) and the jobs left only take slots away, so that the same job
# computes with the same threads whatever else the machine runs.
# Arguments: cores, jobs of the sweep, jobs left to run.
#######################################
cpu_slots() {
  local cores="$1" jobs="$2" left="$3" width mib reason i slots
  if [[ "${CPU_JOBS}" == auto ]]; then
    width="${cores}" reason="${cores} core(s)"
    if (( jobs < width )); then width="${jobs}" reason="${jobs} job(s)"; fi
    if [[ "${OMP_NUM_THREADS:-}" =~ ^[1-9][0-9]*$ ]] && (( cores / OMP_NUM_THREADS < width )); then
      width=$(( cores / OMP_NUM_THREADS )) reason="${cores} core(s) / OMP_NUM_THREADS"
    fi
    if (( width < 1 )); then width=1; fi
    reason="CPU_JOBS=auto: ${reason}"
  else
    width="${CPU_JOBS}" reason="CPU_JOBS=${CPU_JOBS}"
  fi
  # Never more threads than cores: oversubscribed, the same sweep took 3.8x as long.
  SWEEP_JOB_CPUS=$(( cores / width > 0 ? cores / width : 1 ))
  SWEEP_THREADS="${OMP_NUM_THREADS:-${SWEEP_JOB_CPUS}}"
  slots="${width}"
  if [[ "${CPU_JOBS}" == auto ]]; then
    mib=$(available_mib)
    if [[ -n "${mib}" ]] && (( mib / (CPU_JOB_MEM_GB * 1024) < slots )); then
      slots=$(( mib / (CPU_JOB_MEM_GB * 1024) > 0 ? mib / (CPU_JOB_MEM_GB * 1024) : 1 ))
      reason+="; $(( mib / 1024 )) GiB free / CPU_JOB_MEM_GB=${CPU_JOB_MEM_GB}"
    fi
    if (( left > 0 && left < slots )); then slots="${left}" reason+="; ${left} job(s) left"; fi
  fi
  SLOTS=()
  for ((i = 0; i < slots; i++)); do SLOTS+=(""); done
  SWEEP_SLOT_REASON="${reason}"
}

#######################################
# Slots on the GPUs: JOBS_PER_GPU per GPU, or for auto one per 2 of the GPU's cores (a job's
# main process and one loader worker) and per job, as many of those as the GPU's free memory
# holds (gpu_fit). Each slot gets an equal share of the cores.
# Arguments: cores, jobs of the sweep.
#######################################
gpu_slots() {
  local cores="$1" jobs="$2" n_gpus="${#SWEEP_GPUS[@]}" width why per_gpu
  if [[ "${JOBS_PER_GPU}" == auto ]]; then
    width=$(( cores / n_gpus / 2 )) why="${cores} core(s)"
    per_gpu=$(( (jobs + n_gpus - 1) / n_gpus ))
    if (( per_gpu < width )); then width="${per_gpu}" why="${jobs} job(s)"; fi
    if (( width < 1 )); then width=1; fi
    SWEEP_GPU_WHY="JOBS_PER_GPU=auto: ${why} -> ${width} per GPU"
  else
    width="${JOBS_PER_GPU}" SWEEP_GPU_WHY="JOBS_PER_GPU=${JOBS_PER_GPU}"
  fi
  SWEEP_JOB_CPUS=$(( cores / (n_gpus * width) > 0 ? cores / (n_gpus * width) : 1 ))
  SWEEP_THREADS="${OMP_NUM_THREADS:-${SWEEP_JOB_CPUS}}"
  SWEEP_GPU_WIDTH="${width}" SLOTS=()
  if [[ "${JOBS_PER_GPU}" == auto ]] && (( width > 1 )); then
    gpu_fit
  else
    add_gpu_slots "${width}"
    SWEEP_SLOT_REASON="${SWEEP_GPU_WHY}${SWEEP_MPS}"
  fi
}

# JOBS_PER_GPU=auto, after a job ended: once a finished job has recorded its peak memory, open
# the slots its memory leaves room for, and say so.
grow_gpu_slots() {
  gpu_fit
  if (( ! SWEEP_GPU_MEASURE )); then log "slots now: $(describe_slots)"; fi
}

# add_gpu_slots N: grow SLOTS (and SLOT_BUSY, in the queue) to N slots on each GPU.
add_gpu_slots() {
  local dev k have
  for dev in "${SWEEP_GPUS[@]}"; do
    have=0
    for k in "${SLOTS[@]}"; do [[ "${k}" != "${dev}" ]] || have=$(( have + 1 )); done
    for ((k = have; k < $1; k++)); do
      SLOTS+=("${dev}")
      SLOT_BUSY[${#SLOTS[@]} - 1]=0
    done
  done
}

# The largest peak GPU memory, in MiB, that a finished job of the sweep recorded (metrics.json:
# peak_mem_bytes on a CUDA device); empty when none has.
measured_peak_mib() {
  local i file line peak=0
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    file="${SWEEP_DIR[i]}/metrics.json"
    [[ -n "${SWEEP_DIR[i]}" && -f "${file}" ]] || continue
    grep -q '"device": *"cuda' "${file}" || continue
    line="$(grep -m1 -o '"peak_mem_bytes": *[0-9]*' "${file}")" || continue
    line="${line##*[ :]}"
    if (( line > peak )); then peak="${line}"; fi
  done
  if (( peak > 0 )); then echo $(( (peak + 1048575) / 1048576 )); fi
}

# The least free memory, in MiB, of the sweep's GPUs, from one nvidia-smi query; empty if unknown.
gpu_free_mib() {
  local index uuid free least=""
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  while IFS=', ' read -r index uuid free; do
    [[ "${free}" =~ ^[0-9]+$ ]] || continue
    [[ " ${SWEEP_GPUS[*]} " == *" ${index} "* || " ${SWEEP_GPUS[*]} " == *" ${uuid} "* ]] \
      || continue
    if [[ -z "${least}" ]] || (( free < least )); then least="${free}"; fi
  done < <(nvidia-smi --query-gpu=index,uuid,memory.free --format=csv,noheader,nounits \
    2>/dev/null || true)
  echo "${least}"
}

#######################################
# JOBS_PER_GPU=auto: open as many of the SWEEP_GPU_WIDTH slots per GPU as 90 % of the GPU's
# free memory holds at 1.25 x the largest peak a job of the sweep measured plus
# SWEEP_CUDA_CONTEXT_MIB; until a job has measured it, one per GPU.
#######################################
gpu_fit() {
  local peak free fit
  peak="$(measured_peak_mib)"
  if [[ -z "${peak}" ]]; then
    SWEEP_GPU_MEASURE=1
    SWEEP_SLOT_REASON="${SWEEP_GPU_WHY}, 1 until a job has measured its peak memory${SWEEP_MPS}"
    add_gpu_slots 1
    return 0
  fi
  SWEEP_GPU_MEASURE=0
  free="$(gpu_free_mib)"
  if [[ -z "${free}" ]]; then
    SWEEP_SLOT_REASON="${SWEEP_GPU_WHY}, 1: free GPU memory unknown (no nvidia-smi)${SWEEP_MPS}"
    add_gpu_slots 1
    return 0
  fi
  fit=$(( free * 9 / 10 / (peak * 5 / 4 + SWEEP_CUDA_CONTEXT_MIB) ))
  if (( fit < 1 )); then fit=1; fi
  if (( fit > SWEEP_GPU_WIDTH )); then fit="${SWEEP_GPU_WIDTH}"; fi
  SWEEP_SLOT_REASON="${SWEEP_GPU_WHY}, ${fit} in 90 % of ${free} MiB free at 1.25 x a measured"
  SWEEP_SLOT_REASON+=" peak of ${peak} MiB + ${SWEEP_CUDA_CONTEXT_MIB} MiB context per job"
  SWEEP_SLOT_REASON+="${SWEEP_MPS}"
  add_gpu_slots "${fit}"
}

# "2 CPU slot(s), 1 thread(s) each (CPU_JOBS=auto: 2 core(s))" or "4 slot(s) on GPU(s) 0 0 1 1,
# 4 thread(s) each (JOBS_PER_GPU=2; ...)".
describe_slots() {
  if [[ -z "${SLOTS[0]}" ]]; then
    printf '%d CPU slot(s), %s thread(s) each (%s)' "${#SLOTS[@]}" "${SWEEP_THREADS}" \
      "${SWEEP_SLOT_REASON}"
  else
    printf '%d slot(s) on GPU(s) %s, %s thread(s) each (%s)' "${#SLOTS[@]}" "${SLOTS[*]}" \
      "${SWEEP_THREADS}" "${SWEEP_SLOT_REASON}"
  fi
}

#######################################
# Signal handler: the first signal asks every running job to checkpoint and stop (SIGTERM to
# the job's main process); every later one kills their process groups outright. Either way the
# queue loop goes on to reap them, mark them and print the summary.
#######################################
on_signal() {
  local pid
  # No bare `return` here: in a trap it returns the status of the command the signal
  # interrupted (wait: 128+n), and under `set -e` that non-zero status ends run.sh at once,
  # with no summary (the "second signal exits 143" bug).
  if [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then
    err "SIG$1 again: killing all jobs"
    for pid in "${!SWEEP_RUNNING[@]}"; do kill -KILL -- "-${pid}" 2>/dev/null || true; done
  else
    SWEEP_STOP_SIGNAL="$1"
    # No more status lines; and `wait -n` must not sit on the timer once the jobs are gone.
    if [[ -n "${SWEEP_TICKER}" ]]; then kill "${SWEEP_TICKER}" 2>/dev/null || true; fi
    err "got SIG$1: stopping ${#SWEEP_RUNNING[@]} running job(s) (they checkpoint; again to kill)"
    for pid in "${!SWEEP_RUNNING[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; done
  fi
}

# recorded_threads DIR: "THREADS CPUS" that the run in DIR recorded when it started (run.py's
# config.json: torch_threads, job_cpus); nothing for a run that never started.
recorded_threads() {
  local line threads cpus=""
  line="$(grep -m1 -o '"torch_threads": *[0-9]*' "$1/config.json" 2>/dev/null)" || return 0
  threads="${line##*[ :]}"
  if line="$(grep -m1 -o '"job_cpus": *[0-9]*' "$1/config.json")"; then cpus="${line##*[ :]}"; fi
  echo "${threads} ${cpus:-${threads}}"
}

# launch I SLOT: start job I in the background, in a process group of its own.
launch() {
  local i="$1" slot="$2" dev="${SLOTS[$2]}" pid threads="" cpus="" how=""
  local log_file="${LOG_DIR}/${SWEEP_RUN_NAME[$1]}.log"
  job_argv "${i}"
  # A job that started before (interrupted, failed) keeps its threads: its numbers depend on them.
  read -r threads cpus <<<"$(recorded_threads "${SWEEP_DIR[i]}")"
  if [[ -n "${threads}" ]]; then
    how=", as when it started"
  else
    threads="${SWEEP_THREADS}" cpus="${SWEEP_JOB_CPUS}"
  fi
  printf '=== %(%F %T)T  CUDA_VISIBLE_DEVICES=%s OMP_NUM_THREADS=%s LAB_JOB_CPUS=%s  %s %s %s\n' \
    -1 "${dev}" "${threads}" "${cpus}" "${PYTHON}" "${SWEEP_SCRIPT[i]}" "${JOB_ARGV[*]}" \
    >>"${log_file}"
  # setsid: its own process group (pgid = pid), so stopping it reaches its children too, and
  # Ctrl-C in the terminal reaches run.sh only, which then stops every job the same way.
  if (( SWEEP_HAVE_SETSID )); then
    CUDA_VISIBLE_DEVICES="${dev}" OMP_NUM_THREADS="${threads}" LAB_JOB_CPUS="${cpus}" \
      setsid "${SWEEP_GUARD[@]}" "${PYTHON}" "${SWEEP_SCRIPT[i]}" "${JOB_ARGV[@]}" \
      </dev/null >>"${log_file}" 2>&1 &
  else   # no setsid (macOS): job control gives the job its own process group
    set -m
    CUDA_VISIBLE_DEVICES="${dev}" OMP_NUM_THREADS="${threads}" LAB_JOB_CPUS="${cpus}" \
      "${PYTHON}" "${SWEEP_SCRIPT[i]}" "${JOB_ARGV[@]}" </dev/null >>"${log_file}" 2>&1 &
    set +m
  fi
  pid=$!
  SWEEP_RUNNING[${pid}]="${i}" SWEEP_SLOT_OF[${pid}]="${slot}" SWEEP_T0[${pid}]="${EPOCHSECONDS}"
  SWEEP_GROUPS+=("${pid}")
  SLOT_BUSY[slot]=1
  log "start    ${SWEEP_RUN_NAME[i]}  (${dev:+GPU }${dev:-CPU}, slot ${slot}," \
    "${threads} thread(s)${how})"
  # A signal that arrived while this job was being started missed it.
  if [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then kill -TERM "${pid}" 2>/dev/null || true; fi
}

# A job killed before it could write its own status leaves "running": say what happened.
mark_interrupted() {
  local dir="$1" status=""
  [[ -n "${dir}" && -f "${dir}/status" ]] || return 0
  read -r status <"${dir}/status" || true
  if [[ "${status}" == "running" ]]; then
    if ! { printf 'interrupted\n' >"${dir}/.status.sweep.tmp" \
      && mv -f "${dir}/.status.sweep.tmp" "${dir}/status"; }; then
      err "could not mark ${dir} interrupted"
    fi
  fi
}

# finished_elsewhere DIR PID: true if job PID found its run already finished by another process
# (another run.sh, a Slurm task) instead of training it. A job writes its pid into .lock when it
# claims the run; if that is still PID's claim and metrics.json is older, PID only found it done.
finished_elsewhere() {
  local dir="$1" pid="$2" holder=""
  [[ -f "${dir}/.lock" ]] || return 1
  read -r holder <"${dir}/.lock" || true
  [[ "${holder}" == "pid=${pid} "* && ! "${dir}/metrics.json" -nt "${dir}/.lock" ]]
}

# finish PID STATUS: record how job PID ended and free its slot.
finish() {
  local pid="$1" rc="$2" i="${SWEEP_RUNNING[$1]}" took
  took=$(( EPOCHSECONDS - SWEEP_T0[$1] ))
  local slot="${SWEEP_SLOT_OF[${pid}]}" name="${SWEEP_RUN_NAME[${SWEEP_RUNNING[$1]}]}"
  unset "SWEEP_RUNNING[${pid}]"
  SLOT_BUSY[slot]=0
  # Children the job left behind (data-loader workers, ...) go with it.
  kill -TERM -- "-${pid}" 2>/dev/null || true
  if (( rc == 0 )) && [[ -f "${SWEEP_DIR[i]}/metrics.json" ]]; then
    if finished_elsewhere "${SWEEP_DIR[i]}" "${pid}"; then
      SWEEP_RESULT[i]="skipped"
      log "skipped  ${name}  (finished meanwhile by another process)"
    else
      SWEEP_RESULT[i]="done"
      SWEEP_TOOK+=("${took}")
      log "done     ${name}  (${took}s)"
    fi
  elif (( rc == SWEEP_EXIT_BUSY )); then
    SWEEP_RESULT[i]="elsewhere"
    log "skipped  ${name}  (running elsewhere: another process holds it; see its log)"
  elif (( rc == SWEEP_EXIT_INTERRUPTED )) || [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then
    # Stopped by us: exit 75, or killed by the signal before its handlers were up.
    SWEEP_RESULT[i]="interrupted"
    mark_interrupted "${SWEEP_DIR[i]}"
    log "stopped  ${name}  (exit ${rc}; re-run run.sh to resume)"
  else
    SWEEP_RESULT[i]="failed"
    if (( rc == 0 )); then rc="0 but no metrics.json"; fi
    log "FAILED   ${name}  (exit ${rc}, ${took}s)  log: ${LOG_DIR}/${name}.log"
  fi
}

#######################################
# Finish every job whose process is gone but that `wait -n` did not report: a child that ends
# while a trap interrupts `wait -n` can be reaped without ever being returned by it.
#######################################
reap_lost() {
  local pid rc
  for pid in "${!SWEEP_RUNNING[@]}"; do
    kill -0 "${pid}" 2>/dev/null && continue
    rc=0
    wait "${pid}" 2>/dev/null || rc=$?
    if (( rc == 127 )); then   # its status is lost too: read what the job wrote
      local dir="${SWEEP_DIR[${SWEEP_RUNNING[${pid}]}]}" status=""
      [[ -f "${dir}/status" ]] && read -r status <"${dir}/status"
      case "${status}" in
        finished) rc=0 ;;
        interrupted) rc="${SWEEP_EXIT_INTERRUPTED}" ;;
      esac
    fi
    finish "${pid}" "${rc}"
  done
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

# "e3/20" from a job's history.csv (epochs written) and config.json (epochs planned).
job_progress() {
  local dir="$1" rows=0 total="?" line
  if [[ -f "${dir}/history.csv" ]]; then
    rows=$(( $(wc -l <"${dir}/history.csv") - 1 ))
    (( rows >= 0 )) || rows=0
  fi
  if [[ -f "${dir}/config.json" ]]; then
    line="$(grep -m1 -o '"epochs": *[0-9]*' "${dir}/config.json" || true)"
    total="${line##*[ :]}"
  fi
  printf 'epoch %s/%s' "${rows}" "${total:-?}"
}

#######################################
# One line: jobs done / running / pending, each running job's epoch, an ETA from the jobs that
# finished so far in this sweep (mean duration x jobs left / slots).
# Arguments: number of jobs still queued.
#######################################
print_status() {
  local left="$1" pid i n_done=0 total=0 t eta="after the first job finishes"
  local -a running=()
  for i in "${SWEEP_RESULT[@]}"; do
    if [[ "${i}" == "done" || "${i}" == "skipped" ]]; then n_done=$(( n_done + 1 )); fi
  done
  for pid in "${!SWEEP_RUNNING[@]}"; do
    i="${SWEEP_RUNNING[${pid}]}"
    running+=("${SWEEP_RUN_NAME[i]} $(job_progress "${SWEEP_DIR[i]}")")
  done
  if (( ${#SWEEP_TOOK[@]} > 0 )); then
    for t in "${SWEEP_TOOK[@]}"; do total=$(( total + t )); done
    t=$(( total * (left + ${#SWEEP_RUNNING[@]}) / ${#SWEEP_TOOK[@]} / ${#SLOTS[@]} ))
    eta="~$(( t / 3600 ))h$(( t % 3600 / 60 ))m"
  fi
  log "sweep: ${n_done} done, ${#SWEEP_RUNNING[@]} running, ${left} pending; ETA ${eta}"
  for i in "${running[@]}"; do log "  running  ${i}"; done
}

# Start the timer child whose end wakes `wait -n` for the next status line.
start_ticker() {
  SWEEP_TICKER=""
  (( SWEEP_STATUS_SECS > 0 )) || return 0
  # Its own output closed: an orphaned timer must not hold run.sh's stdout pipe open.
  "${SWEEP_GUARD[@]}" sleep "${SWEEP_STATUS_SECS}" </dev/null >/dev/null 2>&1 &
  SWEEP_TICKER=$!
}

#######################################
# Plan again (after a job ended, or before the queue ends) and queue the jobs that can run now:
# those waiting for inputs (runs of this sweep) that have finished meanwhile, and, once each,
# those running elsewhere whose holder has let go of the claim since (it stopped: exit 75, or
# died); one finished elsewhere meanwhile is skipped. Appends to run_queue's local `queue`.
#######################################
replan() {
  local i
  plan_jobs
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    case "${SWEEP_RESULT[i]:-}" in
      waiting)
        if is_runnable "${i}"; then
          SWEEP_RESULT[i]="" queue+=("${i}")
          log "ready    ${SWEEP_RUN_NAME[i]}  (its inputs have finished)"
        fi
        ;;
      elsewhere)
        if [[ "${SWEEP_STATE[i]}" == "done" ]]; then
          SWEEP_RESULT[i]="skipped"
          log "skipped  ${SWEEP_RUN_NAME[i]}  (finished meanwhile by another process)"
        elif is_runnable "${i}" && [[ -z "${SWEEP_TAKEN[i]:-}" ]]; then
          SWEEP_RESULT[i]="" SWEEP_TAKEN[i]=1 queue+=("${i}")
          log "taking   ${SWEEP_RUN_NAME[i]}  (its holder let go: ${SWEEP_STATE[i]})"
        fi
        ;;
    esac
  done
}

# True if a job waits for inputs or runs elsewhere: planning again may free it.
others_pending() {
  [[ " ${SWEEP_RESULT[*]} " == *" waiting "* || " ${SWEEP_RESULT[*]} " == *" elsewhere "* ]]
}

#######################################
# Run every pending job through the dynamic queue (and each waiting job once its inputs are
# done); print the summary.
# Returns: 0 if every job is done, 1 otherwise.
#######################################
run_queue() {
  local i s pid rc next=0 planned=0
  local -a queue=()
  declare -gA SWEEP_RUNNING=() SWEEP_SLOT_OF=() SWEEP_T0=()
  declare -ga SWEEP_GROUPS=() SLOT_BUSY=() SWEEP_RESULT=() SWEEP_TOOK=() SWEEP_TAKEN=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    if is_runnable "${i}"; then queue+=("${i}"); continue; fi
    case "${SWEEP_STATE[i]}" in
      done) SWEEP_RESULT[i]="skipped" ;;
      duplicate) SWEEP_RESULT[i]="duplicate" ;;
      running | stopping) SWEEP_RESULT[i]="elsewhere" ;;
      waiting) SWEEP_RESULT[i]="waiting" ;;
      *) SWEEP_RESULT[i]="failed" ;;
    esac
  done
  for s in "${!SLOTS[@]}"; do SLOT_BUSY[s]=0; done
  # The jobs that share this node's memory: run.py's --data-mode auto divides its budget by it.
  # (JOBS_PER_GPU=auto may open more slots once a job has measured its memory: count them all.)
  s="${#SLOTS[@]}"
  if (( ${#SWEEP_GPUS[@]} )); then s=$(( ${#SWEEP_GPUS[@]} * SWEEP_GPU_WIDTH )); fi
  export LAB_JOBS_PER_NODE="${LAB_JOBS_PER_NODE:-${s}}"
  mkdir -p "${LOG_DIR}"
  start_follower   # MLflow follower (helper "mlflow")
  # Installed for the rest of run.sh: however many signals come, the summary is printed.
  trap 'on_signal INT || true' INT
  trap 'on_signal TERM || true' TERM
  trap 'on_signal HUP || true' HUP
  # Status lines: every STATUS_EVERY s on a terminal, every STATUS_EVERY_LOG s into a log file.
  SWEEP_STATUS_SECS="${STATUS_EVERY_LOG}"
  if [[ -t 1 ]]; then SWEEP_STATUS_SECS="${STATUS_EVERY}"; fi
  if (( ${#queue[@]} > 0 )); then
    log "${#queue[@]} job(s) to run, $(( ${#SWEEP_START[@]} - ${#queue[@]} )) done or skipped;" \
      "$(describe_slots); logs in ${LOG_DIR}/"
    start_ticker
  fi
  while true; do
    if [[ -z "${SWEEP_STOP_SIGNAL}" ]]; then
      for s in "${!SLOTS[@]}"; do
        # Jobs finished meanwhile by another process (planned long ago) need no interpreter.
        while (( next < ${#queue[@]} )) && [[ -f "${SWEEP_DIR[${queue[next]}]}/metrics.json" ]]; do
          SWEEP_RESULT[queue[next]]="skipped"
          log "skipped  ${SWEEP_RUN_NAME[${queue[next]}]}  (finished meanwhile by another process)"
          next=$(( next + 1 ))
        done
        if (( SLOT_BUSY[s] == 0 && next < ${#queue[@]} )); then
          launch "${queue[next]}" "${s}"
          next=$(( next + 1 )) planned=0
        fi
      done
    fi
    if (( ${#SWEEP_RUNNING[@]} == 0 )); then
      # Nothing runs here any more: one last look at the jobs held elsewhere before the end.
      if [[ -z "${SWEEP_STOP_SIGNAL}" ]] && (( ! planned )) && others_pending; then
        replan
        planned=1
        if (( next < ${#queue[@]} )); then continue; fi
      fi
      break
    fi
    pid="" rc=0
    wait -n -p pid || rc=$?
    if [[ -n "${pid:-}" && "${pid}" == "${SWEEP_TICKER}" ]]; then
      if [[ -z "${SWEEP_STOP_SIGNAL}" ]]; then
        print_status $(( ${#queue[@]} - next ))
        start_ticker
      fi
    # No pid: a trapped signal interrupted the wait (or it was not one of ours).
    elif [[ -n "${pid:-}" && -n "${SWEEP_RUNNING[${pid}]+set}" ]]; then
      finish "${pid}" "${rc}"
      if [[ -z "${SWEEP_STOP_SIGNAL}" ]]; then
        # JOBS_PER_GPU=auto: the first job to finish has measured its peak memory.
        if (( SWEEP_GPU_MEASURE )); then grow_gpu_slots; fi
        if others_pending; then replan; planned=1; fi
      fi
    fi
    reap_lost
  done
  if [[ -n "${SWEEP_TICKER}" ]]; then kill "${SWEEP_TICKER}" 2>/dev/null || true; fi
  reap_groups
  stop_follower   # MLflow follower (helper "mlflow"): mirrors what is left, then ends
  summarize
}

# Print the counts and the failures; returns 0 iff every job is done.
summarize() {
  local i n_done=0 n_skip=0 n_fail=0 n_int=0 n_left=0 n_dup=0 n_else=0 n_wait=0
  local -a failures=()
  # Jobs another process was running may have finished meanwhile: ask once more (one call).
  if [[ " ${SWEEP_RESULT[*]} " == *" elsewhere "* ]]; then
    plan_jobs
    for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
      if [[ "${SWEEP_RESULT[i]:-}" == "elsewhere" ]]; then
        case "${SWEEP_STATE[i]}" in
          done) SWEEP_RESULT[i]="skipped" ;;
          interrupted) SWEEP_RESULT[i]="interrupted" ;;   # its holder stopped: re-run resumes it
          pending | failed) SWEEP_RESULT[i]="" ;;         # not started here
        esac
      fi
    done
  fi
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    case "${SWEEP_RESULT[i]:-}" in
      done) n_done=$(( n_done + 1 )) ;;
      skipped) n_skip=$(( n_skip + 1 )) ;;
      duplicate) n_dup=$(( n_dup + 1 )) ;;
      interrupted) n_int=$(( n_int + 1 )) ;;
      elsewhere) n_else=$(( n_else + 1 )) ;;
      waiting) n_wait=$(( n_wait + 1 )) ;;
      failed)
        n_fail=$(( n_fail + 1 ))
        if [[ "${SWEEP_STATE[i]}" == "invalid" || "${SWEEP_STATE[i]}" == "refused" ]]; then
          job_argv "${i}"
          failures+=("job ${i} (${SWEEP_SCRIPT[i]} ${JOB_ARGV[*]}): ${SWEEP_NOTE[i]}")
        else
          failures+=("${SWEEP_RUN_NAME[i]}  log: ${LOG_DIR}/${SWEEP_RUN_NAME[i]}.log")
        fi
        ;;
      *) n_left=$(( n_left + 1 )) ;;
    esac
  done
  echo "---"
  printf 'sweep summary: %d done (%d ran now, %d skipped: already done), %d failed, ' \
    "$(( n_done + n_skip ))" "${n_done}" "${n_skip}" "${n_fail}"
  printf '%d interrupted, %d not started' "${n_int}" "${n_left}"
  if (( n_else )); then printf ', %d running elsewhere' "${n_else}"; fi
  if (( n_wait )); then printf ', %d waiting for unfinished inputs' "${n_wait}"; fi
  if (( n_dup )); then printf ' (%d duplicate job(s) ignored)' "${n_dup}"; fi
  printf '\n'
  for i in "${failures[@]}"; do echo "  failed: ${i}"; done
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    if [[ "${SWEEP_RESULT[i]:-}" == "waiting" ]]; then
      echo "  waiting: job ${i}: ${SWEEP_NOTE[i]}"
    fi
  done
  if (( n_int + n_left + n_else + n_wait )); then
    echo "re-run run.sh to finish the rest (interrupted jobs resume from their checkpoints)."
  fi
  (( n_fail + n_int + n_left + n_else + n_wait == 0 ))
}

#######################################
# Mark jobs still queued or running in an earlier array of this project as "queued", so that
# submitting again does not run them twice. Earlier submissions are SLURM_LOG_DIR/*/, each with
# job_id (the array) and tasks.tsv (task id TAB run directory).
#######################################
mark_queued_in_slurm() {
  local f array task state dir i
  local -A submit_dir_of=() queued=()
  command -v squeue >/dev/null 2>&1 || return 0
  for f in "${SLURM_LOG_DIR}"/*/job_id; do
    [[ -f "${f}" ]] || continue
    read -r array <"${f}" || continue
    submit_dir_of[${array}]="${f%/job_id}"
  done
  (( ${#submit_dir_of[@]} > 0 )) || return 0
  # One line per array task still in the queue (-r: pending tasks one by one): ARRAY TASK STATE.
  while read -r array task state; do
    f="${submit_dir_of[${array}]:-}/tasks.tsv"
    [[ -n "${submit_dir_of[${array}]:-}" && -f "${f}" && "${task}" =~ ^[0-9]+$ ]] || continue
    dir="$(awk -F'\t' -v t="${task}" '$1 == t { print $2; exit }' "${f}")"
    [[ -n "${dir}" ]] && queued[${dir}]="${array}_${task} ${state}"
  done < <(squeue -h -r -u "$(id -un)" -o '%F %K %T' 2>/dev/null || true)
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    if is_runnable "${i}" && [[ -n "${queued[${SWEEP_DIR[i]}]:-}" ]]; then
      SWEEP_STATE[i]="queued"
      SWEEP_NOTE[i]="Slurm task ${queued[${SWEEP_DIR[i]}]}, from an earlier run.sh --slurm"
    fi
  done
}

#######################################
# Submit the pending jobs as one Slurm job array (slurm_task.sh runs one task).
#######################################
submit_slurm() {
  local dry_run="$1" i n=0 dir python jobid
  local -a pending=() cmd=() extra=()
  for ((i = 0; i < ${#SWEEP_START[@]}; i++)); do
    if is_runnable "${i}"; then pending+=("${i}"); fi
    if [[ "${SWEEP_STATE[i]}" == "invalid" ]]; then err "not submitted, ${SWEEP_NOTE[i]}"; fi
    if [[ "${SWEEP_STATE[i]}" == "refused" ]]; then
      err "not submitted, ${SWEEP_RUN_NAME[i]}: ${SWEEP_NOTE[i]}"
    fi
  done
  if (( ${#pending[@]} == 0 )); then
    echo "nothing to submit: all ${#SWEEP_START[@]} jobs are done, queued or running."
    return 0
  fi
  # One job on several GPUs (torchrun): GPUS_PER_JOB replaces SLURM_GRES's count, per node.
  local job_gpus="${GPUS_PER_JOB:-1}" job_nodes="${NODES_PER_JOB:-1}" gres="${SLURM_GRES}"
  if [[ ! "${job_gpus}" =~ ^[1-9][0-9]*$ || ! "${job_nodes}" =~ ^[1-9][0-9]*$ ]]; then
    die "GPUS_PER_JOB=${job_gpus}, NODES_PER_JOB=${job_nodes}: expected whole numbers >= 1"
  fi
  if (( job_gpus > 1 )); then gres="${gres%:[0-9]*}:${job_gpus}"; fi
  dir="${PWD}/${SLURM_LOG_DIR}/$(date +%Y%m%d-%H%M%S)-$$"
  cmd=(sbatch --parsable --job-name="${SWEEP_JOB_NAME:-${PWD##*/}}"
    --array="0-$(( ${#pending[@]} - 1 ))%${SLURM_MAX_PARALLEL}"
    --gres="${gres}" --cpus-per-task="${SLURM_CPUS}" --mem="${SLURM_MEM}" --time="${SLURM_TIME}"
    # --requeue: preempted tasks go back to the queue. B:USR1@N: N s before the time limit,
    # the task script (only it: B:) gets USR1; it tells run.py, which checkpoints, and requeues.
    --requeue --signal="B:USR1@${SLURM_SIGNAL_SECS}" --open-mode=append
    --output="${dir}/%A_%a.out" --chdir="${PWD}")
  if [[ -n "${SLURM_PARTITION}" ]]; then cmd+=(--partition="${SLURM_PARTITION}"); fi
  # Several GPUs: one torchrun per node (slurm_task.sh), each starting one process per GPU.
  local multi=$(( job_gpus > 1 || job_nodes > 1 ))
  if (( multi )); then cmd+=(--nodes="${job_nodes}" --ntasks-per-node=1); fi
  read -ra extra <<<"${SLURM_EXTRA}"
  cmd+=("${extra[@]}" "${SWEEP_TASK_SCRIPT}" "${dir}")
  if (( dry_run )); then
    echo "would submit ${#pending[@]} job(s): ${cmd[*]}"
    if (( multi )); then
      echo "  each job: $(bash "${SWEEP_TASK_SCRIPT}" --launch "${job_gpus}" "${job_nodes}") run.py ARGS"
    fi
    return 0
  fi
  command -v sbatch >/dev/null 2>&1 || die "--slurm: sbatch not found (run this on a Slurm login node)"
  init_tracking "${pending[0]}"
  mkdir -p "${dir}/args"
  # The interpreter the tasks use: PYTHON as resolved here, so the tasks get the same venv.
  python="$(command -v "${PYTHON}")" || die "PYTHON=${PYTHON} not found"
  printf '%s\n' "${python}" >"${dir}/python"
  if (( multi )); then printf '%s %s\n' "${job_gpus}" "${job_nodes}" >"${dir}/torchrun"; fi
  for i in "${pending[@]}"; do
    job_argv "${i}"
    # One file per array task: its arguments, NUL-separated (any character is safe), and its
    # script when it is not run.py.
    printf '%s\0' "${JOB_ARGV[@]}" >"${dir}/args/${n}"
    if [[ "${SWEEP_SCRIPT[i]}" != run.py ]]; then
      mkdir -p "${dir}/script" && printf '%s\n' "${SWEEP_SCRIPT[i]}" >"${dir}/script/${n}"
    fi
    printf '%d\t%s\n' "${n}" "${SWEEP_DIR[i]}" >>"${dir}/tasks.tsv"
    n=$(( n + 1 ))
  done
  jobid="$("${cmd[@]}")" || die "sbatch failed"
  jobid="${jobid%%;*}"
  printf '%s\n' "${jobid}" >"${dir}/job_id"
  echo "submitted ${n} job(s) as Slurm array ${jobid} (at most ${SLURM_MAX_PARALLEL} at a time)"
  echo "  watch:  squeue -j ${jobid}        cancel: scancel ${jobid}"
  echo "  logs:   ${dir}/${jobid}_<task>.out   (task -> run: ${dir}/tasks.tsv)"
}

# The settings (listed at the top of this file): what the environment or run.sh set, else the
# defaults. The quick preset changes where results go, so PRESET comes first.
sweep_settings() {
  PYTHON="${PYTHON:-python}"
  SWEEP_NAME="${SWEEP_NAME:-${PRESET:-sweep}}"
  JOBS_PER_GPU="${JOBS_PER_GPU:-auto}"
  CPU_JOBS="${CPU_JOBS:-auto}"
  CPU_JOB_MEM_GB="${CPU_JOB_MEM_GB:-2}"
  LOG_DIR="${LOG_DIR:-logs/${SWEEP_NAME}}"
  STATUS_EVERY="${STATUS_EVERY:-60}"
  STATUS_EVERY_LOG="${STATUS_EVERY_LOG:-600}"
  SLURM_PARTITION="${SLURM_PARTITION:-}"
  SLURM_TIME="${SLURM_TIME:-24:00:00}"
  SLURM_MEM="${SLURM_MEM:-32G}"
  SLURM_CPUS="${SLURM_CPUS:-8}"
  SLURM_GRES="${SLURM_GRES:-gpu:1}"
  SLURM_MAX_PARALLEL="${SLURM_MAX_PARALLEL:-16}"
  SLURM_SIGNAL_SECS="${SLURM_SIGNAL_SECS:-300}"
  SLURM_EXTRA="${SLURM_EXTRA:-}"
  SLURM_LOG_DIR="${SLURM_LOG_DIR:-logs/slurm}"
  SWEEP_JOB_NAME="${SWEEP_JOB_NAME:-}"
  GPUS_PER_JOB="${GPUS_PER_JOB:-1}"
  NODES_PER_JOB="${NODES_PER_JOB:-1}"
}

#######################################
# Entry point, called by run.sh.
# Arguments: the name of the function that lists the jobs, then run.sh's arguments.
# Globals read: QUICK_ARGS, the quick preset's run.py arguments (run.sh's).
#######################################
sweep_main() {
  local define_jobs="$1" dry_run=0 slurm=0
  shift
  if (( BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1) )); then
    die "needs bash >= 5.1 (this is ${BASH_VERSION}); on macOS: brew install bash"
  fi
  PRESET="${PRESET:-}"
  while (( $# > 0 )); do
    case "$1" in
      --dry-run) dry_run=1 ;;
      --slurm) slurm=1 ;;
      --quick) PRESET=quick ;;
      -h | --help) usage; exit 0 ;;
      --) shift; SWEEP_EXTRA=("$@"); break ;;
      *) usage >&2; die "unknown option: $1" ;;
    esac
    shift
  done
  sweep_settings
  case "${PRESET}" in
    "") ;;
    quick)
      SWEEP_PRESET_ARGS=("${QUICK_ARGS[@]}")
      echo "run.sh: quick preset: ${QUICK_ARGS[*]} first on every job," \
        "results in results/${SWEEP_NAME}/"
      ;;
    *) die "PRESET must be quick or empty, got '${PRESET}'" ;;
  esac
  [[ "${JOBS_PER_GPU}" =~ ^([1-9][0-9]*|auto)$ ]] \
    || bad_setting "JOBS_PER_GPU must be a positive integer or auto, got '${JOBS_PER_GPU}'"
  [[ "${CPU_JOBS}" =~ ^([1-9][0-9]*|auto)$ ]] \
    || bad_setting "CPU_JOBS must be a positive integer or auto, got '${CPU_JOBS}'"
  [[ "${CPU_JOB_MEM_GB}" =~ ^[1-9][0-9]*$ ]] \
    || bad_setting "CPU_JOB_MEM_GB must be a positive integer (GiB one CPU job needs)," \
      "got '${CPU_JOB_MEM_GB}'"
  [[ "${STATUS_EVERY}" =~ ^[0-9]+$ && "${STATUS_EVERY_LOG}" =~ ^[0-9]+$ ]] \
    || die "STATUS_EVERY and STATUS_EVERY_LOG must be whole seconds (0 = off)"
  [[ "${SWEEP_NAME}" =~ ^[A-Za-z0-9._-]+$ && "${SWEEP_NAME}" != "." && "${SWEEP_NAME}" != ".." ]] \
    || die "SWEEP_NAME must be a folder name (letters, digits, . _ -), got '${SWEEP_NAME}'"
  command -v "${PYTHON}" >/dev/null 2>&1 \
    || die "PYTHON=${PYTHON} not found (activate the project's venv, or set PYTHON)"
  [[ -f run.py ]] || die "run.py not found in ${PWD}"
  SWEEP_HAVE_SETSID=0 SWEEP_GUARD=()
  if command -v setsid >/dev/null 2>&1; then SWEEP_HAVE_SETSID=1; fi
  # PR_SET_PDEATHSIG (Linux, util-linux setpriv): the kernel sends each job SIGTERM when run.sh
  # dies, even by SIGKILL, so no job trains on as an orphan (it checkpoints and exits 75).
  if setpriv --pdeathsig TERM -- true 2>/dev/null; then
    SWEEP_GUARD=(setpriv --pdeathsig TERM --)
  fi
  if (( ! slurm )); then choose_gpus; fi   # bad GPUS: refused before any work

  "${define_jobs}"
  (( ${#SWEEP_START[@]} > 0 )) || die "the sweep has no jobs"
  plan_jobs
  if (( ! dry_run )); then wait_for_stopping; fi
  if (( ! slurm )); then size_slots; fi
  if (( slurm )); then
    mark_queued_in_slurm
    if (( dry_run )); then print_plan; fi
    submit_slurm "${dry_run}"
  elif (( dry_run )); then
    print_plan
    echo "would run on $(describe_slots)"
  else
    local rc=0
    run_queue || rc=$?
    if [[ -n "${SWEEP_STOP_SIGNAL}" ]]; then
      trap - INT TERM HUP
      exit $(( 128 + $(kill -l "${SWEEP_STOP_SIGNAL}") ))
    fi
    return "${rc}"
  fi
}
