"""Gated DeltaNet linear attention (Qwen3-Next's and Qwen3.5's `linear_attn`) over the engine's flat token layout.

A batch is a flat run of tokens `[T, hidden]`, several sequences concatenated (`LinearBatch`: their lengths and the
state-cache slot of each). Each sequence carries two states from one call to the next (`state_cache.StateCache`):
- the conv state `[conv_dim, kernel - 1]`: the last `kernel - 1` inputs of the causal depthwise conv1d (oldest
  first, as transformers' cache holds them);
- the recurrent state `[v_heads, head_k_dim, head_v_dim]` in float32: the delta rule's fast-weight matrix.
A fresh sequence starts from zeros in both, which is exactly transformers' forward without a cache (zero left
padding of the conv, no initial state). A call reads each sequence's states from its slot and writes the new ones
back (`index_copy_`), so a prompt may arrive in several prefill chunks, each continuing from the last.

The layer, per token: the input projections give q, k, v (one `[q; k; v]` row of `conv_dim`), the output gate z,
and per value head b and a; q, k, v pass through the causal conv1d and SiLU; q and k are L2-normalised (float32),
q scaled by `head_k_dim ** -0.5`, and each key head serves `v_heads / k_heads` consecutive value heads (grouped, as
transformers' `repeat_interleave`); `g = -exp(A_log) * softplus(a + dt_bias)` is the per-head log decay and
`beta = sigmoid(b)` the write strength of the delta rule
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
(S: `[head_k_dim, head_v_dim]`, float32). The output is RMS-normed per value head (float32 statistics, a plain
weight), times SiLU(z), then `out_proj`.

Two HF layouts of the input projections, the parameters named as HF names them:
- Qwen3.5: `in_proj_qkv` (rows `[q of every key head; k ...; v of every value head]`), `in_proj_z`, `in_proj_b`,
  `in_proj_a`;
- Qwen3-Next: `in_proj_qkvz` grouped per key head (`[q_h, k_h, v of its value heads, z of them]` for each key
  head h) and `in_proj_ba` likewise (`[b of its value heads, a of them]`); `split_fused` reorders them into the
  split layout (transformers' `fix_query_key_value_ordering`).

Prefill runs the chunked form of the recurrence (`chunked_delta_rule`: within a chunk of `CHUNK` tokens a
triangular solve replaces the token loop; one state update per chunk). Sequences of a batch are padded at their
end to a common multiple of `CHUNK`: a padded token has k = 0, beta = 0 and g = 0, so it neither writes nor decays
the state, and each sequence's final state is exact. Decode (one token per sequence) runs the recurrence once
(`recurrent_step`), with shapes that depend only on the number of sequences (capturable in a CUDA graph).

Tensor parallelism (`linear_attn_shards`): split by key heads, each rank keeping its key heads' q and k rows and
the value heads they serve (v, z, b, a, `dt_bias`, `A_log`, the conv channels of all three), `out_proj` split by
its input columns (row-parallel: partial outputs summed over the group, as attention's `o_proj`); the norm's weight
(per head dimension) is replicated. The key heads must divide by the TP size (refused otherwise; replicating key
heads over ranks, as attention does with KV heads, is not implemented). Each rank's states hold only its heads.

Simplifications: the conv has no bias and its activation is SiLU (the released models' `hidden_act`, and the
only activation read); pure torch, no fused kernels (flash-linear-attention's are CUDA/Triton only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_mcore_bridge.engine.layers import Linear, RowLinear, empty_param
from hf_mcore_bridge.engine.tp_group import TensorParallel
from hf_mcore_bridge.engine.tp_shards import Shard, TPRank, even_split

CHUNK = 64
"""Tokens per chunk of the chunked delta rule (transformers' and flash-linear-attention's default)."""

L2_EPS = 1e-6
"""The epsilon of the q/k L2 normalisation (flash-linear-attention's, as transformers uses it)."""


@dataclass(frozen=True)
class LinearAttnSpec:
    """The sizes of one Gated DeltaNet layer (every linear layer of a model has the same), full or one rank's."""

    hidden_size: int
    num_k_heads: int
    """Key (and query) heads: HF `linear_num_key_heads`."""
    num_v_heads: int
    """Value heads: HF `linear_num_value_heads`, a multiple of the key heads."""
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    """HF `linear_conv_kernel_dim`; the conv state holds `conv_kernel - 1` inputs."""
    eps: float
    """The gated RMSNorm's epsilon (HF `rms_norm_eps`)."""
    fused_projections: bool
    """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (True) or Qwen3.5's split projections (False)."""

    def __post_init__(self) -> None:
        if self.num_k_heads < 1 or self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of linear_num_key_heads "
                f"({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")

    @classmethod
    def from_hf(cls, config: Any, fused_projections: bool) -> LinearAttnSpec:
        """The sizes an HF text config (object or dict) gives; `fused_projections` is the architecture's layout."""
        get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
        if get("hidden_act") != "silu":
            raise NotImplementedError(f"linear attention with hidden_act {get('hidden_act')!r}: only 'silu'")
        return cls(
            hidden_size=get("hidden_size"),
            num_k_heads=get("linear_num_key_heads"),
            num_v_heads=get("linear_num_value_heads"),
            head_k_dim=get("linear_key_head_dim"),
            head_v_dim=get("linear_value_head_dim"),
            conv_kernel=get("linear_conv_kernel_dim"),
            eps=get("rms_norm_eps"),
            fused_projections=fused_projections,
        )

    @property
    def heads_per_key(self) -> int:
        """Value heads each key head serves."""
        return self.num_v_heads // self.num_k_heads

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and rows of its state): q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def local(self, tp: TPRank) -> LinearAttnSpec:
        """One rank's sizes: its share of the key heads and of the value heads they serve."""
        _, k_heads = even_split(self.num_k_heads, tp, "linear_num_key_heads")
        return LinearAttnSpec(
            self.hidden_size,
            k_heads,
            k_heads * self.heads_per_key,
            self.head_k_dim,
            self.head_v_dim,
            self.conv_kernel,
            self.eps,
            self.fused_projections,
        )


