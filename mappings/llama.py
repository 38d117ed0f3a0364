"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 (`LlamaForCausalLM`): the dense vocabulary every other dense family reuses."""

from __future__ import annotations

from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import Direct, FusedGateUp, FusedQKV, Size
from hf_mcore_bridge.models.parallel_style import Parallel

HF_LAYER = "model.layers.{layer}"
MC_LAYER = "decoder.layers.{layer}"

ATTENTION = (
    Direct("embedding.word_embeddings.weight", "model.embed_tokens.weight", Parallel.VOCAB, (Size.VOCAB, Size.HIDDEN)),
    Direct(
        f"{MC_LAYER}.self_attention.linear_qkv.layer_norm_weight",
        f"{HF_LAYER}.input_layernorm.weight",
        Parallel.REPLICATED,
        (Size.HIDDEN,),
    ),
    FusedQKV(
        f"{MC_LAYER}.self_attention.linear_qkv.weight",
        q=f"{HF_LAYER}.self_attn.q_proj.weight",
        k=f"{HF_LAYER}.self_attn.k_proj.weight",
        v=f"{HF_LAYER}.self_attn.v_proj.weight",
    ),
    Direct(
        f"{MC_LAYER}.self_attention.linear_proj.weight",
        f"{HF_LAYER}.self_attn.o_proj.weight",
        Parallel.ROW,
        (Size.HIDDEN, Size.Q),
    ),
    Direct("decoder.final_layernorm.weight", "model.norm.weight", Parallel.REPLICATED, (Size.HIDDEN,)),
    Direct("output_layer.weight", "lm_head.weight", Parallel.VOCAB, (Size.VOCAB, Size.HIDDEN), untied_only=True),
)
"""Embedding, attention, final norm and output layer: shared by every family, dense or MoE."""

GATED_MLP = (
    FusedGateUp(
        f"{MC_LAYER}.mlp.linear_fc1.weight",
        gate=f"{HF_LAYER}.mlp.gate_proj.weight",
        up=f"{HF_LAYER}.mlp.up_proj.weight",
    ),
    Direct(
        f"{MC_LAYER}.mlp.linear_fc2.weight", f"{HF_LAYER}.mlp.down_proj.weight", Parallel.ROW, (Size.HIDDEN, Size.FFN)
    ),
)
"""The MLP's projections (gate and up fused into `linear_fc1`, down as `linear_fc2`), without its norm."""
DENSE_MLP = (
    Direct(
        f"{MC_LAYER}.mlp.linear_fc1.layer_norm_weight",
        f"{HF_LAYER}.post_attention_layernorm.weight",
        Parallel.REPLICATED,
        (Size.HIDDEN,),
    ),
    *GATED_MLP,
)
"""The gated dense MLP with its pre-MLP norm (fused into `linear_fc1` under the Transformer-Engine naming)."""

TABLE = ATTENTION + DENSE_MLP


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""Llama 3.1's RoPE scaling, as published (and as megatron-core hard-codes it)."""

ARCHITECTURE = Architecture(
    hf_name="LlamaForCausalLM",
    model_type="llama",
    table=TABLE,
    # q/k/v and o_proj biases: not in the table (megatron-core's GPT layers have no o_proj bias without MLP biases,
    # so conversion refuses them); the engine runs them under names derived from the weights'
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    hf_defaults={"attention_bias": False, "mlp_bias": False},
    tiny={"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
)
