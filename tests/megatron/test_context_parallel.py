"""Context parallelism without Transformer Engine: the sequence split against megatron-core's own RoPE slicing,
split/merge round trips, per-sequence padding of packed rows, the two gathers alone in a gloo world (every rank's
chunks back in sequence order, forwards and backwards, at CP2 and CP4), and one gloo world in which CP2 and CP2 x
TP2 (with sequence parallelism) give CP1's log-probs, GRPO loss and every gradient, on padded and packed rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cp_ranks import GATHER_CASES, LAYOUTS, cp_rank, gather_inputs, gather_rank, held_positions

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.grpo.algorithm.batching import (
    Rollout,
    make_microbatches,
    pack_microbatches,
    pad_sequences_to_multiple,
    response_values,
)
from hf_mcore_bridge.megatron.context_parallel import chunks_of_rank, cp_positions, merge_sequence, split_sequence
from hf_mcore_bridge.megatron.world import run_torch_world, run_world
from hf_mcore_bridge.models.tiny_models import tiny_config


def test_chunks_of_rank():
    assert [chunks_of_rank(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError):
        chunks_of_rank(2, 2)


@pytest.mark.parametrize("cp", [2, 4])
def test_split_matches_megatron_rope_slicing(cp, monkeypatch):
    """Our split of a position table is megatron-core's `get_pos_emb_on_this_cp_rank` on every rank."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    tensor = torch.tensor  # it asks for pinned memory, which needs an accelerator

    def unpinned(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", unpinned)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)

    class Group:
        def __init__(self, rank: int) -> None:
            self._rank = rank

        def size(self) -> int:
            return cp

        def rank(self) -> int:
            return self._rank

    table = torch.arange(8 * cp, dtype=torch.float32)[:, None, None, None]
    for rank in range(cp):
        expected = get_pos_emb_on_this_cp_rank(table, 0, Group(rank))
        assert torch.equal(split_sequence(table, cp, rank, 0), expected)


def test_packed_split_matches_megatron_thd_rope():
    """Per packed sequence, megatron-core's THD RoPE slice of a position table equals our split positions."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    cp, cu = 2, torch.tensor([0, 8, 12, 24])
    freqs = torch.arange(100)
    for rank in range(cp):
        mine = cp_positions(cu, cp, rank)
        offset = 0
        for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            local = (stop - start) // cp
            got = _get_thd_freqs_on_this_cp_rank(rank, cp, torch.zeros(local), freqs)
            assert torch.equal(mine[offset : offset + local] - start, got)
            offset += local


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_split_then_merge_is_identity(cp):
    x = torch.randn(2, 12 * cp, 3)
    assert torch.equal(merge_sequence([split_sequence(x, cp, r, 1) for r in range(cp)], 1), x)
    cu = torch.tensor([0, 2 * cp, 8 * cp, 12 * cp])
    parts = [split_sequence(x, cp, r, 1, cu) for r in range(cp)]
    assert torch.equal(merge_sequence(parts, 1, cu), x)
    assert sorted(torch.cat([cp_positions(cu, cp, r) for r in range(cp)]).tolist()) == list(range(12 * cp))


def test_split_refuses_uneven_sequences():
    with pytest.raises(ValueError, match="2 x CP"):
        cp_positions(torch.tensor([0, 6, 9]), 2, 0)


def _rollouts(lengths: list[int], seed: int) -> list[Rollout]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, 200, (n,), generator=generator).tolist()
        prompt = 2 + i % 3
        logps = (-torch.rand(n - prompt, generator=generator)).tolist()
        out.append(Rollout(tuple(ids[:prompt]), tuple(ids[prompt:]), tuple(logps), advantage=(-1) ** i * (0.5 + i)))
    return out


def test_pad_sequences_to_multiple_keeps_every_rollout():
    (batch,) = pack_microbatches(_rollouts([7, 5, 9], 0), 64)
    padded = pad_sequences_to_multiple(batch, 4)
    lengths = (padded.cu_seqlens[1:] - padded.cu_seqlens[:-1]).tolist()
    assert lengths == [12, 8, 8] and padded.max_seqlen == 12
    assert response_values(padded.engine_logprobs, padded) == response_values(batch.engine_logprobs, batch)
    assert response_values(padded.advantages, padded) == response_values(batch.advantages, batch)
    starts = padded.cu_seqlens[:-1].long()
    for start, stop, old_start, old_stop in zip(
        starts.tolist(),
        padded.cu_seqlens[1:].tolist(),
        batch.cu_seqlens[:-1].tolist(),
        batch.cu_seqlens[1:].tolist(),
        strict=True,
    ):
        n = old_stop - old_start
        assert torch.equal(padded.tokens[0, start : start + n], batch.tokens[0, old_start:old_stop])
        assert padded.tokens[0, start + n : stop].eq(0).all()
        assert padded.position_ids[0, start:stop].tolist() == list(range(stop - start))


@pytest.mark.slow
def test_cp2_and_cp2_tp2_equal_cp1(tmp_path):
    """CP2 and CP2 x TP2 (sequence parallel), padded and packed rows: completion log-probs, GRPO loss and every
    gradient (summed over CP ranks) equal CP1's within 1e-5 in fp32; TP2 layouts are compared shard by shard
    against TP2 x CP1."""
    config = tiny_config("LlamaForCausalLM", num_hidden_layers=2)
    model_cfg = config_bridge.megatron_spec(config)
    rollouts = _rollouts([13, 9, 11], 1)
    batches = {"padded": make_microbatches(rollouts, 3)[0], "packed": pack_microbatches(rollouts, 64)[0]}
    run_world(cp_rank, Layout(), model_cfg, batches, str(tmp_path / "ckpt"), str(tmp_path), world=4)
    pairs = [("tp1cp2", "tp1cp1", 0), ("tp2cp2", "tp2cp1", 0), ("tp2cp2", "tp2cp1", 1)]
    assert set(LAYOUTS) == {"tp1cp1", "tp1cp2", "tp2cp1", "tp2cp2"}
    for test, reference, tp_rank in pairs:
        got = torch.load(tmp_path / f"{test}.tp{tp_rank}.pt", weights_only=True)
        want = torch.load(tmp_path / f"{reference}.tp{tp_rank}.pt", weights_only=True)
        for key in ("padded", "packed"):
            for row_got, row_want in zip(got[key]["logprobs"], want[key]["logprobs"], strict=True):
                assert len(row_got) == len(row_want) > 0
                assert torch.allclose(torch.tensor(row_got), torch.tensor(row_want), atol=1e-5, rtol=0)
            assert abs(float(got[key]["loss"]) - float(want[key]["loss"])) <= 1e-5
            assert float(want[key]["loss"]) != 0.0
            assert got[key]["grads"].keys() == want[key]["grads"].keys()
            for name, grad in want[key]["grads"].items():
                assert grad.abs().max() > 0, name
                assert (got[key]["grads"][name] - grad).abs().max() <= 1e-5, (test, key, name)


@pytest.mark.slow
def test_gathers_put_every_rank_chunk_back_in_sequence_order(tmp_path):
    """Guards against the CP gathers putting the ranks' chunks back in the wrong order (e.g. rank order reversed in
    the all-gather or in the index that sorts the chunks), forwards or backwards. In one 4-rank gloo world, at CP4
    and at CP2, on a plain and a packed row, each rank hands in the values it holds under megatron-core's
    load-balanced split (written out in the test, `cp_ranks.held_positions`): `gather_in_order` (log-probs) and
    `gather_sequence` (keys and values) must return the whole row exactly, on every rank; the gradient
    `gather_in_order` sends back is this rank's own slice of its output gradient, and `gather_sequence`'s the sum
    of every CP rank's (each weights the output by `weights * (its CP rank + 1)`)."""
    run_torch_world(gather_rank, 4, str(tmp_path))
    for world_rank in range(4):
        results = torch.load(tmp_path / f"rank{world_rank}.pt", weights_only=True)
        assert sorted(results) == sorted((cp, case) for cp in (2, 4) for case in GATHER_CASES)
        for (cp, case), got in results.items():
            where = (world_rank, cp, case)
            cu, values, weights = gather_inputs(cp, case)
            held = held_positions(cu, cp, got["cp_rank"])
            assert got["cp_rank"] == world_rank % cp, where
            assert torch.equal(got["in_order"], values), where
            assert torch.equal(got["sequence"], values.T), where
            assert torch.equal(got["in_order_grad"], weights[:, held] * (got["cp_rank"] + 1)), where
            assert torch.equal(got["sequence_grad"], weights.T[held] * sum(range(1, cp + 1))), where


