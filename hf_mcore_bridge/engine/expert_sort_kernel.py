"""The sort by expert's body (Triton), wrapped by `expert_sort`, which documents it.

Kept in a module of its own so that Triton is imported only when the kernel is first used (as
`fused_moe_kernel`): `triton.jit` reads the function's source and its `tl.constexpr` annotations.

One program does everything, in three phases separated by barriers (`tl.debug_barrier`, a `__syncthreads` on the
GPU, which also orders the program's global stores before its later loads; a no-op in the interpreter, which runs
the program's steps in order):

1. per-expert counts of the `num_pairs` expert ids (`tl.histogram`; the lanes past `num_pairs` read expert 0 and are
   taken off its count again, since older Triton versions take no mask), their padded cumulative ends (stored as
   `group_ends`) and, per expert, the shift from a pair's place among the unpadded sorted pairs to its row
   (stored to `shift`, a scratch of E entries);
2. every row of `sorted_pairs` set to `num_pairs` (padding) and every entry of `block_expert` to -1;
3. the pairs sorted by (expert, pair index), a key that is unique, so the sort is stable by construction: each
   sorted pair is written to its row (its place plus its expert's shift), and the first row of each of its
   expert's blocks writes that block's expert (every block of an expert starts with a real pair: an expert's
   padding is less than one block).
"""

import triton.language as tl


def expert_sort_kernel(
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    group_ends_ptr,
    shift_ptr,
    num_pairs,
    num_experts,
    capacity,
    BLOCK_M: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    FILL: tl.constexpr,
):
    lanes = tl.arange(0, PAIRS_PAD)
    real = lanes < num_pairs
    ids = tl.load(experts_ptr + lanes, mask=real, other=0).to(tl.int32)
    bins = tl.arange(0, EXPERTS_PAD)
    counts = tl.histogram(ids, EXPERTS_PAD) - tl.where(bins == 0, PAIRS_PAD - num_pairs, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    first = tl.cumsum(counts, 0) - counts  # each expert's place among the unpadded sorted pairs
    expert_ok = bins < num_experts
    tl.store(group_ends_ptr + bins, ends.to(tl.int64), mask=expert_ok)
    tl.store(shift_ptr + bins, ends - padded - first, mask=expert_ok)

    for start in range(0, capacity, FILL):
        rows = start + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + rows, tl.full([FILL], 0, tl.int64) + num_pairs, mask=rows < capacity)
        tl.store(block_expert_ptr + rows, tl.full([FILL], -1, tl.int64), mask=rows < capacity // BLOCK_M)
    tl.debug_barrier()

    # padding lanes take the expert past every real one, so the real pairs fill the first num_pairs places
    keys = tl.sort(tl.where(real, ids, EXPERTS_PAD) * PAIRS_PAD + lanes)
    expert = keys // PAIRS_PAD
    row = lanes + tl.load(shift_ptr + expert, mask=real, other=0)
    tl.store(sorted_pairs_ptr + row, (keys % PAIRS_PAD).to(tl.int64), mask=real)
    tl.store(block_expert_ptr + row // BLOCK_M, expert.to(tl.int64), mask=real & (row % BLOCK_M == 0))
