"""The refit's two checks, each shown to fire on a deliberately broken input.

Transfer integrity (`refit.stream.tensor_checksums`, compared by the trainer after every refit): the hash itself is
checked in `test_checksums.py`; here `trainer._check_transfer` names lost, duplicated, changed and stale
tensors on a real engine.
Functional agreement (`logprob_gate`): the engine-vs-trainer `token_mult_prob_error` of each step's rollouts and
of the probe prompt stops the run. The slow tests corrupt the refit stream only (the trainer and its checkpoint
are untouched; `refit_ranks.py`) and assert that the run stops at the first step with the one-line message:
a q/k row swap in one layer (TP1, PP2), gate/up swapped (TP2), two experts exchanged (EP2, Qwen3-MoE), a stale
replay (TP1: recorded refits exist only where the stream takes no collective; a stand-in recorder, since a CPU
cannot capture CUDA graphs) and the vLLM path (vLLM's engine replaced by the embedded one, which is not readable
through `readable_tensor`, so only the gate can see it); a corruption from the second refit on is caught by the
probe prompt's gate. With the stream sound, the engine's own slicing mutated at engine TP2 (a query head shifted,
KV groups on the wrong ranks) stops the run at its initial refit: the transfer check's reference is cut on the
trainer's side (`refit.reference`; its fast tests, and every tensor corrupted in turn: `test_reference.py`).
That uncorrupted runs pass the gate at its fp32 default is shown by `test_layouts.py` (TP1,
TP2, PP2, DP2, EP2 runs with the gate on). The DP2 test shows the stream stale under megatron-core's deferred
parameter all-gather and fresh after `finish_param_gather`, against post-step weights set by the test itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.refit.logprob_gate import LogprobMismatchError, check_logprob_agreement, limit_of
from hf_mcore_bridge.grpo.refit.stream import tensor_checksums
from hf_mcore_bridge.grpo.run.config import config_from_dict

from ..tiny_policy import build_tiny_policy


def _config(dtype: str = "fp32", **grpo: object) -> object:
    base = {"policy": {"model_path": "/m", "dtype": dtype}, "data": {"task": "repeat_digit"}, "grpo": grpo}
    return config_from_dict(base)


def test_gate_defaults_by_dtype_and_stops_or_warns_with_one_line() -> None:
    assert limit_of(_config()) == 1.0001
    assert limit_of(_config("bf16")) == 1.25
    assert limit_of(_config(max_token_mult_prob_error=1.02)) == 1.02
    config = _config()
    assert check_logprob_agreement(config, 3, 1.00009, "step's rollouts") is None
    with pytest.raises(LogprobMismatchError) as caught:
        check_logprob_agreement(config, 3, 1.25, "step's rollouts")
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, BridgeError)
    assert message.startswith("step 3: engine vs trainer log-probs disagree on the step's rollouts")
    assert "1.25 > grpo.max_token_mult_prob_error 1.0001" in message and "wrong weight mapping or refit" in message
    with pytest.raises(LogprobMismatchError, match="token_mult_prob_error nan"):
        check_logprob_agreement(config, 1, float("nan"), "probe prompt")
    warn = _config(on_logprob_mismatch="warn")
    with pytest.warns(UserWarning, match="step 2: .* on the probe prompt: token_mult_prob_error 1.5"):
        assert check_logprob_agreement(warn, 2, 1.5, "probe prompt") is not None
    assert check_logprob_agreement(warn, 2, 1.5, "probe prompt", report=False) is not None  # other ranks: quiet


@pytest.mark.parametrize(
    ("grpo", "message"),
    [
        ({"max_token_mult_prob_error": 0.99}, "must be >= 1"),
        ({"on_logprob_mismatch": "ignore"}, "stop or warn"),
    ],
)
def test_gate_settings_are_validated(grpo: dict[str, object], message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message):
        _config(**grpo).validate()


def _corrupted_run(
    root: Path,
    policy: Path,
    kind: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    on_mismatch: str = "stop",
    check_initial: bool = False,
    engine_tp: int | None = None,
) -> None:
    """One GRPO step with the refit broken as `kind` says (`refit_ranks.corrupted_rank`); `engine_tp`:
    `generation.tensor_parallel_size` (None: the trainer's TP). The initial weights check (`grpo.refit.source_check`) is
    off unless `check_initial`: it would stop these runs before the gate sees them."""
    from hf_mcore_bridge.grpo.run.ranks import start_world
    from hf_mcore_bridge.grpo.run.trainer import prepare_run

    from .refit_ranks import corrupted_rank

    vllm = kind.startswith("vllm_")
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": pp,
                    "expert_model_parallel_size": ep,
                    "sequence_parallel": tp > 1 and ep > 1,
                    "micro_batch_size": 8,
                    "optimizer": {"lr": 1e-2},
                },
            },
            "reward": {"name": "grpo.refit.refit_ranks:varied_reward"},
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": 4,
                "max_num_steps": 1,
                "on_logprob_mismatch": on_mismatch,
                "check_initial_weights": check_initial,
            },
            "generation": {
                "max_new_tokens": 3,
                "stop_token_ids": [0],
                "max_model_len": 64,
                "tensor_parallel_size": engine_tp,
            },
            "data": {"task": "repeat_digit"},
            "logger": {"log_dir": str(root / kind), "print_progress": False},
        }
    )
    if vllm:  # set after validation, which refuses the vllm backend where vLLM is not installed
        config = dataclasses.replace(config, generation=dataclasses.replace(config.generation, backend="vllm"))
    prepared = prepare_run(config)
    start_world(prepared.plan.dims, corrupted_rank, kind, config, prepared)


ROLLOUTS_GATE = r"step 1: engine vs trainer log-probs disagree on the step's rollouts: token_mult_prob_error \d"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "layout", "message"),
    [
        ("qk", {}, ROLLOUTS_GATE),
        pytest.param(*("gate_up", {}, ROLLOUTS_GATE), marks=pytest.mark.extended),
        ("qk", {"tp": 2}, ROLLOUTS_GATE),
        pytest.param(*("gate_up", {"tp": 2}, ROLLOUTS_GATE), marks=pytest.mark.extended),
        pytest.param(*("qk", {"pp": 2}, ROLLOUTS_GATE), marks=pytest.mark.extended),
        ("gate_up", {"pp": 2}, ROLLOUTS_GATE),
        ("vllm_qk", {}, ROLLOUTS_GATE),
        ("later_qk+gate_up", {}, "step 1: engine vs trainer log-probs disagree on the probe prompt: token_mult_pr"),
        ("stale_engine", {}, "the refit after step 1 failed its check: the engine's tensor differs from the one"),
        ("stale_sources", {}, "the refit after step 1 failed its check: the refit read trainer tensors that differ"),
        (
            "rank1_copy",
            {"tp": 2},
            r"the initial refit \(rank 1\) failed its check: the engine's tensor differs from the one streamed for 1: "
            "model.layers.1.mlp.down_proj.weight",
        ),
    ],
    ids=[
        *("tp1-qk", "tp1-gate_up", "tp2-qk", "tp2-gate_up", "pp2-qk", "pp2-gate_up"),
        *("vllm-qk", "tp1-probe", "tp1-stale_engine", "tp1-stale_sources", "tp2-rank1_copy"),
    ],
)
def test_a_corrupted_refit_stops_the_run_at_the_first_step(
    tmp_path: Path, kind: str, layout: dict[str, int], message: str
) -> None:
    policy = build_tiny_policy(tmp_path / "policy")
    with pytest.raises(BridgeError, match=message) as caught:
        _corrupted_run(tmp_path, policy, kind, **layout)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("engine_head_shift", "for 2: model.layers.0.self_attn.q_proj.weight, model.layers.1.self_attn.q_proj.weight"),
        (
            "engine_kv_wrong_rank",
            "for 4: model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight, "
            "model.layers.1.self_attn.k_proj.weight, model.layers.1.self_attn.v_proj.weight",
        ),
    ],
    ids=["query-head-shifted", "kv-group-on-the-wrong-rank"],
)
def test_a_mutated_engine_slicing_stops_the_run_at_the_first_step_at_engine_tp2(
    tmp_path: Path, kind: str, named: str
) -> None:
    """Issue 27, requirement 4: a PP2 trainer with one TP2 engine over both ranks (full tensors, each rank keeping
    its part), the engine's own slicing mutated (`refit_ranks.shifted_head_shard`: each rank's query heads shifted
    by one head; `kv_on_wrong_rank`: the ranks' KV groups exchanged) while the stream is sound. The transfer check's
    reference is cut on the trainer's side (`refit.reference`), so the initial refit fails (on whichever rank is
    reported first: both fail their own check) naming exactly those tensors, before any rollout. The same layout
    unmutated passes every check for two steps (`test_engine_layouts.py`, `pp2_engine_tp2`); in-process checks of
    both mutations on every rank, and of KV heads replicated over TP4 onto the wrong ranks: `test_reference.py`.
    """
    policy = build_tiny_policy(tmp_path / "policy")
    message = (
        rf"the initial refit \(rank [01]\) failed its check: the engine's tensor differs from the one streamed {named}$"
    )
    with pytest.raises(BridgeError, match=message) as caught:
        _corrupted_run(tmp_path, policy, kind, pp=2, engine_tp=2)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    ["experts", pytest.param("qk", marks=pytest.mark.extended), pytest.param("gate_up", marks=pytest.mark.extended)],
)
def test_a_corrupted_moe_refit_stops_the_run_at_the_first_step_at_ep2(tmp_path: Path, kind: str) -> None:
    """Qwen3-MoE at EP2: two experts' tensors exchanged in layer 0, or q/k rows or gate/up swapped in its dense
    layer 1."""
    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    with pytest.raises(BridgeError, match=ROLLOUTS_GATE):
        _corrupted_run(tmp_path, policy, kind, ep=2)


INITIAL_CHECK = r"the initial refit's tensors do not give back the policy's HF checkpoint .*: [26] differ: "


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "ep", "names"), [("qk", 1, "q_proj, k_proj"), ("experts", 2, "experts")])
def test_the_initial_weights_check_stops_a_corrupted_stream_before_step_1(
    tmp_path: Path, kind: str, ep: int, names: str
) -> None:
    """With `grpo.check_initial_weights` (the default) a stream that does not give back the HF checkpoint stops
    the run before any rollout: q/k rows exchanged (TP1), two experts exchanged (Qwen3-MoE, EP2)."""
    moe = {"architecture": "Qwen3MoeForCausalLM", "mlp_only_layers": [1], "router_aux_loss_coef": 0.0}
    policy = build_tiny_policy(tmp_path / "policy", seed=2, **(moe if ep > 1 else {}))
    with pytest.raises(BridgeError, match=INITIAL_CHECK) as caught:
        _corrupted_run(tmp_path, policy, kind, ep=ep, check_initial=True)
    message = str(caught.value)
    assert "\n" not in message and all(n.strip() in message for n in names.split(","))
    assert not (tmp_path / kind / "metrics.jsonl").exists()  # stopped before step 1 logged anything


@pytest.mark.slow
def test_refit_streams_the_post_step_weights_with_overlapped_param_gather_at_dp2(tmp_path: Path) -> None:
    """With the distributed optimizer's buffers and `ddp.overlap_param_gather`, a step leaves the other ranks'
    shards stale until the next forward; the stream then differs from the post-step weights, and after
    `finish_param_gather` (what the megatron backend's `hf_weights` runs first) equals them."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import resolve_checkpoint
    from hf_mcore_bridge.convert.layout import Layout
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.megatron.world import run_world

    from .refit_ranks import param_gather_rank

    policy = build_tiny_policy(tmp_path / "policy")
    convert_hf_to_mcore(policy, tmp_path / "mcore", layout=Layout(), dtype="fp32", show_progress=False)
    _, checkpoint_dir = resolve_checkpoint(tmp_path / "mcore")
    out = tmp_path / "result.pt"
    run_world(param_gather_rank, Layout(), str(checkpoint_dir), str(out), world=2)
    result = torch.load(out)
    assert result["tensors"] == 21
    assert not result["stale"]  # the stale path: rank 0 streams the other rank's shard as it was before the step
    assert result["gathered"] and result["fresh"]


@pytest.mark.slow
def test_on_logprob_mismatch_warn_goes_on_and_logs_the_value(tmp_path: Path) -> None:
    from hf_mcore_bridge.grpo.run.metrics import read_metrics

    policy = build_tiny_policy(tmp_path / "policy")
    _corrupted_run(tmp_path, policy, "qk", on_mismatch="warn")
    (step,) = read_metrics(tmp_path / "qk")
    assert step["token_mult_prob_error"] > 1.0001 and step["probe_token_mult_prob_error"] > 1.0001


def test_transfer_check_names_lost_duplicated_changed_and_stale_tensors(tmp_path: Path) -> None:
    """`trainer._check_transfer` on a real embedded engine loaded from an HF file, each fault made by hand."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from hf_mcore_bridge.engine import Engine, EngineConfig
    from hf_mcore_bridge.grpo.refit.stream import Checksums
    from hf_mcore_bridge.grpo.run.trainer import _check_transfer

    policy = build_tiny_policy(tmp_path / "policy")
    weights = load_file(policy / "model.safetensors")
    config = EngineConfig(dtype=torch.float32, device="cpu", max_num_seqs=2, max_model_len=32)
    engine = Engine(json.loads((policy / "config.json").read_text()), config)
    engine.load_weights(weights.items())
    names = list(weights)
    trainer_params = [torch.randn(4, 3), torch.randn(5)]
    ctx = SimpleNamespace(refit_names=names, engine=engine)
    backend = SimpleNamespace(refit_sources=lambda: trainer_params)

    def sent(streamed: list[str], sources: list[torch.Tensor] | None = None) -> Checksums:
        values = tensor_checksums([weights[n] for n in streamed])
        return Checksums(tuple(streamed), values, None if sources is None else tensor_checksums(sources))

    assert _check_transfer(ctx, backend, sent(names, trainer_params), step=3) == len(names) == 21
    with pytest.raises(
        BridgeError, match=r"^the refit after step 3 failed its check: not streamed: model.norm.weight$"
    ):
        _check_transfer(ctx, backend, sent([n for n in names if n != "model.norm.weight"]), step=3)
    with pytest.raises(BridgeError, match=r"^the initial refit failed its check: streamed more than once: lm_head"):
        _check_transfer(ctx, backend, sent([*names, "lm_head.weight"]), step=0)
    engine.model.hf_view("model.layers.1.self_attn.k_proj.weight")[2, 5] += 1e-3  # the engine's copy went wrong
    with pytest.raises(BridgeError, match=r"differs from the one streamed for 1: model.layers.1.self_attn.k_proj"):
        _check_transfer(ctx, backend, sent(names), step=3)
    engine.load_weights(weights.items())
    stale = [trainer_params[0], trainer_params[1] + 1]  # what a replay read: not the trainer's weights now
    with pytest.raises(BridgeError, match=r"read trainer tensors that differ from the trainer's now \(a stale replay"):
        _check_transfer(ctx, backend, sent(names, stale), step=3)
