"""What a model is, independent of megatron-core and of the engine: the layer every other part reads.

- the table vocabulary the architecture files are written in: typed entries that name each tensor in both naming
  schemes with its tensor-parallel style and HF shape (`mapping_types`, `parallel_style`, `row_runs`), the pure
  tensor transforms they call (`tensor_ops`), and the entries shared by mixture-of-experts families (`moe_tables`);
- what an architecture file declares (`architecture.Architecture`) and the HF config readers its hooks share
  (`moe`, `config_errors`);
- the one description of a model, read once from its `config.json` (`spec.ModelSpec`), which conversion, export,
  verify, the engine, the DTensor path and the trainer all read; each refuses over it what it cannot compute;
- the explicit registry of the files in `mappings/` (`registry`);
- the tiny test models built from each architecture's config (`tiny_models`) and the real trained one
  (`real_models`).

Imports only `checkpoint` (tensor names), `errors` and the architecture files; never megatron-core, `convert`,
the engine or the trainer. The vocabulary and the registry import no torch (the transforms import it when they
run; `tiny_models` needs it), so a conversion is planned before torch loads.
"""