def linear_attn_shards(spec: LinearAttnSpec, tp: TPRank) -> dict[str, tuple[Shard, ...]]:
    """Which rows (or columns) of each full HF tensor of a linear-attention layer one rank keeps, by the name under
    `linear_attn.`: the rank's part is its pieces concatenated along their dim (`take`); no pieces: the whole tensor
    (replicated). `ValueError` if the key heads do not divide by the TP size."""
    first_k, k_heads = even_split(spec.num_k_heads, tp, "linear_num_key_heads")
    r, dk, dv = spec.heads_per_key, spec.head_k_dim, spec.head_v_dim
    first_v, v_heads = first_k * r, k_heads * r
    conv = spec.conv_dim
    # q, k and v rows of the [q; k; v] layout (in_proj_qkv's rows, the conv's channels)
    qkv = (
        Shard(0, first_k * dk, k_heads * dk, conv),
        Shard(0, spec.key_dim + first_k * dk, k_heads * dk, conv),
        Shard(0, 2 * spec.key_dim + first_v * dv, v_heads * dv, conv),
    )

    def per_v_head(width: int, dim: int = 0) -> tuple[Shard, ...]:
        return (Shard(dim, first_v * width, v_heads * width, spec.num_v_heads * width),)

    def per_k_head(width: int) -> tuple[Shard, ...]:
        return (Shard(0, first_k * width, k_heads * width, spec.num_k_heads * width),)

    shards = {
        "conv1d.weight": qkv,
        "dt_bias": per_v_head(1),
        "A_log": per_v_head(1),
        "norm.weight": (),
        "out_proj.weight": per_v_head(dv, dim=1),
    }
    if spec.fused_projections:
        shards["in_proj_qkvz.weight"] = per_k_head(2 * dk + 2 * r * dv)
        shards["in_proj_ba.weight"] = per_k_head(2 * r)
    else:
        shards["in_proj_qkv.weight"] = qkv
        shards["in_proj_z.weight"] = per_v_head(dv)
        shards["in_proj_b.weight"] = per_v_head(1)
        shards["in_proj_a.weight"] = per_v_head(1)
    return shards


