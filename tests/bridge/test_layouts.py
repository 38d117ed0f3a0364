"""The bridge API in gloo worlds at TP2, PP2 (with two virtual stages), EP2 and TP2 x PP2, on a dense, a MoE, a
DeepSeek-V3 and a GLM-4.5 tiny model (one world per layout runs them all; at PP2 also Gemma 3, at TP2 also Qwen3.5 and
Qwen3-Next, whose Gated DeltaNet tensors megatron-core splits part by part), at TP2 x EP2 with
expert TP 1 (GLM-4.7-Flash there too) and at CP2 (the bridge's own spec: megatron-core's local one refuses CP), at
PP2 on the real SmolLM2-135M-Instruct, and an FP8 DeepSeek-V3 checkpoint at TP2.

Each model is built by the test's own megatron-core code from the bridge's config (`ranks.build_chunks`), loaded by
`load_hf_weights`, and must give transformers' logits (fp32, max |dlogit| <= 1e-4) on random tokens; its
`export_hf_weights` stream must hold every tensor of the checkpoint, each `torch.equal` (dtype included) to the
tensor read with safetensors, on every rank, in the same order. The loader's economy is counted: on every rank the
elements read equal the checkpoint elements that rank holds (`ranks.held_elements`), so no rank reads another's
slice. Beside: `get_model` (the bridge's own spec) gives the same logits; the bucketed stream keeps its bound; at
PP > 1 the stream never runs more than one pipeline broadcast ahead of what it has yielded; an FP8 checkpoint loads
as its blocks dequantized (the test's own `q * scale`) and exports back to FP8 blocks the test quantizes itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fp8_sources import SHAPE, expand, fp8_source
from safetensors.torch import save_file

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.verify import _hf_logits
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.tiny_models import build_tiny_model

from .ranks import BUCKET_BYTES, Job, layout_rank

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def _run(layout: Layout, jobs: list[Job], tmp_path: Path, vocab: int = 211) -> tuple[torch.Tensor, dict]:
    """Run the jobs in one world; returns the tokens and, per job, every rank's results."""
    tokens = _tokens(vocab)
    out = tmp_path / "results"
    out.mkdir()
    run_world(layout_rank, layout, jobs, tokens, str(out))
    results = {}
    for job in jobs:
        files = sorted(out.glob(f"{job.name}.*.pt"), key=lambda f: int(f.suffixes[-2][1:]))
        results[job.name] = [torch.load(f, weights_only=False) for f in files]
    return tokens, results


def _check(job: Job, ranks: list[dict], tokens: torch.Tensor, world: int, *, count_reads: bool = True) -> None:
    from .ranks import Reference

    assert len(ranks) == world, job.name
    reference = Reference(Path(job.reference or job.hf_dir))
    for rank, result in enumerate(ranks):
        assert sorted(result["names"]) == sorted(reference.files), f"{job.name} rank {rank}"
        assert result["names"] == ranks[0]["names"], f"{job.name} rank {rank}: another order"
        assert result["unequal"] == [], f"{job.name} rank {rank}: {result['unequal'][:3]}"
        if count_reads:
            assert result["read"] == result["held"], f"{job.name} rank {rank}: read {result['read']}, holds"
    logits = [r["logits"] for r in ranks if r["logits"] is not None]
    assert len(logits) == 1, f"{job.name}: logits on {len(logits)} ranks"
    expected = _hf_logits(Path(job.reference or job.hf_dir), tokens, "fp32")
    assert (logits[0] - expected).abs().max() <= TOLERANCE, job.name
    if job.get_model:
        (own,) = [r["get_model_logits"] for r in ranks if r["get_model_logits"] is not None]
        assert (own - expected).abs().max() <= TOLERANCE, f"{job.name}: get_model"


@pytest.fixture(scope="module")
def models(tiny_models, tiny_moe_models) -> dict[str, str]:
    return {name: str(path) for name, path in {**tiny_models, **tiny_moe_models}.items()}


