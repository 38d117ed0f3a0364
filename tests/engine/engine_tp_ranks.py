"""The rank function of the tensor-parallel engine test (`test_engine_tp.py`), run in a 2-rank gloo world.

One world runs every scenario, so process start-up is paid once. The mixture-of-experts models run through the exact
expert loop and through the fast path (`fused_moe`). Each rank writes what its engine returned to
`rank{r}.json`; rank 0 also writes the references (transformers' greedy `generate` and log-probs, and the
single-device engine), computed outside the tensor-parallel engine. The test compares the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine_helpers import (
    ARCH_NAMES,
    COMMON,
    MOE_ARCH_NAMES,
    build_hf_from_config,
    build_hf_model,
    engine_from_hf,
    engine_greedy,
    hf_greedy,
    hf_token_logprobs,
    random_prompts,
    tiny_engine_config,
)
from lora_helpers import ALPHA, RANK, TARGETS, adapter_tensors, peft_model
from transformers import AutoConfig, LlamaConfig, PreTrainedModel

from hf_mcore_bridge.engine import Engine, SamplingParams
from hf_mcore_bridge.engine.attention import bytes_per_block
from hf_mcore_bridge.models.tiny_models import tiny_config

FROM_TINY_CONFIGS = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
"""Built from the project's tiny configs: multi-latent attention (heads split, the latent whole on each rank),
Gemma 3 (windows, both RoPE bases, offset and post-norms), Qwen3.5 (Gated DeltaNet split by key heads, its states
per rank, beside gated attention) and Qwen3-Next (the same with projections fused per key head, and experts)."""
TP_ARCHS = (*ARCH_NAMES, *(a for a in MOE_ARCH_NAMES if a != "qwen3_moe_unnormalised"), "llama_mqa", *FROM_TINY_CONFIGS)
"""Every supported architecture, plus Llama with one KV head (replicated on both ranks)."""
TP_MOE_ARCHS = tuple(a for a in TP_ARCHS if a in MOE_ARCH_NAMES)
"""The mixture-of-experts ones, also run through the fast expert path."""
MAX_TOKENS = 10
"""`engine_helpers.GREEDY`'s max_tokens."""


def _model(arch: str) -> PreTrainedModel:
    if arch in FROM_TINY_CONFIGS:
        fields = tiny_config(FROM_TINY_CONFIGS[arch])
        return build_hf_from_config(AutoConfig.for_model(fields.pop("model_type"), **fields), seed=0)
    if arch == "llama_mqa":
        return build_hf_from_config(LlamaConfig(**{**COMMON, "num_key_value_heads": 1}), seed=0)
    return build_hf_model(arch, seed=0)


def _save(model: PreTrainedModel, directory: Path) -> Path:
    """The model saved as transformers saves it (by rank 0 only: `save_pretrained` writes nothing on the other
    ranks of an initialised world)."""
    if dist.get_rank() == 0 and not directory.exists():
        model.save_pretrained(directory)
    dist.barrier()
    return directory


def _tp_engine(directory: Path, group: dist.ProcessGroup, **overrides: object) -> Engine:
    """A tensor-parallel engine; every rank reads the full tensors from `directory` and keeps its slices."""
    return Engine.from_pretrained(directory, tiny_engine_config(**overrides), tp_group=group)


