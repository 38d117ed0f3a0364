"""CUDA-only checks: the engine on the GPU against transformers, CUDA-graph decode against eager decode, and the
mixture-of-experts models: eagerly through the exact expert loop, in graphs through the fast path, whose grouped
GEMMs (Triton and `torch._grouped_mm`) equal the exact path in bf16 at Qwen3-30B-A3B's expert shape, synchronise
nothing with the host and replay in a CUDA graph (with either sort by expert; the Triton sort equals the torch one
at decode sizes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    ARCH_NAMES,
    MOE_ARCH_NAMES,
    MOE_CONFIGS,
    build_hf_model,
    build_hybrid_model,
    hf_token_logprobs,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)

from hf_mcore_bridge.engine import Engine, SamplingParams, read_spec
from hf_mcore_bridge.engine.expert_sort import sort_by_expert, sort_by_expert_triton
from hf_mcore_bridge.engine.fused_moe import ExpertActivation, fused_experts, grouped_mm_experts
from hf_mcore_bridge.engine.model import SparseMoe, route, routed_experts
from hf_mcore_bridge.engine.tp_shards import TPRank, local_sizes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def local_sizes_of(spec):
    """The widths of a model on one device."""
    moe = spec.moe
    return local_sizes(
        spec.num_attention_heads,
        spec.num_query_groups,
        spec.ffn_hidden_size,
        moe.ffn_hidden_size,
        moe.shared_expert_size,
        spec.vocab_size,
        TPRank(1, 0),
    )


def _cuda_engine(model, graphs: bool, kernel: str = "auto") -> Engine:
    config = tiny_engine_config(
        device="cuda", use_cuda_graphs=graphs, block_size=16, decode_attention=kernel, flex_min_batch=1
    )
    engine = Engine(model.config, config)
    engine.load_weights(model.state_dict().items())
    return engine


@pytest.mark.parametrize("kernel", ["triton", "flex", "gather"])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_cuda_graph_decode_matches_eager_and_transformers(arch, kernel):
    """The Triton kernel and compiled FlexAttention (both reading the blocks in place) and SDPA over gathered
    blocks, eager and in graphs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hf_model(arch, 0)
    model = build_hf_model(arch, 0).to("cuda")
    prompts = random_prompts([5, 20, 33], seed=11)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=3)
    eager = _cuda_engine(model, graphs=False, kernel=kernel).generate(prompts, params)
    graphed_engine = _cuda_engine(model, graphs=True, kernel=kernel)
    graphed = graphed_engine.generate(prompts, params)
    assert graphed_engine.num_cuda_graphs > 0
    for prompt, a, b in zip(prompts, eager, graphed, strict=True):
        for sa, sb in zip(a.samples, b.samples, strict=True):
            assert sa.token_ids == sb.token_ids
            assert sb.logprobs == pytest.approx(sa.logprobs, abs=1e-5)
            expected = hf_token_logprobs(reference_model, prompt, sb.token_ids, 0.8)
            assert sb.logprobs == pytest.approx(expected, abs=1e-4)


