"""Context parallelism without Transformer Engine: the sequence split, the gathers and the attention over it.

The split is megatron-core's load-balanced one: each sequence is cut into `2 * cp` equal chunks and CP rank `r`
holds chunks `r` and `2 * cp - 1 - r` (so every rank gets the same share of causal-attention work). megatron-core's
RoPE follows the same convention (`get_pos_emb_on_this_cp_rank` for `[s, b, ...]` rows, `_get_thd_freqs_on_this_cp_rank`
for packed THD rows, which reads the GLOBAL `cu_seqlens` and divides each length by `cp`): the model is handed this
rank's tokens in that order and the global `cu_seqlens`. In a packed row each sequence is split on its own, so every
sequence length must be a multiple of `2 * cp` (`grpo.algorithm.batching` pads each rollout, as NeMo-RL does).

Attention: keys and values are all-gathered over the CP group (the Llama 3 paper's choice; with grouped KV heads
they are a small fraction of the activations) and each local query attends to the global keys with its causal
mask at its global position. The gather's backward reduce-scatters the key/value gradients (`gather_sequence`).
Ring attention would overlap the exchange with compute but needs a log-sum-exp merge of partial attention
outputs, which torch's public SDPA does not return; both move the same key/value bytes per rank. The choice is not
backed by GPU measurements yet. The mask is dense (`[local, global]` tokens), so SDPA runs its memory-efficient or
math kernel with the key/value heads repeated, not flash.

Log-probs: each rank scores its own tokens (labels are the global next tokens, split the same way), the
per-token values are all-gathered and put back in sequence order (`gather_in_order`), so every CP rank sees the
whole sequence's log-probs and computes the same loss; that gather's backward keeps this rank's slice only, so
each token's gradient flows from exactly one rank and megatron-core's DDP sums the ranks' gradients (its
schedule multiplies the loss by the CP size, its DDP averages over data x context ranks).

Assumes equal-length rows on every CP rank (they hold the same micro-batch) and no attention dropout at CP > 1.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "chunks_of_rank",
    "cp_positions",
    "gather_in_order",
    "gather_sequence",
    "merge_sequence",
    "split_sequence",
]


def chunks_of_rank(cp: int, rank: int) -> tuple[int, int]:
    """The two of `2 * cp` chunks CP rank `rank` holds: `rank` and `2 * cp - 1 - rank`."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside a group of {cp}")
    return rank, 2 * cp - 1 - rank


def cp_positions(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions in the global row (int64) of the tokens CP rank `rank` holds, in the order it holds them.

    `cu_seqlens` `[n + 1]`: the row's sequences (one sequence `[0, S]` for an unpacked row); each length must be a
    multiple of `2 * cp`. For each sequence in turn: its chunk `rank`, then its chunk `2 * cp - 1 - rank`."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    first, second = chunks_of_rank(cp, rank)
    parts = []
    for start, stop in itertools.pairwise(bounds):
        length = stop - start
        if length % (2 * cp):
            raise ValueError(f"a sequence of {length} tokens does not split into 2 x CP = {2 * cp} equal chunks")
        chunk = length // (2 * cp)
        parts += [torch.arange(start + c * chunk, start + (c + 1) * chunk) for c in (first, second)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int, cu_seqlens: torch.Tensor | None = None):
    """CP rank `rank`'s part of `x` along `dim` (the whole row as one sequence when `cu_seqlens` is None)."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, x.shape[dim]])
    return x.index_select(dim, cp_positions(cu_seqlens, cp, rank).to(x.device))


def merge_sequence(parts: list[torch.Tensor], dim: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The row back in sequence order from every CP rank's part (`parts[r]` from rank r), along `dim`."""
    cp = len(parts)
    total = sum(p.shape[dim] for p in parts)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, total])
    order = torch.cat([cp_positions(cu_seqlens, cp, r) for r in range(cp)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order).to(parts[0].device))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (ranks in order); backward: the gradient summed over ranks, this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, reduce_grad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.reduce_grad = group, reduce_grad
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.contiguous()
        if not ctx.reduce_grad:
            return grad.chunk(size)[rank].contiguous(), None, None
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad.chunk(size)[rank])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad.chunk(size)[rank].contiguous(), None, None


_order_cache: tuple[torch.Tensor, int, int, torch.device, torch.Tensor] | None = None


def _sequence_order(cu_seqlens: torch.Tensor, cp: int, device: torch.device) -> torch.Tensor:
    """Index that puts the ranks' parts, concatenated in rank order, back in sequence order (on `device`).

    Every layer gathers with the same `cu_seqlens`: a one-entry cache keyed on that tensor itself and its version
    counter (as `sdpa_attention._cached_block_mask`) builds the index once per row, not once per layer."""
    global _order_cache
    cached = _order_cache
    if cached is not None and cached[0] is cu_seqlens and cached[1:4] == (cu_seqlens._version, cp, device):
        return cached[4]
    order = torch.argsort(torch.cat([cp_positions(cu_seqlens, cp, r) for r in range(cp)])).to(device)
    _order_cache = (cu_seqlens, cu_seqlens._version, cp, device, order)
    return order


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, cu_seqlens: torch.Tensor, dim: int = 0):
    """Every CP rank's part of `x` (split along `dim` as `cp_positions` says), back in global sequence order.

    Backward: the gradients of all ranks summed, each rank keeping its own part (a reduce-scatter): for keys and
    values, which every rank's queries use."""
    gathered = _GatherSequence.apply(x.movedim(dim, 0), group, True)
    return gathered.index_select(0, _sequence_order(cu_seqlens, dist.get_world_size(group), x.device)).movedim(0, dim)


