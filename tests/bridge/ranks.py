"""Rank functions of the bridge API tests, run in megatron-core gloo worlds (`megatron.world.run_world`).

Each job's model is built here with megatron-core's own `GPTModel` and layer specs from the bridge's config
(`transformer_config`, `gpt_model_kwargs`): `get_gpt_layer_local_spec` for dense models,
`get_gpt_decoder_block_spec` for MoE ones; multi-latent attention takes the bridge's spec (`layer_spec`), because
megatron-core 0.16's local spec cannot build MLA attention (its `DotProductAttention` refuses MLA's `k_channels`),
and so does Gemma 3, whose post-norms, sliding layers' RoPE base and embedding scale megatron-core's specs lack.
The model is then loaded by `load_hf_weights`, run by the forward below (plain megatron-core calls: stages and
virtual stages hand activations on point to point) and exported. What each rank saw is saved for the test:

- `read` / `held`: elements the loader read (its single reader, `bridge.load._read`, counted here) and elements
  of the HF checkpoint this rank holds, counted here from the local tensors' shapes (vocabulary padding rows are
  no checkpoint's: left out);
- `names` / `unequal`: the export stream's names in order, and those not `torch.equal` (dtype included) to the
  reference tensor read with safetensors from the job's reference directory;
- `logits`: the unpadded logits, on the rank that has them (last stage, TP rank 0, first replica);
- optionally the model of `AutoBridge.get_model` (the bridge's own spec: SDPA attention) loaded the same way and its
  logits, the bucketed stream's buckets, the order of the stream's pipeline broadcasts and yields, and an FP8
  export.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 20000
"""The bucketed export's bound in the tests: a few tiny tensors a bucket, and tensors larger than a bucket."""


@dataclass(frozen=True)
class Job:
    """One model in one world."""

    name: str
    hf_dir: str
    """What the bridge is made from and loads."""
    reference: str | None = None
    """The directory whose safetensors the export must equal (None: `hf_dir`); for an FP8 source, a plain
    directory of the values the test expects."""
    get_model: bool = False
    """Also build the model with `AutoBridge.get_model(load_weights=True)` and save its logits."""
    bucketed: bool = False
    """Also export in buckets of `BUCKET_BYTES`."""
    trace: bool = False
    """Record the export's pipeline broadcasts and yields in order."""
    fp8_export: bool = False
    """Also export with `fp8=True` (ue8m0 scales) and save what that gives for the FP8 weights."""
    save_dir: str | None = None
    """Also `save_hf` the loaded model there (shards of at most `shard_size`)."""
    shard_size: str = "5GB"
    wrong_dirs: tuple[str, ...] = ()
    """Record what the API says to bad calls: a layout other than the world's, a load from each of these
    directories (other models), a save into the source directory."""
    bridge_spec: bool = False
    """Build the model with `AutoBridge.get_model` (the bridge's spec) rather than the test's own code: for layouts
    megatron-core's local spec cannot run (context parallelism, which its attention refuses)."""
    misbuilt: bool = False
    """Build the model without its q/k norms (otherwise than its config says) and record only what loading and
    exporting it say."""
    same_dtype: bool = True
    """Each exported tensor has the reference's dtype; False: the model's dtype, holding the reference's values
    exactly (an fp32 model of a bfloat16 checkpoint)."""


def layout_rank(jobs: list[Job], tokens: torch.Tensor, out_dir: str) -> None:
    """Run every job on this rank (see the module docstring); results in `out_dir/<job>.<rank>.pt`."""
    from hf_mcore_bridge import AutoBridge

    for job in jobs:
        bridge = AutoBridge.from_pretrained(job.hf_dir)
        result = misbuilt(bridge) if job.misbuilt else run_job(job, bridge, tokens)
        torch.save(result, Path(out_dir) / f"{job.name}.{dist.get_rank()}.pt")


