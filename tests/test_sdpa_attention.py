"""The SDPA core attention: the same logits as megatron-core's own unfused attention, and packed sequences give
the same logits as the sequences run one by one."""

from __future__ import annotations

import torch
from megatron_ranks import sdpa_rank

from hf_mcore_bridge import config_bridge
from hf_mcore_bridge.layout import Layout
from hf_mcore_bridge.mappings import get_architecture
from hf_mcore_bridge.sdpa_attention import block_causal_mask
from hf_mcore_bridge.tiny_models import tiny_config
from hf_mcore_bridge.world import run_world


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


def test_sdpa_matches_local_attention_and_packing(tmp_path):
    config = tiny_config("Qwen3ForCausalLM")  # GQA and q/k norms
    model_cfg = config_bridge.from_hf(config, get_architecture("Qwen3ForCausalLM"))
    lengths = [5, 11, 3]
    run_world(sdpa_rank, Layout(), model_cfg, lengths, str(tmp_path / "logits.pt"))
    results = torch.load(tmp_path / "logits.pt", weights_only=True)
    for sdpa, local, packed in zip(results["sdpa"], results["local"], results["packed"], strict=True):
        assert sdpa.shape == local.shape == packed.shape
        assert (sdpa - local).abs().max() <= 1e-5
        assert (sdpa - packed).abs().max() <= 1e-5
        assert sdpa.abs().max() > 1e-3  # the comparison is between real logits
