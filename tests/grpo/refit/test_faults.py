"""The refit faults the gate is measured and tested against (`grpo.refit.faults`) do what they say, each checked
against tensors rearranged by hand here, and a fault that finds nothing to rewrite is an error, not a no-op."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.grpo.refit.faults import FAULTS, inject

CONFIG = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2}


def _stream() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(5, 8))]
    for layer in range(3):
        prefix = f"model.layers.{layer}."
        out += [
            (prefix + "self_attn.q_proj.weight", torch.randn(8, 8)),
            (prefix + "self_attn.k_proj.weight", torch.randn(4, 8)),
            (prefix + "self_attn.v_proj.weight", torch.randn(4, 8)),
        ]
        if layer == 0:
            out += [(prefix + f"mlp.{p}_proj.weight", torch.randn(6, 8)) for p in ("gate", "up", "down")]
        else:
            out += [
                (prefix + f"mlp.experts.{e}.{p}_proj.weight", torch.randn(6, 8))
                for e in range(3)
                for p in ("gate", "up", "down")
            ]
    return out


def _changed(kind: str, **kw: object) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    stream = _stream()
    return dict(stream), dict(inject(iter(stream), kind, CONFIG, **kw))


def test_each_fault_rewrites_exactly_its_tensors() -> None:
    before, after = _changed("qk")
    q, k = before["model.layers.1.self_attn.q_proj.weight"], before["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(after["model.layers.1.self_attn.q_proj.weight"], torch.cat([k, q[4:]]))
    assert torch.equal(after["model.layers.1.self_attn.k_proj.weight"], q[:4])

    before, after = _changed("q_heads")  # heads of 2 rows: rows 0-1 and 2-3 exchanged, both of KV group 0
    q = before["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(after["model.layers.1.self_attn.q_proj.weight"], q[[2, 3, 0, 1, 4, 5, 6, 7]])

    before, after = _changed("kv", layer=2)
    k, v = before["model.layers.2.self_attn.k_proj.weight"], before["model.layers.2.self_attn.v_proj.weight"]
    assert torch.equal(after["model.layers.2.self_attn.k_proj.weight"], v)
    assert torch.equal(after["model.layers.2.self_attn.v_proj.weight"], k)

    before, after = _changed("gate_up", layer=0)
    mlp = "model.layers.0.mlp."
    assert torch.equal(after[mlp + "gate_proj.weight"], before[mlp + "up_proj.weight"])
    assert torch.equal(after[mlp + "up_proj.weight"], before[mlp + "gate_proj.weight"])

    before, after = _changed("experts")  # the first layer with experts: layer 1
    for p in ("gate", "up", "down"):
        e0, e1 = (f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1))
        assert torch.equal(after[e0], before[e1]) and torch.equal(after[e1], before[e0])
    for kind, touched in {
        "qk": 2,
        "q_heads": 1,
        "kv": 2,
        "gate_up": 2,
        "experts": 6,
    }.items():
        before, after = _changed(kind, layer=0 if kind == "gate_up" else None)
        assert sorted(after) == sorted(before)
        differ = [n for n in before if not torch.equal(before[n], after[n])]
        assert len(differ) == touched, (kind, differ)


@pytest.mark.parametrize(("kind", "layer"), [("gate_up", 1), ("experts", 0), ("qk", 7)])
def test_a_fault_that_finds_nothing_is_an_error(kind: str, layer: int) -> None:
    with pytest.raises(ValueError, match=f"refit fault '{kind}' found no tensor to rewrite in layer {layer}"):
        list(inject(iter(_stream()), kind, CONFIG, layer=layer))


def test_unknown_fault_and_q_heads_without_groups_are_refused() -> None:
    assert set(FAULTS) == {"qk", "q_heads", "kv", "gate_up", "experts"}
    with pytest.raises(ValueError, match="unknown refit fault 'vq'"):
        list(inject(iter(_stream()), "vq", CONFIG))
    with pytest.raises(ValueError, match="at least two query heads per KV group"):
        list(inject(iter(_stream()), "q_heads", CONFIG | {"num_key_value_heads": 4}))
