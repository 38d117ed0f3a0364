"""Rollouts -> padded micro-batches for the trainer's forward passes (pure tensor code, no model, no ranks).

A `Rollout` is one sampled completion: prompt tokens, completion tokens, the engine's log-probs of the completion
tokens, its reward and advantage. A micro-batch holds `B` rollouts as rows `prompt + completion`, right-padded
with token 0 to its longest row `S`. Log-probs are indexed by the PREDICTED position: column `j` of a `[B, S - 1]`
tensor is the log-prob of `tokens[:, j + 1]` given `tokens[:, :j + 1]`; `mask[b, j]` is 1 exactly where
`tokens[b, j + 1]` is a completion token (of a rollout the loss takes: overlong filtering leaves truncated ones out).

Two layouts:
- `make_microbatches`: one rollout per row, right padding (invisible to earlier positions under the causal mask,
  so it changes no valid log-prob); the model builds its usual causal mask.
- `pack_microbatches`: several rollouts in one row, each with its own positions (0, 1, ...) and its boundaries
  as `cu_seqlens` (megatron-core's `PackedSeqParams`, THD), so no token attends across rollouts and RoPE
  restarts per rollout; advantages then become per token. No `[S, S]` mask is built for the model (the
  attention masks by sequence itself, `sdpa_attention`); `attention_mask` derives the equivalent dense mask.

Routing replay: a rollout may carry the experts the engine chose for its tokens (`Rollout.routed_experts`); a
micro-batch then holds them as `routed_experts` `[moe_layers, k, B, S]`, the token axis last like every other
field's, so that padding, packing and the context-parallel split move them with the tokens. They are stored as id + 1
(0: no recorded choice: padding, and each rollout's last token, which the engine never ran).

Simplifications: rollouts are batched in the order given; packing fills rows first-fit-decreasing (longest first).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MicroBatch",
    "Rollout",
    "make_microbatches",
    "move_predicted",
    "pack_microbatches",
    "pad_sequences_to_multiple",
    "pad_to_length",
    "pad_to_multiple",
    "response_values",
    "sequence_padding_index",
]


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt."""

    prompt_ids: tuple[int, ...]
    """The prompt's tokens."""
    completion_ids: tuple[int, ...]
    """The generated tokens (a final stop token included)."""
    engine_logprobs: tuple[float, ...]
    """The engine's log-prob of each completion token (tempered, before top-k/top-p)."""
    reward: float = 0.0
    """The completion's reward."""
    advantage: float = 0.0
    """Its group-relative advantage."""
    truncated: bool = False
    """Generation stopped at the length limit, not on a stop token (overlong filtering masks it out of the loss)."""
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """The engine's expert ids `[moe_layers, prompt + completion - 1, k]` of every token but the last
    (`SampleOutput.routed_experts`; routing replay), or None."""

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.completion_ids:
            raise ValueError("a rollout needs at least one prompt and one completion token")
        tokens = len(self.prompt_ids) + len(self.completion_ids) - 1
        if self.routed_experts is not None and (
            self.routed_experts.dim() != 3 or self.routed_experts.shape[1] != tokens
        ):
            raise ValueError(
                f"routed_experts {tuple(self.routed_experts.shape)} must be [moe_layers, {tokens}, k] for a rollout of"
                f" {tokens + 1} tokens"
            )
        if len(self.engine_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.engine_logprobs)} engine log-probs for {len(self.completion_ids)} completion tokens"
            )