def test_tp2(models, tmp_path):
    saved = tmp_path / "saved"
    wider = build_tiny_model(tmp_path / "wider", "LlamaForCausalLM", intermediate_size=128)  # 96 in the others
    wrong = (models["qwen3"], str(wider))
    jobs = [
        Job("llama", models["llama"], get_model=True, bucketed=True, wrong_dirs=wrong),
        Job("qwen2", models["qwen2"], save_dir=str(saved), shard_size="40KB"),
        Job("qwen3_misbuilt", models["qwen3"], misbuilt=True),
        Job("qwen3_moe", models["qwen3_moe"]),
        Job("deepseek_v3", models["deepseek_v3"], get_model=True),
        Job("glm4_moe", models["glm4_moe"]),
        Job("qwen3_5", models["qwen3_5"]),  # Gated DeltaNet's in_proj and conv1d: each rank its rows of each part
        Job("qwen3_next", models["qwen3_next"]),
    ]
    tokens, results = _run(Layout(tp=2), jobs, tmp_path)
    for job in (j for j in jobs if not j.misbuilt):
        _check(job, results[job.name], tokens, 2)
    for result in results["qwen3_misbuilt"]:  # without the q/k norms its config asks for
        load, export, headless = result["refusals"]
        lacks = "the model lacks 16 tensor(s) the Qwen3ForCausalLM table has at its layers, e.g. "
        first = "decoder.layers.0.self_attention.q_layernorm.weight"
        assert load == f"BridgeError: {lacks}{first} (built otherwise than its config says?)", load
        assert export == load, export  # every rank refuses before any tensor moves
        nobody = "no rank holds 2 tensor(s) of the Qwen3ForCausalLM table, e.g. decoder.final_layernorm.weight"
        assert headless == f"BridgeError: {nobody}", headless
    buckets = results["llama"][0]["buckets"]
    sizes = buckets["sizes"]
    assert all(size <= BUCKET_BYTES or count == 1 for count, size in sizes), sizes
    assert any(count > 1 for count, _ in sizes) and any(size > BUCKET_BYTES for _, size in sizes), sizes
    assert buckets["names"] == results["llama"][0]["names"] and buckets["equal"]
    _check_saved(saved, Path(models["qwen2"]), tokens, sharded=True)
    for result in results["llama"]:
        wrong_layout, other_heads, wider_mlp, into_source = result["refusals"]
        assert wrong_layout.startswith("LayoutError: layout tp=1 pp=1 differs") and "tp=2" in wrong_layout
        wrong = f"CheckpointError: {models['qwen3']}: model.layers.0.self_attn.q_proj.weight has 256 rows, but"
        assert other_heads.startswith(wrong), other_heads
        gate_up = "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight"
        wrong = f"CheckpointError: {gate_up} in {wider} make a (256, 64) tensor, but the model's "
        assert wider_mlp.startswith(wrong) and "is (96, 64) on each of 2 tensor-parallel ranks" in wider_mlp
        source = models["llama"]
        assert (
            into_source == f"BridgeError: destination {source} is the source {source}; choose a directory apart from it"
        )


def _check_saved(saved: Path, source: Path, tokens: torch.Tensor, *, sharded: bool) -> None:
    """`save_hf`'s directory: the source's tensors (names, dtypes, values), in shards with an index where asked,
    its config (dtype stated), its other HF files, and transformers loads it to the source's logits."""
    from hf_mcore_bridge.checkpoint.hf_dir import ASSET_FILES

    from .ranks import Reference

    written, original = Reference(saved), Reference(source)
    assert sorted(written.files) == sorted(original.files)
    for name in original.files:
        assert written[name].dtype == original[name].dtype and torch.equal(written[name], original[name]), name
    assert (saved / "model.safetensors.index.json").is_file() == sharded
    assert len(set(written.files.values())) > 1 if sharded else len(set(written.files.values())) == 1
    config, before = (json.loads((d / "config.json").read_text()) for d in (saved, source))
    assert config == before  # the same dtype (float32) and no quantization_config to drop
    for name in ASSET_FILES:
        assert (saved / name).is_file() == (source / name).is_file(), name
    assert torch.equal(_hf_logits(saved, tokens, "fp32"), _hf_logits(source, tokens, "fp32"))


def test_pp2_with_virtual_stages(models, tmp_path):
    jobs = [
        Job("llama_tied", models["llama_tied"], get_model=True, trace=True),
        Job("mixtral", models["mixtral"]),
        Job("deepseek_v3", models["deepseek_v3"]),
        Job("glm4_moe", models["glm4_moe"], trace=True),
        # four chunks of two layers: the sliding layers and the first layer (the embedding scale) found globally
        Job("gemma3", models["gemma3"], get_model=True),
    ]
    tokens, results = _run(Layout(pp=2, vpp=2), jobs, tmp_path)
    for job in jobs:
        _check(job, results[job.name], tokens, 2)
    for name in ("llama_tied", "glm4_moe"):
        for result in results[name]:
            _assert_streamed(result["events"])


