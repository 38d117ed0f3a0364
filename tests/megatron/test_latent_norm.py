"""Multi-latent attention's latent norms at transformers' epsilon in megatron-core's layer specs (`latent_norm`).

The modules are built as megatron-core's `MLASelfAttention` builds them (`build_module` with its arguments,
`eps=config.layernorm_epsilon`) from megatron-core's own local spec, the project's sequence-parallel norms, and the
Transformer Engine layout (norms fused into the up-projections: a stand-in that reads `config.layernorm_epsilon`
when built as megatron-core's `TELayerNormColumnParallelLinear` does, Transformer Engine being absent here). Their
outputs are checked against an RMSNorm written here. That whole models compute it: `test_parity`'s TP2 world (a
GLM-4.7-Flash whose latents make the epsilon matter) and `test_moe`'s worlds.
"""

from __future__ import annotations

import torch

from hf_mcore_bridge.megatron.latent_norm import use_latent_norm_eps
from hf_mcore_bridge.megatron.sequence_parallel_norm import SequenceParallelRMSNorm, use_sequence_parallel_norms

RMS_NORM_EPS, LATENT_EPS = 1e-5, 1e-6
LATENT_RANKS = {"q_layernorm": 32, "kv_layernorm": 24}


def _config(**changes: object):
    from megatron.core.transformer import TransformerConfig

    fields = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "normalization": "RMSNorm"}
    return TransformerConfig(**fields, layernorm_epsilon=RMS_NORM_EPS, use_cpu_initialization=True, **changes)


def _mla_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm")


def _build_norm(attention, name: str, config) -> torch.nn.Module:
    """As `MLASelfAttention.__init__` builds its latent norms."""
    from megatron.core.transformer.spec_utils import build_module

    return build_module(
        getattr(attention, name), hidden_size=LATENT_RANKS[name], config=config, eps=config.layernorm_epsilon
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _check_norm(norm: torch.nn.Module, width: int) -> None:
    """`norm` computes an RMSNorm at the latent epsilon, on latents small enough that the epsilon matters."""
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(1)))
    x = 1e-3 * torch.randn(3, width, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = norm(x)
        expected, at_rms_norm_eps = _rms_norm(x, norm.weight, LATENT_EPS), _rms_norm(x, norm.weight, RMS_NORM_EPS)
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-7)
    assert (out - at_rms_norm_eps).abs().max() > 0.1  # the two epsilons are far apart on these latents


def test_local_spec_latent_norms_compute_at_the_latent_epsilon():
    config, layer = _config(), _mla_layer()
    attention = layer.submodules.self_attention.submodules
    own = {name: _build_norm(attention, name, config) for name in LATENT_RANKS}  # megatron-core's spec as it is
    assert {norm.eps for norm in own.values()} == {RMS_NORM_EPS}
    use_latent_norm_eps(layer, LATENT_EPS)
    for name, width in LATENT_RANKS.items():
        norm = _build_norm(attention, name, config)
        assert type(norm) is type(own[name]) and norm.eps == LATENT_EPS
        assert norm.state_dict().keys() == own[name].state_dict().keys()  # checkpoints unchanged
        _check_norm(norm, width)
    assert config.layernorm_epsilon == RMS_NORM_EPS  # the model's other norms keep rms_norm_eps


def test_sequence_parallel_latent_norms_keep_their_class_and_mark_and_layers_sharing_a_spec_wrap_once():
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = _mla_layer()
    block = TransformerBlockSubmodules(layer_specs=[layer, layer])  # as megatron-core repeats one layer's spec
    use_sequence_parallel_norms(block)
    attention = layer.submodules.self_attention.submodules
    q_class = attention.q_layernorm
    use_latent_norm_eps(block, LATENT_EPS)
    assert attention.q_layernorm.params["base"] is q_class  # wrapped once, not a wrapper of a wrapper
    config = _config(sequence_parallel=True, tensor_model_parallel_size=2)
    for name, width in LATENT_RANKS.items():
        norm = _build_norm(attention, name, config)
        assert type(norm) is SequenceParallelRMSNorm and norm.eps == LATENT_EPS
        assert norm.weight.sequence_parallel is True  # sequence-sharded latents: summed over TP
        _check_norm(norm, width)
    assert q_class is SequenceParallelRMSNorm


class _FusedNormLinear(torch.nn.Module):
    """Stands in for megatron-core's `TELayerNormColumnParallelLinear`: takes its norm's epsilon from
    `config.layernorm_epsilon` when built and keeps the config."""

    def __init__(self, input_size: int, output_size: int, *, config, **unused: object) -> None:
        super().__init__()
        self.config, self.eps = config, config.layernorm_epsilon
        self.weight = torch.nn.Parameter(torch.ones(input_size))  # the fused norm's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def test_norms_fused_into_the_up_projections_are_built_at_the_latent_epsilon_with_the_models_config():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import build_module

    layer = _mla_layer()
    attention = layer.submodules.self_attention.submodules
    attention.q_layernorm = attention.kv_layernorm = IdentityOp  # Transformer Engine's MLA spec
    attention.linear_q_up_proj = attention.linear_kv_up_proj = _FusedNormLinear
    use_latent_norm_eps(layer, LATENT_EPS)
    assert attention.q_layernorm is IdentityOp and attention.kv_layernorm is IdentityOp
    config = _config()
    for name, width in (("linear_q_up_proj", 32), ("linear_kv_up_proj", 24)):
        module = build_module(getattr(attention, name), width, 96, config=config, init_method=None, bias=False)
        assert type(module) is _FusedNormLinear and module.eps == LATENT_EPS
        assert module.config is config and config.layernorm_epsilon == RMS_NORM_EPS
        _check_norm(module, width)


def test_layers_without_multi_latent_attention_are_left_alone():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")  # Qwen3's q/k norms
    use_latent_norm_eps(layer, LATENT_EPS)
    attention = layer.submodules.self_attention.submodules
    assert attention.q_layernorm is WrappedTorchNorm and attention.k_layernorm is WrappedTorchNorm
