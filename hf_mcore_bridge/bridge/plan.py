"""Which tensor of the mapping table each local tensor of a live megatron-core model holds, on this rank.

A model is a list of `GPTModel` chunks (one per virtual pipeline stage; a single chunk without VPP), each possibly
wrapped (megatron-core's `DistributedDataParallel`, `Float16Module`: anything with a `.module`). Every local
parameter and persistent buffer is named in the table's terms by megatron-core's own key map and its global layer
number (`parallel.table_names`), so the layer specs' naming differences are handled where megatron-core states
them; where a spec keeps a norm under its module name (megatron-core's local spec with multi-latent attention, a
MoE layer's pre-MLP norm) the table entry is looked up under the other spec's name too (`megatron.model.
SPEC_NAME_PAIRS`). A routed expert of global index `g` lives on expert-parallel rank `g // (experts / EP)` as
local expert `g % (experts / EP)`, megatron-core's rule.

A tensor no entry covers is
reported (`Plan.uncovered`), and so is an entry of a layer this rank holds that no tensor holds (`Plan.missing`: a
model built otherwise than its checkpoint, e.g. without its q/k norms); the output layer of a model with tied
embeddings on the last pipeline stage holds a copy of the word embeddings (`Plan.tied`). Multi-token-prediction
layers are not matched (models built here leave them out).

Assumes megatron-core's `parallel_state` is initialised for the layout the chunks were built with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.bridge.parallel import model_tensors, table_names
from hf_mcore_bridge.checkpoint.names import EXPERT
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.model_plan import Placed, placed_entries
from hf_mcore_bridge.errors import BridgeError, LayoutError
from hf_mcore_bridge.models.mapping_types import LayerKind
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

EMBEDDING = "embedding.word_embeddings.weight"
TIED_OUTPUT = "output_layer.weight"


@dataclass(frozen=True)
class Ranks:
    """This rank's place in megatron-core's parallel groups (sizes and indices)."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int
    vpp: int | None
    cp: int

    def split(self, expert: bool) -> tuple[int, int]:
        """(size, rank) of the tensor-parallel split of a tensor: expert TP for a routed expert's, else TP."""
        return (self.etp, self.etp_rank) if expert else (self.tp, self.tp_rank)

    @property
    def layout(self) -> Layout:
        """The layout these groups were initialised for (even pipeline stages; expert TP None where it is TP)."""
        etp = None if self.etp == self.tp else self.etp
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep, etp=etp)


