"""The shared decoder (Llama, Mistral, Qwen2, Qwen3) with fused `qkv_proj` / `gate_up_proj`, and its weight loader.

Layout follows the inference convention: a batch is a flat run of tokens `[T]` with their positions, and the
attention metadata says how tokens group into sequences and where they live in the paged KV cache
(`attention.py`). Numerics follow transformers' modules (float32 RMSNorm statistics, float32 rotary tables cast
to the activation dtype), so an fp32 engine reproduces an fp32 HF model to rounding; in bf16 the fused RMSNorm
rounds once where transformers rounds twice.

Weights: parameters are created empty and filled only through `load_weights`, which takes HF names and full
(unsharded) tensors in any order and in any number of calls; `{q,k,v}_proj` go into row slices of `qkv_proj`,
`{gate,up}_proj` into `gate_up_proj` (the name table is `arch.weight_table`). Copies are in place, so a refit
keeps every parameter's storage (and any CUDA graph captured over it) valid. `check_loaded` names whatever has not
been loaded since the weights were (re)allocated.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_mcore_bridge.engine.arch import (
    Direct,
    FusedGateUp,
    FusedQKV,
    ModelConfig,
    RopeConfig,
    ignored_names,
    weight_table,
)
from hf_mcore_bridge.engine.attention import (
    DecodeMetadata,
    PrefillMetadata,
    decode_attention,
    prefill_attention,
    with_key_bias,
    write_kv,
)

AttentionMetadata = PrefillMetadata | DecodeMetadata


class MissingWeightsError(RuntimeError):
    """Some engine parameters were never filled by `load_weights`."""


class UnknownWeightError(KeyError):
    """`load_weights` got an HF name the model has no place for."""


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, computed with transformers' float32 op order."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "default":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [num_positions, head_dim] float32 (each frequency twice, as in `rotate_half` layout)."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel on CUDA (float32 statistics). transformers rounds the normalised activations to the
        # input dtype before the weight multiply; this rounds once, at the end: identical in float32, and in
        # bfloat16 within one rounding step.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Module):
    """A linear layer whose parameters start empty (they are always loaded, never initialised)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(num, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.split), cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(self.split[0], cfg.hidden_size, cfg.o_bias, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.arch.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.split[0] + self.split[1] :].view(tokens, kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split(self.split, dim=-1)
            q = self.q_norm(q.view(tokens, heads, head_dim))
            k = self.k_norm(k.view(tokens, kv_heads, head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # Without per-head norms q and k are rotated together: half the kernels of the decode step's RoPE.
            qk = qkv[:, : self.split[0] + self.split[1]].view(tokens, heads + kv_heads, head_dim)
            q, k = apply_rope(qk, cos, sin).split((heads, kv_heads), dim=1)
        write_kv(layer_cache, k, v, meta.slot_mapping)
        if isinstance(meta, PrefillMetadata):
            out = prefill_attention(q, k, v, meta, self.scale)
        else:
            out = decode_attention(q, layer_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.width = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: a parameter, and the rows of it (None: the whole parameter)."""

    param: str
    rows: tuple[int, int] | None = None


class CausalLM(nn.Module):
    """The decoder plus output layer; parameter names are HF's, except the fused `qkv_proj` / `gate_up_proj`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, dtype, device)
        self.lm_head = (
            self.model.embed_tokens
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        )
        cos, sin = rope_tables(rope_inv_freq(cfg.rope, cfg.head_dim), max_positions)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.targets = _expand_targets(cfg)
        self.ignored = _expand(ignored_names(cfg), cfg.num_layers)
        self.loaded: set[str] = set()
        self._shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        missing_params = {t.param for t in self.targets.values()} - set(self._shapes)
        if missing_params:
            raise AssertionError(f"weight table names parameters the model lacks: {sorted(missing_params)}")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows `logits_rows` of the flat batch (every row when None).

        input_ids, positions: [T]; kv_cache: [layers, 2, NB, BS, kv_heads, D].
        """
        h = self.model.embed_tokens(input_ids)
        if isinstance(meta, DecodeMetadata):
            meta = with_key_bias(meta, kv_cache.shape[3], h.dtype)
        cos = self.rope_cos.index_select(0, positions).to(h.dtype)
        sin = self.rope_sin.index_select(0, positions).to(h.dtype)
        for index, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_cache[index], meta)
        h = self.model.norm(h)
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
        return F.linear(h, self.lm_head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named full tensors into place; returns the HF names loaded by this call.

        Raises `UnknownWeightError` for a name the model has no place for and `ValueError` for a shape mismatch.
        """
        params = dict(self.named_parameters())
        done: set[str] = set()
        for name, tensor in weights:
            target = self.targets.get(name)
            if target is None:
                if name in self.ignored:
                    continue
                close = difflib.get_close_matches(name, list(self.targets), n=3)
                raise UnknownWeightError(f"unknown weight {name!r}; closest known names: {close}")
            dest = params[target.param].data
            if target.rows is not None:
                dest = dest[target.rows[0] : target.rows[1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
            dest.copy_(tensor)
            done.add(name)
        self.loaded |= done
        return done

    def missing_weights(self) -> list[str]:
        """HF names not loaded since the weights were last allocated."""
        return sorted(set(self.targets) - self.loaded)

    def check_loaded(self) -> None:
        """Raises `MissingWeightsError` naming every HF tensor that was never loaded."""
        missing = self.missing_weights()
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise MissingWeightsError(f"weights never loaded: {shown}")

    def release_weights(self) -> None:
        """Frees every parameter's storage (shapes are kept); `allocate_weights` brings empty ones back."""
        for _, p in self.named_parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.loaded.clear()

    def allocate_weights(self) -> None:
        """Fresh, uninitialised storage for every parameter; all of them must be loaded again."""
        for name, p in self.named_parameters():
            p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=p.device)
        self.loaded.clear()


def _expand(templates: Iterable[str], num_layers: int) -> set[str]:
    out: set[str] = set()
    for template in templates:
        layers = range(num_layers) if "{layer}" in template else (0,)
        out |= {template.format(layer=layer) for layer in layers}
    return out


def _expand_targets(cfg: ModelConfig) -> dict[str, Target]:
    """HF name -> target, for every layer (the table's `{layer}` placeholder filled in)."""
    q_rows = cfg.num_heads * cfg.head_dim
    kv_rows = cfg.num_kv_heads * cfg.head_dim
    ffn = cfg.intermediate_size
    targets: dict[str, Target] = {}
    for layer in range(cfg.num_layers):
        for entry in weight_table(cfg):
            if "{layer}" not in _first_name(entry) and layer > 0:
                continue
            fill = {"layer": layer}
            if isinstance(entry, Direct):
                name = entry.name.format(**fill)
                targets[name] = Target(name)
            elif isinstance(entry, FusedQKV):
                param = entry.target.format(**fill)
                targets[entry.q.format(**fill)] = Target(param, (0, q_rows))
                targets[entry.k.format(**fill)] = Target(param, (q_rows, q_rows + kv_rows))
                targets[entry.v.format(**fill)] = Target(param, (q_rows + kv_rows, q_rows + 2 * kv_rows))
            else:
                param = entry.target.format(**fill)
                targets[entry.gate.format(**fill)] = Target(param, (0, ffn))
                targets[entry.up.format(**fill)] = Target(param, (ffn, 2 * ffn))
    return targets


def _first_name(entry: Direct | FusedQKV | FusedGateUp) -> str:
    return entry.name if isinstance(entry, Direct) else entry.target
