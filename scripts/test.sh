#!/usr/bin/env bash
# The template's whole test suite: renders the option matrix, lints every render, runs the
# generated project's own tests (CPU), and the Slurm test when a cluster is up (.ci/slurm-up.sh).
#
# The generated project's suite runs nested inside (tests/test_generated_project.py): its lines
# stream as it runs, and the end of the run lists what it skipped and why (CUDA tests without a
# GPU, the Slurm test without a cluster).
#
# Usage: bash scripts/test.sh [PYTEST_ARGS...]      (INSTALLER=uv: install with uv, see venv.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
ensure_venv test
echo "[test] running the template's tests (the generated project's suite takes the longest)"
PATH="${PWD}/.venv/bin:${PATH}" .venv/bin/python -m pytest "$@"
