#!/usr/bin/env bash
# The main job: stamp out a demo project with the default answers and use it as a lab member
# would, on CPU: install it with the command its README gives, into its own environment (the
# library's wheel that the render built, then the project), run a small sweep with run.sh (real
# training on the offline digits data), then plot.py.
#
# Usage: bash scripts/demo.sh [OUTPUT_DIR]      (default: build/demo)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
ensure_venv demo  # cookiecutter, to render

readonly OUT_DIR="${1:-build/demo}"

mkdir -p "${OUT_DIR}"
echo "[demo] rendering the template with the default answers into ${OUT_DIR}/lab_project"
# -f: the demo is regenerated on every call; results of earlier sweeps are kept and skipped.
.venv/bin/cookiecutter --no-input --overwrite-if-exists . -o "${OUT_DIR}"
cd "${OUT_DIR}/lab_project"

echo "[demo] installing the project as its README says, into ${PWD}/.venv"
if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON3:-python3}" -m venv .venv
fi
# The README's command (constraints.txt: the template's, rendered into the project).
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off \
  -c constraints.txt wheels/labrun-*.whl -e '.[dev]' \
  | { grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached' || true; }
readonly VENV_PYTHON="${PWD}/.venv/bin/python"

echo "[demo] running the sweep (run.sh --quick), then the figures (plot.py)"
# A job per core (run.sh's default without a GPU); run.sh's quick preset (a small model, few
# epochs) into results/quick/, the README's quick path.
PYTHON="${VENV_PYTHON}" bash run.sh --quick
"${VENV_PYTHON}" plot.py --results results/quick

echo
echo "Demo finished."
echo "  figures:         ${PWD}/figures/"
echo "  results:         ${PWD}/results/"
echo "  MLflow database: ${PWD}/mlflow.db"
echo "  browse it with:  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false ${VENV_PYTHON%/python}/mlflow ui --workers 1 --backend-store-uri sqlite:///${PWD}/mlflow.db"
