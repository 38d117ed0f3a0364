"""Mixture-of-experts architectures (Mixtral, Qwen3-MoE, Qwen2-MoE, GLM-4.5 and GLM-4.5-Air's switches) against
transformers.

Weights reach the engine only through `load_weights`, with the per-expert names transformers saves. Checked: greedy
tokens identical to `generate` and per-token log-probs within 1e-5 of a transformers forward pass (prompts of different
lengths, n > 1), through the exact expert loop and through the fast sorted grouped GEMM (Triton, in its interpreter
here, and `torch._grouped_mm`), `norm_topk_prob` on and off, a refit to other weights, a bit-exact read-back of every
saved tensor, the routing and expert pieces alone against transformers' own modules (softmax routers, GLM's sigmoid
router with score bias and groups), which layers get experts, config keys (expert count, Qwen2-MoE's `qkv_bias`), the
errors for missing, unknown or misshapen expert tensors, GLM checkpoints with multi-token-prediction layers
(skipped), and the recorded routing of every token (`EngineConfig.record_routing`) against transformers' top-k."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from engine_helpers import (
    GREEDY,
    MOE_ARCH_NAMES,
    MOE_CONFIGS,
    QWEN3_MOE,
    build_hf_from_config,
    engine_from_hf,
    engine_greedy,
    hf_greedy,
    hf_token_logprobs,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)
from transformers import AutoModelForCausalLM, Glm4MoeConfig, PreTrainedModel, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from hf_mcore_bridge.engine import Engine, MissingWeightsError, SamplingParams, UnknownWeightError, read_spec
from hf_mcore_bridge.engine.model import Experts, route, routed_experts


@pytest.mark.parametrize("arch", MOE_ARCH_NAMES)
def test_greedy_matches_transformers_generate(arch, get_hf_model):
    model = get_hf_model(arch)
    engine = engine_from_hf(model)
    prompts = random_prompts([5, 11, 23], seed=21)
    outputs = engine.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, 10)
        for sample in output.samples:
            assert sample.token_ids == reference
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=1.0)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("kernel", ["triton", "grouped_mm"])
@pytest.mark.parametrize("arch", MOE_ARCH_NAMES)
def test_fast_moe_path_matches_transformers_generate(arch, kernel, get_hf_model):
    """The experts through the sorted grouped GEMM (`fused_moe`: the Triton kernel in Triton's interpreter, or
    `torch._grouped_mm`'s CPU loop) instead of the per-expert loop: the same tokens and log-probs as transformers."""
    model = get_hf_model(arch)
    engine = engine_from_hf(model, moe_kernel=kernel)
    assert {m.kernel for m in engine.model.modules() if isinstance(m, Experts)} == {kernel}
    prompts = random_prompts([5, 11, 23], seed=21)
    outputs = engine.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, 10)
        for sample in output.samples:
            assert sample.token_ids == reference
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=1.0)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", MOE_ARCH_NAMES)
def test_sampled_logprobs_match_transformers_forward(arch, get_hf_model):
    model = get_hf_model(arch)
    engine = engine_from_hf(model)
    prompts = random_prompts([8, 17], seed=22)
    outputs = engine.generate(prompts, SamplingParams(n=3, temperature=0.8, max_tokens=8, seed=5))
    for prompt, output in zip(prompts, outputs, strict=True):
        for sample in output.samples:
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=0.8)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)


