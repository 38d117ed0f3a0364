#!/usr/bin/env bash
# Sets up the environment and runs ruff and the tests (CPU; GPU tests skip).
#
#     bash scripts/test.sh            # the fast tier (pytest's default: `-m fast`, see tests/conftest.py)
#     bash scripts/test.sh --all      # everything, as CI runs it
#     bash scripts/test.sh tests/engine -k sampling    # further arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1-}" = "--all" ]; then
  shift
  tier=(-m "fast or not fast")
fi
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "${tier[@]}" "$@"
