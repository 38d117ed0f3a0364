"""`AutoBridge`: one HF model (a directory or a Hub id) as megatron-core sees it, and its weights both ways.

    bridge = AutoBridge.from_pretrained("Qwen/Qwen3-8B")          # or a local directory
    models = bridge.get_model(Layout(tp=2, pp=2), torch.bfloat16)  # this rank's chunks (parallel_state initialised)
    bridge.load_hf_weights(models)                                  # each rank reads only its slices
    for name, tensor in bridge.export_hf_weights(models): ...       # full HF tensors, on every rank
    bridge.save_hf(models, "out/")                                  # sharded safetensors + config + tokenizer

The architecture is looked up by the config's `architectures` entry in the explicit registry (`mappings`); the
config is translated once (`config_bridge.megatron_spec`, which refuses what megatron-core cannot represent); the
weights go through the architecture's mapping table in both directions (`bridge.load`, `bridge.export`), the same
table conversion, export and the trainer's refit use. Reading a bridge's config imports neither torch nor
megatron-core; building, loading and exporting do.

Layouts: a `Layout` (TP, PP, VPP, CP, EP, ETP) must be the one megatron-core's `parallel_state` was initialised for;
None takes that one. Where CUDA is absent, building a model applies the patches megatron-core needs on CPU
(`megatron.cpu_patches`), and wherever Transformer Engine is absent those it needs without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.hf_dir import ASSET_FILES, INDEX_NAME
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.config_bridge import PARAMS_DTYPES
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

HUB_FILES = ("*.safetensors", INDEX_NAME, *ASSET_FILES)
"""What `from_pretrained` fetches of a Hub repo: weights, index, config, tokenizer (never pickles)."""


class AutoBridge:
    """An HF causal LM of a registered architecture, bridged to megatron-core. Build with `from_pretrained`."""

    def __init__(self, hf_dir: Path, hf_config: dict[str, Any], model_config: ModelSpec, notes: tuple[str, ...]):
        self.hf_dir = hf_dir
        """The local HF directory (a Hub id's snapshot)."""
        self.hf_config = hf_config
        """Its `config.json`."""
        self.model_config = model_config
        """The architecture-neutral description every megatron-core object here is built from."""
        self.notes = notes
        """What reading the checkpoint changed, one line each (FP8 weights dequantized, MTP layers left out), or
        where the models built here differ from Megatron-LM's own (latent norms' epsilon)."""

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | os.PathLike[str], *, revision: str | None = None) -> AutoBridge:
        """A bridge for a local HF directory, or for a Hub repo id (its config, safetensors and tokenizer fetched
        with `huggingface_hub.snapshot_download`, `revision` its branch, tag or commit). Refuses an architecture
        without a mapping, a config megatron-core cannot represent, and a directory without safetensors, by
        name. Reads headers only."""
        from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Checkpoint, open_hf_checkpoint
        from hf_mcore_bridge.convert.mtp import resolve_import

        directory = _local_directory(path_or_hub_id, revision)
        hf = open_hf_checkpoint(directory)
        model = config_bridge.megatron_spec(hf.config)
        mtp = resolve_import(model, hf)
        fp8 = hf.note() if isinstance(hf, Fp8Checkpoint) else None
        wrapped = None
        if hf.wrapper_config is not None:  # a vision-language class: its language model (`models.vision_language`)
            wrapped = (
                f"{hf.wrapper_config['architectures'][0]}: its language model ({hf.architecture}) is bridged; "
                "save_hf writes the language model alone (`convert` keeps the whole class)"
            )
        latent = config_bridge.latent_norm_note(model)
        notes = tuple(note for note in (wrapped, fp8, mtp.note, latent) if note)
        return cls(directory, dict(hf.config), mtp.model, notes)

    @property
    def architecture(self) -> str:
        """The HF `architectures` entry."""
        return self.model_config.architecture

    # Configuration ---------------------------------------------------------------------------------------------

    def layout(self, layout: Layout | None = None) -> Layout:
        """`layout` (or, None, the one `parallel_state` was initialised for; without it one rank), checked against
        the model (heads, groups, widths, layers and experts divisible) and against `parallel_state`."""
        from hf_mcore_bridge.bridge.plan import check_layout, parallel_ranks

        initialised = _parallel_state_ready()
        if layout is None:
            layout = parallel_ranks().layout if initialised else Layout()
        elif initialised:
            check_layout(layout, parallel_ranks())
        validate_layout(layout, self.model_config)
        return layout

    def params_dtype(self, dtype: Any = None) -> torch.dtype:
        """`dtype` as torch's (a torch dtype or its name, `bfloat16`); None: the checkpoint's own dtype where it
        declares one of `float32`, `bfloat16`, `float16`, else float32."""
        if dtype is not None:
            return dtypes.of(dtype).torch
        declared = self.model_config.torch_dtype
        kind = dtypes.BY_NAME.get(declared or "", dtypes.FLOAT32)
        return (kind if kind in PARAMS_DTYPES else dtypes.FLOAT32).torch

    def padded_vocab_size(self, layout: Layout | None = None, make_vocab_size_divisible_by: int = 128) -> int:
        """The vocabulary megatron-core's embedding and output layer hold: padded to a multiple of
        `make_vocab_size_divisible_by * TP` (Megatron-LM's rule)."""
        return config_bridge.padded_vocab(self.model_config, self.layout(layout), make_vocab_size_divisible_by)

    def transformer_config(
        self, layout: Layout | None = None, dtype: Any = None, *, transformer_engine: bool | None = None, **overrides
    ) -> Any:
        """megatron-core's `TransformerConfig` (`MLATransformerConfig` with multi-latent attention) for `layout`.

        `transformer_engine`: build for Transformer Engine's modules (True) or megatron-core's local ones (False);
        None: Transformer Engine where it is installed and CUDA is available. `overrides` are `TransformerConfig`
        fields set over the translated ones (e.g. `moe_token_dispatcher_type="alltoall"`, `sequence_parallel=True`).
        The auxiliary MoE loss and expert-bias updates are off unless overridden (`config_bridge`); parameters are
        initialised on the CPU where there is no GPU (`use_cpu_initialization`)."""
        import torch

        from hf_mcore_bridge.megatron.model import transformer_config

        layout, kind = self.layout(layout), self.params_dtype(dtype)
        kwargs = config_bridge.transformer_config_kwargs(self.model_config, layout, kind)
        kwargs["use_cpu_initialization"] = not torch.cuda.is_available()
        if transformer_engine is not None:
            kwargs["transformer_impl"] = "transformer_engine" if transformer_engine else "local"
        kwargs.update(overrides)
        return transformer_config(kwargs)

    def gpt_model_kwargs(self, layout: Layout | None = None, make_vocab_size_divisible_by: int = 128) -> dict[str, Any]:
        """`GPTModel`'s keyword arguments besides config, layer spec, pre/post-process and vp_stage: the padded
        vocabulary, maximum length, RoPE (base, scaling, rotary percent) and whether embeddings are tied."""
        padded = self.padded_vocab_size(layout, make_vocab_size_divisible_by)
        return config_bridge.gpt_model_kwargs(self.model_config, padded)

    def layer_spec(self, config: Any, *, vp_stage: int | None = None, core_attention: str = "sdpa") -> Any:
        """The layer spec for `config`: Transformer Engine's (`config.transformer_impl`), or megatron-core's local
        spec with torch's fused attention (`core_attention="sdpa"`, which also takes packed sequences) or
        megatron-core's own unfused attention (`"local"`; not with multi-latent attention, which megatron-core
        0.16's local attention cannot build). MoE models get per-layer specs (dense and MoE layers mixed)."""
        from hf_mcore_bridge.megatron.model import layer_spec

        return layer_spec(self.model_config, config, vp_stage=vp_stage, core_attention=core_attention)

    # Models ----------------------------------------------------------------------------------------------------

    def model_provider(
        self,
        layout: Layout | None = None,
        dtype: Any = None,
        *,
        transformer_engine: bool | None = None,
        core_attention: str = "sdpa",
        initialize: bool = True,
        make_vocab_size_divisible_by: int = 128,
        **overrides,
    ) -> Callable[..., Any]:
        """A Megatron-LM style `model_provider(pre_process=True, post_process=True, vp_stage=None) -> GPTModel`
        (one config shared by every chunk it builds). `initialize=False` leaves the parameters unset (about to be
        loaded) and, on a GPU, allocates them there directly."""
        _patch_megatron_core()
        layout = self.layout(layout)
        overrides.setdefault("perform_initialization", initialize)
        import torch

        overrides.setdefault("use_cpu_initialization", initialize or not torch.cuda.is_available())
        config = self.transformer_config(layout, dtype, transformer_engine=transformer_engine, **overrides)
        kwargs = self.gpt_model_kwargs(layout, make_vocab_size_divisible_by)

        def provide(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
            from megatron.core.models.gpt import GPTModel

            spec = self.layer_spec(config, vp_stage=vp_stage, core_attention=core_attention)
            stage = {"pre_process": pre_process, "post_process": post_process, "vp_stage": vp_stage}
            return GPTModel(config, spec, **stage, **kwargs)

        return provide

    def get_model(
        self,
        layout: Layout | None = None,
        dtype: Any = None,
        *,
        device: Any = None,
        load_weights: bool = False,
        transformer_engine: bool | None = None,
        core_attention: str = "sdpa",
        initialize: bool = True,
        make_vocab_size_divisible_by: int = 128,
        **overrides,
    ) -> list[Any]:
        """This rank's `GPTModel` chunks (one per virtual pipeline stage, one without VPP) for `layout`, on
        `device` (None: this rank's GPU, else the CPU). `load_weights`: filled from the HF checkpoint
        (`load_hf_weights`; nothing is initialised first). Needs `parallel_state` initialised for `layout`."""
        import torch
        from megatron.core import parallel_state

        from hf_mcore_bridge.bridge.plan import parallel_ranks

        parallel_ranks()  # refuses an uninitialised parallel_state, naming what to initialise
        layout = self.layout(layout)
        provide = self.model_provider(
            layout,
            dtype,
            transformer_engine=transformer_engine,
            core_attention=core_attention,
            initialize=initialize and not load_weights,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            **overrides,
        )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        chunks = []
        for vp_stage in range(layout.vpp) if layout.vpp else [None]:
            ignore = vp_stage is None
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=ignore, vp_stage=vp_stage)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=ignore, vp_stage=vp_stage)
            chunks.append(provide(pre_process=pre, post_process=post, vp_stage=vp_stage).to(device))
        if load_weights:
            self.load_hf_weights(chunks)
        return chunks

    # Weights ---------------------------------------------------------------------------------------------------

    def load_hf_weights(self, models: Any, hf_dir: str | os.PathLike[str] | None = None) -> None:
        """Fill `models` (a `GPTModel`, or a list of virtual-pipeline chunks; any layout, CPU or GPU; wrappers such
        as DDP are looked through) from the HF directory (`hf_dir`, default the bridge's), each rank reading only
        the slices it holds; FP8 checkpoints are dequantized as they are read. Not collective."""
        from hf_mcore_bridge.bridge.load import load_hf_weights

        load_hf_weights(models, self.model_config, Path(hf_dir) if hf_dir is not None else self.hf_dir)

    def export_hf_weights(
        self, models: Any, *, dtype: Any = None, fp8: bool = False, fp8_scale_format: str = "source"
    ) -> Any:
        """The model as a generator of `(hf_name, tensor)`, full HF tensors (gathered over TP and EP, exchanged over
        PP one tensor at a time) on every rank, in the checkpoint's names: what vLLM's `load_weights` and this
        project's engine take. `dtype` casts (tensors HF keeps in float32 stay so); `fp8` writes the linear
        layers' weights as 128 x 128 e4m3 blocks plus `<name>_scale_inv`, scales in `fp8_scale_format`
        (`ue8m0`, `float32`, or `source`: the checkpoint's own format, `ue8m0` for one without FP8). Collective:
        every rank must exhaust it. Tensors may share storage with the parameters: use or clone them before the
        model changes."""
        from hf_mcore_bridge.bridge.export import export_hf_weights

        options = self._export_options(dtype, fp8, fp8_scale_format)
        return export_hf_weights(models, self.model_config, **options)

    def export_hf_weights_bucketed(
        self,
        models: Any,
        bucket_bytes: int = 512 << 20,
        *,
        dtype: Any = None,
        fp8: bool = False,
        fp8_scale_format: str = "source",
    ) -> Any:
        """`export_hf_weights` in lists of at most `bucket_bytes` bytes (a tensor larger than that is a list of its
        own): one `load_weights` call per list. Collective, as `export_hf_weights`."""
        from hf_mcore_bridge.bridge.export import export_hf_weights_bucketed

        options = self._export_options(dtype, fp8, fp8_scale_format)
        return export_hf_weights_bucketed(models, self.model_config, bucket_bytes, **options)

    def save_hf(
        self,
        models: Any,
        out_dir: str | os.PathLike[str],
        *,
        dtype: Any = None,
        fp8: bool = False,
        fp8_scale_format: str = "source",
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
    ) -> Path:
        """Write `models` to `out_dir` as an HF directory: safetensors sharded at `max_shard_size` (with an index),
        the bridge's config (with the written dtype) and its tokenizer files. Collective; global rank 0 writes.
        `overwrite` replaces an earlier output of this tool, never another directory."""
        from hf_mcore_bridge.bridge.save import save_hf

        options = self._export_options(dtype, fp8, fp8_scale_format)
        return save_hf(
            models,
            self.model_config,
            out_dir,
            hf_config=self.hf_config,
            assets_dir=self.hf_dir,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            **options,
        )

    def _export_options(self, dtype: Any, fp8: bool, fp8_scale_format: str) -> dict[str, Any]:
        from hf_mcore_bridge.convert.fp8_checkpoint import export_scale_format

        return {
            "dtype": None if dtype is None else dtypes.of(dtype).torch,
            "fp8": fp8,
            "fp8_scale_format": export_scale_format(fp8_scale_format, self.hf_config),
        }

    def __repr__(self) -> str:
        return f"AutoBridge({self.architecture}, {self.hf_dir})"


def _local_directory(path_or_hub_id: str | os.PathLike[str], revision: str | None) -> Path:
    """A local directory as it is, else a Hub repo id's snapshot (one line for an id that cannot be fetched)."""
    path = Path(path_or_hub_id)
    if path.is_dir():
        return path
    repo_id = str(path_or_hub_id)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise BridgeError(f"{repo_id} is neither a directory nor a Hub repo id") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except Exception as err:
        first = (str(err).splitlines() or [""])[0]
        raise BridgeError(f"{repo_id} is not a directory and could not be fetched from the Hub: {first}") from None


def _parallel_state_ready() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def _patch_megatron_core() -> None:
    """megatron-core's patches for CPU (where CUDA is absent) and for a missing Transformer Engine; idempotent."""
    from hf_mcore_bridge.megatron.cpu_patches import (
        apply_cpu_workarounds,
        apply_fla_absent_workarounds,
        apply_te_absent_workarounds,
    )

    apply_cpu_workarounds()
    apply_te_absent_workarounds()
    apply_fla_absent_workarounds()
