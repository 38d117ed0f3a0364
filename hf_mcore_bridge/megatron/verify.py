"""`bridge verify`: load a Megatron checkpoint into real megatron-core at a layout and compare logits with HF.

A world of TP x PP x EP processes is started (gloo on CPU, NCCL on GPU), or, under an env:// launcher
(`torchrun`), the launcher's world is used (any size that is a multiple of the layout's; see `world`). Each rank
builds its stage of a megatron-core `GPTModel` from the checkpoint's own `args`, loads it with
`dist_checkpointing.load`, and runs the same tokens; stages hand activations on with point-to-point sends. The last
stage gathers the vocabulary-parallel logits and hands them to global rank 0, which writes them; the parent (under
a launcher: global rank 0 itself) runs HF transformers on the HF directory and compares: max |dlogit|, mean
KL(HF || mcore) and top-1 agreement. Several checkpoints can be verified in one world (process start-up is the
expensive part).

Before any process starts, each HF directory's safetensors headers are read as `convert` reads them (a corrupt or
truncated file is refused naming it, not found by transformers after the world has run), and `seq_len` is checked
against the checkpoint's `max_position_embeddings` (longer sequences are positions neither side was built for, and
their attention scores grow with the square of the length).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint
from hf_mcore_bridge.checkpoint.megatron_dirs import check_installed_reads, resolve_checkpoint
from hf_mcore_bridge.convert.config_bridge import from_megatron_args, padded_vocab
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.errors import BridgeError, CheckpointError
from hf_mcore_bridge.megatron.world import device as rank_device
from hf_mcore_bridge.megatron.world import reports_here, run_world
from hf_mcore_bridge.models.spec import ModelSpec

DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 0.15, "fp16": 0.05}
"""Max |dlogit| allowed per compute dtype."""


@dataclass(frozen=True)
class VerifyJob:
    """One HF directory and the Megatron checkpoint that should hold the same model."""

    hf_dir: Path
    mcore_dir: Path


@dataclass(frozen=True)
class VerifyResult:
    """Logit agreement between HF transformers and megatron-core for one job."""

    job: VerifyJob
    layout: Layout
    max_abs_diff: float
    mean_kl: float
    top1_agreement: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def summary(self) -> str:
        verdict = "OK" if self.passed else "FAIL"
        return (
            f"{verdict} {self.job.mcore_dir} at {self.layout}: max|dlogit|={self.max_abs_diff:.3e} "
            f"(tolerance {self.tolerance:g}) mean KL={self.mean_kl:.3e} top-1 agreement={self.top1_agreement:.4f}"
        )


def _tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=generator)


def text_tokens(hf_dir: Path, text: str, batch: int, seq_len: int) -> torch.Tensor:
    """`text` tokenized by the HF directory's tokenizer, as `batch` consecutive rows of `seq_len` tokens: real text
    gives a trained model's peaked logits, where a wrong weight shows far more than on random token ids."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir)(text, add_special_tokens=False)["input_ids"]
    if len(ids) < batch * seq_len:
        raise BridgeError(
            f"--text is {len(ids)} tokens long; --batch {batch} x --seq-len {seq_len} needs {batch * seq_len}"
        )
    return torch.tensor(ids[: batch * seq_len]).view(batch, seq_len)


def verify(
    jobs: list[VerifyJob],
    layout: Layout,
    *,
    dtype: str = "fp32",
    batch: int = 2,
    seq_len: int = 16,
    seed: int = 0,
    tolerance: float | None = None,
    text: str | None = None,
) -> list[VerifyResult]:
    """Verify each job at `layout`; one process world serves all jobs. Under a launcher, the results are returned
    on global rank 0 and the other ranks get an empty list. The tokens are random ids, or `text` tokenized by each
    job's HF tokenizer (`text_tokens`)."""
    if layout.vpp:
        raise BridgeError("verify runs at tp/pp/cp/ep layouts; virtual pipeline parallelism is not used")
    if seq_len % (2 * layout.cp):
        raise BridgeError(f"--seq-len {seq_len} must be a multiple of 2 x CP = {2 * layout.cp} (the CP split)")
    with tempfile.TemporaryDirectory(prefix="bridge-verify-") as scratch:
        work = Path(scratch)
        token_sets = []
        for i, job in enumerate(jobs):
            # every shard's header readable, every indexed tensor present; `.bin` weights are read weights-only, as
            # transformers reads them for the comparison (a forbidden global is refused here, naming it)
            HFCheckpoint(job.hf_dir, allow_pickle=True)
            _, checkpoint_dir = resolve_checkpoint(job.mcore_dir)
            check_installed_reads(checkpoint_dir)
            model = from_megatron_args(_args(checkpoint_dir))
            check_seq_len(seq_len, model.max_position_embeddings, checkpoint_dir)
            if text is None:
                tokens = _tokens(model.vocab_size, batch, seq_len, seed + i)
            else:
                tokens = text_tokens(job.hf_dir, text, batch, seq_len)
            token_sets.append(tokens)
            torch.save(tokens, work / f"tokens_{i}.pt")
        run_world(_verify_rank, layout, layout, [str(j.mcore_dir) for j in jobs], dtype, str(work))
        if not reports_here():
            return []
        results = []
        for i, job in enumerate(jobs):
            mcore_logits = torch.load(work / f"logits_{i}.pt", weights_only=True).double()
            hf_logits = _hf_logits(job.hf_dir, token_sets[i], dtype).double()
            limit = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
            results.append(_compare(job, layout, hf_logits, mcore_logits, limit))
    return results


