#!/usr/bin/env bash
# Sets up the environment and runs the checks CI runs: ruff, then the test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "$@"