def test_norm_topk_prob_is_followed(get_hf_model):
    """Same weights, `norm_topk_prob` True and False: each engine matches its own config's transformers log-probs
    and is far from the other's, so the flag is neither ignored nor fixed."""
    models = {True: get_hf_model("qwen3_moe"), False: get_hf_model("qwen3_moe_unnormalised")}
    same_weights = zip(models[True].state_dict().values(), models[False].state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in same_weights)
    prompt = random_prompts([12], seed=23)[0]
    for flag, model in models.items():
        (output,) = engine_from_hf(model).generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))
        tokens, logprobs = output.samples[0].token_ids, output.samples[0].logprobs
        assert tokens == hf_greedy(model, prompt, 6)
        assert logprobs == pytest.approx(hf_token_logprobs(model, prompt, tokens, temperature=1.0), abs=1e-5)
        other = hf_token_logprobs(models[not flag], prompt, tokens, temperature=1.0)
        assert max(abs(a - b) for a, b in zip(logprobs, other, strict=True)) > 1e-3


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_refit_switches_to_the_new_weights(arch, get_hf_model, tmp_path):
    """Start from a saved HF directory (config.json as transformers writes it), then refit in shuffled pieces."""
    first, second = get_hf_model(arch, 0), get_hf_model(arch, 1)
    first.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, tiny_engine_config())
    prompts = random_prompts([4, 13], seed=24)
    before = engine_greedy(engine, prompts)
    assert before == [hf_greedy(first, p, 10) for p in prompts]

    items = hub_weights(second)
    random.Random(0).shuffle(items)
    loaded: set[str] = set()
    for chunk in (items[:7], items[7:30], items[30:]):
        loaded |= engine.load_weights(iter(chunk))
    after = engine_greedy(engine, prompts)
    assert after == [hf_greedy(second, p, 10) for p in prompts]
    assert after != before
    assert loaded == set(engine.model.targets)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_every_saved_tensor_round_trips_bit_exactly(arch, get_hf_model):
    """Each HF tensor reads back unchanged from its own slice (two names sharing a slice would clobber one)."""
    weights = hub_weights(get_hf_model(arch))
    engine = Engine(get_hf_model(arch).config, tiny_engine_config())
    assert engine.load_weights(weights) == set(engine.model.targets) == {name for name, _ in weights}
    for name, tensor in weights:
        assert torch.equal(engine.model.hf_view(name), tensor), name


def test_missing_expert_is_an_error_naming_it(get_hf_model):
    model = get_hf_model("mixtral")
    engine = Engine(model.config, tiny_engine_config())
    skipped = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    weights = dict(hub_weights(model))
    engine.load_weights((name, t) for name, t in weights.items() if name != skipped)
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight"):
        engine.generate([[1, 2, 3]], GREEDY)
    engine.load_weights([(skipped, weights[skipped])])
    engine.check_loaded()


def test_unknown_expert_names_are_errors_naming_them(get_hf_model):
    engine = engine_from_hf(get_hf_model("qwen3_moe"))
    for name, shape in (
        ("model.layers.0.mlp.experts.8.up_proj.weight", (32, 64)),  # experts 0..7 only
        ("model.layers.1.mlp.experts.0.up_proj.weight", (32, 64)),  # layer 1 is dense (mlp_only_layers)
        ("model.layers.1.mlp.experts.gate_up_proj", (8, 64, 64)),  # a fused name on the dense layer
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64)),  # Qwen2-MoE only
    ):
        with pytest.raises(UnknownWeightError, match=name.replace(".", r"\.")):
            engine.load_weights([(name, torch.zeros(shape))])
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight"):
        engine.load_weights([("model.layers.2.mlp.experts.5.down_proj.weight", torch.zeros(32, 64))])


