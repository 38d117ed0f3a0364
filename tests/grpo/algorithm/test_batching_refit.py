"""Pure pieces of the trainer: micro-batch layout, TP shard assembly for refit, the CPU clip patch (the refit's
checksums: `refit/test_refit_checks.py`)."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches, pack_microbatches, response_values
from hf_mcore_bridge.grpo.refit.stream import PhaseTimes, assemble_shards
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.tensor_ops import shard_boxes, take_box

ROLLOUTS = [
    Rollout((5, 6, 7), (8, 9), (-0.1, -0.2), reward=1.0, advantage=0.5),
    Rollout((1,), (2, 3, 4), (-0.3, -0.4, -0.5), reward=0.0, advantage=-0.5),
    Rollout((4, 4, 4, 4), (1,), (-0.6,)),
]


def test_microbatch_layout_by_hand() -> None:
    first, second = make_microbatches(ROLLOUTS, 2)
    assert first.tokens.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]
    assert first.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert torch.allclose(first.engine_logprobs, torch.tensor([[0, 0, -0.1, -0.2], [-0.3, -0.4, -0.5, 0]]))
    assert first.advantages.tolist() == [0.5, -0.5]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert second.tokens.tolist() == [[4, 4, 4, 4, 1]]
    assert second.mask.tolist() == [[0, 0, 0, 1]]


def test_masked_positions_pick_the_completion_token_logprobs() -> None:
    """Log-probs gathered at the mask equal those computed rollout by rollout, unpadded."""
    vocab = 10
    table = torch.randn(vocab, vocab)  # logits depend on the previous token only: a bigram "model"
    for batch in make_microbatches(ROLLOUTS, 3):
        logprobs = torch.log_softmax(table[batch.tokens[:, :-1]], -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
        for rollout, got in zip(ROLLOUTS, response_values(logprobs, batch), strict=True):
            ids = rollout.prompt_ids + rollout.completion_ids
            expected = [
                float(torch.log_softmax(table[ids[p - 1]], -1)[ids[p]])
                for p in range(len(rollout.prompt_ids), len(ids))
            ]
            assert got == pytest.approx(expected)


def test_rollout_refuses_mismatched_logprobs() -> None:
    with pytest.raises(ValueError, match="engine log-probs"):
        Rollout((1,), (2, 3), (-0.1,))


@pytest.mark.parametrize("style", list(Parallel))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_assemble_shards_inverts_megatron_sharding(style: Parallel, tp: int) -> None:
    full = torch.randn(16, 8)
    parts = (4, 8, 4) if style is Parallel.COLUMN_PARTS else ()
    if style is Parallel.COLUMN_PARTS:  # megatron-core's GatedDeltaNet: each rank holds its rows of each part
        shards = [torch.cat([part.chunk(tp)[r] for part in full.split(parts)]) for r in range(tp)]
        assert torch.equal(assemble_shards(shards, style, parts), full)
        return
    boxes = shard_boxes(tuple(full.shape), style, tp)
    if style is Parallel.GATED_COLUMN:  # each rank holds [gate_r; up_r]: its two boxes stacked
        shards = [torch.cat([take_box(full, boxes[r]), take_box(full, boxes[tp + r])]) for r in range(tp)]
    else:
        shards = [take_box(full, box) for box in boxes] if len(boxes) > 1 else [full] * tp
    assert torch.equal(assemble_shards(shards, style), full)


def test_cpu_clip_matches_torch_clip_grad_norm() -> None:
    from hf_mcore_bridge.megatron.cpu_patches import _clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, reference, strict=True):
        p.grad = torch.randn_like(p) * 3
        r.grad = p.grad.clone()
    total = float(torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0))
    _clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    for p, r in zip(params, reference, strict=True):
        assert torch.allclose(p.grad, r.grad, rtol=1e-6, atol=0)


def test_packed_rows_by_hand() -> None:
    first, second = pack_microbatches(ROLLOUTS, 9)
    assert first.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # targets: 6 7 8 9 | 1 (next rollout: not predicted) | 2 3 4
    assert first.mask.tolist() == [[0, 0, 1, 1, 0, 1, 1, 1]]
    assert first.advantages.tolist() == [[0, 0, 0.5, 0.5, 0, -0.5, -0.5, -0.5]]
    assert torch.allclose(first.engine_logprobs, torch.tensor([[0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5]]))
    allowed = ~first.attention_mask[0, 0]
    assert allowed[6].tolist() == [False] * 5 + [True, True] + [False] * 2  # sees only its own rollout, causally
    assert allowed[4].tolist() == [True] * 5 + [False] * 4
    assert second.tokens.tolist() == [[4, 4, 4, 4, 1]] and second.mask.tolist() == [[0, 0, 0, 1]]


def test_packing_keeps_every_valid_token_once() -> None:
    for budget in (2, 5, 9, 100):
        batches = pack_microbatches(ROLLOUTS, budget)
        assert sum(int(b.mask.sum()) for b in batches) == sum(len(r.completion_ids) for r in ROLLOUTS)
        for batch in batches:  # within budget, unless one rollout alone exceeds it
            assert batch.seq_len <= budget or int((batch.position_ids == 0).sum()) == 1


def test_refit_buckets_respect_the_budget() -> None:
    from hf_mcore_bridge.grpo.refit.stream import buckets

    stream = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 20, 5, 40, 1])]
    grouped = list(buckets(stream, limit_bytes=4 * 30))  # 30 floats a bucket
    assert [[name for name, _ in bucket] for bucket in grouped] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [name for bucket in grouped for name, _ in bucket] == [name for name, _ in stream]


def test_padding_to_a_multiple_keeps_every_real_value() -> None:
    from hf_mcore_bridge.grpo.algorithm.batching import pad_to_multiple

    (batch,) = make_microbatches(ROLLOUTS, 3)  # S = 5
    padded = pad_to_multiple(batch, 4)
    assert padded.seq_len == 8 and padded.mask.shape == (3, 7)
    assert torch.equal(padded.tokens[:, :5], batch.tokens) and not padded.tokens[:, 5:].any()
    assert torch.equal(padded.mask[:, :4], batch.mask) and not padded.mask[:, 4:].any()
    assert padded.position_ids[0].tolist() == list(range(8))
    assert pad_to_multiple(batch, 5) is batch

    (row,) = pack_microbatches(ROLLOUTS, 64)  # one packed row of 5 + 4 + 5 tokens
    packed = pad_to_multiple(row, 4)
    assert packed.seq_len == 16
    assert packed.cu_seqlens.tolist() == [*row.cu_seqlens.tolist(), 16]  # the padding is a sequence of its own
    assert packed.position_ids[0, 14:].tolist() == [0, 1]
    assert torch.equal(packed.advantages[:, :13], row.advantages) and not packed.advantages[:, 13:].any()


def test_phase_times_add_up_per_phase_and_refuse_unknown_names() -> None:
    times = PhaseTimes()
    for _ in range(3):
        with times.phase("load"):
            torch.ones(64, 64).sum()
    with times.phase("produce"), times.phase("gather"):  # phases nest: produce holds the gathers it caused
        pass
    totals = times.totals()
    assert set(totals) == {"gather", "transfer", "produce", "load"}
    assert totals["load"] > 0 and totals["transfer"] == 0
    assert totals["produce"] >= totals["gather"] >= 0
    with pytest.raises(ValueError, match="unknown refit phase"), times.phase("convert"):
        pass
