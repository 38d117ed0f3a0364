"""Core attention for megatron-core through torch's fused attention kernels, and the layer specs using it.

megatron-core's local spec (the one available without Transformer Engine) computes attention unfused: it
materialises the full `[b, heads, s, s]` score matrix and cannot take packed sequences. `SDPAttention` is a
drop-in `core_attention` module: the same inputs (`[s, b, heads, head_dim]` query/key/value, megatron's boolean
mask where True means masked) and output (`[s, b, heads * head_dim]`).

- Unpacked batches go through `scaled_dot_product_attention`. With no explicit mask it runs with `is_causal=True`
  and `enable_gqa=True`, which the flash kernel takes as is (no copies of the key/value heads); an explicit mask
  rules flash out, and the memory-efficient kernel that takes masks does not take grouped heads, so the
  key/value heads are repeated then.
- Packed sequences (`PackedSeqParams`, `qkv_format="thd"`: `[t, heads, head_dim]` with RoPE already applied per
  sequence, positions restarting at each sequence, as megatron-core's attention hands them) are attended
  causally within each sequence, so no sequence sees another:
  - on CUDA in bf16/fp16 by torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`,
    causal through `window_size=(-1, 0)`): one flash kernel over all sequences, no mask and no compilation, so
    rows of changing lengths (every GRPO micro-batch) cost nothing extra. Compiled `flex_attention` is as fast
    only for the first row length it sees: a second one makes `torch.compile` recompile it for dynamic shapes,
    and its kernel slows down. Measured on an H200 (torch 2.11, 32 query / 8 key-value heads, forward+backward,
    rows of 3 sequences): 16K tokens, head_dim 64: varlen 5.6 ms, flex 5.4 ms static / 8.4 ms dynamic; head_dim
    128: varlen 9.8 ms, flex 8.3 ms static; 4K tokens, head_dim 128: varlen 1.2 ms, flex 2.2 ms. Where the
    installed `varlen_attn` has no `enable_gqa` (torch 2.11), key/value heads are repeated first (those timings
    include the copies);
  - on CUDA otherwise (fp32, or no `varlen_attn`) by `flex_attention`, compiled once per process, with a
    `BlockMask` built directly from `cu_seqlens` at the 128 x 128 tile level (O((t/128)^2) work, never a `[t, t]`
    tensor); tiles wholly inside one sequence's past run without the mask function, tiles of other sequences are
    skipped. The mask is built once per forward pass and shared by every layer (one-entry cache keyed on the
    `cu_seqlens` tensor);
  - elsewhere (CPU) by SDPA with the dense `[t, t]` block-diagonal causal mask. On CPU `flex_attention` has no
    backward pass, uncompiled it is a reference implementation that materialises the full fp32 score matrix
    anyway, and compiling it takes tens of seconds and a C++ toolchain: for the short rows CPU runs, the dense
    mask is exact and faster.
  `SDPAttention.packed_backend` ("auto", "varlen", "flex", "dense") overrides the choice (tests use it).

At `context_parallel_size` > 1 both layouts go through `context_parallel.cp_attention` (keys and values
all-gathered over the CP group, each local query masked at its global position); attention dropout is refused
there.

Attention sinks (`softmax_type="learnable"`: a logit per query head in every softmax denominator, megatron-core's
`softmax_offset`, GPT-OSS's `sinks`) and sliding windows (`window_size` on the layers `window_attn_skip_freq`
marks) are computed explicitly (`explicit_attention`: scores, mask, softmax with the sink, values), as
megatron-core's own `DotProductAttention` does, unpacked or packed; torch's fused kernels take neither. Both are
refused under context parallelism (its attention knows neither).

Assumes no attention bias; attention dropout, which neither `varlen_attn` nor `flex_attention` implements, sends
packed rows through the dense path.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

FLEX_BLOCK = 128
"""`flex_attention`'s tile size (its default sparse block size) for the document mask."""


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """`[total, total]` boolean mask, True where a token may attend: same sequence and not in the future."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    segment = torch.bucketize(torch.arange(total, device=device), bounds[1:], right=True)
    starts = bounds[segment]
    positions = torch.arange(total, device=device)
    same = segment[:, None] == segment[None, :]
    return same & (positions[None, :] <= positions[:, None]) & (positions[None, :] >= starts[:, None])


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, config: object | None = None) -> PackedSeqParams:
    """megatron-core's `thd` parameters for one packed row: `cu_seqlens` `[n + 1]` int32, the longest sequence.

    `max_seqlen` is what megatron-core sizes the rotary table by; with it shorter than the row, RoPE positions
    restart at every sequence (`rope_utils._apply_rotary_pos_emb_thd`).

    `cu_seqlens` stays where it is given, which should be the host: megatron-core's unfused THD RoPE reads the
    sequence lengths on the host (`tolist()`, and a comparison of the row length against the tensor), for the
    query and the key of every layer. With `cu_seqlens` on a GPU each read synchronises with the device, which
    then idles while the host launches the next kernels: the profiler counted 970 synchronisation events in one
    optimizer step of the 1B shape (8 micro-batches of 4096 tokens, H200), the GPU busy 61% of the step; with
    host `cu_seqlens` the step took 0.64 s instead of 0.98 s. `SDPAttention` moves a host `cu_seqlens` to the
    device once per forward pass. Under `config.transformer_impl == "transformer_engine"` it is moved to the GPU
    here, as Transformer Engine's attention and fused RoPE take device tensors (and do not synchronise)."""
    cu = cu_seqlens.to(torch.int32)
    if getattr(config, "transformer_impl", "local") == "transformer_engine":
        cu = cu.to(torch.device("cuda", torch.cuda.current_device()))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen
    )


