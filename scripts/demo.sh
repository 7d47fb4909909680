#!/usr/bin/env bash
# The main job: stamp out a demo project with the default answers and run it end to end on CPU:
# a small sweep with run.sh (real training on the offline digits data), then plot.py.
#
# Usage: bash scripts/demo.sh [OUTPUT_DIR]      (default: build/demo)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
ensure_venv demo

readonly OUT_DIR="${1:-build/demo}"
readonly VENV_PYTHON="${PWD}/.venv/bin/python"

mkdir -p "${OUT_DIR}"
echo "[demo] rendering the template with the default answers into ${OUT_DIR}/lab_project"
# -f: the demo is regenerated on every call; results of earlier sweeps are kept and skipped.
.venv/bin/cookiecutter --no-input --overwrite-if-exists . -o "${OUT_DIR}"
cd "${OUT_DIR}/lab_project"
echo "[demo] running the sweep (run.sh), then the figures (plot.py)"

# A job per core (run.sh's default without a GPU); run.sh's quick preset (a small model, few
# epochs) into results/quick/, the README's quick path.
PYTHON="${VENV_PYTHON}" bash run.sh --quick
"${VENV_PYTHON}" plot.py --results results/quick

echo
echo "Demo finished."
echo "  figures:         ${PWD}/figures/"
echo "  results:         ${PWD}/results/"
echo "  MLflow database: ${PWD}/mlflow.db"
echo "  browse it with:  ${VENV_PYTHON%/python}/mlflow ui --backend-store-uri sqlite:///${PWD}/mlflow.db"