def parallel_ranks() -> Ranks:
    """This rank's groups, from megatron-core's `parallel_state` (which must be initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise BridgeError(
            "megatron-core's parallel_state is not initialised: call torch.distributed.init_process_group and "
            "megatron.core.parallel_state.initialize_model_parallel(...) first"
        )
    return Ranks(
        tp=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
    )


def check_layout(layout: Layout, ranks: Ranks) -> None:
    """Refuse a layout other than the one `parallel_state` was initialised for (one line naming both)."""
    given = (layout.tp, layout.pp, layout.vpp or None, layout.cp, layout.ep, layout.expert_tp)
    held = (ranks.tp, ranks.pp, ranks.vpp or None, ranks.cp, ranks.ep, ranks.etp)
    if given != held:
        raise LayoutError(f"layout {layout} differs from the one parallel_state was initialised for: {ranks.layout}")


def bare(model: Any) -> torch.nn.Module:
    """The `GPTModel` inside its wrappers (DDP, Float16Module: anything holding it as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def as_chunks(models: Any) -> list[Any]:
    """A model or a sequence of virtual-pipeline chunks, as a list (wrappers kept)."""
    return list(models) if isinstance(models, Sequence) else [models]


@dataclass(frozen=True)
class Held:
    """A table entry this rank holds (all of it, or its tensor-parallel part)."""

    placed: Placed
    """The entry at its global layer (and global expert)."""
    tensor: torch.Tensor
    """The local parameter or persistent buffer."""
    name: str
    """Its local name, prefixed with its chunk's index where there are several (`1:decoder.layers.0...`)."""

    @property
    def parallel(self) -> Parallel:
        return self.placed.entry.parallel

    @property
    def expert(self) -> bool:
        return self.placed.expert is not None


@dataclass(frozen=True)
class Plan:
    """What this rank holds of the model, in table order."""

    held: tuple[Held, ...]
    tied: tuple[tuple[str, torch.Tensor], ...]
    """The last stage's output layer where the embeddings are tied (a copy of the word embeddings)."""
    uncovered: tuple[str, ...]
    """Local tensors no table entry covers."""
    missing: tuple[str, ...]
    """Table entries of the decoder layers (and routed experts) this rank holds that no local tensor holds."""
    padded_vocab: int | None
    """The padded vocabulary of the vocabulary-parallel tensors this rank holds, None without any."""

    def problem(self, architecture: str) -> str | None:
        """One line for a model that does not match its table (`uncovered` or `missing` tensors), else None."""
        if self.uncovered:
            return (
                f"{len(self.uncovered)} tensor(s) of the model have no HF tensor in the {architecture} table, "
                f"e.g. {self.uncovered[0]}"
            )
        if self.missing:
            return (
                f"the model lacks {len(self.missing)} tensor(s) the {architecture} table has at its layers, e.g. "
                f"{self.missing[0]} (built otherwise than its config says?)"
            )
        return None


def spec_names(template: str) -> list[str]:
    """A table name and its names under the other layer spec (`SPEC_NAME_PAIRS`)."""
    from hf_mcore_bridge.megatron.model import SPEC_NAME_PAIRS

    names = [template]
    for first, second in SPEC_NAME_PAIRS:
        for old, new in ((first, second), (second, first)):
            if old in template:
                names.append(template.replace(old, new))
    return list(dict.fromkeys(names))


def _local_index(chunks: list[torch.nn.Module]) -> tuple[dict[tuple[str, int | None], str], dict[str, Any]]:
    """(table name, global layer) -> local name, and local name -> tensor, over every chunk."""
    by_table: dict[tuple[str, int | None], str] = {}
    tensors: dict[str, Any] = {}
    for index, chunk in enumerate(chunks):
        prefix = f"{index}:" if len(chunks) > 1 else ""
        local = model_tensors(chunk)
        for name, key in table_names(chunk).items():
            by_table[key] = prefix + name
            tensors[prefix + name] = local[name]
    return by_table, tensors


def build_plan(models: Any, model_cfg: ModelSpec, ranks: Ranks) -> Plan:
    """This rank's part of the model (see the module docstring); `models` as `as_chunks` takes them."""
    chunks = [bare(m) for m in as_chunks(models)]
    by_table, tensors = _local_index(chunks)
    per_rank = model_cfg.moe.num_experts // ranks.ep if model_cfg.moe else 0
    layers = {layer for _, layer in by_table if layer is not None}
    held: list[Held] = []
    missing: list[str] = []
    claimed: set[str] = set()
    for placed in placed_entries(model_cfg):
        template, local_expert = placed.template.mcore, None
        if placed.expert is not None:
            owner, local_expert = divmod(placed.expert, per_rank)
            if owner != ranks.ep_rank:
                continue
        found = _find(by_table, template, placed.mcore_index, local_expert)
        if found is None:  # another pipeline stage holds it, unless it is of a layer held here
            if placed.layer in layers and placed.template.layers is not LayerKind.MTP:
                missing.append(placed.mcore_name)
            continue
        claimed.add(found)
        held.append(Held(placed, tensors[found], found))
    tied = tuple(
        (name, tensor)
        for name, tensor in tensors.items()
        if model_cfg.tie_word_embeddings and name.split(":")[-1] == TIED_OUTPUT and name not in claimed
    )
    claimed |= {name for name, _ in tied}
    uncovered = tuple(name for name in tensors if name not in claimed)
    return Plan(tuple(held), tied, uncovered, tuple(missing), _padded_vocab(held, tied, ranks))


def _find(
    by_table: dict[tuple[str, int | None], str], template: str, layer: int | None, local_expert: int | None
) -> str | None:
    for name in spec_names(template):
        if local_expert is not None:
            name = name.replace(EXPERT, str(local_expert))
        found = by_table.get((name, layer))
        if found is not None:
            return found
    return None


def _padded_vocab(held: Iterable[Held], tied: Iterable[tuple[str, torch.Tensor]], ranks: Ranks) -> int | None:
    """The padded vocabulary: rows of a vocabulary-parallel tensor (the tied output layer's too) times TP."""
    vocab = [item.tensor for item in held if item.parallel is Parallel.VOCAB] + [tensor for _, tensor in tied]
    return vocab[0].shape[0] * ranks.tp if vocab else None