def tp_engine_rank(out: str) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # the engine is given its group; it builds none
    mine: dict[str, Any] = {"greedy": {}}
    refs: dict[str, Any] = {"hf": {}, "tp1": {}}
    prompts = random_prompts([5, 11, 3], seed=3)
    models, dirs = {}, {}
    for arch in TP_ARCHS:
        models[arch] = model = _model(arch)
        dirs[arch] = _save(model, Path(out, arch))
        cache = {"kv_cache_memory_bytes": 1 << 20} if arch in FROM_TINY_CONFIGS else {}  # 4-8 layers, not 2
        engine = _tp_engine(dirs[arch], group, **cache)
        mine["greedy"][arch] = engine_greedy(engine, prompts)
        if arch == "qwen3_moe":
            # sleep/wake: weights released, then reloaded as a live transformers-5 model names them (fused
            # experts), each rank taking its slices again
            engine.sleep(level=2)
            engine.wake_up()
            engine.load_weights(model.named_parameters())
            mine["after_wake"] = engine_greedy(engine, prompts)
        if rank == 0:
            refs["hf"][arch] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
            refs["tp1"][arch] = engine_greedy(engine_from_hf(model, **cache), prompts)

    # LoRA adapters applied by the engine's linears at TP2 (`engine.lora`): A whole or split by columns, B split by
    # rows (one KV head, replicated, for llama_mqa); PEFT's greedy tokens and log-probs
    mine["lora"], refs["lora"] = {}, {}
    for arch in ("llama", "llama_mqa"):
        adapted = peft_model(models[arch])
        lora = {"lora_rank": RANK, "lora_scale": ALPHA / RANK, "lora_targets": TARGETS}
        engine = _tp_engine(dirs[arch], group, **lora)
        engine.load_weights(adapter_tensors(adapted))
        (sampled,) = engine.generate([prompts[1]], SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=11))
        mine["lora"][arch] = {"greedy": engine_greedy(engine, prompts), "sampled": sampled.samples[0].token_ids}
        mine["lora"][arch]["logprobs"] = sampled.samples[0].logprobs
        if rank == 0:
            with torch.no_grad():
                refs["lora"][arch] = {
                    "greedy": [hf_greedy(adapted, p, MAX_TOKENS) for p in prompts],
                    "logprobs": hf_token_logprobs(adapted, prompts[1], sampled.samples[0].token_ids, 1.0),
                }

    # The fast expert path under expert tensor parallelism: `torch._grouped_mm` (its CPU loop), and the Triton
    # grouped GEMM where Triton runs on CPU tensors (its interpreter, machines without CUDA: see conftest)
    kernels = ("grouped_mm", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("grouped_mm",)
    mine["fast_moe"] = {
        f"{arch}/{kernel}": engine_greedy(_tp_engine(dirs[arch], group, moe_kernel=kernel), prompts)
        for arch in TP_MOE_ARCHS
        for kernel in kernels
    }

    # Continuous batching and preemption: 12 sequences through 4 slots and 17 usable blocks (each rank's cache
    # holds one of the two KV heads).
    model = models["llama"]
    batch_prompts = random_prompts([6, 9, 3, 14, 7, 5], seed=5)
    budget = 18 * bytes_per_block(2, 4, 1, 16, torch.float32)
    engine = _tp_engine(dirs["llama"], group, max_num_seqs=4, kv_cache_memory_bytes=budget)
    outputs = engine.generate(batch_prompts, SamplingParams(n=2, temperature=0.0, max_tokens=16))
    mine["batching"] = [[s.token_ids for s in o.samples] for o in outputs]
    mine["batching_stats"] = vars(engine.last_stats)
    if rank == 0:
        refs["batching"] = [hf_greedy(model, p, 16) for p in batch_prompts]

    # Prefix sharing and sampling at temperature 1, unseeded: the seed is drawn once and shared by the group.
    model = models["qwen2"]
    prompt = random_prompts([10], seed=7)[0]
    engine = _tp_engine(dirs["qwen2"], group)
    (output,) = engine.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=8))
    mine["sampled"] = [s.token_ids for s in output.samples]
    mine["sampled_logprobs"] = [s.logprobs for s in output.samples]
    mine["sampled_stats"] = vars(engine.last_stats)
    # a seeded prompt (a seed beyond int64) beside an unseeded one in one call
    mixed = [SamplingParams(n=2, max_tokens=4, seed=2**64 - 5), SamplingParams(n=2, max_tokens=4)]
    mine["mixed_seeds"] = [[s.token_ids for s in o.samples] for o in engine.generate([prompt, prompt], mixed)]
    if rank == 0:
        refs["sampled_logprobs"] = [hf_token_logprobs(model, prompt, s.token_ids, 1.0) for s in output.samples]
        refs["sampled_prompt_len"] = len(prompt)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"mine": mine, "refs": refs}))
