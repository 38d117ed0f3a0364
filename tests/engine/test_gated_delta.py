"""The engine's Gated DeltaNet layer against transformers' own modules (`Qwen3NextGatedDeltaNet`, Qwen3.5's
`Qwen3_5GatedDeltaNet`), same weights, tiny configs, float32 on CPU: whole sequences in one flat batch, prefill in
chunks continuing from each sequence's state, token-by-token decode, n samples copied from one prompt's state, a
preempted sequence recomputed, and a two-way tensor-parallel split whose partial outputs sum to the whole."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from hf_mcore_bridge.engine.gated_delta import (
    GatedDeltaNet,
    LinearAttnSpec,
    LinearBatch,
    decode_batch,
    linear_attn_shards,
    prefill_batch,
    take,
)
from hf_mcore_bridge.engine.state_cache import StateCache, StateShape
from hf_mcore_bridge.engine.tp_shards import TPRank

SIZES = {
    "hidden_size": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
}
LAYOUTS = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet, True),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet, False),
}
TOL = {"atol": 1e-5, "rtol": 0}


def hf_layer(layout: str, seed: int = 0) -> tuple[torch.nn.Module, LinearAttnSpec]:
    """transformers' layer with every parameter random (norm weight, dt_bias included), and its spec."""
    config_class, module_class, fused = LAYOUTS[layout]
    config = config_class(**SIZES)
    torch.manual_seed(seed)
    layer = module_class(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.rand_like(param) * 2 - 1)
            elif name == "norm.weight":
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.15)
    return layer, LinearAttnSpec.from_hf(config, fused_projections=fused)


ONE_RANK = TPRank(1, 0)


def engine_layer(hf: torch.nn.Module, spec: LinearAttnSpec, place: TPRank = ONE_RANK) -> GatedDeltaNet:
    layer = GatedDeltaNet(spec, place, torch.float32, "cpu")
    loaded = layer.load_full((name, p.detach()) for name, p in hf.named_parameters())
    assert loaded == {name for name, _ in layer.named_parameters()}
    return layer


def cache_for(layer: GatedDeltaNet, num_slots: int = 8) -> StateCache:
    local = layer.spec
    shape = StateShape(
        1, local.conv_dim, local.conv_kernel, local.num_v_heads, local.head_k_dim, local.head_v_dim, torch.float32
    )
    return StateCache(shape, num_slots, "cpu")


