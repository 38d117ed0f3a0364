"""Megatron-LM's legacy `torch` checkpoint format: one `model_optim_rng.pt` per model-parallel rank.

`<iter>/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` (the PP part only when PP > 1, EP only when EP > 1) holds
`args`, `checkpoint_version`, `iteration` and `model` (`model0`, `model1`, ... with virtual pipeline stages):
the rank's local tensor-parallel shards under the module's own state-dict names, with stage-local layer
numbers. Unlike `torch_dist` it is layout-specific: written exactly at one layout, read back by reassembling
the shards. Names depend on the layer spec: the local spec keeps `input_layernorm` / `pre_mlp_layernorm` where
Transformer Engine fuses the norms into `linear_qkv` / `linear_fc1` (a Gated DeltaNet layer's input norm into
`in_proj`). A tensor megatron-core saves in parts in a distributed checkpoint (`Parallel.COLUMN_PARTS`: Gated
DeltaNet's `in_proj` and `conv1d`) is one tensor here, as its module holds it: each rank's rows of each part, part
after part (`[q_r; k_r; v_r; z_r; b_r; a_r]`), the parts' rows given by the model's dimensions
(`placement.part_rows`).

Files are written one rank at a time and read with `torch.load(weights_only=True, mmap=True)` one tensor at a
time, so memory holds one rank's shards when writing and one layer tensor when reading.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.megatron_dirs import CHECKPOINT_VERSION, safe_torch_load
from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.convert.layout import Layout, stage_layer_counts
from hf_mcore_bridge.convert.model_plan import Placed
from hf_mcore_bridge.convert.placement import LOCAL_MLA_SPEC_KEYS, dcp_key, extra_state_module, part_rows
from hf_mcore_bridge.errors import CheckpointError, LayoutError
from hf_mcore_bridge.models.mapping_types import Dims, Entry, is_layered
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.tensor_ops import global_shape, merge_rank_shards, rank_shard

FILE_NAME = "model_optim_rng.pt"
LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""Transformer-Engine names (as the distributed checkpoint stores them) -> the local spec's module names (with
multi-latent attention: `LOCAL_MLA_SPEC_KEYS`, its input norm having one name in both). A Gated DeltaNet layer's
input norm is fused into its `in_proj` where a full-attention layer's is fused into `linear_qkv`: read back, the
local `input_layernorm.weight` is the one of whichever projection its layer holds."""
GATED_DELTA_NET_IN_PROJ = "self_attention.in_proj.weight"
"""The tensor that marks a Gated DeltaNet layer (its input norm fused into `in_proj` under TE's names)."""
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def rank_dirname(tp_rank: int, pp_rank: int, ep_rank: int, layout: Layout) -> str:
    """`mp_rank_TT[_PPP][_EEE]` as Megatron-LM names it."""
    name = f"mp_rank_{tp_rank:02d}"
    if layout.pp > 1:
        name += f"_{pp_rank:03d}"
    if layout.ep > 1:
        name += f"_{ep_rank:03d}"
    return name


@dataclass(frozen=True)
class ModelChunk:
    """The decoder layers one (pipeline rank, virtual stage) holds."""

    pp_rank: int
    virtual: int
    first_layer: int
    num_layers: int

    @property
    def state_key(self) -> str:
        return "model" if self.virtual < 0 else f"model{self.virtual}"


def model_chunks(layout: Layout, num_layers: int) -> list[ModelChunk]:
    """Every model chunk in global layer order (virtual stage major, pipeline rank minor)."""
    if layout.vpp:
        per_chunk = num_layers // (layout.pp * layout.vpp)
        return [
            ModelChunk(r, v, (v * layout.pp + r) * per_chunk, per_chunk)
            for v in range(layout.vpp)
            for r in range(layout.pp)
        ]
    chunks, first = [], 0
    for r, count in enumerate(stage_layer_counts(layout, num_layers)):
        chunks.append(ModelChunk(r, -1, first, count))
        first += count
    return chunks


def local_name(
    mcore_template: str, local_layer: int | None, spec: str, local_expert: int | None = None, mla: bool = False
) -> str:
    """The module state-dict name of a table entry on its stage (layer and expert numbered locally)."""
    name = fill(mcore_template, local_layer, local_expert)
    if spec == "local":
        for te_name, local in (LOCAL_MLA_SPEC_KEYS if mla else LOCAL_SPEC_NAMES).items():
            name = name.replace(te_name, local)
    return name


