"""The GRPO config: YAML and dotted overrides onto frozen dataclasses; unknown keys name the closest valid key;
keys forwarded to megatron-core are checked against megatron-core's own config classes; a mistake is found without
importing the training stack."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.algorithm.losses import Aggregation, LossConfig
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import GRPOConfig, apply_overrides, config_from_dict, load_config

EXAMPLE = Path(__file__).parents[3] / "examples" / "grpo_tiny.yaml"
BASE = {"policy": {"model_path": "/some/model"}, "data": {"task": "repeat_digit"}}


def test_example_yaml_loads_with_overrides() -> None:
    config = load_config(EXAMPLE, ["policy.model_path=/m", "grpo.seed=3", "loss_fn.aggregation=sequence"])
    assert config.policy.model_path == "/m"
    assert config.grpo.seed == 3
    assert config.loss_fn.aggregation is Aggregation.SEQUENCE
    assert config.policy.megatron_cfg.tensor_model_parallel_size == 2
    assert config.policy.megatron_cfg.optimizer["lr"] == 1e-2
    assert config.generation.stop_token_ids == (0,)
    assert isinstance(config.loss_fn, LossConfig)


def test_every_field_has_a_docstring_default_and_the_config_is_frozen() -> None:
    config = config_from_dict(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.grpo.seed = 1  # type: ignore[misc]
    assert GRPOConfig().grpo.num_generations_per_prompt >= 2


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("grpo.num_generation_per_prompt=4", "num_generations_per_prompt"),
        ("polcy.model_path=/x", "policy"),
        ("loss_fn.kl_coeff=0.1", "kl_coef"),
        ("policy.megatron_cfg.tensor_parallel_size=2", "tensor_model_parallel_size"),
        ("policy.megatron_cfg.optimizer.adam_bta1=0.9", "adam_beta1"),
        ("policy.megatron_cfg.transformer.recompute_granularty=full", "recompute_granularity"),
        ("policy.megatron_cfg.ddp.overlap_grad_reduc=true", "overlap_grad_reduce"),
    ],
)
def test_unknown_keys_name_the_closest_valid_key(override: str, suggestion: str) -> None:
    with pytest.raises(GRPOConfigError, match=f"did you mean '[a-z_.]*{suggestion}'"):
        config_from_dict(BASE, [override])


def test_forwarded_keys_reach_megatron_core_classes_unchanged() -> None:
    from megatron.core.optimizer import OptimizerConfig

    config = config_from_dict(BASE, ["policy.megatron_cfg.optimizer.adam_beta2=0.95"])
    assert OptimizerConfig(**config.policy.megatron_cfg.optimizer).adam_beta2 == 0.95


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policy.megatron_cfg.transformer.num_layers=4", "set by the trainer"),
        ("grpo.num_generations_per_prompt=1", ">= 2"),
        ("grpo.num_minibatches=3", "must divide"),
        ("generation.temperature=0", "temperature"),
        ("grpo.seed=abc", "must be int"),
        ("loss_fn.clip_low=1.5", "clip_low"),
        ("loss_fn.aggregation=tokens", "aggregation"),
        (
            "loss_fn.ratio_level=sequence",
            r"^loss_fn: LossConfig\.ratio_level=sequence \(GSPO\) needs aggregation=sequence",
        ),
        ("reward.name=maths", "did you mean 'math'"),
        ("data.train_jsonl=/x.jsonl", "exactly one of data.task, data.train_jsonl and data.hf_dataset"),
        ("policy.megatron_cfg.sequence_parallel=true", "tensor_model_parallel_size > 1"),
        ("policy.megatron_cfg.transformer.transformer_impl=fast", "must be one of local, transformer_engine"),
        ("policy.megatron_cfg.transformer.transformer_impl=transformer_engine", "needs Transformer Engine"),
        ("policy.megatron_cfg.sequence_packing=true", "aggregation=token"),
        ("generation.decode_attention=paged", "one of auto, triton, flex, gather"),
        ("generation.flex_min_batch=0", "flex_min_batch must be >= 1"),
        ("generation.torch_compile=maybe", "torch_compile must be bool"),
        ("generation.kv_cache_dtype=int8", "kv_cache_dtype='int8': auto or fp8"),
        ("generation.kv_cache_scale=0", "kv_cache_scale=0.0 must be positive"),
        (
            "policy.megatron_cfg.transformer.moe_router_bias_update_rate=0.001",
            r"is set by policy\.megatron_cfg\.moe_router_bias_update_rate; set that instead",
        ),
        ("policy.megatron_cfg.moe_router_bias_update_rate=-0.1", "moe_router_bias_update_rate=-0.1 must be >= 0"),
    ],
)
def test_invalid_values_are_refused_before_any_work(override: str, message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(BASE, [override, *(["loss_fn.aggregation=sequence"] if "packing" in override else [])])


def test_context_parallel_is_taken_and_refuses_attention_dropout() -> None:
    config = config_from_dict(BASE, ["policy.megatron_cfg.context_parallel_size=2"])
    assert config.policy.megatron_cfg.context_parallel_size == 2
    with pytest.raises(GRPOConfigError, match="does not implement dropout"):
        config_from_dict(
            BASE,
            ["policy.megatron_cfg.context_parallel_size=2", "policy.megatron_cfg.transformer.attention_dropout=0.1"],
        )


def test_dtensor_context_parallel_is_refused_with_the_reason() -> None:
    overrides = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
    config_from_dict(BASE, [*overrides, "policy.dtensor_cfg.context_parallel_size=1"])
    with pytest.raises(GRPOConfigError, match="ring attention replaces only the CUDA SDPA kernels"):
        config_from_dict(BASE, [*overrides, "policy.dtensor_cfg.context_parallel_size=2"])


def test_overrides_parse_yaml_scalars_and_do_not_touch_the_input() -> None:
    data = {"grpo": {"seed": 1}}
    result = apply_overrides(data, ["grpo.seed=2", "generation.stop_token_ids=[1, 2]", "policy.tokenizer=null"])
    assert data == {"grpo": {"seed": 1}}
    assert result == {"grpo": {"seed": 2}, "generation": {"stop_token_ids": [1, 2]}, "policy": {"tokenizer": None}}
    with pytest.raises(GRPOConfigError, match=r"key\.sub=value"):
        apply_overrides(data, ["grpo.seed"])
    with pytest.raises(GRPOConfigError, match=r"override 'grpo\.seed=\{a: 1': the value is not valid YAML: .* line 1"):
        apply_overrides(data, ["grpo.seed={a: 1"])


def test_hf_dataset_source_feeds_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`data.hf_dataset` goes through `datasets.load_dataset` (a stand-in here: the Hub is not reachable)."""
    import sys
    import types

    from hf_mcore_bridge.grpo.run.trainer import _records

    calls = []

    def load_dataset(path, split):
        calls.append((path, split))
        return [{"question": f"{split} {i}?", "solution": str(i)} for i in range(3)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    config = config_from_dict(
        {
            "policy": {"model_path": "/models/any"},
            "data": {
                "hf_dataset": "org/math",
                "hf_val_split": "test",
                "prompt_field": "question",
                "answer_field": "solution",
            },
        }
    )
    config.validate()
    train, val = _records(config)
    assert calls == [("org/math", "train"), ("org/math", "test")]
    assert [r["prompt"] for r in train] == ["train 0?", "train 1?", "train 2?"]
    assert [r["answer"] for r in val][:2] == ["0", "1"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.gpus_per_node=3", "policy.megatron_cfg.tensor_model_parallel_size=2"], "multiple of tp.pp.cp=2"),
        (["cluster.gpus_per_node=2", "policy.megatron_cfg.expert_model_parallel_size=4"], "etp.ep.pp=4"),
        (["cluster.gpus_per_node=3"], "do not split over the 3 data-parallel ranks"),
        (["policy.megatron_cfg.expert_tensor_parallel_size=0"], "expert_tensor_parallel_size=0"),
    ],
)
def test_a_world_that_cannot_hold_the_layout_is_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(BASE, overrides).validate()