def hf_forward(hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' output for one whole sequence [L, hidden] (no cache: zero initial states)."""
    with torch.no_grad():
        return hf(x[None])[0]


def run(layer: GatedDeltaNet, cache: StateCache, pieces: list[torch.Tensor], batch: LinearBatch) -> torch.Tensor:
    with torch.no_grad():
        return layer(torch.cat(pieces), batch, *cache.layer(0))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sequences_of_a_flat_batch_match_transformers_each_alone(layout: str) -> None:
    hf, spec = hf_layer(layout)
    layer, lengths = engine_layer(hf, spec), [5, 70, 1, 131]  # one chunk, two, one token, three
    cache = cache_for(layer)
    xs = [torch.randn(n, spec.hidden_size) for n in lengths]
    slots = [cache.allocate() for _ in lengths]
    out = run(layer, cache, xs, prefill_batch(lengths, slots, spec.conv_kernel, "cpu"))
    for x, got in zip(xs, out.split(lengths), strict=True):
        torch.testing.assert_close(got, hf_forward(hf, x), **TOL)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunked_prefill_then_decode_matches_one_forward(layout: str) -> None:
    """Three sequences prefilled together in chunks of different sizes (each chunk continuing from its own
    sequence's states: conv windows across the chunk boundary, chunks shorter than the conv window), then decoded
    token by token together; every output equals transformers' over the whole sequence."""
    hf, spec = hf_layer(layout, seed=1)
    layer = engine_layer(hf, spec)
    cache = cache_for(layer)
    chunks = [[40, 2, 30], [1, 66, 3], [70, 1, 5]]
    decode_steps = 4
    xs = [torch.randn(sum(c) + decode_steps, spec.hidden_size) for c in chunks]
    slots = [cache.allocate() for _ in chunks]
    got: list[list[torch.Tensor]] = [[] for _ in chunks]
    starts = [0] * len(chunks)
    for step in range(3):
        lengths = [c[step] for c in chunks]
        pieces = [x[s : s + n] for x, s, n in zip(xs, starts, lengths, strict=True)]
        out = run(layer, cache, pieces, prefill_batch(lengths, slots, spec.conv_kernel, "cpu"))
        for outputs, part in zip(got, out.split(lengths), strict=True):
            outputs.append(part)
        starts = [s + n for s, n in zip(starts, lengths, strict=True)]
    for step in range(decode_steps):
        pieces = [x[s + step : s + step + 1] for x, s in zip(xs, starts, strict=True)]
        out = run(layer, cache, pieces, decode_batch(torch.tensor(slots)))
        for outputs, part in zip(got, out.split(1), strict=True):
            outputs.append(part)
    for x, outputs in zip(xs, got, strict=True):
        torch.testing.assert_close(torch.cat(outputs), hf_forward(hf, x), **TOL)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_samples_start_from_the_copied_prompt_state_and_a_preempted_one_recomputes(layout: str) -> None:
    hf, spec = hf_layer(layout, seed=2)
    layer = engine_layer(hf, spec)
    cache = cache_for(layer)
    prompt = torch.randn(20, spec.hidden_size)
    first = cache.allocate()
    run(layer, cache, [prompt], prefill_batch([20], [first], spec.conv_kernel, "cpu"))
    siblings = [cache.allocate() for _ in range(2)]
    cache.copy(first, siblings)
    samples = [first, *siblings]
    tokens = [torch.randn(1, spec.hidden_size) for _ in samples]  # each sample decodes its own token
    out = run(layer, cache, tokens, decode_batch(torch.tensor(samples)))
    for token, got in zip(tokens, out.split(1), strict=True):
        torch.testing.assert_close(got[0], hf_forward(hf, torch.cat([prompt, token]))[-1], **TOL)

    # preempted: the slot goes back; readmitted, a zeroed slot recomputes from the sequence's inputs so far
    preempted = siblings[0]
    cache.free(preempted)
    again = cache.allocate()
    assert again == preempted
    assert not cache.conv[:, again].any() and not cache.recurrent[:, again].any()
    so_far = torch.cat([prompt, tokens[1]])
    run(layer, cache, [so_far], prefill_batch([21], [again], spec.conv_kernel, "cpu"))
    nxt = torch.randn(1, spec.hidden_size)
    got = run(layer, cache, [nxt], decode_batch(torch.tensor([again])))
    torch.testing.assert_close(got[0], hf_forward(hf, torch.cat([so_far, nxt]))[-1], **TOL)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_two_way_tensor_parallel_split_sums_to_the_whole(layout: str) -> None:
    """Each rank's layer (its key heads, their value heads, out_proj's columns of them, its own states) over a
    prefill and a decode step; the partial outputs summed equal transformers' layer."""
    hf, spec = hf_layer(layout, seed=3)
    ranks = [engine_layer(hf, spec, TPRank(2, rank)) for rank in range(2)]
    assert ranks[0].spec.num_k_heads == 1 and ranks[0].spec.num_v_heads == 2
    caches = [cache_for(layer) for layer in ranks]
    x = torch.randn(11, spec.hidden_size)
    total = torch.zeros(11, spec.hidden_size)
    for layer, cache in zip(ranks, caches, strict=True):
        slot = cache.allocate()
        prefill = run(layer, cache, [x[:10]], prefill_batch([10], [slot], spec.conv_kernel, "cpu"))
        total += torch.cat([prefill, run(layer, cache, [x[10:]], decode_batch(torch.tensor([slot])))])
    torch.testing.assert_close(total, hf_forward(hf, x), **TOL)


def test_the_shard_rule_keeps_each_ranks_heads() -> None:
    """The rule's rows, against an index written out by hand: 2 key heads of dim 8 (q rows 0-15, k rows 16-31),
    4 value heads of dim 6 (v rows 32-55); rank 1 keeps key head 1 and value heads 2 and 3."""
    _, spec = hf_layer("qwen3_5")
    rows = torch.arange(56.0)[:, None]
    kept = take(linear_attn_shards(spec, TPRank(2, 1))["in_proj_qkv.weight"], rows, "in_proj_qkv.weight")
    assert kept[:, 0].tolist() == [*range(8, 16), *range(24, 32), *range(44, 56)]
    fused = linear_attn_shards(LinearAttnSpec(**{**spec.__dict__, "fused_projections": True}), TPRank(2, 1))
    per_key = 2 * 8 + 2 * 2 * 6  # q, k, then v and z of the key head's two value heads
    qkvz = take(fused["in_proj_qkvz.weight"], torch.arange(2.0 * per_key)[:, None], "in_proj_qkvz.weight")
    assert qkvz[:, 0].tolist() == list(range(per_key, 2 * per_key))


def test_bad_sizes_and_inputs_are_refused() -> None:
    _, spec = hf_layer("qwen3_5")
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        LinearAttnSpec(**{**spec.__dict__, "num_v_heads": 5})
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) does not divide by the tensor-parallel size 4"):
        spec.local(TPRank(4, 0))
    with pytest.raises(NotImplementedError, match="gelu"):
        LinearAttnSpec.from_hf({**SIZES, "hidden_act": "gelu"}, fused_projections=False)
    with pytest.raises(ValueError, match="one slot per sequence"):
        prefill_batch([3, 4], [1], 4, "cpu")
    with pytest.raises(ValueError, match="at least one token"):
        prefill_batch([3, 0], [1, 2], 4, "cpu")
    with pytest.raises(ValueError, match="share a state slot"):
        prefill_batch([3, 2], [1, 1], 4, "cpu")
    layer = GatedDeltaNet(spec, TPRank(1, 0), torch.float32, "cpu")
    with pytest.raises(KeyError, match="in_proj_qkvz"):
        layer.load_full([("in_proj_qkvz.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="expected the full tensor"):
        layer.load_full([("in_proj_z.weight", torch.zeros(12, 32))])


def graph_decode_outputs(
    layer: GatedDeltaNet, cache: StateCache, inputs: list[torch.Tensor], slots: list[int], bucket: int
) -> list[torch.Tensor]:
    """Decode steps replayed from one CUDA graph of `bucket` rows: the real sequences' rows first, the padding rows
    reading and writing the scratch slot. `inputs`: [steps, hidden] per sequence; returns [steps, hidden] each."""
    hidden = inputs[0].shape[1]
    static_x = torch.zeros(bucket, hidden, device="cuda")
    static_slots = torch.zeros(bucket, dtype=torch.int64, device="cuda")  # padding rows: the scratch slot
    static_slots[: len(slots)] = torch.tensor(slots)
    batch = decode_batch(static_slots)
    warm = StateCache(cache.shape, 2, "cuda")  # warm-up and capture write the scratch slot only
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static_x, decode_batch(torch.zeros(bucket, dtype=torch.int64, device="cuda")), *warm.layer(0))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, batch, *cache.layer(0))
    outputs = []
    for step in range(inputs[0].shape[0]):
        static_x[: len(slots)] = torch.stack([x[step] for x in inputs])
        graph.replay()
        outputs.append(static_out[: len(slots)].clone())
    return list(torch.stack(outputs, dim=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_prefill_and_graph_replayed_decode_match_transformers(layout: str) -> None:
    """float32 on the GPU: a flat prefill of four sequences, then decode steps replayed from one captured CUDA graph
    of eight rows (four padding rows on the scratch slot), each sequence against transformers' layer on the GPU."""
    hf, spec = hf_layer(layout, seed=4)
    hf = hf.cuda()
    layer = GatedDeltaNet(spec, ONE_RANK, torch.float32, "cuda")
    layer.load_full((name, p.detach()) for name, p in hf.named_parameters())
    cache = StateCache(cache_for(layer).shape, 8, "cuda")
    lengths, steps = [37, 100, 5, 64], 6
    xs = [torch.randn(n + steps, spec.hidden_size, device="cuda") for n in lengths]
    slots = [cache.allocate() for _ in lengths]
    with torch.no_grad():
        prefill = layer(
            torch.cat([x[:n] for x, n in zip(xs, lengths, strict=True)]),
            prefill_batch(lengths, slots, spec.conv_kernel, "cuda"),
            *cache.layer(0),
        )
    decoded = graph_decode_outputs(layer, cache, [x[n:] for x, n in zip(xs, lengths, strict=True)], slots, bucket=8)
    for x, first, rest in zip(xs, prefill.split(lengths), decoded, strict=True):
        torch.testing.assert_close(torch.cat([first, rest]), hf_forward(hf, x), atol=1e-4, rtol=0)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_is_as_close_to_float32_as_transformers_bf16(layout: str, device: str) -> None:
    """bf16: the engine's error against transformers' float32 layer is within twice transformers' own bf16 error
    (the same roundings, in another order)."""
    hf, spec = hf_layer(layout, seed=5)
    hf = hf.to(device)
    x = torch.randn(150, spec.hidden_size, device=device)
    reference = hf_forward(hf, x)
    hf_bf16 = hf.to(torch.bfloat16)
    layer = GatedDeltaNet(spec, ONE_RANK, torch.bfloat16, device)
    layer.load_full((name, p.detach()) for name, p in hf_bf16.named_parameters())
    cache = StateCache(replace(cache_for(layer).shape, conv_dtype=torch.bfloat16), 4, device)
    with torch.no_grad():
        ours = layer(x.bfloat16(), prefill_batch([150], [cache.allocate()], spec.conv_kernel, device), *cache.layer(0))
    theirs = hf_forward(hf_bf16, x.bfloat16())
    ours_err = (ours.float() - reference).abs().max().item()
    theirs_err = (theirs.float() - reference).abs().max().item()
    print(f"{layout}: bf16 max |error| engine {ours_err:.3g}, transformers {theirs_err:.3g}")
    assert ours_err <= 2 * theirs_err + 1e-3
