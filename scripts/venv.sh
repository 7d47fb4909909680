#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: make .venv (Python >= 3.11) and install one extra of
# pyproject.toml into it, pinned by constraints.txt. Re-running is cheap: pip skips what is there.
#
# Usage: source scripts/venv.sh EXTRA

ensure_venv() {
  local extra="$1"
  local python="${PYTHON3:-python3}"
  if ! "${python}" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: Python >= 3.11 is needed; '${python}' is $("${python}" --version 2>&1)" >&2
    return 1
  fi
  if [[ ! -x .venv/bin/python ]]; then
    "${python}" -m venv .venv
  fi
  echo "Installing .[${extra}] into .venv (pinned by constraints.txt) ..."
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt ".[${extra}]"
}
