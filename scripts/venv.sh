#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: make .venv (Python >= 3.11) and install one extra of
# pyproject.toml into it, pinned by constraints.txt. Re-running is cheap: what is there is kept.
# Each step is announced, and the installer's own lines (which package it is collecting,
# downloading, building) are shown as they come, so a first install of several minutes is not
# one silent line. Lines about packages already there are left out.
#
# For the tests the library, labrun (lib/), is installed editable too: an edit there is live in
# every test (the demo installs it from the wheel a render builds, as a project does).
#
# Usage: source scripts/venv.sh; ensure_venv EXTRA
# INSTALLER=uv uses uv (`uv venv`, `uv pip install`) instead of pip. uv does not read pip's
# configuration: a local wheel folder must be in PIP_FIND_LINKS or UV_FIND_LINKS.

step() { echo "[venv] $*"; }

ensure_venv() {
  local extra="$1"
  local python="${PYTHON3:-python3}"
  local installer="${INSTALLER:-pip}"
  local started="${SECONDS}"
  if ! "${python}" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: Python >= 3.11 is needed; '${python}' is $("${python}" --version 2>&1)" >&2
    return 1
  fi
  if [[ ! -x .venv/bin/python ]]; then
    step "creating .venv with $("${python}" --version 2>&1) (${installer})"
    if [[ "${installer}" == uv ]]; then
      uv venv --quiet --python "${python}" .venv
    else
      "${python}" -m venv .venv
    fi
  fi
  local -a library=()
  if [[ "${extra}" == test ]]; then library=(-e ./lib); fi
  step "installing .[${extra}] ${library[*]} pinned by constraints.txt with ${installer}" \
    "(first time: torch, mlflow and their dependencies, several minutes)"
  if [[ "${installer}" == uv ]]; then
    local find_links="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}"
    uv pip install --python .venv/bin/python ${find_links:+--find-links "${find_links}"} \
      -c constraints.txt "${library[@]}" ".[${extra}]"
  else
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off \
      -c constraints.txt "${library[@]}" ".[${extra}]" \
      | { grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached' || true; }
  fi
  step "ready in $((SECONDS - started)) s"
}
