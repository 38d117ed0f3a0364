"""One file per architecture: its mapping table, how its HF config is read, and its tiny test model.

Each file declares an `Architecture` (`models.architecture`) and imports only from `hf_mcore_bridge.models` (and
`hf_mcore_bridge.errors`). The registry that lists them is `models.registry`; adding an architecture is one file
here and one line there (`docs/adding-an-architecture.md`).
"""