def _assert_streamed(events: list[str]) -> None:
    """Never more than one pipeline broadcast ahead of the tensors yielded: the stream is tensor by tensor."""
    broadcasts = yields = 0
    for event in events:
        broadcasts += event == "b"
        yields += event == "y"
        assert broadcasts <= yields + 1, events
    assert broadcasts > 1 and yields >= broadcasts, events


def test_ep2(models, tmp_path):
    jobs = [Job(name, models[name]) for name in ("qwen3_moe", "deepseek_v3", "glm4_moe", "qwen2_moe")]
    tokens, results = _run(Layout(ep=2), jobs, tmp_path)
    for job in jobs:
        _check(job, results[job.name], tokens, 2)


def test_tp2_pp2(models, tmp_path):
    jobs = [
        Job("llama_tied", models["llama_tied"], get_model=True),
        Job("qwen3_moe", models["qwen3_moe"]),
        Job("deepseek_v3", models["deepseek_v3"]),
        Job("glm4_moe", models["glm4_moe"]),
    ]
    tokens, results = _run(Layout(tp=2, pp=2), jobs, tmp_path)
    for job in jobs:
        _check(job, results[job.name], tokens, 4)


def test_tp2_ep2_with_experts_unsplit(models, tmp_path):
    """Expert tensor parallelism 1 beside TP2: dense tensors split over TP, experts whole on their EP rank."""
    jobs = [Job(name, models[name]) for name in ("qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite")]
    tokens, results = _run(Layout(tp=2, ep=2, etp=1), jobs, tmp_path)
    for job in jobs:
        _check(job, results[job.name], tokens, 4)


def test_cp2_with_the_bridge_spec(models, tmp_path):
    """Context parallelism: megatron-core's local spec refuses it, so the model is `get_model`'s."""
    jobs = [Job(name, models[name], bridge_spec=True) for name in ("llama", "deepseek_v3")]
    tokens, results = _run(Layout(cp=2), jobs, tmp_path)
    for job in jobs:
        _check(job, results[job.name], tokens, 2)


@pytest.mark.real_model
def test_smollm2_pp2(smollm2, tmp_path):
    job = Job("smollm2", str(smollm2), trace=True, save_dir=str(tmp_path / "saved"), shard_size="200MB")
    tokens, results = _run(Layout(pp=2), [job], tmp_path, vocab=49152)
    _check(job, results["smollm2"], tokens, 2)
    _check_saved(tmp_path / "saved", smollm2, tokens, sharded=True)
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    for result in results["smollm2"]:
        _assert_streamed(result["events"])


def _fp8_checkpoint(root: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A tiny FP8 DeepSeek-V3 (`fp8_sources.fp8_source`), and a plain directory of the values it holds
    (each block `q * scale_inv` in bfloat16, by the test's own arithmetic; router and bias in float32)."""
    bf16 = build_tiny_model(root / "bf16", "DeepseekV3ForCausalLM", seed=4, dtype=torch.bfloat16, **SHAPE)
    expected = fp8_source(root / "fp8", bf16, kind="random ue8m0")
    plain = root / "dequantized"
    shutil.copytree(bf16, plain)
    save_file(expected, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    assert "quantization_config" not in config
    return root / "fp8", plain, expected


def _pow2_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own ue8m0 quantization: per 128 x 128 block, scale = the power of two at or above amax / 448
    (1 for a block of zeros), codes = value / scale rounded to e4m3."""
    rows, cols = -(-weight.shape[0] // 128), -(-weight.shape[1] // 128)
    scale = torch.ones(rows, cols)
    for i in range(rows):
        for j in range(cols):
            amax = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max()
            if amax > 0:
                scale[i, j] = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    codes = (weight.float() / expand(scale, weight.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scale


def test_fp8_checkpoint_at_tp2(tmp_path):
    fp8, plain, expected = _fp8_checkpoint(tmp_path)
    job = Job("fp8", str(fp8), reference=str(plain), fp8_export=True, same_dtype=False)  # an fp32 model
    tokens, results = _run(Layout(tp=2), [job], tmp_path, vocab=211)
    _check(job, results["fp8"], tokens, 2, count_reads=False)  # FP8 rows are dequantized whole, columns cut after
    for result in results["fp8"]:
        blocks = result["fp8"]
        assert sorted(n for n in blocks if not n.endswith("_scale_inv")) == sorted(expected)
        for name, value in expected.items():
            scale = blocks.get(f"{name}_scale_inv")
            if scale is None:
                assert torch.equal(blocks[name], value.to(blocks[name].dtype)), name
                continue
            codes, want = _pow2_blocks(value)
            assert torch.equal(scale, want), name
            assert torch.equal(blocks[name].view(torch.uint8), codes.view(torch.uint8)), name
