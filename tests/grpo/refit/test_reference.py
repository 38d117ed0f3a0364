"""The refit check's reference for what an engine rank must hold (`grpo.refit.reference`), and the check run on it.

- The reference against megatron-core's layout written out in this file (its per-query-group fused `linear_qkv`
  chunked over the ranks, `[gate_r; up_r]`, row and vocabulary blocks) and against HF's grouped-query rule where
  there are fewer KV heads than ranks; the settings it refuses; that it loads no engine module. (Against
  megatron-core's own TP2 shards: `test_engine_layouts.py`, the shard-local test.)
- No circular check at engine TP > 1 (issue 27, requirement 4, in-process part; the multi-process run is in
  `test_refit_checks.py`): the real `trainer._stream_into_engine` and `_check_transfer` on every rank of a TP2 (and TP4)
  engine built without a world, whose own slicing is mutated (`refit_ranks.shifted_head_shard`, `kv_on_wrong_rank`): the
  check names the tensors, where a check taken through the engine's slicing passes.
- Every tensor covered (requirement 5): for a dense model with biases (Qwen2), a MoE model with router, experts,
  shared experts, expert score bias, q/k norms and biases (GLM-4.5) and DeepSeek-V3 (multi-latent attention), each
  streamed tensor in turn has one element changed on its way into the engine, after the reference was taken, and
  the check names exactly that tensor; an uncorrupted refit passes. At engine TP 1 (the `Engine`) and on both
  ranks of a TP2 engine.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.convert.config_bridge import megatron_spec
from hf_mcore_bridge.engine import Engine, EngineConfig, tp_shards
from hf_mcore_bridge.engine import model as engine_model
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.refit.reference import EnginePartReference
from hf_mcore_bridge.grpo.refit.stream import PhaseTimes, mismatched, tensor_checksums
from hf_mcore_bridge.grpo.run.generation import engine_part
from hf_mcore_bridge.grpo.run.plan import RefitPath
from hf_mcore_bridge.grpo.run.trainer import _check_transfer, _stream_into_engine
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import build_tiny_model, tiny_config

from .refit_ranks import kv_on_wrong_rank, shifted_head_shard


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny tensors: intra-op threads only spin on a shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model_cfg(architecture: str, **overrides: Any) -> ModelSpec:
    return megatron_spec(tiny_config(architecture, **overrides))


# --- the reference against megatron-core's layout, written here -----------------------------------------------


def _megatron_qkv_parts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, d: int, tp: int
) -> list[tuple[torch.Tensor, ...]]:
    """Per rank, (q, k, v) of megatron-core's TP chunk of its fused `linear_qkv`: per query group its heads/groups
    q heads, its k head, its v head; the fused rows split into `tp` equal chunks (whole groups each)."""
    per = heads // groups
    tail = q.shape[1:]
    fused = torch.cat(
        [
            torch.cat([q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
            for g in range(groups)
        ]
    )
    parts = []
    for chunk in fused.chunk(tp):
        rows = chunk.reshape(groups // tp, (per + 2) * d, *tail)
        parts.append(
            tuple(
                rows[:, a:b].reshape(-1, *tail) for a, b in ((0, per * d), (per * d, per * d + d), (per * d + d, None))
            )
        )
    return parts


@pytest.mark.parametrize(("heads", "groups", "tp"), [(8, 4, 2), (8, 4, 4), (8, 8, 2), (8, 2, 2), (8, 1, 1)])
def test_attention_parts_are_megatron_cores_query_group_chunks(heads: int, groups: int, tp: int) -> None:
    d, hidden = 4, heads * 4
    cfg = _model_cfg(
        "Qwen2ForCausalLM", num_attention_heads=heads, num_key_value_heads=groups, hidden_size=hidden, head_dim=d
    )
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    attn = "model.layers.0.self_attn"
    for leaf, tail in (("weight", (hidden,)), ("bias", ())):
        q, k, v = (torch.randn(n * d, *tail, generator=gen) for n in (heads, groups, groups))
        for rank, expected in enumerate(_megatron_qkv_parts(q, k, v, heads, groups, d, tp)):
            reference = EnginePartReference(cfg, tp, rank)
            got = [reference.part(f"{attn}.{p}_proj.{leaf}", t) for p, t in zip("qkv", (q, k, v), strict=True)]
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), (leaf, rank)
    o = torch.randn(hidden, heads * d, generator=gen)
    for rank, expected in enumerate(o.chunk(tp, dim=1)):  # o_proj: its input columns, the rank's heads
        assert torch.equal(EnginePartReference(cfg, tp, rank).part(f"{attn}.o_proj.weight", o), expected)


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_adapter_parts_follow_their_weights(tp: int) -> None:
    """An engine that applies LoRA adapters (`engine.lora`) holds of a column-parallel projection A whole and B's
    rows as the weight's (q: its query heads' rows; gate / up: megatron-core's chunks), of a row-parallel one A's
    input columns as the weight's and B whole; shard-local refits stream adapters whole, so they are cut too."""
    heads, groups, d, hidden, ffn, rank = 8, 4, 4, 32, 48, 3
    cfg = _model_cfg(
        "LlamaForCausalLM",
        num_attention_heads=heads,
        num_key_value_heads=groups,
        hidden_size=hidden,
        head_dim=d,
        intermediate_size=ffn,
    )
    gen = torch.Generator().manual_seed(tp)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    rows = {f"{attn}.q_proj": heads * d, f"{attn}.k_proj": groups * d, f"{mlp}.up_proj": ffn}
    columns = {f"{attn}.o_proj": heads * d, f"{mlp}.down_proj": ffn}
    for part in range(tp):
        reference = EnginePartReference(cfg, tp, part)
        for module, out in rows.items():
            a, b = torch.randn(rank, hidden, generator=gen), torch.randn(out, rank, generator=gen)
            assert reference.part(f"{module}.lora_A.weight", a, trainer_part=True) is a
            got = reference.part(f"{module}.lora_B.weight", b, trainer_part=True)
            assert torch.equal(got, b.chunk(tp)[part]), (module, part)  # equal blocks of heads / of rows
        for module, width in columns.items():
            a, b = torch.randn(rank, width, generator=gen), torch.randn(hidden, rank, generator=gen)
            got = reference.part(f"{module}.lora_A.weight", a, trainer_part=True)
            assert torch.equal(got, a.chunk(tp, dim=1)[part]), (module, part)
            assert reference.part(f"{module}.lora_B.weight", b) is b


