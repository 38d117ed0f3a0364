"""The bridge API's surface: importable from the package top without importing torch or megatron-core, a bridge
read from a directory's config alone, megatron-core configs that state the HF config's dimensions, and one clear
error for each bad input (a path that is neither a directory nor a Hub id, a Hub id that cannot be fetched, an
unsupported architecture or config, building before `parallel_state` exists)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_mcore_bridge
from hf_mcore_bridge import AutoBridge, BridgeError, Layout
from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.models.config_errors import ConfigError

PROBE = """
import sys
import hf_mcore_bridge
loaded = lambda: sorted(m for m in ("torch", "megatron") if m in sys.modules)
print("top", loaded())
bridge = hf_mcore_bridge.AutoBridge.from_pretrained(sys.argv[1])
print("bridge", loaded(), bridge.model_config.num_layers, bridge.architecture)
try:
    bridge.get_model()
except hf_mcore_bridge.BridgeError as err:
    print("refused", err)
print("built", loaded())
"""


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env or dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_the_package_top_imports_neither_torch_nor_megatron_until_a_model_is_built(tiny_models):
    top, bridge, refused, built = _python(PROBE, str(tiny_models["llama"]))
    assert top == "top []"
    assert bridge == "bridge [] 8 LlamaForCausalLM"  # a bridge is read from config and headers only
    assert refused.startswith("refused megatron-core's parallel_state is not initialised: call")
    assert "initialize_model_parallel" in refused
    assert built == "built ['megatron', 'torch']"  # the probe sees an import where there is one


def test_every_public_name_resolves_and_no_other():
    for name in hf_mcore_bridge.__all__:
        assert getattr(hf_mcore_bridge, name) is not None, name
    calls = {"AutoBridge", "load_hf_weights", "export_hf_weights", "save_hf", "convert_hf_to_mcore"}
    assert calls <= set(dir(hf_mcore_bridge))
    with pytest.raises(AttributeError, match="no attribute 'AutoBrige'"):
        hf_mcore_bridge.AutoBrige  # noqa: B018


def test_megatron_configs_state_the_hf_dimensions(tiny_models, tiny_moe_models):
    from megatron.core.transformer import MLATransformerConfig

    qwen3 = AutoBridge.from_pretrained(tiny_models["qwen3"])
    hf = json.loads((tiny_models["qwen3"] / "config.json").read_text())
    config = qwen3.transformer_config(Layout(tp=2), "bfloat16")
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["intermediate_size"],
    )
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
        hf["head_dim"],
    )
    assert config.qk_layernorm and config.tensor_model_parallel_size == 2 and config.params_dtype is torch.bfloat16
    assert config.transformer_impl == "local"  # no Transformer Engine here
    assert qwen3.transformer_config(transformer_engine=True).transformer_impl == "transformer_engine"
    assert qwen3.transformer_config(moe_token_dispatcher_type="alltoall").moe_token_dispatcher_type == "alltoall"
    assert qwen3.params_dtype() is torch.float32  # the checkpoint's own
    kwargs = qwen3.gpt_model_kwargs(Layout(tp=2))
    assert kwargs["vocab_size"] == 256  # 211 padded to 128 x TP
    assert kwargs["rotary_base"] == hf["rope_parameters"]["rope_theta"]
    deepseek = AutoBridge.from_pretrained(tiny_moe_models["deepseek_v3"])
    hf = json.loads((tiny_moe_models["deepseek_v3"] / "config.json").read_text())
    mla = deepseek.transformer_config(Layout(ep=2))
    assert isinstance(mla, MLATransformerConfig)
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.num_moe_experts) == (
        hf["kv_lora_rank"],
        hf["q_lora_rank"],
        hf["n_routed_experts"],
    )
    assert mla.expert_model_parallel_size == 2 and mla.moe_router_score_function == "sigmoid"


def test_a_layout_the_model_cannot_take_is_refused(tiny_models):
    with pytest.raises(BridgeError, match="num_query_groups=4 is not divisible by tp=8"):
        AutoBridge.from_pretrained(tiny_models["llama"]).transformer_config(Layout(tp=8))


def test_bad_sources_are_refused_in_one_line(tiny_models, tmp_path):
    with pytest.raises(BridgeError, match=r"^no/such/dir/here is neither a directory nor a Hub repo id$"):
        AutoBridge.from_pretrained("no/such/dir/here")
    unsupported = shutil.copytree(tiny_models["llama"], tmp_path / "gpt2")
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture 'GPT2LMHeadModel'"):
        AutoBridge.from_pretrained(unsupported)
    gelu = shutil.copytree(tiny_models["llama"], tmp_path / "gelu")
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="hidden_act='gelu' cannot be represented"):
        AutoBridge.from_pretrained(gelu)


def test_a_hub_id_that_cannot_be_fetched_is_one_line(tmp_path):
    code = "\n".join(
        [
            "import hf_mcore_bridge as h",
            "try:",
            "    h.AutoBridge.from_pretrained('someone/some-model')",
            "except h.BridgeError as e:",
            "    print(e)",
        ]
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    (line,) = _python(code, env=env)
    assert line.startswith("someone/some-model is not a directory and could not be fetched from the Hub: ")
