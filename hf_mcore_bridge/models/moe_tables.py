"""Table entries shared by the mixture-of-experts architectures in `mappings/` (their config readers: `moe`).

A routed MoE layer's norm, router and experts are `routed_experts`; the sigmoid router's score bias is
`expert_score_bias`; an ungated shared expert `shared_experts`; entries of dense-MLP layers only `dense_only`.
Multi-token-prediction layers (HF's layers after the decoder's, megatron-core's `mtp.layers.{i}`) are `mtp_layer`,
with `MTP_COPIES`.
"""

from __future__ import annotations

from dataclasses import replace

from hf_mcore_bridge.models.mapping_types import Direct, Entry, FusedGateUp, LayerKind, Size
from hf_mcore_bridge.models.parallel_style import Parallel

MC_LAYER = "decoder.layers.{layer}"
MC_EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"


def dense_only(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """The same entries, present only on dense-MLP layers."""
    return tuple(replace(e, layers=LayerKind.DENSE) for e in entries)


def routed_experts(norm: str, router: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
    """Pre-MLP norm, router and routed experts of a MoE layer, from their HF name templates."""
    moe = LayerKind.MOE
    return (
        Direct(f"{MC_LAYER}.pre_mlp_layernorm.weight", norm, Parallel.REPLICATED, (Size.HIDDEN,), layers=moe),
        Direct(f"{MC_LAYER}.mlp.router.weight", router, Parallel.REPLICATED, (Size.EXPERTS, Size.HIDDEN), layers=moe),
        FusedGateUp(f"{MC_EXPERT}.linear_fc1.weight", gate=gate, up=up, width=Size.EXPERT_FFN, layers=moe),
        Direct(f"{MC_EXPERT}.linear_fc2.weight", down, Parallel.ROW, (Size.HIDDEN, Size.EXPERT_FFN), layers=moe),
    )


def expert_score_bias(hf: str) -> Direct:
    """The router's per-expert score bias of a MoE layer: HF `mlp.gate.e_score_correction_bias` [experts],
    megatron-core's `mlp.router.expert_bias` (a persistent buffer, saved in its sharded state dict). Both sides
    hold it in float32; it is added to the sigmoid scores only to choose the experts (`sigmoid_router`)."""
    return Direct(
        f"{MC_LAYER}.mlp.router.expert_bias",
        hf,
        Parallel.REPLICATED,
        (Size.EXPERTS,),
        layers=LayerKind.MOE,
        float32=True,
    )


def shared_experts(gate: str, up: str, down: str) -> tuple[Entry, ...]:
    """An ungated shared expert of a MoE layer, added to the routed experts' output (megatron-core's
    `mlp.shared_experts` with `moe_shared_expert_gate=False`), from its HF gate/up/down name templates."""
    moe = LayerKind.MOE
    return (
        FusedGateUp(
            f"{MC_LAYER}.mlp.shared_experts.linear_fc1.weight", gate=gate, up=up, width=Size.SHARED_FFN, layers=moe
        ),
        Direct(
            f"{MC_LAYER}.mlp.shared_experts.linear_fc2.weight",
            down,
            Parallel.ROW,
            (Size.HIDDEN, Size.SHARED_FFN),
            layers=moe,
        ),
    )


HF_LAYER = "model.layers.{layer}"
MC_MTP = "mtp.layers.{layer}"


def mtp_layer(decoder: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """A multi-token-prediction layer (DeepSeek-V3, GLM-4.5; `{layer}` is its HF layer index in HF names and its
    MTP index in megatron-core names): the norms of the next token's embedding and of the hidden state, their
    projection `eh_proj` (over `[embedding; hidden]` in both), a decoder layer made of `decoder`'s layer entries
    (megatron-core's `transformer_layer`), and the norm before the shared output layer."""
    mtp = LayerKind.MTP

    def inside(entry: Entry) -> Entry:
        return replace(entry, mcore=entry.mcore.replace(f"{MC_LAYER}.", f"{MC_MTP}.transformer_layer."), layers=mtp)

    norm, replicated = (Size.HIDDEN,), Parallel.REPLICATED
    return (
        Direct(f"{MC_MTP}.enorm.weight", f"{HF_LAYER}.enorm.weight", replicated, norm, layers=mtp),
        Direct(f"{MC_MTP}.hnorm.weight", f"{HF_LAYER}.hnorm.weight", replicated, norm, layers=mtp),
        Direct(
            f"{MC_MTP}.eh_proj.weight",
            f"{HF_LAYER}.eh_proj.weight",
            Parallel.COLUMN,
            (Size.HIDDEN, Size.TWO_HIDDEN),
            layers=mtp,
        ),
        *(inside(e) for e in decoder if e.mcore.startswith(f"{MC_LAYER}.")),
        Direct(f"{MC_MTP}.final_layernorm.weight", f"{HF_LAYER}.shared_head.norm.weight", replicated, norm, layers=mtp),
    )


MTP_COPIES = {
    f"{HF_LAYER}.embed_tokens.weight": "model.embed_tokens.weight",
    f"{HF_LAYER}.shared_head.head.weight": "lm_head.weight",
}
"""An MTP layer's own copies of the embedding and output layer, which megatron-core's MTP shares with the model
(`Architecture.mtp_copies`)."""
