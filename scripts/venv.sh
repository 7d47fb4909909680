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
# INSTALLER=uv uses uv (`uv venv`, `uv pip install`) instead of pip; where there is no uv on
# PATH, pip installs it into .venv first (ensure_uv). uv does not read pip's configuration: a
# local wheel folder must be in PIP_FIND_LINKS or UV_FIND_LINKS.

step() { echo "[venv] $*"; }

# ensure_uv: set UV to the uv on PATH, else to .venv's own, installed there by pip (pinned by
# constraints.txt) when missing: a machine without uv needs nothing but Python.
ensure_uv() {
  UV="$(command -v uv || true)"
  if [[ -n "${UV}" ]]; then return 0; fi
  UV="${PWD}/.venv/bin/uv"
  if [[ -x "${UV}" ]]; then return 0; fi
  step "no uv on PATH: installing it into .venv with pip (pip install uv)"
  if [[ ! -x .venv/bin/python ]]; then "${PYTHON3:-python3}" -m venv .venv; fi
  if ! .venv/bin/python -m pip install --disable-pip-version-check --quiet -c constraints.txt \
    uv; then
    echo "error: could not install uv: install it (pip install uv), or use INSTALLER=pip" >&2
    return 1
  fi
}

ensure_venv() {
  local extra="$1"
  local python="${PYTHON3:-python3}"
  local installer="${INSTALLER:-pip}"
  local started="${SECONDS}"
  if ! "${python}" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: Python >= 3.11 is needed; '${python}' is $("${python}" --version 2>&1)" >&2
    return 1
  fi
  if [[ "${installer}" == uv ]]; then ensure_uv || return 1; fi
  if [[ ! -x .venv/bin/python ]]; then
    step "creating .venv with $("${python}" --version 2>&1) (${installer})"
    if [[ "${installer}" == uv ]]; then
      "${UV}" venv --quiet --python "${python}" .venv
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
    "${UV}" pip install --python .venv/bin/python ${find_links:+--find-links "${find_links}"} \
      -c constraints.txt "${library[@]}" ".[${extra}]" || return 1
  else
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off \
      -c constraints.txt "${library[@]}" ".[${extra}]" \
      | { grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached' || true; }
    # Sourced without `set -e` (by hand), a failed install must not be reported "ready".
    (( PIPESTATUS[0] == 0 )) || return 1
  fi
  step "ready in $((SECONDS - started)) s"
}
