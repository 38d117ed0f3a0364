"""Conversion of vision-language checkpoints (`models.vision_language`): their language model converts as its
architecture; the rest goes through unchanged.

Import (`text_view`, `keep_carried`): the checkpoint is read as its language model (its `text_config`, its tensors
under the text architecture's names); the wrapper's own tensors are copied, bytes unchanged, into
`vision_language.CARRIED_FILE` among the converted checkpoint's HF assets (whose `config.json` is the wrapper's),
with the name layout the text tensors were stored under in its metadata. Export (`WrappedExport`): the text
tensors are written under that layout's names, the carried tensors' bytes copied from that file, and the config
is the wrapper's with the export's changes (dtype, quantization, MTP layers) made in its `text_config` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.byte_copy import Span
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint, TextView, data_offsets
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.registry import for_config, wrapper_for
from hf_mcore_bridge.models.vision_language import (
    CARRIED_FILE,
    LAYOUT_KEY,
    NameLayout,
    VisionLanguage,
    stored_name,
    text_name,
)


def text_view(config: dict[str, Any], names: Iterable[str]) -> TextView | None:
    """How to read a checkpoint of a vision-language class as its language model; None for any other."""
    wrapper = wrapper_for(config)
    if wrapper is None:
        return None
    text = wrapper.text_config(config)
    text.setdefault("architectures", [for_config(text).hf_name])  # transformers saves sub-configs without one
    layout = wrapper.layout_of(names)
    return TextView(
        text, lambda stored: text_name(layout, stored), wrapper.is_carried, {LAYOUT_KEY: json.dumps(layout)}
    )


def keep_carried(hf: HFCheckpoint, assets: Path) -> str | None:
    """Copy a wrapper checkpoint's own tensors into `assets / CARRIED_FILE`, bytes unchanged; the one-line notice
    of what was converted (None for a checkpoint of a text architecture)."""
    if hf.wrapper_config is None or hf.view is None:
        return None
    from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsStreamWriter

    plan = [(name, info.shape, info.dtype) for name, info in sorted(hf.carried.items())]
    writer = SafetensorsStreamWriter(assets / CARRIED_FILE, plan, metadata={"format": "pt", **hf.view.metadata})
    try:
        for name, _, _ in plan:
            writer.write(name, hf.read_carried(name))
    except BaseException:
        writer.abandon()
        raise
    writer.close()
    wrapper = hf.wrapper_config["architectures"][0]
    return (
        f"{wrapper}: its language model ({hf.architecture}) converted; its {len(plan)} other tensors (vision tower,"
        " projector) and its config kept unchanged for export"
    )


@dataclass(frozen=True)
class Carried:
    """One of the wrapper's own tensors, as kept: its shape, dtype and bytes in `CARRIED_FILE`."""

    name: str
    shape: tuple[int, ...]
    dtype: dtypes.DType
    span: Span


class WrappedExport:
    """How an export writes the complete vision-language class: names, the carried tensors, the config."""

    def __init__(self, wrapper: VisionLanguage, config: dict[str, Any], layout: NameLayout, carried: list[Carried]):
        self.wrapper, self.config, self.layout, self.carried = wrapper, config, layout, carried

    @classmethod
    def of(cls, config: dict[str, Any], assets: Path | None) -> WrappedExport | None:
        """The export of a checkpoint whose HF config is `config` (None where it is of a text architecture);
        refused where the carried tensors were not kept (`assets` lacks `CARRIED_FILE`)."""
        wrapper = wrapper_for(config)
        if wrapper is None:
            return None
        path = None if assets is None else assets / CARRIED_FILE
        if path is None or not path.is_file():
            raise CheckpointError(
                f"the HF config is of {wrapper.hf_name}, but the checkpoint's HF assets hold no {CARRIED_FILE} "
                "(its vision tower and projector, kept by `convert --to mcore`: copy it there from the converted "
                "checkpoint's hf_assets), or pass --hf-config with the language model's config to export that alone"
            )
        return cls(wrapper, config, *_read_carried(path))

    def name(self, text: str) -> str:
        """A text-model tensor's name in the exported checkpoint."""
        return stored_name(self.layout, text)

    def text_config(self) -> dict[str, Any]:
        return self.wrapper.text_config(self.config)

    def config_with(self, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """The wrapper's config with `edit` made to its text model's config (as stored: no field added)."""
        return {**self.config, self.wrapper.text_field: edit(dict(self.config[self.wrapper.text_field]))}


def _read_carried(path: Path) -> tuple[NameLayout, list[Carried]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            shapes = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (no __iter__)
            specs = {n: (tuple(s.get_shape()), dtypes.BY_SAFETENSORS[s.get_dtype()]) for n, s in shapes.items()}
    except (SafetensorError, OSError, KeyError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from None
    if LAYOUT_KEY not in metadata:
        raise CheckpointError(f"{path} does not say how the language model's tensors were named ({LAYOUT_KEY})")
    layout = tuple((str(a), str(b)) for a, b in json.loads(metadata[LAYOUT_KEY]))
    offsets = data_offsets(path)
    carried = []
    for name, (shape, dtype) in specs.items():
        size = dtype.itemsize
        for dim in shape:
            size *= dim
        carried.append(Carried(name, shape, dtype, Span(path, offsets[name], size)))
    return layout, carried
