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

Assumes full HF tensors (a refit of `bridge.export.export_hf_weights`, not a shard-local one) with HF's names and
q/k/v rows in head order (every architecture the engine runs, multi-latent attention aside).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping
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
    stream: Iterable[tuple[str, torch.Tensor]], kind: str, hf_config: Mapping[str, Any], layer: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` with fault `kind` (one of `FAULTS`) in decoder layer `layer` (None: layer 1, or for `experts` the
    first layer with routed experts); every other tensor as it came. Raises `ValueError` at the stream's end if
    the fault found nothing to rewrite (a fault that silently did nothing would make a check look good)."""
    if kind not in FAULTS:
        raise ValueError(f"unknown refit fault {kind!r}; known: {', '.join(FAULTS)}")
    if kind == "q_heads":
        groups = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
        if hf_config["num_attention_heads"] // groups < 2:
            raise ValueError("q_heads needs at least two query heads per KV group")
    rewritten = yield from _rewrite(stream, kind, hf_config, layer)
    if not rewritten:
        where = "any layer" if layer is None and kind == "experts" else f"layer {1 if layer is None else layer}"
        raise ValueError(f"refit fault {kind!r} found no tensor to rewrite in {where}")


def _rewrite(
    stream: Iterable[tuple[str, torch.Tensor]], kind: str, hf_config: Mapping[str, Any], layer: int | None
) -> Generator[tuple[str, torch.Tensor], None, int]:
    """The rewritten stream; returns how many tensors were rewritten."""
    if kind == "experts":
        return (yield from _swap_experts(stream, layer))
    first, second = _pair(kind, 1 if layer is None else layer)
    if kind == "q_heads":
        count = 0
        for name, tensor in stream:
            if name == first:
                tensor, count = swap_query_heads(tensor, head_dim(hf_config)), count + 1
            yield name, tensor
        return count
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
    return len(held) if len(held) == 2 else 0


def _swap_experts(
    stream: Iterable[tuple[str, torch.Tensor]], layer: int | None
) -> Generator[tuple[str, torch.Tensor], None, int]:
    """Experts 0 and 1 of `layer` (None: the first layer that has routed experts) exchanged, every tensor of each."""
    count = 0
    for name, tensor in stream:
        if layer is None and ".mlp.experts.0." in name:
            layer = int(name.split(".")[2])
        if layer is not None:
            zero, one = _pair("experts", layer)
            if name.startswith(zero):
                name, count = name.replace(zero, one), count + 1
            elif name.startswith(one):
                name, count = name.replace(one, zero), count + 1
        yield name, tensor
    return count