def take(pieces: tuple[Shard, ...], tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A rank's part of a full tensor: its pieces concatenated (the tensor itself when there are none)."""
    if not pieces:
        return tensor
    return torch.cat([piece.take(tensor, name) for piece in pieces], dim=pieces[0].dim)


@dataclass(frozen=True)
class LinearBatch:
    """How a flat batch of tokens groups into sequences, and where each sequence's states live.

    Built once per forward pass (`prefill_batch`, `decode_batch`) and read by every linear-attention layer."""

    slots: torch.Tensor
    """[S] int64: the state-cache slot of each sequence."""
    decode: bool
    """One token per sequence (the recurrent step); else a prefill, which the fields below describe."""
    window_rows: torch.Tensor | None = None
    """[T, kernel] int64: the rows of the extended input (each sequence's conv state, then its tokens) that each
    token's conv window reads."""
    state_rows: torch.Tensor | None = None
    """[S * (kernel - 1)] int64: where each sequence's conv state goes in the extended input."""
    token_rows: torch.Tensor | None = None
    """[T] int64: where each token goes in the extended input."""
    new_state_rows: torch.Tensor | None = None
    """[S, kernel - 1] int64: the rows of the extended input that are each sequence's conv state afterwards."""
    pad_index: torch.Tensor | None = None
    """[T] int64: each token's row in the padded `[S * padded_len]` layout of the chunked delta rule."""
    padded_len: int = 0
    """The longest sequence rounded up to a multiple of `CHUNK`."""


def prefill_batch(lengths: list[int], slots: list[int], conv_kernel: int, device: torch.device | str) -> LinearBatch:
    """The batch of sequences of `lengths` tokens (prompt chunks), in that order, whose states are in `slots`."""
    if len(lengths) != len(slots) or not lengths or min(lengths) < 1:
        raise ValueError(
            f"prefill batch: need one slot per sequence and at least one token each, got lengths "
            f"{lengths} and slots {slots}"
        )
    if len(set(slots)) != len(slots):
        raise ValueError(f"prefill batch: two sequences share a state slot: {slots}")
    width = conv_kernel - 1
    n = torch.tensor(lengths, dtype=torch.int64)
    seqs = torch.arange(len(lengths))
    seq_of_token = torch.repeat_interleave(seqs, n)
    starts = torch.cumsum(n, 0) - n
    token = torch.arange(int(n.sum()))
    pos = token - starts[seq_of_token]
    ext_start = starts + seqs * width  # where sequence s's conv state begins in the extended input
    token_rows = token + (seq_of_token + 1) * width
    window_rows = (token_rows - width)[:, None] + torch.arange(conv_kernel)
    state_rows = (ext_start[:, None] + torch.arange(width)).reshape(-1)
    new_state_rows = (ext_start + n)[:, None] + torch.arange(width)
    padded_len = -(-max(lengths) // CHUNK) * CHUNK
    pad_index = seq_of_token * padded_len + pos

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    return LinearBatch(
        slots=put(torch.tensor(slots, dtype=torch.int64)),
        decode=False,
        window_rows=put(window_rows),
        state_rows=put(state_rows),
        token_rows=put(token_rows),
        new_state_rows=put(new_state_rows),
        pad_index=put(pad_index),
        padded_len=padded_len,
    )


def decode_batch(slots: torch.Tensor) -> LinearBatch:
    """One token per sequence, sequence i's state in `slots[i]` ([S] int64, on the model's device). Padding rows
    of a CUDA-graph bucket may all name the scratch slot: their writes race there, and nothing reads it."""
    return LinearBatch(slots=slots, decode=True)


def split_fused(
    qkvz: torch.Tensor, ba: torch.Tensor, spec: LinearAttnSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's per-key-head groups -> the split layout: (qkv [T, conv_dim] as `[q; k; v]`, z [T, v_heads *
    head_v_dim], b [T, v_heads], a [T, v_heads]); `spec` this rank's sizes."""
    tokens = qkvz.shape[0]
    r, dk, dv = spec.heads_per_key, spec.head_k_dim, spec.head_v_dim
    q, k, v, z = qkvz.view(tokens, spec.num_k_heads, -1).split((dk, dk, r * dv, r * dv), dim=-1)
    b, a = ba.view(tokens, spec.num_k_heads, 2 * r).split((r, r), dim=-1)
    qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
    return qkv, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, batch: LinearBatch) -> torch.Tensor:
    """The causal depthwise conv1d of every sequence continuing from its conv state, then SiLU; writes the new
    states into `conv_cache` ([slots, channels, kernel - 1]). `x`: [T, channels]; `weight`: [channels, kernel]."""
    width = weight.shape[1] - 1
    states = conv_cache.index_select(0, batch.slots).transpose(1, 2).to(x.dtype)  # [S, width, channels]
    if batch.decode:
        windows = torch.cat([states, x[:, None]], dim=1)  # [S, kernel, channels]
        new_states = windows[:, 1:]
    else:
        assert batch.state_rows is not None and batch.token_rows is not None
        assert batch.window_rows is not None and batch.new_state_rows is not None
        extended = x.new_empty(x.shape[0] + states.shape[0] * width, x.shape[1])
        extended.index_copy_(0, batch.state_rows, states.reshape(-1, x.shape[1]))
        extended.index_copy_(0, batch.token_rows, x)
        windows = extended[batch.window_rows]  # [T, kernel, channels]
        new_states = extended[batch.new_state_rows]  # [S, width, channels]
    conv_cache.index_copy_(0, batch.slots, new_states.transpose(1, 2).to(conv_cache.dtype))
    out = torch.einsum("tkc,ck->tc", windows.to(weight.dtype), weight)
    return F.silu(out).to(x.dtype)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (flash-linear-attention's definition)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over padded sequences, chunk by chunk, float32.

    q, k: [S, H, L, dk] (q already scaled); v: [S, H, L, dv]; g, beta: [S, H, L]; state: [S, H, dk, dv], the
    initial state of each sequence; L a multiple of `chunk`. Returns (outputs [S, H, L, dv], final states).

    Within a chunk, with G_t the cumulative log decay from the chunk's start and S0 the state before it, the
    state is S_t = e^{G_t} S0 + sum_{j<=t} e^{G_t - G_j} k_j u_j^T where the written values u solve the unit
    lower-triangular system (I + L) u = beta v - beta e^{G} K S0, L[t, j] = beta_t e^{G_t - G_j} k_t.k_j (j < t)."""
    sequences, heads, length, _ = k.shape
    shape = (sequences, heads, length // chunk, chunk)
    q, k, v = (x.reshape(*shape, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(shape), beta.reshape(shape)
    cum = g.cumsum(-1)  # G_t
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)  # j > t
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()  # e^{G_t - G_j}, j <= t
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    system = torch.tril(kk, -1) + torch.eye(chunk, dtype=k.dtype, device=k.device)
    written_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    reads_state = torch.linalg.solve_triangular(
        system, k * (beta * cum.exp())[..., None], upper=False, unitriangular=True
    )
    qk = (q @ k.transpose(-1, -2)) * decay  # within-chunk scores, j <= t
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(shape[2]):
        u = written_v[:, :, c] - reads_state[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + qk[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    return out.reshape(sequences, heads, length, -1), state


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule per sequence, float32. q, k: [S, H, dk] (q scaled); v: [S, H, dv];
    g, beta: [S, H]; state: [S, H, dk, dv]. Returns (outputs [S, H, dv], new states)."""
    state = state * g.exp()[..., None, None]
    predicted = (k[..., None] * state).sum(-2)  # S^T k: [S, H, dv]
    state = state + k[..., None] * ((v - predicted) * beta[..., None])[..., None, :]
    return (q[..., None] * state).sum(-2), state


class ConvWeight(nn.Module):
    """The depthwise conv's weight, HF's `conv1d.weight` shape `[channels, 1, kernel]`."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(channels, 1, kernel, dtype=dtype, device=device)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (float32 statistics, plain weight), times SiLU of the gate z, as transformers'
    `Qwen3NextRMSNormGated` rounds: normalised activations to the input dtype, times the weight, times SiLU(z) in
    float32, then to the input dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (this rank's heads), parameters named as HF's under `linear_attn.`. `tp`: the group
    `out_proj`'s partial outputs are summed over (None: no sum)."""

    def __init__(
        self,
        spec: LinearAttnSpec,
        place: TPRank,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.full = spec
        self.spec = local = spec.local(place)
        self.place = place
        hidden = spec.hidden_size
        if spec.fused_projections:
            per_key = 2 * local.head_k_dim + 2 * local.heads_per_key * local.head_v_dim
            self.in_proj_qkvz = Linear(hidden, local.num_k_heads * per_key, False, dtype, device)
            self.in_proj_ba = Linear(hidden, 2 * local.num_v_heads, False, dtype, device)
        else:
            self.in_proj_qkv = Linear(hidden, local.conv_dim, False, dtype, device)
            self.in_proj_z = Linear(hidden, local.value_dim, False, dtype, device)
            self.in_proj_b = Linear(hidden, local.num_v_heads, False, dtype, device)
            self.in_proj_a = Linear(hidden, local.num_v_heads, False, dtype, device)
        self.conv1d = ConvWeight(local.conv_dim, spec.conv_kernel, dtype, device)
        self.dt_bias = empty_param(local.num_v_heads, dtype=dtype, device=device)
        self.A_log = empty_param(local.num_v_heads, dtype=dtype, device=device)
        self.norm = GatedRMSNorm(local.head_v_dim, spec.eps, dtype, device)
        self.out_proj = RowLinear(local.value_dim, hidden, False, dtype, device, tp)

    def load_full(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies full (unsharded) HF tensors, named as under `linear_attn.`, into this rank's parameters; returns
        the names loaded. `KeyError` for a name the layer does not have."""
        shards = linear_attn_shards(self.full, self.place)
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in shards:
                raise KeyError(f"linear attention has no parameter {name!r} (has {sorted(shards)})")
            with torch.no_grad():
                params[name].copy_(take(shards[name], tensor, name))
            loaded.add(name)
        return loaded

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [T, conv_dim], z [T, value_dim], b [T, v_heads], a [T, v_heads]) of this rank's heads."""
        if self.spec.fused_projections:
            return split_fused(self.in_proj_qkvz(x), self.in_proj_ba(x), self.spec)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(
        self, x: torch.Tensor, batch: LinearBatch, conv_cache: torch.Tensor, recurrent_cache: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; reads and writes the states of `batch.slots` in the layer's caches
        (`conv_cache` [slots, conv_dim, kernel - 1], `recurrent_cache` [slots, v_heads, head_k_dim, head_v_dim],
        float32)."""
        spec, tokens = self.spec, x.shape[0]
        qkv, z, b, a = self.project(x)
        qkv = causal_conv(qkv, self.conv1d.weight[:, 0], conv_cache, batch)
        q, k, v = qkv.split((spec.key_dim, spec.key_dim, spec.value_dim), dim=-1)
        q = l2_normalise(q.reshape(tokens, spec.num_k_heads, spec.head_k_dim)) * spec.head_k_dim**-0.5
        k = l2_normalise(k.reshape(tokens, spec.num_k_heads, spec.head_k_dim))
        q = q.repeat_interleave(spec.heads_per_key, dim=1)
        k = k.repeat_interleave(spec.heads_per_key, dim=1)
        v = v.reshape(tokens, spec.num_v_heads, spec.head_v_dim).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid().float()
        state = recurrent_cache.index_select(0, batch.slots)
        if batch.decode:
            out, state = recurrent_step(q, k, v, g, beta, state)
        else:
            out, state = self._prefill(q, k, v, g, beta, state, batch)
        recurrent_cache.index_copy_(0, batch.slots, state)
        out = self.norm(out.to(x.dtype), z.view(tokens, spec.num_v_heads, spec.head_v_dim))
        return self.out_proj(out.reshape(tokens, -1))

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        batch: LinearBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked rule over the batch padded per sequence (`LinearBatch.pad_index`); outputs back in the
        flat layout [T, H, dv]."""
        assert batch.pad_index is not None
        rows = state.shape[0] * batch.padded_len

        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [S, H, padded_len, ...]
            out = x.new_zeros(rows, *x.shape[1:]).index_copy_(0, batch.pad_index, x)
            return out.view(state.shape[0], batch.padded_len, *x.shape[1:]).transpose(1, 2)

        out, state = chunked_delta_rule(padded(q), padded(k), padded(v), padded(g), padded(beta), state)
        out = out.transpose(1, 2).reshape(rows, *out.shape[1:2], -1)
        return out.index_select(0, batch.pad_index), state