@dataclass(frozen=True)
class MicroBatch:
    """`B` rollouts padded to a common length `S`."""

    tokens: torch.Tensor
    """[B, S] int64: prompt then completion, then 0-padding."""
    position_ids: torch.Tensor
    """[B, S] int64: 0..S-1 on every row."""
    mask: torch.Tensor
    """[B, S-1] float 0/1: predicted position `j` is a completion token (of a rollout the loss takes)."""
    engine_logprobs: torch.Tensor
    """[B, S-1] float32: the engine's log-probs at the masked positions, 0 elsewhere."""
    advantages: torch.Tensor
    """[B] float32 (one rollout per row), or [B, S-1] per predicted position (packed rows)."""
    cu_seqlens: torch.Tensor | None = None
    """[n + 1] int32: where each of the n rollouts of a packed row (B = 1) starts, then S; None: unpacked rows."""
    max_seqlen: int = 0
    """The longest rollout of a packed row."""
    routed_experts: torch.Tensor | None = None
    """[moe_layers, k, B, S] int16: the engine's expert id + 1 of each token (0: none recorded), or None (routing
    replay off)."""

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """[1, 1, S, S] bool, True where attention is masked out (a packed row's block-diagonal causal mask, built
        on request: the model takes `cu_seqlens`); None for unpacked rows (the plain causal mask)."""
        if self.cu_seqlens is None:
            return None
        device = self.tokens.device
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long().to(device)
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        causal = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool, device=device).tril()
        return ~(causal & (segment[:, None] == segment[None, :]))[None, None]

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device`, but `cu_seqlens`, which stays on the host (where
        megatron-core's RoPE reads it without a device synchronisation; `sdpa_attention.packed_seq_params`)."""
        moved = {
            f.name: value.to(device)
            if isinstance(value := getattr(self, f.name), torch.Tensor) and f.name != "cu_seqlens"
            else value
            for f in dataclasses.fields(self)
        }
        return MicroBatch(**moved)

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


def _in_loss(rollout: Rollout, mask_truncated: bool) -> float:
    """The mask value of `rollout`'s completion tokens: 0 for a truncated one when those are masked out."""
    return 0.0 if mask_truncated and rollout.truncated else 1.0


def _microbatch(rollouts: Sequence[Rollout], mask_truncated: bool = False) -> MicroBatch:
    seq_len = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    rows = len(rollouts)
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)
    mask = torch.zeros(rows, seq_len - 1)
    engine = torch.zeros(rows, seq_len - 1)
    for b, rollout in enumerate(rollouts):
        prompt, completion = len(rollout.prompt_ids), len(rollout.completion_ids)
        tokens[b, :prompt] = torch.tensor(rollout.prompt_ids)
        tokens[b, prompt : prompt + completion] = torch.tensor(rollout.completion_ids)
        # the first completion token is predicted at position prompt - 1
        mask[b, prompt - 1 : prompt - 1 + completion] = _in_loss(rollout, mask_truncated)
        engine[b, prompt - 1 : prompt - 1 + completion] = torch.tensor(rollout.engine_logprobs)
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(seq_len).expand(rows, seq_len).clone(),
        mask=mask,
        engine_logprobs=engine,
        advantages=torch.tensor([r.advantage for r in rollouts], dtype=torch.float32),
        routed_experts=_routing_rows([[r] for r in rollouts], seq_len),
    )


def _routing_rows(rows: Sequence[Sequence[Rollout]], seq_len: int) -> torch.Tensor | None:
    """`[moe_layers, k, len(rows), seq_len]` int16 expert ids + 1 of the rollouts of each row, one after another
    (0 elsewhere); None where no rollout carries routing. All or none must carry it."""
    carried = [r.routed_experts is not None for row in rows for r in row]
    if not any(carried):
        return None
    if not all(carried):
        raise ValueError("routing replay needs the routed experts of every rollout; some have none")
    first = rows[0][0].routed_experts
    assert first is not None
    layers, _, k = first.shape
    out = torch.zeros(layers, k, len(rows), seq_len, dtype=torch.int16)
    for b, row in enumerate(rows):
        offset = 0
        for rollout in row:
            routed = rollout.routed_experts
            assert routed is not None
            if routed.shape[0] != layers or routed.shape[2] != k:
                raise ValueError(f"routed_experts {tuple(routed.shape)} differ from the batch's [{layers}, _, {k}]")
            out[:, :, b, offset : offset + routed.shape[1]] = routed.to(torch.int16).permute(0, 2, 1) + 1
            offset += len(rollout.prompt_ids) + len(rollout.completion_ids)
    return out


def make_microbatches(
    rollouts: Sequence[Rollout], micro_batch_size: int, mask_truncated: bool = False
) -> list[MicroBatch]:
    """Consecutive chunks of `micro_batch_size` rollouts (the last may be smaller), each padded to its longest;
    `mask_truncated`: the completion tokens of truncated rollouts are left out of `mask` (overlong filtering)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        _microbatch(rollouts[i : i + micro_batch_size], mask_truncated)
        for i in range(0, len(rollouts), micro_batch_size)
    ]


def response_values(values: torch.Tensor, batch: MicroBatch) -> list[list[float]]:
    """Per row of `values: [B, S-1]`, the entries at the completion positions, in order."""
    return [values[b][batch.mask[b].bool()].tolist() for b in range(batch.num_rows)]


def _packed_row(rollouts: Sequence[Rollout], mask_truncated: bool = False) -> MicroBatch:
    ids = [list(r.prompt_ids) + list(r.completion_ids) for r in rollouts]
    seq_len = sum(len(i) for i in ids)
    tokens = torch.tensor([t for row in ids for t in row])
    positions = torch.cat([torch.arange(len(row)) for row in ids])
    mask, engine, advantages = torch.zeros(seq_len - 1), torch.zeros(seq_len - 1), torch.zeros(seq_len - 1)
    offset = 0
    for rollout, row in zip(rollouts, ids, strict=True):
        start = offset + len(rollout.prompt_ids) - 1
        stop = start + len(rollout.completion_ids)
        mask[start:stop] = _in_loss(rollout, mask_truncated)
        engine[start:stop] = torch.tensor(rollout.engine_logprobs)
        advantages[start:stop] = rollout.advantage
        offset += len(row)
    lengths = [len(row) for row in ids]
    return MicroBatch(
        tokens=tokens[None],
        position_ids=positions[None],
        mask=mask[None],
        engine_logprobs=engine[None],
        advantages=advantages[None],
        cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        max_seqlen=max(lengths),
        routed_experts=_routing_rows([rollouts], seq_len),
    )


def pack_microbatches(rollouts: Sequence[Rollout], max_tokens: int, mask_truncated: bool = False) -> list[MicroBatch]:
    """Rows of whole rollouts, at most `max_tokens` tokens each (a longer rollout gets a row of its own), packed
    first-fit-decreasing: longest rollouts first, each into the first row with room; `mask_truncated` as in
    `make_microbatches`."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    rows: list[list[Rollout]] = []
    used: list[int] = []
    for rollout in sorted(rollouts, key=lambda r: -(len(r.prompt_ids) + len(r.completion_ids))):
        size = len(rollout.prompt_ids) + len(rollout.completion_ids)
        row = next((i for i, taken in enumerate(used) if taken + size <= max_tokens), None)
        if row is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        rows[row].append(rollout)
        used[row] += size
    return [_packed_row(row, mask_truncated) for row in rows]


def pad_to_multiple(batch: MicroBatch, multiple: int) -> MicroBatch:
    """`batch` with its rows lengthened by trailing 0-padding to a multiple of `multiple` tokens (megatron-core's
    sequence parallelism splits the sequence over the TP ranks). The padding is masked out of the loss; in a
    packed row it is one more sequence of its own, so no rollout attends to it; in unpadded rows causal attention
    keeps it invisible to the real tokens."""
    return pad_to_length(batch, batch.seq_len + -batch.seq_len % multiple)


def pad_to_length(batch: MicroBatch, length: int) -> MicroBatch:
    """`batch` with its rows lengthened by trailing 0-padding to `length` tokens (at least its own), as in
    `pad_to_multiple`."""
    extra = length - batch.seq_len
    if extra < 0:
        raise ValueError(f"cannot pad a micro-batch of {batch.seq_len} tokens a row to {length}")
    if extra == 0:
        return batch

    def longer(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, values.new_zeros(*values.shape[:-1], extra)], dim=-1)

    steps = torch.arange(1, extra + 1, device=batch.position_ids.device)
    if batch.cu_seqlens is None:
        positions = torch.cat([batch.position_ids, batch.position_ids[:, -1:] + steps], dim=-1)
        cu_seqlens, max_seqlen = None, batch.max_seqlen
    else:
        positions = torch.cat([batch.position_ids, (steps - 1).expand(batch.num_rows, extra)], dim=-1)
        cu_seqlens = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + extra])
        max_seqlen = max(batch.max_seqlen, extra)
    return dataclasses.replace(
        batch,
        tokens=longer(batch.tokens),
        position_ids=positions,
        mask=longer(batch.mask),
        engine_logprobs=longer(batch.engine_logprobs),
        advantages=longer(batch.advantages) if batch.advantages.dim() == 2 else batch.advantages,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        routed_experts=None if batch.routed_experts is None else longer(batch.routed_experts),
    )


def sequence_padding_index(cu_seqlens: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token of a packed row goes when every sequence is padded to a multiple of `multiple` tokens:
    `(index [S] int64, new cu_seqlens [n + 1] int32)` (`pad_sequences_to_multiple`)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded = lengths + (-lengths) % multiple
    new_cu = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    index = torch.arange(int(lengths.sum())) - cu_seqlens[:-1].long()[segment] + new_cu[:-1][segment]
    return index, new_cu.to(torch.int32)


def move_predicted(values: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """`values` `[..., S-1]` (indexed by predicted position) moved into a row of `length` tokens in which old
    token `k` sits at `index[k]` (`sequence_padding_index`): `[..., length - 1]`, zeros at the new places."""
    out = values.new_zeros(*values.shape[:-1], length)
    out[..., index[:-1].to(values.device)] = values
    return out[..., :-1]


def pad_sequences_to_multiple(batch: MicroBatch, multiple: int) -> MicroBatch:
    """A packed row with each of its sequences lengthened by trailing 0-padding to a multiple of `multiple`
    tokens (context parallelism splits every sequence into 2 x CP equal chunks; NeMo-RL pads the same way). The
    padding belongs to its sequence (positions continue), is masked out of the loss and, being after the
    sequence's last token, is invisible to it under causal attention. Unpacked rows: `pad_to_multiple`."""
    if batch.cu_seqlens is None:
        return pad_to_multiple(batch, multiple)
    index, cu_seqlens = sequence_padding_index(batch.cu_seqlens, multiple)
    total = int(cu_seqlens[-1])
    if total == batch.seq_len:
        return batch
    new_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(len(new_lengths)), new_lengths)
    positions = torch.arange(total) - cu_seqlens[:-1].long()[segment]  # padding continues its sequence

    def spread(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(*values.shape[:-1], total)
        out[..., index.to(values.device)] = values
        return out

    return dataclasses.replace(
        batch,
        tokens=spread(batch.tokens),
        position_ids=positions.expand(batch.num_rows, total).to(batch.position_ids),
        mask=move_predicted(batch.mask, index, total),
        engine_logprobs=move_predicted(batch.engine_logprobs, index, total),
        advantages=move_predicted(batch.advantages, index, total) if batch.advantages.dim() == 2 else batch.advantages,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(new_lengths.max()),
        routed_experts=None if batch.routed_experts is None else spread(batch.routed_experts),
    )