def document_block_mask(cu_seqlens: torch.Tensor, total: int, block: int = FLEX_BLOCK) -> Any:
    """`flex_attention`'s `BlockMask` for causal attention within each packed sequence.

    Tokens are numbered by sequence (`doc`; positions past `total` in the last tile form one more sequence of
    their own). With sequences contiguous and in order, q tile i and kv tile j < i share a sequence exactly when
    the last sequence of j is the first of i, and every pair in them does when the first sequence of j is the
    last of i (a "full" tile, computed without the mask function); the diagonal tile is always partial.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = cu_seqlens.device
    tiles = -(-total // block)
    doc = torch.bucketize(
        torch.arange(tiles * block, device=device, dtype=torch.int32), cu_seqlens[1:].to(torch.int32), right=True
    ).to(torch.int32)
    first, last = doc[::block], doc[block - 1 :: block]
    q_tile = torch.arange(tiles, device=device)[:, None]
    kv_tile = torch.arange(tiles, device=device)[None, :]
    touched = (kv_tile <= q_tile) & (last[None, :] >= first[:, None])
    full = (kv_tile < q_tile) & (first[None, :] == last[:, None])
    partial = touched & ~full

    def ordered(tiles_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles_mask.sum(-1, dtype=torch.int32)
        indices = torch.argsort(tiles_mask.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(total, total)
    )


_device_cu_seqlens: tuple[torch.Tensor, int, torch.Tensor] | None = None


def cu_seqlens_on(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`cu_seqlens` (int32) on `device`: a host tensor is copied once (asynchronously, from pinned memory) and the
    copy reused by every layer and by the backward pass (one-entry cache holding the host tensor, as
    `_cached_block_mask` does, so the flex mask cache sees one device tensor per row)."""
    global _device_cu_seqlens
    if cu_seqlens.device == device:
        return cu_seqlens.to(torch.int32)
    cached = _device_cu_seqlens
    hit = cached is not None and cached[0] is cu_seqlens and cached[1] == cu_seqlens._version
    if hit and cached is not None and cached[2].device == device:
        return cached[2]
    host = cu_seqlens.to(torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True)
    _device_cu_seqlens = (cu_seqlens, cu_seqlens._version, moved)
    return moved


_compiled_flex: Callable[..., torch.Tensor] | None = None
_mask_cache: tuple[torch.Tensor, int, int, Any] | None = None


