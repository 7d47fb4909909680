#!/usr/bin/env bash
# Bring up a real single-node Slurm cluster on this machine for CI (Debian 12, run as root).
#
# Usage: bash .ci/slurm-up.sh        (stop it with: bash .ci/slurm-down.sh)
#
# Installs slurmctld, slurmd, slurm-client and munge if missing, writes a slurm.conf for
# `hostname -s` with two fake GPUs (character devices listed in gres.conf, so --gres=gpu:1 sets
# CUDA_VISIBLE_DEVICES per task), starts munged, slurmctld and slurmd, and waits for the node
# to be idle. No cgroup plugins: on the CI machines they fail (no freezer controller) and the
# node drains while jobs still report exit 0. Running it again while the cluster is up is a
# no-op; a half-up cluster is taken down and started again.

set -euo pipefail

readonly SLURM_CONF=/etc/slurm/slurm.conf
readonly GRES_CONF=/etc/slurm/gres.conf
readonly N_FAKE_GPUS=2

err() { echo "slurm-up: $*" >&2; }

# True if the process whose pid is in file $1 is alive.
pid_alive() {
  [[ -s "$1" ]] && kill -0 "$(<"$1")" 2>/dev/null
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge
}

start_munge() {
  if pid_alive /run/munge/munged.pid; then return 0; fi
  # Nothing creates the runtime directory without systemd.
  mkdir -p /run/munge
  chown munge:munge /run/munge
  chmod 755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  munge -n | unmunge >/dev/null
}

# Write slurm.conf and gres.conf for this host.
write_config() {
  local host="$1" cpus mem gpu_last=$(( N_FAKE_GPUS - 1 )) i
  cpus="$(nproc)"
  # RealMemory must not exceed what slurmd detects, or the node is invalid.
  mem="$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)"
  [[ -n "${mem}" ]] || mem=1000
  for ((i = 0; i < N_FAKE_GPUS; i++)); do
    [[ -e "/dev/fakegpu${i}" ]] || mknod "/dev/fakegpu${i}" c 1 3   # same as /dev/null
  done
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  cat >"${SLURM_CONF}" <<EOF
# Written by .ci/slurm-up.sh: single-node CI cluster.
ClusterName=ci
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
GresTypes=gpu
NodeName=${host} CPUs=${cpus} RealMemory=${mem} Gres=gpu:${N_FAKE_GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"${GRES_CONF}" <<EOF
AutoDetect=off
NodeName=${host} Name=gpu File=/dev/fakegpu[0-${gpu_last}]
EOF
}

# Wait up to 30 s for the node to be idle; resume it if it comes up drained.
wait_idle() {
  local host="$1" state i
  for ((i = 0; i < 60; i++)); do
    state="$(sinfo -h -n "${host}" -o '%t' 2>/dev/null | head -1)" || state=""
    case "${state}" in
      idle) echo "slurm-up: node ${host} is idle"; return 0 ;;
      drain* | drng | down*) scontrol update nodename="${host}" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  err "node ${host} did not become idle (state: ${state:-no answer}); see /var/log/slurm/"
  return 1
}

main() {
  local host
  host="$(hostname -s)"
  if pid_alive /run/slurmctld.pid && pid_alive /run/slurmd.pid \
    && [[ "$(sinfo -h -n "${host}" -o '%t' 2>/dev/null)" == "idle" ]]; then
    echo "slurm-up: already up"
    return 0
  fi
  if pid_alive /run/slurmctld.pid || pid_alive /run/slurmd.pid; then
    bash "$(dirname "${BASH_SOURCE[0]}")/slurm-down.sh"
  fi
  (( EUID == 0 )) || { err "must run as root"; exit 1; }
  install_packages
  # slurmctld and slurmd must find this host by name.
  getent hosts "${host}" >/dev/null || echo "127.0.0.1 ${host}" >>/etc/hosts
  start_munge
  write_config "${host}"
  # Old state (job ids, a drained node) survives restarts; start clean.
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
  slurmctld
  slurmd
  wait_idle "${host}"
}

main "$@"
