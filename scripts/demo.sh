#!/usr/bin/env bash
# Sets up the environment and runs the embedded default job: build a tiny Llama-architecture checkpoint,
# convert it to TP2 PP2, verify it in real megatron-core against HF transformers, export it back bit-exactly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bridge demo "${1:-demo}" --tp 2 --pp 2