def _flex_attention() -> Callable[..., torch.Tensor]:
    """`flex_attention` compiled once per process: uncompiled it runs an unfused reference implementation."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _cached_block_mask(cu_seqlens: torch.Tensor, total: int) -> Any:
    """The row's `BlockMask`, built by the first layer and reused by the others (and by the backward pass).

    The cache holds the `cu_seqlens` tensor itself, so its identity cannot be taken over by a new tensor, and
    its version counter, so an in-place change is noticed."""
    global _mask_cache
    cached = _mask_cache
    if cached is not None and cached[0] is cu_seqlens and cached[1] == cu_seqlens._version and cached[2] == total:
        return cached[3]
    mask = document_block_mask(cu_seqlens, total)
    _mask_cache = (cu_seqlens, cu_seqlens._version, total, mask)
    return mask


@functools.cache
def _varlen_attn() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether the installed `varlen_attn` takes grouped heads itself (looked up once: attention is a hot path)."""
    varlen_attn = _varlen_attn()
    return varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def _varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    varlen_attn = _varlen_attn()
    if varlen_attn is None:
        raise ValueError("this torch has no torch.nn.attention.varlen")
    groups = query.shape[1] // key.shape[1]
    kwargs: dict[str, Any] = {}
    if groups > 1 and _varlen_takes_gqa():
        kwargs["enable_gqa"] = True
    elif groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0), **kwargs)


def _auto_backend(query: torch.Tensor, dropout: float) -> str:
    if not query.is_cuda or dropout:
        return "dense"
    if query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None:
        return "varlen"
    return "flex"


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    backend: str = "auto",
    dropout: float = 0.0,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Document-causal attention over packed sequences. query `[t, heads, d]`, key/value `[t, groups, d]` ->
    `[t, heads, d]`; `cu_seqlens` `[n + 1]`, starting at 0 and ending at t; `max_seqlen` its longest sequence
    (read from `cu_seqlens` when not given).

    `backend`: "varlen" (torch's variable-length flash attention; CUDA, bf16/fp16), "flex" (`flex_attention`,
    compiled on CUDA), "dense" (SDPA with a `[t, t]` mask) or "auto" (see the module docstring)."""
    if backend not in ("auto", "varlen", "flex", "dense"):
        raise ValueError(f"unknown packed attention backend {backend!r}")
    if backend == "auto":
        backend = _auto_backend(query, dropout)
    if dropout and backend != "dense":
        raise ValueError(f"the {backend} packed attention does not implement attention dropout")
    if backend == "varlen":
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return _varlen(query, key, value, cu_seqlens, max_seqlen, scale)
    total = query.shape[0]
    q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))  # [1, heads, t, d]
    if backend == "flex":
        block_mask = _cached_block_mask(cu_seqlens, total)
        flex = _flex_attention() if query.is_cuda else _eager_flex()
        out = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:
        allowed = block_causal_mask(cu_seqlens, total, query.device)
        out = _sdpa(q, k, v, allowed, causal=False, scale=scale, dropout=dropout)
    return out.squeeze(0).permute(1, 0, 2)


def _eager_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    causal: bool,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """SDPA on `[b, heads, s, d]` queries and `[b, groups, s, d]` keys/values."""
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and allowed is None  # flash takes grouped heads; the kernels that take masks do not
    if groups > 1 and not gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def window_band(queries: int, keys: int, left: int, device: torch.device) -> torch.Tensor:
    """`[queries, keys]` boolean, True where key j is at most `left` positions before query i and not after it
    (the last query is the last key: megatron-core's `window_size=(left, 0)`)."""
    offset = keys - queries
    distance = torch.arange(queries, device=device)[:, None] + offset - torch.arange(keys, device=device)[None, :]
    return (distance >= 0) & (distance <= left)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention on `[b, heads, s, d]` queries and `[b, groups, s, d]` keys/values where `allowed` (broadcast to
    `[b, heads, s, s]`); `sinks` `[heads]`: a logit per head joining each softmax denominator with no value
    (transformers' GPT-OSS `eager_attention_forward`, megatron-core's `SoftmaxOne`). Softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=dropout) if dropout else probs
    return torch.matmul(probs.to(v.dtype), v)