def check_seq_len(seq_len: int, max_positions: int, where: Path | str) -> None:
    """Refuse sequences longer than the model's `max_position_embeddings` (`where` says whose)."""
    if seq_len > max_positions:
        raise BridgeError(
            f"--seq-len {seq_len} is longer than the model's max_position_embeddings={max_positions} ({where})"
        )


def _compare(job: VerifyJob, layout: Layout, hf: torch.Tensor, mc: torch.Tensor, tolerance: float) -> VerifyResult:
    if hf.shape != mc.shape:
        raise BridgeError(f"logit shapes differ: HF {tuple(hf.shape)} vs megatron-core {tuple(mc.shape)}")
    log_p, log_q = torch.log_softmax(hf, -1), torch.log_softmax(mc, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return VerifyResult(
        job=job,
        layout=layout,
        max_abs_diff=float((hf - mc).abs().max()),
        mean_kl=float(kl),
        top1_agreement=float((hf.argmax(-1) == mc.argmax(-1)).double().mean()),
        tolerance=tolerance,
    )


def _hf_logits(hf_dir: Path, tokens: torch.Tensor, dtype: str) -> torch.Tensor:
    """transformers' logits of the HF directory's model; of a vision-language class, its logits on text alone."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from hf_mcore_bridge.checkpoint.hf_dir import read_json
    from hf_mcore_bridge.models.registry import wrapper_for
    from hf_mcore_bridge.quiet import quiet_libraries

    quiet_libraries()
    device = rank_device()
    auto = AutoModelForImageTextToText if wrapper_for(read_json(Path(hf_dir) / "config.json")) else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, dtype=dtypes.FLAGS[dtype].torch).to(device).eval()
    with torch.no_grad():
        return model(input_ids=tokens.to(device)).logits.float().cpu()


def _verify_rank(layout: Layout, checkpoints: list[str], dtype: str, work: str) -> None:
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    for i, checkpoint in enumerate(checkpoints):
        tokens = torch.load(Path(work) / f"tokens_{i}.pt", weights_only=True)
        logits = stage_logits(Path(checkpoint), layout, dtypes.FLAGS[dtype].torch, tokens)
        # the last stage may be on another node: global rank 0 (on the node that compares) writes the logits
        gathered: list[torch.Tensor | None] | None = [None] * dist.get_world_size() if rank0 else None
        dist.gather_object(logits, gathered, dst=0)
        if gathered is not None:
            (held,) = [g for g in gathered if g is not None]
            torch.save(held, Path(work) / f"logits_{i}.pt")


def _args(checkpoint_dir: Path) -> Any:
    """Megatron-LM `args`, or those of a Megatron-Bridge checkpoint's `run_config.yaml`."""
    from hf_mcore_bridge.convert.to_hf import checkpoint_args

    args = checkpoint_args(checkpoint_dir)
    if args is None:
        raise CheckpointError(f"{checkpoint_dir} records neither args nor a run_config.yaml: nothing to build from")
    return args


def stage_logits(checkpoint: Path, layout: Layout, dtype: torch.dtype, tokens: torch.Tensor) -> torch.Tensor | None:
    """Run this rank's pipeline stage; the last stage's TP-rank-0 returns the gathered, unpadded logits."""
    from hf_mcore_bridge.megatron.model import build_gpt_model, load_distributed_checkpoint

    _, checkpoint_dir = resolve_checkpoint(checkpoint)
    args = _args(checkpoint_dir)
    model_cfg = from_megatron_args(args)
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
    device = rank_device()
    padded = padded_vocab(model_cfg, layout, divisible_by)
    model = build_gpt_model(model_cfg, layout, dtype, padded, device=device, initialize=False).eval()
    load_distributed_checkpoint(model, checkpoint_dir)
    return forward_stage(model, model_cfg, tokens, dtype)


def forward_stage(model: torch.nn.Module, model_cfg: ModelSpec, tokens: torch.Tensor, dtype: torch.dtype):
    """One forward pass through this rank's pipeline stage; activations travel between stages point to point.
    Under context parallelism each rank runs its share of the sequence (`context_parallel`, causal attention
    without a mask) and the logits are gathered back in sequence order.

    Returns the unpadded, TP-gathered logits `[batch, seq, vocab]` on the last stage's TP rank 0, else None.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hf_mcore_bridge.megatron.model import causal_mask

    device = rank_device()
    tokens = tokens.to(device)
    batch, seq_len = tokens.shape
    positions = torch.arange(seq_len, device=device).expand(batch, -1)
    cp = parallel_state.get_context_parallel_world_size()
    mask: torch.Tensor | None = causal_mask(seq_len, device)
    if cp > 1:
        from hf_mcore_bridge.megatron.context_parallel import split_sequence

        rank = parallel_state.get_context_parallel_rank()
        tokens, positions = (split_sequence(x, cp, rank, 1) for x in (tokens, positions))
        mask = None
    local_len = tokens.shape[1]
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(local_len, batch, model_cfg.hidden_size, dtype=dtype, device=device)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(tokens, positions, mask)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        logits = gather_from_tensor_model_parallel_region(output)
        if cp > 1:
            from hf_mcore_bridge.megatron.context_parallel import gather_in_order

            group = parallel_state.get_context_parallel_group()
            logits = gather_in_order(logits, group, torch.tensor([0, seq_len]), dim=1)
    first_replica = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0
    if parallel_state.get_tensor_model_parallel_rank() != 0 or not first_replica:
        return None
    return logits[..., : model_cfg.vocab_size].float().cpu()