def run_job(job: Job, bridge: Any, tokens: torch.Tensor) -> dict[str, Any]:
    config = bridge.model_config
    chunks = bridge.get_model(dtype=torch.float32, initialize=False) if job.bridge_spec else build_chunks(bridge)
    result: dict[str, Any] = {"read": 0}
    with counting(result):
        bridge.load_hf_weights(chunks)
    result["held"] = held_elements(chunks, config.vocab_size)
    result["logits"] = forward(chunks, tokens, config.hidden_size, config.vocab_size)
    reference = Reference(Path(job.reference or job.hf_dir))
    stream = bridge.export_hf_weights(chunks)
    if job.trace:
        stream = traced(stream, result)
    result["names"], result["unequal"] = compared(stream, reference, job.same_dtype)
    if job.get_model:
        models = bridge.get_model(dtype=torch.float32, load_weights=True)
        result["get_model_logits"] = forward(models, tokens, config.hidden_size, config.vocab_size)
    if job.bucketed:
        result["buckets"] = bucket_check(bridge, chunks, reference)
    if job.save_dir:
        bridge.save_hf(chunks, job.save_dir, max_shard_size=job.shard_size)
    if job.wrong_dirs:
        result["refusals"] = refusals(bridge, chunks, job.wrong_dirs)
    if job.fp8_export:
        blocks = bridge.export_hf_weights(chunks, fp8=True, fp8_scale_format="ue8m0")
        result["fp8"] = {name: tensor.cpu() for name, tensor in blocks}
    return result


def misbuilt(bridge: Any) -> dict[str, Any]:
    """What loading and exporting say of a model built without the q/k norms its config asks for, and what
    exporting says of one built without its last stage's final norm and output layer."""
    chunks = build_chunks(bridge, qk_norm=False)
    load = _refused(lambda: bridge.load_hf_weights(chunks))
    export = _refused(lambda: list(bridge.export_hf_weights(chunks)))
    headless = build_chunks(bridge, post_process=False)
    return {"refusals": [load, export, _refused(lambda: list(bridge.export_hf_weights(headless)))]}


def refusals(bridge: Any, chunks: list[torch.nn.Module], wrong_dirs: tuple[str, ...]) -> list[str]:
    """The message of each refused bad call (`Job.wrong_dirs`), as `type: message`."""
    from hf_mcore_bridge.convert.layout import Layout

    loads = [_refused(lambda d=directory: bridge.load_hf_weights(chunks, d)) for directory in wrong_dirs]
    layout = _refused(lambda: bridge.get_model(Layout(tp=1)))
    return [layout, *loads, _refused(lambda: bridge.save_hf(chunks, bridge.hf_dir))]


