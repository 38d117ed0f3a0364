"""Gemma 3 (`Gemma3ForCausalLM`, `model_type` `gemma3_text`; the 270M and 1B releases), and the language model of
`Gemma3ForConditionalGeneration` (4B-27B, `model_type` `gemma3`, beside a SigLIP vision tower and its projector).

Llama attention with q/k norms and a softmax scale of `query_pre_attn_scalar`^-0.5; sliding-window layers as
`layer_types` lists them, with their own RoPE base (`rope_local_base_freq`; `rope_theta` and any `rope_scaling`,
linear in the 4B-27B releases, are the full layers'); four norms per layer: `input_layernorm` before attention,
`post_attention_layernorm` on its output before the residual add, `pre_feedforward_layernorm` before the MLP,
`post_feedforward_layernorm` on its output; every norm Gemma's `(1 + weight)` RMSNorm; a GeGLU MLP with the tanh
approximation; embeddings scaled by sqrt(hidden_size) in the model's dtype; tied embeddings. Logit soft-capping
(none in Gemma 3) and bidirectional attention are refused by name.

megatron-core holds the post-norms as `linear_proj.post_layernorm` and `linear_fc2.post_layernorm` (the project's
layer spec, `megatron.gemma_layers`), the pre-MLP norm where it fuses every pre-MLP norm (`linear_fc1`).
"""

from __future__ import annotations

from hf_mcore_bridge.mappings.llama import ATTENTION, GATED_MLP, HF_LAYER, MC_LAYER
from hf_mcore_bridge.mappings.qwen3 import QK_NORMS
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import Direct, Size
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.vision_language import FLAT, NESTED, VisionLanguage

NORMS_AND_MLP = (
    Direct(
        f"{MC_LAYER}.self_attention.linear_proj.post_layernorm.weight",
        f"{HF_LAYER}.post_attention_layernorm.weight",
        Parallel.REPLICATED,
        (Size.HIDDEN,),
    ),
    Direct(
        f"{MC_LAYER}.mlp.linear_fc1.layer_norm_weight",
        f"{HF_LAYER}.pre_feedforward_layernorm.weight",
        Parallel.REPLICATED,
        (Size.HIDDEN,),
    ),
    *GATED_MLP,
    Direct(
        f"{MC_LAYER}.mlp.linear_fc2.post_layernorm.weight",
        f"{HF_LAYER}.post_feedforward_layernorm.weight",
        Parallel.REPLICATED,
        (Size.HIDDEN,),
    ),
)
"""The post-attention norm, the MLP between its pre- and post-norms."""

ARCHITECTURE = Architecture(
    hf_name="Gemma3ForCausalLM",
    model_type="gemma3_text",
    table=(*ATTENTION, *QK_NORMS, *NORMS_AND_MLP),
    qk_norm=True,
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    hidden_act_field="hidden_activation",
    norm_offset=True,
    post_norms=True,
    embedding_scale=True,
    sliding_rope_theta="rope_local_base_freq",
    softmax_scale_field="query_pre_attn_scalar",
    refused_when_set=("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"),
    full_attention_period="sliding_window_pattern",
    hf_absent={  # Gemma3TextConfig's defaults (the 4B-27B releases' text_config states few fields)
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 4096,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    hf_defaults={"attention_bias": False, "final_logit_softcapping": None, "attn_logit_softcapping": None},
    tiny={
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24,  # not head_dim: a scale taken from head_dim shows
        "sliding_window": 6,
        # the published pattern, five sliding layers then a full one, over TINY_BASE's 8 layers: under PP2 the
        # second stage's layers are s, f, s, s, so a stage counting its layers from one (s, s, s, s) shows
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # the full layers', as in Gemma 3 4B-27B
        "rope_local_base_freq": 10000.0,
    },
)

WRAPPER = VisionLanguage(
    hf_name="Gemma3ForConditionalGeneration",
    model_type="gemma3",
    carried=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    layouts=(NESTED, FLAT),
)
"""Gemma 3 4B-27B: the language model under `language_model.` as published (`model.language_model.` as
transformers holds it), the SigLIP tower and the projector carried."""
