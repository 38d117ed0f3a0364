"""Tensor-parallel styles: how megatron-core shards each tensor over tensor-parallel ranks."""

import enum


class Parallel(enum.Enum):
    """How megatron-core shards a tensor over tensor-parallel ranks."""

    REPLICATED = "replicated"
    """Every rank holds the whole tensor (norms)."""
    COLUMN = "column"
    """Split along the output dimension (dim 0): QKV, column-parallel biases."""
    ROW = "row"
    """Split along the input dimension (dim 1): attention output projection, `linear_fc2`."""
    VOCAB = "vocab"
    """Split along the (padded) vocabulary, dim 0: word embeddings and the output layer."""
    GATED_COLUMN = "gated_column"
    """A gated MLP's `[gate; up]`: each half split along dim 0, each rank holding `[gate_r; up_r]`."""
    COLUMN_PARTS = "column_parts"
    """A tensor megatron-core saves as separate parts (its `_split_tensor_factory`: Gated DeltaNet's `in_proj` and
    `conv1d`), each part split along dim 0, each rank holding `[p0_r; p1_r; ...]`; the checkpoint keys the parts
    `<key>.<part>` (`convert.placement.split_parts`)."""
