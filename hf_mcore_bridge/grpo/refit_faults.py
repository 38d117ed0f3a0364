"""Deliberate refit mistakes, for measuring and testing the checks that must catch them.

Each fault rewrites a refit's stream of `(hf_name, tensor)` the way a wrong mapping table would, in one decoder
layer, consistently on both sides of the transfer check (so only the engine-vs-trainer log-prob gate can see it):

- `qk`: the QKV split off by one block: q's first rows and k exchanged;
- `q_heads`: two query heads of one KV group exchanged (a head order mixed up within its group);
- `kv`: k and v exchanged;
- `gate_up`: the gated MLP's gate and up exchanged;
- `experts`: two routed experts' tensors exchanged (mixture-of-experts layers).

`scripts/measure_logprob_gate.py` measures the gate on each of them and on a correct refit, and the tests show
that each stops a run at step 1. A stale copy is not a stream rewrite (the engine keeps weights of an earlier
step); the transfer check's checksums catch it, as measured there too.

Assumes full HF tensors (a refit of `grpo.refit.hf_weights`, not a shard-local one) with HF's names and q/k/v rows
in head order (every architecture the engine runs, multi-latent attention aside).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

FAULTS = ("qk", "q_heads", "kv", "gate_up", "experts")
"""The stream faults, in the order the measurements report them."""

ATTENTION_FAULTS = ("qk", "q_heads", "kv")


def _pair(kind: str, layer: int) -> tuple[str, str]:
    """The two HF names a fault rewrites (prefixes for `experts`)."""
    attention = f"model.layers.{layer}.self_attn."
    mlp = f"model.layers.{layer}.mlp."
    return {
        "qk": (attention + "q_proj.weight", attention + "k_proj.weight"),
        "q_heads": (attention + "q_proj.weight", attention + "q_proj.weight"),
        "kv": (attention + "k_proj.weight", attention + "v_proj.weight"),
        "gate_up": (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
        "experts": (mlp + "experts.0.", mlp + "experts.1."),
    }[kind]


def head_dim(hf_config: Mapping[str, Any]) -> int:
    return int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])


def swap_query_heads(q: torch.Tensor, dim: int) -> torch.Tensor:
    """q's heads 0 and 1 exchanged (rows `[0, dim)` and `[dim, 2 dim)`): both of KV group 0 under grouped-query
    attention with at least two query heads a group."""
    order = torch.arange(q.shape[0])
    order[:dim], order[dim : 2 * dim] = torch.arange(dim, 2 * dim), torch.arange(dim)
    return q[order]


def inject(
    stream: Iterable[tuple[str, torch.Tensor]], kind: str, hf_config: Mapping[str, Any], layer: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` with fault `kind` (one of `FAULTS`) in decoder layer `layer`; every other tensor as it came."""
    if kind not in FAULTS:
        raise ValueError(f"unknown refit fault {kind!r}; known: {', '.join(FAULTS)}")
    first, second = _pair(kind, layer)
    if kind == "q_heads":
        groups = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
        if hf_config["num_attention_heads"] // groups < 2:
            raise ValueError("q_heads needs at least two query heads per KV group")
        for name, tensor in stream:
            yield name, swap_query_heads(tensor, head_dim(hf_config)) if name == first else tensor
        return
    if kind == "experts":
        for name, tensor in stream:
            if name.startswith(first):
                yield name.replace(first, second), tensor
            elif name.startswith(second):
                yield name.replace(second, first), tensor
            else:
                yield name, tensor
        return
    held: dict[str, torch.Tensor] = {}
    for name, tensor in stream:
        if name not in (first, second):
            yield name, tensor
            continue
        held[name] = tensor
        if len(held) < 2:
            continue
        a, b = held[first], held[second]
        if kind == "qk":  # q's first rows take k's place and k takes them: shapes kept
            rows = b.shape[0]
            yield first, torch.cat([b, a[rows:]])
            yield second, a[:rows].clone()
        else:
            yield first, b
            yield second, a
