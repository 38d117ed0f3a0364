"""Rank function of the hybrid Gated DeltaNet parity worlds (`test_gated_delta_net`).

Each rank builds megatron-core's `GPTModel` of its stage from the project's hybrid block spec
(`megatron.gated_delta_net_layers`), fills it from a transformers `Qwen3_5ForCausalLM` through a mapping written
here, independently of the project's tables (HF tensor -> megatron-core's global tensor -> this TP rank's slice, as
megatron-core's modules hold them), runs one forward through the pipeline and the reporting rank saves the logits.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

PADDED_VOCAB_MULTIPLE = 128


def _config(hf: Any, tp: int, pp: int) -> Any:
    from megatron.core.transformer import TransformerConfig

    from hf_mcore_bridge.megatron.gated_delta_net_layers import linear_attention_pattern

    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_pattern(hf.layer_types),
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
        linear_key_head_dim=hf.linear_key_head_dim,
        linear_value_head_dim=hf.linear_value_head_dim,
        linear_num_key_heads=hf.linear_num_key_heads,
        linear_num_value_heads=hf.linear_num_value_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        transformer_impl="local",
    )


def _chunk(tensor: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return tensor.chunk(tp, dim=dim)[rank]


def _parts(parts: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """Each part split over TP, the rank's slices stacked: `[p0_r; p1_r; ...]`."""
    return torch.cat([_chunk(p, tp, rank) for p in parts])


def _gated_qkv(q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf: Any) -> torch.Tensor:
    """transformers' q_proj holds per head `[query; gate]`; megatron-core's `linear_qkv` with an output gate holds
    per query group `[its query heads; their gates; key; value]`."""
    heads, groups, dim = hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    per_group = heads // groups
    both = q_proj.view(heads, 2, dim, -1)
    query = both[:, 0].reshape(groups, per_group * dim, -1)
    gate = both[:, 1].reshape(groups, per_group * dim, -1)
    return torch.cat([query, gate, k.view(groups, dim, -1), v.view(groups, dim, -1)], dim=1).reshape(
        -1, q_proj.shape[-1]
    )


