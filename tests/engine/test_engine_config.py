"""Reading HF configs: both RoPE spellings, llama3 frequencies against transformers' own function, the explicit
architecture registry, and loud refusals of what the decoder does not implement."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_helpers import CONFIGS
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_mcore_bridge.engine import Engine, EngineConfig, read_spec
from hf_mcore_bridge.engine.model import rope_inv_freq
from hf_mcore_bridge.mappings.qwen2 import ARCHITECTURE as QWEN2
from hf_mcore_bridge.mappings.qwen3 import ARCHITECTURE as QWEN3
from hf_mcore_bridge.models.spec import RopeSpec

YARN = {
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def read_rope(rope_fields: dict) -> RopeSpec:
    """The engine's reading of a Llama config whose RoPE fields are `rope_fields` (and no others)."""
    llama = CONFIGS["llama"]().to_dict()
    base = {k: v for k, v in llama.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return read_spec({**base, **rope_fields}).rope


def test_rope_is_read_from_both_spellings():
    new = read_rope({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}})
    old = read_rope({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    older = read_rope({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert new == old == older == RopeSpec(theta=500000.0, rope_type="llama3", **LLAMA3)
    assert read_rope({"rope_theta": 1e6}) == RopeSpec(theta=1e6)


def test_missing_rope_theta_is_an_error():
    with pytest.raises(ValueError, match="rope_theta"):
        read_rope({"rope_scaling": None})


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unimplemented_rope_types_are_refused(rope_type):
    with pytest.raises(NotImplementedError, match=rope_type):
        read_rope({"rope_parameters": {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}})


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
        {"rope_type": "llama3", "rope_theta": 500000.0, **{**LLAMA3, "original_max_position_embeddings": 32}},
        {"rope_type": "yarn", "rope_theta": 150000.0, **YARN},  # GPT-OSS's: the correction range not truncated
        {"rope_type": "yarn", "rope_theta": 10000.0, **{**YARN, "truncate": True, "beta_fast": 16.0}},
    ],
)
def test_inverse_frequencies_equal_transformers(rope_parameters):
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=rope_parameters)
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config, device=None)
    got = rope_inv_freq(read_spec(config).rope, 64)
    assert torch.equal(got, expected)
    if rope_type == "yarn":
        _, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=None)
        assert read_spec(config).rope.attention_scaling == scaling != 1.0


def test_architecture_comes_from_the_explicit_registry():
    qwen2 = CONFIGS["qwen2"]().to_dict()
    assert read_spec(qwen2).arch is QWEN2
    assert read_spec({**qwen2, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}).arch is QWEN3
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        read_spec({**qwen2, "architectures": ["GPT2LMHeadModel"]})


def test_per_architecture_data_resolves_biases_and_norms():
    llama = read_spec(CONFIGS["llama"]())
    qwen2 = read_spec(CONFIGS["qwen2"]())
    qwen3 = read_spec(CONFIGS["qwen3"]())
    assert (llama.qkv_bias, llama.o_bias, llama.arch.qk_norm) == (False, False, False)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.arch.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.head_dim, qwen3.arch.qk_norm, qwen3.tie_word_embeddings) == (False, 32, True, True)
    llama_biased = read_spec({**CONFIGS["llama"]().to_dict(), "attention_bias": True})
    assert (llama_biased.qkv_bias, llama_biased.o_bias) == (True, True)


def test_unsupported_configs_are_refused():
    mistral = CONFIGS["mistral"]().to_dict()
    with pytest.raises(NotImplementedError, match="sliding"):
        Engine({**mistral, "sliding_window": 32}, EngineConfig(device="cpu", max_model_len=64, dtype=torch.float32))
    with pytest.raises(NotImplementedError, match="hidden_act"):
        read_spec({**mistral, "hidden_act": "gelu"})
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        read_spec({**CONFIGS["llama"]().to_dict(), "mlp_bias": True})
    qwen2_window = {**CONFIGS["qwen2"]().to_dict(), "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(NotImplementedError, match="sliding"):
        Engine(qwen2_window, EngineConfig(device="cpu", max_model_len=64, dtype=torch.float32))


def test_kv_budget_must_hold_one_full_sequence():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        Engine(CONFIGS["llama"](), EngineConfig(device="cpu", dtype=torch.float32, kv_cache_memory_bytes=4096))


def test_decode_kernel_resolution():
    """`auto`: gather off CUDA; on CUDA the Triton kernel where Triton is installed and takes the head dim, else
    FlexAttention. An explicit `triton` for a head dim the kernel cannot take is refused."""
    assert EngineConfig(device="cpu").decode_kernel(64) == "gather"
    cuda = EngineConfig(device="cuda")
    assert cuda.decode_kernel(8) == "flex"
    assert cuda.decode_kernel(64) == ("triton" if importlib.util.find_spec("triton") else "flex")
    assert EngineConfig(device="cuda", decode_attention="gather").decode_kernel(64) == "gather"
    hf = CONFIGS["llama"]().to_dict() | {"head_dim": 8, "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="head_dim >= 16"):
        Engine(hf, EngineConfig(device="cpu", dtype=torch.float32, decode_attention="triton"))


def test_triton_kernel_off_cuda_needs_the_interpreter(monkeypatch):
    """An explicit `triton` on CPU is refused when the engine is built, not at its first decode step."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        Engine(CONFIGS["llama"](), EngineConfig(device="cpu", dtype=torch.float32, decode_attention="triton"))


def test_partial_rotary_factor_is_read_in_either_spelling_and_an_odd_rotation_refused():
    from engine_helpers import MOE_CONFIGS

    config = MOE_CONFIGS["glm4_moe"]().to_dict()  # head_dim 32, rope_parameters' partial_rotary_factor 0.5
    assert read_spec(config).rope.rotary_dim(32) == 16
    older = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 1e6}
    assert read_spec({**older, "partial_rotary_factor": 0.25}).rope.rotary_dim(32) == 8
    assert read_spec(older).rope.partial_rotary_factor == 0.5  # absent: transformers' GLM default
    with pytest.raises(ValueError, match="rotates 3 of the 32 dimensions"):
        read_spec({**older, "partial_rotary_factor": 0.1})
