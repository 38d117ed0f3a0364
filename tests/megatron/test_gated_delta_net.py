"""Qwen3.5's hybrid decoder (Gated DeltaNet + gated full attention) through real megatron-core on CPU.

- The torch kernels `cpu_patches.apply_fla_absent_workarounds` gives megatron-core's `GatedDeltaNet` (its own
  `torch_chunk_gated_delta_rule` after a torch `l2norm`) against transformers' token-by-token recurrence, with
  grouped value heads and a sequence across chunk boundaries.
- Logits of megatron-core's `GPTModel` built from the project's hybrid block spec (`gated_delta_net_layers`) against
  transformers' `Qwen3_5ForCausalLM` at TP1, TP2 and PP2; the weights go in through a mapping written in the test
  (`gdn_ranks`), not the project's tables.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gdn_ranks import hybrid_logits_rank

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import VerifyJob, verify
from hf_mcore_bridge.megatron.world import run_world

TINY = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,  # linear, linear, linear, full: under PP2 the second stage holds one of each
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # two value heads per key head
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _gated_delta_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    batch, seq, k_heads, v_heads, k_dim, v_dim = 2, 150, 2, 4, 8, 12
    query = torch.randn(batch, seq, k_heads, k_dim, generator=gen)
    key = torch.randn(batch, seq, k_heads, k_dim, generator=gen)
    value = torch.randn(batch, seq, v_heads, v_dim, generator=gen)
    g = -F.softplus(torch.randn(batch, seq, v_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, seq, v_heads, generator=gen))
    return query, key, value, g, beta


def _megatron_rule(query, key, value, g, beta):
    """What megatron-core's `GatedDeltaNet.forward` does from the convolved q/k/v on: l2norm, repeat q/k over the
    value heads of their group, the chunked rule."""
    from megatron.core.ssm import gated_delta_net

    repeat = value.shape[2] // key.shape[2]
    query = gated_delta_net.l2norm(query.contiguous()).repeat_interleave(repeat, dim=2)
    key = gated_delta_net.l2norm(key.contiguous()).repeat_interleave(repeat, dim=2)
    out, _ = gated_delta_net.chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False
    )
    return out


def test_cpu_gated_delta_rule_matches_transformers_recurrence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from hf_mcore_bridge.megatron.cpu_patches import apply_fla_absent_workarounds

    assert apply_fla_absent_workarounds()  # no flash-linear-attention on the CPU machines
    query, key, value, g, beta = _gated_delta_inputs()
    expected, _ = torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    got = _megatron_rule(query, key, value, g, beta)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5
    # the comparison can fail: a decay off by 1% on one value head, or key heads not repeated in groups
    g_off = g.clone()
    g_off[..., 1] *= 1.01
    assert (_megatron_rule(query, key, value, g_off, beta) - expected).abs().max() > 1e-3
    swapped = _megatron_rule(query, key.flip(2), value, g, beta)
    assert (swapped - expected).abs().max() > 1e-2


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    """A `Qwen3_5ForCausalLM` of random weights (norm weights and gated-norm weights away from their
    initial values, so zero-centred and plain norms show)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("qwen3_5") / "hf"
    model.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("layout", [Layout(tp=2)], ids=["tp2"])  # TP1 and PP2: the converted checkpoints below
def test_hybrid_logits_equal_transformers(tiny_qwen3_5, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, TINY["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    run_world(hybrid_logits_rank, layout, str(tiny_qwen3_5), str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-4, (got - expected).abs().max()


CONVERTED = {
    "tp2": ("qwen3_5", Layout(tp=2)),
    "pp2": ("qwen3_5", Layout(pp=2)),
    "moe-ep2": ("qwen3_5_moe", Layout(ep=2)),
    "next-tp2": ("qwen3_next", Layout(tp=2)),
    "next-ep2": ("qwen3_next", Layout(ep=2)),
}
"""One world each (the full tier's time): every model, every kind of split (TP, PP, EP), the fused and split layouts."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONVERTED))
def test_converted_checkpoint_gives_transformers_logits(tiny_models, tiny_moe_models, case, tmp_path):
    """The tiny Qwen3.5 (dense, MoE) and Qwen3-Next converted to megatron-core's checkpoint, loaded by
    megatron-core's own `dist_checkpointing` into the project's model, give transformers' logits."""
    name, layout = CONVERTED[case]
    hf_dir = {**tiny_models, **tiny_moe_models}[name]
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", layout=layout, show_progress=False)
    (result,) = verify([VerifyJob(hf_dir, tmp_path / "mc")], layout, seq_len=80)
    assert result.max_abs_diff <= 1e-4, result.summary()
    assert result.top1_agreement == 1.0, result.summary()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [Layout(tp=2)], ids=["tp2"])
def test_packed_sequences_restart_at_every_boundary(tiny_qwen3_5, layout, tmp_path):
    """Three sequences in one packed row (the first longer than a chunk of the delta rule) give each sequence's
    transformers logits: convolution and recurrent state start afresh at each boundary."""
    from gdn_ranks import packed_logits_rank
    from transformers import AutoModelForCausalLM

    lengths = [70, 23, 41]
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n in lengths]
    torch.save(torch.cat(sequences)[None], tmp_path / "row.pt")
    run_world(packed_logits_rank, layout, str(tiny_qwen3_5), str(tmp_path / "row.pt"), lengths, str(tmp_path / "o.pt"))
    got = torch.load(tmp_path / "o.pt", weights_only=True)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.cat([hf(input_ids=seq[None]).logits[0] for seq in sequences])
        joined = hf(input_ids=torch.cat(sequences)[None]).logits[0]
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-4, (got - expected).abs().max()
    assert (joined - expected).abs().max() > 1e-2  # state carried over a boundary shows
