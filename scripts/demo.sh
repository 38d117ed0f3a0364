#!/usr/bin/env bash
# Sets up the environment and runs the embedded default job: build a tiny Llama-architecture checkpoint,
# convert it to TP2 PP2, verify it in real megatron-core against HF transformers, export it back bit-exactly.
# Usage: bash scripts/demo.sh [DIR] [options of `bridge demo`, e.g. --overwrite to replace an earlier demo]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
dir="${1:-demo}"
shift $(( $# > 0 ? 1 : 0 ))
bridge demo "$dir" --tp 2 --pp 2 "$@"
