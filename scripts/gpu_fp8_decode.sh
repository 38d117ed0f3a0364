#!/usr/bin/env bash
# One bounded call on a fresh one-H200 machine (Python 3.12 with a CUDA torch, the project not installed) for the
# rollout levers of issue 21: installs the project as gpu_check.sh does (scripts/setup.sh keeping the system's
# torch; offline from WHEELS, default .whl/ where it exists, which must hold the megatron-core wheel), runs the CUDA
# checks of the changed kernels (FP8 GEMM path and agreement, FP8 KV cache through the Triton kernels, the fused
# sampler and RoPE / cache write, the Triton engine against transformers), then scripts/bench_fp8_decode.py.
# Everything lands under OUT_DIR: setup.log, pytest.log, bench.log and fp8_decode.json. About 5-6 minutes.
#
#     bash scripts/gpu_fp8_decode.sh OUT_DIR
#
# Limits (seconds, environment): TESTS_LIMIT (110), BENCH_LIMIT (250; the benchmark skips sections past
# BENCH_LIMIT - 30). Exit status: 2 when the install fails, else the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_fp8_decode.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" && OUT="$(cd "$1" && pwd)"
if [ -z "${WHEELS+set}" ] && [ -d .whl ]; then
  WHEELS=.whl
fi
TORCH_SPEC= EXTRAS= WHEELS="${WHEELS-}" bash scripts/setup.sh >"$OUT/setup.log" 2>&1 || {
  tail -5 "$OUT/setup.log"
  echo "gpu_fp8_decode: the install failed (see $OUT/setup.log)" >&2
  exit 2
}
. .venv/bin/activate
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

timeout -k 5 "${TESTS_LIMIT:-110}" python -m pytest -q -s -p no:cacheprovider -k "not flex and not gather" \
  tests/engine/test_fp8.py tests/engine/test_engine_fp8.py tests/engine/test_triton_sampling.py \
  tests/engine/test_triton_rope.py tests/engine/test_decode_attention.py::test_fp8_cache_decode_matches_a_reference_over_its_dequantized_entries \
  tests/engine/test_engine_gpu.py::test_cuda_graph_decode_matches_eager_and_transformers >"$OUT/pytest.log" 2>&1
tests_status=$?
grep -E "blockwise scaled_mm used|agreement|fp8 KV cache|passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -30

limit="${BENCH_LIMIT:-250}"
timeout -k 5 "$limit" python scripts/bench_fp8_decode.py --out "$OUT" --time-limit "$((limit - 30))" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/bench.log"
echo "gpu_fp8_decode: tests exit status $tests_status; results under $OUT"
exit "$tests_status"
