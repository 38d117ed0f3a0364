"""Every tensor's full shape and dtype checked against the model config before anything is written.

The expected shapes come from the architecture's table (each entry states its HF tensors' shapes in model
dimensions, `Size`) resolved with the `ModelSpec`; only headers are read (safetensors headers, DCP metadata,
the shard shapes of legacy files), never tensor data. The same expectations serve both directions: HF tensors
against `config.json`, and the global megatron-core tensors of a Megatron checkpoint (built from the HF shapes
by the entry's own `mcore_shape`) against the config the checkpoint is exported with (its HF assets or `args`).

Dtypes: weights must be floating point; a checkpoint whose floating tensors mix dtypes is refused unless a
target dtype is given, in which case everything is cast to it and a one-line note says so. Tensors that both sides
hold in float32 whatever the model's dtype (`Direct.float32`: the router's expert bias) are left out of that
choice and stay float32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.checkpoint import expert_parts
from hf_mcore_bridge.checkpoint.dtypes import FLOAT32, DType, of
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.mapping_types import Dims, Shape, Size
from hf_mcore_bridge.models.spec import ModelSpec

Resolved = dict[Size, tuple[int, str]]
"""Each model dimension's size and the config field(s) it comes from."""


_MLA_MEGATRON_LABELS = {
    Size.MLA_Q: "num_attention_heads * (qk_head_dim + qk_pos_emb_head_dim)",
    Size.Q_LORA: "q_lora_rank",
    Size.KV_LORA: "kv_lora_rank",
    Size.KV_DOWN: "kv_lora_rank + qk_pos_emb_head_dim",
    Size.KV_UP: "num_attention_heads * (qk_head_dim + v_head_dim)",
    Size.MLA_V: "num_attention_heads * v_head_dim",
    Size.TWO_HIDDEN: "2 * hidden_size",
}

_LINEAR_LABELS = {
    Size.Q_GATED: "2 * num_attention_heads * head_dim",
    Size.LINEAR_QKV: "2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * linear_value_head_dim",
    Size.LINEAR_QKVZ: "2 * (linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * "
    "linear_value_head_dim)",
    Size.LINEAR_V: "linear_num_value_heads * linear_value_head_dim",
    Size.LINEAR_HEADS: "linear_num_value_heads",
    Size.LINEAR_BA: "2 * linear_num_value_heads",
    Size.LINEAR_V_HEAD: "linear_value_head_dim",
    Size.CONV_KERNEL: "linear_conv_kernel_dim",
}
"""Gated attention's and Gated DeltaNet's dimensions, under the HF config's names (megatron-core's are alike)."""


def hf_sizes(model: ModelSpec, config: Mapping[str, Any]) -> Resolved:
    """Model dimensions labelled with the HF `config.json` fields they come from (the architecture's own names
    where it has them, `Architecture.hf_size_fields`)."""
    fields = model.arch.hf_size_fields
    labels = {
        Size.HIDDEN: "hidden_size",
        Size.Q: "num_attention_heads * head_dim",
        Size.KV: "num_key_value_heads * head_dim",
        Size.HEAD_DIM: "head_dim",
        Size.HEADS: "num_attention_heads",
        Size.FFN: "intermediate_size",
        # Mixtral keeps the expert width in intermediate_size and the expert count in num_local_experts
        Size.EXPERT_FFN: "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size",
        Size.SHARED_FFN: "shared_expert_intermediate_size",
        Size.VOCAB: "vocab_size",
        Size.EXPERTS: "num_experts" if config.get("num_experts") else "num_local_experts",
        Size.ONE: "1",
        Size.TWO_HIDDEN: "2 * hidden_size",
        **_LINEAR_LABELS,
        **(fields or {}),
    }
    return {size: (value, labels[size]) for size, value in model.sizes().items() if value is not None}


def megatron_sizes(model: ModelSpec) -> Resolved:
    """Model dimensions labelled with the Megatron-LM argument names they correspond to."""
    labels = {
        Size.HIDDEN: "hidden_size",
        Size.Q: "num_attention_heads * kv_channels",
        Size.KV: "num_query_groups * kv_channels",
        Size.HEAD_DIM: "kv_channels",
        Size.HEADS: "num_attention_heads",
        Size.FFN: "ffn_hidden_size",
        Size.EXPERT_FFN: "moe_ffn_hidden_size",
        Size.SHARED_FFN: "moe_shared_expert_intermediate_size",
        Size.VOCAB: "vocab_size",
        Size.EXPERTS: "num_experts",
        Size.ONE: "1",
        **_MLA_MEGATRON_LABELS,
        **_LINEAR_LABELS,
    }
    return {size: (value, labels[size]) for size, value in model.sizes().items() if value is not None}


def concrete(shape: Shape, sizes: Resolved) -> tuple[int, ...]:
    return tuple(sizes[s][0] for s in shape)


