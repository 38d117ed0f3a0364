"""The training benchmark: its CPU smoke run end to end (every path, a table, JSON), its packed rows, its FLOP count
against the weights of a real transformers model, and its out-of-memory handling (its GPU figures are reported
separately)."""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_training  # noqa: E402


def test_bench_training_tiny_runs_on_cpu(tmp_path: Path, run_script) -> None:
    out = tmp_path / "bench.json"
    result = run_script("bench_training.py", ["--tiny", "--json", str(out)], 300)
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("tiny ")]
    rows = [row for row in rows if row[1].isdigit()]  # the table, not the ratio lines
    assert sorted((row[1], row[2], row[3]) for row in rows) == sorted(
        (str(n), "2", path) for n in (64, 128) for path in ("megatron", "dtensor", "hf")
    )
    assert all(row[-1] == "ok" for row in rows), result.stdout
    assert "Megatron / DTensor tokens/s per GPU" in result.stdout
    payload = json.loads(out.read_text())
    assert len(payload["results"]) == 6
    for entry in payload["results"]:
        assert entry["status"] == "ok"
        for key in ("step_s", "tokens_per_s", "tokens_per_s_per_gpu", "flops_per_iter", "mfu", "peak_mem_gib"):
            assert math.isfinite(entry[key]) and entry[key] > 0, (key, entry)
        assert entry["micro_batches"] == 2
        assert entry["tokens_per_iter"] == 2 * entry["seq_len"]


@pytest.mark.slow
@pytest.mark.extended
def test_bench_training_runs_the_megatron_path_at_cp2(tmp_path: Path, run_script) -> None:
    """`--megatron-parallel cp`: the trainer's policy at CP = nproc, each row's tokens counted once."""
    out = tmp_path / "bench.json"
    args = ["--shapes", "tiny", "--seq-lens", "64", "--micro-batches", "2", "--warmup", "1", "--iters", "1"]
    args += ["--dtype", "fp32", "--nproc", "2", "--megatron-parallel", "cp", "--paths", "megatron", "--json", str(out)]
    run_script("bench_training.py", args, 300)
    (entry,) = json.loads(out.read_text())["results"]
    assert entry["status"] == "ok" and entry["layout"] == "TP1 CP2" and entry["gpus"] == 2
    assert entry["tokens_per_iter"] == 2 * 64
    assert entry["tokens_per_s_per_gpu"] == pytest.approx(entry["tokens_per_s"] / 2)


def test_micro_batches_follow_the_tokens_per_step() -> None:
    defaults = bench_training.Options()
    assert [bench_training.micro_batches(defaults, n) for n in (4096, 16384, 65536)] == [8, 2, 1]
    assert bench_training.micro_batches(bench_training.Options(micro_batches=3), 4096) == 3


def test_packed_rows() -> None:
    lengths = bench_training.packed_lengths(4096, (1 / 16, 1 / 2), seed=3)
    assert sum(lengths) == 4096 and len(lengths) > 1 and min(lengths) >= 2
    row = bench_training.make_row(40, 211, (0.1, 0.5), seed=5, device=torch.device("cpu"))
    starts = row.cu_seqlens[:-1].tolist()
    assert row.cu_seqlens[-1] == 40 and row.tokens.shape == row.positions.shape == (1, 40)
    assert (row.positions[0] == 0).nonzero().flatten().tolist() == starts
    last = [s - 1 for s in row.cu_seqlens[1:].tolist()]
    assert (row.loss_mask[0] == 0).nonzero().flatten().tolist() == last  # no prediction across sequences
    assert (row.hf_labels[0] == -100).nonzero().flatten().tolist() == starts
    assert torch.equal(row.next_tokens[0, :-1], row.tokens[0, 1:])


