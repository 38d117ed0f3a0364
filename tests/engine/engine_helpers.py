"""Shared helpers of the engine tests.

Tiny HF models (2-3 layers, hidden 64, 4 heads, 2 KV heads, vocab 211; the MoE ones with 4-8 experts, top-2;
GLM-4.5's top-4 of 8 in 4 groups, sigmoid scores with a score bias, partial rotary, an ungated shared expert;
GPT-OSS's sliding window, sinks, YaRN, biased router and experts with the clamped activation)
built from configs in code, and the transformers references the engine tests compare against (greedy `generate`,
log-probs of a forward pass). Weights reach the engine as transformers saves them (`hub_weights`): for the MoE
models that is one tensor per expert, not the fused expert tensors of their in-memory state dict.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from engine_vs_generate import hf_greedy as hf_greedy  # shared with the real-model checks
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
from hf_mcore_bridge.models.tiny_models import tiny_config

VOCAB = 211
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

CONFIGS: dict[str, Callable[[], object]] = {
    # llama3 RoPE scaling with a short original context, so the scaling changes the logits of short prompts.
    "llama": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: MistralConfig(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
    "qwen2": lambda: Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Explicit head_dim different from hidden / heads, and tied embeddings.
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}
ARCH_NAMES = tuple(CONFIGS)

QWEN3_MOE = dict(
    COMMON,
    num_hidden_layers=3,
    head_dim=32,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],  # layers 0 and 2 route to experts, layer 1 is dense
)

MOE_CONFIGS: dict[str, Callable[[], object]] = {
    "mixtral": lambda: MixtralConfig(
        **{**COMMON, "intermediate_size": 48},
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=True),
    # The same weights (same shapes, same seed) routed with the top-k softmax values as they are.
    "qwen3_moe_unnormalised": lambda: Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=False),
    # A shared expert beside the routed ones; norm_topk_prob keeps its default, False.
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2
    ),
}
GLM4_MOE = dict(
    COMMON,
    num_hidden_layers=3,
    head_dim=32,
    partial_rotary_factor=0.5,  # 16 of each head's 32 dimensions rotate
    attention_bias=True,
    first_k_dense_replace=1,  # layer 0 dense, layers 1 and 2 routed
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=4,
    n_shared_experts=2,
    num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
)

MOE_CONFIGS.update(
    {
        # GLM-4.5: q/k norms, groups that restrict the choice (2 of 4), a scaling factor
        "glm4_moe": lambda: Glm4MoeConfig(
            **GLM4_MOE, use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True
        ),
        # GLM-4.5-Air's switches: no q/k norm, one group, no scaling
        "glm4_moe_air": lambda: Glm4MoeConfig(
            **GLM4_MOE, use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True
        ),
    }
)
# GPT-OSS: window 6 on layer 0 (prompts and generations run past it), a sink logit per head, YaRN without truncation
# over a short original context (so it changes short prompts' logits), biased router and experts, and a clamp low
# enough that the tiny model's activations reach it
MOE_CONFIGS["gpt_oss"] = lambda: GptOssConfig(
    **COMMON,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
    swiglu_limit=0.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
)
MOE_ARCH_NAMES = tuple(MOE_CONFIGS)


def build_hf_model(arch: str, seed: int) -> PreTrainedModel:
    """A float32 HF model with every parameter random (biases and norm weights too, unlike HF's own init)."""
    return build_hf_from_config({**CONFIGS, **MOE_CONFIGS}[arch](), seed)


def build_hf_from_config(config: object, seed: int) -> PreTrainedModel:
    """`build_hf_model` for a config built by the caller (persistent buffers, such as GLM's router score bias, are
    random too)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in (*model.named_parameters(), *persistent_buffers(model)):
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.08 * noise)
    return model


def build_hybrid_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """The registry's tiny model of a hybrid Gated DeltaNet architecture, every weight random; its zero-centred
    norms (weight + 1, all but Gated DeltaNet's own) at 1 + 0.2 noise in effect, as the other architectures' plain
    norms are (`build_hf_from_config`)."""
    fields = tiny_config(arch)
    model = build_hf_from_config(AutoConfig.for_model(fields.pop("model_type"), **fields), seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and ".linear_attn." not in name:
                param.sub_(1.0)
    return model


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a model saves with its weights (GLM's `e_score_correction_bias`; none for the others)."""
    saved = set(model.state_dict())
    return [(name, buffer) for name, buffer in model.named_buffers() if name in saved]


def tiny_engine_config(**overrides: object) -> EngineConfig:
    """CPU fp32 engine settings sized for the tiny models (small blocks so prompts span several)."""
    settings: dict[str, object] = dict(
        dtype=torch.float32,
        device="cpu",
        max_num_seqs=8,
        max_model_len=64,
        kv_cache_memory_bytes=256 * 1024,
        block_size=4,
        max_num_batched_tokens=256,
    )
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


def hub_weights(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors as transformers saves them (HF names, full tensors; per-expert names for MoE)."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        files = sorted(Path(directory).glob("*.safetensors"))
        return [item for file in files for item in load_file(file).items()]


def engine_from_hf(model: PreTrainedModel, **overrides: object) -> Engine:
    """An engine whose weights are pushed through `load_weights` in the layout transformers saves."""
    engine = Engine(model.config, tiny_engine_config(**overrides))
    engine.load_weights(hub_weights(model))
    return engine


def hf_token_logprobs(
    model: PreTrainedModel, prompt: list[int], generated: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / temperature) of each generated token, from one transformers forward pass."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / t, dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logprobs[rows, torch.tensor(generated)].tolist()


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=10)


def engine_greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens per prompt from the engine, sampled twice (n=2): both samples must agree."""
    outputs = engine.generate(prompts, GREEDY)
    for output in outputs:
        assert output.samples[0].token_ids == output.samples[1].token_ids
    return [output.samples[0].token_ids for output in outputs]