def test_data_parallel_size_is_ranks_over_the_model_parallel_ones() -> None:
    from hf_mcore_bridge.grpo.run.plan import parallel_dims

    config = config_from_dict(BASE, ["cluster.gpus_per_node=8", "policy.megatron_cfg.tensor_model_parallel_size=2"])
    dims = parallel_dims(config)
    assert (dims.world, dims.dp) == (8, 4)
    default = config_from_dict(BASE, ["policy.megatron_cfg.expert_model_parallel_size=2"])
    dims = parallel_dims(default)
    assert (dims.world, dims.dp) == (2, 2)  # the EP ranks replicate the dense layers


_VALIDATE = """
import sys
from hf_mcore_bridge.grpo.run.config import GRPOConfigError, load_config
try:
    load_config(sys.argv[1], sys.argv[2:])
    print("accepted")
except GRPOConfigError as err:
    print(f"refused: {err}")
heavy = ("megatron.core", "transformers", "torch.distributed", "torch")
print("loaded:", " ".join(name for name in heavy if name in sys.modules))
"""

DTENSOR = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.num_generations_per_prompt=1"], ">= 2"),
        (["policy.megatron_cfg.optimizer.lr=-1.0"], r"optimizer\.lr=-1 must be >= 0"),
        (["cluster.gpus_per_node=3", "policy.megatron_cfg.tensor_model_parallel_size=2"], "multiple of tp"),
        (["generation.decode_attention=paged"], "one of auto, triton, flex, gather"),
        ([*DTENSOR, "policy.dtensor_cfg.scheduler.lr_decay_style=WSD"], "lr_decay_style='WSD'"),
        (["logger.num_val_samples_to_print=-1"], "num_val_samples_to_print must be >= 0"),  # the last cheap check
        ([], None),  # a valid config: megatron-core's config classes are read for the forwarded keys
    ],
    ids=["early", "optimizer", "world", "engine-kernel", "dtensor-schedule", "last", "valid"],
)
def test_a_config_error_is_found_without_the_training_stack(
    tmp_path: Path, overrides: list[str], message: str | None
) -> None:
    """In a fresh interpreter, a config error is reported without importing torch (let alone torch.distributed),
    transformers or megatron-core; the valid config, whose forwarded keys need megatron-core's classes, shows that
    the probe sees those imports."""
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(BASE))
    done = subprocess.run(
        [sys.executable, "-c", _VALIDATE, str(path), *overrides], capture_output=True, text=True, timeout=300
    )
    verdict, loaded = done.stdout.strip().splitlines()[-2:]
    if message is None:
        assert verdict == "accepted" and "megatron.core" in loaded.split(), done.stdout + done.stderr
        return
    assert verdict.startswith("refused: ") and re.search(message, verdict), done.stdout + done.stderr
    assert loaded == "loaded:", loaded


