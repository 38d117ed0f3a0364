"""hf-mcore-bridge: HuggingFace <-> Megatron-Core weight mappers, an embedded inference engine and a GRPO trainer.

The public entry points are re-exported lazily so that `import hf_mcore_bridge` stays cheap (no megatron-core
import until a function that needs it runs).
"""

__version__ = "0.1.0"
