"""Qwen3.5 (`Qwen3_5ForCausalLM`, `model_type` `qwen3_5_text`): the text model of the Qwen3.5 releases, a hybrid
of Gated DeltaNet linear attention and gated full attention, dense MLPs.

`layer_types` (else every `full_attention_interval`-th layer full, the others linear) says which layers are which.
A linear layer (`linear_attn`) projects the input into q, k, v (`in_proj_qkv`), the output norm's gate
(`in_proj_z`), the write strength (`in_proj_b`) and the decay's input (`in_proj_a`); a causal depthwise `conv1d` over
q, k and v; `A_log` and `dt_bias` per value head; a plain gated RMSNorm (`norm`, `weight * x`); `out_proj`.
megatron-core's `GatedDeltaNet` holds the four projections as one `in_proj` (with the layer's input norm fused under
Transformer Engine's names) and saves it and `conv1d` in parts (`Parallel.COLUMN_PARTS`). A full-attention layer is
Qwen3's (q/k norms, partial rotary embedding) with a sigmoid gate on its output per head, held in `q_proj` beside
each head's query (`GatedQKV`, megatron-core's `attention_output_gate`). Every other RMSNorm is zero-centred
(`1 + weight`).

The rotary embedding is transformers' multimodal one (`mrope_section`): on text, whose three position axes are
equal, it is the plain partial rotary embedding megatron-core computes.
"""

from __future__ import annotations

from dataclasses import replace

from hf_mcore_bridge.mappings.llama import ATTENTION, DENSE_MLP, HF_LAYER, MC_LAYER
from hf_mcore_bridge.mappings.qwen3 import QK_NORMS
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    Direct,
    Entry,
    GatedQKV,
    LinearInProj,
    Size,
)
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.vision_language import FLAT, NESTED, VisionLanguage

LINEAR = f"{HF_LAYER}.linear_attn"
GDN = f"{MC_LAYER}.self_attention"


def full_attention_only(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """The layer entries of these, present in full-attention layers only."""
    return tuple(replace(e, attention=FULL_ATTENTION) if "{layer}" in e.mcore else e for e in entries)


GATED_ATTENTION = full_attention_only(
    (
        *(e for e in ATTENTION if not e.mcore.endswith("linear_qkv.weight")),
        GatedQKV(
            f"{MC_LAYER}.self_attention.linear_qkv.weight",
            q=f"{HF_LAYER}.self_attn.q_proj.weight",
            k=f"{HF_LAYER}.self_attn.k_proj.weight",
            v=f"{HF_LAYER}.self_attn.v_proj.weight",
        ),
        *QK_NORMS,
    )
)
"""Embedding, final norm and output layer; in full-attention layers, Qwen3's attention with the output gate."""

GATED_DELTA_NET_TAIL = (
    Direct(
        f"{GDN}.conv1d.weight",
        f"{LINEAR}.conv1d.weight",
        Parallel.COLUMN_PARTS,
        (Size.LINEAR_QKV, Size.ONE, Size.CONV_KERNEL),
        attention=LINEAR_ATTENTION,
    ),
    Direct(f"{GDN}.dt_bias", f"{LINEAR}.dt_bias", Parallel.COLUMN, (Size.LINEAR_HEADS,), attention=LINEAR_ATTENTION),
    Direct(f"{GDN}.A_log", f"{LINEAR}.A_log", Parallel.COLUMN, (Size.LINEAR_HEADS,), attention=LINEAR_ATTENTION),
    Direct(
        f"{GDN}.out_norm.weight",
        f"{LINEAR}.norm.weight",
        Parallel.REPLICATED,
        (Size.LINEAR_V_HEAD,),
        attention=LINEAR_ATTENTION,
    ),
    Direct(
        f"{GDN}.out_proj.weight",
        f"{LINEAR}.out_proj.weight",
        Parallel.ROW,
        (Size.HIDDEN, Size.LINEAR_V),
        attention=LINEAR_ATTENTION,
    ),
)
"""Gated DeltaNet after its input projection: convolution, decay parameters, gated norm, output projection."""

LINEAR_INPUT_NORM = Direct(
    f"{GDN}.in_proj.layer_norm_weight",
    f"{HF_LAYER}.input_layernorm.weight",
    Parallel.REPLICATED,
    (Size.HIDDEN,),
    attention=LINEAR_ATTENTION,
)

GATED_DELTA_NET = (
    LINEAR_INPUT_NORM,
    LinearInProj(
        f"{GDN}.in_proj.weight",
        qkv=f"{LINEAR}.in_proj_qkv.weight",
        z=f"{LINEAR}.in_proj_z.weight",
        b=f"{LINEAR}.in_proj_b.weight",
        a=f"{LINEAR}.in_proj_a.weight",
        attention=LINEAR_ATTENTION,
    ),
    *GATED_DELTA_NET_TAIL,
)
"""A linear layer's attention, Qwen3.5's split projections."""

HYBRID = {
    "norm_offset": True,
    "qk_norm": True,
    "linear_attention": True,
    "attention_output_gate": True,
    "full_attention_period": "full_attention_interval",
    "hf_absent": {"full_attention_interval": 4, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4},
}
"""What Qwen3-Next and Qwen3.5 (dense and MoE) share besides their tables."""

TINY_HYBRID = {
    "head_dim": 16,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    # 3 linear layers per full one over TINY_BASE's 8: under PP2 each stage holds both kinds
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # two value heads per key head
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
}

ARCHITECTURE = Architecture(
    hf_name="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    table=(*GATED_ATTENTION, *GATED_DELTA_NET, *DENSE_MLP),
    **HYBRID,  # type: ignore[arg-type]
    tiny=TINY_HYBRID,
)

WRAPPER = VisionLanguage(
    hf_name="Qwen3_5ForConditionalGeneration",
    model_type="qwen3_5",
    carried=("model.visual.", "visual.", "mtp."),
    layouts=(FLAT, NESTED),
    tied_absent=False,
)
"""The Qwen3.5 releases: the language model under `model.language_model.` (`lm_head.` at the top), the vision tower
(`model.visual.`) and the multi-token-prediction layer the releases store (`mtp.`, which transformers does not load)
carried."""