def _refused(call: Any) -> str:
    """`type: message` of what `call()` raises, `accepted` where it raises nothing."""
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def build_chunks(bridge: Any, qk_norm: bool = True, post_process: bool = True) -> list[torch.nn.Module]:
    """This rank's model chunks, built with megatron-core's own `GPTModel` and layer specs (module docstring);
    `qk_norm=False`: a dense model's spec without the q/k norms its config asks for; `post_process=False`: no
    stage with the final norm and output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = bridge.transformer_config(dtype=torch.float32)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        if (
            bridge.model_config.mla is not None
            or bridge.model_config.post_norms
            or bridge.model_config.linear_attention
        ):
            spec = bridge.layer_spec(config, vp_stage=vp_stage)
        elif bridge.model_config.moe is not None:
            spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
            )
        else:
            spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm and qk_norm, normalization="RMSNorm")
        ignore = vp_stage is None
        chunks.append(
            GPTModel(
                config,
                spec,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=ignore, vp_stage=vp_stage),
                post_process=post_process
                and parallel_state.is_pipeline_last_stage(ignore_virtual=ignore, vp_stage=vp_stage),
                vp_stage=vp_stage,
                **bridge.gpt_model_kwargs(),
            )
        )
    return chunks


@contextmanager
def counting(result: dict[str, Any]) -> Iterator[None]:
    """Inside, the elements the loader reads are added to `result["read"]` (its one reader, `bridge.load._read`;
    for a plain checkpoint it returns exactly the elements it reads from the file)."""
    from hf_mcore_bridge.bridge import load

    original = load._read

    def read(*args: Any) -> torch.Tensor:
        tensor = original(*args)
        result["read"] += tensor.numel()
        return tensor

    load._read = read
    try:
        yield
    finally:
        load._read = original


def held_elements(chunks: list[torch.nn.Module], vocab_size: int) -> int:
    """Elements of the checkpoint this rank holds: every parameter and persistent buffer, without the padding
    rows of the vocabulary-parallel tensors (rows >= `vocab_size` of the padded vocabulary, this TP rank's block)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    total = 0
    for chunk in chunks:
        saved = set(chunk.state_dict())
        tensors = [*chunk.named_parameters(), *((n, b) for n, b in chunk.named_buffers() if n in saved)]
        for name, tensor in tensors:
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = tensor.shape[0]
                first = tp_rank * rows
                real = max(0, min(rows, vocab_size - first))
                total += real * tensor.shape[1]
            else:
                total += tensor.numel()
    return total


def forward(chunks: list[torch.nn.Module], tokens: torch.Tensor, hidden: int, vocab: int) -> torch.Tensor | None:
    """The logits `[batch, seq, vocab]` of `tokens` through every stage and virtual stage (causal mask), on the
    last stage's TP rank 0 of the first data-parallel replica; None elsewhere. Under context parallelism (one
    chunk), `megatron.verify.forward_stage`, which runs each rank's share of the sequence and gathers them."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if ps.get_context_parallel_world_size() > 1:
        from types import SimpleNamespace

        from hf_mcore_bridge.megatron.verify import forward_stage

        (chunk,) = chunks
        model = SimpleNamespace(hidden_size=hidden, vocab_size=vocab)
        return forward_stage(chunk.eval(), model, tokens, torch.float32)

    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    output = None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            chunk.eval()
            first, last = pp_rank == 0 and v == 0, pp_rank == pp - 1 and v == len(chunks) - 1
            if not first:
                hidden_states = torch.empty(seq, batch, hidden)
                dist.recv(hidden_states, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden_states)
            output = chunk(tokens, positions, mask)
            if not last:
                dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                output = None
        if output is None:
            return None
        logits = gather_from_tensor_model_parallel_region(output)
    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
        return None
    return logits[..., :vocab].clone()


class Reference:
    """The tensors of an HF directory's safetensors files, read with safetensors one at a time."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)


def compared(stream: Any, reference: Reference, same_dtype: bool = True) -> tuple[list[str], list[str]]:
    """The stream's names in order, and those whose tensor is not `torch.equal` to the reference's (nor of its
    dtype, with `same_dtype`; else the reference is cast to the tensor's dtype, which must hold it exactly)."""
    names, unequal = [], []
    for name, tensor in stream:
        names.append(name)
        expected = reference[name] if name in reference.files else None
        if expected is not None and not same_dtype:
            cast = expected.to(tensor.dtype)
            expected = cast if torch.equal(cast.to(expected.dtype), expected) else None
        if expected is None or tensor.dtype != expected.dtype or not torch.equal(tensor.cpu(), expected):
            unequal.append(name)
    return names, unequal


def traced(stream: Any, result: dict[str, Any]) -> Any:
    """The stream, with every pipeline broadcast (`torch.distributed.broadcast` over the pipeline group) and every
    yielded tensor recorded in order in `result["events"]` (`"b"`, `"y"`)."""
    from megatron.core import parallel_state

    events: list[str] = []
    result["events"] = events
    broadcast = dist.broadcast
    group = parallel_state.get_pipeline_model_parallel_group()

    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is group:
            events.append("b")
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = recorded
    try:
        for item in stream:
            events.append("y")
            yield item
    finally:
        dist.broadcast = broadcast


def bucket_check(bridge: Any, chunks: list[torch.nn.Module], reference: Reference) -> dict[str, Any]:
    """Each bucket's (tensor count, bytes), and whether the buckets joined are the reference's tensors in the
    unbucketed stream's order."""
    sizes, names, equal = [], [], True
    for bucket in bridge.export_hf_weights_bucketed(chunks, BUCKET_BYTES):
        sizes.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
        for name, tensor in bucket:
            names.append(name)
            equal = equal and torch.equal(tensor.cpu(), reference[name])
    return {"sizes": sizes, "names": names, "equal": equal}