def test_refit_keeps_captured_graphs_valid():
    first, second = build_hf_model("llama", 0).to("cuda"), build_hf_model("llama", 1).to("cuda")
    engine = _cuda_engine(first, graphs=True)
    prompts = random_prompts([7, 9], seed=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    engine.generate(prompts, greedy)
    engine.load_weights(second.state_dict().items())
    after = engine.generate(prompts, greedy)
    reference = _cuda_engine(second, graphs=False).generate(prompts, greedy)
    assert [o.samples[0].token_ids for o in after] == [o.samples[0].token_ids for o in reference]


@pytest.mark.parametrize("moe_kernel", ["exact", "triton"])
@pytest.mark.parametrize("arch", MOE_ARCH_NAMES)
def test_moe_decode_matches_transformers_eagerly_or_in_graphs(arch, moe_kernel):
    """The exact expert loop decodes eagerly even when graphs are asked for; the fast path (the Triton grouped GEMM)
    is captured in the decode graphs, and its graphs give the tokens of its eager decode."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hf_model(arch, 0)
    prompts = random_prompts([5, 20, 33], seed=13)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=4)
    outputs = {}
    for graphs in (True, False):
        config = tiny_engine_config(device="cuda", use_cuda_graphs=graphs, block_size=16, moe_kernel=moe_kernel)
        engine = Engine(reference_model.config, config)
        engine.load_weights(hub_weights(reference_model))
        outputs[graphs] = engine.generate(prompts, params)
        if graphs:
            assert (engine.num_cuda_graphs > 0) == (moe_kernel != "exact")
    for prompt, graphed, eager in zip(prompts, outputs[True], outputs[False], strict=True):
        for sample, eager_sample in zip(graphed.samples, eager.samples, strict=True):
            assert sample.token_ids == eager_sample.token_ids
            expected = hf_token_logprobs(reference_model, prompt, sample.token_ids, 0.8)
            assert sample.logprobs == pytest.approx(expected, abs=1e-4)


QWEN3_30B_A3B_LAYER = dict(hidden=2048, width=768, experts=128, top_k=8)
"""Qwen3-30B-A3B's expert shape."""


def _bf16_experts(tokens: int, hidden: int, width: int, experts: int, top_k: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    gate_up = (0.02 * torch.randn(experts, 2 * width, hidden, device="cuda", generator=gen)).bfloat16()
    down = (0.02 * torch.randn(experts, hidden, width, device="cuda", generator=gen)).bfloat16()
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, chosen = route(logits, top_k, renormalize=True)
    return x, gate_up, down, weights, chosen


@pytest.mark.parametrize("tokens", [64, 2048], ids=["decode", "prefill"])
@pytest.mark.parametrize("kernel", ["triton", "grouped_mm"])
def test_fast_moe_equals_the_exact_path_in_bf16(kernel, tokens):
    """At Qwen3-30B-A3B's expert shape, bf16 operands: both paths against a float64 product of the same operands;
    the fast path is no further from it than the exact path (it rounds less: the products once, after the
    activation). Also with biases and the clamped activation, at a smaller shape."""
    fast = {"triton": fused_experts, "grouped_mm": grouped_mm_experts}[kernel]
    x, gate_up, down, weights, chosen = _bf16_experts(tokens, **QWEN3_30B_A3B_LAYER)
    reference = routed_experts(x.double(), gate_up.double(), down.double(), weights.double(), chosen)
    exact_error = (routed_experts(x, gate_up, down, weights, chosen).double() - reference).abs().max()
    fast_error = (fast(x, gate_up, down, weights, chosen).double() - reference).abs().max()
    assert fast_error <= 1.5 * exact_error, (fast_error, exact_error)

    x, gate_up, down, weights, chosen = _bf16_experts(tokens // 4, 256, 128, 16, 4, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    biases = {
        "gate_up_bias": (0.5 * torch.randn(16, 256, device="cuda", generator=gen)).bfloat16(),
        "down_bias": (0.5 * torch.randn(16, 256, device="cuda", generator=gen)).bfloat16(),
    }
    clamped = ExpertActivation(limit=0.05)
    in64 = {name: b.double() for name, b in biases.items()}
    reference = routed_experts(
        x.double(), gate_up.double(), down.double(), weights.double(), chosen, activation=clamped, **in64
    )
    exact = routed_experts(x, gate_up, down, weights, chosen, activation=clamped, **biases)
    got = fast(x, gate_up, down, weights, chosen, activation=clamped, **biases)
    assert (got.double() - reference).abs().max() <= 1.5 * (exact.double() - reference).abs().max()


@pytest.mark.parametrize("kernel, sort", [("triton", "torch"), ("triton", "triton"), ("grouped_mm", "torch")])
def test_fast_moe_layer_syncs_nothing_and_replays_in_a_cuda_graph(kernel, sort):
    """A whole MoE layer (router, sort by expert, in torch or one Triton kernel, grouped GEMMs, shared expert) of a
    Qwen2-MoE-style model at Qwen3-30B-A3B's expert shape: no host synchronisation (`set_sync_debug_mode("error")`
    raises on one; the exact path trips it), captured in a CUDA graph whose replay on new inputs equals the eager
    layer."""
    config = {
        **MOE_CONFIGS["qwen2_moe"]().to_dict(),
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "shared_expert_intermediate_size": 1024,
        "num_experts": 128,
        "num_experts_per_tok": 8,
    }
    spec = read_spec(config)
    gen = torch.Generator(device="cuda").manual_seed(3)
    layers = {}
    for name in (kernel, "exact"):
        layer = SparseMoe(spec, local_sizes_of(spec), torch.bfloat16, "cuda", moe_kernel=name, moe_sort=sort)
        for p in layer.parameters():
            p.data.copy_(0.02 * torch.randn(p.shape, device="cuda", generator=gen))
        layers[name] = layer
    static = torch.randn(64, 2048, device="cuda", generator=gen).bfloat16()
    layer = layers[kernel]
    with torch.inference_mode():
        layer(static)  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(static)
            with pytest.raises(RuntimeError, match="synchroniz"):
                layers["exact"](static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(static)
        fresh = torch.randn(64, 2048, device="cuda", generator=gen).bfloat16()
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(captured, layer(fresh))


@pytest.mark.parametrize("tokens, experts, block_m", [(64, 128, 16), (512, 128, 64), (64, 1024, 16), (513, 128, 16)])
def test_triton_sort_equals_the_torch_sort_at_decode_sizes(tokens, experts, block_m):
    """The compiled sort (`expert_sort.sort_by_expert_triton`) against the torch sort, field by field, at top-8
    routing: Qwen3-30B-A3B's decode batch (512 pairs), the kernel's 4096-pair limit with 64-row blocks, 1024
    experts, and one token past the limit (the torch sort itself); the CPU tests check both against a reference."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    chosen = torch.rand(tokens, experts, device="cuda", generator=gen).topk(8, dim=1).indices
    got = sort_by_expert_triton(chosen, experts, block_m)
    expected = sort_by_expert(chosen, experts, block_m)
    for field in ("sorted_pairs", "block_expert", "group_ends"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field


@pytest.mark.parametrize("graphs", [False, True])
def test_latent_decode_kernel_matches_transformers(graphs, tiny_moe_models):
    """DeepSeek-V3's tiny model decoding through the Triton latent kernel (`triton_mla`) and the fast expert path,
    eager and in CUDA graphs, against transformers' log-probs."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    directory = tiny_moe_models["deepseek_v3"]
    reference_model = AutoModelForCausalLM.from_pretrained(directory).eval()
    config = tiny_engine_config(device="cuda", use_cuda_graphs=graphs, block_size=16, decode_attention="triton")
    engine = Engine.from_pretrained(directory, config)
    assert (engine.model.decode_kernel, engine.model.moe_kernel) == ("triton", "triton")
    prompts = random_prompts([5, 20, 33], seed=14)
    outputs = engine.generate(prompts, SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=5))
    assert (engine.num_cuda_graphs > 0) == graphs
    for prompt, output in zip(prompts, outputs, strict=True):
        for sample in output.samples:
            expected = hf_token_logprobs(reference_model, prompt, sample.token_ids, 0.8)
            assert sample.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("rows", [4, 64])
def test_latent_decode_kernel_in_bf16_at_deepseek_v3_shape(rows):
    """DeepSeek-V3's latent (rank 512, rotary 64) and 128 heads, 32-token blocks, contexts up to 1000 tokens (split
    over the length at 4 rows, not at 64): within the gathered SDPA path's own bf16 error of a float64 reference."""
    from hf_mcore_bridge.engine.mla import gather_latent
    from hf_mcore_bridge.engine.triton_mla import paged_mla_decode

    rank, rope, heads, block = 512, 64, 128, 32
    gen = torch.Generator(device="cuda").manual_seed(7)
    lengths = torch.randint(1, 1000, (rows,), device="cuda", generator=gen)
    n_blocks = 32
    cache = torch.randn(1, rows * n_blocks + 1, block, 1, rank + rope, device="cuda", generator=gen).bfloat16()
    tables = 1 + torch.randperm(rows * n_blocks, device="cuda", generator=gen).view(rows, n_blocks)
    q_latent = torch.randn(rows, heads, rank, device="cuda", generator=gen).bfloat16()
    q_rope = torch.randn(rows, heads, rope, device="cuda", generator=gen).bfloat16()
    scale = 0.02
    entries = gather_latent(cache, tables).double()  # [B, L, rank + rope]
    scores = torch.einsum("bhc,blc->bhl", torch.cat((q_latent, q_rope), -1).double(), entries) * scale
    valid = torch.arange(entries.shape[1], device="cuda")[None, :] < lengths[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    expected = torch.einsum("bhl,blc->bhc", torch.softmax(scores, -1), entries[..., :rank])
    query = torch.cat((q_latent, q_rope), -1).unsqueeze(1)
    mask = torch.zeros(rows, 1, 1, entries.shape[1], device="cuda").masked_fill(~valid[:, None, None, :], -torch.inf)
    sdpa_latent = entries.bfloat16()[..., :rank].unsqueeze(1)
    sdpa_entries = entries.bfloat16().unsqueeze(1)
    sdpa = F.scaled_dot_product_attention(query, sdpa_entries, sdpa_latent, attn_mask=mask.bfloat16(), scale=scale)
    gathered_error = (sdpa.squeeze(1).double() - expected).abs().max()
    got = paged_mla_decode(q_latent, q_rope, cache, tables, lengths, scale)
    assert (got.double() - expected).abs().max() <= max(1.5 * gathered_error, 1e-2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_routing_recorded_in_decode_graphs_equals_eager_recording(arch):
    """`record_routing` with the fast path captured in decode graphs (the copy into the routing buffer is part of
    each graph, the per-step copy out is queued before the next step): every sample's tokens and recorded experts
    equal the eager engine's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hf_model(arch, 0)
    prompts = random_prompts([5, 20, 33], seed=13)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=4)
    recorded = {}
    for graphs in (True, False):
        config = tiny_engine_config(
            device="cuda", use_cuda_graphs=graphs, block_size=16, moe_kernel="triton", record_routing=True
        )
        engine = Engine(reference_model.config, config)
        engine.load_weights(hub_weights(reference_model))
        outputs = engine.generate(prompts, params)
        assert (engine.num_cuda_graphs > 0) == graphs
        recorded[graphs] = [(s.token_ids, s.routed_experts) for out in outputs for s in out.samples]
    for (tokens, routed), (eager_tokens, eager_routed) in zip(recorded[True], recorded[False], strict=True):
        assert tokens == eager_tokens
        assert routed is not None and eager_routed is not None and torch.equal(routed, eager_routed)


@pytest.mark.parametrize("kernel", ["triton", "triton+fused_rope", "gather"])
def test_gpt_oss_window_and_sinks_decode_in_graphs_matches_eager_and_transformers(kernel):
    """GPT-OSS (window 6 on layer 0, sinks, YaRN, biased clamped experts through the Triton grouped GEMM) decoding
    past its window through each decode kernel that takes windows and sinks, in CUDA graphs and eagerly."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hf_model("gpt_oss", 0)
    prompts = random_prompts([5, 20, 33], seed=14)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=6)
    kernel, _, fused = kernel.partition("+")
    outputs = {}
    for graphs in (True, False):
        config = tiny_engine_config(
            device="cuda",
            use_cuda_graphs=graphs,
            block_size=16,
            decode_attention=kernel,
            fused_rope=fused == "fused_rope",
            moe_kernel="triton",
        )
        engine = Engine(reference_model.config, config)
        engine.load_weights(hub_weights(reference_model))
        outputs[graphs] = engine.generate(prompts, params)
        assert (engine.num_cuda_graphs > 0) == graphs
    for prompt, graphed, eager in zip(prompts, outputs[True], outputs[False], strict=True):
        for sample, eager_sample in zip(graphed.samples, eager.samples, strict=True):
            assert sample.token_ids == eager_sample.token_ids
            expected = hf_token_logprobs(reference_model, prompt, sample.token_ids, 0.8)
            assert sample.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 128])
def test_triton_decode_with_window_and_sinks_at_gpt_oss_20b_shape(window, dtype):
    """The compiled Triton decode kernel at gpt-oss-20b's attention shape (64 query heads over 8 KV heads of 64,
    window 128 on its sliding layers, a sink per head, 32-token blocks), long and short contexts, one row and a
    batch (split and unsplit over the window's blocks), against float64 attention written here."""
    from hf_mcore_bridge.engine.triton_decode import paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, head_dim, block = 64, 8, 64, 32
    lengths = torch.tensor([1, 100, 129, 1000, 4000], device="cuda")
    n_blocks = -(-int(lengths.max()) // block)
    cache = torch.randn(2, len(lengths) * n_blocks + 1, block, kv_heads, head_dim, device="cuda", generator=gen)
    cache = cache.to(dtype)
    tables = torch.randperm(len(lengths) * n_blocks, device="cuda", generator=gen).view(len(lengths), n_blocks) + 1
    q = torch.randn(len(lengths), heads, head_dim, device="cuda", generator=gen).to(dtype)
    sinks = torch.randn(heads, device="cuda", generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = []
    for b, length in enumerate(lengths.tolist()):
        slots = (tables[b][:, None] * block + torch.arange(block, device="cuda")).flatten()[:length]
        slots = slots if window is None else slots[-window:]
        k = cache[0].view(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        v = cache[1].view(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.cat((torch.einsum("hd,thd->ht", q[b].double(), k) * scale, sinks.double()[:, None]), dim=-1)
        expected.append(torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1)[:, :-1], v))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    # one long row (split over the KV length: the window's 5 blocks make 1 split by default, 3 asked for), then the
    # batch
    for rows, splits in ((slice(3, 4), None), (slice(3, 4), 3), (slice(None), None)):
        out = paged_decode_attention(
            q[rows], cache, tables[rows], lengths[rows], scale, splits, window=window, sinks=sinks
        ).double()
        torch.testing.assert_close(out, torch.stack(expected)[rows], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", ["triton", "gather"])
@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"])
def test_hybrid_decode_in_graphs_matches_eager_and_transformers(arch, kernel):
    """Gated DeltaNet's states in CUDA graphs: the state slots travel in the packed graph inputs (padded rows in the
    scratch slot), the state tensors are allocated before the first capture. After sleep and wake_up (new state
    tensors, graphs cleared) the same samples come back."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hybrid_model(arch)
    model = build_hybrid_model(arch).to("cuda")
    prompts = random_prompts([5, 20, 70], seed=11)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=20, seed=3)
    config = dict(
        device="cuda", block_size=16, decode_attention=kernel, max_model_len=128, kv_cache_memory_bytes=1 << 20
    )

    def engine(graphs: bool) -> Engine:
        runner = Engine(model.config, tiny_engine_config(**config, use_cuda_graphs=graphs))
        runner.load_weights(model.state_dict().items())
        return runner

    prompts = prompts[:1] + prompts  # 8 sequences, fewer as they finish: padded buckets
    eager = engine(graphs=False).generate(prompts, params)
    graphed_engine = engine(graphs=True)
    graphed = graphed_engine.generate(prompts, params)
    assert graphed_engine.num_cuda_graphs > 0
    graphed_engine.sleep(level=1)
    graphed_engine.wake_up()
    again = graphed_engine.generate(prompts, params)
    for prompt, a, b, c in zip(prompts, eager, graphed, again, strict=True):
        for sa, sb, sc in zip(a.samples, b.samples, c.samples, strict=True):
            assert sa.token_ids == sb.token_ids == sc.token_ids
            assert sb.logprobs == pytest.approx(sa.logprobs, abs=1e-5)
            expected = hf_token_logprobs(reference_model, prompt, sb.token_ids, 0.8)
            assert sb.logprobs == pytest.approx(expected, abs=1e-4)
