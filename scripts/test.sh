#!/usr/bin/env bash
# The template's whole test suite: renders the option matrix, lints every render, runs the
# generated project's own tests (CPU), and the Slurm test when a cluster is up (.ci/slurm-up.sh).
#
# Usage: bash scripts/test.sh [PYTEST_ARGS...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
ensure_venv test
PATH="${PWD}/.venv/bin:${PATH}" .venv/bin/python -m pytest "$@"