def test_dense_layers_follow_mlp_only_layers_and_sparse_step():
    """The layers that get experts are those transformers builds a sparse block for."""
    config = Qwen3MoeConfig(**{**QWEN3_MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    hf_layers = AutoModelForCausalLM.from_config(config).model.layers
    expected = {i for i, layer in enumerate(hf_layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)}
    assert expected == {1, 5}
    moe = read_spec(config).moe
    assert moe is not None and {layer for layer, routed in enumerate(moe.moe_layers) if routed} == expected


def test_expert_count_is_read_from_either_config_key():
    saved = MOE_CONFIGS["qwen3_moe"]().to_dict()  # transformers 5 writes num_local_experts
    assert "num_experts" not in saved
    moe = read_spec(saved).moe
    assert moe is not None and (moe.num_experts, moe.topk, moe.ffn_hidden_size) == (8, 2, 32)
    renamed = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert read_spec(renamed).moe == moe
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        read_spec({**saved, "num_experts_per_tok": 9})


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_equals_transformers_router(norm_topk_prob):
    config = Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    logits, hf_weights, hf_experts = router(x)
    weights, experts = route(logits, config.num_experts_per_tok, renormalize=norm_topk_prob)
    assert torch.equal(experts, hf_experts)
    assert torch.equal(weights, hf_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(40)) == norm_topk_prob


def test_routed_experts_equal_transformers_experts():
    config = MOE_CONFIGS["mixtral"]()
    router, experts = MixtralTopKRouter(config), MixtralExperts(config)
    generator = torch.Generator().manual_seed(2)
    for p in (router.weight, experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(p, std=0.3, generator=generator)
    x = torch.randn(33, 64, generator=generator)
    with torch.no_grad():
        _, hf_weights, hf_experts = router(x)
        expected = experts(x, hf_experts, hf_weights)
        weights, chosen = route(torch.nn.functional.linear(x, router.weight), 2, renormalize=True)
        got = routed_experts(x, experts.gate_up_proj, experts.down_proj, weights, chosen)
    assert torch.equal(chosen, hf_experts)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_qwen2_moe_attention_bias_follows_its_qkv_bias_flag(qkv_bias):
    config = MOE_CONFIGS["qwen2_moe"]()
    config.qkv_bias = qkv_bias
    attention = AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    assert (attention.q_proj.bias is not None) == qkv_bias == read_spec(config).qkv_bias


@pytest.mark.parametrize("arch", ["glm4_moe", "glm4_moe_air"])
def test_sigmoid_routing_equals_transformers_router(arch):
    """Sigmoid scores, score bias for the choice only, group-limited top-k, renormalisation and scaling: the same
    experts and the same float32 weights as transformers' `Glm4MoeTopkRouter`."""
    config = MOE_CONFIGS[arch]()
    router = Glm4MoeTopkRouter(config)
    generator = torch.Generator().manual_seed(3)
    torch.nn.init.normal_(router.weight, std=0.5, generator=generator)
    router.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=generator))
    x = torch.randn(40, 64, generator=generator)
    with torch.no_grad():
        logits, hf_weights, hf_experts = router(x)
    moe = read_spec(config).moe
    assert moe is not None and moe.score_function == "sigmoid" and moe.renormalize
    weights, experts = route(
        logits,
        moe.topk,
        moe.renormalize,
        score_function=moe.score_function,
        expert_bias=router.e_score_correction_bias,
        num_groups=moe.num_groups,
        group_topk=moe.group_topk,
        scaling_factor=moe.topk_scaling_factor or 1.0,
    )
    order, hf_order = experts.argsort(-1), hf_experts.argsort(-1)  # transformers' top-k is unsorted
    assert torch.equal(experts.gather(-1, order), hf_experts.gather(-1, hf_order))
    # equal up to the order of the renormalising sum (transformers adds in its unsorted top-k order)
    assert torch.allclose(weights.gather(-1, order), hf_weights.gather(-1, hf_order), rtol=0, atol=1e-6)
    unbiased = route(logits, moe.topk, True, score_function="sigmoid", num_groups=moe.num_groups, group_topk=2)[1]
    assert not torch.equal(unbiased.sort(-1)[0], hf_experts.sort(-1)[0])  # the bias changes choices here


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """A GLM-4.5 directory with an MTP layer after the decoder layers (`num_nextn_predict_layers`): the engine
    serves the decoder, as transformers' model does, and skips the MTP tensors."""
    config = MOE_CONFIGS["glm4_moe"]()
    model = build_hf_from_config(config, seed=4)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    extra = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})
    saved = Glm4MoeConfig.from_pretrained(tmp_path)
    saved.num_nextn_predict_layers = 1
    saved.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, tiny_engine_config())
    prompts = random_prompts([9], seed=25)
    assert engine_greedy(engine, prompts) == [hf_greedy(model, prompts[0], 10)]
    with pytest.raises(UnknownWeightError, match=r"model\.layers\.4\.eh_proj"):  # only the declared MTP layer
        engine.load_weights([("model.layers.4.eh_proj.weight", torch.zeros(64, 128))])