def check_legacy_layout(layout: Layout, num_experts: int | None, spec: str) -> None:
    """Refuse what the legacy format is not written for (called before any output exists): a mixture-of-experts
    model needs expert TP equal to TP and the local spec."""
    if num_experts and layout.expert_tp != layout.tp:
        raise LayoutError("the legacy format is written with expert tensor parallelism equal to tp; use torch_dist")
    if num_experts and spec != "local":
        raise LayoutError(
            "legacy MoE checkpoints are written for the local spec (--spec local); TE uses grouped experts"
        )


def write_legacy(
    checkpoint_dir: Path,
    placed: list[Placed],
    full_tensor: Callable[[Placed], torch.Tensor],
    *,
    layout: Layout,
    num_layers: int,
    num_experts: int | None,
    tied: bool,
    spec: str,
    args: Any,
    dims: Dims,
    on_write: Callable[[], None] = lambda: None,
    mla: bool = False,
) -> int:
    """Write one file per (TP, PP, EP) rank; returns the number of files. `full_tensor` gives a placed entry's tensor.

    Experts are numbered locally on their expert-parallel rank and sharded like the rest over TP (expert tensor
    parallelism other than TP is not written in this format). `dims` gives the rows of the parts of a tensor
    sharded part by part (`Parallel.COLUMN_PARTS`).
    """
    check_legacy_layout(layout, num_experts, spec)
    chunks = model_chunks(layout, num_layers)
    per_rank = (num_experts or 0) // layout.ep
    files = 0
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            for ep_rank in range(layout.ep):
                state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
                experts = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
                for chunk in (c for c in chunks if c.pp_rank == pp_rank):
                    state[chunk.state_key] = _chunk_state(
                        chunk, chunks, placed, full_tensor, layout, tp_rank, experts, tied, (spec, mla), dims
                    )
                directory = checkpoint_dir / rank_dirname(tp_rank, pp_rank, ep_rank, layout)
                directory.mkdir(parents=True)
                # a file object we close ourselves: torch's own file writer stays open (holding the space of a
                # partial file) until garbage collection when a write fails
                with (directory / FILE_NAME).open("wb") as handle:
                    torch.save(state, handle)
                files += 1
                on_write()
    return files


def _chunk_state(chunk, chunks, placed, full_tensor, layout, tp_rank, experts, tied, naming, dims) -> dict[str, Any]:
    first, last = chunk == chunks[0], chunk == chunks[-1]
    spec, mla = naming
    state: dict[str, Any] = {}
    for p in placed:
        template = p.template.mcore
        if is_layered(template):
            if not chunk.first_layer <= p.layer < chunk.first_layer + chunk.num_layers:
                continue
            local_layer = p.layer - chunk.first_layer
        elif (template.startswith("embedding") and not first) or (not template.startswith("embedding") and not last):
            continue
        else:
            local_layer = None
        local_expert = None
        if p.expert is not None:
            if p.expert not in experts:
                continue
            local_expert = p.expert - experts.start
        name = local_name(template, local_layer, spec, local_expert, mla)
        parts = part_rows(template, dims) if p.entry.parallel is Parallel.COLUMN_PARTS else ()
        state[name] = rank_shard(full_tensor(p), p.entry.parallel, layout.tp, tp_rank, parts)
        module = extra_state_module(p.template)
        if module is not None:
            state[local_name(module, local_layer, spec, local_expert, mla) + "._extra_state"] = None
    if last:
        state["output_layer._extra_state"] = None
        if tied and not first:  # the last stage holds its own copy of the shared embedding
            embedding = next(p for p in placed if p.template.mcore.startswith("embedding"))
            state["output_layer.weight"] = rank_shard(full_tensor(embedding), Parallel.VOCAB, layout.tp, tp_rank)
    return state


_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_PER_LAYER = re.compile(r"^decoder\.layers\.\d+\.")


