"""Rank functions the tests run inside megatron-core process worlds (`hf_mcore_bridge.world.run_world`).

Everything here is megatron-core's own machinery: `GPTModel`, `dist_checkpointing.save` / `load`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from hf_mcore_bridge.config_bridge import ModelConfig, from_megatron_args, padded_vocab
from hf_mcore_bridge.layout import Layout
from hf_mcore_bridge.megatron_dirs import read_common, resolve_checkpoint
from hf_mcore_bridge.megatron_model import build_gpt_model, load_distributed_checkpoint
from hf_mcore_bridge.verify import forward_stage
from hf_mcore_bridge.world import device


def _save(model: torch.nn.Module, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(directory))
    dist.barrier()


def resave_rank(source: str, destination: str, layout: Layout) -> None:
    """Load a checkpoint at `layout` with megatron-core and save it again with megatron-core."""
    _, checkpoint_dir = resolve_checkpoint(Path(source))
    args = read_common(checkpoint_dir)["args"]
    model_cfg = from_megatron_args(args)
    model = build_gpt_model(model_cfg, layout, torch.float32, args.padded_vocab_size, device=device())
    load_distributed_checkpoint(model, checkpoint_dir)
    _save(model, Path(destination))


def random_save_rank(model_cfg: ModelConfig, layout: Layout, destination: str, tokens: torch.Tensor, out: str):
    """A randomly initialised megatron-core GPTModel: saved by megatron-core, and its logits on `tokens`."""
    torch.manual_seed(1234)
    model = build_gpt_model(model_cfg, layout, torch.float32, padded_vocab(model_cfg, layout), device=device())
    with torch.no_grad():  # norms start at 1: make them differ so that a misplaced norm shows in the logits
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.1 * torch.sin(torch.arange(param.numel()) + len(name)).to(param))
    model.eval()
    _save(model, Path(destination))
    logits = forward_stage(model, model_cfg, tokens, torch.float32)
    if logits is not None:
        torch.save(logits, out)


def not_nan(value: float) -> bool:
    return not math.isnan(value)


def legacy_load_rank(root: str, layout: Layout, tokens: torch.Tensor, out: str) -> None:
    """Load this rank's legacy file into megatron-core modules with strict=True; logits when not interleaved."""
    from megatron.core import parallel_state

    from hf_mcore_bridge.legacy_format import FILE_NAME, rank_dirname

    _, checkpoint_dir = resolve_checkpoint(Path(root))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    state = torch.load(checkpoint_dir / rank_dirname(tp_rank, pp_rank, ep_rank, layout) / FILE_NAME, weights_only=False)
    model_cfg = from_megatron_args(state["args"])
    padded = state["args"].padded_vocab_size
    if layout.vpp:
        for v in range(layout.vpp):
            chunk = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device(), vp_stage=v)
            chunk.load_state_dict(state[f"model{v}"], strict=True)
        return
    model = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device()).eval()
    model.load_state_dict(state["model"], strict=True)
    logits = forward_stage(model, model_cfg, tokens, torch.float32)
    if logits is not None:
        torch.save(logits, out)


def sdpa_rank(model_cfg: ModelConfig, lengths: list[int], out: str) -> None:
    """Logits of one randomly initialised model: SDPA on separate sequences, SDPA on the same sequences packed
    into one row (`PackedSeqParams`, thd), and megatron-core's own local attention on separate sequences."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from hf_mcore_bridge.megatron_model import causal_mask

    layout = Layout()
    padded = padded_vocab(model_cfg, layout)
    torch.manual_seed(7)
    sdpa = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device()).eval()
    local = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device(), core_attention="local").eval()
    local.load_state_dict(sdpa.state_dict())
    generator = torch.Generator().manual_seed(8)
    sequences = [torch.randint(0, model_cfg.vocab_size, (1, n), generator=generator) for n in lengths]
    results: dict[str, list[torch.Tensor]] = {"sdpa": [], "local": []}
    with torch.no_grad():
        sequences = [tokens.to(device()) for tokens in sequences]
        for tokens in sequences:
            positions = torch.arange(tokens.shape[1], device=device())[None]
            results["sdpa"].append(sdpa(tokens, positions, None)[0])
            results["local"].append(local(tokens, positions, causal_mask(tokens.shape[1], device()))[0])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
        )
        packed_tokens = torch.cat(sequences, dim=1)
        packed_positions = torch.cat([torch.arange(n, device=device()) for n in lengths])[None]
        packed = sdpa(packed_tokens, packed_positions, None, packed_seq_params=params)[0]
    results["packed"] = list(packed.split(lengths))
    torch.save({k: [t.float().cpu() for t in v] for k, v in results.items()}, out)
