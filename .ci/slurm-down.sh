#!/usr/bin/env bash
# Stop the single-node Slurm cluster that .ci/slurm-up.sh started, by the daemons' pid files.
#
# Usage: bash .ci/slurm-down.sh
#
# Stops slurmd, then slurmctld, then munged; waits up to 10 s for each, then kills it. Safe to
# run when nothing is up.

set -euo pipefail

# Stop the process whose pid is in file $1, if it is running.
stop_pidfile() {
  local pidfile="$1" pid i
  [[ -s "${pidfile}" ]] || return 0
  pid="$(<"${pidfile}")"
  if kill -TERM "${pid}" 2>/dev/null; then
    for ((i = 0; i < 100; i++)); do
      kill -0 "${pid}" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "${pid}" 2>/dev/null; then kill -KILL "${pid}" 2>/dev/null || true; fi
    echo "slurm-down: stopped ${pidfile##*/} (pid ${pid})"
  fi
  rm -f "${pidfile}"
}

main() {
  stop_pidfile /run/slurmd.pid
  stop_pidfile /run/slurmctld.pid
  stop_pidfile /run/munge/munged.pid
}

main "$@"