def _hf_chosen_experts(model: PreTrainedModel, ids: list[int]) -> list[torch.Tensor]:
    """transformers' own top-k of every MoE layer, in layer order, for the tokens `ids` (one forward pass): the
    indices each layer's router module returns, captured by forward hooks, sorted per token."""
    captured: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [gate.register_forward_hook(lambda _m, _i, out: captured.append(out[2])) for gate in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return [chosen.sort(dim=-1).values for chosen in captured]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_recorded_routing_is_transformers_top_k(arch, get_hf_model):
    """`record_routing`: every sample's expert ids of every MoE layer, for its prompt and all its generated tokens
    but the last, equal the top-k transformers' routers choose for the same tokens (Qwen3-MoE: softmax, a dense
    layer between two routed ones; GLM-4.5: sigmoid scores chosen with a score bias, set at random here so that it
    changes the choice, within 2 of 4 groups). Samples stop early on a stop token (the decode pipeline then runs a
    step too many for them, whose routing must not be kept) or run to their length."""
    model = get_hf_model(arch)
    if arch == "glm4_moe":
        model = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(5)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=generator) * 0.2)
    engine = engine_from_hf(model, record_routing=True)
    prompts = random_prompts([5, 11, 3], seed=8)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=4, stop_token_ids=list(range(0, 211, 17)))
    outputs = engine.generate(prompts, params)
    lengths = {len(s.token_ids) for out in outputs for s in out.samples}
    assert min(lengths) < 8 and max(lengths) == 8  # some stopped early, some ran to their length
    if arch == "qwen3_moe":  # here some samples stop while the next decode step is already queued
        assert engine.last_stats is not None and engine.last_stats.discarded_tokens > 0
    layers = len(_hf_chosen_experts(model, prompts[0]))
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.samples:
            ids = prompt + sample.token_ids[:-1]
            recorded = sample.routed_experts
            assert recorded is not None and recorded.dtype == torch.uint8
            assert recorded.shape == (layers, len(ids), model.config.num_experts_per_tok)
            expected = torch.stack(_hf_chosen_experts(model, ids))
            assert torch.equal(recorded.long().sort(dim=-1).values, expected)


def test_routing_is_recorded_only_when_asked_and_only_for_moe_models(get_hf_model):
    engine = engine_from_hf(get_hf_model("qwen3_moe"))
    (out,) = engine.generate(random_prompts([4], seed=1), SamplingParams(max_tokens=2))
    assert out.samples[0].routed_experts is None
    with pytest.raises(ValueError, match="has no mixture-of-experts layers: no routing to record"):
        engine_from_hf(get_hf_model("llama"), record_routing=True)


def test_routing_record_refuses_gaps_and_short_records():
    """The bookkeeping's checks fire: a chunk that starts past the recorded positions, and a sample whose record
    does not cover every token it ran."""
    from hf_mcore_bridge.engine.engine import _record_routing, _routed_experts
    from hf_mcore_bridge.engine.scheduler import Sequence

    seq = Sequence(0, 0, 0, prompt_len=3, token_ids=[1, 2, 3, 4, 5], params=SamplingParams(), max_len=8)
    _record_routing(seq, torch.zeros(2, 3, 2, dtype=torch.uint8), 0)
    _record_routing(seq, torch.ones(2, 4, 2, dtype=torch.uint8), 0)  # a recompute: only position 3 is new
    assert seq.routed == 4 and _routed_experts(seq)[:, 3].eq(1).all() and _routed_experts(seq)[:, :3].eq(0).all()
    with pytest.raises(RuntimeError, match="routing of position 6 recorded before that of position 4"):
        _record_routing(seq, torch.zeros(2, 1, 2, dtype=torch.uint8), 6)
    seq.token_ids.append(6)
    with pytest.raises(RuntimeError, match="routing recorded for 4 of the 5 tokens a sample ran"):
        _routed_experts(seq)
