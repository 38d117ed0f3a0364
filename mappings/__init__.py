"""Per-architecture mapping tables, looked up by the HF `architectures` entry from an explicit registry.

Adding an architecture: one file here declaring an `Architecture`, and one line in `REGISTRY`.
"""

from __future__ import annotations

from hf_mcore_bridge.convert.architecture import Architecture
from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.mappings import llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe

REGISTRY: dict[str, Architecture] = {
    arch.hf_name: arch
    for arch in (
        llama.ARCHITECTURE,
        mistral.ARCHITECTURE,
        qwen2.ARCHITECTURE,
        qwen3.ARCHITECTURE,
        mixtral.ARCHITECTURE,
        qwen3_moe.ARCHITECTURE,
        qwen2_moe.ARCHITECTURE,
    )
}


def supported() -> list[str]:
    """The HF `architectures` names that can be converted."""
    return sorted(REGISTRY)


def get_architecture(hf_name: str) -> Architecture:
    """The architecture registered for an HF `architectures` entry."""
    try:
        return REGISTRY[hf_name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {hf_name!r}; supported: {', '.join(supported())}"
        ) from None
