"""hf-mcore-bridge: HuggingFace <-> Megatron-Core weight mappers, an embedded inference engine and a GRPO trainer.

The public entry points are re-exported lazily so that `import hf_mcore_bridge` stays cheap (no torch or
megatron-core import until a function that needs it runs):

- the bridge API (`bridge`): `AutoBridge`, `load_hf_weights`, `export_hf_weights`, `export_hf_weights_bucketed`,
  `save_hf` (docs/bridge-api.md);
- the file conversions: `convert_hf_to_mcore`, `convert_mcore_to_hf`;
- `Layout` (a parallel layout) and `BridgeError` (the errors whose message tells the user what to fix).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AutoBridge": "hf_mcore_bridge.bridge",
    "load_hf_weights": "hf_mcore_bridge.bridge",
    "export_hf_weights": "hf_mcore_bridge.bridge",
    "export_hf_weights_bucketed": "hf_mcore_bridge.bridge",
    "save_hf": "hf_mcore_bridge.bridge",
    "convert_hf_to_mcore": "hf_mcore_bridge.convert.to_mcore",
    "convert_mcore_to_hf": "hf_mcore_bridge.convert.to_hf",
    "Layout": "hf_mcore_bridge.convert.layout",
    "BridgeError": "hf_mcore_bridge.errors",
}
"""Public name -> the module that defines it (imported on first use)."""

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the names as type checkers and IDEs see them
    from hf_mcore_bridge.bridge import AutoBridge as AutoBridge
    from hf_mcore_bridge.bridge import export_hf_weights as export_hf_weights
    from hf_mcore_bridge.bridge import export_hf_weights_bucketed as export_hf_weights_bucketed
    from hf_mcore_bridge.bridge import load_hf_weights as load_hf_weights
    from hf_mcore_bridge.bridge import save_hf as save_hf
    from hf_mcore_bridge.convert.layout import Layout as Layout
    from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf as convert_mcore_to_hf
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore as convert_hf_to_mcore
    from hf_mcore_bridge.errors import BridgeError as BridgeError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_mcore_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