def _layer_tensors(sd: dict[str, torch.Tensor], layer: int, hf: Any, tp: int, r: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}."
    out = {
        "pre_mlp_layernorm.weight": sd[p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": _parts([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], tp, r),
        "mlp.linear_fc2.weight": _chunk(sd[p + "mlp.down_proj.weight"], tp, r, 1),
        "input_layernorm.weight": sd[p + "input_layernorm.weight"],
    }
    if hf.layer_types[layer] == "full_attention":
        a = p + "self_attn."
        fused = _gated_qkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"], hf)
        return out | {
            "self_attention.linear_qkv.weight": _chunk(fused, tp, r),
            "self_attention.linear_proj.weight": _chunk(sd[a + "o_proj.weight"], tp, r, 1),
            "self_attention.q_layernorm.weight": sd[a + "q_norm.weight"],
            "self_attention.k_layernorm.weight": sd[a + "k_norm.weight"],
        }
    a = p + "linear_attn."
    key_dim = hf.linear_num_key_heads * hf.linear_key_head_dim
    q, k, v = sd[a + "in_proj_qkv.weight"].split([key_dim, key_dim, sd[a + "in_proj_z.weight"].shape[0]])
    conv = sd[a + "conv1d.weight"].split([key_dim, key_dim, v.shape[0]])
    return out | {
        "self_attention.in_proj.weight": _parts(
            [q, k, v, sd[a + "in_proj_z.weight"], sd[a + "in_proj_b.weight"], sd[a + "in_proj_a.weight"]], tp, r
        ),
        "self_attention.conv1d.weight": _parts(list(conv), tp, r),
        "self_attention.dt_bias": _chunk(sd[a + "dt_bias"], tp, r),
        "self_attention.A_log": _chunk(sd[a + "A_log"], tp, r),
        "self_attention.out_norm.weight": sd[a + "norm.weight"],
        "self_attention.out_proj.weight": _chunk(sd[a + "out_proj.weight"], tp, r, 1),
    }


def _fill(model: torch.nn.Module, sd: dict[str, torch.Tensor], hf: Any, padded: int, tp: int, r: int) -> None:
    want: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(model.decoder.layers):
        for name, tensor in _layer_tensors(sd, layer.layer_number - 1, hf, tp, r).items():
            want[f"decoder.layers.{index}.{name}"] = tensor
    pad = padded - hf.vocab_size
    if hasattr(model, "embedding"):
        want["embedding.word_embeddings.weight"] = _chunk(F.pad(sd["model.embed_tokens.weight"], (0, 0, 0, pad)), tp, r)
    if getattr(model, "post_process", False):
        want["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        want["output_layer.weight"] = _chunk(F.pad(sd["lm_head.weight"], (0, 0, 0, pad)), tp, r)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(want))
    unknown = sorted(set(want) - set(params))
    if missing or unknown:
        raise AssertionError(f"parameters without a tensor: {missing}; tensors without a parameter: {unknown}")
    with torch.no_grad():
        for name, tensor in want.items():
            if params[name].shape != tensor.shape:
                raise AssertionError(f"{name}: {tuple(params[name].shape)} vs {tuple(tensor.shape)}")
            params[name].copy_(tensor)


def hybrid_logits_rank(hf_dir: str, tokens_path: str, out_path: str) -> None:
    """This rank's stage of the hybrid model, filled from `hf_dir`; the reporting rank saves the logits."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_mcore_bridge.megatron.gated_delta_net_layers import hybrid_block_spec
    from hf_mcore_bridge.megatron.verify import forward_stage

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    hf = AutoConfig.from_pretrained(hf_dir)
    sd = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    config = _config(hf, tp, pp)
    multiple = PADDED_VOCAB_MULTIPLE * tp
    padded = -(-hf.vocab_size // multiple) * multiple
    model = GPTModel(
        config,
        hybrid_block_spec(config, hf.layer_types),
        vocab_size=padded,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        rotary_percent=hf.rope_parameters["partial_rotary_factor"],
        rotary_base=hf.rope_parameters["rope_theta"],
        share_embeddings_and_output_weights=False,
    ).eval()
    _fill(model, sd, hf, padded, tp, parallel_state.get_tensor_model_parallel_rank())
    tokens = torch.load(tokens_path, weights_only=True)
    shape = SimpleNamespace(hidden_size=hf.hidden_size, vocab_size=hf.vocab_size)
    logits = forward_stage(model, shape, tokens, torch.float32)  # type: ignore[arg-type]
    if logits is not None:
        torch.save(logits, Path(out_path))


def packed_logits_rank(hf_dir: str, tokens_path: str, lengths: list[int], out_path: str) -> None:
    """The hybrid model (one stage) on one packed row of sequences of `lengths` (`thd`, positions restarting at each
    sequence); the reporting rank saves the logits of the row."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_mcore_bridge.megatron.gated_delta_net_layers import hybrid_block_spec
    from hf_mcore_bridge.megatron.sdpa_attention import packed_seq_params

    tp = parallel_state.get_tensor_model_parallel_world_size()
    hf = AutoConfig.from_pretrained(hf_dir)
    sd = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    config = _config(hf, tp, 1)
    multiple = PADDED_VOCAB_MULTIPLE * tp
    padded = -(-hf.vocab_size // multiple) * multiple
    model = GPTModel(
        config,
        hybrid_block_spec(config, hf.layer_types),
        vocab_size=padded,
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=hf.rope_parameters["partial_rotary_factor"],
        rotary_base=hf.rope_parameters["rope_theta"],
        share_embeddings_and_output_weights=False,
    ).eval()
    _fill(model, sd, hf, padded, tp, parallel_state.get_tensor_model_parallel_rank())
    row = torch.load(tokens_path, weights_only=True)  # [1, sum(lengths)]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        output = model(row, positions, None, packed_seq_params=packed_seq_params(cu, max(lengths), config))
        logits = gather_from_tensor_model_parallel_region(output)
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(logits[..., : hf.vocab_size].float(), Path(out_path))