def gather_in_order(x: torch.Tensor, group: dist.ProcessGroup, cu_seqlens: torch.Tensor, dim: int = -1):
    """Per-token values of every CP rank, in sequence order along `dim`, the same on every rank.

    Backward keeps this rank's slice of the gradient, unsummed: every rank computes the same function of the
    gathered values (the loss), so each token's gradient is taken from exactly one rank."""
    gathered = _GatherSequence.apply(x.movedim(dim, 0), group, False)
    return gathered.index_select(0, _sequence_order(cu_seqlens, dist.get_world_size(group), x.device)).movedim(0, dim)


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence(s).

    query `[t, b, heads, d_k]`, key `[t, b, groups, d_k]`, value `[t, b, groups, d_v]`: this rank's tokens of rows
    of sequences `cu_seqlens` (global, on the host; `[0, S]` for plain rows) in `cp_positions` order ->
    `[t, b, heads, d_v]`. Keys and values
    are gathered in one collective; a query attends to the keys of its own sequence at global positions up to
    its own. Rows of one sequence each (unpacked rows) attend chunk by chunk with SDPA's lower-right causal bias
    (`causal_lower_right`: flash or memory-efficient kernels on a GPU, no mask tensor); packed rows take a dense
    `[t, T]` mask, exact on every device, which keeps SDPA off the flash kernel."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    # [T, b, groups, d_k + d_v]: keys and values may differ in width (multi-latent attention's do)
    kv = gather_sequence(torch.cat([key, value], dim=-1), group, cu_seqlens)
    key_all, value_all = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    if len(cu_seqlens) == 2:
        return _one_sequence(query, key_all, value_all, cp, rank, scale)
    return _packed(query, key_all, value_all, cp, rank, cu_seqlens, scale)


def _packed(
    query: torch.Tensor,
    key_all: torch.Tensor,
    value_all: torch.Tensor,
    cp: int,
    rank: int,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`cp_attention` for packed rows: this rank's queries against every key, masked by sequence and position."""
    allowed = _packed_mask(cu_seqlens, cp, rank, query.device)
    groups = query.shape[2] // key_all.shape[2]
    q = query.permute(1, 2, 0, 3)  # [b, heads, t, d]
    k, v = (x.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3) for x in (key_all, value_all))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.permute(2, 0, 1, 3)


_mask_cache: tuple[torch.Tensor, int, int, int, torch.device, torch.Tensor] | None = None


def _packed_mask(cu_seqlens: torch.Tensor, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """`[t, T]` bool, True where this rank's query (row) may attend to a global key (column): same sequence, not
    later. Built once per row and shared by the layers (one-entry cache, as `_sequence_order`)."""
    global _mask_cache
    key = (cu_seqlens._version, cp, rank, device)
    cached = _mask_cache
    if cached is not None and cached[0] is cu_seqlens and cached[1:5] == key:
        return cached[5]
    mine = cp_positions(cu_seqlens, cp, rank).to(device)
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    every = torch.arange(int(bounds[-1]), device=device)
    doc_q = torch.bucketize(mine, bounds[1:], right=True)
    doc_k = torch.bucketize(every, bounds[1:], right=True)
    allowed = (doc_q[:, None] == doc_k[None, :]) & (every[None, :] <= mine[:, None])
    _mask_cache = (cu_seqlens, *key, allowed)
    return allowed


def _one_sequence(
    query: torch.Tensor, key_all: torch.Tensor, value_all: torch.Tensor, cp: int, rank: int, scale: float
) -> torch.Tensor:
    """`cp_attention` for rows of one sequence: each of this rank's two chunks against the keys up to its end.

    Chunk `i` holds global positions `[i * c, (i + 1) * c)`, so its queries see keys `[0, (i + 1) * c)` with the
    causal diagonal aligned to the bottom right of that block."""
    from torch.nn.attention.bias import causal_lower_right

    chunk = query.shape[0] // 2
    groups = query.shape[2] // key_all.shape[2]
    k_all, v_all = (x.repeat_interleave(groups, dim=2).permute(1, 2, 0, 3) for x in (key_all, value_all))
    outs = []
    for half, index in enumerate(chunks_of_rank(cp, rank)):
        q = query[half * chunk : (half + 1) * chunk].permute(1, 2, 0, 3)  # [b, heads, c, d]
        seen = (index + 1) * chunk
        k, v = k_all[:, :, :seen], v_all[:, :, :seen]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(chunk, seen), scale=scale))
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)