@pytest.mark.parametrize(("groups", "tp"), [(1, 2), (2, 4), (1, 4), (4, 8)])
def test_fewer_kv_heads_than_ranks_give_each_rank_the_head_its_queries_read(groups: int, tp: int) -> None:
    """HF's grouped-query attention: query head h reads KV head h // (heads / groups) (transformers' `repeat_kv`);
    each rank must hold the one KV head its block of query heads reads."""
    heads, d, hidden = 8, 4, 32
    cfg = _model_cfg(
        "LlamaForCausalLM", num_attention_heads=heads, num_key_value_heads=groups, hidden_size=hidden, head_dim=d
    )
    k = torch.randn(groups * d, hidden, generator=torch.Generator().manual_seed(groups))
    for rank in range(tp):
        read = {h // (heads // groups) for h in range(rank * heads // tp, (rank + 1) * heads // tp)}
        assert len(read) == 1
        (kv,) = read
        got = EnginePartReference(cfg, tp, rank).part("model.layers.1.self_attn.k_proj.weight", k)
        assert torch.equal(got, k[kv * d : (kv + 1) * d])


def test_mlp_expert_vocabulary_and_replicated_parts() -> None:
    """GLM-4.5: dense and shared-expert gate/up as megatron-core's `[gate_r; up_r]`, down by columns, every routed
    expert the same way, router, score bias and norms whole, the odd vocabulary in blocks of ceil(V / tp) rows."""
    cfg = _model_cfg("Glm4MoeForCausalLM")
    gen = torch.Generator().manual_seed(3)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    assert vocab % 2 and cfg.moe is not None
    tensors = {
        "model.layers.0.mlp.gate_proj.weight": torch.randn(cfg.ffn_hidden_size, hidden, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(cfg.ffn_hidden_size, hidden, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, cfg.ffn_hidden_size, generator=gen),
        "model.layers.1.mlp.shared_experts.up_proj.weight": torch.randn(
            cfg.moe.shared_expert_size, hidden, generator=gen
        ),
        "model.layers.1.mlp.shared_experts.down_proj.weight": torch.randn(
            hidden, cfg.moe.shared_expert_size, generator=gen
        ),
        "model.layers.2.mlp.experts.7.gate_proj.weight": torch.randn(cfg.moe.ffn_hidden_size, hidden, generator=gen),
        "model.layers.2.mlp.experts.7.down_proj.weight": torch.randn(hidden, cfg.moe.ffn_hidden_size, generator=gen),
    }
    whole = {
        "model.layers.2.mlp.gate.weight": torch.randn(cfg.moe.num_experts, hidden, generator=gen),
        "model.layers.2.mlp.gate.e_score_correction_bias": torch.randn(cfg.moe.num_experts, generator=gen),
        "model.layers.2.post_attention_layernorm.weight": torch.randn(hidden, generator=gen),
        "model.layers.2.self_attn.k_norm.weight": torch.randn(cfg.head_dim, generator=gen),
        "model.norm.weight": torch.randn(hidden, generator=gen),
    }
    embed = torch.randn(vocab, hidden, generator=gen)
    for tp in (2, 4):
        rows = -(-vocab // tp)
        for rank in range(tp):
            reference = EnginePartReference(cfg, tp, rank)
            for name, tensor in tensors.items():
                expected = tensor.chunk(tp, dim=1 if "down_proj" in name else 0)[rank]
                assert torch.equal(reference.part(name, tensor), expected), (name, tp, rank)
            for name, tensor in whole.items():
                assert reference.part(name, tensor) is tensor
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                assert torch.equal(reference.part(name, embed), embed[rank * rows : (rank + 1) * rows])
    reference = EnginePartReference(cfg, 2, 1)
    assert reference.dtype("model.layers.2.mlp.gate.e_score_correction_bias", torch.bfloat16) == torch.float32
    assert reference.dtype("model.layers.2.mlp.gate.weight", torch.bfloat16) == torch.bfloat16


def test_multi_latent_attention_parts_are_whole_heads_and_a_whole_latent() -> None:
    """DeepSeek-V3 (vLLM's split): each rank's block of heads of the query and key/value up-projections (rows
    `heads / tp * (nope + rope)`, `heads / tp * (nope + v)`), `o_proj` by input columns; the down-projections and
    the latent norms whole."""
    cfg = _model_cfg("DeepseekV3ForCausalLM")
    mla, heads, hidden = cfg.mla, cfg.num_attention_heads, cfg.hidden_size
    assert mla is not None and mla.q_lora_rank is not None
    qk, kv_up = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    gen = torch.Generator().manual_seed(4)
    attn = "model.layers.0.self_attn"
    per_head = {  # name -> (tensor, rows of one head, dim)
        f"{attn}.q_b_proj.weight": (torch.randn(heads * qk, mla.q_lora_rank, generator=gen), qk, 0),
        f"{attn}.kv_b_proj.weight": (torch.randn(heads * kv_up, mla.kv_lora_rank, generator=gen), kv_up, 0),
        f"{attn}.o_proj.weight": (torch.randn(hidden, heads * mla.v_head_dim, generator=gen), mla.v_head_dim, 1),
    }
    whole = {
        f"{attn}.q_a_proj.weight": torch.randn(mla.q_lora_rank, hidden, generator=gen),
        f"{attn}.q_a_layernorm.weight": torch.randn(mla.q_lora_rank, generator=gen),
        f"{attn}.kv_a_proj_with_mqa.weight": torch.randn(
            mla.kv_lora_rank + mla.qk_rope_head_dim, hidden, generator=gen
        ),
        f"{attn}.kv_a_layernorm.weight": torch.randn(mla.kv_lora_rank, generator=gen),
    }
    tp = 2
    local = heads // tp
    for rank in range(tp):
        reference = EnginePartReference(cfg, tp, rank)
        for name, (tensor, rows, dim) in per_head.items():
            expected = tensor.narrow(dim, rank * local * rows, local * rows)
            assert torch.equal(reference.part(name, tensor), expected), (name, rank)
        for name, tensor in whole.items():
            assert reference.part(name, tensor) is tensor, name


def test_a_shard_local_part_is_its_own_reference_but_the_vocabulary_is_cut() -> None:
    cfg = _model_cfg("LlamaForCausalLM")
    reference = EnginePartReference(cfg, 2, 1)
    own = torch.randn(cfg.num_attention_heads * cfg.head_dim // 2, cfg.hidden_size)  # the trainer's own shard
    assert reference.part("model.layers.0.self_attn.q_proj.weight", own, trainer_part=True) is own
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    rows = -(-cfg.vocab_size // 2)
    assert torch.equal(reference.part("model.embed_tokens.weight", embed, trainer_part=True), embed[rows:])
    with pytest.raises(ValueError, match=r"q_proj.weight: expected the full tensor, 8 heads of 8 rows, got shape"):
        reference.part("model.layers.0.self_attn.q_proj.weight", own)
    assert EnginePartReference(cfg, 1, 0).part("model.layers.0.self_attn.q_proj.weight", own) is own


def test_the_reference_loads_no_engine_module() -> None:
    """The reference cannot call the engine's slicing: importing it (in a fresh interpreter) loads no module of
    `hf_mcore_bridge.engine`."""
    code = (
        "import sys, hf_mcore_bridge.grpo.refit.reference\n"
        "print(sorted(m for m in sys.modules if m.startswith('hf_mcore_bridge.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_settings_the_engine_cannot_shard_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) does not divide by the engine's TP size 3"):
        EnginePartReference(_model_cfg("LlamaForCausalLM"), 3, 0)
    odd = _model_cfg("LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) neither divides by nor divides engine TP 2"):
        EnginePartReference(odd, 2, 0)
    with pytest.raises(ValueError, match="rank 2 of 2 is out of range"):
        EnginePartReference(_model_cfg("LlamaForCausalLM"), 2, 2)


# --- the check itself: the trainer's refit and transfer check on a real engine (rank) --------------------------


class _SafetensorsPolicy:
    """Stands in for the trained policy: its refit stream is the HF file's tensors, full."""

    def __init__(self, directory: Path) -> None:
        self.file = directory / "model.safetensors"

    def trained_names(self) -> None:
        return None

    def shard_local_weights(self, times: PhaseTimes | None = None, names: Any = None) -> None:
        return None

    def hf_weights(self, times: PhaseTimes | None = None, names: Any = None) -> Any:
        return iter(load_file(self.file).items())

    def refit_sources(self) -> None:
        return None


def _rank_engine(hf_config: dict[str, Any], tp: int, rank: int) -> Any:
    """One rank of a TP engine, built without a world (loading needs only the rank's place): its model, and
    `load_weights` as the embedded engine's."""
    place = SimpleNamespace(place=tp_shards.TPRank(tp, rank))
    model = engine_model.CausalLM(engine_model.ModelSpec.from_hf(hf_config), torch.float32, "cpu", 16, tp=place)  # type: ignore[arg-type]
    return SimpleNamespace(model=model, load_weights=model.load_weights)


def _engine(hf_config: dict[str, Any]) -> Engine:
    """The embedded engine on one device (a small KV cache: only its weights are used here)."""
    config = EngineConfig(
        dtype=torch.float32, device="cpu", max_num_seqs=2, max_model_len=32, kv_cache_memory_bytes=1 << 20
    )
    return Engine(hf_config, config)


def _ctx(directory: Path, engine: Any, tp: int = 1, rank: int = 0) -> Any:
    """What `_stream_into_engine` and `_check_transfer` read of the trainer's `_RankContext`."""
    hf_config = json.loads((directory / "config.json").read_text())
    model_cfg = megatron_spec(hf_config)
    return SimpleNamespace(
        config=SimpleNamespace(policy=SimpleNamespace(refit_bucket_mb=1)),
        engine=engine,
        replicas=SimpleNamespace(shared=False, tp=tp, tp_rank=rank),
        plan=SimpleNamespace(refit=RefitPath.FULL),
        adapter_refit=False,
        vllm=False,
        refit_shard_local=False,
        refit_names=list(load_file(directory / "model.safetensors")),
        engine_dtype=torch.float32,
        refit_reference=EnginePartReference(model_cfg, tp, rank),
    )


def _refit_and_check(ctx: Any, policy: _SafetensorsPolicy) -> int:
    sent = _stream_into_engine(ctx, policy, None, PhaseTimes())
    return _check_transfer(ctx, policy, sent, step=1)


def _named(error: BridgeError) -> set[str]:
    """The tensor names the check's one-line message gives (all of them, when it gives fewer than 7)."""
    message = str(error)
    assert "\n" not in message
    match = re.fullmatch(
        r"the refit after step 1 failed its check: the engine's tensor differs from the one "
        r"streamed for (\d+): (.*)",
        message,
    )
    assert match, message
    names = set(match[2].split(", "))
    assert len(names) == int(match[1]), message
    return names


HYBRID = ["linear_attention", "full_attention"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("refit-reference")
    return {
        "qwen2": build_tiny_model(root / "qwen2", "Qwen2ForCausalLM", seed=1, num_hidden_layers=2),
        "qwen2_one_layer": build_tiny_model(root / "qwen2_one_layer", "Qwen2ForCausalLM", seed=2, num_hidden_layers=1),
        "qwen2_kv2": build_tiny_model(
            root / "qwen2_kv2", "Qwen2ForCausalLM", seed=3, num_hidden_layers=1, num_key_value_heads=2
        ),
        # a dense layer 0 and a MoE layer 1 each (every tensor is corrupted in turn, each time a whole refit)
        "glm4_moe": build_tiny_model(root / "glm4_moe", "Glm4MoeForCausalLM", seed=4, num_hidden_layers=2),
        "deepseek_v3": build_tiny_model(root / "deepseek_v3", "DeepseekV3ForCausalLM", seed=5, num_hidden_layers=2),
        # a Gated DeltaNet layer and a gated full-attention layer (Qwen3-Next: fused projections, experts)
        "qwen3_5": build_tiny_model(
            root / "qwen3_5", "Qwen3_5ForCausalLM", seed=6, num_hidden_layers=2, layer_types=HYBRID
        ),
        "qwen3_next": build_tiny_model(
            root / "qwen3_next", "Qwen3NextForCausalLM", seed=7, num_hidden_layers=2, layer_types=HYBRID
        ),
    }


QUERY = {f"model.layers.0.self_attn.q_proj.{leaf}" for leaf in ("weight", "bias")}
KEY_VALUE = {f"model.layers.0.self_attn.{p}_proj.{leaf}" for p in "kv" for leaf in ("weight", "bias")}
"""What a wrong query-head split or KV heads on the wrong rank must be named as (one-layer Qwen2: q/k/v biases)."""


@pytest.mark.parametrize(
    ("model", "tp", "function", "mutated", "named"),
    [
        ("qwen2_one_layer", 2, "head_shard", shifted_head_shard, QUERY),
        ("qwen2_one_layer", 2, "kv_shard", kv_on_wrong_rank, KEY_VALUE),
        ("qwen2_kv2", 4, "kv_shard", kv_on_wrong_rank, KEY_VALUE),  # 2 KV heads replicated over 4 ranks
    ],
    ids=["tp2-query-head-shifted", "tp2-kv-group-on-the-wrong-rank", "tp4-replicated-kv-head-on-the-wrong-rank"],
)
def test_a_mutated_engine_slicing_fails_the_check_where_a_check_through_it_passes(
    tiny: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    tp: int,
    function: str,
    mutated: Any,
    named: set[str],
) -> None:
    directory = tiny[model]
    hf_config = json.loads((directory / "config.json").read_text())
    policy = _SafetensorsPolicy(directory)
    count = len(load_file(directory / "model.safetensors"))
    for rank in range(tp):  # the engine's own slicing as it is: every rank passes
        assert _refit_and_check(_ctx(directory, _rank_engine(hf_config, tp, rank), tp, rank), policy) == count
    monkeypatch.setattr(engine_model, function, mutated(getattr(engine_model, function)))
    full = load_file(directory / "model.safetensors")
    for rank in range(tp):
        engine = _rank_engine(hf_config, tp, rank)
        with pytest.raises(BridgeError) as caught:
            _refit_and_check(_ctx(directory, engine, tp, rank), policy)
        assert _named(caught.value) == named, rank
        # the circular check: a "sent" side cut by the engine's own (mutated) slicing agrees with what it holds
        names = list(engine.model.targets)
        through_engine = tensor_checksums([engine_part(engine, name, full[name]) for name in names])
        assert mismatched(names, through_engine, tensor_checksums([engine.model.hf_view(n) for n in names])) == []


def _nudged(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A copy of `tensor` with element `index` (of the flattened tensor) one ulp larger."""
    out = tensor.clone()
    flat = out.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=flat.dtype))
    return out


def _corrupting(load: Any, name: str, index: int) -> Any:
    """`load_weights` that changes one element of `name` on its way in (the refit's checksums are already taken)."""

    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        return load([(n, _nudged(t, index) if n == name else t) for n, t in weights], *args, **kwargs)

    return load_weights


KINDS = {
    "embedding": lambda n: n == "model.embed_tokens.weight",
    "output layer": lambda n: n == "lm_head.weight",
    "norm": lambda n: "norm" in n,
    "linear": lambda n: n.endswith("_proj.weight"),
    "bias": lambda n: n.endswith(".bias"),
    "router": lambda n: n.endswith("mlp.gate.weight"),
    "routed expert": lambda n: ".mlp.experts." in n,
    "shared expert": lambda n: ".shared_experts." in n,
    "expert score bias": lambda n: n.endswith("e_score_correction_bias"),
    "gated delta net": lambda n: ".linear_attn." in n,
}
"""Kinds of tensor the stream must cover, by name."""
DENSE_KINDS = ("embedding", "output layer", "norm", "linear", "bias")
MODEL_KINDS = {
    "qwen2": DENSE_KINDS,
    "glm4_moe": tuple(k for k in KINDS if k != "gated delta net"),
    "deepseek_v3": tuple(k for k in KINDS if k not in ("bias", "gated delta net")),  # multi-latent projections
    "qwen3_5": ("embedding", "output layer", "norm", "linear", "gated delta net"),
    "qwen3_next": ("embedding", "output layer", "norm", "linear", "router", "routed expert", "gated delta net"),
}


@pytest.mark.parametrize(
    ("model", "tp"),
    [
        *((model, tp) for tp in (1, 2) for model in ("qwen2", "glm4_moe", "deepseek_v3")),
        ("qwen3_5", 2),  # Gated DeltaNet's sections and the gated query split over the ranks
        ("qwen3_next", 2),
    ],
)
def test_every_streamed_tensor_corrupted_in_turn_is_named_by_the_check(
    tiny: dict[str, Path], model: str, tp: int
) -> None:
    directory = tiny[model]
    hf_config = json.loads((directory / "config.json").read_text())
    names = list(load_file(directory / "model.safetensors"))
    assert all(any(KINDS[kind](n) for n in names) for kind in MODEL_KINDS[model]), model  # it has each kind
    policy = _SafetensorsPolicy(directory)
    for rank in range(tp):
        engine = _engine(hf_config) if tp == 1 else _rank_engine(hf_config, tp, rank)
        ctx = _ctx(directory, engine, tp, rank)
        assert _refit_and_check(ctx, policy) == len(names)
        load = engine.load_weights
        index = 0 if rank == 0 else -1  # in every rank's part: the first rank's first element, the last's last
        for name in names:
            engine.load_weights = _corrupting(load, name, index)
            with pytest.raises(BridgeError) as caught:
                _refit_and_check(ctx, policy)
            assert _named(caught.value) == {name}
        engine.load_weights = load
        assert _refit_and_check(ctx, policy) == len(names)
