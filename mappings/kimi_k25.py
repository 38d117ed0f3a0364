"""Kimi-K2.5 (`Kimi_K25ForConditionalGeneration`; published with remote code as `KimiK25ForConditionalGeneration`):
a DeepSeek-V3 language model (`text_config`, `model_type` `kimi_k2`, read as `deepseek_v3`) beside a vision tower
and its projector, which conversion keeps unchanged for export (`models.vision_language`).

As published, the language model's tensors are under `language_model.model.` and `language_model.lm_head.`, the
tower's under `vision_tower.` and the projector's under `mm_projector.`. transformers 5 saves the class in that
layout too, but its rule renaming the tower's `blocks` to `layers` also renames, in reverse, the language model's
layers to `language_model.model.blocks.{layer}` (and its projector's norm stays `model.mm_projector.pre_norm`);
both layouts, and transformers' in-memory one (`model.language_model.`), are read and written back as found.
"""

from __future__ import annotations

from hf_mcore_bridge.models.vision_language import FLAT, NESTED, VisionLanguage

TRANSFORMERS_SAVED = (("language_model.model.blocks.", "model.layers."), *NESTED)
"""transformers 5's `save_pretrained` of the class: the language model's layers written as `blocks`."""

WRAPPER = VisionLanguage(
    hf_name="Kimi_K25ForConditionalGeneration",
    model_type="kimi_k25",
    other_names=("KimiK25ForConditionalGeneration",),
    carried=("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."),
    layouts=(TRANSFORMERS_SAVED, NESTED, FLAT),
)
