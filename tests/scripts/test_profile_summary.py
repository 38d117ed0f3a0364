"""The profile summary used by `bench_training.py --profile`: interval union, kernel kinds, and a CPU run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from profile_summary import kernel_kind, profile_call, union_us


def test_union_counts_overlaps_once() -> None:
    assert union_us([]) == 0.0
    assert union_us([(0.0, 10.0), (5.0, 15.0), (20.0, 30.0), (21.0, 22.0)]) == 25.0
    assert union_us([(20.0, 30.0), (0.0, 10.0)]) == 20.0


def test_kernel_kinds() -> None:
    assert kernel_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "communication"
    assert kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_NNT") == "matmul"
    assert kernel_kind("triton_poi_fused_add_mul_0") == "other"


def test_profile_call_on_cpu_reports_the_wall_time() -> None:
    x = torch.randn(64, 64)
    summary = profile_call(lambda: (x @ x).sum().item(), "cpu matmul")
    assert summary.startswith("profile cpu matmul: wall ")
    if not torch.cuda.is_available():
        assert "no device kernels recorded" in summary
    else:
        assert "kernel time by kind" in summary
