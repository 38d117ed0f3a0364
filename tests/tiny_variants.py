"""The tiny models the suites build (`conftest`'s `tiny_models`, `tiny_models_bf16`, `tiny_moe_models`): every
registered architecture (`tests/models/test_every_architecture.py` checks), plus variants of the features that
need their own model, keyed by name."""

from __future__ import annotations

VARIANTS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),  # Llama-3.2 style
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    # four norms per layer, (1 + weight) norms, q/k norms, GeGLU, scaled embeddings, sliding layers (window 6) with
    # their own RoPE base, a softmax scale from query_pre_attn_scalar
    "gemma3": ("Gemma3ForCausalLM", {}),
    # Gated DeltaNet layers (three of every four) beside gated full attention with partial rotary; (1 + weight) norms
    "qwen3_5": ("Qwen3_5ForCausalLM", {}),
}
"""Tiny models: every architecture, plus tied embeddings (which matter with PP > 1)."""


MOONLIGHT_LIKE = {
    "q_lora_rank": None,
    "rope_interleave": False,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 3,
}
"""DeepSeek-V3 with a full-rank query projection (Moonlight), plain RoPE with weights in rotate-half order, no
expert groups."""

MOE_VARIANTS = {
    "mixtral": ("MixtralForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {}),  # layer 1 dense (mlp_only_layers): a heterogeneous stack
    "qwen2_moe": ("Qwen2MoeForCausalLM", {}),  # shared expert with its gate, no top-k renormalisation
    # multi-latent attention, YaRN, sigmoid router with expert bias and 4 groups of 4 experts, a dense layer 0
    "deepseek_v3": ("DeepseekV3ForCausalLM", {}),
    "moonlight": ("DeepseekV3ForCausalLM", MOONLIGHT_LIKE),
    # sigmoid router with score bias, 2 of 4 groups, scaling 2.5; ungated shared expert; layer 0 dense; partial
    # rotary (half of each head); q/k norms and q/k/v biases
    "glm4_moe": ("Glm4MoeForCausalLM", {}),
    # GLM-4.7-Flash: DeepSeek-V3's multi-latent attention (plain RoPE, interleaved pairs) with GLM's router (2 of 4
    # groups, scaling 1.8) and shared expert; dense layers 0 and 2 (`mlp_layer_types`)
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", {}),
    # sinks, sliding and full layers (window 6), YaRN, biased router and experts with the clamped SwiGLU
    "gpt_oss": ("GptOssForCausalLM", {}),
    # Qwen3.5's hybrid layers, every MLP routed experts beside a sigmoid-gated shared expert
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {}),
    # Qwen3.5 MoE with Gated DeltaNet's projections fused per key head; layer 2 dense (mlp_only_layers)
    "qwen3_next": ("Qwen3NextForCausalLM", {}),
}