LORA = ["policy.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"]
EXPERTS = ["policy.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, experts.gate_up_proj, experts.down_proj]"]


def test_lora_section_loads_with_its_defaults_and_values() -> None:
    config = config_from_dict(BASE, [*LORA, "policy.lora.rank=4", "policy.lora.alpha=8", "policy.lora.init=gaussian"])
    lora = config.policy.lora
    assert (lora.enabled, lora.rank, lora.alpha, lora.scale, lora.init) == (False, 4, 8.0, 2.0, "gaussian")
    assert lora.target_modules[-1] == "down_proj"
    assert config_from_dict(BASE).policy.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    experts = config_from_dict(BASE, ["policy.lora.enabled=true", *EXPERTS]).policy.lora  # EP1, ETP1: accepted
    assert experts.target_modules[-2:] == ("experts.gate_up_proj", "experts.down_proj")
    saved = config_from_dict(BASE, ["policy.lora.enabled=true", *EXPERTS, "checkpointing.enabled=true"])
    assert saved.checkpointing.enabled and saved.policy.lora.target_modules == experts.target_modules  # checkpoints


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policy.lora.rnak=4", "did you mean 'policy.lora.rank'"),
        ("policy.lora.rank=0", r"policy\.lora\.rank=0 must be >= 1"),
        ("policy.lora.alpha=-1", r"policy\.lora\.alpha=-1\.0 must be > 0"),
        ("policy.lora.dropout=1", r"policy\.lora\.dropout=1\.0 must be in \[0, 1\)"),
        ("policy.lora.dropout=-0.1", r"policy\.lora\.dropout=-0\.1 must be in \[0, 1\)"),
        ("policy.lora.dropout=abc", r"policy\.lora\.dropout must be float"),
        ("policy.lora.init=xavier", r"policy\.lora\.init='xavier': one of kaiming, gaussian"),
        (
            "policy.lora.target_modules=[q_prj, k_proj, v_proj]",
            "'q_prj' is not an implemented projection; did you mean 'q_proj'",
        ),
        (
            "policy.lora.target_modules=[experts]",
            "'experts' is not an implemented projection; did you mean 'experts.down",
        ),
        ("policy.lora.target_modules=[lm_head]", "'lm_head' is not an implemented projection; implemented: q_proj"),
        ("policy.lora.target_modules=[]", "target_modules is empty"),
        ("policy.lora.target_modules=[q_proj, v_proj]", "q_proj, k_proj, v_proj share one megatron-core linear"),
        ("policy.lora.target_modules=[up_proj]", "gate_proj, up_proj share one megatron-core linear"),
    ],
)
def test_bad_lora_values_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(BASE, [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "policy.megatron_cfg.enabled=false",
                "policy.dtensor_cfg.enabled=true",
                "policy.dtensor_cfg.tensor_parallel_size=2",
                "cluster.gpus_per_node=2",
                "policy.lora.dropout=0.1",
            ],
            "adapter dropout under tensor parallelism is not implemented",
        ),
        (
            [*EXPERTS, "policy.lora.dropout=0.1"],
            r"policy\.lora\.dropout=0\.1 with adapters on experts",
        ),
        (
            [*EXPERTS, "policy.megatron_cfg.tensor_model_parallel_size=2", "cluster.gpus_per_node=2"],
            r"\['experts.gate_up_proj', 'experts.down_proj'\] at tensor_model_parallel_size 2: megatron-core trains"
            " mixture-of-experts layers at tensor parallelism > 1 only with sequence parallelism",
        ),
        (
            [*EXPERTS, "policy.megatron_cfg.expert_tensor_parallel_size=2", "cluster.gpus_per_node=2"],
            "with expert tensor parallelism 2 .* and tensor_model_parallel_size 1: adapters on experts are implemented"
            " at expert_tensor_parallel_size 1 or equal to tensor_model_parallel_size",
        ),
        (
            [
                *EXPERTS,
                "policy.megatron_cfg.enabled=false",
                "policy.dtensor_cfg.enabled=true",
                "policy.lora.dropout=0.1",
            ],
            r"policy\.lora\.dropout=0\.1 with adapters on experts",
        ),
    ],
)
def test_lora_runs_not_implemented_yet_are_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(BASE, ["policy.lora.enabled=true", *overrides])