@pytest.mark.parametrize("shape", ["llama3.2-1b", "llama3-8b"])
def test_flop_count_matches_the_model(shape: str) -> None:
    """N_matmul equals the weights of every `nn.Linear` of the transformers model (the output layer included,
    tied or not); one sequence of length T costs 6 N T plus the causal attention term."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = bench_training.shape_config(shape)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert bench_training.matmul_params(config) == linear
    attention = 6 * model.config.num_hidden_layers * model.config.num_attention_heads * model.config.head_dim
    assert bench_training.row_flops(config, [100, 28]) == 6 * linear * 128 + attention * (100**2 + 28**2)


def _fake_builder(fail_without_recompute: bool):
    def build(shape, opts, recompute, device):
        if fail_without_recompute and not recompute:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return bench_training.Trainer(lambda rows: None)

    return build


@pytest.fixture
def one_rank_world():
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_out_of_memory_is_retried_with_recompute_or_reported(one_rank_world, monkeypatch) -> None:
    cpu = torch.device("cpu")
    place = bench_training._Placement("fake", 1, 0, 1)
    opts = bench_training.Options(shapes=("tiny",), seq_lens=(16, 8), micro_batches=1, warmup=0, iters=1)
    monkeypatch.setitem(bench_training.BUILDERS, "megatron", _fake_builder(fail_without_recompute=True))
    results = bench_training.run_path("tiny", "megatron", opts, place, cpu)
    assert [(r.seq_len, r.status, r.recompute) for r in results] == [(8, "ok", True), (16, "ok", True)]
    off = bench_training.run_path(
        "tiny", "megatron", bench_training.Options(recompute="off", seq_lens=(8,), micro_batches=1), place, cpu
    )
    assert [(r.status, r.recompute) for r in off] == [("OOM", False)]
    monkeypatch.setitem(bench_training.BUILDERS, "megatron", _fake_builder(fail_without_recompute=False))
    fits = bench_training.run_path(
        "tiny", "megatron", bench_training.Options(seq_lens=(8,), micro_batches=1, iters=1), place, cpu
    )
    assert [(r.status, r.recompute) for r in fits] == [("ok", False)]


def test_recomputation_is_predicted_from_the_shorter_rows_peak() -> None:
    """The 8B Megatron path peaked at 113 GiB at 4096 tokens (about 56 GiB held before its first step): 16384 is
    predicted not to fit on a 140 GiB GPU, as it did not; the 1B path (24 GiB peak, ~10 static) is predicted to fit,
    as it did (54 GiB)."""
    assert bench_training.predicted_oom(113.0, 4096, 56.0, 16384, 139.8)
    assert not bench_training.predicted_oom(24.0, 4096, 10.0, 16384, 139.8)
    assert not bench_training.predicted_oom(24.0, 4096, 30.0, 16384, 139.8)  # static above the peak: no activations


@pytest.mark.parametrize("in_place", [True, False], ids=["turned-on", "rebuilt"])
def test_predicted_recomputation_is_turned_on_in_place_where_the_path_can(one_rank_world, monkeypatch, in_place):
    """A longer row length predicted not to fit gets recomputation: in the built model where the path offers
    `enable_recompute` (Megatron, HF), else in a rebuilt one (FSDP2)."""
    builds: list[bool] = []
    turned_on: list[bool] = []

    def build(shape, opts, recompute, device):
        builds.append(recompute)
        return bench_training.Trainer(lambda rows: None, (lambda: turned_on.append(True)) if in_place else None)

    monkeypatch.setitem(bench_training.BUILDERS, "megatron", build)
    monkeypatch.setattr(bench_training, "_predicted_oom", lambda previous, *args: previous is not None)
    place = bench_training._Placement("fake", 1, 0, 1)
    opts = bench_training.Options(shapes=("tiny",), seq_lens=(8, 16), micro_batches=1, warmup=0, iters=1)
    results = bench_training.run_path("tiny", "megatron", opts, place, torch.device("cpu"))
    assert [(r.seq_len, r.status, r.recompute) for r in results] == [(8, "ok", False), (16, "ok", True)]
    assert (builds, turned_on) == (([False], [True]) if in_place else ([False, True], []))


def test_auto_layout_measures_the_recomputed_row_lengths_again_at_tp(monkeypatch) -> None:
    """`--megatron-parallel auto`: the megatron path runs data parallel; the row lengths that needed recomputation
    there (or ran out of memory) run again in a world of TP = nproc, and the ratio takes the faster layout."""
    launched = []

    def fake_world(body, layout, shape, path, opts, out, world):
        launched.append((path, layout.tp, opts.seq_lens, world))
        results = []
        for n in opts.seq_lens:
            tp = layout.tp > 1
            speed = {"megatron": 900.0 if tp else (1000.0 if n == 64 else 500.0), "dtensor": 600.0}[path]
            result = bench_training.Result(shape, n, path, f"TP{layout.tp}", world, "ok", not tp and n == 128)
            results.append(bench_training.asdict(bench_training.replace(result, tokens_per_s_per_gpu=speed)))
        Path(out).write_text(json.dumps(results))

    monkeypatch.setattr(bench_training, "run_world", fake_world)
    opts = bench_training.Options(shapes=("s",), seq_lens=(64, 128), paths=("megatron", "dtensor"))
    results = bench_training.run(opts, nproc=2)
    assert launched == [("megatron", 1, (64, 128), 2), ("megatron", 2, (128,), 2), ("dtensor", 1, (64, 128), 2)]
    assert [(r.seq_len, r.layout) for r in results if r.path == "megatron"] == [(64, "TP1"), (128, "TP1"), (128, "TP2")]
    lines = bench_training.ratios(results)
    assert lines == [
        "s @ 64: Megatron / DTensor tokens/s per GPU = 1.67x (each at its fastest: Megatron TP1, DTensor TP1)",
        "s @ 128: Megatron / DTensor tokens/s per GPU = 1.50x (each at its fastest: Megatron TP2, DTensor TP1)",
    ]
    launched.clear()
    bench_training.run(bench_training.replace(opts, megatron_parallel="dp"), nproc=2)
    assert [entry[1] for entry in launched] == [1, 1]


def test_dtensor_search_covers_fsdp_tp_deferred_sync_and_attention() -> None:
    """With 2 ranks on the 1B shape: FSDP2 with per-micro-batch and deferred gradient sync, TP2, each with both
    attentions; TP only where the heads, KV heads and FFN divide by the world; `off` is FSDP2 with one attention."""
    opts = bench_training.Options()
    shape = bench_training.shape_config("llama3.2-1b")
    labels = [layout.label(2) for layout in bench_training.dtensor_layouts(opts, 2, shape)]
    assert labels == [
        "FSDP2 dp_shard=2 sdpa",
        "FSDP2 dp_shard=2 flex",
        "FSDP2 dp_shard=2 deferred-sync sdpa",
        "FSDP2 dp_shard=2 deferred-sync flex",
        "FSDP2 dp_shard=1 TP2 sdpa",
        "FSDP2 dp_shard=1 TP2 flex",
    ]
    three = bench_training.dtensor_layouts(opts, 3, shape, ("sdpa",))  # 32 heads / 3: no TP
    assert [layout.tp for layout in three] == [1, 1]
    one = bench_training.dtensor_layouts(opts, 1, shape, ("sdpa",))  # one rank: nothing to reduce or defer
    assert [layout.label(1) for layout in one] == ["FSDP2 dp_shard=1 sdpa"]
    off = bench_training.dtensor_layouts(bench_training.Options(dtensor_search="off", hf_attention="eager"), 2, shape)
    assert off == [bench_training.DTensorLayout(attention="eager")]


def test_megatron_path_runs_the_trainers_settings() -> None:
    """The Megatron path passes only `policy.megatron_cfg.ddp` keys a user can set; the rest are the trainer's
    defaults: fp32 gradient reduction, and with data parallelism the reduction overlapped with the backward."""
    from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig
    from hf_mcore_bridge.grpo.backends.megatron.policy import ddp_settings

    opts = bench_training.Options()
    assert bench_training.megatron_ddp(opts, 1) == {}
    keys = bench_training.megatron_ddp(opts, 2)
    assert keys == {"use_distributed_optimizer": True, "overlap_param_gather": False}
    assert bench_training.megatron_ddp(bench_training.Options(overlap_param_gather=True), 2)["overlap_param_gather"]
    settings = ddp_settings(MegatronConfig(ddp=keys), 2)
    assert settings == {
        "grad_reduce_in_fp32": True,
        "overlap_grad_reduce": True,
        "use_distributed_optimizer": True,
        "overlap_param_gather": False,
    }
    assert ddp_settings(MegatronConfig(), 1) == {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False}
    assert ddp_settings(MegatronConfig(ddp={"grad_reduce_in_fp32": False}), 1)["grad_reduce_in_fp32"] is False
    # the distributed optimizer named on the optimizer alone switches DDP's buffers too
    on = ddp_settings(MegatronConfig(optimizer={"use_distributed_optimizer": True}), 2)
    assert on["use_distributed_optimizer"] is True


def _fused_logprobs_rank(out: str) -> None:
    """Rank body: the trainer's bf16 log-probs on CUDA (megatron-core's fused cross entropy) and their gradient,
    beside a float64 log-softmax of the same bf16 logits."""
    from hf_mcore_bridge.grpo.backends.megatron.policy import token_logprobs

    torch.manual_seed(0)
    vocab, padded, temperature = 300, 384, 0.7
    logits = (torch.randn(2, 33, padded, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, vocab, (2, 33), device="cuda")
    weights = torch.randn(2, 32, device="cuda", dtype=torch.float64)
    logprobs = token_logprobs(logits, tokens, vocab, temperature)
    (logprobs.double() * weights).sum().backward()
    exact = logits.detach().double().requires_grad_()
    reference = torch.log_softmax(exact[:, :-1, :vocab] / temperature, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    (reference * weights).sum().backward()
    fused = logprobs.grad_fn.next_functions[0][0]._forward_cls.__module__  # NegBackward <- the cross entropy
    result = {
        "module": fused,
        "dlogprob": (logprobs.double() - reference).abs().max().item(),
        "dgrad": (logits.grad.double() - exact.grad).abs().max().item(),
        "grad_scale": exact.grad.abs().max().item(),
        "padding_grad": logits.grad[..., vocab:].abs().max().item(),
    }
    Path(out).write_text(json.dumps(result))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trainer_logprobs_on_cuda_in_bf16_use_the_fused_cross_entropy(tmp_path: Path) -> None:
    """The Megatron path's log-probs (the trainer's `token_logprobs`) in bf16 on CUDA go through megatron-core's
    fused cross entropy and equal a float64 log-softmax of the same logits (temperature, padded vocabulary) to fp32
    rounding; their gradient to bf16 rounding, none reaching the padding."""
    from hf_mcore_bridge.convert.layout import Layout
    from hf_mcore_bridge.megatron.world import run_world

    out = tmp_path / "fused.json"
    run_world(_fused_logprobs_rank, Layout(), str(out), world=1)
    result = json.loads(out.read_text())
    assert result["module"] == "megatron.core.fusions.fused_cross_entropy"
    assert result["dlogprob"] <= 1e-5
    assert result["dgrad"] <= 1e-2 * result["grad_scale"]
    assert result["padding_grad"] == 0.0


@pytest.mark.slow
@pytest.mark.extended
def test_dtensor_search_runs_every_layout_of_two_ranks(tmp_path: Path, run_script) -> None:
    """Two gloo ranks: the trainer's DTensor policy trains in each searched layout (FSDP2, FSDP2 with deferred
    gradient sync, TP2; sdpa only on CPU), and a TP group counts its shared rows once."""
    out = tmp_path / "bench.json"
    args = ["--shapes", "tiny", "--seq-lens", "64", "--micro-batches", "2", "--dtype", "fp32", "--nproc", "2"]
    run_script("bench_training.py", [*args, "--paths", "dtensor", "--iters", "1", "--json", str(out)], 300)
    results = json.loads(out.read_text())["results"]
    assert [(r["layout"], r["status"]) for r in results] == [
        ("FSDP2 dp_shard=2 sdpa", "ok"),
        ("FSDP2 dp_shard=2 deferred-sync sdpa", "ok"),
        ("FSDP2 dp_shard=1 TP2 sdpa", "ok"),
    ]
    assert [r["tokens_per_iter"] for r in results] == [2 * 2 * 64, 2 * 2 * 64, 2 * 64]
