"""The SDPA core attention: the same logits as megatron-core's own unfused attention, and packed sequences (the
trainer's `PackedSeqParams` rows, dense-mask and flex_attention backends) give the same logits, log-probs and
gradients as the sequences run one by one; the flex `BlockMask` against the dense mask; on CUDA, compiled flex and
varlen flash attention against the dense mask in bf16."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import sdpa_rank

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.sdpa_attention import FLEX_BLOCK, block_causal_mask, document_block_mask, packed_attention
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.tiny_models import tiny_config


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([0, 2, 5]), 5, torch.device("cpu"))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2)], ids=["tp1", "tp2"])
def test_sdpa_matches_local_attention_and_packing(tmp_path, layout):
    """SDPA and packed rows (the trainer's `PackedSeqParams` path, dense and flex backends) against megatron-core's
    own attention run sequence by sequence: logits, log-probs and gradients, fp32, at TP1 and TP2."""
    config = tiny_config("Qwen3ForCausalLM")  # GQA and q/k norms
    model_cfg = config_bridge.megatron_spec(config)
    lengths = [5, 11, 3, 9]
    run_world(sdpa_rank, layout, model_cfg, layout, lengths, str(tmp_path / "logits.pt"))
    results = torch.load(tmp_path / "logits.pt", weights_only=True)
    for backend in ("dense", "flex"):
        for i, local in enumerate(results["local"]):
            assert local.shape == results["sdpa"][i].shape == results[f"packed_{backend}"][i].shape
            assert (results["sdpa"][i] - local).abs().max() <= 1e-5
            assert (results[f"packed_{backend}"][i] - local).abs().max() <= 1e-5
            assert (results[f"logprobs_{backend}"][i] - results["logprobs_local"][i]).abs().max() <= 1e-5
            assert local.abs().max() > 1e-3  # the comparison is between real logits
    for key in [k for k in results if k.startswith("grad_diff_")]:
        (grad_diff,), (grad_max,) = results[key], results["grad_max"]
        assert grad_diff <= 1e-5 * grad_max and grad_max > 0, key
    assert "grad_diff_dense" in results


@pytest.mark.parametrize(
    "lengths", [[5, 11, 3], [300, 17, 100, 600, 7], [128, 128, 256], [1000], [1] * 20 + [50]], ids=str
)
def test_document_block_mask_matches_dense_mask(lengths):
    """The flex `BlockMask`: its mask function is the block-diagonal causal mask element by element; at the tile
    level it visits exactly the tiles holding an allowed pair, and runs as "full" (unmasked) only tiles where
    every pair is allowed."""
    from torch.nn.attention.flex_attention import create_mask

    block = 8 if sum(lengths) < 100 else FLEX_BLOCK
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    mask = document_block_mask(cu, total, block)
    dense = block_causal_mask(cu, total, torch.device("cpu"))
    assert torch.equal(create_mask(mask.mask_mod, None, None, total, total, device="cpu")[0, 0], dense)
    tiles = -(-total // block)
    padded = torch.zeros(tiles * block, tiles * block, dtype=torch.bool)
    padded[:total, :total] = dense
    per_tile = padded.view(tiles, block, tiles, block).permute(0, 2, 1, 3).reshape(tiles, tiles, -1)
    partial, full = (_tiles(num, idx, tiles) for num, idx in _kv_tiles(mask))
    assert torch.equal(partial | full, per_tile.any(-1))
    assert not (partial & full).any()
    assert torch.equal(full, per_tile.all(-1))  # every all-allowed tile skips the mask function


def _kv_tiles(mask) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]),
        (mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]),
    ]


def _tiles(num: torch.Tensor, indices: torch.Tensor, tiles: int) -> torch.Tensor:
    out = torch.zeros(tiles, tiles, dtype=torch.bool)
    for row in range(tiles):
        out[row, indices[row, : num[row]].long()] = True
    return out


def test_packed_attention_backends_agree_on_cpu():
    """Dense mask and (eager, forward-only on CPU) flex_attention give the same output with grouped heads, and the
    dense path equals attention run sequence by sequence."""
    generator = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 7, 40, 41, 90], dtype=torch.int32)
    q = torch.randn(90, 8, 16, generator=generator)
    k, v = (torch.randn(90, 2, 16, generator=generator) for _ in range(2))
    dense, flex = (packed_attention(q, k, v, cu, scale=0.3, backend=b) for b in ("dense", "flex"))
    assert (dense - flex).abs().max() <= 1e-5
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(x[start:stop].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=True
        ).transpose(0, 1)
        assert (dense[start:stop] - alone).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_fast_packed_backends_match_dense_mask_in_bf16_on_cuda(backend, head_dim):
    """The CUDA packed paths (compiled flex_attention, torch's varlen flash attention) against SDPA with the dense
    mask, bf16, forward and backward, grouped heads; all measured against an fp32 reference so the tolerance is the
    one bf16 itself needs."""
    from hf_mcore_bridge.megatron.sdpa_attention import _varlen_attn

    if backend == "varlen" and _varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    lengths = [700, 1, 129, 128, 2000, 90, 1]  # odd lengths: tiles straddle sequences, the last tile is padded
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q32 = torch.randn(total, 32, head_dim, device="cuda")
    k32, v32 = (torch.randn(total, 8, head_dim, device="cuda") for _ in range(2))
    grad_out = torch.randn(total, 32, head_dim, device="cuda")
    scale = head_dim**-0.5

    def run(name: str, dtype: torch.dtype) -> list[torch.Tensor]:
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q32, k32, v32))
        out = packed_attention(q, k, v, cu, scale=scale, backend=name)
        out.backward(grad_out.to(dtype))
        return [t.float() for t in (out, q.grad, k.grad, v.grad)]

    reference = run("dense", torch.float32)
    dense, fast = run("dense", torch.bfloat16), run(backend, torch.bfloat16)
    for name, ref, d, f in zip(("out", "dq", "dk", "dv"), reference, dense, fast, strict=True):
        scale_ref = ref.abs().max()
        dense_err, fast_err = (d - ref).abs().max() / scale_ref, (f - ref).abs().max() / scale_ref
        assert fast_err <= max(2 * dense_err, 1e-2), (name, float(fast_err), float(dense_err))


def test_packed_rows_keep_cu_seqlens_on_the_host():
    """Packed rows hand megatron-core host `cu_seqlens` (its RoPE reads them there); `cu_seqlens_on` copies a host
    tensor to the device once and gives every later caller (each layer, the backward) that same copy."""
    from hf_mcore_bridge.grpo.algorithm.batching import Rollout, pack_microbatches
    from hf_mcore_bridge.megatron.sdpa_attention import cu_seqlens_on, packed_seq_params

    rollouts = [Rollout((1, 2), (3, 4, 5), (0.0, 0.0, 0.0)), Rollout((6,), (7, 8), (0.0, 0.0))]
    (batch,) = pack_microbatches(rollouts, 8)
    moved = batch.to(torch.device("meta"))
    assert moved.tokens.device.type == "meta" and moved.cu_seqlens.device.type == "cpu"
    params = packed_seq_params(moved.cu_seqlens, moved.max_seqlen)
    assert params.cu_seqlens_q.device.type == "cpu" and params.cu_seqlens_q.tolist() == [0, 5, 8]
    meta = torch.device("meta")
    first = cu_seqlens_on(params.cu_seqlens_q, meta)
    assert first.device == meta and first.dtype == torch.int32
    assert cu_seqlens_on(params.cu_seqlens_q, meta) is first
    assert cu_seqlens_on(params.cu_seqlens_q.clone(), meta) is not first  # a new row: a new copy
    assert cu_seqlens_on(params.cu_seqlens_q, torch.device("cpu")) is params.cu_seqlens_q


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_training_step_does_not_synchronise_on_cuda(tmp_path):
    """A packed row's forward and backward through the trainer's `_forward_step` (bf16, varlen flash attention,
    megatron-core's RoPE per sequence) never waits for the device: a synchronisation would stall kernel launches
    once per layer."""
    from megatron_ranks import packed_step_sync_rank

    config = tiny_config("LlamaForCausalLM")
    model_cfg = config_bridge.megatron_spec(config)
    out = tmp_path / "sync.txt"
    run_world(packed_step_sync_rank, Layout(), model_cfg, [40, 7, 81], str(out))
    assert out.read_text() == "no synchronisation"