def test_cp_attention_refuses_dropout_and_explicit_masks():
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from hf_mcore_bridge.megatron.sdpa_attention import SDPAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=2, attention_dropout=0.1
    )
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=object()))
    q = torch.zeros(4, 1, 4, 8)
    with pytest.raises(ValueError, match="dropout is not implemented under context parallelism"):
        attention.train()(q, q, q, None)
    with pytest.raises(ValueError, match="an explicit mask is refused"):
        attention.eval()(q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["one_sequence", "packed"])
def test_local_attention_equals_full_causal_attention(cp, packed):
    """Each rank's queries against the gathered keys (the two local paths of `cp_attention`, no collective) give
    the rows of a reference written here: SDPA over the whole row with a per-sequence causal mask."""
    from hf_mcore_bridge.megatron.context_parallel import _one_sequence
    from hf_mcore_bridge.megatron.context_parallel import _packed as packed_path

    generator = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 4 * cp, 6 * cp, 12 * cp]) if packed else torch.tensor([0, 12 * cp])
    total, batch = int(cu[-1]), 1 if packed else 2
    q = torch.randn(total, batch, 4, 8, generator=generator)
    k, v = (torch.randn(total, batch, 2, 8, generator=generator) for _ in range(2))
    doc = torch.bucketize(torch.arange(total), cu[1:], right=True)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), *(x.repeat_interleave(2, 2).permute(1, 2, 0, 3) for x in (k, v)), attn_mask=allowed
    ).permute(2, 0, 1, 3)
    for rank in range(cp):
        mine = cp_positions(cu, cp, rank)
        if packed:
            got = packed_path(q[mine], k, v, cp, rank, cu, 8**-0.5)
        else:
            got = _one_sequence(q[mine], k, v, cp, rank, 8**-0.5)
        assert torch.allclose(got, expected[mine], atol=1e-6), rank
        assert not torch.allclose(got, expected[mine.flip(0)], atol=1e-3)  # a misplaced row would show