def explain(shapes: Iterable[Shape], sizes: Resolved, extra: Iterable[str] = ()) -> str:
    """`hidden_size=64, intermediate_size=96`: the config fields that determine a set of shapes."""
    seen = dict.fromkeys(sizes[s][1] + f"={sizes[s][0]}" for shape in shapes for s in shape if s is not Size.ONE)
    return ", ".join([*seen, *extra])


def _fmt(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def mismatch(name: str, where: str, found: tuple[int, ...], expected: tuple[int, ...], why: str) -> CheckpointError:
    return CheckpointError(
        f"{name} in {where} has shape {_fmt(found)}, but the config implies {_fmt(expected)} ({why})"
    )


def check_hf_shapes(
    expected: Mapping[str, Shape],
    sizes: Resolved,
    info: Callable[[str], tuple[tuple[int, ...], str]],
    fused: Callable[[str], tuple[str, bool, str] | None] = lambda name: None,
) -> None:
    """Every HF tensor's full shape against the config, in table order; the first difference is the error.

    `info(name)` gives (shape, file name); `fused(name)` says whether a per-expert name is read from a fused
    transformers-5 tensor (fused name, has an expert axis, part), whose own shape is then what is checked.
    """
    checked_fused: set[str] = set()
    for name, shape in expected.items():
        want = concrete(shape, sizes)
        source = fused(name)
        if source is not None:
            fused_name, per_expert, part = source
            if fused_name in checked_fused:
                continue
            checked_fused.add(fused_name)
            shape = ((Size.EXPERTS,) if per_expert else ()) + shape
            want = concrete(shape, sizes)
            lead = 1 if per_expert else 0  # the expert axis, then one expert's slice
            want = (*want[:lead], *expert_parts.fused_shape(part, want[lead:]))
            name = fused_name
        found, where = info(name)
        if found != want:
            raise mismatch(name, where, found, want, explain([shape], sizes))


def check_mcore_shape(
    key: str,
    location: Callable[[str], str],
    found: tuple[int, ...],
    leading: tuple[int, ...],
    hf_expected: Mapping[str, Shape],
    mcore_shape: Callable[[Mapping[str, tuple[int, ...]], Dims], tuple[int, ...]],
    sizes: Resolved,
    dims: Dims,
) -> None:
    """A Megatron tensor's global shape (leading layer / expert axes included) against the config.

    `location(key)` names the file the tensor is read from (looked up only for the message)."""
    hf_shapes = {name: concrete(shape, sizes) for name, shape in hf_expected.items()}
    want = (*leading, *mcore_shape(hf_shapes, dims))
    if found != want:
        vocab = any(Size.VOCAB in shape for shape in hf_expected.values())
        padded = [f"padded vocabulary={dims.padded_vocab_size}"] if vocab else []
        raise mismatch(key, location(key), found, want, explain(hf_expected.values(), sizes, padded))


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype tensors are written in, and the note to show when that casts a mixed checkpoint."""

    dtype: DType
    note: str | None = None


def choose_dtype(
    dtypes: Mapping[str, Any], where: Callable[[str], str], requested: Any | None, flag: str
) -> DtypeChoice:
    """Refuse non-floating weights; refuse mixed floating dtypes unless `requested` (then note the cast).

    `dtypes` maps each tensor (in table order) to its dtype (`DType`s or torch's), `where(name)` names its file,
    `flag` is how the user asks for a dtype (`--dtype`).
    """
    dtypes = {name: of(dtype) for name, dtype in dtypes.items()}
    requested = None if requested is None else of(requested)
    check_floating(dtypes, where)
    counts = Counter(dtypes.values())
    if len(counts) <= 1:
        return DtypeChoice(requested or next(iter(counts), FLOAT32))
    first = {dtype: next(n for n, d in dtypes.items() if d == dtype) for dtype in counts}
    parts = [f"{_name(d)} ({c} tensor{'s' * (c != 1)}, e.g. {first[d]})" for d, c in counts.most_common()]
    mixed = ", ".join(parts)
    if requested is None:
        raise CheckpointError(
            f"the checkpoint mixes dtypes: {mixed}; pass {flag} bf16, fp16 or fp32 to cast every tensor to one"
        )
    summary = " and ".join(f"{c} {_name(d)}" for d, c in counts.most_common())
    return DtypeChoice(
        requested, f"the checkpoint mixes dtypes ({summary} tensors); all cast to {_name(requested)} ({flag})"
    )


def check_floating(dtypes: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """Refuse a tensor that is not floating point, naming it and its file."""
    for name, dtype in dtypes.items():
        if not of(dtype).floating:
            raise CheckpointError(
                f"{name} in {where(name)} has dtype {_name(dtype)}; weights must be floating point "
                "(bfloat16, float16 or float32)"
            )


def _name(dtype: DType) -> str:
    return dtype.name
