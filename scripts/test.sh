#!/usr/bin/env bash
# The template's whole test suite, in two parts:
#   1. the library's tests (lib/tests): the machinery every project shares, run once, through a
#      project rendered from this checkout, slow tests included (real signals, torchrun, sweeps,
#      Slurm when a cluster is up: .ci/slurm-up.sh);
#   2. the template's own tests (tests/): the option matrix rendered and linted, the hooks, the
#      generated project's own suite as a user runs it, cruft updates, the first hour.
# Failures come last: every FAILED or ERROR line of both parts is repeated after both have run,
# then one closing line with the counts of both.
#
# Usage: bash scripts/test.sh [PYTEST_ARGS...]   (passed to both parts, e.g. -k cache -x)
#        INSTALLER=uv: install with uv (venv.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
ensure_venv test

readonly BIN="${PWD}/.venv/bin"  # ruff, shellcheck, cruft, torchrun beside the interpreter
readonly PYTHON="${BIN}/python"
LOGS="$(mktemp -d)"
readonly LOGS
trap 'rm -rf "${LOGS}"' EXIT

# run_part NAME DIR ARGS...: pytest in DIR, streamed and kept in LOGS/NAME.log; returns its
# exit status, with pytest's 5 (no test selected, e.g. by -k) counted as success.
run_part() {
  local name="$1" dir="$2"
  shift 2
  local -a statuses
  set +e
  (cd "${dir}" && PATH="${BIN}:${PATH}" "${PYTHON}" -m pytest "$@") 2>&1 \
    | tee "${LOGS}/${name}.log"
  statuses=("${PIPESTATUS[@]}")
  set -e
  if (( statuses[0] == 5 )); then return 0; fi
  return "${statuses[0]}"
}

# count WORD: the sum of "N WORD" over both parts' closing lines.
count() {
  local word="$1"
  cat "${LOGS}"/*.log \
    | grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s' \
    | grep -oE "[0-9]+ ${word}" \
    | awk '{ sum += $1 } END { print sum + 0 }'
}

main() {
  local lib_rc=0 template_rc=0
  echo "[test] 1/2 the library's tests (lib/tests), two workers, slow tests included"
  run_part library lib -n 2 --dist loadscope --runslow -p no:cacheprovider "$@" || lib_rc=$?
  echo "[test] 2/2 the template's tests (tests/); the generated project's suite runs inside"
  run_part template . -p no:cacheprovider "$@" || template_rc=$?

  echo
  echo "[test] failures of both parts:"
  grep -hE '^(FAILED|ERROR) ' "${LOGS}"/*.log || echo "none"
  echo "[test] library: exit ${lib_rc}; template: exit ${template_rc}"
  echo "$(count passed) passed, $(( $(count failed) + $(count errors) )) failed, $(count skipped) skipped"
  if (( lib_rc != 0 || template_rc != 0 )); then
    exit 1
  fi
}

main "$@"
