"""The multi-tensor replacements of megatron-core's local fallbacks (`cpu_patches.foreach_l2_norm`, `foreach_scale`)
against references written here, and their installation where neither Transformer Engine nor Apex is present."""

from __future__ import annotations

import math

import pytest
import torch

from hf_mcore_bridge.megatron.cpu_patches import apply_foreach_multi_tensor_ops, foreach_l2_norm, foreach_scale


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (2, 4, 3), (1,)]
    tensors = [torch.randn(s, generator=generator) for s in shapes]
    return [*tensors, torch.randn(6, 2, generator=generator).to(torch.bfloat16)]


def test_foreach_l2_norm_is_the_norm_of_every_element_together():
    tensors = _tensors()
    expected = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))
    norm, per_tensor = foreach_l2_norm(2048, None, [tensors[:2], tensors[2:]], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    assert float(foreach_l2_norm(2048, None, [tensors[:1]], False)[0]) != pytest.approx(expected)


def test_foreach_scale_writes_scaled_copies_or_scales_in_place():
    sources = [t.float() for t in _tensors()]
    targets = [torch.zeros_like(t) for t in sources]
    foreach_scale(2048, None, [sources, targets], 0.25)
    assert all(torch.equal(t, s * 0.25) for s, t in zip(sources, targets, strict=True))
    before = [s.clone() for s in sources]
    foreach_scale(2048, None, [sources, sources], 3.0)
    assert all(torch.equal(s, b * 3.0) for s, b in zip(sources, before, strict=True))


def test_megatron_cores_local_fallbacks_are_replaced():
    from megatron.core.optimizer import clip_grads, optimizer

    assert apply_foreach_multi_tensor_ops()  # neither Transformer Engine nor Apex on this machine
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale and optimizer.multi_tensor_scale_impl is foreach_scale
    assert apply_foreach_multi_tensor_ops()  # idempotent