class SDPAttention(MegatronModule):
    """megatron-core `core_attention` computed by torch's fused attention (SDPA; `flex_attention` when packed)."""

    packed_backend: ClassVar[str] = "auto"
    """How packed rows are attended: "auto" (varlen or flex on CUDA, dense elsewhere), "varlen", "flex" or "dense".
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        self.cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state

            cp = getattr(pg_collection, "cp", None)
            self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # multi-latent attention passes its query/key and value head widths (they differ) and its own scale
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        from megatron.core.transformer.utils import is_layer_window_attention

        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window: int | None = config.window_size[0] if windowed and config.window_size is not None else None
        if windowed and config.window_size is not None and config.window_size[1] != 0:
            raise ValueError(f"window_size={config.window_size}: only causal windows (right 0) are supported")
        self.tp_group: Any = None
        self.softmax_offset: torch.Tensor | None = None
        if config.softmax_type == "learnable":
            self._add_softmax_offset(config, pg_collection)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by SDPAttention")

    def _add_softmax_offset(self, config: TransformerConfig, pg_collection: object | None) -> None:
        """The sinks of this rank's heads, a parameter split with the heads over tensor parallelism."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.tp_group = _tp_group(pg_collection)
        heads = config.num_attention_heads // self.tp_group.size()
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            config.init_method(offset)
        set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)
        self.softmax_offset = offset

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """The sinks, split over tensor parallelism along the heads (megatron-core's `DotProductAttention`'s)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if self.softmax_offset is None:
            return {}
        state = self.state_dict(prefix="", keep_vars=True)
        dp_cp = (metadata or {}).get("dp_cp_group")
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp
        )

    @property
    def explicit(self) -> bool:
        """Sinks or a window: attention computed by `explicit_attention`."""
        return self.softmax_offset is not None or self.window is not None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        dropout = self.dropout if self.training else 0.0
        if self.cp_group is not None:
            if self.explicit:
                raise ValueError(
                    "attention sinks and sliding windows (softmax_type, window_size) are not implemented under "
                    "context parallelism"
                )
            return self._context_parallel(query, key, value, attention_mask, dropout, packed_seq_params)
        if self.explicit:
            return self._explicit(query, key, value, attention_mask, dropout, packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = cu_seqlens_on(packed_seq_params.cu_seqlens_q, query.device)
            out = packed_attention(
                query,
                key,
                value,
                cu_seqlens,
                scale=self.softmax_scale,
                backend=self.packed_backend if dropout == 0.0 else "dense",
                dropout=dropout,
                max_seqlen=packed_seq_params.max_seqlen_q,
            )
            return out.reshape(query.shape[0], -1)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        allowed = None if attention_mask is None else ~attention_mask
        out = _sdpa(q, k, v, allowed, causal=causal, scale=self.softmax_scale, dropout=dropout)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _explicit(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float,
        packed_seq_params: PackedSeqParams | None,
    ) -> torch.Tensor:
        """Attention with sinks and/or the window: each packed sequence, or each row, causally (or by the given
        mask), the window cutting the keys further back than `window` positions."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # [t, heads, d] -> [1, heads, t, d]
            cu_seqlens = cu_seqlens_on(packed_seq_params.cu_seqlens_q, query.device)
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
            allowed = block_causal_mask(cu_seqlens, query.shape[0], query.device)
        else:  # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            if attention_mask is None:
                allowed = window_band(q.shape[2], k.shape[2], k.shape[2], query.device)
            else:
                allowed = ~attention_mask
        if self.window is not None:
            allowed = allowed & window_band(q.shape[2], k.shape[2], self.window, query.device)
        out = explicit_attention(q, k, v, allowed, scale=self.softmax_scale, sinks=self.softmax_offset, dropout=dropout)
        if packed:
            return out.squeeze(0).permute(1, 0, 2).reshape(query.shape[0], -1)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _context_parallel(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float,
        packed_seq_params: PackedSeqParams | None,
    ) -> torch.Tensor:
        from hf_mcore_bridge.megatron.context_parallel import cp_attention

        if dropout:
            raise ValueError("attention dropout is not implemented under context parallelism")
        cp = self.config.context_parallel_size
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q.cpu()
            out = cp_attention(
                query.unsqueeze(1),
                key.unsqueeze(1),
                value.unsqueeze(1),
                self.cp_group,
                cu_seqlens,
                scale=self.softmax_scale,
            )
            return out.reshape(query.shape[0], -1)
        if attention_mask is not None:
            raise ValueError("under context parallelism rows are attended causally: an explicit mask is refused")
        cu_seqlens = torch.tensor([0, query.shape[0] * cp])
        out = cp_attention(query, key, value, self.cp_group, cu_seqlens, scale=self.softmax_scale)
        return out.reshape(query.shape[0], query.shape[1], -1)


def _tp_group(pg_collection: object | None) -> Any:
    """The tensor-parallel group: the collection's, else megatron-core's global one."""
    tp = getattr(pg_collection, "tp", None)
    if tp is not None:
        return tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def use_sdpa(spec: object) -> object:
    """Put `SDPAttention` in as the core attention of a layer spec or of every layer of a block spec."""
    layer_specs = getattr(spec, "layer_specs", None) or [spec]
    for layer in layer_specs:
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