class LegacySource:
    """Model tensors of a legacy checkpoint directory, reassembled from the per-rank files on demand.

    Keys are given in the distributed-checkpoint form with Transformer-Engine names, whatever spec the files were
    written for: stacked over layers (addressed by (layer, expert) leading indices) where every decoder layer holds
    the same tensors, else per layer (`decoder.layers.{i}.*`, addressed by the expert index), as megatron-core saves
    a heterogeneous stack (dense and MoE layers mixed, Gated DeltaNet and full attention). A tensor sharded part by
    part (`Parallel.COLUMN_PARTS`) is served whole, its parts one after another (as `DCPSource` serves it), which
    needs the model's `dims` (their linear-attention fields) over more than one tensor-parallel rank.
    """

    def __init__(self, checkpoint_dir: Path, table: tuple[Entry, ...], *, tied: bool, dims: Dims | None = None):
        self.directory = checkpoint_dir
        self._tied = tied
        self._dims = dims
        self._files: dict[tuple[int, int, int], Path] = {}
        found = {}
        for path in sorted(checkpoint_dir.glob("mp_rank_*")):
            match = _RANK_DIR.fullmatch(path.name)
            if match is None or not (path / FILE_NAME).exists():
                raise CheckpointError(f"{path} is not a legacy rank directory with {FILE_NAME}")
            found[path] = [int(g) if g is not None else None for g in match.groups()]
        if not found:
            raise CheckpointError(f"{checkpoint_dir} holds no mp_rank_* directories")
        # `mp_rank_TT_NNN` names a pipeline rank when PP > 1 and an expert rank otherwise: the args say which
        args = safe_torch_load(next(iter(found)) / FILE_NAME, mmap=True).get("args")
        pipeline = getattr(args, "pipeline_model_parallel_size", 1) > 1 if args is not None else True
        for path, (tp_rank, second, third) in found.items():
            pp_rank, ep_rank = (second or 0, third or 0) if pipeline else (0, second or 0)
            self._files[(tp_rank, pp_rank, ep_rank)] = path / FILE_NAME
        self.tp, self.pp, self.ep = self._sizes(args)
        self._check_all_ranks_present()
        self._parallel = {dcp_key(e.mcore): e.parallel for e in table}
        self._index: dict[str, dict[tuple[int, ...], tuple[int, int, str, str]]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, dtypes.DType] = {}
        self._check_rank_files()
        self._scan()

    def _sizes(self, args: Any) -> tuple[int, int, int]:
        """TP, PP and EP: the args' sizes (the ranks the checkpoint was saved at), or more where more rank
        directories are found; without args, what the directories found span."""
        found = [1 + max(rank[i] for rank in self._files) for i in range(3)]
        keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
        saved = [getattr(args, key, 1) if args is not None else 1 for key in keys]
        tp, pp, ep = (max(f, s if isinstance(s, int) else 1) for f, s in zip(found, saved, strict=True))
        return tp, pp, ep

    def _check_all_ranks_present(self) -> None:
        """Refuse, naming the directory, a checkpoint missing the files of one of its ranks."""
        layout = Layout(tp=self.tp, pp=self.pp, ep=self.ep)
        ranks = itertools.product(range(self.tp), range(self.pp), range(self.ep))
        missing = [self.directory / rank_dirname(*rank, layout) for rank in ranks if rank not in self._files]
        if missing:
            more = f" (and {len(missing) - 1} more rank directories)" if len(missing) > 1 else ""
            raise CheckpointError(
                f"legacy rank directory {missing[0]} is missing{more}: a checkpoint saved at {layout} has one per"
                f" rank, each holding {FILE_NAME}"
            )

    def _check_rank_files(self) -> None:
        """Every rank file readable (a truncated file is refused here, naming it) and holding the same tensors,
        of the same shard shapes, as its tensor-parallel rank 0."""
        references: dict[tuple[int, int], dict[str, Any]] = {}
        for (tp_rank, pp_rank, ep_rank), path in sorted(self._files.items()):
            state = self._load(tp_rank, pp_rank, ep_rank)
            if tp_rank == 0:
                references[(pp_rank, ep_rank)] = state
                continue
            reference = references[(pp_rank, ep_rank)]
            for key, module_state in reference.items():
                if not re.fullmatch(r"model\d*", key):
                    continue
                ours = state.get(key)
                if not isinstance(ours, dict):
                    raise CheckpointError(f"{path} lacks {key}, which {self._files[(0, pp_rank, ep_rank)]} holds")
                for name, value in module_state.items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    other = ours.get(name)
                    if not isinstance(other, torch.Tensor) or other.shape != value.shape:
                        found = "nothing" if other is None else f"shape {tuple(getattr(other, 'shape', ()))}"
                        raise CheckpointError(
                            f"{path} holds {found} for {name}, where tensor-parallel rank 0 holds shape "
                            f"{tuple(value.shape)}"
                        )

    def location(self, key: str) -> str:
        """The file a tensor's (first) shard is read from."""
        by_leading = self._index.get(key)
        if not by_leading:
            return str(self.directory)
        pp_rank, ep_rank, _, _ = next(iter(by_leading.values()))
        return str(self._files[(0, pp_rank, ep_rank)])

    def _load(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, Any]:
        return safe_torch_load(self._files[(tp_rank, pp_rank, ep_rank)], mmap=True)

    def _chunks(self) -> list[tuple[int, int, str]]:
        chunks = []
        for pp_rank in range(self.pp):
            state = self._load(0, pp_rank)
            keys = [k for k in state if re.fullmatch(r"model\d*", k)]
            if not keys:
                raise CheckpointError(f"{self._files[(0, pp_rank, 0)]} holds no model state")
            chunks += [(int(k[5:] or -1), pp_rank, k) for k in keys]
        return sorted(chunks)  # global layer order: virtual stage major, pipeline rank minor

    def _scan(self) -> None:
        first_layer = 0
        max_layers = 0
        for _, pp_rank, state_key in self._chunks():
            layers: set[int] = set()
            for ep_rank in range(self.ep):
                module_state = self._load(0, pp_rank, ep_rank)[state_key]
                moe_layers = {m.group(1) for n in module_state if (m := _LAYER_KEY.fullmatch(n)) and "router" in n}
                linear_layers = {
                    m.group(1)
                    for n in module_state
                    if (m := _LAYER_KEY.fullmatch(n)) and m.group(2) == GATED_DELTA_NET_IN_PROJ
                }
                for name, value in module_state.items():
                    if name.endswith("._extra_state") or not isinstance(value, torch.Tensor):
                        continue
                    located = self._locate(
                        name, first_layer, ep_rank, len(self._local_experts(module_state)), (moe_layers, linear_layers)
                    )
                    if located is None or (ep_rank and located[1] == ()):
                        continue
                    key, leading, local_layer = located
                    if local_layer is not None:
                        layers.add(local_layer)
                    self._index.setdefault(key, {})[leading] = (pp_rank, ep_rank, state_key, name)
                    self._dtypes.setdefault(key, dtypes.of(value.dtype))
                    self._shapes.setdefault(key, global_shape(tuple(value.shape), self._style(key), self.tp))
            first_layer += len(layers)
            max_layers = first_layer
        self.num_layers = max_layers
        self.stacked = self._homogeneous()
        """Whether every decoder layer holds the same tensors (else the keys are per layer)."""
        if not self.stacked:
            self._per_layer_keys()
        for key, by_leading in self._index.items():
            leading_shape = self._leading_shape(by_leading)
            self._shapes[key] = (*leading_shape, *self._shapes[key])

    def _layered(self) -> dict[str, set[int]]:
        """Stacked key -> the decoder layers holding it (keys of decoder layers only)."""
        return {
            key: {leading[0] for leading in by_leading}
            for key, by_leading in self._index.items()
            if key.startswith("decoder.layers.") and next(iter(by_leading))
        }

    def _homogeneous(self) -> bool:
        everywhere = set(range(self.num_layers))
        return all(layers == everywhere for layers in self._layered().values())

    def _per_layer_keys(self) -> None:
        """Re-key every decoder-layer tensor as `decoder.layers.{i}.<name>`, addressed by its expert index."""
        for key in self._layered():
            by_leading = self._index.pop(key)
            shape, dtype = self._shapes.pop(key), self._dtypes.pop(key)
            for leading, where in by_leading.items():
                own = key.replace("decoder.layers.", f"decoder.layers.{leading[0]}.", 1)
                self._index.setdefault(own, {})[leading[1:]] = where
                self._shapes[own], self._dtypes[own] = shape, dtype

    @staticmethod
    def _local_experts(module_state: dict[str, Any]) -> set[str]:
        return {m.group(1) for n in module_state if (m := _LOCAL_EXPERT.search(n))}

    def _leading_shape(self, by_leading: dict[tuple[int, ...], Any]) -> tuple[int, ...]:
        some = next(iter(by_leading))
        if not some:
            return ()
        if not self.stacked:  # per-layer keys: only experts lead
            return (1 + max(index[0] for index in by_leading),)
        shape = [self.num_layers]
        if len(some) == 2:
            shape.append(1 + max(index[1] for index in by_leading))
        return tuple(shape)

    def _locate(self, name, first_layer, ep_rank, local_experts, kinds):
        """(stacked key, leading indices, local layer) of a state-dict name; None for a tied output copy. `kinds`:
        the local layers (as named) that hold routed experts, and those that are Gated DeltaNet layers."""
        moe_layers, linear_layers = kinds
        match = _LAYER_KEY.fullmatch(name)
        if match is None:
            if name == "output_layer.weight" and self._tied:
                return None  # a tied model's last-stage copy of the embedding
            return name, (), None
        local_layer, suffix = int(match.group(1)), match.group(2)
        leading: tuple[int, ...] = (first_layer + local_layer,)
        expert = _LOCAL_EXPERT.fullmatch(suffix)
        if expert is not None:
            leading += (ep_rank * local_experts + int(expert.group(1)),)
            suffix = f"mlp.experts.experts.{expert.group(2)}"
        elif ep_rank:
            return None  # non-expert tensors are the same on every expert-parallel rank
        if not (suffix == "pre_mlp_layernorm.weight" and match.group(1) in moe_layers):
            suffix = self._te_name(suffix, linear=match.group(1) in linear_layers)
        return f"decoder.layers.{suffix}", leading, local_layer

    def _te_name(self, suffix: str, *, linear: bool = False) -> str:
        """A (dense-layer) module name as the table (Transformer Engine's names) has it: a local-spec name is
        renamed where the table holds the renamed key (multi-latent attention keeps `input_layernorm`, which has no
        fused name in its table); without a table, as the plain local spec names it. The input norm of a Gated
        DeltaNet layer (`linear`) is renamed to its `in_proj`'s, any other layer's to `linear_qkv`'s."""
        fused_into = "self_attention.in_proj." if linear else "self_attention.linear_qkv."
        names = [
            (te_name, local)
            for te_name, local in LOCAL_SPEC_NAMES.items()
            if local != "input_layernorm.weight" or te_name.startswith(fused_into)
        ]
        if not self._parallel:
            for te_name, local in names:
                suffix = suffix.replace(local, te_name)
            return suffix
        for te_name, local in (*names, *LOCAL_MLA_SPEC_KEYS.items()):
            renamed = suffix.replace(local, te_name)
            if renamed != suffix and f"decoder.layers.{renamed}" in self._parallel:
                return renamed
        return suffix

    def keys(self) -> set[str]:
        return set(self._index)

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            raise CheckpointError(f"tensor {key} is missing from {self.directory}")
        return self._shapes[key]

    def dtype(self, key: str) -> dtypes.DType:
        return self._dtypes[key]

    def read(self, key: str, leading: tuple[int, ...]) -> torch.Tensor:
        location = self._index.get(key, {}).get(tuple(leading))
        if location is None:
            raise CheckpointError(f"tensor {key} at {leading} is missing from {self.directory}")
        pp_rank, ep_rank, state_key, name = location
        shards = [self._load(t, pp_rank, ep_rank)[state_key][name] for t in range(self.tp)]
        style = self._style(key)
        parts: tuple[int, ...] = ()
        if style is Parallel.COLUMN_PARTS and self.tp > 1:
            if self._dims is None:
                raise CheckpointError(f"{key} is sharded part by part: reading it needs the model's dimensions")
            parts = part_rows(key, self._dims)
        try:
            return merge_rank_shards(shards, style, parts)
        except ValueError as error:
            raise CheckpointError(f"{self._files[(0, pp_rank, ep_rank)]}: {name}: {error}") from None

    def _style(self, key: str) -> Parallel:
        return self._parallel.get(_PER_LAYER.sub("decoder.layers.", key, count=1), Parallel.REPLICATED)
