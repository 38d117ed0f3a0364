#!/usr/bin/env bash
# The one command for a fresh one-H200 machine (Python 3.12 with a CUDA torch installed, the project not): installs
# the project (scripts/setup.sh, keeping the system's torch; offline from WHEELS, default .whl/ where it exists,
# which must hold the megatron-core wheel), runs the GPU-marked tests, then the throughput benchmarks on bounded
# sizes (bench_throughput.py: training on the 1B shape at 4096-token rows, the engine against transformers on
# 64 x 8 samples of 128 new tokens, a 1B GRPO step), each stopped at its time limit, so that the whole fits in
# about 9 minutes. Everything it writes goes under OUT_DIR: setup.log, pytest_gpu.log, and each benchmark's JSON
# and log with summary.json.
#
#     bash scripts/gpu_check.sh OUT_DIR
#
# Limits (seconds, environment): TESTS_LIMIT (120), TRAINING_LIMIT (170), ENGINE_LIMIT (130), GRPO_LIMIT (90).
# Exit status: 2 when the install fails, else the GPU tests' (the benchmarks report their failures in the summary).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_check.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" && OUT="$(cd "$1" && pwd)"
if [ -z "${WHEELS+set}" ] && [ -d .whl ]; then
  WHEELS=.whl
fi

TORCH_SPEC= EXTRAS= WHEELS="${WHEELS-}" bash scripts/setup.sh 2>&1 | tee "$OUT/setup.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "gpu_check: the install failed (see $OUT/setup.log)" >&2
  exit 2
fi
. .venv/bin/activate
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available(), torch.cuda.device_count())"

timeout -k 10 "${TESTS_LIMIT:-120}" python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log"
tests_status=${PIPESTATUS[0]}

python scripts/bench_throughput.py --nproc 1 --out "$OUT" \
  --training-time-limit "${TRAINING_LIMIT:-170}" --engine-time-limit "${ENGINE_LIMIT:-130}" \
  --grpo-time-limit "${GRPO_LIMIT:-90}" \
  --training-args "--shapes llama3.2-1b --seq-lens 4096 --iters 3" \
  --engine-args "--max-tokens 128" \
  --grpo-args "--steps 3 --prompts 32 --max-new-tokens 256"

echo "gpu_check: GPU tests exit status $tests_status; results under $OUT"
exit "$tests_status"
