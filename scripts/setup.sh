#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test tools. Idempotent.
# torch is installed first and pinned (TORCH_SPEC): a bare `torch` requirement would pull a multi-GB CUDA build
# where a CPU build is wanted. On a GPU machine, set TORCH_SPEC to the torch you want (or to "" to keep yours).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ -n "$TORCH_SPEC" ]; then
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e '.[dev]'