def test_megatron_lora_runs_with_sequence_parallelism() -> None:
    """Adapters under sequence parallelism are implemented (`megatron.lora`), dense and on experts (at expert
    tensor parallelism 1)."""
    sp = ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true"]
    sp.append("cluster.gpus_per_node=2")
    assert config_from_dict(BASE, ["policy.lora.enabled=true", *sp]).policy.megatron_cfg.sequence_parallel
    experts = [*EXPERTS, "policy.megatron_cfg.expert_tensor_parallel_size=1"]
    assert config_from_dict(BASE, ["policy.lora.enabled=true", *sp, *experts]).policy.lora.enabled


def test_dtensor_lora_runs_with_checkpoints() -> None:
    on = ["policy.lora.enabled=true", "policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
    assert config_from_dict(BASE, [*on, "checkpointing.enabled=true"]).checkpointing.enabled
    # adapters on experts too (PEFT's target_parameters on the DTensor backend), with checkpoints
    config = config_from_dict(BASE, [*on, *EXPERTS, "checkpointing.enabled=true"])
    assert config.checkpointing.enabled and "experts.down_proj" in config.policy.lora.target_modules
    # and under tensor parallelism (without dropout)
    tp = ["policy.dtensor_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=2"]
    assert config_from_dict(BASE, [*on, *tp]).policy.dtensor_cfg.tensor_parallel_size == 2


def test_lora_dropout_is_accepted_on_both_backends() -> None:
    from hf_mcore_bridge.grpo.run.trainer import fuses_old_logprobs

    dtensor = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
    for backend in ([], dtensor):
        config = config_from_dict(BASE, ["policy.lora.enabled=true", "policy.lora.dropout=0.05", *backend])
        assert config.policy.lora.dropout == 0.05
        assert not fuses_old_logprobs(config)  # the old log-probs: a forward of their own, in eval mode
        assert fuses_old_logprobs(config_from_dict(BASE, ["policy.lora.enabled=true", *backend]))


def test_a_lora_adapter_path_must_be_a_peft_directory_of_the_configs_shape(tmp_path: Path) -> None:
    """`policy.lora.adapter_path`: a PEFT LoRA directory whose rank, alpha and targets are the config's; anything
    else is one line naming the difference, before torch loads."""
    on = ["policy.lora.enabled=true", f"policy.lora.adapter_path={tmp_path}"]
    with pytest.raises(GRPOConfigError, match=r"no adapter_config\.json there"):
        config_from_dict(BASE, on)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]})
    )
    with pytest.raises(GRPOConfigError, match=r"no adapter_model\.safetensors"):
        config_from_dict(BASE, on)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    message = r"the adapter has rank 8, alpha 16, target_modules \['q_proj', 'v_proj'\]; the config asks for rank 8"
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(BASE, on)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    )
    assert config_from_dict(BASE, on).policy.lora.adapter_path == str(tmp_path)
