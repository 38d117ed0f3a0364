"""Logit parity through real megatron-core: every architecture at TP1PP1, TP2PP1, TP1PP2, TP2PP2, CP2, TP2CP2.

One gloo world per layout verifies all tiny models (GQA, odd vocabulary padded for TP, tied embeddings with PP>1,
Qwen2 biases, Qwen3 q/k norms, Llama-3 RoPE scaling, Gemma 3's sliding layers with 24-token sequences over a window
of 6, its post-norms and own RoPE bases), and MoE models without expert parallelism in some worlds:
GLM-4.5 and GLM-4.7-Flash at TP2 and PP2, DeepSeek-V3's multi-latent attention at TP2, PP2 and CP2 (their EP
layouts are in `test_moe`); at TP2 also GLM-4.7-Flash with latents small enough that their norms' epsilon (1e-6,
not its `rms_norm_eps` 1e-5) moves the logits far beyond the tolerance (`test_glm4_moe_lite` shows by how much); at
PP2 also the language model of a `Gemma3ForConditionalGeneration` against transformers' wrapper on text.
Also: checkpoints written by megatron-core itself.
"""

from __future__ import annotations

import pytest
import torch
from hf_weights import assert_same_weights
from megatron_ranks import random_save_rank, resave_rank

from hf_mcore_bridge.checkpoint.hf_dir import read_json
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import VerifyJob, _hf_logits, verify
from hf_mcore_bridge.megatron.world import run_world

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp1pp1": Layout(),
    "tp2pp1": Layout(tp=2),
    "tp1pp2": Layout(pp=2),
    "tp2pp2": Layout(tp=2, pp=2),
    "tp1cp2": Layout(cp=2),  # context parallelism through the project's attention (`context_parallel`)
    "tp2cp2": Layout(tp=2, cp=2),
}


MOE_HERE = {
    "tp2pp1": ("glm4_moe", "deepseek_v3", "glm4_moe_lite"),
    "tp1pp2": ("glm4_moe", "deepseek_v3", "glm4_moe_lite"),
    "tp1cp2": ("deepseek_v3",),
}
"""Mixture-of-experts models verified in these worlds too (layouts without expert parallelism; DeepSeek-V3's
multi-latent attention has keys and values of different widths under CP; GLM-4.7-Flash's is DeepSeek-V3's)."""


WINDOWED = ("gemma3", "qwen3_5")
"""Tiny models that context parallelism refuses, verified in the other worlds: sliding windows (Gemma 3's sequences
of 24 tokens exceed its window of 6) and Gated DeltaNet layers (Qwen3.5)."""


@pytest.mark.parametrize(
    "layout_name",
    [
        pytest.param(n, marks=pytest.mark.extended) if n == "tp2cp2" else n for n in LAYOUTS
    ],  # CP x TP: also test_context_parallel
)
def test_logit_parity_through_megatron_core(layout_name, tiny_models, tiny_moe_models, request, tmp_path):
    layout = LAYOUTS[layout_name]
    jobs = []
    models = {**tiny_models, **{name: tiny_moe_models[name] for name in MOE_HERE.get(layout_name, ())}}
    if layout.cp > 1:  # sliding windows are refused under context parallelism (`layout.validate_layout`)
        models = {name: path for name, path in models.items() if name not in WINDOWED}
    if layout_name == "tp2pp1":  # latents small enough that their norms' epsilon shows (test_glm4_moe_lite)
        models["small_latent_glm"] = request.getfixturevalue("small_latent_glm")
    if layout_name == "tp1pp2":  # a vision-language class: its language model against transformers' wrapper
        models["gemma3_vl"] = request.getfixturevalue("gemma3_vl_dir")
    for name, hf_dir in models.items():
        convert_hf_to_mcore(hf_dir, tmp_path / name, layout=layout, show_progress=False)
        jobs.append(VerifyJob(hf_dir, tmp_path / name))
    for result in verify(jobs, layout, seq_len=24):
        assert result.max_abs_diff <= 1e-4, result.summary()
        assert result.top1_agreement == 1.0, result.summary()
        assert result.mean_kl < 1e-9, result.summary()


def test_verify_fails_on_wrong_weights(tiny_models, tmp_path):
    """The check can fail: a checkpoint of one model verified against another model's HF weights."""
    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "m", show_progress=False)
    (result,) = verify([VerifyJob(tiny_models["llama_tied"], tmp_path / "m")], Layout())
    assert not result.passed and result.max_abs_diff > 1e-2


def test_reshard_chain_through_megatron_core_is_bit_exact(tiny_models, tmp_path):
    """Written by us at TP2PP2, loaded by megatron-core at TP1PP4, saved by megatron-core, exported to HF."""
    hf_dir = tiny_models["qwen2"]
    convert_hf_to_mcore(hf_dir, tmp_path / "ours", layout=Layout(tp=2, pp=2), show_progress=False)
    run_world(resave_rank, Layout(pp=4), str(tmp_path / "ours"), str(tmp_path / "theirs"), Layout(pp=4))
    convert_mcore_to_hf(tmp_path / "theirs", tmp_path / "hf", hf_config=hf_dir, show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "hf")


@pytest.mark.parametrize("variant", ["qwen3", "llama_tied"])
def test_checkpoint_saved_by_megatron_core_exports_to_matching_hf(variant, tiny_models, tmp_path):
    """A GPTModel saved by megatron-core at TP2PP2 (4 gloo ranks) exports to an HF model with the same logits."""
    hf_dir = tiny_models[variant]
    config = read_json(hf_dir / "config.json")
    model_cfg = config_bridge.megatron_spec(config)
    layout = Layout(tp=2, pp=2)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    logits_path = tmp_path / "logits.pt"
    run_world(random_save_rank, layout, model_cfg, layout, str(tmp_path / "saved"), tokens, str(logits_path))
    convert_mcore_to_hf(tmp_path / "saved", tmp_path / "hf", hf_config=hf_dir, show_progress=False)
    megatron_logits = torch.load(logits_path, weights_only=True)
    hf_logits = _hf_logits(tmp_path / "hf", tokens, "fp32")
    assert (megatron_logits - hf_logits).abs().max() <= 1e-4
