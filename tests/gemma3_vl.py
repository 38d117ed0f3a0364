"""A tiny `Gemma3ForConditionalGeneration` built by transformers (no download): the tiny Gemma 3 of
`Architecture.tiny` as its language model beside a one-layer SigLIP tower and the projector, every 1-D weight
randomised (Gemma's norms start at zero) so that a misplaced one shows."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_mcore_bridge.models.tiny_models import tiny_config

VISION = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 8,
    "patch_size": 2,
}
"""A one-layer SigLIP tower (transformers' `SiglipVisionConfig` fields)."""


def gemma3_vl(seed: int = 5) -> torch.nn.Module:
    """The tiny wrapper, in memory (fp32, eval mode)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_config("Gemma3ForCausalLM")
    del text["architectures"]  # as the class's text_config holds it
    config = Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=4,
        boi_token_index=207,
        eoi_token_index=208,
        image_token_index=209,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_gemma3_vl(directory: Path, seed: int = 5) -> Path:
    """The tiny wrapper saved by transformers (`language_model.model.`, `vision_tower.`, `multi_modal_projector.`)."""
    gemma3_vl(seed).save_pretrained(directory)
    return directory
